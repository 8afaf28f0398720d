"""The gradient checker: it accepts correct backward passes and rejects planted wrong ones."""

import math
import xml.etree.ElementTree as ET

import matplotlib
import numpy as np
import pytest

import gptlab.gradcheck as gradcheck
from gptlab import GPTConfig, init_params
from gptlab.backend import convert
from gptlab.course.errata import draft_attention_single_backward, dropped_transpose_linear_backward
from gptlab.gradcheck import below, check_layer, check_model
from gptlab.layers.attention_single import (
    attention_single_backward,
    attention_single_backward_compact,
    attention_single_forward,
)
from gptlab.layers.block import BLOCK_PARAM_NAMES, block_backward, block_forward
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.gelu import gelu_backward, gelu_forward
from gptlab.layers.layernorm import layernorm_backward, layernorm_forward
from gptlab.layers.linear import linear_backward, linear_forward
from gptlab.layers.sdpa import sdpa_backward, sdpa_forward
from gptlab.layers.softmax import softmax_backward
from gptlab.model import gpt_backward, param_shapes

BACKENDS = ("numpy", "torch")
ORACLES = ("finite_differences", "autograd")
TOL = 1e-7
WRONG = 1e-2  # a wrong formula gives a relative error of order 1

ATTENTION_SHAPES = [(2, 4, 3), (3, 4), (3, 4), (3, 4)]  # X (B, d, T), A, B, C (h, d)
CASES = {
    "linear": (linear_forward, linear_backward, [(2, 3, 4), (4, 5), (5,)], {}),
    "layernorm": (layernorm_forward, layernorm_backward, [(2, 3, 5), (5,), (5,)], {}),
    "attention_single": (attention_single_forward, attention_single_backward, ATTENTION_SHAPES, {}),
    "attention_single_causal": (
        attention_single_forward, attention_single_backward, ATTENTION_SHAPES, {"causal": True}
    ),
    "attention_single_compact": (
        attention_single_forward, attention_single_backward_compact, ATTENTION_SHAPES,
        {"causal": True},
    ),
}  # fmt: skip


def randn(backend, *shape, seed=0):
    return convert(np.random.default_rng(seed).standard_normal(shape), backend)


def inputs(shapes, backend="numpy"):
    return [randn(backend, *shape, seed=i) for i, shape in enumerate(shapes)]


def rel(a, b):
    return np.linalg.norm(a - b) / max(np.linalg.norm(a) + np.linalg.norm(b), 1e-300)


# --- correct layers pass -------------------------------------------------------------------------


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_accepts_correct_layers(case, backend, oracle):
    forward, backward, shapes, hyper = CASES[case]
    result = check_layer(forward, backward, *inputs(shapes, backend), oracle=oracle, **hyper)
    result.assert_ok()
    assert result.worst < TOL
    assert len(result.names) == len(shapes)


@pytest.mark.parametrize("case", CASES)
def test_autograd_agrees_with_finite_differences(case):
    forward, backward, shapes, hyper = CASES[case]
    args = inputs(shapes)
    fd = check_layer(forward, backward, *args, oracle="finite_differences", **hyper)
    ag = check_layer(forward, backward, *args, oracle="autograd", **hyper)
    assert fd.names == ag.names
    for a, b in zip(fd.entries, ag.entries):
        assert rel(a.numeric, b.numeric) < TOL, a.name


def test_names_come_from_the_forward_signature():
    forward, backward, shapes, hyper = CASES["attention_single"]
    assert check_layer(forward, backward, *inputs(shapes)).names == ["X", "A", "B", "C"]


@pytest.mark.parametrize("oracle", ORACLES)
def test_strict_backend_on_a_second_device(oracle):
    xp = pytest.importorskip("array_api_strict")
    device = xp.Device("device1")
    x, w, b = (xp.asarray(a, device=device) for a in inputs([(2, 3, 4), (4, 5), (5,)]))
    x = xp.astype(x, xp.float32)  # checked in float64 all the same
    check_layer(linear_forward, linear_backward, x, w, b, oracle=oracle).assert_ok()


@pytest.mark.parametrize("oracle", ORACLES)
def test_integer_inputs_pass_through_and_scalar_outputs(oracle):
    logits = randn("numpy", 2, 3, 7)
    targets = np.random.default_rng(1).integers(0, 7, size=(2, 3))
    result = check_layer(cross_entropy_forward, cross_entropy_backward, logits, targets,
                         oracle=oracle)
    assert result.names == ["logits"]
    result.assert_ok()


@pytest.mark.parametrize("oracle", ORACLES)
def test_dict_inputs(oracle):
    shapes = param_shapes(GPTConfig(n_layer=1, n_head=2, n_embd=4, vocab_size=5, block_size=3))
    p = {name: randn("torch", *shapes[f"h.0.{name}"], seed=i)
         for i, name in enumerate(BLOCK_PARAM_NAMES)}
    x = randn("torch", 2, 3, 4)
    result = check_layer(block_forward, block_backward, x, p, oracle=oracle, max_elements=4,
                         n_head=2)
    assert result.names == ["x"] + [f"p[{name}]" for name in BLOCK_PARAM_NAMES]
    result.assert_ok()


# --- planted wrong formulas fail -----------------------------------------------------------------


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("causal", [False, True])
def test_rejects_the_drafts_attention_backward(causal, oracle):
    args = inputs(ATTENTION_SHAPES)
    draft = check_layer(attention_single_forward, draft_attention_single_backward, *args,
                        oracle=oracle, causal=causal)
    assert draft.rel_error("A") > WRONG  # the missing transpose
    assert draft.rel_error("X") > WRONG  # the merged terms
    assert draft.rel_error("B") < TOL and draft.rel_error("C") < TOL  # right in the draft too
    assert not draft.passed()
    with pytest.raises(AssertionError, match=r"\['X', 'A'\]"):
        draft.assert_ok()


def test_rejects_a_dropped_transpose():
    args = inputs([(2, 3, 4), (4, 4), (4,)])  # square w: the slip keeps every shape valid
    result = check_layer(linear_forward, dropped_transpose_linear_backward, *args)
    assert result.rel_error("x") > WRONG
    assert result.rel_error("w") < TOL and result.rel_error("b") < TOL


def attention_single_backward_without_scale(E, cache):
    """Forgets the 1/sqrt(h) of scores = Q^T K / sqrt(h). X (d, T), no batch."""
    X, A, B, C, Q, K, V, att, softmax_cache = cache
    (dscores,) = softmax_backward(V.mT @ E, softmax_cache)  # (T, T)
    dQ, dK, dV = K @ dscores.mT, Q @ dscores, E @ att.mT  # (h, T) each, WRONG dQ and dK
    return A.mT @ dQ + B.mT @ dK + C.mT @ dV, dQ @ X.mT, dK @ X.mT, dV @ X.mT


def test_rejects_a_forgotten_scale():
    X, A, B, C = inputs([(4, 3), (4, 4), (4, 4), (4, 4)])  # h = 4: the grads come out 2x too big
    result = check_layer(attention_single_forward, attention_single_backward_without_scale,
                         X, A, B, C)
    assert math.isclose(result.rel_error("A"), 1 / 3, rel_tol=1e-6)  # |2n - n| / |2n + n|
    assert math.isclose(result.rel_error("B"), 1 / 3, rel_tol=1e-6)
    assert result.rel_error("X") > WRONG
    assert result.rel_error("C") < TOL


def layernorm_backward_without_mean_term(dy, cache):
    """Forgets that the mean depends on x: drops the - mean(dxhat) term."""
    xhat, w, rstd, _ = cache  # the last entry says whether there is a bias
    dx, dw, db = layernorm_backward(dy, cache)
    dxhat = dy * w  # (..., C)
    dx = rstd * (dxhat - xhat * np.mean(dxhat * xhat, axis=-1, keepdims=True))  # WRONG
    return dx, dw, db


def test_rejects_layernorm_without_the_mean_term():
    result = check_layer(layernorm_forward, layernorm_backward_without_mean_term,
                         *inputs([(2, 3, 5), (5,), (5,)]))
    assert result.rel_error("x") > WRONG
    assert result.rel_error("w") < TOL and result.rel_error("b") < TOL


def test_error_map_locates_the_error():
    def backward_one_wrong_element(dy, cache):
        dx, dw, db = linear_backward(dy, cache)
        dw = dw.copy()
        dw[1, 2] += 1.0
        return dx, dw, db

    result = check_layer(linear_forward, backward_one_wrong_element,
                         *inputs([(2, 3, 4), (4, 5), (5,)]))
    err = result.error_map("w")
    assert err.shape == (4, 5) and not np.isnan(err).any()
    assert np.unravel_index(np.argmax(err), err.shape) == (1, 2)
    assert err[1, 2] > WRONG
    assert np.delete(err.ravel(), 1 * 5 + 2).max() < 1e-6
    assert result.max_abs_error("w") == pytest.approx(1.0, rel=1e-6)
    assert result.rel_error("x") < TOL


def test_max_elements_checks_a_seeded_subset():
    args = inputs([(2, 3, 4), (4, 4), (4,)])
    result = check_layer(linear_forward, dropped_transpose_linear_backward, *args, max_elements=7,
                         seed=3)
    again = check_layer(linear_forward, dropped_transpose_linear_backward, *args, max_elements=7,
                        seed=3)
    err = result.error_map("x")
    assert np.sum(~np.isnan(err)) == 7
    assert np.array_equal(np.isnan(err), np.isnan(again.error_map("x")))
    assert result.rel_error("x") > WRONG
    assert [row["checked"] for row in result.as_rows()] == [7, 7, 4]


# --- the whole model -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6)
    rng = np.random.default_rng(0)
    idx, targets = rng.integers(0, 11, size=(2, 6)), rng.integers(0, 11, size=(2, 6))
    return cfg, init_params(cfg, seed=0, dtype="float64"), idx, targets


@pytest.mark.parametrize("backend, oracle", [("numpy", "finite_differences"),
                                             ("numpy", "autograd"), ("torch", "autograd")])
def test_check_model_passes(tiny, backend, oracle):
    cfg, params, idx, targets = tiny
    params = {name: convert(p, backend) for name, p in params.items()}
    result = check_model(params, convert(idx, backend), convert(targets, backend), cfg,
                         oracle=oracle, max_elements=10)
    assert result.names == list(param_shapes(cfg))
    result.assert_ok()


def gpt_backward_without_head_share(cache):
    """The tied-matrix bug: wte.weight gets only the embedding's share, not the output head's."""
    grads = gpt_backward(cache)
    (dlogits,) = cross_entropy_backward(1.0, cache["loss"])  # (B, T, V)
    V, C = cache["wte.weight"].shape
    head_share = dlogits.reshape(-1, V).T @ cache["xf"].reshape(-1, C)  # (V, C)
    return {**grads, "wte.weight": grads["wte.weight"] - head_share}


@pytest.mark.parametrize("oracle", ORACLES)
def test_check_model_catches_a_missing_head_share(tiny, monkeypatch, oracle):
    cfg, params, idx, targets = tiny
    monkeypatch.setattr(gradcheck, "gpt_backward", gpt_backward_without_head_share)
    result = check_model(params, idx, targets, cfg, oracle=oracle, max_elements=6)
    assert [row["input"] for row in result.as_rows() if not row["passed"]] == ["wte.weight"]
    assert result.rel_error("wte.weight") > WRONG


# --- reports -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mixed_result():
    """dx wrong, dw and db right."""
    return check_layer(linear_forward, dropped_transpose_linear_backward,
                       *inputs([(2, 3, 4), (4, 4), (4,)]))


def test_text_report(mixed_result):
    text = str(mixed_result)
    lines = text.splitlines()
    assert "finite differences" in lines[0]
    for name, verdict in (("x", "FAIL"), ("w", "PASS"), ("b", "PASS")):
        (row,) = [line for line in lines[2:] if line.split()[0] == name]
        assert row.endswith(verdict)
        # a failing row shows its error; a passing one the bound it passed, not round-off digits
        shown = f"{mixed_result.rel_error(name):.2g}" if verdict == "FAIL" else "< 1e-07"
        assert shown in row
    assert repr(mixed_result) == text
    assert "FAIL" in str(pytest.raises(AssertionError, mixed_result.assert_ok).value)


def test_html_report(mixed_result):
    page = mixed_result._repr_html_()
    table = ET.fromstring(page)  # well-formed
    assert table.tag == "table"
    cells = [["".join(td.itertext()) for td in tr] for tr in table.iter("tr")][1:]
    assert [row[0] for row in cells] == ["x", "w", "b"]
    assert [row[-1] for row in cells] == ["FAIL", "PASS", "PASS"]
    assert [row[2] for row in cells][1:] == ["< 1e-07", "< 1e-07"]
    assert "#cf222e" in page and "#1a7f37" in page


def test_below_states_a_bound_and_asserts_it():
    assert below(3.2e-11, 1e-9) == "below 1e-09"
    with pytest.raises(AssertionError, match="not below 1e-09"):
        below(2e-9, 1e-9)
    with pytest.raises(AssertionError):
        below(float("nan"), 1.0)


def test_rows(mixed_result):
    rows = mixed_result.as_rows()
    assert [(r["input"], r["shape"], r["passed"]) for r in rows] == [
        ("x", (2, 3, 4), False), ("w", (4, 4), True), ("b", (4,), True)
    ]
    assert mixed_result.worst == max(r["rel_error"] for r in rows)


def test_plot_error_map(mixed_result):
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ax = mixed_result.plot_error_map("x")
    assert ax.images[0].get_array().shape == (6, 4)  # (2, 3) rows of 4
    _, ax = plt.subplots()
    assert mixed_result.plot_error_map("b", ax=ax) is ax
    assert ax.images[0].get_array().shape == (1, 4)  # 1-D: one row
    plt.close("all")


# --- clear errors --------------------------------------------------------------------------------


def test_wrong_number_of_grads():
    with pytest.raises(ValueError, match=r"\(x, w, b\): 3 expected, got 2"):
        check_layer(linear_forward, lambda dy, cache: linear_backward(dy, cache)[:2],
                    *inputs([(2, 3, 4), (4, 5), (5,)]))


def test_grad_not_in_a_tuple():
    with pytest.raises(ValueError, match=r"\(x\): 1 expected, got a ndarray"):
        check_layer(gelu_forward, lambda dy, cache: gelu_backward(dy, cache)[0], randn("numpy", 3))


def test_grad_of_the_wrong_shape():
    def backward_transposed_dw(dy, cache):
        dx, dw, db = linear_backward(dy, cache)
        return dx, dw.T, db

    with pytest.raises(ValueError, match=r"gradient for w has shape \(5, 4\), expected \(4, 5\)"):
        check_layer(linear_forward, backward_transposed_dw, *inputs([(2, 3, 4), (4, 5), (5,)]))


def test_missing_dict_grad():
    def forward(x, p):
        return x * p["scale"] + p["shift"], (x, p)

    def backward(dy, cache):
        x, p = cache
        return dy * p["scale"], {"scale": dy * x}

    x, p = randn("numpy", 3), {"scale": randn("numpy", 3, seed=1), "shift": randn("numpy", 3)}
    with pytest.raises(ValueError, match=r"no gradient array for p\[shift\]"):
        check_layer(forward, backward, x, p)


def test_not_callable():
    with pytest.raises(ValueError, match="forward must be callable"):
        check_layer(None, linear_backward, randn("numpy", 2))
    with pytest.raises(ValueError, match="backward must be callable"):
        check_layer(linear_forward, "linear_backward", randn("numpy", 2))


VARIANT_CONFIGS = {
    "llama": GPTConfig.llama(n_layer=2, n_head=4, n_embd=8, vocab_size=11, block_size=6,
                             n_kv_head=2, mlp_hidden=12),
    "moe": GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6, mlp="moe",
                     n_expert=3, mlp_hidden=12, capacity_factor=1.0, aux_loss_weight=0.1),
}


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("variant", VARIANT_CONFIGS)
def test_check_model_passes_on_variants(variant, oracle):
    """A tiny LLaMA-style model (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head) and
    one with experts (top-2 of 3, a capacity that drops tokens, the load-balancing loss): every
    gradient by name. Parameters get N(0, 0.3) noise so the routing is far from a tie that a
    finite-difference step could flip."""
    cfg = VARIANT_CONFIGS[variant]
    rng = np.random.default_rng(1)
    params = {name: p + rng.normal(0.0, 0.3, p.shape)
              for name, p in init_params(cfg, seed=0, dtype="float64").items()}  # fmt: skip
    idx, targets = rng.integers(0, 11, size=(2, 6)), rng.integers(0, 11, size=(2, 6))
    result = check_model(params, idx, targets, cfg, oracle=oracle, max_elements=10)
    assert result.names == list(param_shapes(cfg))
    result.assert_ok()


# --- the floor: zero and tiny true gradients ------------------------------------------------------


def plain_rel_error(entry):
    """||a - n|| / (||a|| + ||n||): the error without the floor."""
    a, n = entry.analytic[entry.mask], entry.numeric[entry.mask]
    return np.linalg.norm(a - n) / (np.linalg.norm(a) + np.linalg.norm(n))


def sdpa_backward_with_round_off(dout, cache):
    """sdpa_backward plus round-off of the size the inputs imply on dq and dk: a few units of
    u * |dout| |v| |k| per element, what the flash backward returns for one causal query (there
    dscores = att * (datt - D), and datt and D are the same sum taken in two orders)."""
    q, k, v = cache[:3]
    dq, dk, dv = sdpa_backward(dout, cache)
    rng = np.random.default_rng(5)
    size = 4 * np.finfo(np.float64).eps * np.max(np.abs(dout)) * np.max(np.abs(v))
    return (dq + size * np.max(np.abs(k)) * rng.standard_normal(dq.shape),
            dk + size * np.max(np.abs(q)) * rng.standard_normal(dk.shape), dv)


@pytest.mark.parametrize("oracle", ORACLES)
def test_a_zero_true_gradient_passes_with_round_off(oracle):
    """One causal query sees one key: att = 1 whatever q and k, so dq and dk are exactly 0. A
    backward that returns round-off there passes; without the floor its error would be 1."""
    q, k, v = inputs([(2, 3, 1, 4), (2, 3, 1, 4), (2, 3, 1, 2)])
    result = check_layer(sdpa_forward, sdpa_backward_with_round_off, q, k, v, oracle=oracle,
                         causal=True)
    result.assert_ok()
    for name in ("q", "k"):
        entry = result.entry(name)
        assert np.linalg.norm(entry.numeric) < 1e-15 * entry.scale  # zero up to round-off
        assert 0.0 < np.max(np.abs(entry.analytic)) < 1e-13  # the planted round-off
        assert plain_rel_error(entry) > 0.5  # what the error was before the floor: about 1
        no_floor = gradcheck.GradcheckEntry(name, entry.analytic, entry.numeric, entry.mask)
        assert not no_floor.passed()
    assert result.rel_error("v") < TOL


def zero_grad_for(backward, index):
    """``backward`` with the gradient of input ``index`` replaced by zeros."""

    def wrong(dout, cache):
        grads = list(backward(dout, cache))
        grads[index] = np.zeros_like(grads[index])
        return tuple(grads)

    return wrong


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("case", CASES)
def test_a_zero_analytic_gradient_fails(case, oracle):
    """A backward that returns zeros for one input fails on that input, with error 1: the floor
    never reaches a gradient of the usual size."""
    forward, backward, shapes, hyper = CASES[case]
    args = inputs(shapes)
    for index in range(len(shapes)):
        result = check_layer(forward, zero_grad_for(backward, index), *args, oracle=oracle,
                             **hyper)
        entry = result.entries[index]
        assert not entry.passed() and entry.rel_error == 1.0, entry.name
        assert result.passed() is False


def shift_forward(x, c):
    """y = x + 1e-6 c: the gradient of c is a millionth of the size s gives it."""
    return x + 1e-6 * c, None


def shift_backward(dy, cache):
    return dy, 1e-6 * dy


@pytest.mark.parametrize("oracle", ORACLES)
def test_a_zero_analytic_gradient_fails_against_a_tiny_true_one(oracle):
    """Where the floor does act (a true gradient far below s) a zero analytic gradient still
    fails: the test is ||a - n|| < 1e-9 s, and this gradient is about 1e-6 s."""
    x, c = inputs([(3, 5), (3, 5)])
    right = check_layer(shift_forward, shift_backward, x, c, oracle=oracle)
    right.assert_ok()
    entry = right.entry("c")
    assert np.linalg.norm(entry.numeric) < 1e-5 * entry.scale  # the floor acts here
    wrong = check_layer(shift_forward, zero_grad_for(shift_backward, 1), x, c, oracle=oracle)
    assert wrong.rel_error("c") > 100 * TOL
    assert wrong.entry("c").rel_error < plain_rel_error(wrong.entry("c"))  # floored, still FAIL


def gelu_backward_forgets_dout(dy, cache):
    """Chapter 5, exercise 1: the gradient of sum(out), whatever dout is."""
    return gelu_backward(np.ones_like(dy), cache)


PLANTED = {  # name: (forward, wrong backward, input shapes, hyperparameters, the inputs it breaks)
    "draft attention": (attention_single_forward, draft_attention_single_backward,
                        ATTENTION_SHAPES, {}, ["X", "A"]),
    "draft attention, causal": (attention_single_forward, draft_attention_single_backward,
                                ATTENTION_SHAPES, {"causal": True}, ["X", "A"]),
    "dropped transpose": (linear_forward, dropped_transpose_linear_backward,
                          [(2, 3, 4), (4, 4), (4,)], {}, ["x"]),
    "forgotten scale": (attention_single_forward, attention_single_backward_without_scale,
                        [(4, 3), (4, 4), (4, 4), (4, 4)], {}, ["X", "A", "B"]),
    "LayerNorm without its mean term": (layernorm_forward, layernorm_backward_without_mean_term,
                                        [(2, 3, 5), (5,), (5,)], {}, ["x"]),
    "GELU that forgets dout": (gelu_forward, gelu_backward_forgets_dout, [(4, 6)], {}, ["x"]),
}  # fmt: skip


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("bug", PLANTED)
def test_planted_bugs_fail_as_before(bug, oracle):
    """Every wrong formula of the book fails on exactly the inputs it breaks, with the same error
    as without the floor (which stays below their gradients' size), an error of order one."""
    forward, backward, shapes, hyper, broken = PLANTED[bug]
    result = check_layer(forward, backward, *inputs(shapes), oracle=oracle, **hyper)
    assert [entry.name for entry in result.entries if not entry.passed()] == broken
    for entry in result.entries:
        size = np.linalg.norm(entry.analytic) + np.linalg.norm(entry.numeric)
        assert size > 10 * gradcheck.FLOOR * entry.scale, entry.name
        if entry.name in broken:
            assert entry.rel_error == plain_rel_error(entry) > WRONG
