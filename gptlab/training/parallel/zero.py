"""ZeRO (Rajbhandari et al. 2020): data parallelism without W copies of everything.

Data parallel training keeps on every rank Ψ parameters, Ψ gradients and the optimizer's KΨ
bytes of state (AdamW: m and v). ZeRO partitions them over the W ranks, stage by stage:

    stage 1  optimizer state    each rank updates only its part of the parameters
    stage 2  + gradients        reduce-scatter instead of all-reduce: rank r receives the sum of
                                its part only
    stage 3  + parameters       each block's weights are all-gathered just before its forward
                                and again for its backward, and freed after

The part of rank r: rows [r k, (r + 1) k) of every tensor, k = ceil(rows / W) (the last rank's
rows padded with zeros). Splitting along the first axis keeps a matrix a matrix, so AdamW's
"decay the matrices only" reads the same from a shard. The optimizer built over ``params``
(this rank's rows) holds this rank's moments only: that is stage 1. After its step, assigning
``params`` all-gathers the updated rows into the replica (stages 1, 2); stage 3 keeps the rows.

Communication is bucketed by the parts of ``gptlab.model.backward_parts`` (LN_f and the head,
each block, the embeddings): a bucket is laid out rank-major, (W, S) with row r holding rank r's
rows of every tensor of the part, so one reduce-scatter (or all-gather) moves the whole part.

Stage 3 and the hand-written caches: a block's cache holds the weights its backward multiplies
by, so keeping caches would keep the gathered weights. Stage 3 keeps only each block's input,
and its backward gathers the block's weights, runs the block's forward again (activation
recomputation) and then its backward: weights and activations of one block at a time.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...model import backward_parts, embed_forward, head_forward, layer_forward
from .base import accumulate, pad_rows, rows_per_rank, sharded_norm, take_rows, tensor_bytes
from .ddp import DataParallel, flatten


def rank_major(tensors: list, world_size: int):
    """(W, S): row r holds rank r's rows of every tensor, one after the other."""
    return torch.cat([pad_rows(t, world_size).reshape(world_size, -1) for t in tensors], dim=1)


def from_rank_major(buffer, shapes: list) -> list:
    """The inverse of rank_major: full tensors of ``shapes`` from a (W, S) buffer."""
    W = buffer.shape[0]
    sizes = [rows_per_rank(shape[0], W) * _row_size(shape) for shape in shapes]
    return [piece.reshape(-1, *shape[1:])[:shape[0]]
            for piece, shape in zip(torch.split(buffer, sizes, dim=1), shapes)]


def _row_size(shape: tuple) -> int:
    """The elements of one row of a tensor of ``shape``."""
    return math.prod(shape[1:])


class ZeRO(DataParallel):
    """ZeRO of stage ``stage`` (1, 2 or 3); the classes ZeRO1, ZeRO2, ZeRO3 fix it."""

    stage = 1

    def keep(self, full: dict) -> None:
        self.shapes = {name: tuple(t.shape) for name, t in full.items()}
        if self.stage == 3:
            self._params = self.shard(full)
        else:  # the replica the forward uses, padded so that this rank's rows are its views
            self.replica = {name: pad_rows(t, self.world_size).clone() for name, t in full.items()}
            self._params = self._views()

    def _views(self) -> dict:
        """This rank's rows of the replica, as views (no copy)."""
        k = {name: rows_per_rank(shape[0], self.world_size) for name, shape in self.shapes.items()}
        return {name: self.replica[name][self.rank * k[name]:(self.rank + 1) * k[name]]
                for name in self.shapes}

    @property
    def params(self) -> dict:
        """This rank's rows of every parameter (what the optimizer updates)."""
        return self._params

    @params.setter
    def params(self, shards: dict) -> None:
        if set(shards) != set(self.shapes):
            raise ValueError("params must have the names of the model's parameters")
        if self.stage == 3:
            self._params = dict(shards)
            return
        works = [dist.all_gather_single(self.replica[name], shards[name].contiguous(),
                                        group=self.group, async_op=True) for name in self.shapes]
        for work in works:
            work.wait()
        self._params = self._views()

    def shard(self, full: dict) -> dict:
        return {name: take_rows(t, self.rank, self.world_size) for name, t in full.items()}

    def forward_params(self) -> dict:
        return {name: self.replica[name][:shape[0]] for name, shape in self.shapes.items()}

    def full_params(self) -> dict:
        if self.stage == 3:
            return self.unshard(self._params)
        return {name: t.clone() for name, t in self.forward_params().items()}

    def unshard(self, local: dict) -> dict:
        """The full tensors of every rank's rows ``local`` (named like ``params``), all-gathered
        in one collective; every rank gets them."""
        names = list(local)
        flat = flatten([local[name] for name in names])  # (S,)
        buffer = flat.new_empty(self.world_size * flat.numel())  # (W S,)
        dist.all_gather_single(buffer, flat, group=self.group)
        buffer = buffer.view(self.world_size, -1)  # (W, S)
        return dict(zip(names, from_rank_major(buffer, [self.shapes[n] for n in names])))

    def gather(self, names: list) -> dict:
        """The full parameters ``names`` (stage 3 runs each part on them, then drops them)."""
        return self.unshard({name: self._params[name] for name in names})

    # --- gradients ----------------------------------------------------------------------------

    def bucket_ready(self, part: dict, local_grads: dict, last: bool) -> None:
        if self.stage == 1:  # gradients whole: the all-reduce of data parallelism
            return super().bucket_ready(part, local_grads, last)
        names = list(part)  # every micro-step: reduce-scatter, the sum of this rank's rows only
        buffer = rank_major([part[name] for name in names], self.world_size)  # (W, S)
        received = buffer.new_empty(buffer.shape[1:])  # (S,)
        work = dist.reduce_scatter_single(received, buffer.reshape(-1), group=self.group,
                                          async_op=True)
        self.pending.append((names, received, work))

    def finish(self, local_grads: dict) -> dict:
        if self.stage == 1:
            full = super().finish(local_grads)
            return self.shard(full)  # the whole gradients were held: held_grad_bytes
        scale, grads = 1.0 / (self.world_size * self.accum_steps), {}
        for names, received, work in self.pending:
            work.wait()
            shapes = [(rows_per_rank(self.shapes[n][0], self.world_size), *self.shapes[n][1:])
                      for n in names]
            pieces = torch.split(received, [_row_size(s) * s[0] for s in shapes])
            accumulate(grads, {name: piece.view(shape)
                               for name, piece, shape in zip(names, pieces, shapes)})
        self.pending = []
        grads = {name: grads[name] * scale for name in self.shapes}
        self.held_grad_bytes = tensor_bytes(grads)
        return grads

    def grad_norm(self, grads: dict) -> float:
        return sharded_norm(grads, self.group)

    # --- stage 3: gather before each block's forward and again for its backward ----------------

    def forward_backward(self, x, y, dropout_seed):
        if self.stage < 3:
            return super().forward_backward(x, y, dropout_seed)
        cfg = self.cfg
        seed = dropout_seed if cfg.dropout > 0.0 else None
        cache = {"cfg": cfg, "training": seed is not None}
        embed_names = [n for n in ("wte.weight", "wpe.weight") if n in self.shapes]
        h = embed_forward(self.gather(embed_names), x, cfg, cache, seed)  # (b, T, C)
        inputs, aux_losses = [], []
        for layer in range(cfg.n_layer):
            inputs.append(h)
            h, aux, _ = layer_forward(h, self.gather_block(layer), cfg, layer, seed)  # (b, T, C)
            aux_losses.append(aux)
        head_names = [n for n in self.shapes if n.startswith("ln_f.")]
        head_names.append("wte.weight" if cfg.tie_embeddings else "lm_head.weight")
        _, loss = head_forward(self.gather(head_names), h, cfg, cache, y, aux_losses)

        def recompute(layer):
            return layer_forward(inputs[layer], self.gather_block(layer), cfg, layer, seed)[2]

        def parts():
            for count, part in enumerate(backward_parts(cache, block_cache=recompute)):
                if count == 0:  # the head's backward is done: free its gathered weights
                    for key in ("head", "wte.weight", "xf"):
                        cache.pop(key, None)
                yield part

        return float(loss), parts()

    def gather_block(self, layer: int) -> dict:
        """Block ``layer``'s full weights, names without the ``h.{layer}.`` prefix."""
        prefix = f"h.{layer}."
        full = self.gather([n for n in self.shapes if n.startswith(prefix)])
        return {name.removeprefix(prefix): t for name, t in full.items()}

    def held_params(self) -> dict:
        return self.replica if self.stage < 3 else self._params


class ZeRO1(ZeRO):
    """ZeRO stage 1: optimizer state partitioned."""

    stage = 1


class ZeRO2(ZeRO):
    """ZeRO stage 2: optimizer state and gradients partitioned."""

    stage = 2


class ZeRO3(ZeRO):
    """ZeRO stage 3: optimizer state, gradients and parameters partitioned."""

    stage = 3


__all__ = ["ZeRO", "ZeRO1", "ZeRO2", "ZeRO3", "rank_major", "from_rank_major"]
