"""Grading the book's exercises: a student's function checked on inputs the student never saw.

Every chapter is also an nbgrader assignment (docs/COURSE.md). A graded exercise has an answer
cell, where the student writes a function, and a grading cell that calls one of

- ``check_backward(forward, backward, cases)``: the student's backward against finite
  differences, with the gradient checker of chapter 5, on every case; float32 cases must also
  give gradients of the input's dtype that agree with the float64 ones;
- ``check_function(candidate, reference, cases)``: the student's outputs against gptlab's own
  function, same shapes, same dtypes, same values.

Each returns a :class:`GradeReport` (one row per case, shown as a table) whose ``assert_ok()``
raises :class:`GradingError` unless every case passes: nbgrader gives a grading cell its points
when the cell raises nothing. The visible call uses one small case; the hidden tests (removed
from the student's edition, put back when grading) use several shapes, T = 1, repeated tokens,
float32 and float64.

The student's code runs under :func:`guard`, which fails the case when it calls autograd or one
of gptlab's own backward functions, so the package's answer cannot pass for the student's.

Book: the exercises of every chapter; docs/COURSE.md for the course.
"""

from __future__ import annotations

import copy
import html
import inspect
import sys
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from array_api_compat import is_array_api_obj

from .backend import asarray_like, to_numpy
from .gradcheck import TOLERANCE, GradcheckEntry, _fmt, check_layer

FLOAT32_TOLERANCE = 1e-4  # relative error of float32 gradients against the float64 ones

__all__ = ["FLOAT32_TOLERANCE", "GradeReport", "GradingError", "cases", "check_backward",
           "check_function", "guard"]


class GradingError(AssertionError):
    """A graded check that did not pass (an AssertionError, so a grading cell fails on it)."""


# ---------------------------------------------------------------------------------------------
# The guard: which calls a student's code may not make.


def _is_backward_name(name: str) -> bool:
    return "backward" in name or name.endswith(("_back", "_back_", "grads"))


def _gptlab_backward_functions() -> dict:
    """code object -> qualified name of every loaded gptlab function that computes gradients
    (``*backward*``, ``*_back``, ``*grads``)."""
    found = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or module_name == __name__ or not (
                module_name == "gptlab" or module_name.startswith("gptlab.")):
            continue
        for obj in list(vars(module).values()):
            if (inspect.isfunction(obj) and obj.__module__.startswith("gptlab")
                    and _is_backward_name(obj.__name__)):
                found[obj.__code__] = f"{obj.__module__}.{obj.__qualname__}"
    return found


def _autograd_entries() -> dict:
    """code object -> name of torch's entries into autograd (when torch is loaded)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    import torch.autograd.graph

    entries = [torch.autograd.backward, torch.autograd.grad]
    entries += [getattr(torch.autograd.graph, "_engine_run_backward", None)]
    return {fn.__code__: f"torch.autograd ({fn.__name__})" for fn in entries
            if inspect.isfunction(fn)}


def _code(fn):
    fn = inspect.unwrap(getattr(fn, "__func__", fn))  # a bound method: its function
    if not inspect.isfunction(fn):
        raise TypeError(f"guard takes Python functions, got {type(fn).__name__}")
    return fn.__code__


@contextmanager
def guard(*, allow=(), forbid=()):
    """Fail (GradingError) if the code inside calls autograd, a gptlab backward or ``forbid``.

    ``allow``: gptlab functions the exercise lets the student call (``mlp_backward`` when the
    exercise builds on it); whatever they call in turn is allowed too.
    """
    forbidden = {**_gptlab_backward_functions(), **_autograd_entries()}
    forbidden.update({_code(fn): getattr(fn, "__qualname__", repr(fn)) for fn in forbid})
    allowed = {_code(fn) for fn in allow}
    calls: list[str] = []
    depth = 0  # how many allowed functions are running

    def profile(frame, event, arg):
        nonlocal depth
        code = frame.f_code
        if code in allowed:
            depth += {"call": 1, "return": -1}.get(event, 0)
        elif event == "call" and depth == 0 and code in forbidden:
            calls.append(forbidden[code])

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)
    if calls:
        names = ", ".join(dict.fromkeys(calls))
        raise GradingError(f"calls {names}: the exercise is to write it yourself")


def _guarded(fn, allow, forbid):
    def run(*args, **kwargs):
        with guard(allow=allow, forbid=forbid):
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# The report.


@dataclass(frozen=True)
class CaseResult:
    """One case: its name, whether it passed, and what was measured or went wrong."""

    case: str
    passed: bool
    detail: str


class GradeReport:
    """The outcome of a graded check: one :class:`CaseResult` per case."""

    def __init__(self, title: str, results: list[CaseResult]):
        self.title = title
        self.results = list(results)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.passed for r in self.results)

    def assert_ok(self) -> None:
        """Raise GradingError, with the table, unless every case passed."""
        if not self.passed:
            failed = [r.case for r in self.results if not r.passed]
            raise GradingError(f"not yet: {len(failed)} of {len(self.results)} cases fail "
                               f"({', '.join(failed)})\n{self}")

    def __str__(self) -> str:
        width = max([len("case")] + [len(r.case) for r in self.results])
        lines = [self.title]
        for r in self.results:
            lines.append(f"{r.case:<{width}}  {'PASS' if r.passed else 'FAIL'}  {r.detail}".rstrip())
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        pad = 'style="padding:0.15em 0.8em;text-align:left"'
        rows = []
        for r in self.results:
            color = "#1a7f37" if r.passed else "#cf222e"
            verdict = "PASS" if r.passed else "FAIL"
            rows.append(f"<tr><td {pad}><code>{html.escape(r.case)}</code></td>"
                        f"<td {pad}><b style=\"color:{color}\">{verdict}</b></td>"
                        f"<td {pad}>{html.escape(r.detail)}</td></tr>")
        return ('<table class="grade" style="border-collapse:collapse">'
                f"<caption>{html.escape(self.title)}</caption>"
                "<thead><tr><th>case</th><th>result</th><th>detail</th></tr></thead>"
                f"<tbody>{''.join(rows)}</tbody></table>")


def _failure(error: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    message = str(error).strip().splitlines()
    return type(error).__name__ + (f": {message[0]}" if message else "")


# ---------------------------------------------------------------------------------------------
# Cases.


def cases(make, shapes, *, dtypes=("float64", "float32"), seed: int = 0) -> dict:
    """``{"(2, 3, 4) float32": make(rng, 2, 3, 4, dtype=np.float32), ...}`` for every shape and
    dtype: the inputs of a check, each from its own seeded generator."""
    result = {}
    for i, shape in enumerate(shapes):
        for dtype in dtypes:
            rng = np.random.default_rng([seed, i])
            inputs = make(rng, *shape, dtype=np.dtype(dtype))
            result[f"{tuple(shape)} {dtype}"] = inputs if isinstance(inputs, tuple) else (inputs,)
    return result


def _check_cases(cases_) -> dict:
    if not isinstance(cases_, dict) or not cases_:
        raise ValueError("cases must be a non-empty dict {name: tuple of inputs}")
    return {name: inputs if isinstance(inputs, tuple) else (inputs,)
            for name, inputs in cases_.items()}


def _dtype_name(a) -> str:
    return str(a.dtype).removeprefix("torch.")


def _is_float(a) -> bool:
    return is_array_api_obj(a) and "float" in _dtype_name(a)


def _input_gradient_pairs(args, grads):
    """(input, its gradient) for every float array and every entry of a dict argument, in the
    order of check_layer's entries (a missing gradient is None)."""
    checked = [a for a in args if isinstance(a, dict) or _is_float(a)]
    for x, g in zip(checked, grads):
        if isinstance(x, dict):
            for key in x:
                yield x[key], g.get(key) if isinstance(g, dict) else None
        else:
            yield x, g


# ---------------------------------------------------------------------------------------------
# The two checks.


def _backward_case(forward, backward, args, hyperparams, tol, max_elements) -> str:
    """Check one case; return the detail of a pass, raise GradingError (or the student's own
    exception) on a failure."""
    result = check_layer(forward, backward, *args, max_elements=max_elements, **hyperparams)
    if not result.passed(tol):
        failed = {e.name: _fmt(e.rel_error) for e in result.entries if not e.passed(tol)}
        raise GradingError(f"wrong gradient for {', '.join(failed)} (rel. error "
                           f"{', '.join(failed.values())} against finite differences)")
    out, cache = forward(*args, **hyperparams)
    dout = asarray_like(np.random.default_rng(0).standard_normal(tuple(out.shape)), out)
    grads = backward(dout, cache)
    pairs = list(_input_gradient_pairs(args, grads if isinstance(grads, (tuple, list)) else (grads,)))
    dtype = _dtype_name(pairs[0][0]) if pairs else "float64"
    for entry, (x, g) in zip(result.entries, pairs):
        if not is_array_api_obj(g) or _dtype_name(g) != _dtype_name(x):
            got = _dtype_name(g) if is_array_api_obj(g) else type(g).__name__
            raise GradingError(f"the gradient for {entry.name} is {got}, its input {_dtype_name(x)}")
        if dtype != "float64":
            a = np.asarray(to_numpy(g), dtype=np.float64)
            err = GradcheckEntry(entry.name, a, entry.analytic, entry.mask | True).rel_error
            if not err < FLOAT32_TOLERANCE:
                raise GradingError(f"{dtype} gradient for {entry.name} differs from the float64 "
                                   f"one by {_fmt(err)} (relative)")
    return f"rel. error < {_fmt(tol)}" + ("" if dtype == "float64" else
                                         f"; {dtype} within {_fmt(FLOAT32_TOLERANCE)}")


def check_backward(forward, backward, cases, *, allow=(), forbid=(), tol: float = TOLERANCE,
                   max_elements: int | None = None, **hyperparams) -> GradeReport:
    """Grade ``backward`` (``backward(dout, cache) -> grads``) for ``forward`` on every case.

    ``cases``: ``{name: tuple of the forward's positional inputs}`` (NumPy or torch; float
    inputs get gradients, integer ones such as token ids pass through). A case passes when, in
    float64, every gradient agrees with finite differences (relative error below ``tol``, as
    ``check_layer``), every gradient has its input's dtype and shape, and a float32 case's
    gradients agree with the float64 ones within ``FLOAT32_TOLERANCE``. The backward runs under
    :func:`guard` (``allow``, ``forbid`` as there). ``max_elements``: finite differences on a
    seeded random subset of each input's elements (a whole model). ``hyperparams`` go to
    ``forward``.
    """
    guarded = _guarded(backward, allow, forbid)
    results = []
    for name, args in _check_cases(cases).items():
        try:
            results.append(CaseResult(name, True,
                                      _backward_case(forward, guarded, args, hyperparams, tol,
                                                                 max_elements)))
        except Exception as error:  # the student's code may raise anything
            results.append(CaseResult(name, False, _failure(error)))
    title = f"{getattr(backward, '__name__', 'backward')}: checked against finite differences"
    return GradeReport(title, results)


def _compare(got, want, rtol: float, atol: float, where: str = "output") -> None:
    """Raise GradingError unless ``got`` matches ``want``: same structure, shapes, dtypes, and
    values within rtol/atol (exactly, for integers and booleans)."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            raise GradingError(f"{where} should be a dict with keys {sorted(want)}")
        for key in want:
            _compare(got[key], want[key], rtol, atol, f"{where}[{key!r}]")
    elif isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            raise GradingError(f"{where} should be a sequence of {len(want)}")
        for k, (g, w) in enumerate(zip(got, want)):
            _compare(g, w, rtol, atol, f"{where}[{k}]")
    elif is_array_api_obj(want):
        if not is_array_api_obj(got):
            raise GradingError(f"{where} should be an array, got {type(got).__name__}")
        if tuple(got.shape) != tuple(want.shape) or _dtype_name(got) != _dtype_name(want):
            raise GradingError(f"{where} is {tuple(got.shape)} {_dtype_name(got)}, expected "
                               f"{tuple(want.shape)} {_dtype_name(want)}")
        g, w = np.asarray(to_numpy(got)), np.asarray(to_numpy(want))
        exact = not np.issubdtype(w.dtype, np.inexact)
        if not (np.array_equal(g, w) if exact else
                np.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True)):
            worst = "" if exact else f" (max abs difference {_fmt(float(np.max(np.abs(g - w))))})"
            raise GradingError(f"{where} has wrong values{worst}")
    elif isinstance(want, float):
        if not isinstance(got, (float, int)) or not np.isclose(got, want, rtol=rtol, atol=atol):
            raise GradingError(f"{where} is {got!r:.40}, expected {want!r:.40}")
    elif got != want:
        raise GradingError(f"{where} is {got!r:.40}, expected {want!r:.40}")


def check_function(candidate, reference, cases, *, forbid=(), rtol: float = 1e-6,
                   atol: float = 1e-9, **kwargs) -> GradeReport:
    """Grade ``candidate`` against ``reference`` on every case: the same output structure,
    shapes and dtypes, values within ``rtol``/``atol`` (integers exactly).

    ``cases``: ``{name: tuple of positional inputs}``; each call gets its own deep copy, so a
    function that writes into its inputs cannot change what the other sees. ``kwargs`` go to
    both. The candidate runs under :func:`guard`, with ``reference`` forbidden too.
    """
    guarded = _guarded(candidate, (), (reference, *forbid))
    results = []
    for name, args in _check_cases(cases).items():
        want = reference(*copy.deepcopy(args), **kwargs)
        try:
            _compare(guarded(*copy.deepcopy(args), **kwargs), want, rtol, atol)
            results.append(CaseResult(name, True, "matches"))
        except Exception as error:  # the student's code may raise anything
            results.append(CaseResult(name, False, _failure(error)))
    title = (f"{getattr(candidate, '__name__', 'candidate')}: checked against "
             f"{getattr(reference, '__qualname__', 'the reference')}")
    return GradeReport(title, results)
