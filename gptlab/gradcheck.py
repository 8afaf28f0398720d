"""Gradient checks: a hand-written backward against an oracle, with the reports the book shows.

Every layer follows the contract ``forward(*arrays, **hyperparams) -> (out, cache)``,
``backward(dout, cache) -> grads``. To check a backward we pick a fake loss

    F = sum(out * dout),   dout random normal (fixed by ``seed``),

so that dF/dout = dout and ``backward(dout, cache)`` must return dF/d(input) for every float
input. Two oracles give the same gradients independently:

- ``"finite_differences"``: dF/dx_j ~ (F(x + eps e_j) - F(x - eps e_j)) / (2 eps), element by
  element, in float64 on the backend and device of the inputs;
- ``"autograd"``: the same forward run on torch float64 tensors, differentiated by
  ``torch.autograd`` (the layers are array-API code, so torch records every operation).

The figure of merit compares the analytic gradient a with the numeric one n over the checked
elements of one input x:

    error = ||a - n|| / max(||a|| + ||n||, FLOOR * s),   s = ||dout|| * ||out|| / max(||x||, 1)

and anything below 1e-7 is a pass. Where the gradients have their usual size this is the
relative error ||a - n|| / (||a|| + ||n||): in float64 a correct formula gives about 1e-8 or less,
a wrong one (a dropped transpose, a missing term) an error of order 1. s is the size a gradient of
x has when F, at most ||dout|| * ||out||, changes by about that much as x moves by its own size
(taken as at least 1, so that an all-zero bias still has a scale). The floor FLOOR * s = 0.01 s
keeps the error meaningful where the true gradient is zero or tiny: there both sides are
round-off (for one causal query the flash backward returns 1e-17 where autograd returns 0), and
their relative error would be of order 1 however right the formula. With the floor an input
passes when

    ||a - n|| < 1e-7 * (||a|| + ||n||)   or   ||a - n|| < 1e-9 * s,

torch.autograd.gradcheck's |a - n| <= atol + rtol * |n| in norms, with an atol scaled to the
layer. Why 0.01: finite differences carry an error of about 1e-10 s (the round-off of F divided
by the step), which a zero gradient must pass with room to spare. The floor acts only on
gradients a hundred times smaller than s, and no layer of the table has one besides its exact
zeros (tests/test_layers.py checks that), so it is no weaker where it matters: an all-zero
analytic gradient against a true one above 1e-9 s fails, and every wrong formula of the book
fails with the same error of order one as before.

Book: chapter 5, "Checking a gradient".
"""

from __future__ import annotations

import html
import inspect
from dataclasses import dataclass

import numpy as np
from array_api_compat import is_array_api_obj, is_torch_array

from .backend import array_namespace, asarray_like, convert, is_floating, to_numpy
from .model import gpt_backward, gpt_forward

TOLERANCE = 1e-7
FLOOR = 1e-2  # the error's denominator is at least FLOOR * s (see above)
ORACLES = ("finite_differences", "autograd")

__all__ = ["FLOOR", "TOLERANCE", "GradcheckEntry", "GradcheckResult", "below", "check_layer",
           "check_model"]


def format_float(x: float) -> str:
    """A tolerance or an error far above round-off: two significant digits, e.g. "1e-07"."""
    return f"{x:.2g}"


def below(value: float, bound: float) -> str:
    """``"below 1e-09"``, after asserting ``value < bound``: how the book prints a round-off-sized
    number. Its digits differ from one CPU to the next; the bound does not."""
    if not value < bound:
        raise AssertionError(f"{value!r} is not below {format_float(bound)}")
    return f"below {format_float(bound)}"


def _shown_error(error: float, tol: float) -> str:
    """A passing error as the bound it passed (``< 1e-07``), a failing one with its digits."""
    return f"< {format_float(tol)}" if error < tol else format_float(error)


@dataclass(frozen=True, eq=False)
class GradcheckEntry:
    """One checked input: analytic and numeric gradient (float64, the input's shape), the
    boolean ``mask`` of the elements that were checked and the gradient scale
    s = ||dout|| * ||out|| / max(||x||, 1) of the floor (0: no floor)."""

    name: str
    analytic: np.ndarray
    numeric: np.ndarray
    mask: np.ndarray
    scale: float = 0.0

    @property
    def rel_error(self) -> float:
        """||a - n|| / max(||a|| + ||n||, FLOOR * s, 1e-300) over the checked elements."""
        a, n = self.analytic[self.mask], self.numeric[self.mask]
        size = np.linalg.norm(a) + np.linalg.norm(n)
        return float(np.linalg.norm(a - n) / max(size, FLOOR * self.scale, 1e-300))

    @property
    def max_abs_error(self) -> float:
        diff = np.abs(self.analytic[self.mask] - self.numeric[self.mask])
        return float(np.max(diff)) if diff.size else 0.0

    def passed(self, tol: float = TOLERANCE) -> bool:
        return self.rel_error < tol


class GradcheckResult:
    """The outcome of a gradient check: one :class:`GradcheckEntry` per float input."""

    def __init__(self, entries: list[GradcheckEntry], oracle: str):
        self.entries = list(entries)
        self.oracle = oracle

    def entry(self, name: str) -> GradcheckEntry:
        for entry in self.entries:
            if entry.name == name:
                return entry
        raise KeyError(f"no input named {name!r}; checked inputs: {self.names}")

    @property
    def names(self) -> list[str]:
        return [entry.name for entry in self.entries]

    def rel_error(self, name: str) -> float:
        """||a - n|| / max(||a|| + ||n||, FLOOR * s) over the checked elements of ``name``."""
        return self.entry(name).rel_error

    def max_abs_error(self, name: str) -> float:
        return self.entry(name).max_abs_error

    @property
    def worst(self) -> float:
        """The largest relative error over all inputs."""
        return max((entry.rel_error for entry in self.entries), default=0.0)

    def passed(self, tol: float = TOLERANCE) -> bool:
        return all(entry.passed(tol) for entry in self.entries)

    def assert_ok(self, tol: float = TOLERANCE) -> None:
        """Raise AssertionError, with the per-input table, unless every input passes."""
        if not self.passed(tol):
            failed = [entry.name for entry in self.entries if not entry.passed(tol)]
            raise AssertionError(
                f"gradient check failed for {failed} (tolerance {format_float(tol)}):\n{self._table(tol)}"
            )

    def error_map(self, name: str) -> np.ndarray:
        """Element-wise |a - n| / (max(|a|, |n|) + tiny), the input's shape, NaN where unchecked."""
        entry = self.entry(name)
        a, n = entry.analytic, entry.numeric
        err = np.abs(a - n) / (np.maximum(np.abs(a), np.abs(n)) + np.finfo(np.float64).tiny)
        return np.where(entry.mask, err, np.nan)

    def as_rows(self, tol: float = TOLERANCE) -> list[dict]:
        """One dict per input: name, shape, checked (count), rel_error, max_abs_error, passed."""
        return [
            {
                "input": entry.name,
                "shape": tuple(entry.analytic.shape),
                "checked": int(np.sum(entry.mask)),
                "rel_error": entry.rel_error,
                "max_abs_error": entry.max_abs_error,
                "passed": entry.passed(tol),
            }
            for entry in self.entries
        ]

    def _display_rows(self, tol: float) -> list[tuple[str, str, str, str, str]]:
        """(input, shape, rel. error, max abs error, PASS/FAIL) as shown: a passing row shows the
        bound it passed, not its round-off digits, so the report reads the same on every CPU."""
        return [
            (row["input"], str(row["shape"]), _shown_error(row["rel_error"], tol),
             "" if row["passed"] else format_float(row["max_abs_error"]),
             "PASS" if row["passed"] else "FAIL")
            for row in self.as_rows(tol)
        ]

    def _table(self, tol: float = TOLERANCE) -> str:
        rows = [("input", "shape", "rel. error", "max abs error", "result")]
        rows += self._display_rows(tol)
        widths = [max(len(row[k]) for row in rows) for k in range(4)]
        oracle = self.oracle.replace("_", " ")
        lines = [f"gradient check against {oracle} (pass: rel. error < {format_float(tol)})"]
        for name, shape, rel, abs_err, verdict in rows:
            lines.append(f"{name:<{widths[0]}}  {shape:<{widths[1]}}  {rel:>{widths[2]}}  "
                         f"{abs_err:>{widths[3]}}  {verdict}".rstrip())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self._table()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        pad = 'style="padding:0.15em 0.8em"'
        cells = []
        for name, shape, rel, abs_err, verdict in self._display_rows(TOLERANCE):
            color = "#1a7f37" if verdict == "PASS" else "#cf222e"
            cells.append(
                f"<tr><td {pad}><code>{html.escape(name)}</code></td>"
                f"<td {pad}>{html.escape(shape)}</td>"
                f"<td {pad} align=\"right\">{html.escape(rel)}</td>"
                f"<td {pad} align=\"right\">{abs_err}</td>"
                f"<td {pad}><b style=\"color:{color}\">{verdict}</b></td></tr>"
            )
        oracle = html.escape(self.oracle.replace("_", " "))
        return (
            '<table class="gradcheck" style="border-collapse:collapse">'
            f"<caption>gradient check against {oracle} (pass: rel. error &lt; {format_float(TOLERANCE)})"
            "</caption>"
            "<thead><tr><th>input</th><th>shape</th><th>rel. error</th><th>max abs error</th>"
            "<th>result</th></tr></thead>"
            f"<tbody>{''.join(cells)}</tbody></table>"
        )

    def plot_error_map(self, name: str, ax=None):
        """Show ``error_map(name)`` on a log color scale: 1-D inputs as one row, N-D inputs with
        their leading axes flattened into rows. Unchecked elements stay blank. Returns the axes."""
        import matplotlib.pyplot as plt
        from matplotlib.colors import LogNorm
        from matplotlib.ticker import MaxNLocator

        err = self.error_map(name)
        rows = err.reshape(1, -1) if err.ndim <= 1 else err.reshape(-1, err.shape[-1])
        if ax is None:
            width = min(2.0 + 0.4 * rows.shape[1], 10.0)
            _, ax = plt.subplots(figsize=(width, 1.5 + 0.3 * rows.shape[0]))
        floor = 1e-16  # an exact match would be log(0)
        image = ax.imshow(
            np.ma.masked_invalid(np.clip(rows, floor, None)),
            norm=LogNorm(vmin=floor, vmax=1.0, clip=True),
            cmap="viridis",
            aspect="auto",
            interpolation="nearest",
        )
        ax.figure.colorbar(image, ax=ax, label="|a - n| / max(|a|, |n|)")
        ax.set_title(f"{name} {tuple(err.shape)}: element-wise relative error")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(f"index along axis {max(err.ndim - 1, 0)}")
        if err.ndim <= 1:
            ax.set_yticks([])
        else:
            ax.set_ylabel("index along axis 0" if err.ndim == 2 else "leading axes, flattened")
        return ax


# ---------------------------------------------------------------------------------------------
# The inputs of a forward as a flat list of "leaves": (name, position, key). ``key`` is None for
# an array argument and the dict key for an entry of a dict-of-arrays argument.


def _input_names(forward, n: int) -> list[str]:
    """Names of the first ``n`` positional parameters of ``forward`` (``arg{i}`` where unknown)."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        params = []
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    names = [p.name for p in params if p.kind in positional][:n]
    return names + [f"arg{i}" for i in range(len(names), n)]


def _is_float_array(x) -> bool:
    return is_array_api_obj(x) and is_floating(x)


def _checked_positions(args) -> list[int]:
    """Positions of the arguments that get a gradient: float arrays and dicts of arrays."""
    return [pos for pos, a in enumerate(args) if isinstance(a, dict) or _is_float_array(a)]


def _leaves(args, names) -> list[tuple[str, int, str | None]]:
    """(name, position, key) for every checked array, in forward order."""
    leaves = []
    for pos in _checked_positions(args):
        if isinstance(args[pos], dict):
            leaves.extend((f"{names[pos]}[{key}]", pos, key) for key in args[pos])
        else:
            leaves.append((names[pos], pos, None))
    return leaves


def _get(args, pos, key):
    return args[pos] if key is None else args[pos][key]


def _replace(args, pos, key, value) -> tuple:
    """``args`` with one leaf replaced (dict arguments are copied, never mutated)."""
    new = list(args)
    new[pos] = value if key is None else {**args[pos], key: value}
    return tuple(new)


def _map_arrays(args, fn) -> tuple:
    """Apply ``fn`` to every array argument and to every entry of every dict argument."""

    def one(a):
        return fn(a) if is_array_api_obj(a) else a

    return tuple({k: one(v) for k, v in a.items()} if isinstance(a, dict) else one(a) for a in args)


def _to_float64(a):
    """Float arrays to float64 copies on their own backend and device; other arrays unchanged."""
    if not _is_float_array(a):
        return a
    xp = array_namespace(a)
    return xp.astype(a, xp.float64)


def _run_forward(forward, args, hyperparams):
    result = forward(*args, **hyperparams)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError("forward must return a pair (out, cache)")
    return result


def _fake_loss(out, dout) -> float:
    """F = sum(out * dout) as a Python float."""
    xp = array_namespace(out)
    return float(to_numpy(xp.sum(out * dout)))


def _make_dout(out, dout, seed: int):
    """dout like ``out`` (backend, device, float64), random normal unless given; a Python float
    for a scalar output."""
    if dout is None:
        dout = np.random.default_rng(seed).standard_normal(tuple(out.shape))
    host = np.asarray(to_numpy(dout) if is_array_api_obj(dout) else dout, dtype=np.float64)
    if host.shape != tuple(out.shape):
        raise ValueError(f"dout has shape {host.shape}, but the output has {tuple(out.shape)}")
    return float(host) if host.ndim == 0 else asarray_like(host, out)


def _norm(a) -> float:
    """The Euclidean norm of an array (any backend) or a Python float, as a float."""
    return float(np.linalg.norm(np.asarray(to_numpy(a) if is_array_api_obj(a) else a,
                                           dtype=np.float64)))


def _gradient_scale(out, dout, x) -> float:
    """s = ||dout|| * ||out|| / max(||x||, 1): the size of a typical gradient of x."""
    return _norm(dout) * _norm(out) / max(_norm(x), 1.0)


def _analytic(backward, dout, cache, args, names, leaves) -> list[np.ndarray]:
    """Run ``backward`` and check its grads: one per float (or dict) input, each of its shape."""
    positions = _checked_positions(args)
    grads = backward(dout, cache)
    if isinstance(grads, (tuple, list)):  # an optional input left out (a bias) has grad None
        while len(grads) > len(positions) and grads[-1] is None:
            grads = grads[:-1]
    if not isinstance(grads, (tuple, list)) or len(grads) != len(positions):
        got = len(grads) if isinstance(grads, (tuple, list)) else f"a {type(grads).__name__}"
        raise ValueError(
            f"backward must return a tuple with one gradient per float input "
            f"({', '.join(names[pos] for pos in positions)}): {len(positions)} expected, got {got}"
        )
    grads = dict(zip(positions, grads))
    analytic = []
    for name, pos, key in leaves:
        grad = grads[pos]
        if key is not None:
            grad = grad.get(key) if isinstance(grad, dict) else None
        x = _get(args, pos, key)
        if not is_array_api_obj(grad):
            raise ValueError(f"backward gave no gradient array for {name} (got {grad!r:.40})")
        if tuple(grad.shape) != tuple(x.shape):
            raise ValueError(
                f"the gradient for {name} has shape {tuple(grad.shape)}, expected {tuple(x.shape)}"
            )
        analytic.append(np.asarray(to_numpy(grad), dtype=np.float64))
    return analytic


def _finite_differences(forward, args, hyperparams, dout, leaves, eps, max_elements, seed,
                        richardson) -> list[tuple[np.ndarray, np.ndarray]]:
    """Central differences of F, element by element, for each leaf -> [(numeric, mask)]."""
    results = []
    for index, (_, pos, key) in enumerate(leaves):
        x = _get(args, pos, key)
        host = np.array(to_numpy(x), dtype=np.float64)  # a copy, perturbed one element at a time

        def F(j, value):
            """F with element j of this input set to ``value``."""
            saved = host.flat[j]
            host.flat[j] = value
            out, _ = _run_forward(forward, _replace(args, pos, key, asarray_like(host, x)),
                                  hyperparams)
            loss = _fake_loss(out, dout)
            host.flat[j] = saved
            return loss

        def central(j, h):
            """(F(x + h e_j) - F(x - h e_j)) / (2 h) = dF/dx_j + c h^2 + O(h^4)."""
            return (F(j, host.flat[j] + h) - F(j, host.flat[j] - h)) / (2.0 * h)

        mask = np.zeros(host.shape, dtype=bool)
        if max_elements is None or max_elements >= host.size:
            mask[...] = True
        else:
            rng = np.random.default_rng([seed, index])
            mask.flat[rng.choice(host.size, max_elements, replace=False)] = True
        numeric = np.zeros_like(host)
        for j in np.flatnonzero(mask):
            numeric.flat[j] = central(j, eps)
            if richardson:  # cancel the h^2 term: (4 D(h) - D(2h)) / 3 = dF/dx_j + O(h^4)
                numeric.flat[j] = (4.0 * numeric.flat[j] - central(j, 2.0 * eps)) / 3.0
        results.append((numeric, mask))
    return results


def _autograd(forward, args, hyperparams, dout, leaves) -> list[tuple[np.ndarray, np.ndarray]]:
    """dF/d(input) by torch.autograd through the same forward on float64 tensors."""
    import torch

    def to_torch(a):
        return convert(a, "torch", dtype="float64", device=a.device if is_torch_array(a) else None)

    targs = _map_arrays(args, to_torch)
    inputs = [_get(targs, pos, key).requires_grad_(True) for _, pos, key in leaves]
    with torch.enable_grad():
        out, _ = _run_forward(forward, targs, hyperparams)
        tdout = dout if isinstance(dout, float) else to_torch(dout)
        grads = torch.autograd.grad(torch.sum(out * tdout), inputs, allow_unused=True)
    results = []
    for x, g in zip(inputs, grads):  # an input F does not depend on gets None: a zero gradient
        numeric = np.zeros(tuple(x.shape)) if g is None else g.detach().cpu().numpy()
        results.append((numeric, np.ones(tuple(x.shape), dtype=bool)))
    return results


def check_layer(forward, backward, *args, oracle: str = "finite_differences", eps: float = 1e-6,
                seed: int = 0, dout=None, max_elements: int | None = None,
                richardson: bool = False, **hyperparams) -> GradcheckResult:
    """Check ``backward`` against an oracle at the inputs ``args``, on F = sum(out * dout).

    ``args``: the forward's positional inputs (NumPy, torch or array_api_strict arrays on any
    device, or dicts of arrays). Float inputs are cast to float64 on their own backend and
    checked; integer inputs pass through unchecked. ``hyperparams`` go to ``forward`` as keywords.
    ``dout``: random normal from ``seed`` unless given (a float for a scalar output).
    Finite differences only: ``eps`` the step, ``max_elements`` checks a seeded random subset of
    each input's elements, ``richardson=True`` combines the steps eps and 2 eps to cancel the
    O(eps^2) error (four evaluations per element instead of two).
    A hyperparameter that shares a name with these options (dropout's ``seed``) is bound first:
    ``check_layer(functools.partial(dropout_forward, seed=3), dropout_backward, x, p=0.1)``.
    """
    if not callable(forward):
        raise ValueError(f"forward must be callable, got {type(forward).__name__}")
    if not callable(backward):
        raise ValueError(f"backward must be callable, got {type(backward).__name__}")
    if oracle not in ORACLES:
        raise ValueError(f"oracle must be one of {ORACLES}, got {oracle!r}")
    names = _input_names(forward, len(args))
    args = _map_arrays(args, _to_float64)
    leaves = _leaves(args, names)
    out, cache = _run_forward(forward, args, hyperparams)
    dout = _make_dout(out, dout, seed)
    analytic = _analytic(backward, dout, cache, args, names, leaves)
    if oracle == "finite_differences":
        numeric = _finite_differences(forward, args, hyperparams, dout, leaves, eps, max_elements,
                                      seed, richardson)
    else:
        numeric = _autograd(forward, args, hyperparams, dout, leaves)
    entries = [
        GradcheckEntry(name, a, n, mask, _gradient_scale(out, dout, _get(args, pos, key)))
        for (name, pos, key), a, (n, mask) in zip(leaves, analytic, numeric)
    ]
    return GradcheckResult(entries, oracle)


def _gpt_loss(params, idx, targets, *, cfg):
    """The whole GPT as one layer: (params, idx, targets) -> (loss, cache)."""
    _, loss, cache = gpt_forward(params, idx, cfg, targets)
    return loss, cache


def _gpt_loss_backward(dloss, cache):
    """dloss (a scalar) -> ({name: dparam},)."""
    grads = gpt_backward(cache)
    return ({name: dloss * g for name, g in grads.items()},)


MODEL_EPS = 3e-4


def check_model(params: dict, idx, targets, cfg, oracle: str = "autograd", max_elements: int = 20,
                seed: int = 0) -> GradcheckResult:
    """Check ``gpt_backward`` for every parameter, by name, on the loss of
    ``gpt_forward(params, idx, cfg, targets)`` in float64.

    Autograd checks every element. Finite differences check a seeded subset of ``max_elements``
    elements of each parameter, with the Richardson-extrapolated central difference at step
    ``MODEL_EPS``: at GPT-2's initialisation the gradients span four orders of magnitude (LayerNorm
    gains ~1e-4, biases feeding the residual stream ~1), and no single step of the plain central
    difference resolves both to 1e-7 (its roundoff error buries the small ones, its O(eps^2)
    error the sharply curved ones); the O(eps^4) formula does, with room to spare.
    """
    result = check_layer(
        _gpt_loss, _gpt_loss_backward, params, idx, targets, oracle=oracle, seed=seed, dout=1.0,
        eps=MODEL_EPS, richardson=True, max_elements=max_elements, cfg=cfg,
    )
    entries = [GradcheckEntry(name, e.analytic, e.numeric, e.mask, e.scale)
               for name, e in zip(params, result.entries)]
    return GradcheckResult(entries, oracle)
