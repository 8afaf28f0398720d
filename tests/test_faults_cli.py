"""Faults against the command line (issue 22): every bad option is refused before any process or
run directory exists, with one line that names the option and exit code 2; ``sample`` streams and
checks its device; ``data`` runs the pipeline; ``--help`` does not import torch; a rank that stops
answering is named."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import gptlab.training.config
import gptlab.training.train
from gptlab.tokenizers.bpe import ByteBPETokenizer
from gptlab.cli import TextStream, main
from gptlab.training.data import embedded_corpus
from test_train import _cli_args

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=4, eval_iters=1,
            eval_interval=100, quiet=True)
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")


@pytest.fixture
def no_launch(monkeypatch):
    """Starting the ranks fails the test: a refusal must come before it."""
    def launch(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(gptlab.training.train, "launch", launch)


def refusal(argv: list[str], capsys) -> str:
    """The one line ``main(argv)`` prints as it refuses with exit code 2, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


PARALLEL = ["--parallel", "ddp", "--nproc", "2"]


@pytest.mark.parametrize("options, message", [
    pytest.param(["--device", "cuda", *PARALLEL], "--device cuda: torch finds no CUDA GPU",
                 marks=NO_GPU, id="cuda-without-gpu"),
    (["--device", "foo", *PARALLEL], "--device 'foo' is not a torch device"),
    (["--accum-steps", "2", "--parallel", "pipeline", "--nproc", "2"],
     r"accum_steps (--accum-steps) splits the batch of the data-parallel modes"),
    (["--batch-size", "7", *PARALLEL], "--batch-size 7) must split evenly over --nproc 2 ranks"),
    (["--batch-size", "6", "--n-layer", "2", "--parallel", "pipeline", "--nproc", "2"],
     "--parallel pipeline on 2 ranks (--nproc): pipeline parallel splits the batch into 4"),
    (["--n-head", "3", "--n-embd", "12", "--parallel", "tensor", "--nproc", "2"],
     "--parallel tensor on 2 ranks (--nproc): n_head (3) must be divisible"),
    (["--checkpoint-interval", "-1"], "(--checkpoint-interval) must be an integer >= 0, got -1"),
    (["--grad-clip", "-1"], "(--grad-clip) must be a finite number >= 0, got -1.0"),
    (["--eps", "0"], "(--eps) must be a number > 0"),
    (["--seed", "-1"], "(--seed) must be an integer >= 0, got -1"),
    (["--max-iters", "5", "--warmup-iters", "20"], "(--warmup-iters 20) must be below the update "
                                                   "where the cosine ends"),
])  # fmt: skip
def test_bad_train_options_are_refused_before_any_process_starts(options, message, tmp_path,
                                                                 capsys, no_launch):
    out_dir = tmp_path / "run"
    err = refusal(["train", *_cli_args("-", **TINY), "--out-dir", str(out_dir), *options], capsys)
    assert message in err
    assert not out_dir.exists()  # nothing started, nothing written


def test_a_short_run_without_warmup_iters_fits_the_default_warmup(tmp_path, capsys):
    """--max-iters 5 alone: the default warmup (20) is shortened to 4, and the run finishes."""
    out_dir = tmp_path / "run"
    argv = ["train", *_cli_args("-", **TINY), "--max-iters", "5", "--out-dir", str(out_dir),
            "--data", str(_corpus(tmp_path))]
    assert main(argv) == 0, capsys.readouterr().err
    assert "step 5: train loss" in capsys.readouterr().out


def test_tensor_parallel_takes_a_vocabulary_the_ranks_do_not_divide():
    """Vocabulary 103 on 2 ranks passes the start-up check (it is padded; the equality with
    one process is tests/test_parallel_tensor.py's)."""
    settings = {name: value for name, value in TINY.items() if name != "quiet"}
    cfg = gptlab.training.config.TrainConfig(**settings, parallel="tensor", nproc=2)
    gptlab.training.start.check_start(cfg, 2)
    from gptlab.training.parallel.tensor import check_tensor_config

    check_tensor_config(cfg.model_config(vocab_size=103), 2)


# --- sample -------------------------------------------------------------------------------------


def _corpus(tmp_path: Path) -> Path:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(embedded_corpus()[:4_000], encoding="utf-8")
    return corpus


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """A checkpoint of one update of a tiny model."""
    tmp = tmp_path_factory.mktemp("sample")
    out_dir = tmp / "run"
    assert main(["train", *_cli_args("-", **TINY), "--max-iters", "1", "--warmup-iters", "0",
                 "--out-dir", str(out_dir), "--data", str(_corpus(tmp))]) == 0
    return out_dir


def _gptlab(*args) -> subprocess.Popen:
    """``python -m gptlab ARGS`` in a process group of its own (ended by its id)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "gptlab", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)


def test_sample_streams_the_tokens_as_they_come(run_dir):
    """A billion tokens: the first ones reach stdout long before the end (which never comes:
    the process is ended by its pid)."""
    proc = _gptlab("sample", "--checkpoint", str(run_dir), "--max-new-tokens", "1000000000",
                   "--prompt", "x")
    try:
        os.set_blocking(proc.stdout.fileno(), False)
        received, deadline = b"", time.monotonic() + 120
        while len(received) < 20 and time.monotonic() < deadline and proc.poll() is None:
            received += proc.stdout.read() or b""
            time.sleep(0.1)
        assert len(received) >= 20, (received, proc.poll())
        assert received.startswith(b"x") and proc.poll() is None  # still generating
    finally:
        proc.kill()  # by its pid
        proc.communicate(timeout=30)


def test_the_stream_holds_back_a_character_split_over_byte_tokens():
    """Byte-level tokens of "é" (2 bytes) and "€" (3): nothing half-decoded is printed."""
    tokenizer = ByteBPETokenizer.train("héllo €", 257)  # no merges: one token per byte
    out = io.StringIO()
    stream, printed = TextStream(tokenizer, out), []
    for token in tokenizer.encode("héllo €uro"):
        stream(token)
        printed.append(out.getvalue())
    stream.close()
    assert out.getvalue() == "héllo €uro\n"
    assert all("\ufffd" not in text for text in printed)
    assert printed[0] == printed[1] == "h" and printed[2] == "hé"  # é waited for its 2nd byte


@pytest.mark.parametrize("device, message", [
    pytest.param("cuda", "--device cuda: torch finds no CUDA GPU", marks=NO_GPU, id="cuda"),
    ("foo", "--device 'foo' is not a torch device"),
])
def test_sample_refuses_a_device_it_cannot_use(device, message, run_dir, capsys):
    err = refusal(["sample", "--checkpoint", str(run_dir), "--device", device], capsys)
    assert message in err


# --- data ---------------------------------------------------------------------------------------

DOCS = ["the quick brown fox jumps over the lazy dog near the river bank today",
        "a completely different document about tokenizers and their merges",
        "The quick brown fox  jumps over the lazy dog near the river bank today",  # exact copy
        "the quick brown fox jumps over the lazy dog near the river bank tonight"]  # near


def test_data_filters_and_deduplicates_files(tmp_path, capsys):
    first, second, out = tmp_path / "a.txt", tmp_path / "b.txt", tmp_path / "out.txt"
    first.write_text("\n\n\n".join(DOCS[:2]), encoding="utf-8")
    second.write_text("\n\n\n".join(DOCS[2:]), encoding="utf-8")
    assert main(["data", str(first), str(second), "--out", str(out), "--quiet",
                 "--threshold", "0.3"]) == 0
    assert out.read_text(encoding="utf-8").split("\n\n\n") == DOCS[:2]
    report = capsys.readouterr().out
    assert "4 documents read from 2 files" in report and "1 exact and 1 near-duplicates" in report
    exact_only = tmp_path / "exact.txt"
    assert main(["data", str(first), str(second), "--out", str(exact_only), "--quiet",
                 "--no-dedup"]) == 0  # exact deduplication only: the near-duplicate stays
    assert exact_only.read_text(encoding="utf-8").split("\n\n\n") == [DOCS[0], DOCS[1], DOCS[3]]


@pytest.mark.parametrize("options, message", [
    (["missing.txt"], "no such input file: missing.txt"),
    (["a.txt", "--bands", "64"], "bands * rows = 64 * 4 = 256 exceeds"),
    (["a.txt", "--out", "a.txt"], "is one of the input files"),
    (["a.txt", "--out", "no/such/folder/out.txt"], "expected a file in an existing folder"),
])
def test_data_refuses_bad_options_before_writing(options, message, tmp_path, capsys,
                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("a.txt").write_text(DOCS[0], encoding="utf-8")
    argv = ["data", *options] + ([] if "--out" in options else ["--out", "out.txt"])
    err = refusal(argv, capsys)
    assert message in err and not Path("out.txt").exists()


def test_data_refuses_a_threshold_outside_0_1(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["data", "a.txt", "--out", "b.txt", "--threshold", "0"])
    assert exit_info.value.code == 2
    assert "--threshold: must be in (0, 1], got 0.0" in capsys.readouterr().err


# --- no torch for --help ------------------------------------------------------------------------

PROBE = """import sys
from gptlab.tokenizers.bpe import ByteBPETokenizer
from gptlab.cli import TextStream, main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [["--help"], ["sample", "--help"], ["data", "--help"],
                                  ["sample", "--top-k", "x"], ["nonsense"]],
                         ids=["help", "sample-help", "data-help", "option-error", "no-command"])
def test_help_and_option_errors_do_not_import_torch(argv):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.splitlines()[-1] == "torch imported: False", proc.stdout + proc.stderr
    assert "usage: python -m gptlab" in proc.stdout + proc.stderr


# --- a rank that stops answering ----------------------------------------------------------------


def _spin_rank(folder: str) -> None:
    """A rank of ``launch`` that writes its pid, then all-reduces until the run is stopped."""
    Path(folder, f"rank{torch.distributed.get_rank()}.pid").write_text(str(os.getpid()))
    total = torch.zeros(1)
    while True:
        torch.distributed.all_reduce(total)
        time.sleep(0.01)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


LAUNCH = """import sys
from gptlab.training.parallel.launch import LaunchFailed, launch
from test_faults_cli import _spin_rank
try:
    launch(_spin_rank, 2, sys.argv[1], heartbeat_s=5.0)
except LaunchFailed as err:
    print(err)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs SIGSTOP")
def test_a_rank_that_stops_answering_is_named_and_stops_the_run(tmp_path):
    """Rank 1 SIGSTOPped in the middle of all-reduces: the run stops well within the bound (a
    collective's timeout is 120 s; the heartbeat's here 5 s), and the message names rank 1, not
    the rank that waited."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, str(tmp_path)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pid_files = [tmp_path / f"rank{rank}.pid" for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(f.is_file() and f.read_text() for f in pid_files):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1.0)  # a few heartbeats and all-reduces
        os.kill(int(pid_files[1].read_text()), signal.SIGSTOP)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()  # each by its pid; nothing is left when the run stopped itself
        for f in pid_files:
            if f.is_file() and f.read_text():
                _kill(int(f.read_text()))
    assert "rank 1 of 2 stopped answering: no heartbeat for" in out, out + err[-3000:]
    assert "(noticed by rank 0), so the run was stopped" in out
    assert "Traceback" not in err, err[-3000:]  # the agent's log of the failure stays quiet


# --- a signal stops a run after a step, saved (issue 33) ----------------------------------------

LONG_RUN = ["--max-iters", "1000000", "--warmup-iters", "1", "--eval-interval", "5",
            "--checkpoint-interval", "1000000"]


def _logged_rows(log: Path) -> int:
    return len(log.read_text().splitlines()) - 1 if log.is_file() else 0


def _rank_pids(launcher_pid: int) -> list[int]:
    """The pids of the ranks a launcher started (its children that multiprocessing spawned)."""
    children = Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split()
    return [int(pid) for pid in children
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]


def _stopped_by(number: int, proc: subprocess.Popen, out_dir: Path, to: str = "process") -> str:
    """Wait until the run in ``out_dir`` has logged 3 evaluations, send ``number`` ``to`` the
    "process" ``proc``, its process "group" (as Ctrl-C in a terminal does) or its last "rank";
    (its stderr) once it is gone. Time-bounded; the process group is ended by its id when the
    bound passes."""
    try:
        deadline = time.monotonic() + 120
        while _logged_rows(out_dir / "log.csv") < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        if to == "group":
            os.killpg(proc.pid, number)
        elif to == "rank":
            os.kill(_rank_pids(proc.pid)[-1], number)
        else:
            proc.send_signal(number)
        _, err = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    return err.decode()


def _assert_stopped_and_saved(number: int, proc: subprocess.Popen, err: str,
                              out_dir: Path) -> None:
    """Exit code 128 + number, one line naming the signal and the checkpoint of the last step,
    which loads."""
    from gptlab.training.parallel.checkpoint import load_run

    step = load_run(out_dir, backend="numpy").step
    assert step >= 10  # a checkpoint after the steps logged, far from checkpoint_interval
    name = signal.Signals(number).name
    assert err == (f"stopped by {name}: the checkpoint of step {step} is in {out_dir}; "
                   "continue with --resume\n"), err[-3000:]
    assert proc.returncode == 128 + number


@pytest.mark.parametrize("number", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_finishes_the_step_saves_and_stops_with_one_line(number, tmp_path):
    out_dir = tmp_path / "run"
    proc = _gptlab("train", *_cli_args("-", **TINY), *LONG_RUN, "--data", str(_corpus(tmp_path)),
                   "--out-dir", str(out_dir))
    err = _stopped_by(number, proc, out_dir)
    _assert_stopped_and_saved(number, proc, err, out_dir)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks in /proc")
@pytest.mark.parametrize("number, to", [(signal.SIGINT, "group"), (signal.SIGTERM, "rank")],
                         ids=["ctrl-c", "sigterm-to-a-rank"])
def test_a_signal_stops_a_parallel_run_after_a_step_saved(number, to, tmp_path):
    """SIGINT to the launcher and its ranks (a terminal's Ctrl-C), or SIGTERM to one rank only:
    every rank finishes the same step and writes its shard; the launcher says so in one line."""
    out_dir = tmp_path / "run"
    proc = _gptlab("train", *_cli_args("-", **TINY), *LONG_RUN, "--data", str(_corpus(tmp_path)),
                   "--out-dir", str(out_dir), "--parallel", "ddp", "--nproc", "2")
    err = _stopped_by(number, proc, out_dir, to)
    _assert_stopped_and_saved(number, proc, err, out_dir)
    assert json.loads((out_dir / "state.json").read_text())["index_file"]


# --- a parallel run checks its data and checkpoint before any rank starts (issue 33) ------------


def test_a_parallel_run_refuses_bad_data_before_any_rank_starts(tmp_path, capsys, no_launch):
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"text\x00more")
    for data, message in [(tmp_path / "missing.txt", "cannot read the corpus"),
                          (binary, "looks binary")]:
        err = refusal(["train", *_cli_args("-", **TINY), *PARALLEL, "--data", str(data),
                       "--out-dir", str(tmp_path / "run")], capsys)
        assert message in err and str(data) in err


def test_a_parallel_resume_of_another_model_or_data_is_refused_before_any_rank_starts(
        run_dir, tmp_path, capsys, no_launch):
    """run_dir: 1 update of TINY on _corpus; resumed on 2 ranks with another width, other text."""
    other = tmp_path / "other.txt"
    other.write_text(embedded_corpus()[4_000:8_000], encoding="utf-8")
    resume = ["train", *_cli_args("-", **TINY), *PARALLEL, "--resume", "--max-iters", "2",
              "--out-dir", str(run_dir)]
    err = refusal([*resume, "--n-embd", "32", "--data", str(_corpus(tmp_path))], capsys)
    assert "cannot resume" in err and "its model is" in err
    err = refusal([*resume, "--data", str(other)], capsys)
    assert "cannot resume" in err and "other data than" in err


# --- smaller: /dev/zero, an existing --out, nothing kept, --seed, an empty prompt ---------------


def test_the_corpus_must_be_a_regular_file(tmp_path, capsys):
    err = refusal(["train", *_cli_args("-", **TINY), "--data", "/dev/zero", "--out-dir",
                   str(tmp_path / "run")], capsys)
    assert "the corpus /dev/zero is not a regular file" in err


def test_data_refuses_to_overwrite_an_existing_file(tmp_path, capsys):
    first, out = tmp_path / "a.txt", tmp_path / "out.txt"
    first.write_text(DOCS[0], encoding="utf-8")
    out.write_text("mine", encoding="utf-8")
    err = refusal(["data", str(first), "--out", str(out), "--quiet"], capsys)
    assert f"--out {out} exists" in err and out.read_text(encoding="utf-8") == "mine"


def test_data_with_nothing_kept_is_an_error_and_writes_nothing(tmp_path, capsys):
    empty, out = tmp_path / "empty.txt", tmp_path / "out.txt"
    empty.write_text("\n\n\n", encoding="utf-8")
    err = refusal(["data", str(empty), "--out", str(out), "--quiet"], capsys)
    assert "nothing kept" in err and not out.exists()


@pytest.mark.parametrize("options, message", [
    (["--seed", str(2**64)], f"--seed must be in [0, {2**64 - 1}], got {2**64}"),
    (["--seed", "-1"], "--seed must be in [0,"),
    (["--prompt", ""], "--prompt is empty"),
])
def test_sample_refuses_a_seed_out_of_range_and_an_empty_prompt(options, message, run_dir,
                                                                capsys):
    err = refusal(["sample", "--checkpoint", str(run_dir), "--max-new-tokens", "2", *options],
                  capsys)
    assert message in err
