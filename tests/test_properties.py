"""Property tests (hypothesis) over shapes, ones included: B in 1..3, T in 1..5, n_head in 1..3,
head size in 1..3. Gradients of the bigger pieces (attention, block, the whole GPT) are checked
against torch autograd, which is cheap, and the whole GPT also against finite differences on a
seeded subset of every parameter; small layers against finite differences in full. Plus the
invariants: softmax rows sum to 1, causal attention never looks ahead, LayerNorm output has mean
0 and variance ~1 per row; scaled dot-product attention over broadcast leading dims, Tq != Tk
and random masks (hidden keys get weight 0, causal queries are the tail of full causal
attention, broadcasting equals repeating, a query that sees no key is refused by name).

Examples are few (``max_examples`` 10-15) and derandomized, so the run is short and the same
every time.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from conftest import get_backend, random_attention_mask, to_host
from gptlab import GPTConfig, gpt_forward, init_params
from gptlab.gradcheck import check_layer, check_model
from gptlab.layers.attention import attention_forward, attention_backward
from gptlab.layers.attention_single import attention_single_forward
from gptlab.layers.block import block_backward, block_forward, block_param_shapes
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.gqa import gqa_attention_backward, gqa_attention_forward, gqa_backward, gqa_forward
from gptlab.layers.layernorm import layernorm_backward, layernorm_forward
from gptlab.layers.logistic import logistic_backward, logistic_forward
from gptlab.layers.rmsnorm import rmsnorm_backward, rmsnorm_forward
from gptlab.layers.rope import ROPE_PAIRINGS, rope_backward, rope_forward
from gptlab.layers.moe import moe_backward, moe_forward
from gptlab.layers.sdpa import causal_mask, sdpa_backward, sdpa_forward
from gptlab.layers.silu import silu_forward
from gptlab.layers.softmax import softmax_forward
from gptlab.layers.swiglu import swiglu_backward, swiglu_forward

TOL = 1e-7


def fast(max_examples: int = 15):
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


sizes = st.fixed_dictionaries({
    "B": st.integers(1, 3), "T": st.integers(1, 5), "n_head": st.integers(1, 3),
    "hs": st.integers(1, 3), "seed": st.integers(0, 2**16),
})  # fmt: skip
backends = st.sampled_from(["numpy", "torch"])


def _attention_inputs(rng, B, T, C):
    return (rng.standard_normal((B, T, C)), 0.5 * rng.standard_normal((C, 3 * C)),
            rng.standard_normal(3 * C), rng.standard_normal((C, C)), rng.standard_normal(C))  # fmt: skip


def _block_params(rng, C):
    p = {name: 0.5 * rng.standard_normal(shape) for name, shape in block_param_shapes(C).items()}
    p["ln_1.weight"] += 1.0
    p["ln_2.weight"] += 1.0
    return p


# --------------------------------------------------------------------------------------------
# Gradients over shapes


@fast()
@given(s=sizes, causal=st.booleans(), backend_name=backends)
def test_attention_backward_over_shapes(s, causal, backend_name):
    backend, rng = get_backend(backend_name), np.random.default_rng(s["seed"])
    C = s["n_head"] * s["hs"]
    args = [backend.asarray(a) for a in _attention_inputs(rng, s["B"], s["T"], C)]
    forward = functools.partial(attention_forward, n_head=s["n_head"], causal=causal)
    check_layer(forward, attention_backward, *args, oracle="autograd").assert_ok(TOL)


@fast()
@given(s=sizes, ln_order=st.sampled_from(["pre", "post"]), gelu=st.sampled_from(["tanh", "none"]),
       dropout=st.sampled_from([0.0, 0.3]))  # fmt: skip
def test_block_backward_over_shapes(s, ln_order, gelu, dropout):
    rng = np.random.default_rng(s["seed"])
    C = s["n_head"] * s["hs"]
    x, p = rng.standard_normal((s["B"], s["T"], C)), _block_params(rng, C)
    forward = functools.partial(block_forward, n_head=s["n_head"], ln_order=ln_order, gelu=gelu,
                                dropout=dropout, seed=s["seed"])  # fmt: skip
    check_layer(forward, block_backward, x, p, oracle="autograd").assert_ok(TOL)


@fast()
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), C=st.integers(1, 8),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=st.integers(0, 2**16))  # fmt: skip
def test_layernorm_backward_over_shapes(lead, C, scale, seed):
    rng = np.random.default_rng(seed)
    x = scale * rng.standard_normal((*lead, C))
    w, b = 1.0 + rng.standard_normal(C), rng.standard_normal(C)
    check_layer(layernorm_forward, layernorm_backward, x, w, b, oracle="autograd").assert_ok(TOL)
    # For C <= 2 the normalized row is +-sqrt(var / (var + eps)) whatever x is, so dx is of order
    # eps / var: finite differences cannot resolve so small a gradient to 1e-7 (their round-off
    # is ~1e-10 of F). Autograd checks those widths; finite differences the others.
    if C >= 3:
        check_layer(layernorm_forward, layernorm_backward, x, w, b).assert_ok(TOL)


@fast()
@given(B=st.integers(1, 3), T=st.integers(1, 5), V=st.integers(1, 7), scale=st.sampled_from([0.1, 3.0, 50.0]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_cross_entropy_backward_over_shapes(B, T, V, scale, seed):
    rng = np.random.default_rng(seed)
    logits, targets = scale * rng.standard_normal((B, T, V)), rng.integers(0, V, size=(B, T))
    result = check_layer(cross_entropy_forward, cross_entropy_backward, logits, targets)
    result.assert_ok(TOL)


sdpa_shapes = st.fixed_dictionaries({
    "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2), "Tq": st.integers(1, 4),
    "extra_keys": st.integers(0, 2), "hs": st.integers(1, 3), "hv": st.integers(1, 3),
    "causal": st.booleans(), "masked": st.booleans(), "seed": st.integers(0, 2**16),
})  # fmt: skip


def _sdpa_inputs(s):
    """q (*lead, Tq, hs); k, v with Tk = Tq + extra_keys and some leading dims shrunk to 1 (they
    broadcast); a random mask with a random subset of the leading dims, or None; the rng."""
    rng = np.random.default_rng(s["seed"])
    lead, Tq, Tk = tuple(s["lead"]), s["Tq"], s["Tq"] + s["extra_keys"]
    kv_lead = tuple(1 if rng.random() < 0.5 else n for n in lead)
    q, k = rng.standard_normal((*lead, Tq, s["hs"])), rng.standard_normal((*kv_lead, Tk, s["hs"]))
    v = rng.standard_normal((*kv_lead, Tk, s["hv"]))
    mask_lead = tuple(1 if rng.random() < 0.5 else n for n in lead)
    mask_lead = mask_lead[rng.integers(0, len(lead) + 1) :]  # leading dims may be left out
    mask = random_attention_mask(rng, (*mask_lead, Tq, Tk)) if s["masked"] else None
    return q, k, v, mask, rng


@fast()
@given(s=sdpa_shapes)
def test_sdpa_backward_over_shapes(s):
    q, k, v, mask, _ = _sdpa_inputs(s)
    args = (q, k, v) if mask is None else (q, k, v, mask)
    for oracle in ("autograd", "finite_differences"):
        check_layer(sdpa_forward, sdpa_backward, *args, causal=s["causal"],
                    oracle=oracle).assert_ok(TOL)  # fmt: skip


@fast()
@given(s=sdpa_shapes, backend_name=st.sampled_from(["numpy", "torch", "strict"]))
def test_sdpa_weights_sum_to_one_and_hidden_keys_get_none(s, backend_name):
    """The output has the broadcast leading dims; every row of att sums to 1 and is exactly 0
    where the mask or the causal triangle (key j > i + Tk - Tq) hides a key."""
    backend = get_backend(backend_name)
    q, k, v, mask, _ = _sdpa_inputs(s)
    inputs = [backend.asarray(a) for a in (q, k, v)]
    if mask is not None:
        inputs.append(backend.asarray(mask))
    out, (_, _, _, att, _, _) = sdpa_forward(*inputs, causal=s["causal"])
    att = to_host(att)
    lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    assert tuple(out.shape) == (*lead, s["Tq"], s["hv"])
    np.testing.assert_allclose(att.sum(axis=-1), 1.0, rtol=0, atol=1e-12)
    Tq, Tk = q.shape[-2], k.shape[-2]
    hidden = np.zeros((Tq, Tk), dtype=bool) if mask is None else ~mask
    if s["causal"]:
        hidden = hidden | ~np.tri(Tq, Tk, Tk - Tq, dtype=bool)
    assert np.all(att[np.broadcast_to(hidden, att.shape)] == 0.0)
    assert np.all(att[~np.broadcast_to(hidden, att.shape)] > 0.0)


@fast()
@given(s=sdpa_shapes)
def test_sdpa_causal_queries_are_the_tail_of_full_causal_attention(s):
    """causal=True with Tq < Tk (new queries against a KV cache) gives the last Tq rows of causal
    attention of all Tk positions, whose queries are the cached ones followed by the new."""
    _, k, v, _, rng = _sdpa_inputs(s)
    Tq, Tk = s["Tq"], k.shape[-2]
    q_all = rng.standard_normal((*k.shape[:-2], Tk, s["hs"]))  # (..., Tk, hs)
    full, _ = sdpa_forward(q_all, k, v, causal=True)  # (..., Tk, hv)
    tail, _ = sdpa_forward(q_all[..., Tk - Tq :, :], k, v, causal=True)  # (..., Tq, hv)
    np.testing.assert_allclose(tail, full[..., Tk - Tq :, :], rtol=1e-13, atol=1e-14)
    np.testing.assert_array_equal(causal_mask(Tq, Tk, k), np.tri(Tk, dtype=bool)[Tk - Tq :])


@fast()
@given(s=sdpa_shapes)
def test_sdpa_broadcasting_equals_repeating(s):
    """k, v with leading dims of 1 give what the explicitly repeated k, v give, and their
    gradients are the repeated gradients summed over the repeats."""
    q, k, v, mask, rng = _sdpa_inputs(s)
    lead = q.shape[:-2]
    k_rep = np.broadcast_to(k, (*lead, *k.shape[-2:])).copy()  # (*lead, Tk, hs)
    v_rep = np.broadcast_to(v, (*lead, *v.shape[-2:])).copy()  # (*lead, Tk, hv)
    out, cache = sdpa_forward(q, k, v, mask, causal=s["causal"])
    out_rep, cache_rep = sdpa_forward(q, k_rep, v_rep, mask, causal=s["causal"])
    np.testing.assert_allclose(out, out_rep, rtol=1e-13, atol=1e-14)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = sdpa_backward(dout, cache)
    dq_rep, dk_rep, dv_rep = sdpa_backward(dout, cache_rep)
    np.testing.assert_allclose(dq, dq_rep, rtol=1e-13, atol=1e-14)
    stretched = tuple(i for i, n in enumerate(k.shape[:-2]) if n != lead[i])
    for grad, repeated in ((dk, dk_rep), (dv, dv_rep)):
        np.testing.assert_allclose(grad, repeated.sum(axis=stretched, keepdims=True), rtol=1e-12,
                                   atol=1e-13)  # fmt: skip


@fast()
@given(s=sdpa_shapes, data=st.data())
def test_sdpa_refuses_a_query_that_sees_no_key(s, data):
    """Hiding every key from one query row raises a ValueError that names the row, never NaN."""
    q, k, v, _, rng = _sdpa_inputs(s)
    Tq, Tk = q.shape[-2], k.shape[-2]
    mask = random_attention_mask(rng, (Tq, Tk))
    row = data.draw(st.integers(0, Tq - 1))
    mask[row] = False
    with pytest.raises(ValueError, match=rf"^query row {row} can see no key"):
        sdpa_forward(q, k, v, mask, causal=s["causal"])


gqa_shapes = st.fixed_dictionaries({
    "B": st.integers(1, 2), "n_kv_head": st.integers(1, 3), "group": st.integers(1, 3),
    "Tq": st.integers(1, 4), "extra_keys": st.integers(0, 2), "hs": st.integers(1, 3),
    "hv": st.integers(1, 3), "causal": st.booleans(), "masked": st.booleans(),
    "seed": st.integers(0, 2**16),
})  # fmt: skip


def _gqa_inputs(s):
    """q (B, NH, Tq, hs) with NH = NKV * group; k (B, NKV, Tk, hs), v (B, NKV, Tk, hv) with
    Tk = Tq + extra_keys; a random mask (B or 1, NH or 1, Tq, Tk), or None; the rng."""
    rng = np.random.default_rng(s["seed"])
    B, NKV, Tq = s["B"], s["n_kv_head"], s["Tq"]
    NH, Tk = NKV * s["group"], Tq + s["extra_keys"]
    q, k = rng.standard_normal((B, NH, Tq, s["hs"])), rng.standard_normal((B, NKV, Tk, s["hs"]))
    v = rng.standard_normal((B, NKV, Tk, s["hv"]))
    mask_lead = tuple(1 if rng.random() < 0.5 else n for n in (B, NH))
    mask = random_attention_mask(rng, (*mask_lead, Tq, Tk)) if s["masked"] else None
    return q, k, v, mask, rng


@fast()
@given(s=gqa_shapes)
def test_gqa_backward_over_shapes(s):
    """Both oracles; the mask (or None) is the fourth positional input and gets no gradient."""
    q, k, v, mask, _ = _gqa_inputs(s)
    for oracle in ("autograd", "finite_differences"):
        result = check_layer(gqa_forward, gqa_backward, q, k, v, mask, causal=s["causal"], oracle=oracle)
        assert [entry.name for entry in result.entries] == ["q", "k", "v"]
        result.assert_ok(TOL)


@fast()
@given(s=gqa_shapes)
def test_gqa_equals_multihead_attention_on_repeated_heads(s):
    """Repeating each key/value head NH / NKV times in a row (HF's repeat_kv, torch's
    repeat_interleave) and running sdpa per head gives the same output; the gradient of a
    key/value head is the sum of its copies' gradients."""
    q, k, v, mask, rng = _gqa_inputs(s)
    G = s["group"]
    k_rep, v_rep = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)  # (B, NH, Tk, hs | hv)
    out, cache = gqa_forward(q, k, v, mask, causal=s["causal"])
    out_rep, cache_rep = sdpa_forward(q, k_rep, v_rep, mask, causal=s["causal"])
    np.testing.assert_allclose(out, out_rep, rtol=1e-13, atol=1e-14)
    dout = rng.standard_normal(out.shape)
    dq, dk, dv = gqa_backward(dout, cache)
    dq_rep, dk_rep, dv_rep = sdpa_backward(dout, cache_rep)
    np.testing.assert_allclose(dq, dq_rep, rtol=1e-13, atol=1e-14)
    for grad, repeated in ((dk, dk_rep), (dv, dv_rep)):
        B, NKV, Tk, width = grad.shape
        summed = repeated.reshape(B, NKV, G, Tk, width).sum(axis=2)  # (B, NKV, Tk, width)
        np.testing.assert_allclose(grad, summed, rtol=1e-12, atol=1e-13)


@fast()
@given(s=gqa_shapes, data=st.data(), backend_name=st.sampled_from(["numpy", "torch", "strict"]))
def test_gqa_query_head_reads_only_its_key_value_head(s, data, backend_name):
    """Changing key/value head n changes the outputs of query heads n * G .. n * G + G - 1 and
    leaves every other query head's output exactly as it was."""
    backend = get_backend(backend_name)
    q, k, v, mask, rng = _gqa_inputs(s)
    n, G = data.draw(st.integers(0, s["n_kv_head"] - 1)), s["group"]
    k2, v2 = k.copy(), v.copy()
    k2[:, n], v2[:, n] = rng.standard_normal(k[:, n].shape), rng.standard_normal(v[:, n].shape)
    extra = () if mask is None else (backend.asarray(mask),)
    out, _ = gqa_forward(*map(backend.asarray, (q, k, v)), *extra, causal=s["causal"])
    out2, _ = gqa_forward(*map(backend.asarray, (q, k2, v2)), *extra, causal=s["causal"])
    out, out2 = to_host(out), to_host(out2)
    group = np.arange(q.shape[1]) // G == n  # (NH,) the query heads of key/value head n
    np.testing.assert_array_equal(out2[:, ~group], out[:, ~group])
    assert not np.allclose(out2[:, group], out[:, group])


@fast()
@given(s=gqa_shapes, T=st.integers(1, 4), C=st.integers(1, 4))
def test_gqa_attention_backward_over_shapes(s, T, C):
    rng = np.random.default_rng(s["seed"])
    NKV, hs = s["n_kv_head"], s["hs"]
    NH = NKV * s["group"]
    args = (rng.standard_normal((s["B"], T, C)), 0.5 * rng.standard_normal((C, NH * hs)),
            0.5 * rng.standard_normal((C, NKV * hs)), rng.standard_normal((C, NKV * hs)),
            rng.standard_normal((NH * hs, C)))  # fmt: skip
    forward = functools.partial(gqa_attention_forward, n_head=NH, n_kv_head=NKV,
                                causal=s["causal"])  # fmt: skip
    check_layer(forward, gqa_attention_backward, *args, oracle="autograd").assert_ok(TOL)


model_configs = st.fixed_dictionaries({
    "n_layer": st.integers(1, 2), "n_head": st.integers(1, 3), "hs": st.integers(1, 3),
    "vocab_size": st.integers(1, 7), "B": st.integers(1, 3), "T": st.integers(1, 5),
    "extra_context": st.integers(0, 2), "ln_order": st.sampled_from(["pre", "post"]),
    "position": st.sampled_from(["learned", "sinusoidal"]), "gelu": st.sampled_from(["tanh", "none"]),
    "seed": st.integers(0, 2**16),
})  # fmt: skip


def _model(m):
    C = m["n_head"] * m["hs"]
    position = m["position"] if C % 2 == 0 else "learned"  # the sinusoidal encoding needs even C
    cfg = GPTConfig(n_layer=m["n_layer"], n_head=m["n_head"], n_embd=C, vocab_size=m["vocab_size"],
                    block_size=m["T"] + m["extra_context"], ln_order=m["ln_order"],
                    position=position, gelu=m["gelu"])  # fmt: skip
    rng = np.random.default_rng(m["seed"])
    # GPT-2's init has zero biases and unit gains; perturb everything so every term is exercised
    params = {name: value + 0.3 * rng.standard_normal(value.shape)
              for name, value in init_params(cfg, seed=m["seed"], dtype="float64").items()}  # fmt: skip
    idx = rng.integers(0, cfg.vocab_size, size=(m["B"], m["T"]))
    targets = rng.integers(0, cfg.vocab_size, size=(m["B"], m["T"]))
    return cfg, params, idx, targets


@fast(12)
@given(m=model_configs)
def test_whole_model_backward_matches_autograd(m):
    cfg, params, idx, targets = _model(m)
    result = check_model(params, idx, targets, cfg, oracle="autograd")
    assert result.names == list(params)
    result.assert_ok(TOL)


@fast(10)
@given(m=model_configs)
def test_whole_model_backward_matches_finite_differences_on_a_subset(m):
    # n_embd <= 2 makes LN_f's output (nearly) independent of its input (see the LayerNorm test
    # above): gradients below it are ~1e-5 and below what finite differences resolve.
    assume(m["n_head"] * m["hs"] >= 3)
    cfg, params, idx, targets = _model(m)
    check_model(params, idx, targets, cfg, oracle="finite_differences", max_elements=3).assert_ok(TOL)


# --------------------------------------------------------------------------------------------
# Invariants


@fast(20)
@given(x=hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                    elements=st.floats(-1e3, 1e3)),
       backend_name=st.sampled_from(["numpy", "torch", "strict"]))  # fmt: skip
def test_softmax_rows_sum_to_one(x, backend_name):
    backend = get_backend(backend_name)
    for axis in range(-x.ndim, 0):
        p, _ = softmax_forward(backend.asarray(x), axis=axis)
        p = to_host(p)
        assert np.all(p >= 0.0) and np.all(p <= 1.0)
        np.testing.assert_allclose(p.sum(axis=axis), 1.0, rtol=0, atol=1e-12)


@fast()
@given(s=sizes, t=st.integers(0, 4), backend_name=backends)
def test_causal_attention_does_not_look_ahead(s, t, backend_name):
    """Changing the tokens after position t leaves the outputs at positions <= t as they were."""
    backend, rng = get_backend(backend_name), np.random.default_rng(s["seed"])
    T = s["T"]
    t = min(t, T - 1)
    C = s["n_head"] * s["hs"]
    x, *weights = _attention_inputs(rng, s["B"], T, C)
    x2 = x.copy()
    x2[:, t + 1 :] = rng.standard_normal(x2[:, t + 1 :].shape)
    y, _ = attention_forward(backend.asarray(x), *map(backend.asarray, weights), n_head=s["n_head"])
    y2, _ = attention_forward(backend.asarray(x2), *map(backend.asarray, weights), n_head=s["n_head"])
    y, y2 = to_host(y), to_host(y2)
    np.testing.assert_allclose(y2[:, : t + 1], y[:, : t + 1], rtol=0, atol=1e-14)
    if t + 1 < T:  # the later positions do see the change
        assert not np.allclose(y2[:, t + 1 :], y[:, t + 1 :])
    # the column convention of the post: column t of Z depends on columns <= t of X only
    X, X2 = np.swapaxes(x, -1, -2), np.swapaxes(x2, -1, -2)  # (B, C, T)
    A = rng.standard_normal((s["hs"], C))
    Bm, Cm = rng.standard_normal((s["hs"], C)), rng.standard_normal((s["hs"], C))
    Z, _ = attention_single_forward(backend.asarray(X), *map(backend.asarray, (A, Bm, Cm)), causal=True)
    Z2, _ = attention_single_forward(backend.asarray(X2), *map(backend.asarray, (A, Bm, Cm)), causal=True)
    np.testing.assert_allclose(to_host(Z2)[..., : t + 1], to_host(Z)[..., : t + 1], rtol=0, atol=1e-14)


@fast(10)
@given(m=model_configs, t=st.integers(0, 4))
def test_gpt_logits_do_not_look_ahead(m, t):
    cfg, params, idx, _ = _model(m)
    t = min(t, idx.shape[1] - 1)
    idx2 = idx.copy()
    idx2[:, t + 1 :] = (idx2[:, t + 1 :] + 1) % cfg.vocab_size
    logits, _, _ = gpt_forward(params, idx, cfg)
    logits2, _, _ = gpt_forward(params, idx2, cfg)
    np.testing.assert_allclose(logits2[:, : t + 1], logits[:, : t + 1], rtol=0, atol=1e-13)


@fast()
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), C=st.integers(2, 9),
       scale=st.sampled_from([1e-1, 1.0, 1e3]), offset=st.sampled_from([0.0, 5.0, -1e3]),
       seed=st.integers(0, 2**16), backend_name=st.sampled_from(["numpy", "torch", "strict"]))  # fmt: skip
def test_layernorm_output_is_standardized(lead, C, scale, offset, seed, backend_name):
    """With w = 1 and b = 0 every row has mean 0 and variance var / (var + eps), i.e. ~1."""
    backend, rng = get_backend(backend_name), np.random.default_rng(seed)
    eps = 1e-5
    x = offset + scale * rng.standard_normal((*lead, C))
    y, _ = layernorm_forward(backend.asarray(x), backend.asarray(np.ones(C)),
                             backend.asarray(np.zeros(C)), eps=eps)  # fmt: skip
    y = to_host(y)
    var_in = x.var(axis=-1)
    np.testing.assert_allclose(y.mean(axis=-1), 0.0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(y.var(axis=-1), var_in / (var_in + eps), rtol=1e-9)
    assert np.all(np.abs(y.var(axis=-1) - 1.0) <= eps / var_in + 1e-9)


def test_layernorm_of_a_single_channel_is_zero():
    """C = 1 is the degenerate case: x - mean = 0, so y = b and every input gradient is 0."""
    x, w, b = np.array([[3.0], [-2.0]]), np.array([2.0]), np.array([0.5])
    y, cache = layernorm_forward(x, w, b)
    np.testing.assert_array_equal(y, [[0.5], [0.5]])
    dx, dw, db = layernorm_backward(np.ones((2, 1)), cache)
    np.testing.assert_array_equal(dx, 0.0)
    np.testing.assert_array_equal(db, [2.0])


@pytest.mark.parametrize("T", [1, 2])
def test_single_position_attention_is_the_value(T):
    """With one visible key the softmax weight is exactly 1: position 0 outputs its own value."""
    rng = np.random.default_rng(T)
    x, w_attn, b_attn, w_proj, b_proj = _attention_inputs(rng, 2, T, 4)
    y, _ = attention_forward(x, w_attn, b_attn, np.eye(4), np.zeros(4), n_head=2)
    v = (x @ w_attn + b_attn)[..., 8:]  # (B, T, C)
    np.testing.assert_allclose(y[:, 0], v[:, 0], rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------------------------
# Issue 14: RMSNorm, SiLU, SwiGLU, RoPE


@fast()
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), C=st.integers(2, 8),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), seed=st.integers(0, 2**16))  # fmt: skip
def test_rmsnorm_backward_over_shapes(lead, C, scale, seed):
    """C >= 2: for C = 1 the output w * x / sqrt(x**2 + eps) is +-w up to eps / x**2 whatever x
    is, and its gradient, rstd * (1 - xhat**2) * dxhat, is a difference of nearly equal numbers
    that no method resolves to 1e-7 (as LayerNorm's C <= 2 above)."""
    rng = np.random.default_rng(seed)
    x, w = scale * rng.standard_normal((*lead, C)), 1.0 + rng.standard_normal(C)
    for oracle in ("autograd", "finite_differences"):
        check_layer(rmsnorm_forward, rmsnorm_backward, x, w, oracle=oracle).assert_ok(TOL)


@fast()
@given(lead=st.lists(st.integers(1, 3), min_size=1, max_size=2), C=st.integers(1, 9),
       scale=st.sampled_from([1e-1, 1.0, 1e3]), factor=st.floats(1e-2, 1e2),
       seed=st.integers(0, 2**16),
       backend_name=st.sampled_from(["numpy", "torch", "strict"]))  # fmt: skip
def test_rmsnorm_output_has_unit_rms_whatever_the_scale(lead, C, scale, factor, seed, backend_name):
    """With w = 1 every row has mean square ms / (ms + eps), i.e. ~1; with eps = 0 a row scaled
    by any factor > 0 gives the same output (no mean is removed, so a shift would not)."""
    backend, rng = get_backend(backend_name), np.random.default_rng(seed)
    eps = 1e-6
    x, w = scale * rng.standard_normal((*lead, C)), rng.standard_normal(C)
    y, _ = rmsnorm_forward(backend.asarray(x), backend.asarray(np.ones(C)), eps=eps)
    ms = (x * x).mean(axis=-1)
    np.testing.assert_allclose((to_host(y) ** 2).mean(axis=-1), ms / (ms + eps), rtol=1e-12)
    y, _ = rmsnorm_forward(backend.asarray(x), backend.asarray(w), eps=0.0)
    y_scaled, _ = rmsnorm_forward(backend.asarray(factor * x), backend.asarray(w), eps=0.0)
    np.testing.assert_allclose(to_host(y_scaled), to_host(y), rtol=1e-12, atol=1e-14)


@fast(20)
@given(x=hnp.arrays(np.float64, hnp.array_shapes(min_dims=1, max_dims=3, max_side=5),
                    elements=st.floats(-1e3, 1e3)),
       backend_name=st.sampled_from(["numpy", "torch", "strict"]))  # fmt: skip
def test_silu_odd_part_is_x_and_it_stays_above_its_minimum(x, backend_name):
    """sigmoid(x) + sigmoid(-x) = 1 gives silu(x) - silu(-x) = x; silu(x) <= max(x, 0), and its
    minimum is -0.27846... (at x = -1.27846...)."""
    backend = get_backend(backend_name)
    y, _ = silu_forward(backend.asarray(x))
    y_neg, _ = silu_forward(backend.asarray(-x))
    y, y_neg = to_host(y), to_host(y_neg)
    np.testing.assert_allclose(y - y_neg, x, rtol=1e-12, atol=1e-12)
    assert np.all(y <= np.maximum(x, 0.0)) and np.all(y >= -0.2784645427610739)


@fast()
@given(lead=st.lists(st.integers(1, 3), min_size=0, max_size=2), C=st.integers(1, 4),
       H=st.integers(1, 5), C_out=st.integers(1, 4), seed=st.integers(0, 2**16))  # fmt: skip
def test_swiglu_backward_over_shapes(lead, C, H, C_out, seed):
    rng = np.random.default_rng(seed)
    args = (rng.standard_normal((*lead, C)), rng.standard_normal((C, H)),
            rng.standard_normal((C, H)), rng.standard_normal((H, C_out)))  # fmt: skip
    for oracle in ("autograd", "finite_differences"):
        check_layer(swiglu_forward, swiglu_backward, *args, oracle=oracle).assert_ok(TOL)


rope_shapes = st.fixed_dictionaries({
    "lead": st.lists(st.integers(1, 3), min_size=0, max_size=2), "T": st.integers(1, 5),
    "pairs": st.integers(1, 4), "start": st.integers(0, 50),
    "base": st.sampled_from([10.0, 10000.0]), "pairing": st.sampled_from(ROPE_PAIRINGS),
    "seed": st.integers(0, 2**16),
})  # fmt: skip


def _rope_input(s):
    """x (*lead, T, hs) with hs = 2 * pairs, the rng, and the hyperparameters."""
    rng = np.random.default_rng(s["seed"])
    x = rng.standard_normal((*s["lead"], s["T"], 2 * s["pairs"]))
    return x, rng, {"base": s["base"], "start": s["start"], "pairing": s["pairing"]}


@fast()
@given(s=rope_shapes)
def test_rope_backward_over_shapes(s):
    x, _, hyper = _rope_input(s)
    for oracle in ("autograd", "finite_differences"):
        check_layer(rope_forward, rope_backward, x, oracle=oracle, **hyper).assert_ok(TOL)


@fast()
@given(s=rope_shapes, backend_name=st.sampled_from(["numpy", "torch", "strict"]))
def test_rope_turns_each_pair_and_the_backward_turns_it_back(s, backend_name):
    """Each pair of the chosen pairing keeps its length x1**2 + x2**2 (a rotation within the
    pair), and the backward, R(t)^T, applied to y gives x back."""
    backend = get_backend(backend_name)
    x, _, hyper = _rope_input(s)
    y, cache = rope_forward(backend.asarray(x), **hyper)
    (x_back,) = rope_backward(y, cache)
    y, half = to_host(y), s["pairs"]
    split = ((lambda a: (a[..., :half], a[..., half:])) if s["pairing"] == "rotate_half"
             else (lambda a: (a[..., 0::2], a[..., 1::2])))  # fmt: skip
    (x1, x2), (y1, y2) = split(x), split(y)
    np.testing.assert_allclose(y1**2 + y2**2, x1**2 + x2**2, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(to_host(x_back), x, rtol=1e-12, atol=1e-13)


@fast()
@given(s=rope_shapes, shift=st.integers(0, 100), tail=st.integers(0, 4))
def test_rope_sees_relative_positions_only(s, shift, tail):
    """Any q and k: shifting every position by the same amount leaves q_rot @ k_rot^T as it was;
    and rotating the last rows alone, with start = their first position (new tokens after a KV
    cache), gives the last rows of rotating everything."""
    q, rng, hyper = _rope_input(s)
    k = rng.standard_normal(q.shape)

    def scores(start):
        q_rot, _ = rope_forward(q, **dict(hyper, start=start))
        k_rot, _ = rope_forward(k, **dict(hyper, start=start))
        return q_rot @ np.swapaxes(k_rot, -1, -2)  # (..., T, T)

    np.testing.assert_allclose(scores(s["start"] + shift), scores(s["start"]), rtol=1e-10,
                               atol=1e-10)  # fmt: skip
    first = min(tail, s["T"] - 1)
    y, _ = rope_forward(q, **hyper)
    y_tail, _ = rope_forward(q[..., first:, :], **dict(hyper, start=s["start"] + first))
    np.testing.assert_allclose(y_tail, y[..., first:, :], rtol=1e-13, atol=1e-13)
# Mixture of experts: random shapes, k <= E, with and without capacity drops

moe_shapes = st.integers(1, 4).flatmap(lambda E: st.fixed_dictionaries({
    "B": st.integers(1, 2), "T": st.integers(1, 5), "C": st.integers(1, 4), "H": st.integers(1, 5),
    "E": st.just(E), "k": st.integers(1, E), "renormalize": st.booleans(),
    "capacity_factor": st.sampled_from([None, 0.25, 0.5, 1.0, 2.0]),
    "aux_weight": st.sampled_from([0.0, 0.3]), "seed": st.integers(0, 2**16),
}))  # fmt: skip


def _moe_settings(s) -> dict:
    return {key: s[key] for key in ("k", "renormalize", "capacity_factor", "aux_weight")}


def _moe_run(s, backend_name="numpy", **overrides):
    """(inputs, (y, aux), cache, dout, grads) of one MoE forward and backward, from ``s``."""
    backend, rng = get_backend(backend_name), np.random.default_rng(s["seed"])
    B, T, C, H, E = s["B"], s["T"], s["C"], s["H"], s["E"]
    shapes = ((B, T, C), (C, E), (E, C, H), (E, H), (E, H, C), (E, C))
    inputs = [backend.asarray(rng.standard_normal(shape)) for shape in shapes]
    (y, aux), cache = moe_forward(*inputs, **{**_moe_settings(s), **overrides})
    dout = (backend.randn(rng, B, T, C), float(rng.standard_normal()))
    return inputs, (y, aux), cache, dout, moe_backward(dout, cache)


@fast()
@given(s=moe_shapes, backend_name=backends)
def test_moe_backward_over_shapes_matches_autograd(s, backend_name):
    """Autograd differentiates the same forward at the same point (the same choice of experts,
    the same drops), so no margin between router logits is needed."""
    inputs, _, _, (dy, daux), grads = _moe_run(s, backend_name)
    leaves = [torch.tensor(to_host(a), requires_grad=True) for a in inputs]
    (y, aux), _ = moe_forward(*leaves, **_moe_settings(s))
    loss = torch.sum(y * torch.tensor(to_host(dy))) + aux * daux
    expected = torch.autograd.grad(loss, leaves, allow_unused=True)
    for name, grad, want in zip(("dx", "dw_router", "dw_fc", "db_fc", "dw_proj", "db_proj"),
                                grads, expected):  # fmt: skip
        want = np.zeros(tuple(grad.shape)) if want is None else want.numpy()
        np.testing.assert_allclose(to_host(grad), want, rtol=1e-10, atol=1e-12, err_msg=name)


@fast()
@given(s=moe_shapes)
def test_moe_gates_are_the_chosen_probabilities(s):
    """Renormalized: each token's gates sum to 1 (the chosen probabilities rescaled); raw: they
    ARE the chosen probabilities, summing to at most 1. Either way, best first."""
    _, _, cache, _, _ = _moe_run(s)
    stats = cache["stats"]
    chosen = np.take_along_axis(stats["probs"], stats["experts"], axis=-1)  # (B, T, k)
    if s["renormalize"]:
        np.testing.assert_allclose(stats["gates"].sum(axis=-1), 1.0, rtol=1e-14)
        np.testing.assert_allclose(stats["gates"], chosen / chosen.sum(-1, keepdims=True), rtol=1e-14)
    else:
        np.testing.assert_array_equal(stats["gates"], chosen)
        assert np.all(stats["gates"].sum(axis=-1) <= 1.0 + 1e-15)
    assert np.all(np.diff(stats["gates"], axis=-1) <= 0.0)


@fast()
@given(s=moe_shapes)
def test_moe_dropped_tokens_get_zero_output_and_zero_gradient_from_the_expert(s):
    """An expert's weights learn only from the tokens it took: changing dy at every other token
    leaves its gradients bit for bit the same. A token dropped by all its k experts gets y = 0,
    and (aux_weight 0) dx = 0: with the block's residual it passes through unchanged."""
    inputs, (y, _), cache, (dy, _), grads = _moe_run({**s, "capacity_factor": 0.25},
                                                     aux_weight=0.0)  # fmt: skip
    stats = cache["stats"]
    assume(stats["dropped"] > 0)
    dropped_all = ~np.any(stats["kept"], axis=-1)  # (B, T)
    assert np.all(y[dropped_all] == 0.0) and np.all(grads[0][dropped_all] == 0.0)
    rng = np.random.default_rng(s["seed"] + 1)
    for e in range(s["E"]):
        took = np.any((stats["experts"] == e) & stats["kept"], axis=-1)  # (B, T)
        other_dy = np.where(took[..., None], dy, rng.standard_normal(dy.shape))
        other = moe_backward((other_dy, 0.0), cache)
        for grad, grad_other in zip(grads[2:], other[2:]):  # dw_fc, db_fc, dw_proj, db_proj
            np.testing.assert_array_equal(grad[e], grad_other[e])


@fast()
@given(s=moe_shapes, data=st.data())
def test_moe_without_drops_does_not_depend_on_token_order(s, data):
    """With no capacity limit the tokens do not compete: shuffling them shuffles y and dx alike
    and leaves aux and the weight gradients as they were. (With a limit, token order decides
    who is dropped.)"""
    s = {**s, "capacity_factor": data.draw(st.sampled_from([None, float(s["E"])]))}
    inputs, (y, aux), cache, (dy, daux), grads = _moe_run(s)
    assert cache["stats"]["dropped"] == 0
    N, C = s["B"] * s["T"], s["C"]
    perm = np.random.default_rng(s["seed"]).permutation(N)
    x_perm = inputs[0].reshape(N, C)[perm][None]  # (1, N, C)
    (y_perm, aux_perm), cache_perm = moe_forward(x_perm, *inputs[1:], **_moe_settings(s))
    grads_perm = moe_backward((dy.reshape(N, C)[perm][None], daux), cache_perm)
    np.testing.assert_allclose(y_perm[0], y.reshape(N, C)[perm], rtol=1e-13, atol=1e-14)
    assert float(aux_perm) == pytest.approx(float(aux), rel=1e-13, abs=1e-16)
    np.testing.assert_allclose(grads_perm[0][0], grads[0].reshape(N, C)[perm], rtol=1e-12,
                               atol=1e-13)  # fmt: skip
    for grad, grad_perm in zip(grads[1:], grads_perm[1:]):
        np.testing.assert_allclose(grad_perm, grad, rtol=1e-11, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Issue 15: the logistic loss (sigmoid + binary cross-entropy)


@fast()
@given(shape=hnp.array_shapes(min_dims=1, max_dims=3, max_side=4),
       scale=st.sampled_from([1.0, 5.0]), seed=st.integers(0, 2**16), backend_name=backends)
def test_logistic_over_shapes_matches_finite_differences_and_its_symmetries(shape, scale, seed,
                                                                           backend_name):
    """Any shape: the backward matches finite differences; the loss is positive, log 2 at z = 0,
    and unchanged when both the logits and the labels flip. (Saturated logits, where every
    gradient is below round-off, are tested against torch in test_layers.py.)"""
    backend = get_backend(backend_name)
    rng = np.random.default_rng(seed)
    z, y = scale * rng.standard_normal(shape), rng.integers(0, 2, size=shape)
    result = check_layer(logistic_forward, logistic_backward, backend.asarray(z),
                         backend.asarray(y))
    result.assert_ok(TOL)
    loss = float(logistic_forward(backend.asarray(z), backend.asarray(y))[0])
    flipped = float(logistic_forward(backend.asarray(-z), backend.asarray(1 - y))[0])
    at_zero = float(logistic_forward(backend.asarray(0.0 * z), backend.asarray(y))[0])
    assert loss > 0 and np.isfinite(loss)
    assert flipped == pytest.approx(loss, rel=1e-12)
    assert at_zero == pytest.approx(np.log(2.0), rel=1e-12)
