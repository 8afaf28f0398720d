"""Flash attention (gptlab/layers/flash_attention.py) against the plain attention it replaces.

The table of tests/test_layers.py checks its gradients (finite differences, autograd, float32,
backend parity). Here: the same numbers as sdpa (forward and dq, dk, dv) for T that the tiles do
not divide, T = 1, causal and not; the same as torch's scaled_dot_product_attention in float32
at a longer T; block sizes that change nothing; causal tiles above the diagonal never read; and
the cache's size, counted in bytes: O(T) per row against sdpa's O(T^2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bounds import assert_relative, roundoff

from conftest import get_backend, to_host
from gptlab import autograd as ag
from gptlab.layers.flash_attention import flash_attention_backward, flash_attention_forward
from gptlab.layers.sdpa import sdpa_backward, sdpa_forward

B, NH, HS, HV = 2, 3, 4, 5


def _qkv_dout(rng, Tq, Tk, lead=(B, NH)):
    return (rng.standard_normal((*lead, Tq, HS)), rng.standard_normal((*lead, Tk, HS)),
            rng.standard_normal((*lead, Tk, HV)), rng.standard_normal((*lead, Tq, HV)))  # fmt: skip


def _run(forward, backward, backend, q, k, v, dout, **hyper):
    out, cache = forward(*map(backend.asarray, (q, k, v)), **hyper)
    return to_host(out), to_host(backward(backend.asarray(dout), cache))


@pytest.mark.parametrize("T, block_q, block_k", [(1, 4, 4), (7, 3, 2), (10, 4, 3), (13, 5, 5),
                                                 (9, 16, 16), (11, 1, 1)])  # fmt: skip
@pytest.mark.parametrize("causal", [False, True])
def test_flash_equals_sdpa(backend, T, block_q, block_k, causal):
    """out, dq, dk and dv equal sdpa's to round-off, T not a multiple of the tiles."""
    q, k, v, dout = _qkv_dout(np.random.default_rng(T), T, T)
    tiles = {"block_q": block_q, "block_k": block_k}
    out, grads = _run(flash_attention_forward, flash_attention_backward, backend, q, k, v, dout,
                      causal=causal, **tiles)  # fmt: skip
    want_out, want_grads = _run(sdpa_forward, sdpa_backward, backend, q, k, v, dout, causal=causal)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13, err_msg="out")
    for name, got, want in zip(("dq", "dk", "dv"), grads, want_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13, err_msg=name)


@pytest.mark.parametrize("Tq, Tk, lead_kv, causal", [
    (3, 8, (B, 1), False), (3, 8, (B, 1), True), (8, 3, (B, NH), False), (5, 11, (1, NH), False),
    (5, 11, (1, NH), True)])  # fmt: skip
def test_flash_equals_sdpa_for_kv_cache_shapes_and_broadcast_heads(Tq, Tk, lead_kv, causal):
    """Tq != Tk (causal: the queries are the last Tq positions) and k, v shared across heads."""
    rng = np.random.default_rng(Tq * Tk)
    q, _, _, dout = _qkv_dout(rng, Tq, Tk)
    k, v = rng.standard_normal((*lead_kv, Tk, HS)), rng.standard_normal((*lead_kv, Tk, HV))
    backend = get_backend("numpy")
    out, grads = _run(flash_attention_forward, flash_attention_backward, backend, q, k, v, dout,
                      causal=causal, scale=0.3, block_q=2, block_k=3)  # fmt: skip
    want_out, want_grads = _run(sdpa_forward, sdpa_backward, backend, q, k, v, dout,
                                causal=causal, scale=0.3)  # fmt: skip
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)
    for got, want in zip(grads, want_grads, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-13)


@pytest.mark.roundoff
@pytest.mark.parametrize("causal", [False, True])
def test_flash_float32_matches_torch_sdpa_autograd(causal):
    """float32 on torch at T = 200 (tiles 64 x 48), against F.scaled_dot_product_attention and
    its autograd in float64."""
    rng = np.random.default_rng(1)
    q, k, v, dout = _qkv_dout(rng, 200, 200, lead=(1, 2))
    backend = get_backend("torch", "float32")
    out, grads = _run(flash_attention_forward, flash_attention_backward, backend, q, k, v, dout,
                      causal=causal, block_q=64, block_k=48)  # fmt: skip
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    want = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
    want.backward(torch.tensor(dout))
    bound = roundoff("float32", 200, steps=2, why="200 keys a row, forward and backward")
    assert_relative(out, want, bound, "flash float32 vs sdpa float64", "out")
    for name, got, leaf in zip(("dq", "dk", "dv"), grads, leaves, strict=True):
        assert got.dtype == np.float32
        assert_relative(got, leaf.grad, bound, "flash float32 vs sdpa float64", name)


def test_block_sizes_change_the_order_of_additions_only(rng):
    q, k, v, dout = _qkv_dout(rng, 12, 12)
    backend = get_backend("numpy")
    results = [_run(flash_attention_forward, flash_attention_backward, backend, q, k, v, dout,
                    causal=True, block_q=bq, block_k=bk)
               for bq, bk in ((1, 12), (12, 1), (5, 7), (128, 128))]  # fmt: skip
    for out, grads in results[1:]:
        np.testing.assert_allclose(out, results[0][0], rtol=1e-13, atol=1e-14)
        for got, want in zip(grads, results[0][1]):
            np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_causal_tiles_above_the_diagonal_are_never_read(backend, rng):
    """NaN in the keys and values of positions 4 and 5, tiles of 2: queries 0-3 never meet a
    tile that holds them, so their outputs and dq stay finite (dk and dv of every key take NaN
    from queries 4 and 5, rightly). sdpa multiplies the NaN values by a weight 0
    (0 * NaN = NaN): its rows 0-3 are NaN, so this sees the skipping."""
    q, k, v, dout = _qkv_dout(rng, 6, 6)
    k[..., 4:, :], v[..., 4:, :] = np.nan, np.nan
    out, (dq, _, _) = _run(flash_attention_forward, flash_attention_backward, backend, q, k, v,
                             dout, causal=True, block_q=2, block_k=2)  # fmt: skip
    assert np.isfinite(out[..., :4, :]).all() and np.isfinite(dq[..., :4, :]).all()
    assert np.isnan(out[..., 4:, :]).all()
    sdpa_out, _ = sdpa_forward(*map(backend.asarray, (q, k, v)), causal=True)
    assert np.isnan(to_host(sdpa_out)[..., :4, :]).all()


def _new_bytes(cache, inputs) -> int:
    """Bytes of the arrays in a cache that are not the inputs themselves (tuples searched)."""
    if isinstance(cache, (tuple, list)):
        return sum(_new_bytes(item, inputs) for item in cache)
    if isinstance(cache, np.ndarray) and not any(cache is a for a in inputs):
        return cache.nbytes
    return 0


@pytest.mark.parametrize("T", [16, 64, 256])
def test_the_cache_holds_O_T_floats_per_row(T, rng):
    """Beside the inputs, flash attention keeps out (hv floats per row) and the log-sum-exp (1 per
    row): exactly (hv + 1) floats per query row, whatever T. sdpa keeps att, T floats per row."""
    q, k, v, _ = _qkv_dout(rng, T, T)
    itemsize, rows = q.itemsize, B * NH * T
    _, flash_cache = flash_attention_forward(q, k, v, causal=True, block_q=8, block_k=8)
    _, sdpa_cache = sdpa_forward(q, k, v, causal=True)
    flash_bytes, sdpa_bytes = _new_bytes(flash_cache, (q, k, v)), _new_bytes(sdpa_cache, (q, k, v))
    assert flash_bytes == rows * (HV + 1) * itemsize
    assert sdpa_bytes >= rows * T * itemsize  # att (and softmax's cache, which is att itself)
    assert sdpa_bytes / flash_bytes >= T / (HV + 1)


def test_autograd_wrapper_matches_torch_sdpa():
    """gptlab.autograd.flash_attention: our backward behind torch's .backward()."""
    rng = np.random.default_rng(2)
    q, k, v, dout = (torch.tensor(a, requires_grad=True) for a in _qkv_dout(rng, 9, 9))
    ours = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ag.flash_attention(*ours, causal=True, block_q=4, block_k=3).backward(dout.detach())
    torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
    for mine, theirs in zip(ours, (q, k, v)):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-12, atol=1e-12)
