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
