"""Run a function on several processes joined by torch.distributed, for the parallel tests.

``run_ranks(fn, world_size, *args)`` is the product's own starter, ``gptlab.training.parallel.
launch.launch``, with a wall-clock bound: ``world_size`` processes on 127.0.0.1 in a gloo
process group, one torch thread each (four ranks fit on two cores), ``fn(*args)`` in each (the
rank and world size from ``torch.distributed.get_rank()`` and ``get_world_size()``, as under
torchrun), and the list of the return values, rank by rank. If any rank raises or dies, or the
run takes longer than ``timeout`` seconds, the launcher ends every process by its pid and
raises LaunchFailed naming the rank and its error: a test never hangs on a lost peer.

``fn`` must be a module-level function (spawn pickles it by name); its return value is pickled
with the standard pickle (tensors travel by value, not through shared memory).
"""

from __future__ import annotations

import pickle

import torch.distributed as dist
from bounds import assert_relative, assert_within, model_roundoff

from gptlab.training.parallel.launch import launch


def _by_value(fn, args) -> bytes:
    """One rank: fn(*args), pickled; nobody leaves while a peer still needs it."""
    value = fn(*args)
    dist.barrier()
    return pickle.dumps(value)


def run_ranks(fn, world_size: int, *args, timeout: float = 60):
    """fn(*args) on world_size gloo ranks -> [value of rank 0, rank 1, ...]."""
    return [pickle.loads(value)
            for value in launch(_by_value, world_size, fn, args, deadline_s=timeout)]


# --- the equality target of every mode: training equal to one process -----------------------

# float64 agrees to 1e-12 (a sum of 16 rows in another order moves it by ~1e-15 a step);
# float32 to the derived bound model_roundoff (tests/bounds.py).
FLOAT64_TOLERANCE = 1e-12


def train_in_both_dtypes(mode: str, run: tuple, options: dict):
    """One rank of ``mode`` trained in float64 and in float32 -> {dtype: (losses, params,
    grad norms)}; ``run`` = (cfg, steps, B, T)."""
    from gptlab.training.parallel.demo import train_rank

    return {dtype: train_rank(mode, *run, dtype, options) for dtype in ("float64", "float32")}


def assert_equal_to_one_process(ranks: list, cfg, steps: int, B: int, T: int) -> None:
    """Every rank's losses, full weights after ``steps`` updates and gradient norms (the same on
    every rank) equal those of one process: float64 to 1e-12, float32 to model_roundoff (losses
    relative to their size)."""
    import numpy as np

    from gptlab.training.parallel.demo import train_single

    bound = model_roundoff(cfg, B, T, updates=steps)  # each update's gradients in another order
    for dtype in ("float64", "float32"):
        losses, params = train_single(cfg, steps, B, T, dtype)
        norms = ranks[0][dtype][2]
        for rank, result in enumerate(ranks):
            rank_losses, rank_params, rank_norms = result[dtype]
            assert rank_norms == norms, f"rank {rank}'s gradient norms differ from rank 0's"
            assert list(rank_params) == list(params)
            if dtype == "float32":
                assert_relative(rank_losses, losses, bound, "parallel float32 losses",
                                f"rank {rank}")
                for name, value in params.items():
                    assert_within(rank_params[name], value, bound, "parallel float32 weights",
                                  f"{name} rank {rank}")
                continue
            np.testing.assert_allclose(rank_losses, losses, rtol=0, atol=10 * FLOAT64_TOLERANCE)
            for name, value in params.items():
                np.testing.assert_allclose(rank_params[name].numpy(), value.numpy(), rtol=0,
                                           atol=FLOAT64_TOLERANCE, err_msg=f"{name} rank {rank}")
