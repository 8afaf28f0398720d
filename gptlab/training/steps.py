"""The loss and gradients of one training step, as the run's settings choose them: the
hand-written backward (NumPy or torch), the fused torch path (``gptlab.fast``), or the torch
reference model with autograd; on one process, or spread over ranks by a parallel mode.
Book: chapters 11, 14 and 15.
"""

from __future__ import annotations


import numpy as np

from ..config import GPTConfig
from ..fast import FastStep, FlatStep, GraphStep, LossScaler
from ..model import gpt_forward, loss_and_grads
from .config import TrainConfig
from .parallel import mode_class
from .parallel.base import Replicated


def dropout_seed(seed: int, step: int) -> int:
    """The dropout seed of update ``step`` (0-based): a pure function of (seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def loss_functions(cfg: TrainConfig, model_cfg: GPTConfig, scaler: LossScaler | None):
    """(loss_and_grads(params, x, y, dropout_seed) -> (float, grads),
    loss(params, x, y) -> float); ``scaler``: float16's loss scaler (the fused path)."""
    if cfg.backend != "autograd":
        if cfg.runs_fused:
            step = FastStep(model_cfg, cfg.precision, attention=cfg.attention,
                            classifier=cfg.classifier, recompute=cfg.recompute, scaler=scaler,
                            kernels=cfg.kernels)

            def train_loss(params, x, y, seed):  # grads None: float16 overflowed, no update
                return step(params, x, y)
        else:
            def train_loss(params, x, y, seed):
                return loss_and_grads(params, x, y, model_cfg, dropout_seed=seed,
                                      recompute=cfg.recompute)

        def eval_loss(params, x, y):
            return float(gpt_forward(params, x, model_cfg, y)[1])

        return train_loss, eval_loss

    import torch

    from ..reference.torch_gpt import reference_forward

    def train_loss(params, x, y, seed):
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        _, loss = reference_forward(leaves, x, model_cfg, y, training=True)
        loss.backward()
        return float(loss.detach()), {name: p.grad for name, p in leaves.items()}

    def eval_loss(params, x, y):
        with torch.no_grad():
            return float(reference_forward(params, x, model_cfg, y)[1])

    return train_loss, eval_loss


def flat_train_loss(cfg: TrainConfig, model_cfg: GPTConfig, scaler: LossScaler | None):
    """loss_and_grads(params, x, y, dropout_seed) -> (float, FlatGrads or None) of a run whose
    update is the fused AdamW (``TrainConfig.fused_optimizer``): a ``FlatStep`` (a ``GraphStep``
    with ``cuda_graph``) over the run's ``gptlab.fast.FlatParams``, leaving the gradients where
    the update reads them."""
    options = dict(attention=cfg.attention, classifier=cfg.classifier, recompute=cfg.recompute,
                   kernels=cfg.kernels)
    if cfg.cuda_graph:  # the same step, replayed as one CUDA graph (float16 refused)
        step = GraphStep(model_cfg, cfg.precision, **options)
    else:
        step = FlatStep(model_cfg, cfg.precision, scaler=scaler, **options)

    def train_loss(params, x, y, seed):  # grads None: float16 overflowed, no update
        return step(params, x, y)

    return train_loss


class OneProcess(Replicated):
    """The one-process run as a parallel mode of one rank (any backend, the autograd path too),
    so that the loop drives every run the same way."""

    def __init__(self, params: dict, train_loss):
        self.params, self.train_loss = params, train_loss

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        return self.train_loss(self.params, idx, targets, dropout_seed)


def make_mode(cfg: TrainConfig, model_cfg: GPTConfig, params: dict, train_loss):
    if cfg.parallel == "none":
        return OneProcess(params, train_loss)
    options = {"accum_steps": cfg.accum_steps} if cfg.accum_steps > 1 else {}
    return mode_class(cfg.parallel)(model_cfg, params, **options)


__all__ = ["dropout_seed", "loss_functions", "flat_train_loss", "make_mode", "OneProcess"]
