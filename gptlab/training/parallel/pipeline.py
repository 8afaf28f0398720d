"""Pipeline parallelism: the blocks cut into p stages, one per rank, the batch into m micro-batches.

Stage 0 also holds the embeddings, stage p-1 the final LayerNorm, the head and the loss. A
micro-batch's activations (B/m, T, C) travel forward from stage to stage (send/recv), and their
gradients travel back. A schedule says in which order each stage runs its forward (F) and
backward (B) of each micro-batch; it is an explicit list of (stage, micro-batch, op) per stage,
and any order works as long as F(s, j) follows F(s-1, j) and B(s, j) follows B(s+1, j) and F(s, j):

    GPipe (Huang et al. 2019): all m forwards, then all m backwards
    1F1B  (PipeDream-Flush; Narayanan et al. 2019, 2021): p-s-1 forwards to fill the pipe, then
          one forward and one backward in turn, then the remaining backwards

Both leave every stage idle for the same share of a step, the bubble (p-1)/(m+p-1) when every F
takes t_F and every B takes t_B; they differ in memory: a stage keeps a micro-batch's activations
from its F to its B, at most m of them under GPipe and at most p under 1F1B.

The gradient of the mean loss is the mean of the m micro-batches' gradients: each micro-batch's
backward starts from dloss = 1/m, and a stage sums its micro-batches' gradients. The tied matrix
wte is used on two stages (the embedding on the first, the head on the last): each computes its
share of dwte, and the two exchange and sum them, so both copies take the same update.

Book: chapter 15, "One model, many devices".
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from ...config import GPTConfig
from ...layers.block import block_backward, block_forward, block_norm, part_backward
from ...layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from ...layers.embedding import embedding_backward, embedding_forward
from ...layers.linear import linear_backward, linear_forward
from ...layers.position_learned import position_learned_backward, position_learned_forward
from ...model import block_options, block_params, check_params, head_weight
from .base import Sharded, accumulate, rank_and_world
from .tensor import all_reduce

# --- schedules -----------------------------------------------------------------------------------


def gpipe_schedule(n_stages: int, n_micro: int) -> list[list[tuple[int, int, str]]]:
    """GPipe: on every stage, the m forwards, then the m backwards."""
    return [[(s, j, "F") for j in range(n_micro)] + [(s, j, "B") for j in range(n_micro)]
            for s in range(n_stages)]  # fmt: skip


def one_f_one_b_schedule(n_stages: int, n_micro: int) -> list[list[tuple[int, int, str]]]:
    """1F1B: stage s runs min(p-s-1, m) forwards, then alternates F and B, then drains the Bs."""
    schedule = []
    for s in range(n_stages):
        warmup = min(n_stages - s - 1, n_micro)
        ops = [(s, j, "F") for j in range(warmup)]
        for j in range(n_micro - warmup):
            ops += [(s, warmup + j, "F"), (s, j, "B")]
        ops += [(s, j, "B") for j in range(n_micro - warmup, n_micro)]
        schedule.append(ops)
    return schedule


SCHEDULES = {"gpipe": gpipe_schedule, "1f1b": one_f_one_b_schedule}


def dependencies(stage: int, micro: int, op: str, n_stages: int) -> list[tuple[int, int, str]]:
    """The ops that must finish before (stage, micro, op) can start."""
    if op == "F":
        return [(stage - 1, micro, "F")] if stage > 0 else []
    after_next = [(stage + 1, micro, "B")] if stage < n_stages - 1 else []
    return [(stage, micro, "F"), *after_next]


def simulate(schedule, t_forward: float = 1.0, t_backward: float = 2.0) -> dict:
    """Run a schedule on an idealized clock -> {(stage, micro, op): (start, end)}.

    Each stage runs its list in order, an op as soon as its stage is free and its dependencies
    are done; F takes t_forward, B t_backward. ValueError if the schedule deadlocks (an op waits
    for one that its stage, or a peer, can only run later)."""
    n_stages = len(schedule)
    position, free, done = [0] * n_stages, [0.0] * n_stages, {}
    while any(position[s] < len(schedule[s]) for s in range(n_stages)):
        progressed = False
        for s in range(n_stages):
            while position[s] < len(schedule[s]):
                op = schedule[s][position[s]]
                needs = dependencies(*op, n_stages)
                if any(need not in done for need in needs):
                    break
                start = max([free[s]] + [done[need][1] for need in needs])
                free[s] = start + (t_forward if op[2] == "F" else t_backward)
                done[op], position[s], progressed = (start, free[s]), position[s] + 1, True
        if not progressed:
            stuck = [schedule[s][position[s]] for s in range(n_stages)
                     if position[s] < len(schedule[s])]  # fmt: skip
            raise ValueError(f"the schedule deadlocks: every stage waits, at {stuck}")
    return done


def check_schedule(schedule, n_stages: int, n_micro: int) -> None:
    """ValueError unless every stage runs F and B of each micro-batch exactly once, each F
    before its B, and the stages' orders can run together (no deadlock)."""
    if len(schedule) != n_stages:
        raise ValueError(f"the schedule has {len(schedule)} stages, expected {n_stages}")
    for s, ops in enumerate(schedule):
        expected = {(s, j, op) for j in range(n_micro) for op in "FB"}
        if len(ops) != len(expected) or set(ops) != expected:
            raise ValueError(f"stage {s} must run F and B of micro-batches 0..{n_micro - 1} "
                             f"once each, got {ops}")  # fmt: skip
        for j in range(n_micro):
            if ops.index((s, j, "B")) < ops.index((s, j, "F")):
                raise ValueError(f"stage {s} runs the backward of micro-batch {j} before its "
                                 "forward")  # fmt: skip
    simulate(schedule)


def peak_activations(ops) -> int:
    """The most micro-batches a stage holds at once (forward done, backward not yet)."""
    held = peak = 0
    for _, _, op in ops:
        held += 1 if op == "F" else -1
        peak = max(peak, held)
    return peak


def bubble_fraction(n_stages: int, n_micro: int) -> float:
    """The idle share of a step on every stage, (p-1)/(m+p-1)."""
    return (n_stages - 1) / (n_micro + n_stages - 1)


def idle_fraction(times: dict, n_stages: int) -> list[float]:
    """Per stage, 1 - busy time / the whole step's span, from {(stage, micro, op): (start, end)}."""
    span = max(end for _, end in times.values()) - min(start for start, _ in times.values())
    busy = [0.0] * n_stages
    for (stage, _, _), (start, end) in times.items():
        busy[stage] += end - start
    return [1.0 - b / span for b in busy]


def split_layers(n_layer: int, n_stages: int) -> list[range]:
    """The blocks of each stage: consecutive, sizes as equal as can be (earlier stages +1)."""
    if n_stages > n_layer:
        raise ValueError(f"more stages ({n_stages}) than layers ({n_layer}): every stage needs "
                         "at least one block")  # fmt: skip
    base, extra = divmod(n_layer, n_stages)
    bounds = [0]
    for s in range(n_stages):
        bounds.append(bounds[-1] + base + (1 if s < extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(n_stages)]


N_MICRO = 4  # micro-batches per step unless PipelineParallel(n_micro=...) says otherwise


def check_pipeline_config(cfg: GPTConfig, n_stages: int, n_micro: int = N_MICRO,
                          batch_size: int | None = None) -> None:  # fmt: skip
    """ValueError unless ``cfg`` runs as ``n_stages`` stages on ``n_micro`` micro-batches (and
    ``batch_size``, when given, splits into them)."""
    if cfg.mlp == "moe" or cfg.position != "learned" or cfg.dropout != 0.0:
        raise ValueError("pipeline parallel supports learned positions and blocks without "
                         "experts or dropout")  # fmt: skip
    if not isinstance(n_micro, int) or n_micro < 1:
        raise ValueError(f"n_micro must be a positive integer, got {n_micro!r}")
    split_layers(cfg.n_layer, n_stages)
    if batch_size is not None and batch_size % n_micro:
        raise ValueError(f"pipeline parallel splits the batch into {n_micro} micro-batches: the "
                         f"batch size ({batch_size}) must be a multiple of {n_micro}")


# --- the mode ------------------------------------------------------------------------------------


class PipelineParallel(Sharded):
    """The pipeline mode: ``PipelineParallel(cfg, params, group=None, n_micro=4,
    schedule="1f1b")`` on every rank; rank s of the group is stage s and keeps its parameters.

    After each ``loss_and_grads``, ``.last_step`` holds this stage's measurements: ``timeline``
    [(micro, op, start, end)] in seconds from the step's start (receives excluded, they are
    waiting), ``busy``, ``span`` (the longest stage's step), ``idle`` = 1 - busy/span and
    ``peak_activations``."""

    def __init__(self, cfg: GPTConfig, params: dict, group=None, *, n_micro: int = N_MICRO,
                 schedule: str = "1f1b"):  # fmt: skip
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {tuple(SCHEDULES)}, got {schedule!r}")
        check_params(params, cfg)
        self.cfg, self.group, self.n_micro = cfg, group, n_micro
        self.stage, self.n_stages = rank_and_world(group)
        check_pipeline_config(cfg, self.n_stages, n_micro)
        self.layers = split_layers(cfg.n_layer, self.n_stages)[self.stage]
        self.first, self.last = self.stage == 0, self.stage == self.n_stages - 1
        self.schedule = SCHEDULES[schedule](self.n_stages, n_micro)
        self.ranks = (dist.get_process_group_ranks(group) if group is not None
                      else list(range(self.n_stages)))  # fmt: skip
        self.opts = {**block_options(cfg), "seed": None}
        self.params = self.shard(params)
        self.last_step = {}

    def _owns(self, name: str) -> bool:
        if name.startswith("h."):
            return int(name.split(".")[1]) in self.layers
        if name in ("wte.weight", "wpe.weight"):
            return self.first or (name == "wte.weight" and self.last and self.cfg.tie_embeddings)
        return self.last  # ln_f, lm_head

    # the work of one stage on one micro-batch

    def _forward(self, x, targets):
        """x: ids (first stage) or activations (B/m, T, C) -> (activations or loss, cache)."""
        p, c = self.params, {"blocks": []}
        if self.first:
            tok, c["wte"] = embedding_forward(x, p["wte.weight"])  # (b, T, C)
            x, c["wpe"] = position_learned_forward(tok, p["wpe.weight"])  # (b, T, C)
        for layer in self.layers:
            x, block_cache = block_forward(x, block_params(p, layer), **self.opts)  # (b, T, C)
            c["blocks"].append(block_cache)
        if not self.last:
            return x, c
        xf, c["ln_f"] = block_norm(x, p, "ln_f", self.opts)  # (b, T, C)
        logits, c["head"] = linear_forward(xf, head_weight(p, self.cfg))  # (b, T, V)
        loss, c["loss"] = cross_entropy_forward(logits, targets)  # ()
        return loss, c

    def _backward(self, dout, c):
        """dout: the gradient of the stage's output (None on the last stage) -> (dx, grads);
        the tied head's share of dwte is named "wte.weight:head"."""
        grads = {}
        dx = dout
        if self.last:
            # the loss is the mean of the m micro-batches' losses
            (dlogits,) = cross_entropy_backward(1.0 / self.n_micro, c["loss"])  # (b, T, V)
            # logits = xf @ head
            dxf, dhead, _ = linear_backward(dlogits, c["head"])  # (b, T, C)
            if self.cfg.tie_embeddings:
                grads["wte.weight:head"] = dhead.mT  # (V, C) head = wte^T
            else:
                grads["lm_head.weight"] = dhead  # (C, V)
            # xf = LN_f(x)
            dx, dln_f = part_backward(dxf, c["ln_f"])  # (b, T, C)
            grads.update(dln_f)
        for layer, block_cache in reversed(list(zip(self.layers, c["blocks"]))):
            dx, dblock = block_backward(dx, block_cache)  # (b, T, C)
            grads.update({f"h.{layer}.{name}": g for name, g in dblock.items()})
        if self.first:
            # x = tok + wpe[:T], tok = wte[idx]
            dtok, grads["wpe.weight"] = position_learned_backward(dx, c["wpe"])  # (b, T, C)
            (grads["wte.weight"],) = embedding_backward(dtok, c["wte"])  # (V, C)
        return dx, grads

    # the step: the schedule executed with send/recv

    def _micro_batches(self, a):
        B = a.shape[0]
        if B % self.n_micro != 0:
            raise ValueError(f"the batch size ({B}) must be divisible by n_micro ({self.n_micro})")
        b = B // self.n_micro
        return [a[j * b : (j + 1) * b] for j in range(self.n_micro)]  # (b, T) each

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        """The global batch idx, targets (B, T) -> (mean loss on every rank, this stage's grads).
        ``dropout_seed`` is accepted for the training loop and unused: the model has no dropout."""
        ids, tgts = self._micro_batches(idx), self._micro_batches(targets)
        b, T = ids[0].shape
        dtype = self.params[next(iter(self.params))].dtype
        shape = (b, T, self.cfg.n_embd)
        previous = self.ranks[max(self.stage - 1, 0)]  # the neighbours' global ranks
        following = self.ranks[min(self.stage + 1, self.n_stages - 1)]
        held, grads, losses, sends, timeline, peak = {}, {}, [], [], [], 0
        if dist.is_initialized():
            dist.barrier(group=self.group)
        t0 = time.perf_counter()
        for _, j, op in self.schedule[self.stage]:
            if op == "F":
                x = ids[j]
                if not self.first:
                    x = torch.empty(shape, dtype=dtype)  # (b, T, C)
                    dist.recv(x, previous, group=self.group, tag=2 * j)
                start = time.perf_counter()
                out, held[j] = self._forward(x, tgts[j])
                if self.last:
                    losses.append(out)
                else:
                    sends.append(dist.isend(out.contiguous(), following, group=self.group,
                                            tag=2 * j))  # fmt: skip
            else:
                dout = None
                if not self.last:
                    dout = torch.empty(shape, dtype=dtype)  # (b, T, C)
                    dist.recv(dout, following, group=self.group, tag=2 * j + 1)
                start = time.perf_counter()
                dx, micro_grads = self._backward(dout, held.pop(j))
                accumulate(grads, micro_grads)
                if not self.first:
                    sends.append(dist.isend(dx.contiguous(), previous, group=self.group,
                                            tag=2 * j + 1))  # fmt: skip
            timeline.append((j, op, start - t0, time.perf_counter() - t0))
            peak = max(peak, len(held))
        for request in sends:
            request.wait()
        self._record(timeline, peak)
        self._sum_tied_wte(grads)
        return self._mean_loss(losses), {name: grads[name] for name in self.params}

    def _record(self, timeline, peak: int) -> None:
        busy = sum(end - start for _, _, start, end in timeline)
        end = torch.tensor([timeline[-1][3]], dtype=torch.float64)
        span = float(all_reduce(end, self.group, dist.ReduceOp.MAX)[0])
        self.last_step = dict(timeline=timeline, busy=busy, span=span, idle=1.0 - busy / span,
                              peak_activations=peak)  # fmt: skip

    def _sum_tied_wte(self, grads: dict) -> None:
        """dwte = the embedding's share (first stage) + the head's (last stage), on both."""
        if not self.cfg.tie_embeddings:
            return
        if self.n_stages == 1:
            grads["wte.weight"] = grads["wte.weight"] + grads.pop("wte.weight:head")
            return
        if not (self.first or self.last):
            return
        mine = grads.pop("wte.weight:head") if self.last else grads["wte.weight"]
        theirs = torch.empty(mine.shape, dtype=mine.dtype)  # (V, C)
        peer = self.ranks[-1] if self.first else self.ranks[0]
        tag = 2 * self.n_micro  # after the micro-batches' tags 0 .. 2m-1
        request = dist.isend(mine.contiguous(), peer, group=self.group, tag=tag)
        dist.recv(theirs, peer, group=self.group, tag=tag)
        request.wait()
        embed, head = (mine, theirs) if self.first else (theirs, mine)
        grads["wte.weight"] = embed + head  # (V, C) the same sum, in the same order, on both

    def _mean_loss(self, losses) -> float:
        """The mean of the micro-batches' losses, computed on the last stage, sent to all."""
        loss = torch.zeros(1, dtype=torch.float64)
        if self.last:
            loss[0] = float(sum(losses)) / self.n_micro
        if self.n_stages > 1:
            dist.broadcast(loss, self.ranks[-1], group=self.group)
        return float(loss[0])

    def grad_norm(self, grads: dict) -> float:
        """The whole model's gradient norm; the last stage's copy of the tied wte not counted."""
        total = sum(float(torch.sum(g * g)) for name, g in grads.items()
                    if not (name == "wte.weight" and self.last and not self.first))  # fmt: skip
        return math.sqrt(float(all_reduce(torch.tensor([total], dtype=torch.float64),
                                          self.group)[0]))  # fmt: skip

    def shard(self, full: dict) -> dict:
        """This stage's tensors among full ones named like the model's (parameters or moments)."""
        return {name: value for name, value in full.items() if self._owns(name)}

    def unshard(self, local: dict) -> dict:
        """Every stage's tensors gathered, on every rank (a collective)."""
        parts = [local]
        if self.n_stages > 1:
            parts = [None] * self.n_stages
            dist.all_gather_object(parts, local, group=self.group)
        merged = {}
        for part in parts:
            merged.update(part)
        return merged

__all__ = [
    "PipelineParallel", "gpipe_schedule", "one_f_one_b_schedule", "SCHEDULES", "dependencies",
    "simulate", "check_schedule", "peak_activations", "bubble_fraction", "idle_fraction",
    "split_layers", "check_pipeline_config", "N_MICRO",
]  # fmt: skip
