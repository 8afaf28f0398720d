"""ReLU: y = max(x, 0), the activation of the original transformer's feed-forward layer.

Book: chapter 8, "GELU vs ReLU".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float


def relu_forward(x):
    """x (...) -> y (...)."""
    xp = array_namespace(x)
    require_float("x", x)
    y = xp.where(x > 0, x, 0.0)  # (...)
    return y, (x,)


def relu_backward(dy, cache):
    """dy (...) -> (dx (...),). The subgradient at 0 is taken as 0."""
    xp = array_namespace(dy)
    (x,) = cache
    # y = where(x > 0, x, 0)
    dx = xp.where(x > 0, dy, 0.0)  # (...)
    return (dx,)
