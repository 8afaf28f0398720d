"""Tensor parallelism (Megatron-LM; Shoeybi et al. 2019): each matrix of a block split over W ranks.

A matrix product Y = X A can be split two ways, and a block chains one of each:

    column-parallel   A = [A_1 ... A_W]      rank r computes Y_r = X A_r        (no communication)
    row-parallel      B = [B_1; ...; B_W]    rank r computes Y_r B_r; Z = sum_r Y_r B_r

c_attn (q, k and v columns split by heads, so each rank owns NH/W whole heads) and c_fc are
column-parallel; both c_proj are row-parallel. Two operators, conjugate to each other, mark where
the ranks talk:

    f: forward y = x (X enters the column-parallel layer on every rank),
       backward dx = sum_r dy_r (each rank's columns send back only their share of dX)
    g: forward y = sum_r x_r (the partial products of the row-parallel layer),
       backward dx_r = dy (every rank already holds the whole dy)

so one block is, on rank r (the bias of a row-parallel layer is added once, after g):

    a  = g(multihead_r(f(LN1(x)) @ c_attn_r + b_attn_r) @ c_proj_r) + b_proj
    m  = g(gelu(f(LN2(x1)) @ c_fc_r + b_fc_r) @ c_proj_r) + b_proj

The token embedding is split by vocabulary rows: rank r looks up the ids of its slice, writes
zeros for the others, and g sums the pieces. The tied head then gives logits for the rank's slice
only (B, T, V/W), and the cross-entropy is computed without ever gathering them: the max and the
sum of exponentials are all-reduced over the slices, and each rank's dlogits is its own slice of
probs - onehot. A vocabulary V that W does not divide is padded with zero rows to W ceil(V/W):
the padded ids never occur, and their logits are set to -inf before the softmax, so they get no
probability and no gradient (the saved model has V rows again).

LayerNorms, wpe and the row-parallel biases are replicated: the activations they touch, and the
gradients flowing into those activations, are the same on every rank (f sums dx before it leaves
a layer, g hands every rank the same dy), so their gradients are identical everywhere and need no
communication.

Book: chapter 15, "One model, many devices".
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ...backend import array_device, array_namespace, take_along_last
from ...checks import require_ids_in_range, require_int, require_shape
from ...config import GPTConfig
from ...layers.attention import multihead_backward, multihead_forward
from ...layers.cross_entropy import cross_entropy_backward
from ...layers.embedding import embedding_backward, embedding_forward
from ...layers.layernorm import layernorm_backward, layernorm_forward
from ...layers.linear import linear_backward, linear_forward
from ...layers.mlp import mlp_backward, mlp_forward
from ...layers.position_learned import position_learned_backward, position_learned_forward
from ...model import block_params, check_params, param_shapes
from .base import Sharded, rank_and_world

# --- the all-reduce (nothing to do on one rank, or outside torch.distributed) -------------------


def all_reduce(x, group=None, op=dist.ReduceOp.SUM):
    """The sum (or max) of ``x`` over the ranks of ``group``, on every rank; x itself on one."""
    if rank_and_world(group)[1] == 1:
        return x
    out = x.clone()  # all_reduce works in place: the input is left untouched
    dist.all_reduce(out, op=op, group=group)
    return out


# --- the conjugate operators ---------------------------------------------------------------------


def f_forward(x, *, group=None):
    """f before a column-parallel layer: y = x, the same on every rank."""
    return x, group


def f_backward(dy, cache):
    """dy (this rank's share) -> (dx = sum over ranks of dy,)."""
    group = cache
    # y = x on every rank, and every rank's y feeds its own columns: dx = sum_r dy_r
    return (all_reduce(dy, group),)


def g_forward(x, *, group=None):
    """g after a row-parallel layer: x (this rank's partial sum) -> y = sum over ranks of x."""
    return all_reduce(x, group), None


def g_backward(dy, cache):
    """dy (the same on every rank) -> (dx = dy,)."""
    # y = sum_r x_r: dy/dx_r = 1, and every rank already holds dy
    return (dy,)


# --- the parallel layers: f, a local column-then-row pair, g, the replicated bias ---------------


def _local_attention_forward(x, w_attn, b_attn, w_proj, b_proj, *, n_head: int):
    """This rank's heads: x (B, T, C) @ w_attn (C, 3C/W), NH/W heads, @ w_proj (C/W, C)."""
    qkv, attn_cache = linear_forward(x, w_attn, b_attn)  # (B, T, 3C/W)
    heads, core_cache = multihead_forward(qkv, n_head=n_head)  # (B, T, C/W)
    y, proj_cache = linear_forward(heads, w_proj, b_proj)  # (B, T, C) a partial sum
    return y, (attn_cache, core_cache, proj_cache)


def _local_attention_backward(dy, cache):
    attn_cache, core_cache, proj_cache = cache
    # y = heads @ w_proj + b_proj
    dheads, dw_proj, db_proj = linear_backward(dy, proj_cache)  # (B, T, C/W)
    # heads = multihead(qkv)
    (dqkv,) = multihead_backward(dheads, core_cache)  # (B, T, 3C/W)
    # qkv = x @ w_attn + b_attn
    dx, dw_attn, db_attn = linear_backward(dqkv, attn_cache)  # (B, T, C)
    return dx, dw_attn, db_attn, dw_proj, db_proj


def _parallel_forward(local_forward, x, w_in, b_in, w_out, b_out, group, **hyperparams):
    """y = g(local(f(x), w_in, b_in, w_out)) + b_out, the shape of both parallel layers."""
    xr, f_cache = f_forward(x, group=group)  # (B, T, C)
    partial, local_cache = local_forward(xr, w_in, b_in, w_out, None, **hyperparams)  # (B, T, C)
    y, g_cache = g_forward(partial, group=group)  # (B, T, C)
    if b_out is not None:
        y = y + b_out  # (B, T, C) the replicated bias, added once
    return y, (f_cache, local_cache, g_cache, b_out is not None)


def _parallel_backward(local_backward, dy, cache):
    xp = array_namespace(dy)
    f_cache, local_cache, g_cache, has_bias = cache
    # y = partial_sum + b_out
    db_out = xp.sum(xp.reshape(dy, (-1, dy.shape[-1])), axis=0) if has_bias else None  # (C,)
    # partial_sum = g(partial)
    (dpartial,) = g_backward(dy, g_cache)  # (B, T, C)
    # partial = local(xr, ...)
    dxr, dw_in, db_in, dw_out, _ = local_backward(dpartial, local_cache)  # (B, T, C)
    # xr = f(x)
    (dx,) = f_backward(dxr, f_cache)  # (B, T, C)
    return dx, dw_in, db_in, dw_out, db_out


def parallel_attention_forward(x, w_attn, b_attn, w_proj, b_proj, *, n_head: int, group=None):
    """x (B, T, C), this rank's w_attn (C, 3C/W), b_attn (3C/W,) or None, w_proj (C/W, C), the
    replicated b_proj (C,) or None, n_head = the rank's NH/W heads -> y (B, T, C) on every rank."""
    require_shape("w_attn", w_attn, (x.shape[-1], None))
    require_shape("w_proj", w_proj, (w_attn.shape[1] // 3, x.shape[-1]))
    return _parallel_forward(_local_attention_forward, x, w_attn, b_attn, w_proj, b_proj, group,
                             n_head=n_head)  # fmt: skip


def parallel_attention_backward(dy, cache):
    """dy (B, T, C) -> (dx, dw_attn, db_attn, dw_proj, db_proj), each weight's grad a shard."""
    return _parallel_backward(_local_attention_backward, dy, cache)


def parallel_mlp_forward(x, w_fc, b_fc, w_proj, b_proj, *, approximate: str = "tanh", group=None):
    """x (B, T, C), this rank's w_fc (C, H/W), b_fc (H/W,), w_proj (H/W, C), the replicated
    b_proj (C,) -> y (B, T, C) on every rank."""
    return _parallel_forward(mlp_forward, x, w_fc, b_fc, w_proj, b_proj, group,
                             approximate=approximate)  # fmt: skip


def parallel_mlp_backward(dy, cache):
    """dy (B, T, C) -> (dx, dw_fc, db_fc, dw_proj, db_proj)."""
    return _parallel_backward(mlp_backward, dy, cache)


# --- the vocabulary-parallel embedding and cross-entropy -----------------------------------------


def _vocab_slice(ids, vocab_start: int, vocab_local: int):
    """ids (B, T) -> (inside (B, T) bool: the id is in this rank's rows, local ids (B, T))."""
    xp = array_namespace(ids)
    inside = (ids >= vocab_start) & (ids < vocab_start + vocab_local)  # (B, T)
    return inside, xp.where(inside, ids - vocab_start, 0)  # (B, T)


def vocab_embedding_forward(idx, wte, *, vocab_start: int, group=None):
    """idx (B, T) global ids, wte (V/W, C) the rows vocab_start.. of this rank -> x (B, T, C)."""
    xp = array_namespace(wte)
    inside, local = _vocab_slice(idx, vocab_start, wte.shape[0])  # (B, T)
    rows, embed_cache = embedding_forward(local, wte)  # (B, T, C)
    mask = xp.astype(inside, wte.dtype)[..., None]  # (B, T, 1)
    x, g_cache = g_forward(rows * mask, group=group)  # (B, T, C) each id found on one rank
    return x, (embed_cache, mask, g_cache)


def vocab_embedding_backward(dx, cache):
    """dx (B, T, C) -> (dwte (V/W, C),): the rows of this rank's ids only."""
    embed_cache, mask, g_cache = cache
    # x = g(rows * mask)
    (dpartial,) = g_backward(dx, g_cache)  # (B, T, C)
    return embedding_backward(dpartial * mask, embed_cache)  # (V/W, C)


def vocab_cross_entropy_forward(logits, targets, *, vocab_start: int, group=None):
    """logits (B, T, V/W) this rank's slice, targets (B, T) global ids -> (loss (), cache).

    loss = mean_n(log sum_v exp(logits_nv) - logits_n[target_n]), with the max, the sum of
    exponentials and the target's logit each all-reduced over the slices (a (B, T) array, never
    the (B, T, V) logits). The max only keeps exp from overflowing: the loss does not depend on
    it, so the backward does not differentiate it."""
    xp = array_namespace(logits)
    V_local = logits.shape[-1]
    inside, local = _vocab_slice(targets, vocab_start, V_local)  # (B, T)
    top = all_reduce(xp.max(logits, axis=-1, keepdims=True), group, dist.ReduceOp.MAX)  # (B, T, 1)
    shifted = logits - top  # (B, T, V/W)
    logsumexp = xp.log(all_reduce(xp.sum(xp.exp(shifted), axis=-1), group))  # (B, T)
    mine = xp.where(inside, take_along_last(shifted, local), 0.0)  # (B, T) where: -inf * 0 = nan
    target_logit = all_reduce(mine, group)  # (B, T)
    loss = xp.sum(logsumexp - target_logit) / math.prod(targets.shape)  # ()
    probs = xp.exp(shifted - logsumexp[..., None])  # (B, T, V/W) this rank's slice of softmax
    # a target outside the slice gets the id V/W, whose one-hot row is all zeros
    return loss, (probs, xp.where(inside, local, V_local))


def vocab_cross_entropy_backward(dloss, cache):
    """dloss (scalar) -> (dlogits (B, T, V/W),) = this rank's slice of (probs - onehot) dloss/N."""
    # loss = mean_n(logsumexp_n - logits_n[target_n]), the slices' terms summed
    return cross_entropy_backward(dloss, cache)


# --- the model --------------------------------------------------------------------------------


def check_tensor_config(cfg: GPTConfig, world_size: int) -> None:
    """ValueError unless ``cfg`` is a GPT-2 model whose heads and MLP split evenly over
    ``world_size`` ranks (any vocabulary: it is padded)."""
    unsupported = {"ln_order": "pre", "norm": "layernorm", "mlp": "gelu", "position": "learned"}
    for name, value in unsupported.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"tensor parallel supports GPT-2's blocks: {name} must be {value!r}, "
                             f"got {getattr(cfg, name)!r}")  # fmt: skip
    if cfg.grouped_attention or cfg.dropout != 0.0:
        raise ValueError("tensor parallel supports GPT-2's attention (n_kv_head=None) without "
                         "dropout")  # fmt: skip
    if cfg.n_head % world_size != 0:
        raise ValueError(f"n_head ({cfg.n_head}) must be divisible by the world size "
                         f"({world_size}): every rank owns whole heads")  # fmt: skip
    if cfg.mlp_hidden_size % world_size != 0:
        raise ValueError(f"the MLP width ({cfg.mlp_hidden_size}) must be divisible by the world "
                         f"size ({world_size})")  # fmt: skip


def shard_rule(name: str) -> str:
    """How parameter ``name`` is split: "rows", "columns", "qkv" (columns of q, k and v, by
    heads) or "replicated"."""
    if name == "wte.weight" or name.endswith("c_proj.weight"):
        return "rows"
    if name.endswith(("attn.c_attn.weight", "attn.c_attn.bias")):
        return "qkv"
    if name.endswith(("mlp.c_fc.weight", "mlp.c_fc.bias")) or name == "lm_head.weight":
        return "columns"
    return "replicated"


def shard_param(name: str, full, rank: int, world_size: int):
    """Rank ``rank``'s part of the full parameter ``name``."""
    rule = shard_rule(name)
    if rule == "replicated":
        return full
    if rule == "rows":
        n = -(-full.shape[0] // world_size)  # ceil: a vocabulary W does not divide is padded
        return _padded(full, 0, n * world_size)[rank * n : (rank + 1) * n]  # (n, ...)
    if rule == "columns":
        return _columns(full, rank, world_size)  # (..., n/W)
    xp = array_namespace(full)
    C = full.shape[-1] // 3
    q, k, v = full[..., :C], full[..., C : 2 * C], full[..., 2 * C :]  # (..., C) each
    parts = [_columns(part, rank, world_size) for part in (q, k, v)]  # (..., C/W) each
    return xp.concat(parts, axis=-1)  # (..., 3C/W)


def _padded(full, axis: int, size: int):
    """``full`` with zeros appended along ``axis`` up to ``size`` (itself when it has that many)."""
    xp = array_namespace(full)
    extra = size - full.shape[axis]
    if extra == 0:
        return full
    shape = list(full.shape)
    shape[axis] = extra
    zeros = xp.zeros(tuple(shape), dtype=full.dtype, device=array_device(full))
    return xp.concat([full, zeros], axis=axis)


def _columns(full, rank: int, world_size: int):
    """The rank-th of world_size equal blocks of columns of ``full`` (..., n), zero-padded to a
    multiple of world_size -> (..., ceil(n/W))."""
    n = -(-full.shape[-1] // world_size)
    return _padded(full, full.ndim - 1, n * world_size)[..., rank * n : (rank + 1) * n]


def unshard_param(name: str, pieces: list, shape: tuple | None = None):
    """The full parameter ``name`` from every rank's part, in rank order; ``shape``: its shape
    without the vocabulary's padding (None: keep what the pieces make)."""
    xp = array_namespace(pieces[0])
    rule = shard_rule(name)
    if rule == "replicated":
        return pieces[0]
    if rule in ("rows", "columns"):
        full = xp.concat(pieces, axis=0 if rule == "rows" else -1)
        return full if shape is None else full[tuple(slice(0, n) for n in shape)]
    n = pieces[0].shape[-1] // 3
    return xp.concat([piece[..., j * n : (j + 1) * n] for j in range(3) for piece in pieces],
                     axis=-1)  # (..., 3C): all q columns, then k, then v  # fmt: skip


class TensorParallel(Sharded):
    """The tensor-parallel mode: ``TensorParallel(cfg, params, group=None)`` on every rank of
    ``group``, from the same full ``params``; ``.params`` holds this rank's shards."""

    def __init__(self, cfg: GPTConfig, params: dict, group=None):
        self.cfg, self.group = cfg, group
        self.rank, self.world_size = rank_and_world(group)
        check_tensor_config(cfg, self.world_size)
        check_params(params, cfg)
        self.shapes = param_shapes(cfg)  # the full shapes, the vocabulary unpadded
        self.params = self.shard(params)
        self.vocab_local = self.params["wte.weight"].shape[0]  # ceil(V / W), padding included
        self.vocab_start = self.rank * self.vocab_local

    def _head(self):
        """This rank's columns of the output head (C, V/W): its wte rows transposed when tied."""
        p = self.params
        return p["wte.weight"].mT if self.cfg.tie_embeddings else p["lm_head.weight"]

    def forward(self, idx, targets):
        """idx, targets (B, T) -> (loss (), cache), the loss the same on every rank."""
        cfg, p, group = self.cfg, self.params, self.group
        for name, ids in (("idx", idx), ("targets", targets)):
            require_int(name, ids)
            require_ids_in_range(name, ids, cfg.vocab_size)
        eps, c = cfg.layer_norm_epsilon, {"blocks": []}
        tok, c["wte"] = vocab_embedding_forward(idx, p["wte.weight"], vocab_start=self.vocab_start,
                                                group=group)  # (B, T, C)  # fmt: skip
        x, c["wpe"] = position_learned_forward(tok, p["wpe.weight"])  # (B, T, C)
        for layer in range(cfg.n_layer):
            x, block_cache = self._block_forward(x, block_params(p, layer))  # (B, T, C)
            c["blocks"].append(block_cache)
        xf, c["ln_f"] = layernorm_forward(x, p["ln_f.weight"], p.get("ln_f.bias"), eps=eps)
        xr, c["f"] = f_forward(xf, group=group)  # (B, T, C) the head is column-parallel
        logits, c["head"] = linear_forward(xr, self._head())  # (B, T, V/W)
        ids = self.vocab_start + torch.arange(self.vocab_local, device=logits.device)  # (V/W,)
        # the padding's logits: -inf, so probability 0 and (probs - onehot) 0, dlogits untouched
        logits = torch.where(ids < cfg.vocab_size, logits, -math.inf)  # (B, T, V/W)
        loss, c["loss"] = vocab_cross_entropy_forward(logits, targets, vocab_start=self.vocab_start,
                                                      group=group)  # ()  # fmt: skip
        return loss, c

    def _block_forward(self, x, p):
        """A pre-LN GPT-2 block with tensor-parallel attention and MLP: x (B, T, C) -> y."""
        cfg, eps, group = self.cfg, self.cfg.layer_norm_epsilon, self.group
        c = {}
        h1, c["ln_1"] = layernorm_forward(x, p["ln_1.weight"], p.get("ln_1.bias"), eps=eps)
        a, c["attn"] = parallel_attention_forward(
            h1, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"), p["attn.c_proj.weight"],
            p.get("attn.c_proj.bias"), n_head=cfg.n_head // self.world_size, group=group)
        x1 = x + a  # (B, T, C)
        h2, c["ln_2"] = layernorm_forward(x1, p["ln_2.weight"], p.get("ln_2.bias"), eps=eps)
        m, c["mlp"] = parallel_mlp_forward(
            h2, p["mlp.c_fc.weight"], p.get("mlp.c_fc.bias"), p["mlp.c_proj.weight"],
            p.get("mlp.c_proj.bias"), approximate=cfg.gelu_approximate, group=group)
        return x1 + m, c  # (B, T, C)

    @staticmethod
    def _block_backward(dy, c):
        """dy (B, T, C) -> (dx, the block's grads by name)."""
        grads = {}

        def named(prefix, names, values):
            grads.update({f"{prefix}.{n}": v for n, v in zip(names, values) if v is not None})

        # y = x1 + m, m = mlp(h2), h2 = LN2(x1)
        dh2, *dmlp = parallel_mlp_backward(dy, c["mlp"])  # (B, T, C)
        named("mlp", ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"), dmlp)
        dx1_ln, *dln2 = layernorm_backward(dh2, c["ln_2"])  # (B, T, C)
        named("ln_2", ("weight", "bias"), dln2)
        dx1 = dy + dx1_ln  # (B, T, C)
        # x1 = x + a, a = attn(h1), h1 = LN1(x)
        dh1, *dattn = parallel_attention_backward(dx1, c["attn"])  # (B, T, C)
        named("attn", ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias"), dattn)
        dx_ln, *dln1 = layernorm_backward(dh1, c["ln_1"])  # (B, T, C)
        named("ln_1", ("weight", "bias"), dln1)
        return dx1 + dx_ln, grads  # (B, T, C)

    def backward(self, c) -> dict:
        """The gradients of this rank's shards, by name, from the forward's cache."""
        cfg, p = self.cfg, self.params
        grads = {}
        (dlogits,) = vocab_cross_entropy_backward(1.0, c["loss"])  # (B, T, V/W)
        # logits = xr @ head
        dxr, dhead, _ = linear_backward(dlogits, c["head"])  # (B, T, C) this rank's share
        (dxf,) = f_backward(dxr, c["f"])  # (B, T, C)
        # xf = LN_f(x)
        dx, *dln_f = layernorm_backward(dxf, c["ln_f"])  # (B, T, C)
        grads.update({n: g for n, g in zip(("ln_f.weight", "ln_f.bias"), dln_f) if g is not None})
        for layer in reversed(range(cfg.n_layer)):
            dx, dblock = self._block_backward(dx, c["blocks"][layer])  # (B, T, C)
            grads.update({f"h.{layer}.{name}": g for name, g in dblock.items()})
        # x = tok + wpe[:T]
        dtok, grads["wpe.weight"] = position_learned_backward(dx, c["wpe"])  # (B, T, C)
        # tok = wte[idx], and (tied) head = wte^T: a shared matrix sums the grads of both uses
        (dwte,) = vocab_embedding_backward(dtok, c["wte"])  # (V/W, C)
        if cfg.tie_embeddings:
            grads["wte.weight"] = dwte + dhead.mT  # (V/W, C)
        else:
            grads["wte.weight"], grads["lm_head.weight"] = dwte, dhead
        return {name: grads[name] for name in p}

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        """The global batch idx, targets (B, T) -> (mean loss, grads of this rank's shards).
        ``dropout_seed`` is accepted for the training loop and unused: the model has no dropout."""
        loss, cache = self.forward(idx, targets)
        return float(loss), self.backward(cache)

    def grad_norm(self, grads: dict) -> float:
        """The norm of the whole model's gradient: the shards' squares summed over ranks, the
        replicated gradients (identical everywhere) counted once."""
        sharded = sum(float(torch.sum(g * g)) for n, g in grads.items()
                      if shard_rule(n) != "replicated")  # fmt: skip
        replicated = sum(float(torch.sum(g * g)) for n, g in grads.items()
                         if shard_rule(n) == "replicated")  # fmt: skip
        total = all_reduce(torch.tensor([sharded], dtype=torch.float64), self.group)
        return math.sqrt(float(total[0]) + replicated)

    def shard(self, full: dict) -> dict:
        """This rank's part of full tensors named like ``params`` (parameters or moments)."""
        return {name: shard_param(name, value, self.rank, self.world_size)
                for name, value in full.items()}  # fmt: skip

    def unshard(self, local: dict) -> dict:
        """Every rank's parts all-gathered into full tensors, on every rank (a collective)."""
        full = {}
        for name, value in local.items():
            if shard_rule(name) == "replicated" or self.world_size == 1:
                full[name] = value
                continue
            pieces = [torch.empty_like(value) for _ in range(self.world_size)]
            dist.all_gather(pieces, value.contiguous(), group=self.group)
            full[name] = unshard_param(name, pieces, self.shapes[name])
        return full

__all__ = [
    "TensorParallel", "f_forward", "f_backward", "g_forward", "g_backward",
    "parallel_attention_forward", "parallel_attention_backward", "parallel_mlp_forward",
    "parallel_mlp_backward", "vocab_embedding_forward", "vocab_embedding_backward",
    "vocab_cross_entropy_forward", "vocab_cross_entropy_backward", "check_tensor_config",
    "shard_rule", "shard_param", "unshard_param", "all_reduce",
]  # fmt: skip
