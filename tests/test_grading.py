"""gptlab.grading: the checks behind the graded exercises pass right answers and fail wrong
ones, and the guard stops the package's own backward and autograd from passing for a student's."""

import numpy as np
import pytest
import torch

from gptlab.grading import GradingError, cases, check_backward, check_function, guard
from gptlab.layers.gelu import gelu_forward
from gptlab.layers.layernorm import layernorm_backward, layernorm_forward
from gptlab.layers.mlp import mlp_backward, mlp_forward
from gptlab.layers.softmax import softmax_forward


def _layernorm_inputs(rng, B, T, C, dtype):
    x = rng.standard_normal((B, T, C)).astype(dtype)
    return x, (1 + 0.3 * rng.standard_normal(C)).astype(dtype), rng.standard_normal(C).astype(dtype)


LN_CASES = cases(_layernorm_inputs, [(1, 1, 4), (2, 3, 8)])


def own_layernorm_backward(dy, cache):
    """A student's answer written from the compact formula (chapter 8), on the layer's cache."""
    xhat, w, rstd, _ = cache
    g = dy * w
    C = dy.shape[-1]
    dx = rstd * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    dw = (dy * xhat).reshape(-1, C).sum(0)
    db = dy.reshape(-1, C).sum(0)
    return dx, dw, db


def test_cases_are_seeded_and_named_by_shape_and_dtype():
    again = cases(_layernorm_inputs, [(1, 1, 4), (2, 3, 8)])
    assert list(LN_CASES) == ["(1, 1, 4) float64", "(1, 1, 4) float32",
                              "(2, 3, 8) float64", "(2, 3, 8) float32"]
    assert all(np.array_equal(a, b) for k in LN_CASES for a, b in zip(LN_CASES[k], again[k]))
    assert LN_CASES["(2, 3, 8) float32"][0].dtype == np.float32


def test_a_written_backward_passes_every_case():
    report = check_backward(layernorm_forward, own_layernorm_backward, LN_CASES)
    assert report.passed, str(report)
    report.assert_ok()
    assert "PASS" in report._repr_html_()


@pytest.mark.parametrize("answer, message", [
    (layernorm_backward, "calls gptlab.layers.layernorm.layernorm_backward"),
    (lambda dy, c: (lambda r: (1.01 * r[0], r[1], r[2]))(own_layernorm_backward(dy, c)),
     "wrong gradient for x"),
    (lambda dy, c: (lambda r: (r[0].astype(np.float64), r[1], r[2]))(own_layernorm_backward(dy, c)),
     "is float64, its input float32"),
])
def test_wrong_answers_fail_with_the_reason(answer, message):
    report = check_backward(layernorm_forward, answer, LN_CASES)
    assert not report.passed
    assert any(message in r.detail for r in report.results), str(report)
    with pytest.raises(GradingError, match="not yet"):
        report.assert_ok()


def test_an_unwritten_answer_fails_every_case():
    def stub(dy, cache):
        raise NotImplementedError()

    report = check_backward(layernorm_forward, stub, LN_CASES)
    assert [r.passed for r in report.results] == [False] * 4
    assert all(r.detail == "NotImplementedError" for r in report.results)


def test_guard_catches_autograd_and_allows_what_the_exercise_builds_on():
    def through_autograd(dy, cache):
        x = torch.ones(3, requires_grad=True)
        (2 * x).sum().backward()
        return own_layernorm_backward(dy, cache)

    report = check_backward(layernorm_forward, through_autograd, LN_CASES)
    assert all("torch.autograd" in r.detail for r in report.results)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 4))
    w_fc, b_fc = rng.standard_normal((4, 8)), rng.standard_normal(8)
    w_proj, b_proj = rng.standard_normal((8, 4)), rng.standard_normal(4)

    def residual_forward(x, w_fc, b_fc, w_proj, b_proj):
        m, cache = mlp_forward(x, w_fc, b_fc, w_proj, b_proj)
        return x + m, cache

    def residual_backward(dy, cache):
        dx, *rest = mlp_backward(dy, cache)  # mlp_backward calls linear_ and gelu_backward
        return (dy + dx, *rest)

    inputs = {"(2, 3, 4)": (x, w_fc, b_fc, w_proj, b_proj)}
    assert not check_backward(residual_forward, residual_backward, inputs).passed
    check_backward(residual_forward, residual_backward, inputs, allow=[mlp_backward]).assert_ok()


def test_check_function_compares_shapes_dtypes_and_values():
    def reference(x):
        return softmax_forward(x)[0]

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    rng = np.random.default_rng(1)
    inputs = {"float64": (rng.standard_normal((2, 5)),),
              "float32": (rng.standard_normal(7).astype(np.float32),)}
    check_function(softmax, reference, inputs).assert_ok()
    assert not check_function(lambda x: softmax(x).astype(np.float64), reference, inputs).passed
    assert not check_function(lambda x: softmax(2 * x), reference, inputs).passed
    copied = check_function(reference, reference, inputs)
    assert all("calls" in r.detail for r in copied.results)
    gelu_out = check_function(lambda x: gelu_forward(x)[0], lambda x: gelu_forward(x)[0], inputs)
    assert gelu_out.passed  # a forward of gptlab is not a backward: allowed


def test_guard_takes_bound_methods():
    class Tokenizer:
        def encode(self, text):
            return list(text)

    tokenizer = Tokenizer()
    with pytest.raises(GradingError, match="encode"):
        with guard(forbid=[tokenizer.encode]):
            tokenizer.encode("ab")


def test_bad_cases_are_refused():
    with pytest.raises(ValueError, match="non-empty dict"):
        check_backward(layernorm_forward, own_layernorm_backward, {})
