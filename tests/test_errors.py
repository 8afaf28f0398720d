"""Bad input raises a clear error that names the problem: TypeError for a wrong dtype, ValueError
for a wrong shape or value (CONVENTIONS.md, "Validation"). Every case runs on every backend."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from conftest import get_backend
from gptlab import GPTConfig, gpt_forward, init_params
from gptlab.layers.attention import attention_forward, multihead_forward
from gptlab.layers.attention_single import attention_single_forward
from gptlab.layers.block import block_forward
from gptlab.layers.chunked_classifier import chunked_classifier_forward
from gptlab.layers.cross_entropy import cross_entropy_forward
from gptlab.layers.dropout import dropout_forward
from gptlab.layers.embedding import embedding_forward, embedding_onehot_forward
from gptlab.layers.flash_attention import flash_attention_forward
from gptlab.layers.gelu import gelu_forward
from gptlab.layers.gqa import gqa_attention_forward, gqa_attention_step, gqa_forward, kv_cache_size
from gptlab.layers.layernorm import layernorm_forward
from gptlab.layers.linear import linear_forward
from gptlab.layers.logistic import logistic_forward
from gptlab.layers.mlp import mlp_forward
from gptlab.layers.moe import moe_forward
from gptlab.layers.position_learned import position_learned_forward
from gptlab.layers.position_sinusoidal import position_sinusoidal_forward
from gptlab.layers.relu import relu_forward
from gptlab.layers.rmsnorm import rmsnorm_forward
from gptlab.layers.rope import rope_forward
from gptlab.layers.router import router_forward, top_k_experts
from gptlab.layers.sdpa import sdpa_forward
from gptlab.layers.silu import silu_forward
from gptlab.layers.softmax import softmax_forward
from gptlab.layers.swiglu import swiglu_forward

B, T, C, NH, V = 2, 3, 4, 2, 5


@pytest.fixture
def F(backend):
    """F(*shape): a float array on the backend; F.int(high, *shape): int64 token ids."""
    rng = np.random.default_rng(0)

    class Make:
        def __call__(self, *shape):
            return backend.randn(rng, *shape)

        def int(self, high, *shape):
            return backend.randint(rng, high, *shape)

        def ints(self, values):
            return backend.asarray(np.asarray(values, dtype=np.int64))

    return Make()


# --------------------------------------------------------------------------------------------
# Mismatched shapes


def test_linear_weight_rows_must_match_input_width(F):
    with pytest.raises(ValueError, match=re.escape("w has shape (5, 3), expected (4, *)")):
        linear_forward(F(B, T, C), F(5, 3), F(3))


def test_linear_bias_must_match_output_width(F):
    with pytest.raises(ValueError, match=re.escape("b has shape (4,), expected (3,)")):
        linear_forward(F(B, T, C), F(C, 3), F(4))


@pytest.mark.parametrize("which", ["w", "b"])
def test_layernorm_gain_and_bias_must_match_width(F, which):
    args = {"w": F(C), "b": F(C)}
    args[which] = F(C + 1)
    with pytest.raises(ValueError, match=re.escape(f"{which} has shape (5,), expected (4,)")):
        layernorm_forward(F(B, T, C), args["w"], args["b"])


def test_attention_weights_must_match_width(F):
    with pytest.raises(ValueError, match=re.escape("w_attn has shape (4, 9), expected (4, 12)")):
        attention_forward(F(B, T, C), F(C, 9), F(9), F(C, C), F(C), n_head=NH)
    with pytest.raises(ValueError, match=re.escape("w_proj has shape (3, 4), expected (4, 4)")):
        attention_forward(F(B, T, C), F(C, 3 * C), F(3 * C), F(3, C), F(C), n_head=NH)
    with pytest.raises(ValueError, match=re.escape("b has shape (4,), expected (12,)")):
        attention_forward(F(B, T, C), F(C, 3 * C), F(C), F(C, C), F(C), n_head=NH)


def test_attention_input_needs_positions_and_channels(F):
    with pytest.raises(ValueError, match=re.escape("x must have shape (B, T, C) or (..., T, C), "
                                                   "got (4,)")):
        attention_forward(F(C), F(C, 3 * C), F(3 * C), F(C, C), F(C), n_head=NH)
    with pytest.raises(ValueError, match=re.escape("qkv must have shape (..., T, 3C), got (12,)")):
        multihead_forward(F(3 * C), n_head=NH)


def test_attention_width_must_split_into_heads(F):
    with pytest.raises(ValueError, match=r"n_embd \(4\) must be divisible by n_head \(3\)"):
        attention_forward(F(B, T, C), F(C, 3 * C), F(3 * C), F(C, C), F(C), n_head=3)
    with pytest.raises(ValueError, match=r"qkv width 12 is not 3 \* n_head \* head_size"):
        multihead_forward(F(B, T, 3 * C), n_head=3)


def test_attention_single_weights_must_match(F):
    with pytest.raises(ValueError, match=re.escape("A has shape (3, 5), expected (*, 4)")):
        attention_single_forward(F(C, T), F(3, 5), F(3, C), F(3, C))
    with pytest.raises(ValueError, match=re.escape("C has shape (2, 4), expected (3, 4)")):
        attention_single_forward(F(C, T), F(3, C), F(3, C), F(2, C))
    with pytest.raises(ValueError, match="X must have at least 2 dimensions"):
        attention_single_forward(F(C), F(3, C), F(3, C), F(3, C))


def test_sdpa_shapes_must_match(F):
    with pytest.raises(ValueError, match=re.escape("k has head size 4 but q has 3")):
        sdpa_forward(F(B, NH, T, 3), F(B, NH, T, 4), F(B, NH, T, 3))
    with pytest.raises(ValueError, match=re.escape("v has 2 positions but k has 3")):
        sdpa_forward(F(B, NH, T, 3), F(B, NH, T, 3), F(B, NH, 2, 3))
    message = "the leading dims of q (2, 2, 3, 3), k (2, 3, 3, 3) and v (2, 3, 3, 3) do not broadcast"
    with pytest.raises(ValueError, match=re.escape(message)):
        sdpa_forward(F(B, NH, T, 3), F(B, 3, T, 3), F(B, 3, T, 3))
    with pytest.raises(ValueError, match="q must have at least 2 dimensions"):
        sdpa_forward(F(3), F(T, 3), F(T, 3))


@pytest.mark.parametrize("mask_shape", [(T, T + 1), (2, T, T), (B, NH, T, T, 1), (3, 1, T, T)])
def test_sdpa_mask_must_broadcast_to_the_weights(F, backend, mask_shape):
    """A mask that does not broadcast, or that would grow the weights, is refused by shape."""
    mask = backend.asarray(np.ones(mask_shape, dtype=bool))
    message = (f"mask has shape {mask_shape}, which does not broadcast to the attention weights' "
               f"shape (..., Tq, Tk) = ({B}, 1, {T}, {T})")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        sdpa_forward(F(B, 1, T, 3), F(B, 1, T, 3), F(B, 1, T, 3), mask)


@pytest.mark.parametrize("values", [np.ones((T, T)), np.ones((T, T), dtype=np.int64)])
def test_sdpa_mask_must_be_boolean(F, backend, values):
    with pytest.raises(TypeError, match="mask must be a boolean array .*, got dtype"):
        sdpa_forward(F(T, 3), F(T, 3), F(T, 3), backend.asarray(values))


def test_sdpa_mask_must_be_an_array(F):
    with pytest.raises(TypeError, match="mask must be a boolean array .*, got bool"):
        sdpa_forward(F(T, 3), F(T, 3), F(T, 3), True)


def test_sdpa_names_the_query_row_that_sees_no_key(F, backend):
    mask = np.ones((B, 1, T, T + 1), dtype=bool)
    mask[1, 0, 2] = False
    message = "query row 2 (mask's leading index (1, 0)) can see no key: the mask hides every key"
    with pytest.raises(ValueError, match=re.escape(message)):
        sdpa_forward(F(B, NH, T, 3), F(B, NH, T + 1, 3), F(B, NH, T + 1, 3), backend.asarray(mask))
    # each alone leaves a key, the two together none: key 3 only, and causal allows keys <= 1
    mask = np.zeros((T, T + 1), dtype=bool)
    mask[:, 3] = True
    message = "query row 0 can see no key: the mask and causal=True together hide every key"
    with pytest.raises(ValueError, match=re.escape(message)):
        sdpa_forward(F(T, 3), F(T + 1, 3), F(T + 1, 3), backend.asarray(mask), causal=True)


def test_sdpa_causal_needs_a_key_for_every_query(F):
    with pytest.raises(ValueError, match="query row 0 can see no key: causal=True aligns the 3 "
                                         "queries with the last of the 2 keys, so the first 1"):
        sdpa_forward(F(T, 3), F(2, 3), F(2, 3), causal=True)
    with pytest.raises(ValueError, match=r"query row 0 can see no key: k and v have no positions"):
        sdpa_forward(F(T, 3), F(0, 3), F(0, 3))
    with pytest.raises(ValueError, match="causal must be True or False, got 'yes'"):
        sdpa_forward(F(T, 3), F(T, 3), F(T, 3), causal="yes")


def test_sdpa_dtypes_must_match(backend):
    rng = np.random.default_rng(0)
    b64, b32 = backend, get_backend(backend.name, "float32")
    with pytest.raises(TypeError, match="q has dtype .*float64 but k has dtype .*float32"):
        sdpa_forward(b64.randn(rng, T, 3), b32.randn(rng, T, 3), b64.randn(rng, T, 3))
    with pytest.raises(TypeError, match="q has dtype .*float32 but v has dtype .*float64"):
        sdpa_forward(b32.randn(rng, T, 3), b32.randn(rng, T, 3), b64.randn(rng, T, 3))


def test_gqa_query_heads_must_be_a_multiple_of_the_key_value_heads(F):
    message = "q has 3 heads, not a multiple of k's 2 key/value heads"
    with pytest.raises(ValueError, match=re.escape(message)):
        gqa_forward(F(B, 3, T, 2), F(B, 2, T, 2), F(B, 2, T, 2))
    with pytest.raises(ValueError, match=re.escape("n_head (6) must be a multiple of n_kv_head (4)")):
        gqa_attention_forward(F(B, T, C), F(C, 12), F(C, 8), F(C, 8), F(12, C), n_head=6,
                              n_kv_head=4)  # fmt: skip


def test_gqa_shapes_must_match(F):
    with pytest.raises(ValueError, match=re.escape("k must have shape (B, NKV, T, hs), got (2, 3, 2)")):
        gqa_forward(F(B, 4, T, 2), F(B, T, 2), F(B, 2, T, 2))
    with pytest.raises(ValueError, match=re.escape("v has 1 heads but k has 2")):
        gqa_forward(F(B, 4, T, 2), F(B, 2, T, 2), F(B, 1, T, 2))
    with pytest.raises(ValueError, match=re.escape("k has batch size 1 but q has 2")):
        gqa_forward(F(B, 4, T, 2), F(1, 2, T, 2), F(1, 2, T, 2))
    with pytest.raises(ValueError, match=re.escape("k has head size 3 but q has 2")):
        gqa_forward(F(B, 4, T, 2), F(B, 2, T, 3), F(B, 2, T, 3))
    with pytest.raises(ValueError, match=re.escape("v has 2 positions but k has 3")):
        gqa_forward(F(B, 4, T, 2), F(B, 2, T, 2), F(B, 2, 2, 2))


@pytest.mark.parametrize("mask_shape", [(B, 2, T, T), (3, 1, T, T), (T, T + 1), (1, B, 4, T, T)])
def test_gqa_mask_must_broadcast_to_every_query_head(F, backend, mask_shape):
    """The mask speaks of the NH query heads: one per key/value head is refused."""
    mask = backend.asarray(np.ones(mask_shape, dtype=bool))
    message = (f"mask has shape {mask_shape}, which does not broadcast to the attention weights' "
               f"shape (B, NH, Tq, Tk) = ({B}, 4, {T}, {T})")  # fmt: skip
    with pytest.raises(ValueError, match=re.escape(message)):
        gqa_forward(F(B, 4, T, 2), F(B, 2, T, 2), F(B, 2, T, 2), mask)
    with pytest.raises(TypeError, match="mask must be a boolean array .*, got dtype"):
        gqa_forward(F(B, 4, T, 2), F(B, 2, T, 2), F(B, 2, T, 2), F(B, 4, T, T))


def test_gqa_dtypes_must_match(backend):
    rng = np.random.default_rng(0)
    b64, b32 = backend, get_backend(backend.name, "float32")
    with pytest.raises(TypeError, match="q has dtype .*float64 but k has dtype .*float32"):
        gqa_forward(b64.randn(rng, B, 4, T, 2), b32.randn(rng, B, 2, T, 2), b64.randn(rng, B, 2, T, 2))
    with pytest.raises(TypeError, match="x has dtype .*float32 but wv has dtype .*float64"):
        gqa_attention_forward(b32.randn(rng, B, T, C), b32.randn(rng, C, 8), b32.randn(rng, C, 4),
                              b64.randn(rng, C, 4), b32.randn(rng, 8, C), n_head=4, n_kv_head=2)  # fmt: skip


def test_gqa_attention_weights_must_match(F):
    def call(wq=(C, 8), wk=(C, 4), wv=(C, 4), wo=(8, C), **hyper):
        return gqa_attention_forward(F(B, T, C), F(*wq), F(*wk), F(*wv), F(*wo),
                                     **{"n_head": 4, "n_kv_head": 2, **hyper})  # fmt: skip

    with pytest.raises(ValueError, match=re.escape("wq has shape (3, 8), expected (4, *)")):
        call(wq=(3, 8))
    with pytest.raises(ValueError, match="wq has 6 columns, not n_head \\* head_size for n_head=4"):
        call(wq=(C, 6))
    with pytest.raises(ValueError, match=re.escape("wk has shape (4, 8), expected (4, 4)")):
        call(wk=(C, 8))
    with pytest.raises(ValueError, match=re.escape("wo has shape (8, 3), expected (8, 4)")):
        call(wo=(8, 3))
    with pytest.raises(ValueError, match="n_kv_head must be an integer >= 1, got 0"):
        call(n_kv_head=0)
    with pytest.raises(TypeError, match="rotate must be None or a pair"):
        call(rotate=lambda a: (a, None))
    with pytest.raises(TypeError, match="^wk must be a floating-point array"):
        gqa_attention_forward(F(B, T, C), F(C, 8), F.int(3, C, 4), F(C, 4), F(8, C), n_head=4,
                              n_kv_head=2)  # fmt: skip


def test_gqa_attention_step_checks_the_cache(F):
    weights = F(C, 8), F(C, 4), F(C, 4), F(8, C)
    with pytest.raises(ValueError, match="k_past and v_past go together"):
        gqa_attention_step(F(B, 1, C), *weights, F(B, 2, T, 2), None, n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match=re.escape("k_past has shape (2, 4, 3, 2), expected (2, 2, *, 2)")):
        gqa_attention_step(F(B, 1, C), *weights, F(B, 4, T, 2), F(B, 4, T, 2), n_head=4, n_kv_head=2)
    with pytest.raises(ValueError, match="v_past holds 2 positions but k_past 3"):
        gqa_attention_step(F(B, 1, C), *weights, F(B, 2, T, 2), F(B, 2, 2, 2), n_head=4, n_kv_head=2)
    with pytest.raises(TypeError, match="rotate must be None or a function"):
        gqa_attention_step(F(B, 1, C), *weights, None, None, n_head=4, n_kv_head=2, rotate=(1, 2))


def test_kv_cache_size_checks_its_arguments():
    with pytest.raises(ValueError, match="T must be an integer >= 0, got -1"):
        kv_cache_size(2, 2, 4, -1)
    with pytest.raises(ValueError, match="n_layer must be an integer >= 1, got 1.5"):
        kv_cache_size(1.5, 2, 4, 8)
    with pytest.raises(ValueError, match=r"dtype must be one of \('float64', .*, got 'fp8'"):
        kv_cache_size(2, 2, 4, 8, "fp8")


def test_mlp_weights_must_chain(F):
    with pytest.raises(ValueError, match=re.escape("w has shape (8, 4), expected (16, *)")):
        mlp_forward(F(B, T, C), F(C, 4 * C), F(4 * C), F(8, C), F(C))


def test_position_learned_checks_width_and_length(F):
    with pytest.raises(ValueError, match=re.escape("wpe must have shape (block_size, 4)")):
        position_learned_forward(F(B, T, C), F(8, 3))
    with pytest.raises(ValueError, match="sequence length 3 is longer than the 2 learned positions"):
        position_learned_forward(F(B, T, C), F(2, C))


def test_position_sinusoidal_needs_an_even_width(F):
    with pytest.raises(ValueError, match="even width, got C=3"):
        position_sinusoidal_forward(F(B, T, 3))


def test_rmsnorm_gain_must_match_width(F):
    with pytest.raises(ValueError, match=re.escape("w has shape (5,), expected (4,)")):
        rmsnorm_forward(F(B, T, C), F(C + 1))


def test_swiglu_weights_must_chain(F):
    with pytest.raises(ValueError, match=re.escape("w_gate has shape (5, 6), expected (4, *)")):
        swiglu_forward(F(B, T, C), F(C + 1, 6), F(C, 6), F(6, C))
    with pytest.raises(ValueError, match=re.escape("w_up has shape (4, 5), expected (4, 6)")):
        swiglu_forward(F(B, T, C), F(C, 6), F(C, 5), F(6, C))
    with pytest.raises(ValueError, match=re.escape("w_down has shape (5, 4), expected (6, *)")):
        swiglu_forward(F(B, T, C), F(C, 6), F(C, 6), F(5, C))


def test_rope_needs_pairs_and_positions(F):
    message = "rope needs an even head size to form pairs: x has shape (2, 3, 5), (..., T, hs) with hs=5"
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_forward(F(B, T, 5))
    with pytest.raises(ValueError, match=re.escape("x must have at least 2 dimensions, got shape (4,)")):
        rope_forward(F(C))


@pytest.mark.parametrize("hyper, message", [
    ({"pairing": "gptj"}, "pairing must be one of ('rotate_half', 'adjacent'), got 'gptj'"),
    ({"start": 2.0}, "start must be an integer position, got 2.0"),
    ({"start": True}, "start must be an integer position, got True"),
    ({"base": 0.0}, "base must be a positive number, got 0.0"),
    ({"base": float("inf")}, "base must be a positive number, got inf"),
])  # fmt: skip
def test_rope_hyperparameters_are_checked(F, hyper, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_forward(F(B, T, C), **hyper)


def test_block_reports_missing_parameters(F):
    with pytest.raises(ValueError, match=r"block parameters missing: \['ln_1.weight'"):
        block_forward(F(B, T, C), {}, n_head=NH)


def test_block_ln_order_is_checked(F):
    p = {name: F(1) for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
         "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight",
         "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")}  # fmt: skip
    with pytest.raises(ValueError, match="ln_order must be 'pre' or 'post', got 'middle'"):
        block_forward(F(B, T, C), p, n_head=NH, ln_order="middle")


E = 4  # experts


def _moe_weights(F, E=E, C=C, H=6):
    """w_router (C, E), w_fc (E, C, H), b_fc (E, H), w_proj (E, H, C), b_proj (E, C)."""
    return F(C, E), F(E, C, H), F(E, H), F(E, H, C), F(E, C)


@pytest.mark.parametrize("position, bad, message", [
    (0, (C + 1, E), "w_router has shape (5, 4), expected (4, *)"),
    (1, (E - 1, C, 6), "w_fc has shape (3, 4, 6), expected (4, 4, *)"),
    (1, (E, C + 1, 6), "w_fc has shape (4, 5, 6), expected (4, 4, *)"),
    (2, (E, 5), "b_fc has shape (4, 5), expected (4, 6)"),
    (3, (E, 6, C + 1), "w_proj has shape (4, 6, 5), expected (4, 6, 4)"),
    (4, (C,), "b_proj has shape (4,), expected (4, 4)"),
])  # fmt: skip
def test_moe_weights_must_match_the_input_and_each_other(F, position, bad, message):
    weights = list(_moe_weights(F))
    weights[position] = F(*bad)
    with pytest.raises(ValueError, match=re.escape(message)):
        moe_forward(F(B, T, C), *weights)


@pytest.mark.parametrize("k", [0, E + 1, 1.0, True])
def test_moe_k_must_be_between_1_and_the_number_of_experts(F, k):
    message = f"k must be an integer between 1 and the number of experts E=4, got {k!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        moe_forward(F(B, T, C), *_moe_weights(F), k=k)
    with pytest.raises(ValueError, match=re.escape(message)):
        top_k_experts(F(B * T, E), k)


@pytest.mark.parametrize("capacity_factor", [0, 0.0, -1.0, "1"])
def test_moe_capacity_factor_must_be_positive_or_none(F, capacity_factor):
    with pytest.raises(ValueError, match=re.escape(f"capacity_factor must be a number > 0 or None "
                                                   f"(no limit), got {capacity_factor!r}")):  # fmt: skip
        moe_forward(F(B, T, C), *_moe_weights(F), capacity_factor=capacity_factor)


def test_moe_and_router_settings_are_checked(F):
    with pytest.raises(ValueError, match="renormalize must be True or False, got 1"):
        moe_forward(F(B, T, C), *_moe_weights(F), renormalize=1)
    with pytest.raises(ValueError, match=re.escape("aux_weight must be a number >= 0, got -0.1")):
        moe_forward(F(B, T, C), *_moe_weights(F), aux_weight=-0.1)
    with pytest.raises(ValueError, match="x must have at least 1 dimensions, got shape"):
        moe_forward(F(), *_moe_weights(F))


def test_top_k_experts_needs_finite_logits(F, backend):
    for bad in (math.nan, math.inf, -math.inf):
        logits = backend.asarray(np.array([[0.0, 1.0, bad, 2.0]]))
        with pytest.raises(ValueError, match="logits must be finite: a NaN or infinite router"):
            top_k_experts(logits, 2)


def test_router_experts_must_be_integer_ids_of_the_right_shape(F):
    with pytest.raises(TypeError, match="experts must be an integer array"):
        router_forward(F(B * T, E), F(B * T, 2))
    with pytest.raises(ValueError, match=re.escape("experts has shape (5, 2), expected (6, *)")):
        router_forward(F(B * T, E), F.int(E, B * T - 1, 2))
    with pytest.raises(ValueError, match=re.escape("experts.shape[1] (k) must be an integer "
                                                   "between 1 and the number of experts E=4, "
                                                   "got 5")):  # fmt: skip
        router_forward(F(B * T, E), F.int(E, B * T, E + 1))
    with pytest.raises(ValueError, match=re.escape("experts holds ids from 0 to 4; expert ids "
                                                   "must lie in 0..3")):  # fmt: skip
        router_forward(F(2, E), F.ints([[0], [4]]))
    with pytest.raises(ValueError, match=re.escape("experts holds ids from -1 to 2")):
        router_forward(F(2, E), F.ints([[2], [-1]]))
    with pytest.raises(ValueError, match=re.escape("logits has shape (2, 3, 4), expected (*, *)")):
        router_forward(F(2, 3, E), F.int(E, 2, 1))


def test_moe_input_and_weights_share_a_dtype(backend):
    b32 = get_backend(backend.name, "float32")
    rng = np.random.default_rng(0)
    weights = [backend.randn(rng, *shape) for shape in ((C, E), (E, C, 6), (E, 6), (E, 6, C),
                                                        (E, C))]  # fmt: skip
    with pytest.raises(TypeError, match="x has dtype .*float32 but w_router has dtype .*float64"):
        moe_forward(b32.randn(rng, B, T, C), *weights)


# --------------------------------------------------------------------------------------------
# Wrong dtypes


@pytest.mark.parametrize(
    "name, call",
    [
        ("x", lambda F, i: linear_forward(i, F(C, 3), F(3))),
        ("w", lambda F, i: linear_forward(F(B, T, C), F.int(3, C, 3), F(3))),
        ("x", lambda F, i: layernorm_forward(i, F(C), F(C))),
        ("x", lambda F, i: relu_forward(i)),
        ("x", lambda F, i: gelu_forward(i)),
        ("x", lambda F, i: softmax_forward(i)),
        ("x", lambda F, i: dropout_forward(i, p=0.1, seed=0)),
        ("x", lambda F, i: attention_forward(i, F(C, 3 * C), F(3 * C), F(C, C), F(C), n_head=NH)),
        ("qkv", lambda F, i: multihead_forward(F.int(3, B, T, 3 * C), n_head=NH)),
        ("q", lambda F, i: sdpa_forward(i, F(B, T, C), F(B, T, C))),
        ("k", lambda F, i: sdpa_forward(F(B, T, C), i, F(B, T, C))),
        ("v", lambda F, i: sdpa_forward(F(B, T, C), F(B, T, C), i)),
        ("q", lambda F, i: gqa_forward(F.int(3, B, 2, T, C), F(B, 1, T, C), F(B, 1, T, C))),
        ("v", lambda F, i: gqa_forward(F(B, 2, T, C), F(B, 1, T, C), F.int(3, B, 1, T, C))),
        ("x", lambda F, i: gqa_attention_forward(i, F(C, 4), F(C, 2), F(C, 2), F(4, C), n_head=2,
                                                 n_kv_head=1)),
        ("X", lambda F, i: attention_single_forward(F.int(3, C, T), F(3, C), F(3, C), F(3, C))),
        ("logits", lambda F, i: cross_entropy_forward(F.int(3, B, T, V), F.int(V, B, T))),
        ("wte", lambda F, i: embedding_forward(F.int(V, B, T), F.int(3, V, C))),
        ("x", lambda F, i: position_sinusoidal_forward(i)),
        ("x", lambda F, i: position_learned_forward(i, F(8, C))),
        ("x", lambda F, i: rmsnorm_forward(i, F(C))),
        ("w", lambda F, i: rmsnorm_forward(F(B, T, C), F.int(3, C))),
        ("x", lambda F, i: silu_forward(i)),
        ("x", lambda F, i: swiglu_forward(i, F(C, 6), F(C, 6), F(6, C))),
        ("w_down", lambda F, i: swiglu_forward(F(B, T, C), F(C, 6), F(C, 6), F.int(3, 6, C))),
        ("x", lambda F, i: rope_forward(i)),
        ("x", lambda F, i: moe_forward(i, *_moe_weights(F))),
        ("w_router", lambda F, i: moe_forward(F(B, T, C), F.int(3, C, E), *_moe_weights(F)[1:])),
        ("logits", lambda F, i: router_forward(F.int(3, B * T, E), F.int(E, B * T, 2))),
        ("logits", lambda F, i: top_k_experts(F.int(3, B * T, E), 2)),
        ("logits", lambda F, i: logistic_forward(F.int(3, B, T), F.int(2, B, T))),
    ],
)
def test_integer_arrays_where_floats_are_needed(F, name, call):
    ints = F.int(3, B, T, C)
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point array, got dtype .*int"):
        call(F, ints)


def test_non_arrays_are_rejected():
    """A list is no array: array_namespace (the first line of every layer) says so."""
    with pytest.raises(TypeError, match="list"):
        relu_forward([1.0, -1.0])


@pytest.mark.parametrize("forward", [embedding_forward, embedding_onehot_forward])
def test_embedding_needs_integer_ids(F, forward):
    with pytest.raises(TypeError, match="idx must be an integer array of token ids, got dtype .*float"):
        forward(F(B, T), F(V, C))


def test_cross_entropy_needs_integer_targets(F):
    with pytest.raises(TypeError, match="targets must be an integer array of token ids"):
        cross_entropy_forward(F(B, T, V), F(B, T))


# --------------------------------------------------------------------------------------------
# Ids outside the vocabulary


@pytest.mark.parametrize("forward", [embedding_forward, embedding_onehot_forward])
def test_embedding_rejects_negative_ids(F, forward):
    with pytest.raises(ValueError, match=r"idx holds a negative token id \(-1\)"):
        forward(F.ints([[0, -1, 2]]), F(V, C))


@pytest.mark.parametrize("forward", [embedding_forward, embedding_onehot_forward])
def test_embedding_rejects_ids_past_the_vocabulary(F, forward):
    with pytest.raises(ValueError, match="idx holds token id 5, outside the vocabulary of size 5"):
        forward(F.ints([[0, 5, 2]]), F(V, C))


def test_cross_entropy_rejects_targets_outside_the_vocabulary(F):
    with pytest.raises(ValueError, match="targets holds token id 7, outside the vocabulary of size 5"):
        cross_entropy_forward(F(1, 3, V), F.ints([[0, 7, 1]]))
    with pytest.raises(ValueError, match=r"targets holds a negative token id \(-2\)"):
        cross_entropy_forward(F(1, 3, V), F.ints([[0, -2, 1]]))


def test_cross_entropy_targets_shape_must_match_logits(F):
    message = "targets has shape (2, 4) but logits has shape (2, 3, 5)"
    with pytest.raises(ValueError, match=re.escape(message)):
        cross_entropy_forward(F(B, T, V), F.int(V, B, 4))
    with pytest.raises(ValueError, match=re.escape("expected targets.shape == logits.shape[:-1]")):
        cross_entropy_forward(F(B, T, V), F.int(V, B, T, 1))


# --------------------------------------------------------------------------------------------
# Hyperparameters and the model


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5])
def test_dropout_probability_out_of_range(F, p):
    with pytest.raises(ValueError, match=re.escape(f"dropout probability p must be in [0, 1), got {p!r}")):
        dropout_forward(F(B, T, C), p=p, seed=0)


@pytest.mark.parametrize("approximate", ["erf", "exact", "Tanh", None])
def test_gelu_unknown_approximation(F, approximate):
    message = f"approximate must be one of ('tanh', 'none'), got {approximate!r}"
    with pytest.raises(ValueError, match=re.escape(message)):
        gelu_forward(F(B, T, C), approximate=approximate)


def test_mlp_passes_the_gelu_check_on(F):
    with pytest.raises(ValueError, match="approximate must be one of"):
        mlp_forward(F(B, T, C), F(C, 4 * C), F(4 * C), F(4 * C, C), F(C), approximate="sigmoid")


@pytest.mark.parametrize("n_embd, n_head", [(10, 3), (4, 3), (6, 4)])
def test_config_width_must_split_into_heads(n_embd, n_head):
    with pytest.raises(ValueError, match=rf"n_embd \({n_embd}\) must be divisible by n_head \({n_head}\)"):
        GPTConfig(n_layer=1, n_head=n_head, n_embd=n_embd, vocab_size=V, block_size=8)


@pytest.mark.parametrize("field, value", [("n_layer", 0), ("n_head", -1), ("vocab_size", 2.5),
                                          ("block_size", True)])
def test_config_sizes_must_be_positive_integers(field, value):
    kwargs = dict(n_layer=1, n_head=1, n_embd=4, vocab_size=V, block_size=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"GPTConfig.{field} must be a positive integer, got {value!r}"):
        GPTConfig(**kwargs)


@pytest.mark.parametrize("field, value", [("ln_order", "sandwich"), ("position", "alibi"), ("gelu", "relu")])
def test_config_choices_are_checked(field, value):
    with pytest.raises(ValueError, match=rf"GPTConfig.{field} must be one of .*, got '{value}'"):
        GPTConfig(n_layer=1, n_head=1, n_embd=4, vocab_size=V, block_size=8, **{field: value})


@pytest.mark.parametrize("bias", ["False", 0, None])
def test_config_bias_must_be_a_bool(bias):
    with pytest.raises(ValueError, match=rf"GPTConfig.bias must be True or False, got {bias!r}"):
        GPTConfig(n_layer=1, n_head=1, n_embd=4, vocab_size=V, block_size=8, bias=bias)


@pytest.mark.parametrize("dropout", [-0.5, 1.0])
def test_config_dropout_range(dropout):
    with pytest.raises(ValueError, match=r"GPTConfig.dropout must be in \[0, 1\)"):
        GPTConfig(n_layer=1, n_head=1, n_embd=4, vocab_size=V, block_size=8, dropout=dropout)


CFG = GPTConfig(n_layer=1, n_head=NH, n_embd=C, vocab_size=V, block_size=4)


@pytest.fixture
def params(backend):
    return init_params(CFG, seed=0, backend="numpy", dtype="float64") if backend.name == "numpy" \
        else {k: backend.asarray(v) for k, v in init_params(CFG, dtype="float64").items()}


def test_gpt_forward_rejects_a_sequence_longer_than_block_size(F, params):
    with pytest.raises(ValueError, match=r"sequence length 5 is longer than the context \(block_size=4\)"):
        gpt_forward(params, F.int(V, 1, 5), CFG)


def test_gpt_forward_rejects_bad_ids_and_targets(F, params):
    with pytest.raises(ValueError, match="idx holds token id 5, outside the vocabulary of size 5"):
        gpt_forward(params, F.ints([[1, 5]]), CFG)
    with pytest.raises(TypeError, match="idx must be an integer array of token ids"):
        gpt_forward(params, F(1, 2), CFG)
    with pytest.raises(ValueError, match=re.escape("idx must have shape (B, T), got (3,)")):
        gpt_forward(params, F.int(V, 3), CFG)
    with pytest.raises(ValueError, match=re.escape("targets has shape (1, 3), idx has (1, 2)")):
        gpt_forward(params, F.int(V, 1, 2), CFG, targets=F.int(V, 1, 3))


def test_gpt_forward_checks_parameters(F, params):
    broken = dict(params)
    del broken["ln_f.bias"]
    with pytest.raises(ValueError, match=r"missing \['ln_f.bias'\]"):
        gpt_forward(broken, F.int(V, 1, 2), CFG)
    broken = dict(params, **{"h.0.ln_1.weight": F(C + 1)})
    with pytest.raises(ValueError, match=re.escape("h.0.ln_1.weight has shape (5,), expected (4,)")):
        gpt_forward(broken, F.int(V, 1, 2), CFG)


def test_same_errors_on_float32(backend):
    """The checks do not depend on the float dtype."""
    b32 = get_backend(backend.name, "float32")
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=re.escape("w has shape (5,), expected (4,)")):
        layernorm_forward(b32.randn(rng, B, T, C), b32.randn(rng, 5), b32.randn(rng, C))


def test_logistic_labels_must_be_integer_zero_or_one_of_the_logits_shape(F):
    with pytest.raises(TypeError, match="labels must be an integer array"):
        logistic_forward(F(B, T), F(B, T))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        logistic_forward(F(1, 3), F.ints([[0, 2, 1]]))
    with pytest.raises(ValueError, match="labels must be 0 or 1"):
        logistic_forward(F(1, 3), F.ints([[0, -1, 1]]))
    with pytest.raises(ValueError, match=re.escape("labels has shape (2, 4) but logits has shape "
                                                   "(2, 3): expected one label per logit")):
        logistic_forward(F(B, T), F.int(2, B, 4))


# issue 11: flash attention and the chunked classifier


def test_flash_attention_checks_like_sdpa_and_its_tiles(F):
    with pytest.raises(ValueError, match=re.escape("k has head size 4 but q has 3")):
        flash_attention_forward(F(B, NH, T, 3), F(B, NH, T, 4), F(B, NH, T, 3))
    with pytest.raises(TypeError, match="k must be a floating-point array"):
        flash_attention_forward(F(T, 3), F.int(V, T, 3), F(T, 3))
    with pytest.raises(ValueError, match="query row 0 can see no key: causal=True"):
        flash_attention_forward(F(4, 3), F(2, 3), F(2, 3), causal=True)
    with pytest.raises(ValueError, match=re.escape("q has no positions (Tq=0)")):
        flash_attention_forward(F(0, 3), F(2, 3), F(2, 3))
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match=f"block_q must be a positive integer .*got {bad!r}"):
            flash_attention_forward(F(T, 3), F(T, 3), F(T, 3), block_q=bad)
    with pytest.raises(ValueError, match="block_k must be a positive integer"):
        flash_attention_forward(F(T, 3), F(T, 3), F(T, 3), block_k=0)


def test_chunked_classifier_rejects_bad_shapes_ids_and_chunks(F):
    with pytest.raises(TypeError, match="targets must be an integer array"):
        chunked_classifier_forward(F(B, T, C), F(V, C), F(B, T))
    with pytest.raises(TypeError, match="wte must be a floating-point array"):
        chunked_classifier_forward(F(B, T, C), F.int(V, V, C), F.int(V, B, T))
    with pytest.raises(ValueError, match=re.escape("wte must have shape (V, C), got (5,)")):
        chunked_classifier_forward(F(B, T, C), F(V), F.int(V, B, T))
    with pytest.raises(ValueError, match=re.escape("x has shape (2, 3, 4), expected (*, *, 3)")):
        chunked_classifier_forward(F(B, T, C), F(V, 3), F.int(V, B, T))
    with pytest.raises(ValueError, match=re.escape("targets has shape (2, 2) but x has shape "
                                                   "(2, 3, 4): expected targets.shape == x.shape[:-1]")):
        chunked_classifier_forward(F(B, T, C), F(V, C), F.int(V, B, 2))
    with pytest.raises(ValueError, match="targets holds token id 5, outside the vocabulary of size 5"):
        chunked_classifier_forward(F(1, 2, C), F(V, C), F.ints([[1, 5]]))
    with pytest.raises(ValueError, match="targets is empty"):
        chunked_classifier_forward(F(0, C), F(V, C), F.int(V, 0))
    with pytest.raises(ValueError, match="chunk_size must be a positive integer .*got 0"):
        chunked_classifier_forward(F(B, T, C), F(V, C), F.int(V, B, T), chunk_size=0)
