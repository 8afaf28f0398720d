"""gptlab.course.grading: the checks behind the graded exercises pass right answers and fail wrong
ones, and the guard stops the package's own backward and autograd from passing for a student's."""

import numpy as np
import pytest
import torch

from gptlab.course.grading import (GradingError, cases, check_backward, check_function, guard,
                            package_functions)
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
    def gelu_reference(x):
        out, _ = gelu_forward(x)
        return out

    gelu_out = check_function(lambda x: gelu_forward(x)[0], gelu_reference, inputs)
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


# What a student's code can reach in the kernel, and cheats that tried it (issue 24): each fails.

def _square_forward(x):
    return x * x, (x,)


SQUARE_CASES = cases(lambda rng, n, dtype: rng.standard_normal(n).astype(dtype), [(3,), (5,)])


def _torch_grad(dy, x):
    """The gradient of sum(dy * x * x) by autograd."""
    t = torch.tensor(x, requires_grad=True)
    (grad,) = torch.autograd.grad((torch.tensor(dy) * t * t).sum(), t)
    return grad.detach().numpy()


def _in_thread(fn):
    import threading

    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def _in_pool(fn):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn).result()


def _without_profile(fn):
    import sys

    sys.setprofile(None)
    return fn()


def _through_engine(dy, x):
    from torch.autograd.variable import Variable

    t = torch.tensor(x, requires_grad=True)
    out = (torch.tensor(dy) * t * t).sum()
    (grad,) = Variable._execution_engine.run_backward((out,), (torch.ones(()),), False, False,
                                                      (t,), False)
    return grad.detach().numpy()


@pytest.mark.parametrize("run", [lambda f: f(), _in_thread, _in_pool, _without_profile],
                         ids=["plain", "thread", "thread pool", "setprofile(None)"])
def test_autograd_is_caught_in_threads_and_without_the_profile(run):
    def cheat(dy, cache):
        return (run(lambda: _torch_grad(dy, cache[0])),)

    report = check_backward(_square_forward, cheat, SQUARE_CASES)
    assert not report.passed and all(not r.passed for r in report.results), str(report)


def test_the_autograd_engine_itself_is_caught():
    report = check_backward(_square_forward, lambda dy, c: (_through_engine(dy, c[0]),),
                            SQUARE_CASES)
    assert all("autograd engine" in r.detail for r in report.results), str(report)


def test_the_package_backward_under_another_name_is_caught():
    import inspect
    import types

    code = layernorm_backward.__code__.replace(co_name="mine", co_qualname="mine")
    renamed = types.FunctionType(code, layernorm_backward.__globals__, "mine")
    namespace = dict(layernorm_backward.__globals__)
    exec(inspect.getsource(layernorm_backward).replace("def layernorm_backward", "def mine2"),
         namespace)
    for answer in (renamed, namespace["mine2"]):
        report = check_backward(layernorm_forward, answer, LN_CASES)
        assert all("calls gptlab.layers.layernorm.layernorm_backward" in r.detail
                   for r in report.results), str(report)


def _zero_backward(dy, cache):
    return tuple(np.zeros_like(a) for a in cache[:1]) + (np.zeros_like(cache[1]),) * 2


@pytest.mark.parametrize("patch", ["grading._backward_case", "grading._compare",
                                   "np.linalg.norm", "np.allclose"])
def test_patches_of_what_the_checks_use_are_undone(patch, monkeypatch):
    import gptlab.course.grading as grading

    owner, name = {"grading": grading, "np.linalg": np.linalg, "np": np}[patch.rsplit(".", 1)[0]], \
        patch.rsplit(".", 1)[1]
    monkeypatch.setattr(owner, name, lambda *a, **k: "matches" if "case" in name else True
                        if name == "allclose" else None if name == "_compare" else 0.0)
    report = check_backward(layernorm_forward, _zero_backward, LN_CASES)
    assert not report.passed, str(report)
    softmax_report = check_function(lambda x: np.zeros_like(x), lambda x: softmax_forward(x)[0],
                                    {"x": (np.ones((2, 3)),)})
    assert not softmax_report.passed
    monkeypatch.setattr(owner, name, lambda *a, **k: None)  # patched while the answer runs

    def patching(dy, cache):
        setattr(owner, name, lambda *a, **k: None)
        return own_layernorm_backward(dy, cache)

    report = check_backward(layernorm_forward, patching, LN_CASES)
    assert all(f"changes {owner.__name__}.{name}" in r.detail for r in report.results), str(report)


def test_warnings_and_stderr_are_reported_and_do_not_fail():
    import sys
    import warnings

    def chatty(dy, cache):
        warnings.warn("float64 constant", RuntimeWarning)
        print("debug: dy", dy.shape, file=sys.stderr)
        return own_layernorm_backward(dy, cache)

    report = check_backward(layernorm_forward, chatty, LN_CASES)
    assert report.passed, str(report)
    assert all("warns RuntimeWarning: float64 constant" in r.detail and "stderr: debug: dy" in
               r.detail for r in report.results), str(report)


def test_finite_differences_of_the_given_forward_fail():
    def by_differences(dy, cache):
        (x,) = cache
        x, grad = x.copy(), np.zeros_like(x)
        for i in np.ndindex(x.shape):
            saved = x[i]
            x[i] = saved + 1e-6
            up = np.sum(_square_forward(x)[0] * dy)
            x[i] = saved - 1e-6
            grad[i] = (up - np.sum(_square_forward(x)[0] * dy)) / 2e-6
            x[i] = saved
        return (grad,)

    report = check_backward(_square_forward, by_differences, SQUARE_CASES)
    assert all("calls" in r.detail and "_square_forward" in r.detail for r in report.results)


def test_a_float64_output_for_float32_inputs_is_named_as_the_cause():
    def float64_forward(x):
        return (x * x).astype(np.float64), (x,)

    report = check_backward(float64_forward, lambda dy, c: (2 * c[0] * dy,), SQUARE_CASES)
    float32 = [r for r in report.results if "float32" in r.case]
    assert float32 and all("float64_forward returns float64 for float32 inputs" in r.detail
                           for r in float32), str(report)


def test_package_functions_split_a_whitelist():
    import gptlab.training.data
    from gptlab.training.data import get_batch
    from gptlab.model import gpt_forward, init_params

    allowed, forbidden = package_functions(allow_modules=[gptlab.training.data], allow=[init_params])
    assert get_batch in allowed and init_params in allowed
    assert gpt_forward in forbidden and layernorm_forward in forbidden
    assert not set(allowed) & set(forbidden)

    def from_the_package(x):
        return layernorm_forward(x, np.ones(x.shape[-1]), np.zeros(x.shape[-1]))[0]

    def reference(x):
        mu = x.mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)

    report = check_function(from_the_package, reference, {"x": (np.ones((2, 3)),)},
                            allow=allowed, forbid=forbidden)
    assert "calls gptlab.layers.layernorm.layernorm_forward" in report.results[0].detail


def test_the_channel_carries_numbers_and_arrays_never_objects():
    """gptlab.course.wire: what a sandbox sends the grader is rebuilt without pickle; an object
    stays a handle; a forged message is a ChannelError, not an object."""
    from gptlab.course import wire

    sent = {"loss": np.float32(1.5), "grads": (np.arange(6.0).reshape(2, 3).T, [True, None]),
            7: float("inf"), "name": "x", "empty": np.zeros((0, 3), np.int8)}
    got = wire.decode(wire.encode(sent))
    assert type(got["loss"]) is np.float32 and got[7] == float("inf") and got["name"] == "x"
    assert np.array_equal(got["grads"][0], sent["grads"][0]) and got["grads"][1] == [True, None]
    assert got["empty"].shape == (0, 3) and got["empty"].dtype == np.int8
    kept = []
    handle = wire.decode(wire.encode({"f": print}, lambda obj: kept.append(obj) or 0))["f"]
    assert isinstance(handle, wire.Handle) and kept == [print]
    with pytest.raises(TypeError):
        wire.encode(np.array([object()], dtype=object))
    forged = wire.encode(np.ones(2)).replace(b'"<f8"', b'"|O8"')
    with pytest.raises(wire.ChannelError):
        wire.decode(forged)
    with pytest.raises(wire.ChannelError):
        wire.decode(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad")
