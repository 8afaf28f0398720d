"""Attention, the block, RoPE and the sinusoidal encoding with the inputs other courses hand
them: any leading dims (..., T, C) (against looping over the leading dims), a mask that keeps
packed documents apart, and per-token positions; each with its gradient check."""

import functools
import itertools

import numpy as np
import pytest
from conftest import get_backend

from gptlab.backend import to_numpy
from gptlab.gradcheck import check_layer
from gptlab.layers.attention import attention_backward, attention_forward
from gptlab.layers.block import block_backward, block_forward, block_param_shapes
from gptlab.layers.position_sinusoidal import (
    position_sinusoidal_backward,
    position_sinusoidal_forward,
)
from gptlab.layers.rope import rope_backward, rope_forward
from gptlab.model import positions_in_documents, same_document_mask

ORACLES = ("finite_differences", "autograd")
C, NH = 8, 2
BLOCKS = {  # block_forward's keywords
    "gpt2": dict(n_head=NH),
    "llama-gqa-rope": dict(n_head=NH, n_kv_head=1, norm="rmsnorm", mlp="swiglu", rope_base=100.0),
    "llama-adjacent-post": dict(n_head=NH, n_kv_head=2, norm="rmsnorm", mlp="swiglu",
                                rope_base=100.0, rope_pairing="adjacent", ln_order="post"),
}


def block_params(opts, seed=0):
    rng = np.random.default_rng(seed)
    shapes = block_param_shapes(C, n_head=NH, n_kv_head=opts.get("n_kv_head"),
                                norm=opts.get("norm", "layernorm"), mlp=opts.get("mlp", "gelu"),
                                hidden=12, bias=opts.get("n_kv_head") is None)  # fmt: skip
    return {name: rng.normal(0.0, 0.4, shape) for name, shape in shapes.items()}


def attention_params(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(0.0, 0.4, shape) for shape in ((C, 3 * C), (3 * C,), (C, C), (C,))]


def looped(forward, x, *rest, **hyperparams):
    """forward on each (T, C) slice of x (..., T, C) as a batch of one, stacked back."""
    out = np.empty_like(x)
    for index in itertools.product(*map(range, x.shape[:-2])):
        out[index] = forward(x[index][None], *rest, **hyperparams)[0][0]
    return out


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)])
def test_attention_any_leading_dims_equals_looping(lead):
    x = np.random.default_rng(1).normal(size=(*lead, 5, C))
    y, _ = attention_forward(x, *attention_params(), n_head=NH)
    assert y.shape == x.shape
    np.testing.assert_allclose(y, looped(attention_forward, x, *attention_params(), n_head=NH),
                               rtol=0, atol=1e-13)  # fmt: skip


@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_block_any_leading_dims_equals_looping(lead, name):
    x = np.random.default_rng(2).normal(size=(*lead, 5, C))
    p = block_params(BLOCKS[name])
    y, _ = block_forward(x, p, **BLOCKS[name])
    assert y.shape == x.shape
    np.testing.assert_allclose(y, looped(block_forward, x, p, **BLOCKS[name]), rtol=0, atol=1e-13)


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("shape", [(5, C), (2, 3, 4, C)])
def test_attention_leading_dims_gradcheck(shape, oracle):
    x = np.random.default_rng(3).normal(size=shape)
    check_layer(attention_forward, attention_backward, x, *attention_params(), oracle=oracle,
                n_head=NH).assert_ok()  # fmt: skip


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("name", BLOCKS)
@pytest.mark.parametrize("shape", [(5, C), (2, 3, 4, C)])
def test_block_leading_dims_gradcheck(shape, name, oracle):
    x = np.random.default_rng(4).normal(size=shape)
    check_layer(block_forward, block_backward, x, block_params(BLOCKS[name]), oracle=oracle,
                **BLOCKS[name]).assert_ok()  # fmt: skip


DOCUMENTS = np.array([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 1, 1], [0, 1, 2, 3, 3, 3]])  # (3, 6)
MASK = same_document_mask(DOCUMENTS)  # (3, 6, 6)
POSITIONS = positions_in_documents(MASK)  # (3, 6), restarting with each document


def masked_block(x, p, mask, positions=None, **opts):
    """block_forward with the mask and positions as inputs, so that check_layer hands them to
    each oracle on its own backend (they get no gradient)."""
    return block_forward(x, p, mask=mask, positions=positions, **opts)


def masked_attention(x, w_attn, b_attn, w_proj, b_proj, mask, **opts):
    return attention_forward(x, w_attn, b_attn, w_proj, b_proj, mask=mask, **opts)


def rope_at(x, positions, **opts):
    return rope_forward(x, positions=positions, **opts)


def test_attention_mask_keeps_documents_apart():
    """With the documents' mask each document's outputs are those of the document alone."""
    x = np.random.default_rng(5).normal(size=(3, 6, C))
    y, _ = attention_forward(x, *attention_params(), n_head=NH, mask=MASK)
    for b, row in enumerate(DOCUMENTS):
        for doc in np.unique(row):
            alone, _ = attention_forward(x[b : b + 1, row == doc], *attention_params(), n_head=NH)
            np.testing.assert_allclose(y[b, row == doc], alone[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("name", BLOCKS)
def test_block_mask_and_positions_keep_documents_apart(name):
    opts = BLOCKS[name]
    x = np.random.default_rng(6).normal(size=(3, 6, C))
    p = block_params(opts)
    rope = {"positions": POSITIONS} if "rope_base" in opts else {}
    y, _ = block_forward(x, p, **opts, mask=MASK, **rope)
    for b, row in enumerate(DOCUMENTS):
        for doc in np.unique(row):
            alone, _ = block_forward(x[b : b + 1, row == doc], p, **opts)
            np.testing.assert_allclose(y[b, row == doc], alone[0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("name", BLOCKS)
def test_block_with_mask_and_positions_gradcheck(name, oracle):
    opts = BLOCKS[name]
    x = np.random.default_rng(7).normal(size=(3, 6, C))
    positions = (POSITIONS,) if "rope_base" in opts else ()
    check_layer(masked_block, block_backward, x, block_params(opts), MASK,
                *positions, oracle=oracle, **opts).assert_ok()  # fmt: skip


@pytest.mark.parametrize("oracle", ORACLES)
def test_attention_with_mask_gradcheck(oracle):
    x = np.random.default_rng(8).normal(size=(3, 6, C))
    check_layer(masked_attention, attention_backward, x, *attention_params(),
                MASK, oracle=oracle, n_head=NH).assert_ok()  # fmt: skip


def test_rope_positions_equal_rows_at_those_positions():
    """Row t at position s turns as row s of an unshifted sequence does; a start offset is the
    same as positions start .. start + T - 1; per-row positions broadcast over the heads."""
    x = np.random.default_rng(9).normal(size=(2, 3, 5, 6))  # (B, NH, T, hs)
    for pairing in ("rotate_half", "adjacent"):
        shifted, _ = rope_forward(x, start=4, pairing=pairing)
        at, _ = rope_forward(x, positions=np.arange(4, 9), pairing=pairing)
        np.testing.assert_allclose(at, shifted, rtol=0, atol=1e-13)
        positions = np.array([[0, 1, 0, 1, 2], [3, 0, 1, 2, 0]])[:, None, :]  # (B, 1, T)
        y, _ = rope_forward(x, positions=positions, pairing=pairing)
        for b, t in itertools.product(range(2), range(5)):
            s = positions[b, 0, t]
            one, _ = rope_forward(x[b, :, t : t + 1], start=int(s), pairing=pairing)
            np.testing.assert_allclose(y[b, :, t], one[:, 0], rtol=0, atol=1e-13)


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("pairing", ("rotate_half", "adjacent"))
def test_rope_positions_gradcheck(pairing, oracle):
    x = np.random.default_rng(10).normal(size=(2, 3, 5, 6))
    positions = np.array([[0, 1, 0, 1, 2], [3, 0, 1, 2, 0]])[:, None, :]  # (B, 1, T)
    check_layer(rope_at, rope_backward, x, positions, oracle=oracle, pairing=pairing).assert_ok()


@pytest.mark.parametrize("bad, error, message", [
    (dict(positions=np.zeros((5,))), TypeError, "positions"),
    (dict(positions=np.zeros((4,), dtype=np.int64)), ValueError, "does not broadcast"),
    (dict(positions=np.zeros((2, 3, 3, 5), dtype=np.int64)), ValueError, "does not broadcast"),
    (dict(positions=np.zeros((5,), dtype=np.int64), start=2), ValueError, "not both"),
])  # fmt: skip
def test_rope_positions_are_checked(bad, error, message):
    with pytest.raises(error, match=message):
        rope_forward(np.zeros((2, 3, 5, 6)), **bad)


def test_sinusoidal_positions():
    x = np.random.default_rng(11).normal(size=(2, 5, C))
    positions = np.array([[0, 1, 2, 0, 1], [4, 5, 6, 7, 8]])
    y, cache = position_sinusoidal_forward(x, positions=positions)
    plain, _ = position_sinusoidal_forward(np.zeros((1, 9, C)))  # e(0..8)
    np.testing.assert_allclose(y - x, plain[0][positions], rtol=0, atol=1e-14)
    forward = functools.partial(position_sinusoidal_forward, positions=positions)
    check_layer(forward, position_sinusoidal_backward, x).assert_ok()
    with pytest.raises(ValueError, match="does not broadcast"):
        position_sinusoidal_forward(x, positions=positions[:, :4])


@pytest.mark.parametrize("bad, error, message", [
    (dict(mask=np.ones((6, 6))), TypeError, "boolean"),
    (dict(mask=np.ones((3, 5, 5), dtype=bool)), ValueError, "mask has shape"),
    (dict(mask=np.ones((2, 6, 6), dtype=bool)), ValueError, "mask has shape"),
])  # fmt: skip
def test_attention_mask_is_checked(bad, error, message):
    with pytest.raises(error, match=message):
        attention_forward(np.zeros((3, 6, C)), *attention_params(), n_head=NH, **bad)


def test_block_refuses_positions_without_rope():
    with pytest.raises(ValueError, match="rope_base"):
        block_forward(np.zeros((1, 6, C)), block_params(BLOCKS["gpt2"]), n_head=NH,
                      positions=np.arange(6))  # fmt: skip


@pytest.mark.parametrize("name", BLOCKS)
def test_block_with_documents_on_every_backend(backend, name):
    """The block with a mask, positions and leading dims, forward and backward, on NumPy, torch
    and array_api_strict on a second device: the same numbers."""
    opts = BLOCKS[name]
    rope = "rope_base" in opts
    x = np.random.default_rng(12).normal(size=(1, 3, 6, C))  # (1, B, T, C)
    dy = np.random.default_rng(13).normal(size=x.shape)

    def run(convert):
        extra = {"positions": convert(POSITIONS[None])} if rope else {}
        y, cache = block_forward(convert(x), convert(block_params(opts)), **opts,
                                 mask=convert(MASK[None]), **extra)  # fmt: skip
        dx, dp = block_backward(convert(dy), cache)
        return [to_numpy(y), to_numpy(dx), *(to_numpy(g) for g in dp.values())]

    for got, want in zip(run(backend.convert), run(get_backend("numpy").convert)):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
