"""Inverted dropout (Srivastava et al., 2014) with a seeded mask.

    mask = (uniform(seed) >= p),  y = x * mask / (1 - p)

The mask is a pure function of ``seed``, so a run that is stopped and resumed draws the same
masks. Book: chapter 9, "Dropout".
"""

from __future__ import annotations

from ..backend import array_namespace, uniform
from ..checks import require_float


def dropout_forward(x, *, p: float, seed: int):
    """x (...) -> y (...). Zeroes each element with probability p, scales the rest by 1/(1-p)."""
    xp = array_namespace(x)
    require_float("x", x)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability p must be in [0, 1), got {p!r}")
    keep = xp.astype(uniform(tuple(x.shape), seed, like=x) >= p, x.dtype)  # (...)
    scale = keep / (1.0 - p)  # (...)
    y = x * scale  # (...)
    return y, (scale,)


def dropout_backward(dy, cache):
    """dy (...) -> (dx (...),)."""
    (scale,) = cache
    # y = x * mask / (1 - p)
    dx = dy * scale  # (...)
    return (dx,)
