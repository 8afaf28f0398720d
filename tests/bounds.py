"""Derived bounds on round-off, for the tests that compare float results computed two ways.

Two computations of one value in float32 (or bfloat16, float16) that add in another order, with
other kernels or on another number of processes agree only to round-off. Such a test asserts a
bound derived from the computation, never a number read off one CPU:

    |a - b| <= steps * terms * eps * scale

- ``eps``: the dtype's machine epsilon (float32 2^-23, bfloat16 2^-7, float16 2^-10);
- ``terms``: the longest sum that makes one value (each addition, in another order, may move the
  result by eps times the running sum);
- ``steps``: how many such computations feed one another (layers, updates);
- ``scale``: the size of what is summed (the largest reference value, or a learning rate).

It is a worst case: round-off of random sign grows about as the square root of the count, so
measured differences sit well below it.

``make test`` runs every such comparison (the tests marked ``roundoff``) again under another CPU's
kernels and thread count with ``GPTLAB_BOUND_MARGIN=4``: there each difference must stay below a
quarter of its bound, so a bound that only one CPU meets fails on the developer's machine first.
With ``GPTLAB_BOUND_RECORD=FILE`` each comparison appends its largest difference and its bound to
FILE, one JSON object a line (``tools/bound_table.py`` makes docs/TOLERANCES.md's table of them).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

EPS = {"float64": 2.0**-52, "float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}


@dataclass(frozen=True)
class Bound:
    """A bound on the largest |a - b| and the one line that derives it."""

    value: float
    derivation: str

    def times(self, scale: float, what: str) -> Bound:
        """The bound for values of size ``scale`` (``what`` names it in the derivation)."""
        return Bound(self.value * scale, f"{self.derivation} x {what}")


def roundoff(dtype: str, terms: int, *, steps: int = 1, scale: float = 1.0, why: str) -> Bound:
    """steps * terms * eps(dtype) * scale; ``why`` says where the terms and steps come from."""
    value = steps * terms * EPS[dtype] * scale
    factors = [f"{steps} steps"] if steps != 1 else []
    factors += [f"{terms} terms", f"eps({dtype})"] + ([f"{scale:g}"] if scale != 1.0 else [])
    return Bound(value, f"{' x '.join(factors)} ({why})")


def margin() -> float:
    """How far below its bound a difference must stay in this run (GPTLAB_BOUND_MARGIN, 1)."""
    return float(os.environ.get("GPTLAB_BOUND_MARGIN", "1"))


def largest_difference(got, want) -> float:
    """max |got - want| in float64 (arrays, tensors on any device, lists or numbers)."""
    if hasattr(got, "detach"):
        got = got.detach().double().cpu().numpy()
    if hasattr(want, "detach"):
        want = want.detach().double().cpu().numpy()
    difference = np.abs(np.asarray(got, dtype=np.float64) - np.asarray(want, dtype=np.float64))
    return float(np.max(difference)) if difference.size else 0.0


def record(difference: float, bound: Bound, label: str) -> None:
    """Append the comparison to GPTLAB_BOUND_RECORD's file, where that is set."""
    path = os.environ.get("GPTLAB_BOUND_RECORD")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"test": test, "label": label, "difference": difference,
                                "bound": bound.value, "derivation": bound.derivation}) + "\n")


def assert_within(got, want, bound: Bound, label: str, detail: str = "") -> None:
    """max |got - want| <= bound.value / margin(); ``label`` names the comparison in the table of
    bounds, ``detail`` (a parameter's name, a rank) only the failure message."""
    difference = largest_difference(got, want)
    record(difference, bound, label)
    allowed = bound.value / margin()
    where = f"{label} {detail}".strip()
    assert difference <= allowed, (
        f"{where}: difference {difference:.3g} above {allowed:.3g} (bound {bound.value:.3g}"
        f" / margin {margin():g}; {bound.derivation})")


def assert_relative(got, want, bound: Bound, label: str, detail: str = "") -> None:
    """assert_within with the bound scaled by the largest |want| (the reference's size)."""
    scale = max(largest_difference(want, 0.0), 1e-30)
    assert_within(got, want, bound.times(scale, "max|reference|"), label, detail)


def model_roundoff(cfg, B: int, T: int, dtype: str = "float32", *, updates: int = 1) -> Bound:
    """A GPT's loss or gradients computed two ways, relative to their size: the longest sum is
    over B * T rows (a weight's gradient), the MLP's hidden units, q, k and v's 3C columns (the
    gradient of the attention's input), V logits or T keys; 2 n_layer + 2 steps a pass (each
    block's forward and backward, the embedding and the head), in each of ``updates`` updates."""
    terms = max(B * T, cfg.mlp_hidden_size, 3 * cfg.n_embd, cfg.vocab_size, T)
    return roundoff(dtype, terms, steps=(2 * cfg.n_layer + 2) * updates,
                    why=f"{cfg.n_layer} layers, {B}x{T} tokens, {updates} update(s)")


def bfloat16_pass(n_layer: int, *, backward: bool) -> Bound:
    """A GPT's pass in bfloat16 with float32 accumulation against float32 or float64, relative:
    a result carries one rounding to bfloat16 for each bfloat16 output it passes through, 8 a
    block forward (two norms, q/k/v, attention, its projection, the MLP's two products, GELU),
    as many backward, and 2 more (the embedding and the head)."""
    per_block = 16 if backward else 8
    return roundoff("bfloat16", 1, steps=per_block * n_layer + 2,
                    why=f"bfloat16 outputs a {'forward and backward' if backward else 'forward'} "
                    f"pass of {n_layer} layer(s) goes through")
