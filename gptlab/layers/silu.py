"""SiLU, the sigmoid-weighted linear unit (Elfwing et al., 2018; "Swish" with beta = 1, Ramachandran
et al., 2017): the gate of SwiGLU (swiglu.py).

    s = sigmoid(x) = 1 / (1 + exp(-x)),  y = x * s

Like GELU's x * Phi(x), it weighs x by a smooth step, here the logistic one. With
sigmoid' = s * (1 - s) the backward is

    dx = dy * (s + x * s * (1 - s)) = dy * s * (1 + x * (1 - s))

The sigmoid is computed from exp(-|x|), which never overflows: for x < 0,
1 / (1 + exp(-x)) = exp(x) / (1 + exp(x)).

Book: chapter 17, "Today's blocks", "SwiGLU".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float


def silu_forward(x):
    """x (...) -> y (...) = x * sigmoid(x)."""
    xp = array_namespace(x)
    require_float("x", x)
    e = xp.exp(-xp.abs(x))  # (...) in (0, 1]
    s = xp.where(x >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))  # (...) sigmoid(x)
    y = x * s  # (...)
    return y, (x, s)


def silu_backward(dy, cache):
    """dy (...) -> (dx (...),)."""
    x, s = cache
    # y = x * s,  s = sigmoid(x),  ds/dx = s * (1 - s)
    dx = dy * s * (1.0 + x * (1.0 - s))  # (...)
    return (dx,)
