"""Faults injected against ``python -m gptlab train`` / ``sample``, as a tester would: a run
never destroys or silently corrupts what another run saved.

Each case asserts the clear error (one line naming the file or the holder, exit code 2, no
traceback) and that the checkpoint on disk still loads afterwards. The command line runs in
this process (``gptlab.cli.main``) except where a second process is the fault: a run that
holds the directory, a run killed by SIGKILL (each with a time bound, ended by its pid).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from test_checkpoint import killed_at_state_json

import gptlab.training.checkpoint as ckpt_module
from gptlab.training.checkpoint import STATE_FILE
from gptlab.cli import main
from gptlab.training.data import embedded_corpus
from gptlab.training.log import read_log
from gptlab.training.parallel.checkpoint import load_run
from gptlab.tokenizers.char import CharTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--n-layer=1", "--n-head=2", "--n-embd=16", "--block-size=8", "--batch-size=4",
        "--max-iters=4", "--warmup-iters=1", "--eval-interval=2", "--eval-iters=1", "--quiet"]
TIME_BOUND_S = 120


def gptlab(capsys, *args) -> tuple[int, str]:
    """(exit code, stderr) of ``python -m gptlab ARGS``, run in this process."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def assert_clear_error(code: int, err: str, *names: str) -> None:
    """Exit code 2 and one 'error: ...' line that names each of ``names``."""
    assert code == 2, err
    assert "Traceback" not in err and err.startswith("error: ") and err.count("\n") == 1, err
    for name in names:
        assert name in err, err


def weights(run_dir) -> dict:
    return {name: np.asarray(x) for name, x in load_run(run_dir, backend="numpy").params.items()}


def assert_loads_as(run_dir, saved: dict) -> None:
    """The checkpoint in ``run_dir`` loads (every check passes) and holds ``saved``."""
    loaded = weights(run_dir)
    assert loaded.keys() == saved.keys()
    for name in saved:
        np.testing.assert_array_equal(loaded[name], saved[name], err_msg=name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> list[str]:
    """The options of a tiny run on 20,000 characters of the embedded corpus, with an even
    number of distinct characters: 2 ranks then hold equal shards of every tensor, so that
    two shards swapped between ranks fit each other's place (as in the tester's run)."""
    text = embedded_corpus()[:20_000]
    if len(set(text)) % 2:
        text += next(ch for ch in "~^|@#" if ch not in text)
    corpus = tmp_path_factory.mktemp("data") / "corpus.txt"
    corpus.write_text(text, encoding="utf-8")
    return [*TINY, f"--data={corpus}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny):
    """Two run directories of 4 updates: one process, and data parallel on 2 ranks (sharded)."""
    base = tmp_path_factory.mktemp("runs")
    assert main(["train", *tiny, f"--out-dir={base / 'one'}"]) == 0
    assert main(["train", *tiny, f"--out-dir={base / 'sharded'}", "--parallel=ddp",
                 "--nproc=2"]) == 0
    return base


@pytest.fixture
def one(runs, tmp_path) -> Path:
    return Path(shutil.copytree(runs / "one", tmp_path / "one"))


@pytest.fixture
def sharded(runs, tmp_path) -> Path:
    return Path(shutil.copytree(runs / "sharded", tmp_path / "sharded"))


def start_run(tiny, out_dir, *options) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "gptlab", "train", *tiny,
                             f"--out-dir={out_dir}", *options], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_for(condition, proc: subprocess.Popen, what: str) -> None:
    """Poll ``condition()`` until it holds; fail (killing ``proc``) after the time bound."""
    deadline = time.monotonic() + TIME_BOUND_S
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            os.kill(proc.pid, signal.SIGKILL)
            pytest.fail(f"{what} did not happen: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=TIME_BOUND_S)


def saved_step(run_dir) -> int | None:
    try:
        return json.loads((run_dir / STATE_FILE).read_text())["step"]
    except (FileNotFoundError, ValueError, KeyError):
        return None


# ------------------------------------------------------------------------------------------------
# A fresh run pointed at an existing run


def test_fresh_run_refuses_a_directory_that_holds_a_run(tiny, one, capsys):
    state, saved = (one / STATE_FILE).read_bytes(), weights(one)
    assert_clear_error(*gptlab(capsys, "train", *tiny, f"--out-dir={one}"),
                       str(one), "already holds a run", "--resume", "--overwrite")
    assert (one / STATE_FILE).read_bytes() == state
    assert_loads_as(one, saved)
    assert_clear_error(*gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--resume",
                               "--overwrite"), "choose one")


def test_overwrite_keeps_the_old_checkpoint_until_the_new_one_is_complete(tiny, one, capsys,
                                                                          monkeypatch):
    """A new run (another seed) over a run of the same step, killed as it writes state.json:
    the old checkpoint loads, whole. Finished, the new one replaces it and nothing else stays."""
    saved = weights(one)
    with killed_at_state_json(monkeypatch):
        main(["train", *tiny, f"--out-dir={one}", "--overwrite", "--seed=3"])
    assert_loads_as(one, saved)
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--overwrite", "--seed=3")
    assert code == 0, err
    new = weights(one)
    assert not np.array_equal(new["wte.weight"], saved["wte.weight"])
    assert_holds_only_its_checkpoint(one)


def assert_holds_only_its_checkpoint(run_dir: Path) -> None:
    """The run directory holds the log, state.json and the files it names, nothing else."""
    state = json.loads((run_dir / STATE_FILE).read_text())
    assert sorted(p.name for p in run_dir.iterdir()) == sorted(
        ["log.csv", STATE_FILE, state["model_file"], state["optimizer_file"], "tokenizer.json"])


# ------------------------------------------------------------------------------------------------
# Two runs at once, a run killed by SIGKILL, a stale lock


def test_second_run_is_refused_naming_the_holder_then_sigkill_leaves_a_loadable_run(
        tiny, tmp_path, capsys):
    out_dir = tmp_path / "run"
    holder = start_run(tiny, out_dir, "--max-iters=100000", "--checkpoint-interval=1",
                       "--eval-interval=100000")
    try:
        wait_for(lambda: (saved_step(out_dir) or 0) >= 2, holder, "a checkpoint of step 2")
        for extra in ([], ["--resume"], ["--overwrite"]):
            assert_clear_error(*gptlab(capsys, "train", *tiny, f"--out-dir={out_dir}", *extra),
                               f"pid {holder.pid}", "in use")
        assert holder.poll() is None  # the holder was left alone
    finally:
        kill(holder)
    assert (out_dir / ckpt_module.LOCK_FILE).read_text().strip() == str(holder.pid)  # a stale lock
    step = saved_step(out_dir)
    load_run(out_dir)  # every file of the last complete checkpoint verifies
    assert_clear_error(*gptlab(capsys, "train", *tiny, f"--out-dir={out_dir}"),
                       "already holds a run")
    assert saved_step(out_dir) == step
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={out_dir}", "--resume",
                       f"--max-iters={step + 1}", "--checkpoint-interval=1",
                       "--eval-interval=100000")
    assert code == 0, err
    assert saved_step(out_dir) == step + 1
    assert not (out_dir / ckpt_module.LOCK_FILE).exists() and not list(out_dir.glob(".*.tmp-*"))


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=TIME_BOUND_S)
    (tmp_path / ckpt_module.LOCK_FILE).write_text(dead.stdout)
    with ckpt_module.claim_run_dir(tmp_path):
        assert (tmp_path / ckpt_module.LOCK_FILE).read_text().strip() == str(os.getpid())
    assert not (tmp_path / ckpt_module.LOCK_FILE).exists()


# ------------------------------------------------------------------------------------------------
# Damaged or swapped files


def test_shards_swapped_between_ranks_are_refused(tiny, sharded, capsys):
    saved = weights(sharded)
    first, second = (sharded / f"shard-00000004-{r}-of-2.safetensors" for r in (0, 1))
    first.rename(sharded / "swap")
    second.rename(first)
    (sharded / "swap").rename(second)
    for command in (["sample", f"--checkpoint={sharded}", "--max-new-tokens=3"],
                    ["train", *tiny, f"--out-dir={sharded}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), first.name, "rank 0")
    second.rename(sharded / "swap")
    first.rename(second)
    (sharded / "swap").rename(first)
    assert_loads_as(sharded, saved)


@pytest.mark.parametrize("run, file", [("one", "model-00000004.safetensors"),
                                       ("sharded", "shard-00000004-1-of-2.safetensors")])
def test_zero_bytes_in_tensor_data_are_refused(tiny, run, file, request, capsys):
    run_dir = request.getfixturevalue(run)
    saved, path = weights(run_dir), run_dir / file
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little") + 64  # past the header, in the tensors
    assert len(data) > start + 4000 and any(data[start:start + 4000])
    path.write_bytes(data[:start] + bytes(4000) + data[start + 4000:])
    for command in (["sample", f"--checkpoint={run_dir}", "--max-new-tokens=3"],
                    ["train", *tiny, f"--out-dir={run_dir}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), file, "sha256")
    path.write_bytes(data)
    assert_loads_as(run_dir, saved)


def foreign_tokenizer(run_dir) -> CharTokenizer:
    """The run's characters with two of them replaced: the same vocabulary size, other text."""
    chars = list(load_tokenizer(run_dir / "tokenizer.json").chars)
    chars[-2:] = [c for c in "\u00e9\u00df" if c not in chars][:2]
    return CharTokenizer(sorted(chars))


def test_a_tokenizer_of_another_corpus_is_refused(tiny, one, tmp_path, capsys):
    saved, own = weights(one), (one / "tokenizer.json").read_bytes()
    foreign = foreign_tokenizer(one)
    foreign.save(tmp_path / "foreign.json")
    assert_clear_error(*gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--resume",
                               "--max-iters=5", f"--tokenizer-path={tmp_path / 'foreign.json'}"),
                       "foreign.json", "tokenizer")
    foreign.save(one / "tokenizer.json")
    for command in (["sample", f"--checkpoint={one}", "--max-new-tokens=3"],
                    ["train", *tiny, f"--out-dir={one}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), "tokenizer.json",
                           "not the tokenizer this checkpoint was trained with")
    (one / "tokenizer.json").write_bytes(own)
    assert_loads_as(one, saved)
    (tmp_path / "own.json").write_bytes(own)  # its own tokenizer, named again: accepted
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--resume", "--max-iters=5",
                       f"--tokenizer-path={tmp_path / 'own.json'}")
    assert code == 0, err


def _edit_json(path: Path, edit) -> None:
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _rehash(run_dir: Path, name: str) -> None:
    """Record the new sha256 of ``name`` in state.json: the damage of a writer, not of the disk."""
    _edit_json(run_dir / STATE_FILE, lambda s: {**s, "sha256": {
        **s["sha256"], name: ckpt_module.sha256_of((run_dir / name).read_bytes())}})


def _drop_moment(index: dict) -> dict:
    del index["tensors"]["optimizer/m.wte.weight"]
    return index


INDEX = "index-00000004.json"
CORRUPT = {  # (run, file, damage(run_dir), commands that must refuse)
    "index garbled": ("sharded", INDEX, lambda d: (d / INDEX).write_bytes(b'{"tensors": [1,'),
                      "both"),
    "index zero bytes": ("sharded", INDEX, lambda d: (d / INDEX).write_bytes(b""), "both"),
    "index {}": ("sharded", INDEX, lambda d: (d / INDEX).write_text("{}"), "both"),
    "index {} rehashed": ("sharded", INDEX,
                          lambda d: ((d / INDEX).write_text("{}"), _rehash(d, INDEX)), "both"),
    "index missing a moment": ("sharded", INDEX, lambda d: _edit_json(d / INDEX, _drop_moment),
                               "both"),
    "index missing a moment rehashed": ("sharded", INDEX, lambda d: (
        _edit_json(d / INDEX, _drop_moment), _rehash(d, INDEX)), "both"),
    "state without history": ("one", STATE_FILE, lambda d: _edit_json(
        d / STATE_FILE, lambda s: {k: v for k, v in s.items() if k != "history"}), "resume"),
    "state without model_config": ("sharded", STATE_FILE, lambda d: _edit_json(
        d / STATE_FILE, lambda s: {k: v for k, v in s.items() if k != "model_config"}), "both"),
    "state with a bad model_config": ("one", STATE_FILE, lambda d: _edit_json(
        d / STATE_FILE, lambda s: {**s, "model_config": {"n_layers": 1}}), "both"),
    "state with step a string": ("one", STATE_FILE, lambda d: _edit_json(
        d / STATE_FILE, lambda s: {**s, "step": "4"}), "both"),
}


@pytest.mark.parametrize("run, file, damage, refusing", CORRUPT.values(), ids=CORRUPT.keys())
def test_corrupt_metadata_gives_a_clear_error_naming_the_file(tiny, run, file, damage, refusing,
                                                              request, capsys):
    run_dir = request.getfixturevalue(run)
    saved = weights(run_dir)
    originals = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    damage(run_dir)
    commands = [["train", *tiny, f"--out-dir={run_dir}", "--resume", "--max-iters=5"]]
    if refusing == "both":
        commands.append(["sample", f"--checkpoint={run_dir}", "--max-new-tokens=3"])
    for command in commands:
        assert_clear_error(*gptlab(capsys, *command), str(run_dir / file))
    for name, data in originals.items():
        (run_dir / name).write_bytes(data)
    assert_loads_as(run_dir, saved)


# ------------------------------------------------------------------------------------------------
# Resuming: on one process after a sharded run; with changed settings


def test_resume_on_one_process_removes_old_shards_only_once_complete(tiny, sharded, capsys,
                                                                     monkeypatch):
    saved, before = weights(sharded), sorted(p.name for p in sharded.iterdir())
    with killed_at_state_json(monkeypatch):
        main(["train", *tiny, f"--out-dir={sharded}", "--resume", "--max-iters=5"])
    assert set(before) <= {p.name for p in sharded.iterdir()}
    assert_loads_as(sharded, saved)
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={sharded}", "--resume",
                       "--max-iters=5")
    assert code == 0, err
    assert_holds_only_its_checkpoint(sharded)


def test_resume_with_changed_settings_says_what_changed(tiny, one, capsys):
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--resume", "--max-iters=5",
                       "--seed=7", "--batch-size=2", "--lr=0.01")
    assert code == 0, err
    assert "changed settings" in err
    for change in ("seed 1337 -> 7", "batch_size 4 -> 2", "lr 0.003 -> 0.01"):
        assert change in err, err
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={one}", "--resume", "--max-iters=6",
                       "--seed=7", "--batch-size=2", "--lr=0.01")
    assert code == 0 and "changed settings" not in err, err  # the run now is what it says


# ------------------------------------------------------------------------------------------------
# The user's files, a folder of no run, a schedule extended, checksums off, escaping names,
# non-finite weights, a tokenizer of the wrong size (issue 33)

USER_FILES = {"model-best.safetensors": b"best", "tokenizer-2.json": b"{}",
              "model-00001-of-00002.safetensors": b"hf 1", "model-00002-of-00002.safetensors":
              b"hf 2", "index-notes.json": b"[]"}


@pytest.mark.parametrize("how", [["--resume", "--max-iters=6"], ["--overwrite", "--seed=3"]])
def test_a_run_keeps_the_users_files_whatever_their_names(tiny, one, how, capsys):
    for name, data in USER_FILES.items():
        (one / name).write_bytes(data)
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={one}", *how, "--checkpoint-interval=1")
    assert code == 0, err
    for name, data in USER_FILES.items():
        assert (one / name).read_bytes() == data, name
    state = json.loads((one / STATE_FILE).read_text())
    assert sorted(p.name for p in one.iterdir()) == sorted(
        [*USER_FILES, "log.csv", STATE_FILE, state["model_file"], state["optimizer_file"],
         state["tokenizer_file"]])


def test_a_folder_that_holds_no_run_is_refused_saying_what_it_holds(tiny, tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    code, err = gptlab(capsys, "train", *tiny, f"--out-dir={tmp_path}")
    assert_clear_error(code, err, str(tmp_path), "holds files of no run (notes.txt; no state.json)",
                       "--overwrite")
    assert "already holds a run" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def logged_lr(run_dir) -> dict[int, float]:
    return {row["step"]: row["lr"] for row in read_log(run_dir / "log.csv")}


def test_extending_a_finished_run_continues_its_schedule(tiny, tmp_path, capsys):
    """8 updates, then --max-iters 16: the cosine ended at step 8 stays ended (min_lr), and the
    resumed run says which option would move its end."""
    run = [*tiny, f"--out-dir={tmp_path / 'run'}", "--warmup-iters=2"]
    assert gptlab(capsys, "train", *run, "--max-iters=8")[0] == 0
    before = logged_lr(tmp_path / "run")
    code, err = gptlab(capsys, "train", *run, "--resume", "--max-iters=16")
    assert code == 0, err
    assert "cosine schedule goes on as it started, at min_lr 0.0003 from step 8" in err
    assert "--lr-decay-iters" in err and "changed settings" not in err
    after = logged_lr(tmp_path / "run")
    assert {step: after[step] for step in before} == before
    assert [after[step] for step in (10, 12, 14, 16)] == [3e-4] * 4
    code, err = gptlab(capsys, "train", *run, "--resume", "--max-iters=20",
                       "--lr-decay-iters=20")  # a new end, asked for: said
    assert code == 0 and "changed settings: lr_decay_iters 8 -> 20" in err, err


def test_resuming_a_short_run_keeps_its_warmup(tiny, tmp_path, capsys):
    """Without --warmup-iters, a 10-update run warms up for 9; resumed to 30, it still does."""
    run = [option for option in tiny if not option.startswith("--warmup-iters")]
    run += [f"--out-dir={tmp_path / 'run'}", "--max-iters=10"]
    assert gptlab(capsys, "train", *run)[0] == 0
    code, err = gptlab(capsys, "train", *run, "--resume", "--max-iters=30")
    assert code == 0 and "warmup_iters" not in err, err
    assert json.loads((tmp_path / "run" / STATE_FILE).read_text())[
        "train_config"]["warmup_iters"] == 9


def _nan_at_the_end(run_dir: Path, file: str) -> None:
    """The last float32 of ``file``'s tensor data made NaN, its sha256 recorded again."""
    path = run_dir / file
    data = path.read_bytes()
    path.write_bytes(data[:-4] + np.float32(np.nan).tobytes())
    recorded_in = run_dir / (INDEX if file.startswith("shard") else STATE_FILE)
    if file.startswith("shard"):
        _edit_json(recorded_in, lambda index: {**index, "shards": [
            {**shard, "sha256": ckpt_module.sha256_of(path.read_bytes())}
            if shard["file"] == file else shard for shard in index["shards"]]})
        file = INDEX
    _rehash(run_dir, file)


SAMPLE = ["--max-new-tokens=3", "--prompt=a"]


@pytest.mark.parametrize("run, file", [("one", "model-00000004.safetensors"),
                                       ("sharded", "shard-00000004-1-of-2.safetensors")])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(tiny, run, file, request,
                                                                  capsys):
    run_dir = request.getfixturevalue(run)
    _nan_at_the_end(run_dir, file)
    for command in (["sample", f"--checkpoint={run_dir}", *SAMPLE],
                    ["sample", f"--checkpoint={run_dir}", *SAMPLE, "--backend=numpy"],
                    ["train", *tiny, f"--out-dir={run_dir}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), file, "the tensor ", "holds 1 NaN")


def test_a_state_file_that_says_version_1_turns_no_checksum_off(tiny, one, capsys):
    path = one / "model-00000004.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-4000] + bytes(4000))
    _edit_json(one / STATE_FILE, lambda state: {**state, "format_version": 1})
    for command in (["sample", f"--checkpoint={one}", *SAMPLE],
                    ["train", *tiny, f"--out-dir={one}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), str(one / STATE_FILE), "format version 1")


def test_an_index_that_names_a_shard_outside_the_run_is_refused(tiny, sharded, tmp_path, capsys):
    """The shard moved out and the index (and its sha256) edited to follow it."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shard = "shard-00000004-1-of-2.safetensors"
    (sharded / shard).rename(outside / shard)
    moved = f"../elsewhere/{shard}"
    _edit_json(sharded / INDEX, lambda index: json.loads(json.dumps(index).replace(shard, moved)))
    _rehash(sharded, INDEX)
    for command in (["sample", f"--checkpoint={sharded}", *SAMPLE],
                    ["train", *tiny, f"--out-dir={sharded}", "--resume", "--max-iters=5"]):
        assert_clear_error(*gptlab(capsys, *command), INDEX, repr(moved), "not a file of")


def test_a_tokenizer_with_fewer_ids_than_the_model_is_refused_before_any_text(one, capsys):
    chars = load_tokenizer(one / "tokenizer.json").chars
    CharTokenizer(chars[:-3]).save(one / "tokenizer.json")
    _rehash(one, "tokenizer.json")
    code, err = gptlab(capsys, "sample", f"--checkpoint={one}", *SAMPLE)
    assert_clear_error(code, err, "tokenizer.json", f"{len(chars) - 3} ids, the model "
                                                    f"{len(chars)}")
    assert capsys.readouterr().out == ""
