"""Data parallelism: every rank holds the whole model, runs its share of the batch, and the ranks
average their gradients.

With W ranks and M micro-steps (gradient accumulation) each rank runs M micro-batches of
b = B / (W M) sequences. The global loss is the mean over all B sequences, so

    L = 1/(W M) sum_{r, m} L_{r,m}      dL/dθ = 1/(W M) sum_r ( sum_m dL_{r,m}/dθ )

Each rank sums its micro-steps' gradients locally, and only the last micro-step communicates:
the all-reduce sums over r, and the division by W M gives the mean.

A mixture-of-experts model (mlp="moe") trains differently on W ranks than on one: each rank's
load-balancing loss is computed over its own share of the batch (as GShard and Switch do), and
that loss is not linear in the batch.

Overlap: the hand-written backward (``gptlab.model.backward_parts``) finishes LN_f, then the
blocks from the last to the first, then the embeddings. Each part's gradients are flattened into
one bucket whose all-reduce is started (``async_op=True``) at once, so the network moves block
l's gradients while block l-1's backward computes; the step waits for all of them at the end.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import GPTConfig
from ...model import backward_parts, gpt_forward
from .base import (
    Replicated,
    accumulate,
    all_reduce_sum,
    check_same_config,
    micro_batches,
    rank_and_world,
    require_torch_params,
    tensor_bytes,
)


def flatten(tensors: list):
    """One 1-D buffer holding the tensors one after the other (a communication bucket)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat, like: list) -> list:
    """The inverse of flatten: views of ``flat`` shaped like the tensors of ``like``."""
    sizes = [t.numel() for t in like]
    return [piece.view(t.shape) for piece, t in zip(torch.split(flat, sizes), like)]


class DataParallel(Replicated):
    """Data parallel training of the hand-written model (the contract is in ``base.py``).

    params: the full initial parameters (torch), identical on every rank; group: the process
    group (default: the world); accum_steps: micro-steps per update."""

    def __init__(self, cfg: GPTConfig, params: dict, group=None, *, accum_steps: int = 1):
        require_torch_params(params, cfg)
        self.cfg, self.group, self.accum_steps = cfg, group, accum_steps
        self.rank, self.world_size = rank_and_world(group)
        check_same_config(cfg, params, group, mode=type(self).__name__, accum_steps=accum_steps)
        self.held_grad_bytes = 0
        self.keep(params)

    def keep(self, full: dict) -> None:
        """Keep this rank's part of the full initial parameters (here: all of them)."""
        self.params = dict(full)

    # --- one step: forward and backward of each micro-batch, gradients sent part by part ------

    def forward_params(self) -> dict:
        """The full parameters the forward uses."""
        return self.params

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        """The global batch (B, T) -> (global mean loss, gradients of it), see the docstring."""
        batches = micro_batches(idx, targets, self.rank, self.world_size, self.accum_steps)
        self.pending, local_grads, total = [], {}, 0.0
        for step, (x, y) in enumerate(batches):
            # each micro-batch of each rank draws its own dropout masks
            micro = self.accum_steps * self.rank + step
            seed = None if dropout_seed is None else dropout_seed + micro
            loss, parts = self.forward_backward(x, y, seed)
            total += loss
            for part in parts:
                self.bucket_ready(part, local_grads, last=step == len(batches) - 1)
        grads = self.finish(local_grads)
        total = all_reduce_sum(total, self.group, idx.device)
        return total / (self.world_size * self.accum_steps), grads

    def forward_backward(self, x, y, dropout_seed):
        """(loss of one micro-batch as a float, the generator of its gradients part by part)."""
        _, loss, cache = gpt_forward(self.forward_params(), x, self.cfg, y,
                                     dropout_seed=dropout_seed)
        return float(loss), backward_parts(cache)

    def bucket_ready(self, part: dict, local_grads: dict, last: bool) -> None:
        """Add one part's micro-step gradients to the local sum; on the last micro-step start
        the all-reduce of the part's bucket."""
        accumulate(local_grads, part)
        if last:
            names = list(part)
            bucket = flatten([local_grads[name] for name in names])
            self.pending.append((names, bucket, dist.all_reduce(bucket, group=self.group,
                                                                async_op=True)))

    def finish(self, local_grads: dict) -> dict:
        """Wait for every bucket; the sums divided by W M, in the order of ``params``."""
        scale = 1.0 / (self.world_size * self.accum_steps)
        for names, bucket, work in self.pending:
            work.wait()
            bucket.mul_(scale)
            local_grads.update(zip(names, unflatten(bucket, [local_grads[n] for n in names])))
        self.pending = []
        grads = {name: local_grads[name] for name in self.params}
        self.held_grad_bytes = tensor_bytes(grads)
        return grads

    def held_params(self) -> dict:
        """The parameter tensors this rank keeps between steps."""
        return self.params

    def memory(self, optimizer=None) -> dict:
        """Bytes this rank holds between steps, counted tensor by tensor: params, grads (those
        the last step produced or, in ZeRO 1, received whole), the optimizer's moments, total.
        Transients (activations, one block's gathered weights in ZeRO 3) are not counted."""
        counts = {"params": tensor_bytes(self.held_params()), "grads": self.held_grad_bytes,
                  "optimizer": 0 if optimizer is None else tensor_bytes(optimizer.state)}
        return {**counts, "total": sum(counts.values())}


__all__ = ["DataParallel", "flatten", "unflatten"]
