"""Run a function on several processes joined by torch.distributed, for the parallel tests.

``run_ranks(fn, world_size, *args)`` spawns ``world_size`` processes (start method "spawn"),
joins them in a gloo process group on 127.0.0.1 at a free port, pins one torch thread per
process (four ranks fit on two cores), calls ``fn(*args)`` in each (the rank and world size
come from ``torch.distributed.get_rank()`` and ``get_world_size()``, as under torchrun) and
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
        value = fn(*args)
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
    """fn(*args) on world_size gloo ranks -> [value of rank 0, rank 1, ...]."""
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


# --- the equality target of every mode: training equal to one process -----------------------

TOLERANCE = {"float64": 1e-12, "float32": 1e-6}
# The key bias has a gradient of zero in exact arithmetic (softmax does not change when all the
# scores of a query move by q . b_k), so in float32 AdamW's updates there feed on round-off.
KEY_BIAS_TOLERANCE = 1e-5


def train_in_both_dtypes(mode: str, run: tuple, options: dict):
    """One rank of ``mode`` trained in float64 and in float32 -> {dtype: (losses, params,
    grad norms)}; ``run`` = (cfg, steps, B, T)."""
    from gptlab.parallel.demo import train_rank

    return {dtype: train_rank(mode, *run, dtype, options) for dtype in TOLERANCE}


def assert_equal_to_one_process(ranks: list, cfg, steps: int, B: int, T: int) -> None:
    """Every rank's losses, full weights after ``steps`` updates and gradient norms (the same on
    every rank) equal those of one process, float64 to 1e-12 and float32 to 1e-6."""
    import numpy as np

    from gptlab.parallel.demo import train_single

    for dtype, tol in TOLERANCE.items():
        losses, params = train_single(cfg, steps, B, T, dtype)
        norms = ranks[0][dtype][2]
        for rank, result in enumerate(ranks):
            rank_losses, rank_params, rank_norms = result[dtype]
            np.testing.assert_allclose(rank_losses, losses, rtol=0, atol=10 * tol)
            assert rank_norms == norms, f"rank {rank}'s gradient norms differ from rank 0's"
            assert list(rank_params) == list(params)
            for name, value in params.items():
                got, want = rank_params[name].numpy().copy(), value.numpy()
                if name.endswith("attn.c_attn.bias") and dtype == "float32":
                    key_bias = slice(cfg.n_embd, 2 * cfg.n_embd)
                    np.testing.assert_allclose(got[key_bias], want[key_bias], rtol=0,
                                               atol=KEY_BIAS_TOLERANCE)  # fmt: skip
                    got[key_bias] = want[key_bias]
                np.testing.assert_allclose(got, want, rtol=0, atol=tol,
                                           err_msg=f"{dtype} {name} rank {rank}")  # fmt: skip
