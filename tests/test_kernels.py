"""The Triton kernels (gptlab/kernels/) against their readable twins in gptlab/layers/.

Without CUDA the kernels run under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set
by tests/conftest.py before any kernel is defined); with CUDA they run compiled on the GPU. The
interpreter runs every program in NumPy: the shapes and tiles are tiny, and chosen to hit the
edges (T not a multiple of the tile, tiles across the causal diagonal, one query, head size 1,
vocabularies not a multiple of the tile).

Oracles: the layer functions in float64 on the same (rounded) inputs; finite differences through
the float64 layer for the gradients. Tolerances are the derived bounds of BOUNDS (tests/bounds.py),
on the largest error relative to the largest reference value: in float32 the longest sum of these
cases (70 keys of a row) in a forward and a backward (TF32 tensor cores are off unless torch allows
them); in float16 and bfloat16, whose kernels accumulate in float32, one rounding of each of a few
operations' outputs to the dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bounds import assert_relative, assert_within, bfloat16_pass, model_roundoff, roundoff

pytestmark = pytest.mark.roundoff  # every kernel against its float64 twin

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = DEVICE == "cpu"  # tests/conftest.py has set TRITON_INTERPRET=1 then
triton = pytest.importorskip("triton", reason="Triton does not import on this machine")

from gptlab.kernels import adamw, bias_gelu, classifier, flash_attention, layernorm  # noqa: E402
from gptlab import GPTConfig, init_params  # noqa: E402
from gptlab.fast import FastStep, fast_loss_and_grads, resolve_kernels  # noqa: E402
from gptlab.layers import chunked_classifier as ref_classifier  # noqa: E402
from gptlab.layers import flash_attention as ref_flash  # noqa: E402
from gptlab.layers import gelu as ref_gelu  # noqa: E402
from gptlab.layers import layernorm as ref_layernorm  # noqa: E402
from gptlab.model import loss_and_grads  # noqa: E402
from gptlab.training.optim import adamw_update  # noqa: E402
from gptlab.training.config import TrainConfig  # noqa: E402

BOUNDS = {
    torch.float32: roundoff("float32", 70, steps=2, why="70 keys (or fewer terms), forward and "
                            "backward"),
    torch.float16: roundoff("float16", 1, steps=5, why="a few outputs rounded to float16, float32 "
                            "accumulation"),
    torch.bfloat16: roundoff("bfloat16", 1, steps=5, why="a few outputs rounded to bfloat16, "
                             "float32 accumulation"),
}


def randn(seed, *shape):
    """float64 N(0, 1) numbers on the CPU, from a seeded generator."""
    return torch.tensor(np.random.default_rng(seed).standard_normal(shape))


def to(x, dtype):
    """x in ``dtype`` on the kernels' device, and the same (rounded) numbers in float64 on the
    CPU for the oracle."""
    low = x.to(dtype)
    return low.to(DEVICE), low.double()


def assert_close(got, want, dtype, name):
    """The largest error below BOUNDS[dtype] times the largest reference value."""
    assert got.dtype == dtype, name
    assert_relative(got, want, BOUNDS[dtype], f"kernel vs layer, {str(dtype)[6:]}", name)


def assert_directional(grads, direction, numeric):
    """<grads, direction> (float32 gradients, summed in float64) against the float64 finite
    difference ``numeric``, to BOUNDS[float32] of the sum of the products' sizes."""
    products = [g.double().cpu() * d for g, d in zip(grads, direction)]
    analytic = sum(float(p.sum()) for p in products)
    size = sum(float(p.abs().sum()) for p in products)
    assert_within(analytic, numeric, BOUNDS[torch.float32].times(size, "sum |g d|"),
                  "kernel gradients vs finite differences")


def directional_fd(forward, inputs, dout, direction, eps=1e-6):
    """d/dt <dout, forward(inputs + t direction)> at t = 0 by central differences (float64)."""
    plus = forward(*(x + eps * d for x, d in zip(inputs, direction)))
    minus = forward(*(x - eps * d for x, d in zip(inputs, direction)))
    return float(((plus - minus) * dout).sum()) / (2 * eps)


# --- flash attention ------------------------------------------------------------------------------

# The backward's two kinds of programs on tiles of unequal sides, as on a GPU (BACKWARD_BLOCKS):
# a dk/dv program's key tile spans two query tiles, a dq program's query tile two key tiles.
SMALL_BACKWARD = dict(dkdv_blocks=(16, 32), dq_blocks=(32, 16))
FLASH_CASES = [  # (B*NH, Tq, Tk, hs, hv, causal): forward tiles of 16
    (2, 33, 33, 8, 8, True),  # 3 tiles, the last one short; tiles across the diagonal
    (2, 33, 33, 8, 8, False),
    (1, 1, 5, 4, 4, True),  # one query (a decode step: it sees all 5 keys)
    (2, 17, 17, 1, 1, True),  # head size 1 (a tile of 16 columns, 15 masked)
    (2, 5, 21, 8, 6, True),  # fewer queries than keys (a KV cache's shape), hv != hs
    # tiles wholly below the diagonal, run unmasked, between masked ones (and an edge tile)
    (1, 70, 70, 8, 8, True),
    (1, 40, 70, 8, 8, True),  # and 30 keys before the first query
]


def flash(dtype, case, seed=0):
    """The kernel's and the float64 layer's out, dq, dk, dv on one case."""
    BH, Tq, Tk, hs, hv, causal = case
    (q, q64), (k, k64), (v, v64), (dout, dout64) = (
        to(randn(seed + i, *shape), dtype) for i, shape in
        enumerate(((BH, Tq, hs), (BH, Tk, hs), (BH, Tk, hv), (BH, Tq, hv))))  # fmt: skip
    out, cache = flash_attention.flash_attention_forward(q, k, v, causal=causal, block_q=16,
                                                         block_k=16)  # fmt: skip
    want, want_cache = ref_flash.flash_attention_forward(q64, k64, v64, causal=causal)
    grads = flash_attention.flash_attention_backward(dout, cache, **SMALL_BACKWARD)
    want_grads = ref_flash.flash_attention_backward(dout64, want_cache)
    return (out, *grads), (want, *want_grads)


@pytest.mark.parametrize("case", FLASH_CASES)
def test_flash_attention_float32_matches_the_layer(case):
    got, want = flash(torch.float32, case)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert_close(g, w, torch.float32, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_flash_attention_half_precision_matches_the_layer(dtype):
    """The kernels round P and dS to the dtype before their products with V, K and Q: one
    rounding in each term of a sum over the case's 33 keys (or queries)."""
    got, want = flash(dtype, FLASH_CASES[0])
    bound = roundoff(str(dtype)[6:], 33, why="P and dS rounded in each of 33 terms")
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert g.dtype == dtype, name
        assert_relative(g, w, bound, f"flash kernel vs layer, {str(dtype)[6:]}", name)


@pytest.mark.parametrize("n_kv_head,token_major", [(1, False), (2, False), (2, True)])
def test_flash_attention_shares_key_value_heads(n_kv_head, token_major):
    """GQA: 4 query heads on n_kv_head key/value heads (query head h reads h // (4 / n_kv_head));
    the layer on k, v repeated per query head, its dk, dv summed over the heads that share one.
    token_major: q, k, v, dout are views of (B, T, heads, hs) arrays, read in place."""
    group = 4 // n_kv_head
    q, dout = randn(0, 2, 4, 19, 8), randn(1, 2, 4, 19, 8)
    k, v = randn(2, 2, n_kv_head, 19, 8), randn(3, 2, n_kv_head, 19, 8)
    q32, k32, v32, dout32 = (x.float().to(DEVICE) for x in (q, k, v, dout))
    if token_major:  # the same numbers, each (B, heads, T, hs) a view of a (B, T, heads, hs)
        q32, k32, v32, dout32 = (x.transpose(1, 2).contiguous().transpose(1, 2)
                                 for x in (q32, k32, v32, dout32))  # fmt: skip
        assert not q32.is_contiguous()
    out, cache = flash_attention.flash_attention_forward(q32, k32, v32, causal=True, block_q=16,
                                                         block_k=16)  # fmt: skip
    grads = flash_attention.flash_attention_backward(dout32, cache, **SMALL_BACKWARD)
    repeated = [x.repeat_interleave(group, dim=1) for x in (k, v)]  # (2, 4, 19, 8)
    want, want_cache = ref_flash.flash_attention_forward(q, *repeated, causal=True)
    dq, dk, dv = ref_flash.flash_attention_backward(dout, want_cache)
    shared = [d.view(2, n_kv_head, group, 19, 8).sum(2) for d in (dk, dv)]  # (2, NKV, 19, 8)
    for name, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (want, dq, *shared)):
        assert g.shape == w.shape, name
        assert_close(g, w, torch.float32, name)


def test_flash_attention_gradients_match_finite_differences():
    """<dq, d1> + <dk, d2> + <dv, d3> against central differences through the float64 layer."""
    BH, T, hs = 1, 19, 4
    inputs = [randn(i, BH, T, hs) for i in range(3)]
    direction = [randn(10 + i, BH, T, hs) for i in range(3)]
    dout = randn(20, BH, T, hs)
    q, k, v = (x.float().to(DEVICE) for x in inputs)
    _, cache = flash_attention.flash_attention_forward(q, k, v, causal=True, block_q=16,
                                                       block_k=16)  # fmt: skip
    grads = flash_attention.flash_attention_backward(dout.float().to(DEVICE), cache,
                                                     **SMALL_BACKWARD)  # fmt: skip
    numeric = directional_fd(
        lambda *x: ref_flash.flash_attention_forward(*x, causal=True)[0], inputs, dout, direction)
    assert_directional(grads, direction, numeric)


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # NumPy's, on the NaN rows 32-47
def test_causal_tiles_above_the_diagonal_are_never_read():
    """NaN keys and values at positions 32-47, tiles of 16: queries 0-31 never load a tile that
    holds them, so their outputs and dq stay finite."""
    q, k, v, dout = (randn(i, 1, 48, 8).float() for i in range(4))
    k[:, 32:], v[:, 32:] = torch.nan, torch.nan
    out, cache = flash_attention.flash_attention_forward(
        *(x.to(DEVICE) for x in (q, k, v)), causal=True, block_q=16, block_k=16)
    dq, _, _ = flash_attention.flash_attention_backward(dout.to(DEVICE), cache,
                                                        dkdv_blocks=(16, 16), dq_blocks=(16, 16))
    assert torch.isfinite(out[:, :32]).all() and torch.isfinite(dq[:, :32]).all()
    assert torch.isnan(out[:, 32:]).all()



def test_flash_attention_reads_and_writes_views_in_place():
    """q, k, v split from one (B, T, 3, NH, hs) buffer, out a view of (B, T, NH, hs), dout a
    view of (B, T, NH, hs), dq, dk, dv views of one (B, T, 3, NH, hs) buffer (the fused step's
    layouts, no copies): bit for bit the results on contiguous copies; the inputs untouched,
    every output element written; a k with its columns apart (transposed twice) is copied."""
    B, T, NH, hs = 2, 33, 3, 8
    qkv = to(randn(0, B, T, 3, NH, hs), torch.float32)[0]
    dout_rows = to(randn(1, B, T, NH, hs), torch.float32)[0]
    before = qkv.clone()
    q, k, v = qkv.permute(2, 0, 3, 1, 4)  # (B, NH, T, hs) views
    out_rows = torch.full((B, T, NH, hs), torch.nan, device=DEVICE)
    dqkv = torch.full((B, T, 3, NH, hs), torch.nan, device=DEVICE)
    out, cache = flash_attention.flash_attention_forward(q, k, v, causal=True, block_q=16,
                                                         block_k=16, out=out_rows.transpose(1, 2))
    grads = flash_attention.flash_attention_backward(dout_rows.transpose(1, 2), cache,
                                                     grads=tuple(dqkv.permute(2, 0, 3, 1, 4)),
                                                     **SMALL_BACKWARD)  # fmt: skip
    k_apart = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # unit stride along T, not hs
    want, want_cache = flash_attention.flash_attention_forward(
        q.contiguous(), k_apart, v.contiguous(), causal=True, block_q=16, block_k=16)
    want_grads = flash_attention.flash_attention_backward(dout_rows.transpose(1, 2).contiguous(),
                                                          want_cache, **SMALL_BACKWARD)
    assert torch.equal(qkv, before)
    assert out.data_ptr() == out_rows.data_ptr() and torch.equal(out, want)
    assert all(g.data_ptr() == d.data_ptr() and torch.equal(g, w)
               for g, d, w in zip(grads, dqkv.permute(2, 0, 3, 1, 4), want_grads))  # fmt: skip
    assert torch.isfinite(out_rows).all() and torch.isfinite(dqkv).all()

def test_flash_attention_refuses_what_it_does_not_cover():
    q = torch.zeros(2, 3, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match="leading dims"):
        flash_attention.flash_attention_forward(q, q[:1], q[:1])  # a broadcast batch
    with pytest.raises(ValueError, match="divide"):
        flash_attention.flash_attention_forward(q, q[:, :2], q[:, :2])  # 2 heads do not divide 3
    with pytest.raises(TypeError, match="float32, bfloat16 or float16"):
        flash_attention.flash_attention_forward(q.double(), q.double(), q.double())
    for bad in (0, 24, 8, 16.0):  # not a power of two, below tl.dot's 16, not an integer
        with pytest.raises(ValueError, match="block_q must be a power of two of at least 16"):
            flash_attention.flash_attention_forward(q, q, q, block_q=bad)
    _, cache = flash_attention.flash_attention_forward(q, q, q, block_q=16, block_k=16)
    with pytest.raises(ValueError, match="dq_blocks must be a power of two"):
        flash_attention.flash_attention_backward(q, cache, dq_blocks=(16, 48))
    with pytest.raises(ValueError, match=r"out must be a torch.float32 tensor of shape \(2, 3, 4"):
        flash_attention.flash_attention_forward(q, q, q, out=q[..., :4])
    with pytest.raises(ValueError, match="out must be viewable as"):
        flash_attention.flash_attention_forward(q, q, q, out=q.transpose(-1, -2).contiguous().mT)
    far = torch.empty_strided((1, 1, 2, 8), (0, 0, 2**31, 1), device="meta")  # rows 2^31 apart
    assert flash_attention._as_heads(far).is_contiguous()  # read: copied
    with pytest.raises(ValueError, match="a head's rows within 2"):  # written: refused
        flash_attention._written_heads("out", far, far.shape, far)
    with pytest.raises(ValueError, match="grads must be three tensors"):
        flash_attention.flash_attention_backward(q, cache, grads=(q, q))
    with pytest.raises(ValueError, match="dk must be a torch.float32 tensor"):
        flash_attention.flash_attention_backward(q, cache, grads=(q, q.half(), q))
    with pytest.raises(ValueError, match="dout must have out's shape"):
        flash_attention.flash_attention_backward(q[:1], cache)


# --- LayerNorm ------------------------------------------------------------------------------------


def layernorm_case(dtype, bias, N=21, C=13):
    """The kernel's and the float64 layer's y, dx, dw, db; 21 rows in groups of 4 (the last
    group short), C = 13 columns in a tile of 16."""
    (x, x64), (w, w64), (dy, dy64) = (to(randn(i, *s) * 2 + 1, dtype) for i, s in
                                      enumerate(((N, C), (C,), (N, C))))  # fmt: skip
    b, b64 = to(randn(5, C), dtype) if bias else (None, None)
    y, cache = layernorm.layernorm_forward(x, w, b, rows_per_program=4)
    want, want_cache = ref_layernorm.layernorm_forward(x64, w64, b64)
    return (y, *layernorm.layernorm_backward(dy, cache)), (
        want, *ref_layernorm.layernorm_backward(dy64, want_cache))


@pytest.mark.parametrize("dtype,bias", [(torch.float32, True), (torch.float32, False),
                                        (torch.bfloat16, True)])  # fmt: skip
def test_layernorm_matches_the_layer(dtype, bias):
    got, want = layernorm_case(dtype, bias)
    for name, g, w in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        if w is None:
            assert g is None, name
        else:
            assert_close(g, w, dtype, name)


def test_layernorm_gradients_match_finite_differences():
    inputs = [randn(0, 6, 5), randn(1, 5), randn(2, 5)]
    direction = [randn(10 + i, *x.shape) for i, x in enumerate(inputs)]
    dy = randn(20, 6, 5)
    _, cache = layernorm.layernorm_forward(*(x.float().to(DEVICE) for x in inputs),
                                           rows_per_program=4)  # fmt: skip
    grads = layernorm.layernorm_backward(dy.float().to(DEVICE), cache)
    numeric = directional_fd(lambda *x: ref_layernorm.layernorm_forward(*x)[0], inputs, dy,
                             direction)  # fmt: skip
    assert_directional(grads, direction, numeric)


def test_layernorm_backward_adds_in_a_fixed_order():
    """Two stages, no atomics: the same inputs give bitwise the same dw and db."""
    x, w, b, dy = (randn(i, *shape).float() for i, shape in
                   enumerate(((37, 13), (13,), (13,), (37, 13))))  # fmt: skip
    runs = []
    for _ in range(2):
        _, cache = layernorm.layernorm_forward(*(t.to(DEVICE) for t in (x, w, b)),
                                               rows_per_program=4)  # fmt: skip
        runs.append(layernorm.layernorm_backward(dy.to(DEVICE), cache))
    for first, second in zip(*runs):
        assert torch.equal(first, second)


# --- bias + GELU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,approximate,bias", [
    (torch.float32, "tanh", True), (torch.float32, "none", True), (torch.float32, "tanh", False),
    (torch.bfloat16, "none", True)])  # fmt: skip
def test_bias_gelu_matches_the_layer(dtype, approximate, bias):
    """gelu(h + b) on 21 x 19 numbers in tiles of 16 x 16 (both edges short)."""
    (h, h64), (dy, dy64) = to(randn(0, 3, 7, 19) * 2, dtype), to(randn(1, 3, 7, 19), dtype)
    b, b64 = to(randn(2, 19), dtype) if bias else (None, None)
    y, cache = bias_gelu.bias_gelu_forward(h, b, approximate=approximate, block_n=16, block_h=16)
    dh, db = bias_gelu.bias_gelu_backward(dy, cache)
    want, want_cache = ref_gelu.gelu_forward(h64 if b64 is None else h64 + b64,
                                             approximate=approximate)  # fmt: skip
    (want_dh,) = ref_gelu.gelu_backward(dy64, want_cache)
    assert_close(y, want, dtype, "y")
    assert_close(dh, want_dh, dtype, "dh")
    if bias:
        assert_close(db, want_dh.sum((0, 1)), dtype, "db")  # h + b: db = sum of dh over rows
    else:
        assert db is None


# --- the fused classifier -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_classifier_matches_the_chunked_layer(dtype):
    """V = 37 in vocabulary tiles of 16 (the last one short), N = 15 rows in chunks of 4."""
    (x, x64), (wte, wte64) = to(randn(0, 3, 5, 8), dtype), to(randn(1, 37, 8), dtype)
    targets = torch.tensor(np.random.default_rng(2).integers(0, 37, (3, 5)))
    loss, cache = classifier.classifier_forward(x, wte, targets.to(DEVICE), chunk_size=4,
                                                block_v=16)  # fmt: skip
    want, want_cache = ref_classifier.chunked_classifier_forward(x64, wte64, targets)
    assert loss.dtype == torch.float32  # the loss is accumulated and returned in float32
    assert_relative(loss, want, BOUNDS[dtype], f"kernel vs layer, {str(dtype)[6:]}", "loss")
    got_grads = classifier.classifier_backward(2.0, cache)
    for name, g, w in zip(("dx", "dwte"), got_grads,
                          ref_classifier.chunked_classifier_backward(2.0, want_cache)):
        assert_close(g, w, dtype, name)


def test_bias_gelu_classifier_and_adamw_refuse_tiles_that_are_not_powers_of_two():
    h, wte = randn(0, 4, 8).float().to(DEVICE), randn(1, 37, 8).float().to(DEVICE)
    for tile in ("block_n", "block_h"):
        with pytest.raises(ValueError, match=f"{tile} must be a power of two"):
            bias_gelu.bias_gelu_forward(h, **{tile: 48})
    with pytest.raises(ValueError, match="block must be a power of two"):
        theta = torch.zeros(8, device=DEVICE)
        adamw.adamw_update(theta, theta, theta.clone(), theta.clone(), step=1, lr=0.1,
                           betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, block=100)
    with pytest.raises(ValueError, match="block_v must be a power of two"):
        classifier.classifier_forward(randn(2, 4, 8).float().to(DEVICE), wte,
                                      torch.zeros(4, dtype=torch.int64, device=DEVICE), block_v=12)


# --- AdamW ----------------------------------------------------------------------------------------


def test_adamw_matches_the_update_equations_and_writes_the_bf16_copy():
    """Two steps on 100 numbers in blocks of 32, with decay, against optim.adamw_update in
    float64; the bfloat16 copy is the new master weight to bfloat16's precision."""
    theta, g1, g2 = randn(0, 100), randn(1, 100), randn(2, 100)
    m, v = torch.zeros(100, dtype=torch.float64), torch.zeros(100, dtype=torch.float64)
    hyper = dict(lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    state = [t.float().to(DEVICE) for t in (theta, m, v)]
    copy = torch.empty(100, dtype=torch.bfloat16, device=DEVICE)
    want = (theta, m, v)
    for step, g in ((1, g1), (2, g2)):
        got = adamw.adamw_update(*state[:1], g.to(torch.bfloat16).to(DEVICE), *state[1:],
                                 step=step, compute=copy, block=32, **hyper)  # fmt: skip
        want = adamw_update(want[0], g.to(torch.bfloat16).double(), *want[1:], step=step,
                            **hyper)  # fmt: skip
    for name, a, w in zip(("theta", "m", "v"), got, want, strict=True):
        assert_close(a, w, torch.float32, name)
    assert got[0] is state[0]  # in place
    assert_close(copy, want[0], torch.bfloat16, "copy")
    largest = float(want[0].abs().max())
    assert float((copy.double() - got[0].double()).abs().max()) <= 2**-7 * largest


def test_adamw_refuses_bad_state():
    theta = torch.zeros(4, device=DEVICE)
    hyper = dict(step=1, lr=0.1, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    with pytest.raises(TypeError, match="m must be float32"):
        adamw.adamw_update(theta, theta, theta.bfloat16(), theta, **hyper)
    with pytest.raises(ValueError, match="theta's shape"):
        adamw.adamw_update(theta, theta[:2], theta, theta, **hyper)
    with pytest.raises(ValueError, match="step"):
        adamw.adamw_update(theta, theta, theta, theta, **{**hyper, "step": 0})


# --- the fused step with kernels="triton" ---------------------------------------------------------

TINY = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)


@pytest.mark.parametrize("bias,gelu", [(True, "tanh"), (False, "erf")])
def test_fused_step_with_triton_kernels_matches_the_readable_path(bias, gelu):
    """float32 loss and every gradient against the readable path in float64, to model_roundoff of
    their size; bfloat16 compute (float32 master weights): the loss, and every gradient in norm,
    to bfloat16's one rounding per operation of the pass."""
    cfg = GPTConfig(**TINY, bias=bias, gelu=gelu)
    rng = np.random.default_rng(1)
    params = {name: torch.tensor(value + rng.normal(0.0, 0.2, value.shape))
              for name, value in init_params(cfg, 0, dtype="float64").items()}  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    idx, targets = (torch.randint(0, cfg.vocab_size, (3, 7), generator=generator) for _ in "ab")
    loss, grads = loss_and_grads(params, idx, targets, cfg)
    master = {name: p.float().to(DEVICE) for name, p in params.items()}
    idx, targets = idx.to(DEVICE), targets.to(DEVICE)
    got_loss, got = fast_loss_and_grads(master, idx, targets, cfg, kernels="triton")
    bound = model_roundoff(cfg, 3, 7)
    assert_relative(got_loss, loss, bound, "triton step vs float64, float32 loss")
    for name, g in grads.items():
        assert_relative(got[name], g, bound, "triton step vs float64, float32 gradients", name)
    half_loss, half = FastStep(cfg, "bfloat16", kernels="triton")(master, idx, targets)
    assert_relative(half_loss, loss, bfloat16_pass(cfg.n_layer, backward=False),
                    "triton step vs float64, bfloat16 loss")
    grad_bound = bfloat16_pass(cfg.n_layer, backward=True)
    for name, g in grads.items():
        assert_within(float((half[name].double().cpu() - g).norm()), 0.0,
                      grad_bound.times(float(g.norm()), "|g|"),
                      "triton step vs float64, bfloat16 gradient norms", name)


def test_asking_for_triton_where_it_cannot_run_names_the_option(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="--kernels torch"):
        resolve_kernels("triton", "cpu")  # CPU tensors need the interpreter
    assert resolve_kernels("auto", "cpu") == "torch"
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve_kernels("cuda", "cpu")
    with pytest.raises(ValueError, match="kernels='triton'"):
        TrainConfig(kernels="triton", device="cpu")
    with pytest.raises(ValueError, match="fused path: add fused=True"):
        TrainConfig(kernels="triton", fused=False)
    with pytest.raises(ValueError, match="fused path, and it runs in one process"):
        TrainConfig(kernels="triton", parallel="ddp", nproc=2)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # where the kernels run, but not in float64:
    with pytest.raises(ValueError, match="not torch.float64"):
        TrainConfig(kernels="triton", dtype="float64", device="cpu")
    assert resolve_kernels("auto", "cuda", torch.float64) == "torch"  # the default falls back
