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
import functools
import html
import inspect
import io
import marshal
import sys
import threading
import warnings
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass

import numpy as np
from array_api_compat import is_array_api_obj

from .. import backend, gradcheck
from ..backend import asarray_like, to_numpy
from ..gradcheck import TOLERANCE, GradcheckEntry, format_float, check_layer

FLOAT32_TOLERANCE = 1e-4  # relative error of float32 gradients against the float64 ones
COURSE = __name__.rsplit(".", 1)[0] + "."  # the course's modules: the checks and the grader

__all__ = ["FLOAT32_TOLERANCE", "GradeReport", "GradingError", "cases",
           "check_backward", "check_function", "guard", "guard_spec", "open_guards",
           "package_functions", "recorded", "spec_bodies", "watch"]


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


@functools.lru_cache(maxsize=4)
def _always_forbidden(loaded: tuple) -> dict:
    """body -> name of torch's entries into autograd and gptlab's backward functions, for the
    modules ``loaded`` now (the key of the cache: each check calls the guard)."""
    return {_body(code): name for code, name in
            {**_gptlab_backward_functions(), **_autograd_entries()}.items()}


@functools.lru_cache(maxsize=None)
def _body(code) -> tuple:
    """What a function does, whatever it is named: its bytecode, constants (nested functions by
    their own body), names and local names. The package's backward compiled again under another
    name (exec of its source, ``code.replace(co_name=...)``) has the same body."""
    consts = tuple(_body(c) if inspect.iscode(c) else c for c in code.co_consts
                   if not isinstance(c, str) or c != code.co_consts[0])  # docstring aside
    return code.co_code, consts, code.co_names, code.co_varnames


def _code(fn):
    fn = inspect.unwrap(getattr(fn, "__func__", fn))  # a bound method: its function
    if not inspect.isfunction(fn):
        raise TypeError(f"guard takes Python functions, got {type(fn).__name__}")
    return fn.__code__


def _qualified(fn) -> str:
    """``gptlab.layers.layernorm.layernorm_forward``; a function of the notebook by its name."""
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", repr(fn))
    return f"{module}.{name}" if module and module.startswith("gptlab") else name


class _EngineWatch:
    """Stands in for torch's autograd engine (``Variable._execution_engine``) inside the guard:
    every backward pass and ``torch.autograd.grad``, from any thread and with any profile, goes
    through it. Records the call, then runs the real engine."""

    def __init__(self, engine, calls: list):
        self._engine, self._calls = engine, calls

    def __getattr__(self, name):
        self._calls.append(f"the autograd engine ({name})")
        return getattr(self._engine, name)


@contextmanager
def _watch_engine(calls: list):
    variable = getattr(sys.modules.get("torch.autograd.variable"), "Variable", None)
    engine = getattr(variable, "_execution_engine", None)
    if engine is None:
        yield
        return
    variable._execution_engine = _EngineWatch(engine, calls)
    try:
        yield
    finally:
        variable._execution_engine = engine


_OPEN_GUARDS: list[tuple[tuple, tuple]] = []  # (allow, forbid) of each guard open now


@contextmanager
def guard(*, allow=(), forbid=()):
    """Fail (GradingError) if the code inside calls autograd, a gptlab backward or ``forbid``.

    ``allow``: gptlab functions the exercise lets the student call (``mlp_backward`` when the
    exercise builds on it); whatever they call in turn is allowed too. The functions are known by
    what they do (:func:`_body`), not by name; the guard watches every thread
    (``threading.setprofile``) and torch's autograd engine itself, and fails the code if it
    removes the guard's profile (``sys.setprofile(None)``). A student's function that runs in
    its sandbox (the autograder's) is called there under the guards open here.
    """
    _OPEN_GUARDS.append((tuple(allow), tuple(forbid)))
    try:
        with watch({_body(_code(fn)) for fn in allow},
                   {_body(_code(fn)): _qualified(fn) for fn in forbid}):
            yield
    finally:
        _OPEN_GUARDS.pop()


def open_guards() -> tuple[tuple, tuple] | None:
    """(allow, forbid): the functions of every :func:`guard` open now, together; None if none
    is open."""
    if not _OPEN_GUARDS:
        return None
    return (tuple(fn for allow, _ in _OPEN_GUARDS for fn in allow),
            tuple(fn for _, forbid in _OPEN_GUARDS for fn in forbid))


def guard_spec(allow, forbid) -> tuple[list, list]:
    """What a guard allows and forbids, as the sandbox receives it: the marshalled code of each
    function (and the name of each forbidden one)."""
    return ([marshal.dumps(_code(fn)) for fn in allow],
            [(marshal.dumps(_code(fn)), _qualified(fn)) for fn in forbid])


def spec_bodies(spec) -> tuple[set, dict]:
    """:func:`guard_spec` read back (in the sandbox): the bodies allowed, body -> name forbidden."""
    allow, forbid = spec
    return ({_body(marshal.loads(code)) for code in allow},
            {_body(marshal.loads(code)): name for code, name in forbid})


@contextmanager
def watch(allowed: set, forbidden: dict):
    """:func:`guard` on bodies (:func:`_body`): ``forbidden`` body -> name, on top of autograd
    and gptlab's backward functions; ``allowed`` bodies and what they call pass."""
    loaded = tuple(name for name in sys.modules if name.startswith(("gptlab", "torch.autograd")))
    forbidden = {**_always_forbidden(loaded), **forbidden}
    calls: list[str] = []
    depth = threading.local()  # how many allowed functions are running, per thread
    known: dict = {}  # id(code) -> (code, its name if forbidden, "" if allowed, None if neither)

    def verdict(code):
        if id(code) not in known:  # the code is kept, so its id is not reused
            body = _body(code)
            known[id(code)] = code, "" if body in allowed else forbidden.get(body)
        return known[id(code)][1]

    def profile(frame, event, arg):
        if event not in ("call", "return"):
            return
        name = verdict(frame.f_code)
        if name is None:
            return
        level = getattr(depth, "n", 0)  # what an allowed or forbidden function calls: its own
        if name and event == "call" and level == 0:
            calls.append(name)
        depth.n = level + (1 if event == "call" else -1)

    previous, previous_threads = sys.getprofile(), threading.getprofile()
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        with _watch_engine(engine_calls := []):
            yield
        if engine_calls and not calls:
            calls.extend(engine_calls)
        if sys.getprofile() is not profile:
            calls.append("sys.setprofile (it removed the guard)")
    finally:
        sys.setprofile(previous)
        threading.setprofile(previous_threads)
    if calls:
        names = ", ".join(dict.fromkeys(calls))
        raise GradingError(f"calls {names}: the exercise is to write it yourself")


def package_functions(*, allow_modules=(), allow=()) -> tuple[list, list]:
    """``(allowed, forbidden)``: the Python functions and methods of every loaded gptlab module
    but the course's own (this one, the grader's) and gradcheck, split into those of
    ``allow_modules`` or in ``allow`` and the others: ``check_function(..., allow=allowed,
    forbid=forbidden)`` enforces a whitelist ("from gptlab you may use the configuration and
    the data helpers")."""
    allowed_modules = {module.__name__ for module in allow_modules}
    allowed = {_code(fn) for fn in allow}
    found: dict = {}
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("gptlab.") \
                or module_name.startswith(COURSE) or module_name == gradcheck.__name__:
            continue
        for obj in list(vars(module).values()):
            members = [obj] if inspect.isfunction(obj) else [
                inspect.unwrap(getattr(m, "__func__", m)) for key, m in vars(obj).items()
                if not key.startswith("__")] if inspect.isclass(obj) else []
            for fn in members:
                if inspect.isfunction(fn) and fn.__module__ == module_name:
                    found[fn.__code__] = fn
    split: tuple[list, list] = ([], [])
    for code, fn in found.items():
        split[fn.__module__ not in allowed_modules and code not in allowed].append(fn)
    return split


@contextmanager
def recorded(said: list):
    """What the code inside warns and prints on stderr, recorded in ``said`` (it fails nothing)."""
    stderr = io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as warned, redirect_stderr(stderr):
            warnings.simplefilter("always")
            yield
    finally:
        said.extend(f"warns {w.category.__name__}: {w.message}" for w in warned)
        said.extend(f"stderr: {line}" for line in stderr.getvalue().splitlines() if line)


def _guarded(fn, allow, forbid, said: list):
    """``fn`` under :func:`guard`, what it prints on stderr and warns recorded in ``said``,
    and the modules the checks rely on put back if it changed them (a failure). A student's
    function in its sandbox (``call_guarded``) is called there, under the same guard."""
    if hasattr(fn, "call_guarded"):
        return lambda *args, **kwargs: fn.call_guarded(args, kwargs, allow, forbid, said)

    def run(*args, **kwargs):
        try:
            with recorded(said), guard(allow=allow, forbid=forbid):
                return fn(*args, **kwargs)
        finally:
            if changed := _restore():
                raise GradingError(f"changes {', '.join(changed)} while it runs")

    return run


# ---------------------------------------------------------------------------------------------
# Private copies: what the checks rely on, as it was when this module was imported.


def _pristine_state() -> dict:
    """(module or class, attribute) -> value, and function -> its code and defaults, of NumPy,
    torch (if loaded) and gptlab's grading, gradcheck and backend modules."""
    modules = [np, np.linalg, np.random, sys.modules[__name__], gradcheck, backend]
    if "torch" in sys.modules:
        modules.append(sys.modules["torch"])
    state = {}
    for module in modules:
        for name, value in list(vars(module).items()):
            if inspect.ismodule(value) or (module.__name__ == "torch" and not callable(value)):
                continue  # submodules and torch's settings may come and go
            state[module, name] = value
            if not module.__name__.startswith("gptlab"):
                continue
            if inspect.isfunction(value) and value.__module__ == module.__name__:
                state[value, "__code__"] = value.__code__
                state[value, "__defaults__"] = value.__defaults__
            elif inspect.isclass(value) and value.__module__ == module.__name__:
                for key, attr in list(vars(value).items()):
                    state[value, key] = attr
    return state


def _restore() -> list[str]:
    """Put back every attribute of :func:`_pristine_state` that changed since import; return
    their names (``numpy.linalg.norm``)."""
    changed = []
    for (owner, name), value in _PRISTINE.items():
        now = getattr(owner, name, _MISSING) if not inspect.isclass(owner) \
            else vars(owner).get(name, _MISSING)
        if now is not value:
            try:
                setattr(owner, name, value)
            except (AttributeError, TypeError):  # read-only (a C type's slot): unchanged
                continue
            changed.append(f"{getattr(owner, '__name__', owner)}.{name}")
    return changed


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


def _with_said(detail: str, said: list[str]) -> str:
    """A case's detail with what the student's code warned or printed on stderr (it does not
    fail the case)."""
    return "; ".join([detail, *dict.fromkeys(said)])


def _failure(error: BaseException) -> str:
    """An exception as one line: its type (the student's, for one raised in the sandbox) and
    the first line of its message."""
    message = str(error).strip().splitlines()
    return getattr(error, "kind", type(error).__name__) + (f": {message[0]}" if message else "")


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
        failed = {e.name: format_float(e.rel_error) for e in result.entries if not e.passed(tol)}
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
            if is_array_api_obj(out) and _dtype_name(out) != _dtype_name(x):  # the cause
                name = getattr(forward, "__name__", "the forward")
                raise GradingError(f"{name} returns {_dtype_name(out)} for "
                                   f"{_dtype_name(x)} inputs (so the gradient for {entry.name} "
                                   f"is {got}): keep {_dtype_name(x)} in {_dtype_name(x)}")
            raise GradingError(f"the gradient for {entry.name} is {got}, its input {_dtype_name(x)}")
        if dtype != "float64":
            a = np.asarray(to_numpy(g), dtype=np.float64)
            err = GradcheckEntry(entry.name, a, entry.analytic, entry.mask | True).rel_error
            if not err < FLOAT32_TOLERANCE:
                raise GradingError(f"{dtype} gradient for {entry.name} differs from the float64 "
                                   f"one by {format_float(err)} (relative)")
    return f"rel. error < {format_float(tol)}" + ("" if dtype == "float64" else
                                         f"; {dtype} within {format_float(FLOAT32_TOLERANCE)}")


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
    ``forward``. The backward may not call ``forward`` (finite differences of the given forward
    are not a written backward).
    """
    if inspect.isfunction(inspect.unwrap(forward)):
        forbid = (forward, *forbid)
    _restore()  # what an answer cell changed in NumPy, torch or this module
    results = []
    for name, args in _check_cases(cases).items():
        said: list[str] = []
        guarded = _guarded(backward, allow, forbid, said)
        try:
            detail = _backward_case(forward, guarded, args, hyperparams, tol, max_elements)
            results.append(CaseResult(name, True, _with_said(detail, said)))
        except Exception as error:  # the student's code may raise anything
            results.append(CaseResult(name, False, _with_said(_failure(error), said)))
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
            worst = "" if exact else f" (max abs difference {format_float(float(np.max(np.abs(g - w))))})"
            raise GradingError(f"{where} has wrong values{worst}")
    elif isinstance(want, float):
        if not isinstance(got, (float, int)) or not np.isclose(got, want, rtol=rtol, atol=atol):
            raise GradingError(f"{where} is {got!r:.40}, expected {want!r:.40}")
    elif got != want:
        raise GradingError(f"{where} is {got!r:.40}, expected {want!r:.40}")


def check_function(candidate, reference, cases, *, allow=(), forbid=(), rtol: float = 1e-6,
                   atol: float = 1e-9, **kwargs) -> GradeReport:
    """Grade ``candidate`` against ``reference`` on every case: the same output structure,
    shapes and dtypes, values within ``rtol``/``atol`` (integers exactly).

    ``cases``: ``{name: tuple of positional inputs}``; each call gets its own deep copy, so a
    function that writes into its inputs cannot change what the other sees. ``kwargs`` go to
    both. The candidate runs under :func:`guard` (``allow``, ``forbid`` as there), with
    ``reference`` forbidden too.
    """
    _restore()  # what an answer cell changed in NumPy, torch or this module
    results = []
    for name, args in _check_cases(cases).items():
        said: list[str] = []
        guarded = _guarded(candidate, allow, (reference, *forbid), said)
        want = reference(*copy.deepcopy(args), **kwargs)
        try:
            _compare(guarded(*copy.deepcopy(args), **kwargs), want, rtol, atol)
            results.append(CaseResult(name, True, _with_said("matches", said)))
        except Exception as error:  # the student's code may raise anything
            results.append(CaseResult(name, False, _with_said(_failure(error), said)))
    title = (f"{getattr(candidate, '__name__', 'candidate')}: checked against "
             f"{getattr(reference, '__qualname__', 'the reference')}")
    return GradeReport(title, results)


_MISSING = object()
_PRISTINE = _pristine_state()
