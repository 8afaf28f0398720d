"""The contract every parallel mode keeps, the one-process reference, and the small pieces the
data-parallel modes share (batch shares, row shards, the configuration check, byte counts).

A mode is built on every rank from the SAME full initial parameters and keeps only its part:

    mode = Mode(cfg, params, group=None, **options)
    loss, grads = mode.loss_and_grads(idx, targets)       idx, targets: the GLOBAL batch (B, T)
    norm = mode.grad_norm(grads)                           the global norm, equal on every rank
    mode.params = optimizer.step(mode.params, grads, lr)   element-wise AdamW on the local part

The training loop never asks which mode it drives. An optimizer built over ``mode.params`` holds
moments of the local part only, so under ZeRO (whose ``params`` are this rank's rows) it IS the
partitioned optimizer state of stage 1; assigning ``mode.params`` hands the updated part back,
and ZeRO 1 and 2 all-gather it into the full replica the next forward uses (ZeRO 3 keeps only
the part and gathers each block when it runs).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ...config import GPTConfig
from ...fast import FlatGrads
from ...model import check_params, loss_and_grads, param_shapes
from ..schedule import clip_grad_norm, global_norm


@runtime_checkable
class ParallelMode(Protocol):
    """What the training loop, the checkpoints and the equality tests use of a mode.

    ``params``: the local dict the optimizer updates (names as ``gptlab.model.param_shapes``; a
    shard holds the slice of its name). ``loss_and_grads(idx, targets)``: the global batch on
    every rank -> (the global mean loss, equal on every rank; the gradients of that loss, a dict
    like ``params``). ``grad_norm(grads)``: the global gradient norm, equal on every rank.
    ``full_params()``: every parameter whole, on every rank. ``shard(full)``: this rank's part of
    full tensors named like ``params`` (the layout of ``params`` and of the optimizer's moments),
    used to resume from a checkpoint written at any world size or by any mode;
    ``unshard(local)``: its inverse, every rank's parts gathered into full tensors on every rank
    (a collective), used to write checkpoints of the parameters and the optimizer's moments.
    """

    params: dict

    def loss_and_grads(self, idx, targets) -> tuple[float, dict]: ...

    def grad_norm(self, grads: dict) -> float: ...

    def full_params(self) -> dict: ...

    def shard(self, full: dict) -> dict: ...

    def unshard(self, local: dict) -> dict: ...


class Replicated:
    """A mode whose every rank holds the whole model: shards are the full tensors."""

    def grad_norm(self, grads: dict) -> float:
        """The gradients are whole (and, across data-parallel ranks, equal): the local norm."""
        return global_norm(grads)

    def full_params(self) -> dict:
        return dict(self.params)

    def shard(self, full: dict) -> dict:
        return dict(full)

    def unshard(self, local: dict) -> dict:
        return dict(local)


class Sharded:
    """A mode whose ranks hold parts of the model (tensor, pipeline): its own ``unshard``
    gathers the parts, and the whole parameters come from it the same way for every such mode."""

    def full_params(self) -> dict:
        """Every parameter whole, on every rank (a collective)."""
        full = self.unshard(self.params)
        return {name: full[name] for name in param_shapes(self.cfg)}


class Single(Replicated):
    """One process: the reference the parallel modes are checked against (same contract).

    ``accum_steps`` splits the batch into that many micro-batches whose gradients are summed
    (each is a mean over its micro-batch, so the sum is divided by accum_steps)."""

    def __init__(self, cfg: GPTConfig, params: dict, group=None, *, accum_steps: int = 1):
        check_params(params, cfg)
        self.cfg, self.params, self.accum_steps = cfg, dict(params), accum_steps

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        total, grads = 0.0, {}
        for step, (x, y) in enumerate(micro_batches(idx, targets, 0, 1, self.accum_steps)):
            seed = None if dropout_seed is None else dropout_seed + step
            loss, micro_grads = loss_and_grads(self.params, x, y, self.cfg, dropout_seed=seed)
            total += loss
            accumulate(grads, micro_grads)
        if self.accum_steps == 1:
            return total, grads
        return total / self.accum_steps, {n: g / self.accum_steps for n, g in grads.items()}


def accumulate(grads: dict, more: dict) -> None:
    """grads += more, name by name (a name new to ``grads`` is taken as it is)."""
    for name, g in more.items():
        grads[name] = grads[name] + g if name in grads else g


def clipped_grads(mode, idx, targets, grad_clip: float = 0.0, **options):
    """The training loop's step before the update: (loss, grads clipped to a global norm of
    ``grad_clip`` when it is > 0, the global norm before clipping; grads None and norm nan when
    the mode skipped the step). ``options`` go to the mode's
    loss_and_grads (dropout_seed). A step over ``gptlab.fast.FlatParams`` gives ``FlatGrads``:
    clipping multiplies their ``scale``, and the fused update applies it. The update is then
    ``mode.params = optimizer.step(mode.params, grads, lr=lr)``."""
    loss, grads = mode.loss_and_grads(idx, targets, **options)
    if grads is None:  # a mixed-precision step skipped on overflow (gptlab.fast.FastStep)
        return loss, None, math.nan
    if isinstance(grads, FlatGrads):  # the fused AdamW's g = scale * flat: clipping g is
        norm = grads.norm()  # clipping the one number scale, which the update multiplies in
        if grad_clip > 0:
            factor = {"scale": grads.scale}
            clip_grad_norm(factor, grad_clip, norm=norm)  # times clip_grad_norm's factor
            grads.scale = factor["scale"]
        return loss, grads, norm
    norm = mode.grad_norm(grads)
    if grad_clip > 0:
        clip_grad_norm(grads, grad_clip, norm=norm)
    return loss, grads, norm


# ------------------------------------------------------------------------------------------------
# Ranks, batches, rows


def rank_and_world(group=None) -> tuple[int, int]:
    """(this process's rank in ``group``, the group's size); (0, 1) without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def micro_batches(idx, targets, rank: int, world_size: int, accum_steps: int) -> list:
    """This rank's share of the global batch (B, T), cut into ``accum_steps`` micro-batches:
    [(x, y)] each (B / (world_size * accum_steps), T). Rank r takes the r-th block of rows."""
    if not (isinstance(accum_steps, int) and accum_steps >= 1):
        raise ValueError(f"accum_steps must be an integer >= 1, got {accum_steps!r}")
    B, parts = idx.shape[0], world_size * accum_steps
    if B % parts:
        raise ValueError(f"the global batch of {B} sequences does not split evenly over "
                         f"{world_size} ranks x {accum_steps} micro-steps")
    b = B // parts  # sequences per micro-batch
    first = rank * accum_steps
    return [(idx[(first + i) * b:(first + i + 1) * b], targets[(first + i) * b:(first + i + 1) * b])
            for i in range(accum_steps)]  # fmt: skip


def rows_per_rank(n_rows: int, world_size: int) -> int:
    """k = ceil(n_rows / world_size): every rank holds k rows of a tensor (the last ones padded)."""
    return -(-n_rows // world_size)


def pad_rows(x, world_size: int):
    """x (n, ...) with zero rows appended to world_size * k rows, k = rows_per_rank(n)."""
    extra = rows_per_rank(x.shape[0], world_size) * world_size - x.shape[0]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros((extra, *x.shape[1:]))])  # (world_size * k, ...)


def take_rows(x, rank: int, world_size: int):
    """Rank ``rank``'s rows of x (n, ...): rows [rank k, (rank + 1) k) of pad_rows(x), a copy."""
    k = rows_per_rank(x.shape[0], world_size)
    return pad_rows(x, world_size)[rank * k:(rank + 1) * k].clone()  # (k, ...)


def all_reduce_sum(value: float, group=None, device=None) -> float:
    """The sum of a Python float over the ranks, in float64 (identical on every rank);
    ``device``: where the process group's backend moves tensors (a GPU for NCCL)."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t[0])


def sharded_norm(local_grads: dict, group=None) -> float:
    """‖g‖ of a gradient whose disjoint parts (zero padding allowed) live on the ranks."""
    local = sum(float(torch.sum(g * g)) for g in local_grads.values())
    device = next(iter(local_grads.values())).device
    return math.sqrt(all_reduce_sum(local, group, device))


def tensor_bytes(tensors) -> int:
    """The bytes of a dict or list of tensors, counted from their element counts."""
    values = tensors.values() if isinstance(tensors, dict) else tensors
    return sum(t.numel() * t.element_size() for t in values)


# ------------------------------------------------------------------------------------------------
# Every rank must run the same model


def config_fingerprint(cfg: GPTConfig, params: dict, **options) -> str:
    """A hash of what every rank must agree on: the model config, the parameters' dtype and
    names, and the mode's options."""
    text = json.dumps({"model": cfg.to_dict(), "dtype": str(params["wte.weight"].dtype),
                       "names": sorted(params), "options": options}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def check_same_config(cfg: GPTConfig, params: dict, group=None, **options) -> None:
    """ValueError on every rank when the ranks were started with different configurations
    (the fingerprints are all-gathered, so no rank waits on a collective the others skip)."""
    rank, world_size = rank_and_world(group)
    if world_size == 1:
        return
    mine = config_fingerprint(cfg, params, **options)
    every = [None] * world_size
    dist.all_gather_object(every, mine, group=group)
    differ = [r for r, fingerprint in enumerate(every) if fingerprint != every[0]]
    if differ:
        raise ValueError(f"ranks {differ} were started with another configuration than rank 0 "
                         f"(model config, dtype or mode options differ; this is rank {rank}): "
                         "start every rank with the same arguments")


def require_torch_params(params: dict, cfg: GPTConfig) -> None:
    """The parallel modes run on torch tensors (torch.distributed moves them)."""
    check_params(params, cfg)
    if not isinstance(params["wte.weight"], torch.Tensor):
        raise TypeError("parallel modes need torch tensors (torch.distributed moves them), got "
                        f"{type(params['wte.weight']).__name__}: use backend='torch'")


__all__ = ["ParallelMode", "Replicated", "Single", "clipped_grads", "rank_and_world",
           "micro_batches", "accumulate", "rows_per_rank", "pad_rows", "take_rows",
           "all_reduce_sum", "sharded_norm", "tensor_bytes", "config_fingerprint",
           "check_same_config", "require_torch_params"]
