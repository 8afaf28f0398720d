"""Run a function on several processes joined by torch.distributed, for the parallel tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (start method "spawn"),
joins them in a gloo process group on 127.0.0.1 at a free port, pins one torch thread per
process (four ranks fit on two cores), calls ``fn(rank, world_size, *args)`` in each and
returns the list of the return values, rank by rank. If any rank raises, dies, or the whole
run takes longer than ``timeout`` seconds, every process is killed by its pid and a
RuntimeError carries the failing rank's traceback: a test never hangs on a lost peer.

``fn`` must be a module-level function (spawn pickles it by name); its return value is pickled
with the standard pickle (tensors travel by value, not through shared memory).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world_size: int, port: int, results, fn, args) -> None:
    """One rank: join the group, run fn, send ("ok", rank, pickled value) or ("error", ...)."""
    try:
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size)  # fmt: skip
        value = fn(rank, world_size, *args)
        dist.barrier()  # nobody leaves while a peer still needs it
        dist.destroy_process_group()
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 (the parent reports it)
        results.put(("error", rank, traceback.format_exc()))


def _kill_all(processes) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()  # by this process's pid, nothing broader
    for process in processes:
        process.join(5)


def run_ranks(fn, world_size: int, *args, timeout: float = 60):
    """fn(rank, world_size, *args) on world_size gloo ranks -> [value of rank 0, rank 1, ...]."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    processes = [ctx.Process(target=_rank_main, args=(rank, world_size, port, results, fn, args),
                             daemon=True) for rank in range(world_size)]  # fmt: skip
    for process in processes:
        process.start()
    values, deadline = {}, time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                status, rank, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"run_ranks: {fn.__name__} on {world_size} ranks took "
                                       f"longer than {timeout} s; ranks still missing: "
                                       f"{sorted(set(range(world_size)) - set(values))}") from None
                dead = [r for r, p in enumerate(processes) if r not in values
                        and p.exitcode is not None and p.exitcode != 0]  # fmt: skip
                if dead:
                    code = processes[dead[0]].exitcode
                    raise RuntimeError(f"run_ranks: rank {dead[0]} died (exit code {code}) "
                                       "without reporting") from None  # fmt: skip
                continue
            if status == "error":
                raise RuntimeError(f"run_ranks: rank {rank} of {world_size} failed in "
                                   f"{fn.__name__}:\n{payload}")  # fmt: skip
            values[rank] = pickle.loads(payload)
    finally:
        _kill_all(processes)
    return [values[rank] for rank in range(world_size)]
