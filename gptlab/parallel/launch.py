"""Starting the processes of a parallel run, with torch's own launcher (torch.distributed.elastic).

One machine, from Python or the command line (both spawn N workers through elastic_launch):

    results = launch(fn, 4, *args)                # fn(*args) on 4 ranks -> [its result per rank]
    python -m gptlab train --nproc 4 --parallel zero2 ...

or with torchrun, which sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT for every worker:

    torchrun --nproc-per-node 4 -m gptlab train --parallel ddp ...

Several machines: torchrun's rendezvous. Run the same command on every machine, naming one
host:port that all of them reach (any free port of one of the machines):

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
             --rdzv-endpoint node0.example:29500 --rdzv-id run42 -m gptlab train --parallel ddp

The workers of all machines meet there, get ranks 0 .. 15, and open the process group (NCCL on
GPUs, gloo on CPUs). Every rank reads the data and builds the same initial model from the seed.

Faults: the elastic agent watches its workers (every ``monitor_interval`` seconds); when one
dies (an exception, or SIGKILL) it stops the others and ``launch`` raises ``LaunchFailed`` naming
the rank and its error. A rank stuck in a collective whose peer is gone fails after the
process group's ``timeout``. Restarting the command with ``--resume`` continues from the last
complete checkpoint.
"""

from __future__ import annotations

import os
import signal
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

COLLECTIVE_TIMEOUT_S = 120.0  # a collective whose peers are gone fails after this long
# The elastic agent installs its own handlers for these in the calling process; launch() puts
# the caller's back (a Jupyter kernel would otherwise die with SignalException when shut down).
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class LaunchFailed(RuntimeError):
    """A rank of a parallel run failed (or was killed); the run was stopped."""


def under_launcher() -> bool:
    """True inside a worker started by torchrun or ``launch`` (they set WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_process_group(timeout_s: float = COLLECTIVE_TIMEOUT_S, device: str | None = None) -> None:
    """Open the default process group from the launcher's environment: NCCL when ``device`` is
    a CUDA device (each local rank takes its own GPU), gloo otherwise."""
    if dist.is_initialized():
        return
    cuda = device is not None and str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))


@record
def _worker(fn, args, threads: int | None, timeout_s: float, device: str | None):
    """The body of every spawned rank: threads, process group, fn(*args), clean exit."""
    if threads is not None:
        torch.set_num_threads(threads)
    init_process_group(timeout_s, device)
    try:
        return fn(*args)
    finally:
        dist.destroy_process_group()


def launch(fn, nproc: int, *args, threads: int | None = 1, timeout_s: float = COLLECTIVE_TIMEOUT_S,
           monitor_interval: float = 0.1, device: str | None = None) -> list:
    """Run ``fn(*args)`` on ``nproc`` ranks of this machine (127.0.0.1); returns the ranks'
    results in rank order. ``fn`` must be importable (a module-level function); each rank has
    the default process group open (gloo; NCCL with ``device="cuda"``, a GPU per rank) and
    ``threads`` torch threads (1 lets 4 ranks share 2 cores). Raises LaunchFailed (with the
    failing rank's error) when a rank fails or dies."""
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be an integer >= 1, got {nproc!r}")
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                          monitor_interval=monitor_interval, start_method="spawn")
    handlers = {number: signal.getsignal(number) for number in AGENT_SIGNALS}
    try:
        results = elastic_launch(config, _worker)(fn, args, threads, timeout_s, device)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        raise LaunchFailed(f"rank {rank} of {nproc} failed, so the run was stopped: "
                           f"{_describe(failure)}") from err
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    return [results[rank] for rank in range(nproc)]


def _describe(failure) -> str:
    """One line for an elastic ProcessFailure: the signal that killed it, or its error."""
    if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
        return f"killed by {failure.signal_name()} (exit code {failure.exitcode})"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", message)
    return f"exit code {failure.exitcode}: {message}"


__all__ = ["launch", "init_process_group", "under_launcher", "LaunchFailed",
           "COLLECTIVE_TIMEOUT_S"]
