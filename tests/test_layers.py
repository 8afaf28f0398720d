"""Every layer's hand-written backward, checked three ways (DESIGN.md section 4):

1. against central finite differences in float64 on numpy, torch and array_api_strict (the
   strict arrays live on a second fake device, so a creation call without ``device=`` fails);
2. against torch autograd of the same forward (numpy and torch inputs);
3. NumPy vs torch (and strict) parity of forward and backward, within 1e-12;

plus a float32 torch sanity run per layer and the layer-specific facts (the softmax Jacobian,
the dropout mask, the two attention backwards, sdpa against the GPT core and torch's SDPA). Every layer is ONE row of ``CASES``.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
from bounds import assert_relative, margin, record, roundoff

from conftest import (
    AUTOGRAD_BACKENDS,
    BACKENDS,
    get_backend,
    random_attention_mask,
    requires_cuda,
    to_host,
)
from gptlab.backend import array_device
from gptlab.backend import asarray_like  # the rotation stand-in of the gqa rows
from gptlab.backend import array_namespace
from gptlab.gradcheck import FLOOR, GradcheckEntry, GradcheckResult, check_layer
from gptlab.layers.attention import (
    attention_backward,
    attention_forward,
    causal_mask_rows,
    merge_heads,
    multihead_backward,
    multihead_forward,
    split_heads,
    split_qkv,
)
from gptlab.layers.attention_single import (
    attention_single_backward,
    attention_single_backward_compact,
    attention_single_forward,
)
from gptlab.layers.block import block_backward, block_forward, block_param_shapes
from gptlab.layers.bradley_terry import bradley_terry_backward, bradley_terry_forward
from gptlab.layers.chunked_classifier import chunked_classifier_backward, chunked_classifier_forward
from gptlab.layers.dpo import dpo_backward, dpo_forward
from gptlab.layers.flash_attention import flash_attention_backward, flash_attention_forward
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.distillation import distillation_backward, distillation_forward
from gptlab.layers.dropout import dropout_backward, dropout_forward
from gptlab.layers.embedding import (
    embedding_backward,
    embedding_forward,
    embedding_onehot_backward,
    embedding_onehot_forward,
)
from gptlab.layers.gelu import gelu_backward, gelu_forward
from gptlab.layers.gqa import (
    gqa_attention_backward,
    gqa_attention_forward,
    gqa_attention_step,
    gqa_backward,
    gqa_forward,
    kv_cache_size,
)
from gptlab.layers.layernorm import layernorm_backward, layernorm_forward
from gptlab.layers.linear import linear_backward, linear_forward
from gptlab.layers.logistic import logistic_backward, logistic_forward
from gptlab.layers.mlp import mlp_backward, mlp_forward
from gptlab.layers.moe import moe_backward, moe_forward
from gptlab.layers.ppo import ppo_backward, ppo_forward
from gptlab.layers.position_learned import position_learned_backward, position_learned_forward
from gptlab.layers.position_sinusoidal import (
    position_sinusoidal_backward,
    position_sinusoidal_forward,
)
from gptlab.layers.position_sinusoidal import position_shift_matrix
from gptlab.layers.relu import relu_backward, relu_forward
from gptlab.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gptlab.layers.rope import ROPE_PAIRINGS, rope_backward, rope_forward, rope_rotation_matrix
from gptlab.layers.router import router_backward, router_forward, top_k_experts
from gptlab.layers.sdpa import sdpa_backward, sdpa_forward
from gptlab.layers.silu import silu_backward, silu_forward
from gptlab.layers.softmax import softmax_backward, softmax_forward, softmax_jacobian
from gptlab.layers.swiglu import swiglu_backward, swiglu_forward
from gptlab.layers.token_logprobs import token_logprobs_backward, token_logprobs_forward
from gptlab.layers.value_loss import value_loss_backward, value_loss_forward

B, T, C, NH, V, BLOCK_SIZE, HS = 2, 3, 4, 2, 5, 5, 3  # tiny shapes: batch, time, width, ...
TOL_FLOAT64 = 1e-7
# A layer of the table in float32 against autograd in float64 (relative error in norm): the
# longest sum of these shapes is the MLP's 4C = 16 hidden units, in a forward and a backward.
FLOAT32_TABLE = roundoff("float32", 4 * C, steps=2, why="4C hidden units, forward and backward")
pytestmark = pytest.mark.roundoff  # the gradient-check table: finite differences, autograd, parity

TOL_PARITY = 1e-12


# --------------------------------------------------------------------------------------------
# The table. ``make(rng)`` returns the forward's positional inputs as NumPy values (float64
# arrays, int64 token ids, dicts of float64 arrays); the tests move them onto a backend.


@dataclass(frozen=True)
class Case:
    id: str
    forward: Callable
    backward: Callable
    make: Callable[[np.random.Generator], tuple]
    hyperparams: dict = field(default_factory=dict)

    @property
    def bound_forward(self):
        """The forward with its hyperparameters bound (``check_layer`` has its own ``eps`` and
        ``seed`` keywords, which LayerNorm and dropout also use)."""
        return functools.partial(self.forward, **self.hyperparams)

    def inputs(self, backend, seed: int = 0):
        return tuple(backend.convert(a) for a in self.make(np.random.default_rng(seed)))


def _normal(rng, *shape):
    return rng.standard_normal(shape)


def _away_from_zero(rng, *shape):
    """Normal values with |x| >= 0.1: finite differences never straddle ReLU's kink."""
    x = rng.standard_normal(shape)
    return np.sign(x) * (0.1 + np.abs(x))


def _ids(rng, high, *shape):
    return rng.integers(0, high, size=shape, dtype=np.int64)


def _block_params(rng, bias=True):
    shapes = block_param_shapes(C, bias=bias)
    p = {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}
    p["ln_1.weight"] += 1.0
    p["ln_2.weight"] += 1.0
    return p


def _attention_args(rng, batch=B, t=T, c=C):
    return (_normal(rng, batch, t, c), 0.5 * _normal(rng, c, 3 * c), _normal(rng, 3 * c),
            _normal(rng, c, c), _normal(rng, c))  # fmt: skip


# B = NH = 2 in the rows above, so a backward that reads the batch axis for the head axis would
# pass them: these rows have batch 3, 2 heads, 5 positions and head size 4 (C = 8), all different
ASYM_B, ASYM_NH, ASYM_T, ASYM_C = 3, 2, 5, 8


def _attention_single_args(*batch):
    def make(rng):
        return (_normal(rng, *batch, C, T), _normal(rng, HS, C), _normal(rng, HS, C),
                _normal(rng, HS, C))  # fmt: skip

    return make


def _sdpa_args(q_lead, Tq, Tk, *, kv_lead=None, hv=HS, mask_lead=None):
    """q (*q_lead, Tq, HS), k (*kv_lead, Tk, HS), v (*kv_lead, Tk, hv) and, when ``mask_lead`` is
    given, a random boolean mask (*mask_lead, Tq, Tk) in which every query keeps a key."""
    kv_lead = q_lead if kv_lead is None else kv_lead

    def make(rng):
        q, k = _normal(rng, *q_lead, Tq, HS), _normal(rng, *kv_lead, Tk, HS)
        v = _normal(rng, *kv_lead, Tk, hv)
        if mask_lead is None:
            return q, k, v
        return q, k, v, random_attention_mask(rng, (*mask_lead, Tq, Tk))

    return make


def _mlp_args(rng):
    return (_normal(rng, B, T, C), _normal(rng, C, 4 * C), _normal(rng, 4 * C),
            _normal(rng, 4 * C, C), _normal(rng, C))  # fmt: skip


def _swiglu_args(rng, H=6):
    return (_normal(rng, B, T, C), 0.5 * _normal(rng, C, H), 0.5 * _normal(rng, C, H),
            0.5 * _normal(rng, H, C))  # fmt: skip


ROPE_HS = 6  # an even head size: RoPE turns pairs of coordinates


def _gqa_args(n_head, n_kv_head, Tq, Tk, *, masked=False):
    """q (B, NH, Tq, HS), k and v (B, NKV, Tk, HS) and, when ``masked``, a random boolean mask
    (B, NH, Tq, Tk) in which every query keeps a key."""

    def make(rng):
        q = _normal(rng, B, n_head, Tq, HS)
        k, v = _normal(rng, B, n_kv_head, Tk, HS), _normal(rng, B, n_kv_head, Tk, HS)
        return (q, k, v, random_attention_mask(rng, (B, n_head, Tq, Tk))) if masked else (q, k, v)

    return make


E, MARGIN = 4, 0.5  # experts (E <= C); the gap between a token's consecutive router logits


def _pair_as_one_output(forward, backward):
    """A layer whose output is a pair (moe's (y, aux), the router's (gates, aux)) as a layer with
    ONE flat output [y.ravel(), aux], so that every check of the table differentiates
    F = sum(y * dy) + aux * daux: both outputs, both gradient paths. ``functools.wraps`` keeps
    the layer's name, module and argument names."""

    @functools.wraps(forward)
    def forward_flat(*args, **hyperparams):
        (y, aux), cache = forward(*args, **hyperparams)
        xp = array_namespace(y)
        return xp.concat([xp.reshape(y, (-1,)), xp.reshape(aux, (1,))]), (cache, tuple(y.shape))

    @functools.wraps(backward)
    def backward_flat(dout, cache):
        cache, shape = cache
        xp = array_namespace(dout)
        n = math.prod(shape)
        return backward((xp.reshape(dout[:n], shape), dout[n]), cache)

    return forward_flat, backward_flat


MOE = _pair_as_one_output(moe_forward, moe_backward)
ROUTER = _pair_as_one_output(router_forward, router_backward)


def _moe_args(rng):
    """x (B, T, C) and the weights of E experts, the router logits built FIRST with a clear
    margin: each token's logits are a shuffled MARGIN * [0, 1, ..., E-1] plus noise below
    MARGIN / 4, so consecutive logits stay more than 0.75 MARGIN apart, and
    x = logits @ pinv(w_router) gives exactly those logits (w_router = 2 Q, Q orthogonal (C, E)).
    No finite-difference step then changes the top-k choice: near a tie the layer jumps, and
    finite differences there measure the jump, not the gradient."""
    w_router = 2.0 * np.linalg.qr(_normal(rng, C, E))[0]  # (C, E)
    order = np.stack([rng.permutation(E) for _ in range(B * T)])  # (B*T, E)
    logits = MARGIN * order + rng.uniform(0.0, MARGIN / 4, (B * T, E))  # (B*T, E)
    x = np.reshape(logits @ np.linalg.pinv(w_router), (B, T, C))
    experts = [0.5 * _normal(rng, *shape) for shape in ((E, C, 4 * C), (E, 4 * C), (E, 4 * C, C),
                                                        (E, C))]  # fmt: skip
    return (x, w_router, *experts)


def _router_args(k):
    """logits (B*T, E) and k distinct experts per token (any choice: the router is smooth in the
    logits for a fixed choice, so no margin is needed here)."""

    def make(rng):
        experts = np.stack([rng.permutation(E)[:k] for _ in range(B * T)])  # (B*T, k)
        return _normal(rng, B * T, E), experts

    return make


def _gqa_attention_args(n_head, n_kv_head, hs=2):
    """x (B, T, C), wq (C, NH*hs), wk and wv (C, NKV*hs), wo (NH*hs, C)."""

    def make(rng):
        return (_normal(rng, B, T, C), 0.5 * _normal(rng, C, n_head * hs),
                0.5 * _normal(rng, C, n_kv_head * hs), _normal(rng, C, n_kv_head * hs),
                _normal(rng, n_head * hs, C))  # fmt: skip

    return make


def _random_rotations(positions, hs, seed=0):
    """(positions, hs, hs): a seeded orthogonal matrix per position."""
    return np.linalg.qr(np.random.default_rng(seed).standard_normal((positions, hs, hs)))[0]


def _rotation_pair(R, start=0):
    """A stand-in for rotary embeddings, on any backend: the layer pair that turns row t of
    a (..., T, hs) by R[start + t] (hs, hs), a = a @ R, and its backward da = da_rotated @ R^T."""

    def rotate_forward(a):
        r = asarray_like(R[start : start + a.shape[-2]], a)  # (T, hs, hs)
        return (a[..., None, :] @ r)[..., 0, :], r  # (..., T, hs)

    def rotate_backward(da, r):
        return ((da[..., None, :] @ r.mT)[..., 0, :],)  # (..., T, hs)

    return rotate_forward, rotate_backward


# issue 14, model variants: the block with LLaMA's parts (RMSNorm, SwiGLU, grouped-query attention
# with RoPE) and with a mixture of experts
LLAMA_BLOCK = {"n_head": NH, "n_kv_head": 1, "norm": "rmsnorm", "mlp": "swiglu",
               "rope_base": 10000.0}
MOE_BLOCK = {"n_head": NH, "mlp": "moe", "moe": {"k": 2, "capacity_factor": 1.0,
                                                 "aux_weight": 0.5}}  # fmt: skip
MOE_BLOCK_PAIR = _pair_as_one_output(block_forward, block_backward)


def _variant_block_args(rng, *, n_head, n_kv_head=None, norm="layernorm", mlp="gelu", **_):
    """x (B, T, C) and block parameters for these parts (biases only where the part has them);
    a MoE's router scaled up so that every token's router logits lie far apart and no
    finite-difference step changes its choice of experts."""
    shapes = block_param_shapes(C, n_head=n_head, n_kv_head=n_kv_head, norm=norm, mlp=mlp,
                                n_expert=E, hidden=6)  # fmt: skip
    p = {name: 0.5 * rng.standard_normal(shape) for name, shape in shapes.items()}
    p["ln_1.weight"] += 1.0
    p["ln_2.weight"] += 1.0
    if mlp == "moe":
        p["mlp.router.weight"] *= 5.0
    return _normal(rng, B, T, C), p


# issue 15, learning from preferences: the losses of the reward model, PPO and DPO
PAIRS = 5  # preference pairs


def _logprobs(rng, *shape):
    """Negative numbers, like the log-probabilities of sampled answers."""
    return -0.5 - np.abs(rng.standard_normal(shape))


def _ppo_args(rng, clip_eps=0.2):
    """logp, old_logp, advantages (B, T) = (2, 3): each of the six actions is one combination of
    the advantage's sign with a ratio below, inside or above [1 - eps, 1 + eps] (in shuffled
    places), so every branch of the min and the clip carries gradient: below with A > 0 and above
    with A < 0 take the unclipped term, below with A < 0 and above with A > 0 the clipped one.
    Every ratio is at least 0.05 from the edges and every advantage at least 0.3 from 0: no
    finite-difference step switches a branch."""
    old_logp = _logprobs(rng, B, T)
    sides = {"below": (0.5, 1.0 - clip_eps - 0.1), "inside": (0.95, 1.05),
             "above": (1.0 + clip_eps + 0.1, 1.8)}  # fmt: skip
    combos = [(sign, side) for sign in (1.0, -1.0) for side in sides]  # the B * T = 6 actions
    ratio = np.array([rng.choice(sides[side]) for _, side in combos])  # (6,)
    advantages = np.array([sign for sign, _ in combos]) * (0.3 + np.abs(_normal(rng, B * T)))
    order = rng.permutation(B * T)  # (6,)
    ratio, advantages = ratio[order].reshape(B, T), advantages[order].reshape(B, T)
    return old_logp + np.log(ratio), old_logp, advantages


CASES = [
    Case("embedding", embedding_forward, embedding_backward,
         lambda rng: (_ids(rng, V, B, T), _normal(rng, V, C))),
    Case("embedding_onehot", embedding_onehot_forward, embedding_onehot_backward,
         lambda rng: (_ids(rng, V, B, T), _normal(rng, V, C))),
    Case("position_learned", position_learned_forward, position_learned_backward,
         lambda rng: (_normal(rng, B, T, C), _normal(rng, BLOCK_SIZE, C))),
    Case("position_sinusoidal", position_sinusoidal_forward, position_sinusoidal_backward,
         lambda rng: (_normal(rng, B, T, C),)),
    Case("linear", linear_forward, linear_backward,
         lambda rng: (_normal(rng, B, T, C), _normal(rng, C, 3), _normal(rng, 3))),
    Case("linear_nobias", linear_forward, linear_backward,
         lambda rng: (_normal(rng, B, T, C), _normal(rng, C, 3))),
    Case("relu", relu_forward, relu_backward, lambda rng: (_away_from_zero(rng, B, T, C),)),
    Case("gelu_tanh", gelu_forward, gelu_backward, lambda rng: (2 * _normal(rng, B, T, C),),
         {"approximate": "tanh"}),
    Case("gelu_none", gelu_forward, gelu_backward, lambda rng: (2 * _normal(rng, B, T, C),),
         {"approximate": "none"}),
    Case("softmax_last", softmax_forward, softmax_backward, lambda rng: (_normal(rng, B, T, C),),
         {"axis": -1}),
    Case("softmax_axis0", softmax_forward, softmax_backward, lambda rng: (_normal(rng, B, T, C),),
         {"axis": 0}),
    Case("dropout_p0", dropout_forward, dropout_backward, lambda rng: (_normal(rng, B, T, C),),
         {"p": 0.0, "seed": 7}),
    Case("dropout_p0.5", dropout_forward, dropout_backward, lambda rng: (_normal(rng, B, T, C),),
         {"p": 0.5, "seed": 7}),
    Case("layernorm", layernorm_forward, layernorm_backward,
         lambda rng: (_normal(rng, B, T, C), 1 + _normal(rng, C), _normal(rng, C))),
    Case("layernorm_nobias", layernorm_forward, layernorm_backward,
         lambda rng: (_normal(rng, B, T, C), 1 + _normal(rng, C))),
    Case("attention_single", attention_single_forward, attention_single_backward,
         _attention_single_args(), {"causal": False}),
    Case("attention_single_causal", attention_single_forward, attention_single_backward,
         _attention_single_args(B), {"causal": True}),
    Case("attention_single_compact", attention_single_forward, attention_single_backward_compact,
         _attention_single_args(), {"causal": False}),
    Case("attention_single_compact_causal", attention_single_forward,
         attention_single_backward_compact, _attention_single_args(B), {"causal": True}),
    Case("multihead", multihead_forward, multihead_backward,
         lambda rng: (_normal(rng, B, T, 3 * C),), {"n_head": NH, "causal": False}),
    Case("multihead_causal", multihead_forward, multihead_backward,
         lambda rng: (_normal(rng, B, T, 3 * C),), {"n_head": NH, "causal": True}),
    Case("attention", attention_forward, attention_backward, _attention_args,
         {"n_head": NH, "causal": False}),
    Case("attention_causal", attention_forward, attention_backward, _attention_args,
         {"n_head": NH, "causal": True}),
    Case("multihead_B3_causal", multihead_forward, multihead_backward,
         lambda rng: (_normal(rng, ASYM_B, ASYM_T, 3 * ASYM_C),),
         {"n_head": ASYM_NH, "causal": True}),
    Case("attention_B3", attention_forward, attention_backward,
         lambda rng: _attention_args(rng, ASYM_B, ASYM_T, ASYM_C),
         {"n_head": ASYM_NH, "causal": False}),
    Case("sdpa", sdpa_forward, sdpa_backward, _sdpa_args((B, NH), T, T), {"causal": False}),
    Case("sdpa_causal", sdpa_forward, sdpa_backward, _sdpa_args((B, NH), T, T), {"causal": True}),
    Case("sdpa_T1", sdpa_forward, sdpa_backward, _sdpa_args((B, NH), 1, 1), {"causal": True}),
    Case("sdpa_Tq_lt_Tk_causal_hv", sdpa_forward, sdpa_backward,
         _sdpa_args((B, NH), 2, 4, hv=2), {"causal": True}),
    Case("sdpa_Tq_gt_Tk_mask", sdpa_forward, sdpa_backward,
         _sdpa_args((B, NH), 4, 2, mask_lead=(B, NH)), {"causal": False}),
    Case("sdpa_mask_causal", sdpa_forward, sdpa_backward,
         _sdpa_args((B, NH), 3, 4, mask_lead=(B, NH)), {"causal": True}),
    Case("sdpa_broadcast", sdpa_forward, sdpa_backward,
         _sdpa_args((B, NH), 3, 4, kv_lead=(B, 1), hv=2, mask_lead=(1,)), {"causal": True}),
    # one key/value head shared by NH query heads (multi-query): dk, dv summed over the heads
    Case("sdpa_shared_kv_head", sdpa_forward, sdpa_backward,
         _sdpa_args((B, NH), T, T, kv_lead=(B, 1)), {"causal": True}),
    Case("sdpa_lead3_scale", sdpa_forward, sdpa_backward,
         _sdpa_args((2, 1, 2), T, T, kv_lead=(2, 2, 1), mask_lead=()), {"scale": 0.3}),
    Case("sdpa_no_lead", sdpa_forward, sdpa_backward, _sdpa_args((), 3, 4, hv=1), {"causal": True}),
    # leading dims that differ in number: the gradients of the input with fewer are summed over
    # the extra ones (batch 2, 4 heads, Tq 5, Tk 6, hs 3, hv 1: no two sizes alike)
    Case("sdpa_kv_without_lead", sdpa_forward, sdpa_backward,
         _sdpa_args((2, 4), 5, 6, kv_lead=(), hv=1), {"causal": True}),
    Case("sdpa_kv_one_lead_fewer_mask", sdpa_forward, sdpa_backward,
         _sdpa_args((2, 4), 5, 6, kv_lead=(4,), hv=1, mask_lead=(4,)), {"causal": False}),
    Case("sdpa_q_one_lead_fewer", sdpa_forward, sdpa_backward,
         _sdpa_args((4,), 5, 6, kv_lead=(2, 4), hv=1), {"causal": True}),
    Case("gqa_multihead", gqa_forward, gqa_backward, _gqa_args(2, 2, T, T), {"causal": True}),
    Case("gqa_grouped", gqa_forward, gqa_backward, _gqa_args(4, 2, T, T), {"causal": False}),
    Case("gqa_grouped_Tq_lt_Tk_causal", gqa_forward, gqa_backward, _gqa_args(4, 2, 2, 4),
         {"causal": True}),
    Case("gqa_multiquery", gqa_forward, gqa_backward, _gqa_args(3, 1, T, T), {"causal": True}),
    Case("gqa_multiquery_Tq_gt_Tk_mask", gqa_forward, gqa_backward,
         _gqa_args(3, 1, 4, 2, masked=True), {"causal": False}),
    Case("gqa_attention_grouped", gqa_attention_forward, gqa_attention_backward,
         _gqa_attention_args(4, 2), {"n_head": 4, "n_kv_head": 2}),
    Case("gqa_attention_multiquery", gqa_attention_forward, gqa_attention_backward,
         _gqa_attention_args(2, 1, hs=3), {"n_head": 2, "n_kv_head": 1, "causal": False}),
    Case("gqa_attention_rotate", gqa_attention_forward, gqa_attention_backward,
         _gqa_attention_args(4, 2), {"n_head": 4, "n_kv_head": 2,
                                     "rotate": _rotation_pair(_random_rotations(T, 2))}),
    Case("mlp", mlp_forward, mlp_backward, _mlp_args, {"approximate": "tanh"}),
    Case("block_pre", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng)), {"n_head": NH, "ln_order": "pre"}),
    Case("block_post", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng)), {"n_head": NH, "ln_order": "post"}),
    Case("block_pre_nobias", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng, bias=False)),
         {"n_head": NH, "ln_order": "pre"}),
    Case("block_post_nobias", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng, bias=False)),
         {"n_head": NH, "ln_order": "post"}),
    Case("block_pre_dropout", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng)),
         {"n_head": NH, "ln_order": "pre", "dropout": 0.25, "seed": 3}),
    Case("block_post_dropout", block_forward, block_backward,
         lambda rng: (_normal(rng, B, T, C), _block_params(rng)),
         {"n_head": NH, "ln_order": "post", "dropout": 0.25, "seed": 3}),
    Case("cross_entropy", cross_entropy_forward, cross_entropy_backward,
         lambda rng: (2 * _normal(rng, B, T, V), _ids(rng, V, B, T))),
    # issue 14: RMSNorm, SiLU, SwiGLU, RoPE
    Case("rmsnorm", rmsnorm_forward, rmsnorm_backward,
         lambda rng: (_normal(rng, B, T, C), 1 + _normal(rng, C)), {"eps": 1e-6}),
    Case("silu", silu_forward, silu_backward, lambda rng: (3 * _normal(rng, B, T, C),)),
    Case("swiglu", swiglu_forward, swiglu_backward, _swiglu_args),
    Case("rope", rope_forward, rope_backward, lambda rng: (_normal(rng, B, NH, T, ROPE_HS),)),
    Case("rope_start", rope_forward, rope_backward,
         lambda rng: (_normal(rng, B, NH, T, ROPE_HS),), {"start": 5}),
    Case("rope_adjacent_start", rope_forward, rope_backward,
         lambda rng: (_normal(rng, B, NH, T, ROPE_HS),), {"pairing": "adjacent", "start": 5}),
    Case("rope_no_lead_base", rope_forward, rope_backward, lambda rng: (_normal(rng, T, 4),),
         {"base": 100.0, "start": 2, "pairing": "adjacent"}),
    Case("router_k2_renormalized", *ROUTER, _router_args(2),
         {"renormalize": True, "aux_weight": 0.5}),
    Case("router_k1_raw", *ROUTER, _router_args(1), {"renormalize": False, "aux_weight": 0.5}),
    Case("moe_k1_switch", *MOE, _moe_args, {"k": 1, "renormalize": False, "aux_weight": 0.0}),
    Case("moe_k1_renormalized_aux", *MOE, _moe_args,
         {"k": 1, "renormalize": True, "aux_weight": 1.0}),
    Case("moe_k2_mixtral", *MOE, _moe_args, {"k": 2, "renormalize": True, "aux_weight": 0.0}),
    Case("moe_k2_raw_aux", *MOE, _moe_args, {"k": 2, "renormalize": False, "aux_weight": 0.5}),
    Case("moe_k1_capacity_drops", *MOE, _moe_args,
         {"k": 1, "renormalize": False, "capacity_factor": 0.5, "aux_weight": 0.5}),
    Case("moe_k2_capacity_drops", *MOE, _moe_args,
         {"k": 2, "renormalize": True, "capacity_factor": 0.5, "aux_weight": 0.5}),
    # issue 14, model variants: blocks with LLaMA's parts and with experts
    Case("block_llama", block_forward, block_backward,
         lambda rng: _variant_block_args(rng, **LLAMA_BLOCK), LLAMA_BLOCK),
    Case("block_llama_post_dropout", block_forward, block_backward,
         lambda rng: _variant_block_args(rng, **LLAMA_BLOCK),
         {**LLAMA_BLOCK, "ln_order": "post", "dropout": 0.25, "seed": 3}),
    Case("block_moe_pair", *MOE_BLOCK_PAIR, lambda rng: _variant_block_args(rng, **MOE_BLOCK),
         MOE_BLOCK),
    # issue 15: the quality classifier's loss (sigmoid + binary cross-entropy)
    Case("logistic", logistic_forward, logistic_backward,
         lambda rng: (3 * _normal(rng, B, T), _ids(rng, 2, B, T))),
    Case("logistic_column", logistic_forward, logistic_backward,
         lambda rng: (20 * _normal(rng, 7, 1), _ids(rng, 2, 7, 1))),
    # issue 15: learning from preferences (reward model, PPO, DPO)
    Case("token_logprobs", token_logprobs_forward, token_logprobs_backward,
         lambda rng: (2 * _normal(rng, B, T, V), _ids(rng, V, B, T))),
    Case("bradley_terry", bradley_terry_forward, bradley_terry_backward,
         lambda rng: (2 * _normal(rng, PAIRS), 2 * _normal(rng, PAIRS))),
    Case("dpo", dpo_forward, dpo_backward,
         lambda rng: tuple(4 * _logprobs(rng, PAIRS) for _ in range(4)), {"beta": 0.5}),
    Case("ppo", ppo_forward, ppo_backward, _ppo_args, {"clip_eps": 0.2}),
    Case("value_loss", value_loss_forward, value_loss_backward,
         lambda rng: (_normal(rng, B, T), _normal(rng, B, T))),
    # issue 15: the knowledge-distillation loss (student logits, teacher logits, targets)
    Case("distillation", distillation_forward, distillation_backward,
         lambda rng: (2 * _normal(rng, B, T, V), 2 * _normal(rng, B, T, V), _ids(rng, V, B, T)),
         {"tau": 2.0, "alpha": 0.7}),
    Case("distillation_tau_below_1", distillation_forward, distillation_backward,
         lambda rng: (_normal(rng, B, T, V), _normal(rng, B, T, V), _ids(rng, V, B, T)),
         {"tau": 0.5, "alpha": 0.3}),
    Case("distillation_soft_only", distillation_forward, distillation_backward,
         lambda rng: (3 * _normal(rng, B, T, V), 3 * _normal(rng, B, T, V)),
         {"tau": 4.0, "alpha": 1.0}),
    # issue 11: flash attention (tiles smaller than T, uneven) and the chunked classifier
    Case("flash_attention", flash_attention_forward, flash_attention_backward,
         _sdpa_args((B, NH), 5, 5), {"causal": False, "block_q": 2, "block_k": 3}),
    Case("flash_attention_causal", flash_attention_forward, flash_attention_backward,
         _sdpa_args((B, NH), 5, 5), {"causal": True, "block_q": 3, "block_k": 2}),
    Case("flash_attention_Tq_lt_Tk_causal_broadcast", flash_attention_forward,
         flash_attention_backward, _sdpa_args((B, NH), 3, 5, kv_lead=(B, 1), hv=2),
         {"causal": True, "scale": 0.7, "block_q": 2, "block_k": 2}),
    Case("flash_attention_T1", flash_attention_forward, flash_attention_backward,
         _sdpa_args((B, NH), 1, 1), {"causal": True}),
    Case("flash_attention_kv_without_lead", flash_attention_forward, flash_attention_backward,
         _sdpa_args((2, 4), 5, 6, kv_lead=(), hv=1), {"causal": True, "block_q": 2, "block_k": 4}),
    Case("flash_attention_q_one_lead_fewer", flash_attention_forward, flash_attention_backward,
         _sdpa_args((4,), 5, 6, kv_lead=(2, 4), hv=1), {"causal": False, "block_q": 3,
                                                        "block_k": 4}),
    Case("chunked_classifier", chunked_classifier_forward, chunked_classifier_backward,
         lambda rng: (_normal(rng, B, T, C), _normal(rng, V, C), _ids(rng, V, B, T)),
         {"chunk_size": 4}),
    Case("chunked_classifier_one_chunk", chunked_classifier_forward, chunked_classifier_backward,
         lambda rng: (_normal(rng, B, T, C), _normal(rng, V, C), _ids(rng, V, B, T))),
]  # fmt: skip
CASE_IDS = [case.id for case in CASES]


STRICT_MAX_ELEMENTS = 16  # strict arrays are slow; their run is about portability, not numerics


def gradcheck(case: Case, backend, oracle: str, **kwargs) -> GradcheckResult:
    """``check_layer`` on one table row, on one backend. On the strict backend finite
    differences check a seeded subset of at most 16 entries per input: every forward and backward
    line still runs there (that is what the strict run is for), while numpy and torch check every
    entry."""
    if backend.name == "strict" and oracle == "finite_differences":
        kwargs.setdefault("max_elements", STRICT_MAX_ELEMENTS)
    return check_layer(case.bound_forward, case.backward, *case.inputs(backend), oracle=oracle,
                       **kwargs)  # fmt: skip


def run_layer(case: Case, backend, dout_seed: int = 1):
    """Forward, then backward with a seeded random dout: (out, grads), both on the backend."""
    args = case.inputs(backend)
    out, cache = case.bound_forward(*args)
    dout_host = np.random.default_rng(dout_seed).standard_normal(tuple(out.shape))
    dout = float(dout_host) if len(out.shape) == 0 else backend.asarray(dout_host)
    return out, case.backward(dout, cache), dout_host


# --------------------------------------------------------------------------------------------
# 1-2. Gradient checks


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_matches_finite_differences(case, backend_name):
    result = gradcheck(case, get_backend(backend_name), "finite_differences")
    assert result.entries, "no float input was checked"
    result.assert_ok(TOL_FLOAT64)


@pytest.mark.parametrize("backend_name", AUTOGRAD_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_matches_autograd(case, backend_name):
    result = gradcheck(case, get_backend(backend_name), "autograd")
    assert result.entries, "no float input was checked"
    result.assert_ok(TOL_FLOAT64)


def _flat_grads(args, grads):
    """The backward's grads, flattened in ``check_layer``'s order (dicts by key). A bias left out
    gets a trailing None gradient, dropped here."""
    float_positions = [i for i, a in enumerate(args) if isinstance(a, dict) or
                       (hasattr(a, "dtype") and np.issubdtype(to_host(a).dtype, np.floating))]  # fmt: skip
    assert all(g is None for g in grads[len(float_positions):]), "None for an omitted bias only"
    assert len(grads) >= len(float_positions), "one grad per float input"
    flat = []
    for pos, grad in zip(float_positions, grads):
        if isinstance(args[pos], dict):
            flat.extend(grad[key] for key in args[pos])
        else:
            flat.append(grad)
    return flat


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_float32_torch_matches_autograd(case):
    """The same layer run in float32 (forward and hand-written backward stay float32), against
    torch autograd in float64 of the same inputs: agreement to float32 accuracy."""
    backend = get_backend("torch", "float32")
    args = case.inputs(backend)
    out, cache = case.bound_forward(*args)
    assert out.dtype == torch.float32, f"forward output is {out.dtype}"
    dout_host = np.random.default_rng(1).standard_normal(tuple(out.shape))
    dout = float(dout_host) if len(out.shape) == 0 else backend.asarray(dout_host)
    grads = _flat_grads(args, case.backward(dout, cache))
    oracle = check_layer(case.bound_forward, case.backward, *args, oracle="autograd", dout=dout_host)
    entries = []
    for grad, entry in zip(grads, oracle.entries, strict=True):
        assert grad.dtype == torch.float32, f"the gradient for {entry.name} is {grad.dtype}"
        entries.append(GradcheckEntry(entry.name, to_host(grad).astype(np.float64), entry.numeric,
                                      entry.mask, entry.scale))  # fmt: skip
    result = GradcheckResult(entries, "autograd")
    record(result.worst, FLOAT32_TABLE, "float32 layer vs float64 autograd (relative, in norm)")
    result.assert_ok(FLOAT32_TABLE.value / margin())


@requires_cuda
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backward_on_cuda_matches_autograd(case, cuda_backend):
    result = gradcheck(case, cuda_backend, "autograd")
    result.assert_ok(TOL_FLOAT64)


# The inputs whose true gradient is exactly zero: one causal query sees one key, so att = 1
# whatever q and k. Every other input of the table has a true gradient well above the floor.
ZERO_GRADIENTS = {("sdpa_T1", "q"), ("sdpa_T1", "k"), ("flash_attention_T1", "q"),
                  ("flash_attention_T1", "k")}  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_row_is_well_posed(case):
    """The audit of issue 22 (single tokens, masked keys, key biases, unchosen experts): each
    input's true gradient is either exactly zero (ZERO_GRADIENTS, where the floor lets round-off
    pass) or larger than the floor FLOOR * s, so that its error is the plain relative error and
    a backward that returned zeros for it would fail."""
    result = gradcheck(case, get_backend("numpy"), "autograd")
    for entry in result.entries:
        size = np.linalg.norm(entry.numeric)
        if (case.id, entry.name) in ZERO_GRADIENTS:
            assert size < 1e-12 * entry.scale, entry.name
            continue
        assert size > FLOOR * entry.scale, f"{entry.name}: {size:.2g} vs s = {entry.scale:.2g}"
        zero = GradcheckEntry(entry.name, np.zeros_like(entry.numeric), entry.numeric, entry.mask,
                              entry.scale)  # fmt: skip
        assert not zero.passed(), entry.name


# --------------------------------------------------------------------------------------------
# 3. Parity between backends


def _assert_close_tree(actual, expected, what):
    if expected is None:  # the gradient of a bias left out
        assert actual is None, f"{what}: expected None"
        return
    if isinstance(expected, dict):
        assert set(actual) == set(expected), f"{what}: keys differ"
        for key in expected:
            _assert_close_tree(actual[key], expected[key], f"{what}[{key}]")
        return
    np.testing.assert_allclose(actual, expected, rtol=TOL_PARITY, atol=TOL_PARITY, err_msg=what)


@pytest.mark.parametrize("other", ["torch", "strict"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_backends_agree(case, other):
    """Forward outputs and backward grads on ``other`` equal NumPy's within 1e-12."""
    out_np, grads_np, _ = run_layer(case, get_backend("numpy"))
    out, grads, _ = run_layer(case, get_backend(other))
    assert tuple(out.shape) == tuple(out_np.shape)
    _assert_close_tree(to_host(out), to_host(out_np), "forward output")
    assert isinstance(grads, tuple) and len(grads) == len(grads_np)
    for i, (g, g_np) in enumerate(zip(grads, grads_np)):
        _assert_close_tree(to_host(g), to_host(g_np), f"grad {i}")


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_layer_keeps_inputs_dtype_and_device(case, backend_name):
    """Forward and backward never mutate their inputs or dout; backward returns a tuple; every
    output and grad keeps the inputs' float dtype and device."""
    backend = get_backend(backend_name)
    args = case.inputs(backend)
    before = to_host(args)
    out, cache = case.bound_forward(*args)
    assert array_device(out) == backend.device and out.dtype == backend.dtype
    dout_host = np.random.default_rng(1).standard_normal(tuple(out.shape))
    dout = float(dout_host) if len(out.shape) == 0 else backend.asarray(dout_host)
    grads = case.backward(dout, cache)
    assert isinstance(grads, tuple)
    for grad in _flat_grads(args, grads):
        assert array_device(grad) == backend.device and grad.dtype == backend.dtype
    np.testing.assert_array_equal(to_host(dout), dout_host)
    for a, b in zip(to_host(args), before):
        for key in a if isinstance(a, dict) else [None]:
            np.testing.assert_array_equal(a if key is None else a[key], b if key is None else b[key])


# --------------------------------------------------------------------------------------------
# Layer-specific facts


@pytest.mark.parametrize("n", [1, 2, 5])
def test_softmax_jacobian_is_the_explicit_jacobian(backend, n):
    rng = np.random.default_rng(n)
    x_host = rng.standard_normal((3, n))
    p, _ = softmax_forward(backend.asarray(x_host), axis=-1)
    J = softmax_jacobian(p)  # (3, n, n)
    assert tuple(J.shape) == (3, n, n) and array_device(J) == backend.device
    # explicit: J[i, j] = dp_i / dx_j, by torch autograd of torch's own softmax
    explicit = np.stack([
        torch.autograd.functional.jacobian(lambda r: torch.softmax(r, dim=-1), torch.tensor(row)).numpy()
        for row in x_host
    ])  # fmt: skip
    np.testing.assert_allclose(to_host(J), explicit, rtol=1e-13, atol=1e-15)
    # and entry by entry: p_i (delta_ij - p_j)
    p_host = to_host(p)
    by_formula = np.einsum("ki,ij->kij", p_host, np.eye(n)) - np.einsum("ki,kj->kij", p_host, p_host)
    np.testing.assert_allclose(to_host(J), by_formula, rtol=1e-15, atol=1e-16)


def test_softmax_jacobian_transpose_times_v_is_softmax_backward(backend, rng):
    x = backend.randn(rng, 4, 6)
    v = backend.randn(rng, 4, 6)
    p, cache = softmax_forward(x, axis=-1)
    (dx,) = softmax_backward(v, cache)
    J = softmax_jacobian(p)  # (4, 6, 6)
    jtv = (J.mT @ v[..., None])[..., 0]  # (4, 6)
    np.testing.assert_allclose(to_host(jtv), to_host(dx), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(to_host(J), np.swapaxes(to_host(J), -1, -2), atol=0)  # symmetric


def test_attention_single_compact_equals_stepwise(backend, rng):
    for causal, batch in ((False, ()), (True, ()), (False, (B,)), (True, (B, 2))):
        args = [backend.asarray(a) for a in _attention_single_args(*batch)(rng)]
        Z, cache = attention_single_forward(*args, causal=causal)
        E = backend.randn(rng, *Z.shape)
        stepwise = attention_single_backward(E, cache)
        compact = attention_single_backward_compact(E, cache)
        for name, a, b in zip(("dX", "dA", "dB", "dC"), stepwise, compact):
            assert tuple(a.shape) == tuple(b.shape)
            np.testing.assert_allclose(to_host(b), to_host(a), rtol=1e-12, atol=1e-13,
                                       err_msg=f"{name}, causal={causal}, batch={batch}")


def test_attention_single_is_multihead_transposed(rng):
    """The column convention of the post (X is d x T) and the row convention of GPT-2 (x is
    T x C) give the same attention, one head, no biases, once the roles are matched: the post
    scores c_it = q_i . k_t and normalizes over i, so position t probes with its KEY k_t = B x_t
    and the positions i answer with their QUERIES q_i = A x_i. GPT-2's query weight is B^T and
    its key weight A^T."""
    X, A, Bm, Cm = _attention_single_args()(rng)  # (C, T), (HS, C) x 3
    for causal in (False, True):
        Z, _ = attention_single_forward(X, A, Bm, Cm, causal=causal)  # (HS, T)
        qkv = (X.T @ np.concatenate([Bm.T, A.T, Cm.T], axis=1))[None]  # (1, T, 3 HS)
        y, _ = multihead_forward(qkv, n_head=1, causal=causal)  # (1, T, HS)
        np.testing.assert_allclose(y[0], Z.T, rtol=1e-13, atol=1e-14)
        # with A and B the other way round it is a different function
        qkv_swapped = (X.T @ np.concatenate([A.T, Bm.T, Cm.T], axis=1))[None]  # (1, T, 3 HS)
        if T > 1:
            y_swapped, _ = multihead_forward(qkv_swapped, n_head=1, causal=causal)  # (1, T, HS)
            assert not np.allclose(y_swapped[0], Z.T)


def _keep_mask(backend, shape, p, seed):
    x = backend.asarray(np.ones(shape))
    y, _ = dropout_forward(x, p=p, seed=seed)
    return to_host(y) != 0.0, to_host(y)


def test_dropout_p0_is_the_identity(backend, rng):
    x = backend.randn(rng, B, T, C)
    y, cache = dropout_forward(x, p=0.0, seed=5)
    np.testing.assert_array_equal(to_host(y), to_host(x))
    (dx,) = dropout_backward(x, cache)
    np.testing.assert_array_equal(to_host(dx), to_host(x))


def test_dropout_mask_is_fixed_by_the_seed(backend):
    shape, p = (20, 30), 0.3
    mask, y = _keep_mask(backend, shape, p, seed=11)
    again, _ = _keep_mask(backend, shape, p, seed=11)
    other, _ = _keep_mask(backend, shape, p, seed=12)
    np.testing.assert_array_equal(mask, again)
    assert not np.array_equal(mask, other)
    np.testing.assert_allclose(y[mask], 1.0 / (1.0 - p), rtol=1e-15)  # inverted dropout
    # the backward scales dy by the very same mask
    x = backend.asarray(np.ones(shape))
    _, cache = dropout_forward(x, p=p, seed=11)
    (dx,) = dropout_backward(backend.asarray(np.full(shape, 2.0)), cache)
    np.testing.assert_array_equal(to_host(dx) != 0.0, mask)


def test_dropout_mask_is_the_same_on_every_cpu_backend_and_dtype():
    masks = [_keep_mask(get_backend(name, dtype), (7, 9), 0.4, seed=2)[0]
             for name in BACKENDS for dtype in ("float64", "float32")]  # fmt: skip
    for mask in masks[1:]:
        np.testing.assert_array_equal(mask, masks[0])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_keeps_the_expected_fraction(backend, p):
    n = 40_000
    mask, y = _keep_mask(backend, (200, 200), p, seed=int(100 * p))
    kept = mask.mean()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(kept - (1 - p)) < 5 * sigma, f"kept {kept:.4f}, expected {1 - p} +- {sigma:.4f}"
    assert abs(y.mean() - 1.0) < 5 * sigma / (1 - p)  # inverted dropout keeps the mean


def test_embedding_lookup_equals_onehot_view(backend, rng):
    idx, wte = backend.randint(rng, V, B, T), backend.randn(rng, V, C)
    x, cache = embedding_forward(idx, wte)
    x1, cache1 = embedding_onehot_forward(idx, wte)
    np.testing.assert_allclose(to_host(x), to_host(x1), rtol=1e-15, atol=0)
    dx = backend.randn(rng, B, T, C)
    (dwte,), (dwte_onehot,) = embedding_backward(dx, cache), embedding_onehot_backward(dx, cache1)
    np.testing.assert_allclose(to_host(dwte), to_host(dwte_onehot), rtol=1e-14, atol=1e-15)


def test_embedding_backward_accumulates_repeated_ids(backend):
    idx = backend.asarray(np.array([[3, 3, 3]]))
    wte = backend.asarray(np.zeros((V, 2)))
    _, cache = embedding_forward(idx, wte)
    (dwte,) = embedding_backward(backend.asarray(np.ones((1, 3, 2))), cache)
    expected = np.zeros((V, 2))
    expected[3] = 3.0
    np.testing.assert_array_equal(to_host(dwte), expected)


def test_position_learned_unused_rows_get_zero_gradient(backend, rng):
    x, wpe = backend.randn(rng, B, T, C), backend.randn(rng, BLOCK_SIZE, C)
    _, cache = position_learned_forward(x, wpe)
    _, dwpe = position_learned_backward(backend.randn(rng, B, T, C), cache)
    assert tuple(dwpe.shape) == (BLOCK_SIZE, C)
    assert np.all(to_host(dwpe)[T:] == 0.0) and np.all(to_host(dwpe)[:T] != 0.0)


def test_gelu_none_is_exact_and_tanh_is_close(backend):
    x_host = np.linspace(-5, 5, 41)
    exact = np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x_host])
    y_none, _ = gelu_forward(backend.asarray(x_host), approximate="none")
    y_tanh, _ = gelu_forward(backend.asarray(x_host), approximate="tanh")
    np.testing.assert_allclose(to_host(y_none), exact, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(to_host(y_tanh), exact, atol=1e-3)  # the approximation's error
    assert np.max(np.abs(to_host(y_tanh) - exact)) > 1e-5  # ... which is not zero


def test_relu_subgradient_at_zero_is_zero(backend):
    x = backend.asarray(np.array([-1.0, 0.0, 2.0]))
    y, cache = relu_forward(x)
    (dx,) = relu_backward(backend.asarray(np.ones(3)), cache)
    np.testing.assert_array_equal(to_host(y), [0.0, 0.0, 2.0])
    np.testing.assert_array_equal(to_host(dx), [0.0, 0.0, 1.0])


def test_cross_entropy_of_uniform_logits_is_log_v(backend):
    logits = backend.asarray(np.zeros((B, T, V)))
    loss, _ = cross_entropy_forward(logits, backend.randint(np.random.default_rng(0), V, B, T))
    assert float(to_host(loss)) == pytest.approx(math.log(V), rel=1e-15)


def test_cross_entropy_matches_torch(backend, rng):
    logits_host, targets_host = 3 * rng.standard_normal((B, T, V)), _ids(rng, V, B, T)
    loss, _ = cross_entropy_forward(backend.asarray(logits_host), backend.asarray(targets_host))
    expected = torch.nn.functional.cross_entropy(torch.tensor(logits_host).reshape(-1, V),
                                                 torch.tensor(targets_host).reshape(-1))  # fmt: skip
    assert float(to_host(loss)) == pytest.approx(float(expected), rel=1e-14)


def test_layernorm_matches_torch(backend, rng):
    x, w, b = rng.standard_normal((B, T, C)), rng.standard_normal(C), rng.standard_normal(C)
    y, _ = layernorm_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b))
    expected = torch.nn.functional.layer_norm(torch.tensor(x), (C,), torch.tensor(w), torch.tensor(b))
    np.testing.assert_allclose(to_host(y), expected.numpy(), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("forward, backward, w_shape", [
    (linear_forward, linear_backward, (C, 3)), (layernorm_forward, layernorm_backward, (C,))])
def test_no_bias_is_a_zero_bias_without_its_gradient(backend, rng, forward, backward, w_shape):
    x = backend.asarray(rng.standard_normal((B, T, C)))
    w = backend.asarray(rng.standard_normal(w_shape))
    zero = backend.asarray(np.zeros(w_shape[-1]))
    y, cache = forward(x, w)
    y0, cache0 = forward(x, w, zero)
    np.testing.assert_array_equal(to_host(y), to_host(y0))
    dy = backend.asarray(rng.standard_normal(tuple(y.shape)))
    dx, dw, db = backward(dy, cache)
    dx0, dw0, _ = backward(dy, cache0)
    assert db is None
    np.testing.assert_array_equal(to_host(dx), to_host(dx0))
    np.testing.assert_array_equal(to_host(dw), to_host(dw0))


def test_attention_matches_torch_sdpa(backend, rng):
    qkv_host = rng.standard_normal((B, T, 3 * C))
    for causal in (False, True):
        y, _ = multihead_forward(backend.asarray(qkv_host), n_head=NH, causal=causal)
        q, k, v = (torch.tensor(t).reshape(B, T, NH, C // NH).transpose(1, 2)
                   for t in np.split(qkv_host, 3, axis=-1))  # fmt: skip
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        np.testing.assert_allclose(to_host(y), ref.transpose(1, 2).reshape(B, T, C).numpy(),
                                   rtol=1e-12, atol=1e-13)  # fmt: skip


def _softmax_rows(scores):
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_sdpa_with_a_causal_mask_is_the_gpt_attention_core(backend, rng):
    """The GPT core (multihead_forward, causal=True) equals sdpa on its heads with the lower
    triangle passed as an explicit mask (the mask path, not the causal one), and both equal the
    core's former lines written out in NumPy; the backward agrees with multihead_backward."""
    qkv_host = rng.standard_normal((B, T, 3 * C))
    qkv = backend.asarray(qkv_host)
    y, core_cache = multihead_forward(qkv, n_head=NH, causal=True)  # (B, T, C)
    q, k, v = split_qkv(qkv, NH)  # (B, NH, T, hs) each
    heads, cache = sdpa_forward(q, k, v, causal_mask_rows(T, qkv))  # (B, NH, T, hs)
    np.testing.assert_allclose(to_host(merge_heads(heads)), to_host(y), rtol=1e-14, atol=1e-15)
    qh, kh, vh = (np.swapaxes(a.reshape(B, T, NH, C // NH), 1, 2)
                  for a in np.split(qkv_host, 3, axis=-1))  # fmt: skip
    scores = qh @ np.swapaxes(kh, -1, -2) / math.sqrt(C // NH)  # (B, NH, T, T)
    att = _softmax_rows(np.where(np.tri(T, dtype=bool), scores, -np.inf))  # (B, NH, T, T)
    written_out = np.swapaxes(att @ vh, 1, 2).reshape(B, T, C)  # (B, T, C)
    np.testing.assert_allclose(to_host(y), written_out, rtol=1e-13, atol=1e-14)
    dy = backend.randn(rng, B, T, C)
    (dqkv,) = multihead_backward(dy, core_cache)
    grads = sdpa_backward(split_heads(dy, NH), cache)  # dq, dk, dv (B, NH, T, hs)
    expected = np.concatenate([to_host(merge_heads(g)) for g in grads], axis=-1)  # (B, T, 3C)
    np.testing.assert_allclose(to_host(dqkv), expected, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("Tq, Tk, causal, masked, scale", [
    (3, 3, False, False, None), (3, 3, True, False, None), (2, 4, True, False, None),
    (3, 4, False, True, 0.7), (3, 3, True, True, None), (2, 4, True, True, 2.0)])  # fmt: skip
def test_sdpa_matches_torch_sdpa(backend, Tq, Tk, causal, masked, scale):
    """Forward and the gradients of q, k, v against torch's scaled_dot_product_attention and its
    autograd. torch's ``is_causal`` aligns the triangle top-left and takes no ``attn_mask``: it
    serves Tq == Tk without a mask; otherwise our end-aligned triangle goes into ``attn_mask``."""
    rng = np.random.default_rng(10 * Tq + Tk)
    q, k, v = (rng.standard_normal(shape) for shape in ((B, NH, Tq, HS), (B, NH, Tk, HS),
                                                         (B, NH, Tk, 2)))  # fmt: skip
    mask = random_attention_mask(rng, (B, 1, Tq, Tk)) if masked else None
    dout = rng.standard_normal((B, NH, Tq, 2))
    out, cache = sdpa_forward(*map(backend.asarray, (q, k, v)),
                              None if mask is None else backend.asarray(mask),
                              causal=causal, scale=scale)  # fmt: skip
    grads = sdpa_backward(backend.asarray(dout), cache)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    attn_mask = None if mask is None else torch.tensor(mask)
    is_causal = causal and Tq == Tk and attn_mask is None
    if causal and not is_causal:
        triangle = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)  # key j <= i + Tk - Tq
        attn_mask = triangle if attn_mask is None else attn_mask & triangle
    ref = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=attn_mask, is_causal=is_causal, scale=scale)  # (B, NH, Tq, 2)
    ref.backward(torch.tensor(dout))
    np.testing.assert_allclose(to_host(out), ref.detach().numpy(), rtol=1e-12, atol=1e-13)
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, (tq, tk, tv)):
        np.testing.assert_allclose(to_host(grad), leaf.grad.numpy(), rtol=1e-11, atol=1e-12,
                                   err_msg=name)  # fmt: skip


@pytest.mark.parametrize("n_head, n_kv_head, Tq, Tk, causal, masked", [
    (4, 4, 3, 3, True, False), (4, 2, 3, 3, False, False), (6, 2, 2, 4, True, False),
    (3, 1, 3, 3, True, False), (4, 2, 3, 4, False, True), (4, 1, 2, 4, True, True)])  # fmt: skip
def test_gqa_matches_torch_enable_gqa(backend, n_head, n_kv_head, Tq, Tk, causal, masked):
    """Forward and the gradients of q, k, v against torch's scaled_dot_product_attention with
    ``enable_gqa=True`` (which repeats each key/value head NH / NKV times in a row) and its
    autograd; our end-aligned causal triangle goes into ``attn_mask`` as in the sdpa test."""
    rng = np.random.default_rng(10 * n_head + n_kv_head)
    q, k, v = _gqa_args(n_head, n_kv_head, Tq, Tk)(rng)
    mask = random_attention_mask(rng, (B, n_head, Tq, Tk)) if masked else None
    out, cache = gqa_forward(*map(backend.asarray, (q, k, v)),
                             None if mask is None else backend.asarray(mask), causal=causal)  # fmt: skip
    dout = rng.standard_normal(tuple(out.shape))
    grads = gqa_backward(backend.asarray(dout), cache)

    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    attn_mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq) if causal else None
    if mask is not None:
        attn_mask = torch.tensor(mask) if attn_mask is None else attn_mask & torch.tensor(mask)
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=attn_mask,
                                                           enable_gqa=True)  # fmt: skip
    ref.backward(torch.tensor(dout))
    np.testing.assert_allclose(to_host(out), ref.detach().numpy(), rtol=1e-12, atol=1e-13)
    for name, grad, leaf in zip(("dq", "dk", "dv"), grads, (tq, tk, tv)):
        assert tuple(grad.shape) == tuple(leaf.shape), name
        np.testing.assert_allclose(to_host(grad), leaf.grad.numpy(), rtol=1e-11, atol=1e-12,
                                   err_msg=name)  # fmt: skip


def _repeat_heads(w, n_kv_head, group):
    """(C, NKV*hs) -> (C, NH*hs): each key/value head's columns repeated ``group`` times in a
    row, so head h of the result is head h // group of w."""
    C, width = w.shape
    return np.repeat(w.reshape(C, n_kv_head, width // n_kv_head), group, axis=1).reshape(C, -1)


@pytest.mark.parametrize("n_head, n_kv_head", [(2, 2), (4, 2), (2, 1), (4, 1)])
def test_gqa_attention_is_gpt2_attention_with_repeated_kv_heads(backend, n_head, n_kv_head):
    """GPT-2's attention (no biases) with wk, wv's heads repeated G = NH / NKV times gives the
    same y and dx, dwq, dwo; the gradient of each key/value head is the sum over its G copies."""
    rng, G, hs = np.random.default_rng(n_head + n_kv_head), n_head // n_kv_head, C // n_head
    x, wq, wk, wv, wo = _gqa_attention_args(n_head, n_kv_head, hs)(rng)
    y, cache = gqa_attention_forward(*map(backend.asarray, (x, wq, wk, wv, wo)), n_head=n_head,
                                     n_kv_head=n_kv_head)  # fmt: skip
    w_attn = np.concatenate([wq, _repeat_heads(wk, n_kv_head, G), _repeat_heads(wv, n_kv_head, G)],
                            axis=1)  # (C, 3C)  # fmt: skip
    y_mha, cache_mha = attention_forward(backend.asarray(x), backend.asarray(w_attn), None,
                                         backend.asarray(wo), None, n_head=n_head)  # fmt: skip
    np.testing.assert_allclose(to_host(y), to_host(y_mha), rtol=1e-13, atol=1e-14)
    dy = backend.randn(rng, *y.shape)
    dx, dwq, dwk, dwv, dwo = to_host(gqa_attention_backward(dy, cache))
    dx_mha, dw_attn, _, dwo_mha, _ = to_host(attention_backward(dy, cache_mha))
    dwq_mha, dwk_rep, dwv_rep = np.split(dw_attn, 3, axis=1)  # (C, C) each
    for name, got, want in (("dx", dx, dx_mha), ("dwq", dwq, dwq_mha), ("dwo", dwo, dwo_mha),
                            ("dwk", dwk, dwk_rep.reshape(C, n_kv_head, G, hs).sum(2)),
                            ("dwv", dwv, dwv_rep.reshape(C, n_kv_head, G, hs).sum(2))):  # fmt: skip
        np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-12, atol=1e-13,
                                   err_msg=name)  # fmt: skip


@pytest.mark.parametrize("rotary", [False, True])
def test_gqa_attention_matches_hf_llama_attention(rotary):
    """Hugging Face's LlamaAttention (random weights, float64, torch SDPA): y and every gradient.
    With ``rotary`` its rotary embedding goes in as our ``rotate`` pair: RoPE is linear in q, so
    position t turns a row by the matrix R[t] whose row i is RoPE of the unit vector e_i."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (
        LlamaAttention,
        LlamaRotaryEmbedding,
        rotate_half,
    )

    n_head, n_kv_head, hs, Tn = 4, 2, 2, 5
    cfg = LlamaConfig(hidden_size=C, num_attention_heads=n_head, num_key_value_heads=n_kv_head,
                      head_dim=hs, attention_bias=False, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    hf = LlamaAttention(cfg, layer_idx=0).double()
    x = torch.randn(B, Tn, C, dtype=torch.float64, requires_grad=True)
    cos, sin = LlamaRotaryEmbedding(cfg)(x, torch.arange(Tn)[None])  # (1, T, hs) each
    if not rotary:
        cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    y_hf, _ = hf(x, position_embeddings=(cos.double(), sin.double()), attention_mask=None)
    dy = torch.randn(B, Tn, C, dtype=torch.float64)
    y_hf.backward(dy)

    projections = (hf.q_proj, hf.k_proj, hf.v_proj, hf.o_proj)
    weights = [p.weight.detach().T.numpy() for p in projections]  # nn.Linear's (out, in) -> ours
    eye = torch.eye(hs, dtype=torch.float64)
    R = (eye * cos[0, :, None, :] + rotate_half(eye) * sin[0, :, None, :]).double().numpy()
    rotate = _rotation_pair(R) if rotary else None
    y, cache = gqa_attention_forward(x.detach().numpy(), *weights, n_head=n_head,
                                     n_kv_head=n_kv_head, rotate=rotate)  # fmt: skip
    np.testing.assert_allclose(y, y_hf.detach().numpy(), rtol=1e-12, atol=1e-13)
    dx, *dws = gqa_attention_backward(dy.numpy(), cache)
    np.testing.assert_allclose(dx, x.grad.numpy(), rtol=1e-11, atol=1e-12)
    for name, dw, p in zip(("dwq", "dwk", "dwv", "dwo"), dws, projections):
        np.testing.assert_allclose(dw, p.weight.grad.T.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def test_gqa_attention_step_with_a_kv_cache_equals_the_full_forward(backend):
    """Feeding the positions in chunks (2, 1, 2) through gqa_attention_step, each rotated at its
    own positions, gives the full causal forward's y; the cache grows to (B, NKV, T, hs), and
    holds exactly kv_cache_size's numbers."""
    n_head, n_kv_head, hs, Tn = 4, 2, 2, 5
    rng = np.random.default_rng(5)
    x, *weights = _gqa_attention_args(n_head, n_kv_head, hs)(rng)
    x = np.concatenate([x, rng.standard_normal((B, Tn - T, C))], axis=1)  # (B, Tn, C)
    x, weights = backend.asarray(x), [backend.asarray(w) for w in weights]
    R = _random_rotations(Tn, hs, seed=1)
    y_full, _ = gqa_attention_forward(x, *weights, n_head=n_head, n_kv_head=n_kv_head,
                                      rotate=_rotation_pair(R))  # fmt: skip
    k = v = None
    for start, stop in ((0, 2), (2, 3), (3, 5)):
        y, k, v = gqa_attention_step(x[:, start:stop, :], *weights, k, v, n_head=n_head,
                                     n_kv_head=n_kv_head, rotate=_rotation_pair(R, start)[0])  # fmt: skip
        assert tuple(k.shape) == tuple(v.shape) == (B, n_kv_head, stop, hs)
        np.testing.assert_allclose(to_host(y), to_host(y_full)[:, start:stop], rtol=1e-12,
                                   atol=1e-13, err_msg=f"positions {start}..{stop - 1}")  # fmt: skip
    size = kv_cache_size(1, n_kv_head, hs, Tn, to_host(k).dtype, batch=B)
    assert size.elements == math.prod(k.shape) + math.prod(v.shape)
    assert size.nbytes == to_host(k).nbytes + to_host(v).nbytes


@pytest.mark.parametrize("n_head, n_kv_head", [(32, 8), (8, 1), (12, 12), (6, 3)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", torch.float16, np.dtype("float64")])
def test_kv_cache_shrinks_by_the_group_size(n_head, n_kv_head, dtype):
    full = kv_cache_size(4, n_head, 16, 100, dtype, batch=3)  # multi-head: NKV = NH
    grouped = kv_cache_size(4, n_kv_head, 16, 100, dtype, batch=3)
    assert full.elements == (n_head // n_kv_head) * grouped.elements
    assert full.nbytes == (n_head // n_kv_head) * grouped.nbytes
    assert grouped.elements == 2 * 4 * 3 * n_kv_head * 100 * 16


def test_kv_cache_size_of_llama2_70b():
    """LLaMA 2 70B (80 layers, 64 query heads, 8 key/value heads of size 128) keeps
    2 * 80 * 8 * 128 float16 numbers per token: 320 KiB, where 64 key/value heads would keep
    2.5 MiB, eight times as much."""
    assert kv_cache_size(80, 8, 128, 1, "float16").nbytes == 320 * 1024
    assert kv_cache_size(80, 64, 128, 1, "float16").nbytes == 2.5 * 1024 * 1024
    assert kv_cache_size(80, 8, 128, 4096, "float16").nbytes == 4096 * 320 * 1024
def _moe_reference(x, w_router, w_fc, b_fc, w_proj, b_proj, *, k, renormalize, capacity_factor,
                   aux_weight):
    """The mixture of experts written plainly, one token at a time, in NumPy:
    (y (B, T, C), aux, experts (B*T, k), kept (B*T, k))."""
    tokens = x.reshape(-1, x.shape[-1])  # (N, C)
    N, E = tokens.shape[0], w_router.shape[1]
    capacity = N if capacity_factor is None else math.ceil(capacity_factor * N * k / E)
    taken = [0] * E  # tokens each expert has accepted so far, in token order
    chosen_count, prob_sum = np.zeros(E), np.zeros(E)
    y, experts, kept = np.zeros_like(tokens), [], []
    for n, token in enumerate(tokens):
        logits = token @ w_router
        probs = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
        prob_sum += probs
        chosen = sorted(range(E), key=lambda e: (-logits[e], e))[:k]  # largest; ties: lower id
        total = sum(probs[e] for e in chosen) if renormalize else 1.0
        experts.append(chosen)
        kept.append([])
        for e in chosen:
            chosen_count[e] += 1
            kept[-1].append(taken[e] < capacity)
            if taken[e] < capacity:
                taken[e] += 1
                h = token @ w_fc[e] + b_fc[e]
                h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
                y[n] += probs[e] / total * (h @ w_proj[e] + b_proj[e])
    aux = aux_weight * E * np.sum(chosen_count / (N * k) * prob_sum / N)
    return y.reshape(x.shape), aux, np.array(experts), np.array(kept)


MOE_SETTINGS = [  # k, renormalize, capacity_factor, aux_weight
    dict(zip(("k", "renormalize", "capacity_factor", "aux_weight"), row))
    for row in ((1, False, None, 0.01), (1, True, 1.0, 0.1), (2, True, None, 0.01),
                (2, False, 0.75, 0.0), (3, True, 0.5, 1.0))
]  # fmt: skip


@pytest.mark.parametrize("settings", MOE_SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_moe_equals_a_slow_loop_over_tokens(backend, settings):
    """Random inputs (no margins needed: forward only), 2 x 8 tokens, so that capacity drops."""
    rng = np.random.default_rng(settings["k"])
    shapes = ((2, 8, C), (C, E), (E, C, 6), (E, 6), (E, 6, C), (E, C))
    args = [rng.standard_normal(shape) for shape in shapes]
    (y, aux), cache = moe_forward(*map(backend.asarray, args), **settings)
    y_ref, aux_ref, experts_ref, kept_ref = _moe_reference(*args, **settings)
    np.testing.assert_allclose(to_host(y), y_ref, rtol=1e-12, atol=1e-13)
    assert float(to_host(aux)) == pytest.approx(aux_ref, rel=1e-12, abs=1e-15)
    stats = to_host(cache["stats"])
    np.testing.assert_array_equal(stats["experts"].reshape(-1, settings["k"]), experts_ref)
    np.testing.assert_array_equal(stats["kept"].reshape(-1, settings["k"]), kept_ref)
    assert stats["dropped"] == np.sum(~kept_ref)
    np.testing.assert_array_equal(stats["load"], np.bincount(experts_ref[kept_ref], minlength=E))
    np.testing.assert_array_equal(stats["routed"], np.bincount(experts_ref.ravel(), minlength=E))
    if settings["capacity_factor"] is not None and settings["capacity_factor"] < 1:
        assert stats["dropped"] > 0  # the drop rows do drop


def test_moe_capacity_rows_of_the_table_drop_tokens():
    """capacity_factor 0.5 leaves ceil(N k / 2E) * E < N k places: some choices must drop."""
    for case in CASES:
        if case.hyperparams.get("capacity_factor") is not None:
            (_, _), cache = moe_forward(*case.make(np.random.default_rng(0)), **case.hyperparams)
            assert cache["stats"]["dropped"] > 0, case.id


def test_top_k_experts_breaks_ties_to_the_lower_id(backend):
    logits = backend.asarray(np.array([[1.0, 1.0, 1.0, 0.0], [0.0, 2.0, 2.0, 2.0],
                                       [3.0, -1.0, 3.0, 5.0], [0.0, 0.0, 0.0, 0.0]]))  # fmt: skip
    np.testing.assert_array_equal(to_host(top_k_experts(logits, 2)),
                                  [[0, 1], [1, 2], [3, 0], [0, 1]])  # fmt: skip
    np.testing.assert_array_equal(to_host(top_k_experts(logits, 4)),
                                  [[0, 1, 2, 3], [1, 2, 3, 0], [3, 0, 2, 1], [0, 1, 2, 3]])  # fmt: skip


def test_moe_capacity_keeps_the_first_tokens_in_token_order(backend):
    """Every token prefers expert 2 (k=1); capacity ceil(2.0 * 6 * 1 / 4) = 3 keeps the first
    three: the later tokens are dropped, get y = 0, and (aux_weight 0) get no gradient at all."""
    rng = np.random.default_rng(3)
    x_host = np.abs(rng.standard_normal((1, 6, C))) + 0.1  # positive: logit 2 is the largest
    w_router = np.zeros((C, E))
    w_router[:, 2] = 1.0
    args = [x_host, w_router, *_moe_args(rng)[2:]]
    (y, _), cache = moe_forward(*map(backend.asarray, args), k=1, capacity_factor=2.0,
                                aux_weight=0.0)  # fmt: skip
    capacity = math.ceil(2.0 * 6 * 1 / E)  # 3
    stats = to_host(cache["stats"])
    assert stats["capacity"] == capacity and stats["dropped"] == 6 - capacity
    np.testing.assert_array_equal(stats["kept"][0, :, 0], [True] * capacity + [False] * 3)
    np.testing.assert_array_equal(stats["load"], [0, 0, capacity, 0])
    assert np.all(to_host(y)[0, capacity:] == 0.0) and np.all(to_host(y)[0, :capacity] != 0.0)
    dx, *_ = moe_backward((backend.randn(rng, 1, 6, C), 0.0), cache)
    assert np.all(to_host(dx)[0, capacity:] == 0.0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_gates_and_unselected_logits(backend, renormalize):
    """aux_weight 0, the choice of experts fixed. Renormalized, the gates are a softmax over the
    CHOSEN logits alone: moving an unchosen logit (here anywhere below the chosen ones, so the
    top-k stays) leaves the gates, hence the loss, unchanged, and its gradient is exactly 0.
    Raw (renormalize=False), a gate is a full-softmax probability, whose denominator holds
    every logit: the gates change and unchosen logits get a gradient. The CHOSEN logits matter
    either way."""
    rng = np.random.default_rng(5)
    k = 2
    logits_host = rng.standard_normal((B * T, E))
    experts_host = to_host(top_k_experts(backend.asarray(logits_host), k))
    unchosen = np.ones((B * T, E), dtype=bool)
    np.put_along_axis(unchosen, experts_host, False, axis=1)
    kth = np.take_along_axis(logits_host, experts_host, axis=1).min(axis=1, keepdims=True)
    moved = np.where(unchosen, kth - 0.1 - 3 * rng.random((B * T, E)), logits_host)  # still top-k
    experts = backend.asarray(experts_host)
    assert np.array_equal(to_host(top_k_experts(backend.asarray(moved), k)), experts_host)
    (gates, _), cache = router_forward(backend.asarray(logits_host), experts,
                                       renormalize=renormalize)  # fmt: skip
    (gates_moved, _), _ = router_forward(backend.asarray(moved), experts, renormalize=renormalize)
    dgates = backend.randn(rng, B * T, k)
    (dlogits,) = router_backward((dgates, 0.0), cache)
    if renormalize:
        np.testing.assert_allclose(to_host(gates_moved), to_host(gates), rtol=1e-14, atol=0)
        assert np.all(np.abs(to_host(dlogits)[unchosen]) < 1e-15)
    else:
        assert np.all(np.abs(to_host(gates_moved) - to_host(gates)) > 1e-6)
        assert np.all(np.abs(to_host(dlogits)[unchosen]) > 1e-8)
    assert np.all(np.abs(to_host(dlogits)[~unchosen]) > 1e-8)


def test_moe_k1_renormalized_router_learns_from_aux_alone(backend):
    """k = 1 renormalized: the gate is p/p = 1 whatever the logits, so the loss reaches the
    router only through aux: dw_router is 0 with aux_weight 0, and with aux_weight > 0 it is
    the aux gradient alone (dy = 0 gives the same dw_router)."""
    args = [backend.asarray(a) for a in _moe_args(np.random.default_rng(0))]
    dy = backend.randn(np.random.default_rng(1), B, T, C)
    (_, _), cache = moe_forward(*args, k=1, renormalize=True, aux_weight=0.0)
    np.testing.assert_array_equal(to_host(cache["stats"]["gates"]), np.ones((B, T, 1)))
    _, dw_router, *_ = moe_backward((dy, 1.0), cache)
    assert np.all(to_host(dw_router) == 0.0)
    (_, _), cache = moe_forward(*args, k=1, renormalize=True, aux_weight=0.5)
    _, dw_router, *_ = moe_backward((dy, 1.0), cache)
    _, dw_router_aux, *_ = moe_backward((dy * 0.0, 1.0), cache)
    assert np.any(to_host(dw_router) != 0.0)
    np.testing.assert_allclose(to_host(dw_router), to_host(dw_router_aux), rtol=1e-13, atol=1e-15)


def test_every_layer_module_is_in_the_table():
    """A new file in gptlab/layers must get a row in CASES."""
    from pathlib import Path

    import gptlab.layers

    modules = {p.stem for p in Path(gptlab.layers.__file__).parent.glob("*.py")} - {"__init__"}
    covered = {case.forward.__module__.rsplit(".", 1)[-1] for case in CASES}
    assert modules <= covered, f"layers without a gradient check: {sorted(modules - covered)}"


# --------------------------------------------------------------------------------------------
# Issue 14: RMSNorm, SiLU, SwiGLU and RoPE against independent torch formulations, and RoPE's
# relative positions


def _assert_matches_torch(backend, forward, backward, inputs, reference, *, rtol=1e-12,
                          atol=1e-13, **hyperparams):  # fmt: skip
    """Our forward and backward on the backend equal ``reference`` (plain float64 torch) and the
    torch autograd of ``reference``, for the loss sum(out * dout)."""
    out, cache = forward(*map(backend.asarray, inputs), **hyperparams)
    dout = np.random.default_rng(1).standard_normal(tuple(out.shape))
    grads = backward(backend.asarray(dout), cache)
    leaves = [torch.tensor(a, requires_grad=True) for a in inputs]
    want = reference(*leaves)
    want.backward(torch.tensor(dout))
    np.testing.assert_allclose(to_host(out), want.detach().numpy(), rtol=rtol, atol=atol,
                               err_msg="forward")  # fmt: skip
    for i, (grad, leaf) in enumerate(zip(grads, leaves, strict=True)):
        np.testing.assert_allclose(to_host(grad), leaf.grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"grad of input {i}")  # fmt: skip


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rmsnorm_matches_torch(backend, rng, eps):
    x, w = rng.standard_normal((B, T, C)), 1 + rng.standard_normal(C)
    _assert_matches_torch(backend, rmsnorm_forward, rmsnorm_backward, (x, w),
                          lambda x, w: torch.nn.functional.rms_norm(x, (C,), w, eps=eps),
                          eps=eps)  # fmt: skip


def test_rmsnorm_of_a_zero_mean_row_is_layernorm(backend, rng):
    """LayerNorm without its bias is RMSNorm after subtracting the mean: on rows of mean 0 the
    two agree, on other rows they do not."""
    x, w = rng.standard_normal((B, T, C)), rng.standard_normal(C)
    centred = x - x.mean(axis=-1, keepdims=True)
    y_ln, _ = layernorm_forward(backend.asarray(x), backend.asarray(w), eps=1e-5)
    y_rms, _ = rmsnorm_forward(backend.asarray(centred), backend.asarray(w), eps=1e-5)
    np.testing.assert_allclose(to_host(y_rms), to_host(y_ln), rtol=1e-13, atol=1e-14)
    y_rms_raw, _ = rmsnorm_forward(backend.asarray(x), backend.asarray(w), eps=1e-5)
    assert not np.allclose(to_host(y_rms_raw), to_host(y_ln))


def test_silu_matches_torch(backend):
    x = np.linspace(-40.0, 40.0, 161)
    _assert_matches_torch(backend, silu_forward, silu_backward, (x,), torch.nn.functional.silu,
                          rtol=1e-14, atol=1e-15)  # fmt: skip


def test_silu_never_overflows(backend):
    """The sigmoid comes from exp(-|x|): far out, silu is 0 or x and its slope 0 or 1, with no
    overflow warning (x / (1 + exp(-x)) would overflow exp for x < -709)."""
    x = backend.asarray(np.array([-1e4, -800.0, 800.0, 1e4]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, cache = silu_forward(x)
        (dx,) = silu_backward(backend.asarray(np.ones(4)), cache)
    np.testing.assert_array_equal(to_host(y), [0.0, 0.0, 800.0, 1e4])
    np.testing.assert_array_equal(to_host(dx), [0.0, 0.0, 1.0, 1.0])


def test_swiglu_matches_torch(backend, rng):
    def reference(x, w_gate, w_up, w_down):
        return (torch.nn.functional.silu(x @ w_gate) * (x @ w_up)) @ w_down

    _assert_matches_torch(backend, swiglu_forward, swiglu_backward, _swiglu_args(rng, H=5),
                          reference)


def _rope_rotate_half(x, start, base):
    """Hugging Face's LLaMA RoPE (LlamaRotaryEmbedding + apply_rotary_pos_emb) in plain torch."""
    T_, hs = x.shape[-2:]
    inv_freq = 1.0 / base ** (torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
    freqs = torch.outer(torch.arange(start, start + T_, dtype=torch.float64), inv_freq)  # (T, hs/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hs)
    rotate_half = torch.cat((-x[..., hs // 2 :], x[..., : hs // 2]), dim=-1)  # (..., T, hs)
    return x * emb.cos() + rotate_half * emb.sin()


def _rope_complex(x, start, base):
    """The paper's adjacent pairs as complex numbers, as Meta's LLaMA code writes it:
    (x[2i] + i x[2i+1]) * exp(i t theta_i)."""
    T_, hs = x.shape[-2:]
    theta = base ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)  # (hs/2,)
    angles = torch.outer(torch.arange(start, start + T_, dtype=torch.float64), theta)  # (T, hs/2)
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], hs // 2, 2))  # (..., T, hs/2)
    turned = z * torch.polar(torch.ones_like(angles), angles)  # (..., T, hs/2)
    return torch.view_as_real(turned).reshape(x.shape)  # (..., T, hs)


@pytest.mark.parametrize("pairing, reference", [("rotate_half", _rope_rotate_half),
                                                ("adjacent", _rope_complex)])  # fmt: skip
@pytest.mark.parametrize("start, base", [(0, 10000.0), (7, 10000.0), (3, 500.0)])
def test_rope_matches_torch_formulas(backend, rng, pairing, reference, start, base):
    x = rng.standard_normal((B, NH, 5, 8))
    _assert_matches_torch(backend, rope_forward, rope_backward, (x,),
                          lambda x: reference(x, start, base), start=start, base=base,
                          pairing=pairing)  # fmt: skip


@pytest.mark.parametrize("pairing", ROPE_PAIRINGS)
def test_rope_scores_depend_on_the_offset_only(backend, rng, pairing):
    """The same query vector at every position and the same key vector at every position: after
    RoPE the score of query t and key s depends on s - t alone (every diagonal of the score
    matrix is constant, and equals q^T R(s - t) k), and shifting all positions changes nothing.
    Without RoPE every score would be the same; with it they vary with the offset."""
    Tn, hs = 7, 8
    q, k = np.tile(rng.standard_normal(hs), (Tn, 1)), np.tile(rng.standard_normal(hs), (Tn, 1))

    def scores(start):
        q_rot, _ = rope_forward(backend.asarray(q), start=start, pairing=pairing)  # (T, hs)
        k_rot, _ = rope_forward(backend.asarray(k), start=start, pairing=pairing)  # (T, hs)
        return to_host(q_rot @ k_rot.mT)  # (T, T)

    S = scores(0)
    np.testing.assert_allclose(S[1:, 1:], S[:-1, :-1], rtol=1e-12, atol=1e-13)
    like = backend.asarray(np.zeros(()))
    for offset in range(-(Tn - 1), Tn):
        R = to_host(rope_rotation_matrix(offset, hs, pairing=pairing, like=like))
        np.testing.assert_allclose(np.diagonal(S, offset), q[0] @ R @ k[0], rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(scores(11), S, rtol=1e-12, atol=1e-13)
    assert np.ptp(S[0]) > 0.1


def test_rope_rotation_matrix_is_chapter_2s_staircase(backend, rng):
    """R(t) is orthogonal, R(t) = R(1)^t, R(t)^T R(s) = R(s - t); for adjacent pairs it is the
    transpose of the sinusoidal encoding's shift matrix M_t, and rotate_half is the same matrix
    with the coordinates reordered (pair i = (i, i + hs/2) instead of (2i, 2i + 1)). rope_forward
    applies R(start + t) to row t."""
    hs, like = 6, backend.asarray(np.zeros(()))
    half_order = np.concatenate([np.arange(0, hs, 2), np.arange(1, hs, 2)])  # (hs,) pairs i, i+hs/2

    def R(t, pairing):
        return to_host(rope_rotation_matrix(t, hs, base=30.0, pairing=pairing, like=like))

    for t in range(-3, 4):
        adjacent = R(t, "adjacent")
        shift = to_host(position_shift_matrix(t, hs, base=30.0, like=like))  # M_t of chapter 2
        np.testing.assert_allclose(adjacent, shift.T, rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(R(t, "rotate_half"), adjacent[np.ix_(half_order, half_order)],
                                   rtol=1e-13, atol=1e-14)  # fmt: skip
        for pairing in ROPE_PAIRINGS:
            np.testing.assert_allclose(R(t, pairing).T @ R(t, pairing), np.eye(hs), atol=1e-14)
            np.testing.assert_allclose(R(t, pairing), np.linalg.matrix_power(R(1, pairing), t),
                                       rtol=1e-12, atol=1e-13)  # fmt: skip
            for s in range(-3, 4):
                np.testing.assert_allclose(R(t, pairing).T @ R(s, pairing), R(s - t, pairing),
                                           rtol=1e-12, atol=1e-13)  # fmt: skip
    x = rng.standard_normal((4, hs))
    for pairing in ROPE_PAIRINGS:
        y, _ = rope_forward(backend.asarray(x), base=30.0, start=2, pairing=pairing)
        rows = np.stack([R(2 + t, pairing) @ x[t] for t in range(4)])
        np.testing.assert_allclose(to_host(y), rows, rtol=1e-13, atol=1e-14)


def test_llama_blocks_match_hugging_face(monkeypatch, rng):
    """Hugging Face's LlamaRMSNorm, LlamaMLP and rotary embedding (built from a config, random
    weights, offline) equal ours, with HF's (out, in) weights transposed into our layout. HF
    computes the norm and the angles in float32, hence the float32 tolerance there."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # before transformers is imported: no network
    transformers = pytest.importorskip("transformers")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    hidden, inter, n_head, start = 8, 12, 2, 3
    rope = {"rope_type": "default", "rope_theta": 500.0}
    cfg = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=inter,
                                   num_attention_heads=n_head, num_key_value_heads=n_head,
                                   rms_norm_eps=1e-6, rope_parameters=rope)  # fmt: skip
    x = rng.standard_normal((B, T, hidden))
    tx = torch.tensor(x)

    norm = llama.LlamaRMSNorm(hidden, eps=1e-6).double()
    w = rng.standard_normal(hidden)
    norm.weight.data = torch.tensor(w)
    y, _ = rmsnorm_forward(x, w, eps=1e-6)
    assert_relative(y, norm(tx), roundoff("float32", hidden, steps=2, why="HF's float32 mean of "
                    "the squares, then its rsqrt"), "RMSNorm vs HF's float32 norm")

    mlp = llama.LlamaMLP(cfg).double()
    projections = (mlp.gate_proj, mlp.up_proj, mlp.down_proj)
    weights = [proj.weight.detach().numpy().T for proj in projections]  # (out, in) -> (in, out)
    y, _ = swiglu_forward(x, *weights)
    np.testing.assert_allclose(y, mlp(tx).detach().numpy(), rtol=1e-13, atol=1e-14)

    hs = hidden // n_head
    q, k = rng.standard_normal((2, B, n_head, T, hs))
    cos, sin = llama.LlamaRotaryEmbedding(cfg)(tx, torch.arange(start, start + T)[None])
    q_hf, k_hf = llama.apply_rotary_pos_emb(torch.tensor(q), torch.tensor(k), cos, sin)
    for ours, theirs in ((q, q_hf), (k, k_hf)):
        y, _ = rope_forward(ours, base=500.0, start=start)  # rotate_half, the default
        assert_relative(y, theirs, roundoff("float32", 1, steps=2, scale=start + T, why="HF's "
                        "float32 angles t theta, t < start + T: cos and sin off by eps t"),
                        "RoPE vs HF's float32 angles")


# --------------------------------------------------------------------------------------------
# Issue 15: the logistic loss against torch's binary cross-entropy


@pytest.mark.parametrize("scale", [1.0, 50.0])
def test_logistic_matches_torch_bce_with_logits(backend, rng, scale):
    """Forward and backward equal torch.nn.functional.binary_cross_entropy_with_logits (plain
    float64 torch and its autograd), also far out in the tails where a naive log(sigmoid) fails."""
    logits, labels = scale * rng.standard_normal((4, 5)), rng.integers(0, 2, size=(4, 5))
    loss, cache = logistic_forward(backend.asarray(logits), backend.asarray(labels))
    (dlogits,) = logistic_backward(1.0, cache)
    leaf = torch.tensor(logits, requires_grad=True)
    want = torch.nn.functional.binary_cross_entropy_with_logits(leaf, torch.tensor(labels * 1.0))
    want.backward()
    np.testing.assert_allclose(float(loss), want.item(), rtol=1e-12)
    np.testing.assert_allclose(to_host(dlogits), leaf.grad.numpy(), rtol=1e-12, atol=1e-15)


def test_logistic_is_two_class_cross_entropy(backend, rng):
    """sigmoid + BCE of z equals softmax cross-entropy of the two logits [0, z], and dz is the
    gradient of the second logit."""
    z, y = rng.standard_normal((3, 4)), rng.integers(0, 2, size=(3, 4))
    loss, cache = logistic_forward(backend.asarray(z), backend.asarray(y))
    pair = np.stack([np.zeros_like(z), z], axis=-1)  # (3, 4, 2)
    ce, ce_cache = cross_entropy_forward(backend.asarray(pair), backend.asarray(y))
    np.testing.assert_allclose(float(loss), float(ce), rtol=1e-12)
    (dz,) = logistic_backward(1.0, cache)
    (dpair,) = cross_entropy_backward(1.0, ce_cache)
    np.testing.assert_allclose(to_host(dz), to_host(dpair)[..., 1], rtol=1e-12, atol=1e-15)
