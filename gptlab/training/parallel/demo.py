"""Small runs of the parallel modes, written as module-level functions so that spawned processes
can import them (a notebook cell's function cannot be pickled by name): the tests and chapter 15
call them through a launcher, one process per rank.

``train_rank(mode, cfg, ...)`` trains a mode for a few AdamW updates on a fixed
random batch and returns its losses and the full parameters; ``train_single`` does the same in
one process with ``gptlab.model``: equal results are the modes' correctness test.

Book: chapter 15, "One model, many devices".
"""

from __future__ import annotations

import torch

from ...config import GPTConfig
from ...model import init_params, loss_and_grads
from ..optim import AdamW
from . import mode_class
from .pipeline import SCHEDULES, PipelineParallel
from .tensor import TensorParallel

LR = 1e-3


def batch(cfg: GPTConfig, B: int, T: int, seed: int = 0):
    """A seeded random global batch (idx, targets), each (B, T) int64 on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (B, T), generator=generator)  # (B, T)
    targets = torch.randint(0, cfg.vocab_size, (B, T), generator=generator)  # (B, T)
    return idx, targets


def train_single(cfg: GPTConfig, steps: int, B: int, T: int, dtype: str = "float64"):
    """``steps`` AdamW updates in one process -> (losses, params)."""
    params = init_params(cfg, seed=0, backend="torch", dtype=dtype)
    optimizer, losses = AdamW(params, lr=LR), []
    for step in range(steps):
        loss, grads = loss_and_grads(params, *batch(cfg, B, T, seed=step), cfg)
        params = optimizer.step(params, grads)
        losses.append(loss)
    return losses, params


def train_rank(mode: str, cfg: GPTConfig, steps: int, B: int, T: int, dtype: str = "float64",
               options: dict | None = None):  # fmt: skip
    """One rank of ``mode`` (a name of ``gptlab.training.parallel.MODES``, with ``options``) for
    ``steps`` updates on the batches of ``train_single`` -> (losses, full params, the mode's grad
    norms)."""
    params = init_params(cfg, seed=0, backend="torch", dtype=dtype)
    model = mode_class(mode)(cfg, params, **(options or {}))
    optimizer, losses, norms = AdamW(model.params, lr=LR), [], []
    for step in range(steps):
        loss, grads = model.loss_and_grads(*batch(cfg, B, T, seed=step))
        norms.append(model.grad_norm(grads))
        model.params = optimizer.step(model.params, grads)
        losses.append(loss)
    return losses, model.full_params(), norms


def train_modes(modes: dict, cfg: GPTConfig, steps: int, B: int, T: int, dtype: str = "float64"):
    """One rank: ``train_rank`` for every mode of ``modes`` ({name: options}) -> {name: result}."""
    return {name: train_rank(name, cfg, steps, B, T, dtype, options)
            for name, options in modes.items()}  # fmt: skip


def tensor_parallel_step(cfg: GPTConfig, B: int, T: int):
    """One rank: one forward and backward of ``TensorParallel`` in float64 on ``batch`` ->
    (loss, the gradients gathered whole, the shapes of this rank's parameters)."""
    model = TensorParallel(cfg, init_params(cfg, seed=0, backend="torch", dtype="float64"))
    loss, grads = model.loss_and_grads(*batch(cfg, B, T))
    return loss, model.unshard(grads), {name: tuple(p.shape) for name, p in model.params.items()}


def pipeline_measurements(cfg: GPTConfig, B: int, T: int, micro_counts, steps: int = 3):
    """One rank: ``steps`` float64 steps of each schedule at each number of micro-batches (after
    one warm-up step) -> {(schedule, m): [this stage's ``last_step`` and the step's loss]}."""
    params = init_params(cfg, seed=0, backend="torch", dtype="float64")
    measured = {}
    for schedule in SCHEDULES:
        for n_micro in micro_counts:
            model = PipelineParallel(cfg, params, n_micro=n_micro, schedule=schedule)
            model.loss_and_grads(*batch(cfg, B, T))  # warm-up
            measured[schedule, n_micro] = []
            for step in range(steps):
                loss, _ = model.loss_and_grads(*batch(cfg, B, T, seed=step))
                measured[schedule, n_micro].append({**model.last_step, "loss": loss})
    return measured
