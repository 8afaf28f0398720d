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
the rank and its error. A rank that hangs (stopped, deadlocked, its machine frozen) does not die,
so every rank also beats a heartbeat in the launcher's store (``Heartbeat``, once a second):
when a peer's beat stands still for ``HEARTBEAT_TIMEOUT_S``, the rank that notices stops the
run with ``RankStopped`` naming the silent rank, long before a collective's ``timeout``.
Restarting the command with ``--resume`` continues from the last complete checkpoint. A wall-clock
bound for a whole run: ``launch(..., deadline_s=S)``; at S seconds every rank still running
reports ``OutOfTime`` and exits, and ``launch`` raises ``LaunchFailed`` (the tests bound every
multi-process run this way).
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    get_error_handler,
    record,
)
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

COLLECTIVE_TIMEOUT_S = 120.0  # a collective whose peers are gone fails after this long
HEARTBEAT_INTERVAL_S = 1.0  # every rank beats this often
HEARTBEAT_TIMEOUT_S = 30.0  # a peer whose beat stands still this long has stopped answering
# (long enough for a rank busy in code that holds the GIL, a regex over a big corpus, say)
_heartbeat = None  # this process's Heartbeat, once it is a rank of a launched run
# The elastic agent installs its own handlers for these in the calling process; launch() puts
# the caller's back (a Jupyter kernel would otherwise die with SignalException when shut down).
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# The agent passes such a signal on to the ranks, and kills those still running after this long:
# time for a rank that catches it (training does) to finish its step and save.
SHUTDOWN_TIMEOUT_S = 120
# The loggers whose lines (a failed rank's traceback, "Terminating process") would come before
# the one line that LaunchFailed says: quiet while launch runs.
AGENT_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


# A process that waits (at most KILL_AFTER_S) until the process ``argv[1]`` is gone (reaped by
# the agent, so its failure is on record), then SIGKILLs ``argv[2]``: a stopped process ignores
# SIGTERM.
KILL_AFTER_S = 60.0
KILL_AFTER = f"""import os, signal, sys, time
first, then = int(sys.argv[1]), int(sys.argv[2])
end = time.monotonic() + {KILL_AFTER_S}
while time.monotonic() < end:
    try:
        os.kill(first, 0)
    except ProcessLookupError:
        break
    time.sleep(0.05)
try:
    os.kill(then, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class LaunchFailed(RuntimeError):
    """A rank of a parallel run failed (or was killed); the run was stopped."""


class RunInterrupted(KeyboardInterrupt):
    """A signal (SIGINT, SIGTERM, ...) stopped the run; ``exit_code`` is the shell's 128 + its
    number."""

    def __init__(self, signal_number: int, message: str):
        super().__init__(message)
        self.signal_number, self.exit_code = signal_number, 128 + signal_number


class RankInterrupted(RuntimeError):
    """A rank's RunInterrupted as the error the agent records ("<signal number> <message>"): a
    KeyboardInterrupt would end the rank without a word, and launch would lack its result."""


class RankStopped(RuntimeError):
    """A rank of a parallel run stopped answering: its heartbeat stood still."""


class OutOfTime(RuntimeError):
    """A parallel run took longer than its wall-clock bound (``launch(..., deadline_s=...)``)."""


class Heartbeat:
    """A thread of every rank that counts up ``beat/<rank>`` in the launcher's store every
    ``interval`` seconds and watches the other ranks' counts. When a peer's count has not moved
    for ``timeout`` seconds (and the peer has not finished), this rank writes RankStopped naming
    it as its error (what ``launch`` reports) and exits, so the agent stops the run; a silent
    peer on this machine is ended (SIGKILL by its pid: a stopped process ignores SIGTERM) right
    after this rank is gone, so that the agent sees this rank's failure first. The store is the elastic agent's (torchrun's, ``launch``'s): it outlives every rank."""

    def __init__(self, rank: int, world_size: int, interval: float = HEARTBEAT_INTERVAL_S,
                 timeout: float = HEARTBEAT_TIMEOUT_S):  # fmt: skip
        self.rank, self.world_size = rank, world_size
        self.interval, self.timeout = interval, timeout
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=timeout))
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.store = dist.PrefixStore(f"gptlab-heartbeat/{run}/", store)
        self.store.set(f"pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
        self.store.add(f"beat/{rank}", 1)
        self.finished = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="gptlab-heartbeat", daemon=True)
        self.thread.start()

    def _watch(self) -> None:
        peers = [r for r in range(self.world_size) if r != self.rank]
        last = {peer: (None, time.monotonic()) for peer in peers}  # (count, when it last moved)
        while not self.finished.wait(self.interval):
            try:
                self.store.add(f"beat/{self.rank}", 1)
                now = time.monotonic()
                for peer in peers:
                    count = self.store.add(f"beat/{peer}", 0)  # adding 0 reads the counter
                    if count != last[peer][0]:
                        last[peer] = (count, now)
                silent = [peer for peer in peers if now - last[peer][1] > self.timeout
                          and not self.store.check([f"done/{peer}"])]  # fmt: skip
            except (RuntimeError, OSError):  # the store is gone: the run is ending anyway
                return
            if silent and not self.finished.is_set():
                self._stop_run(silent, now - last[silent[0]][1])

    def _stop_run(self, silent: list[int], seconds: float) -> None:
        """Report the silent ranks as this rank's error, exit, and have those on this machine
        ended once this rank is gone: were a silent rank's death seen first, the agent would
        report that death (SIGKILL) instead of this rank's RankStopped."""
        names = ", ".join(map(str, silent))
        get_error_handler().record_exception(RankStopped(
            f"rank {names} of {self.world_size} stopped answering: no heartbeat for "
            f"{seconds:.0f} s (noticed by rank {self.rank})"))
        for peer in silent:
            host, pid = self.store.get(f"pid/{peer}").decode().split()
            if host == socket.gethostname():
                subprocess.Popen([sys.executable, "-c", KILL_AFTER, str(os.getpid()), pid],
                                 start_new_session=True)  # fmt: skip
        os._exit(1)  # the main thread may be stuck in a collective: no unwinding

    def close(self) -> None:
        """This rank has finished: its silence from now on is not a fault."""
        if self.finished.is_set():
            return
        self.finished.set()
        try:
            self.store.set(f"done/{self.rank}", "1")
        except (RuntimeError, OSError):
            pass  # the store is gone: nobody is watching
        self.thread.join()


def under_launcher() -> bool:
    """True inside a worker started by torchrun or ``launch`` (they set WORLD_SIZE)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def init_process_group(timeout_s: float = COLLECTIVE_TIMEOUT_S, device: str | None = None,
                       heartbeat_s: float = HEARTBEAT_TIMEOUT_S) -> None:
    """Open the default process group from the launcher's environment: NCCL when ``device`` is
    a CUDA device (each local rank takes its own GPU), gloo otherwise; under an elastic agent
    (torchrun, ``launch``) with a ``Heartbeat`` until the process exits."""
    if dist.is_initialized():
        return
    cuda = device is not None and str(device).startswith("cuda")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=timeout_s))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and dist.get_world_size() > 1:
        global _heartbeat
        _heartbeat = Heartbeat(dist.get_rank(), dist.get_world_size(), timeout=heartbeat_s)
        atexit.register(_heartbeat.close)  # torchrun's workers; launch's close it in _worker


def _stop_at(end: float, deadline_s: float) -> None:
    """A timer of this rank: at wall-clock time ``end`` it reports OutOfTime as its error and
    exits (the elastic agent then stops the other ranks), wherever the main thread is stuck."""
    def stop():
        get_error_handler().record_exception(OutOfTime(
            f"the run took longer than its bound of {deadline_s:g} s"))
        os._exit(1)

    timer = threading.Timer(max(0.0, end - time.time()), stop)
    timer.daemon = True
    timer.start()


@record
def _worker(fn, args, threads: int | None, timeout_s: float, device: str | None,
            heartbeat_s: float, deadline: tuple[float, float] | None):
    """The body of every spawned rank: threads, wall-clock bound, process group, fn(*args),
    clean exit."""
    if threads is not None:
        torch.set_num_threads(threads)
    if deadline is not None:
        _stop_at(*deadline)
    init_process_group(timeout_s, device, heartbeat_s)
    try:
        return fn(*args)
    except RunInterrupted as err:
        raise RankInterrupted(f"{err.signal_number} {err}") from None
    finally:
        if _heartbeat is not None:
            _heartbeat.close()
        dist.destroy_process_group()


def launch(fn, nproc: int, *args, threads: int | None = 1, timeout_s: float = COLLECTIVE_TIMEOUT_S,
           monitor_interval: float = 0.1, device: str | None = None,
           heartbeat_s: float = HEARTBEAT_TIMEOUT_S, deadline_s: float | None = None) -> list:
    """Run ``fn(*args)`` on ``nproc`` ranks of this machine (127.0.0.1); returns the ranks'
    results in rank order. ``fn`` must be importable (a module-level function); each rank has
    the default process group open (gloo; NCCL with ``device="cuda"``, a GPU per rank) and
    ``threads`` torch threads (1 lets 4 ranks share 2 cores). Raises LaunchFailed (with the
    failing rank's error) when a rank fails or dies, (naming it) when a rank's heartbeat
    stands still for ``heartbeat_s`` seconds, or when the run takes longer than ``deadline_s``
    seconds of wall-clock time (None: no bound), its processes ended. A signal to this process
    (SIGINT, SIGTERM, ...) goes on to the ranks; once they are gone it raises RunInterrupted."""
    if not (isinstance(nproc, int) and nproc >= 1):
        raise ValueError(f"nproc must be an integer >= 1, got {nproc!r}")
    if deadline_s is not None and not deadline_s > 0:
        raise ValueError(f"deadline_s must be a number of seconds > 0, got {deadline_s!r}")
    deadline = None if deadline_s is None else (time.time() + deadline_s, deadline_s)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0,
                          monitor_interval=monitor_interval, start_method="spawn",
                          shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    handlers = {number: signal.getsignal(number) for number in AGENT_SIGNALS}
    try:
        with _agent_quiet():
            results = elastic_launch(config, _worker)(fn, args, threads, timeout_s, device,
                                                      heartbeat_s, deadline)
    except SignalException as err:
        raise RunInterrupted(int(err.sigval), f"the run was stopped by {err.sigval.name}") from None
    except ChildFailedError as err:
        messages = list(map(_message, err.failures.values()))
        prefix = RankInterrupted.__name__ + ": "
        interrupted = [m.removeprefix(prefix).split(" ", 1) for m in messages
                       if m.startswith(prefix)]
        if interrupted:  # a signal came to the ranks only: they saved and stopped
            raise RunInterrupted(int(interrupted[0][0]), interrupted[0][1]) from None
        for kind in (RankStopped, OutOfTime):  # the rank that noticed is not the one at fault
            prefix = kind.__name__ + ": "
            stopped = [m.removeprefix(prefix) for m in messages if m.startswith(prefix)]
            if stopped:
                raise LaunchFailed(f"{stopped[0]}, so the run was stopped") from err
        rank, failure = err.get_first_failure()
        raise LaunchFailed(f"rank {rank} of {nproc} failed, so the run was stopped: "
                           f"{_describe(failure)}") from err
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
    return [results[rank] for rank in range(nproc)]


@contextmanager
def _agent_quiet():
    """The elastic agent's loggers (AGENT_LOGGERS, each with its own level) silent inside."""
    loggers = [logging.getLogger(name) for name in list(logging.root.manager.loggerDict)
               if name.startswith(AGENT_LOGGERS)]
    levels = {logger: logger.level for logger in loggers}
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)


def _describe(failure) -> str:
    """One line for an elastic ProcessFailure: the signal that killed it, or its error."""
    if failure.signal_name() != "<N/A>" and failure.exitcode < 0:
        return f"killed by {failure.signal_name()} (exit code {failure.exitcode})"
    return f"exit code {failure.exitcode}: {_message(failure)}"


def _message(failure) -> str:
    """The error message an elastic ProcessFailure carries."""
    message = failure.message
    return str(message.get("message", message) if isinstance(message, dict) else message)


__all__ = ["launch", "init_process_group", "under_launcher", "LaunchFailed", "RunInterrupted",
           "RankStopped", "OutOfTime", "Heartbeat", "COLLECTIVE_TIMEOUT_S", "HEARTBEAT_TIMEOUT_S"]
