"""Launching parallel runs: the command line on 2 processes, sharded checkpoints that resume at
another world size and in another mode, a rank killed by SIGKILL, ranks started with different
configurations. Every process listens on 127.0.0.1 and every wait has a time bound."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gptlab.config import GPTConfig
from gptlab.model import init_params
from gptlab.training.optim import AdamW
from gptlab.training.parallel import mode_class
from gptlab.training.parallel.base import Single
from gptlab.training.parallel.checkpoint import read_sharded, save_sharded, shard_optimizer_state
from gptlab.training.parallel.launch import LaunchFailed, launch
from gptlab.tokenizers.char import CharTokenizer
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=4, lr_schedule="constant",
            eval_iters=1, eval_interval=2, checkpoint_interval=2, dtype="float64")


def cli(out_dir, *options, timeout=240):
    """``python -m gptlab train`` with TINY and ``options`` in a subprocess (time-bounded)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "gptlab", "train", *args, "--quiet",
                             f"--out-dir={out_dir}", *options], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finished(proc, timeout=240):
    """(return code, stdout, stderr) of a process, killed if it runs past ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the run did not finish within {timeout} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def final_weights(out_dir) -> dict:
    """The weights of a run directory's last checkpoint, whole, as NumPy."""
    from gptlab.training.parallel.checkpoint import load_run

    return {n: t.numpy() for n, t in load_run(out_dir, dtype="float64").params.items()}


def test_cli_two_ranks_then_resume_at_another_world_size_and_mode(tmp_path):
    """zero3 on 2 ranks for 4 updates (command line), then ddp on 1 rank continues to 6 from
    the sharded checkpoint: the weights equal 6 updates of one process."""
    code, out, err = finished(cli(tmp_path / "run", "--nproc=2", "--parallel=zero3",
                                  "--max-iters=4"))
    assert code == 0, err[-3000:]
    assert "step 4: train loss" in out
    names = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert names == ["index-00000004.json", "log.csv", "shard-00000004-0-of-2.safetensors",
                     "shard-00000004-1-of-2.safetensors", "state.json", "tokenizer.json"]
    assert len((tmp_path / "run" / "log.csv").read_text().splitlines()) == 1 + 3  # rank 0 alone
    settings = {**TINY, "out_dir": str(tmp_path / "run"), "max_iters": 6}
    train(TrainConfig(**settings, resume=True, parallel="ddp", nproc=1), progress=False)
    one = train(TrainConfig(**{**settings, "out_dir": str(tmp_path / "one")}), progress=False)
    resumed = final_weights(tmp_path / "run")
    for name, value in one.params.items():
        np.testing.assert_allclose(resumed[name], value.numpy(), rtol=0, atol=1e-12,
                                   err_msg=name)


def _children(pid: int) -> list[int]:
    """The ids of a process's child processes (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def _worker_pids(launcher_pid: int) -> list[int]:
    """The ranks' processes: the launcher's children that multiprocessing spawned (not its
    resource tracker)."""
    pids = []
    for pid in _children(launcher_pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in command and b"resource_tracker" not in command:
            pids.append(pid)
    return pids


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
def test_a_killed_rank_stops_the_run_and_the_restart_resumes(tmp_path):
    run = tmp_path / "run"
    proc = cli(run, "--nproc=2", "--parallel=ddp", "--max-iters=100000")
    deadline = time.monotonic() + 180
    while not (run / "state.json").is_file():  # the first complete checkpoint
        assert proc.poll() is None and time.monotonic() < deadline, "the run never checkpointed"
        time.sleep(0.2)
    workers = _worker_pids(proc.pid)
    assert len(workers) == 2
    os.kill(max(workers), signal.SIGKILL)
    killed_at = time.monotonic()
    code, _, err = finished(proc, timeout=60)
    stopped_after = time.monotonic() - killed_at
    assert code == 1
    assert re.search("rank [01] of 2 failed, so the run was stopped: killed by SIGKILL", err)
    print(f"the run stopped {stopped_after:.1f} s after the SIGKILL")  # shown with -s
    step = json.loads((run / "state.json").read_text())["step"]
    assert step >= 2 and step % 2 == 0
    code, out, err = finished(cli(run, "--nproc=2", "--parallel=ddp", f"--max-iters={step + 2}",
                                  "--resume"))
    assert code == 0, err[-3000:]
    assert f"step {step + 2}: train loss" in out
    steps = [int(line.split(",")[0]) for line in (run / "log.csv").read_text().splitlines()[1:]]
    assert steps == list(range(0, step + 3, 2))  # the log continues from the checkpoint


def _mismatched():
    """Rank 1 builds a wider model than rank 0."""
    rank = torch.distributed.get_rank()
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8 * (1 + rank), vocab_size=11, block_size=4)
    mode_class("ddp")(cfg, init_params(cfg, backend="torch"))


def test_ranks_with_different_configurations_are_a_clear_error():
    with pytest.raises(LaunchFailed, match="ranks \\[1\\] were started with another "
                                           "configuration than rank 0"):
        launch(_mismatched, 2, timeout_s=30)


def _rank_1_sleeps():
    """Rank 1 never finishes: it sleeps, and rank 0 waits for it in a collective."""
    if torch.distributed.get_rank() == 1:
        time.sleep(600)
    torch.distributed.barrier()


def test_a_run_past_its_wall_clock_bound_is_stopped():
    # the message is the bound's, not the heartbeat's or the collective timeout's (both 300 s)
    with pytest.raises(LaunchFailed, match="the run took longer than its bound of 8 s, so the "
                                           "run was stopped"):
        launch(_rank_1_sleeps, 2, deadline_s=8, timeout_s=300, heartbeat_s=300)
    with pytest.raises(ValueError, match="deadline_s must be a number of seconds > 0, got 0"):
        launch(_rank_1_sleeps, 2, deadline_s=0)


def test_sharded_checkpoint_round_trip_and_missing_shard(tmp_path):
    """One process writes the sharded format (world size 1); the rows read back are the
    tensors written, the optimizer's moments cut to a mode's layout too; a lost shard is named."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4)
    mode = Single(cfg, init_params(cfg, backend="torch", dtype="float64"))
    optimizer = AdamW(mode.params)
    idx = torch.arange(8).reshape(2, 4) % 11
    _, grads = mode.loss_and_grads(idx, idx)
    mode.params = optimizer.step(mode.params, grads)
    path = save_sharded(tmp_path, step=3, mode=mode, optimizer=optimizer,
                        tokenizer=CharTokenizer.from_text("abcdefghijk"), model_config=cfg)
    state = json.loads(path.read_text())
    params, moments = read_sharded(tmp_path, state)
    for name, value in mode.params.items():
        assert np.array_equal(params[name], value.numpy())
    restored = shard_optimizer_state(mode, {"kind": "adamw", "step": 1, "state": moments})
    for key, value in optimizer.state.items():
        assert torch.equal(restored["state"][key], value)
    (tmp_path / "shard-00000003-0-of-1.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00000003-0-of-1.safetensors"):
        read_sharded(tmp_path, state)


@pytest.mark.parametrize("values, message", [
    (dict(parallel="ddp", backend="numpy"), "parallel='ddp' runs the hand-written backward on "
                                            "torch tensors"),
    (dict(nproc=2), "nproc > 1 and accum_steps > 1 need a parallel mode"),
    (dict(parallel="fsdp"), "TrainConfig.parallel must be one of"),
    (dict(parallel="ddp", accum_steps=0), "TrainConfig.accum_steps must be >= 1"),
])
def test_bad_parallel_settings_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)
