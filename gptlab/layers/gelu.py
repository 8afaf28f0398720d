"""GELU (Hendrycks and Gimpel, 2016): x * Phi(x), Phi the standard normal CDF.

    exact ("none"): y = 0.5 * x * (1 + erf(x / sqrt(2)))
    tanh (GPT-2):   y = 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))

Book: chapter 8, "GELU".
"""

from __future__ import annotations

import math

from ..backend import array_namespace, erf
from ..checks import require_float

GELU_APPROXIMATIONS = ("tanh", "none")
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
GELU_CUBIC = 0.044715  # the coefficient of x^3 in the tanh form


def _check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")


def gelu_forward(x, *, approximate: str = "tanh"):
    """x (...) -> y (...). ``approximate='tanh'`` as GPT-2, ``'none'`` for the erf form."""
    xp = array_namespace(x)
    require_float("x", x)
    _check_approximate(approximate)
    if approximate == "tanh":
        u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x**3)  # (...)
        phi = 0.5 * (1.0 + xp.tanh(u))  # (...)
    else:
        phi = 0.5 * (1.0 + erf(x * INV_SQRT_2))  # (...)
    y = x * phi  # (...)
    return y, (x, phi, approximate)


def gelu_backward(dy, cache):
    """dy (...) -> (dx (...),)."""
    xp = array_namespace(dy)
    x, phi, approximate = cache
    if approximate == "tanh":
        # y = 0.5 * x * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
        tanh_u = 2.0 * phi - 1.0  # (...)
        du_dx = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x * x)  # (...)
        dphi_dx = 0.5 * (1.0 - tanh_u * tanh_u) * du_dx  # (...)
    else:
        # y = x * Phi(x),  Phi'(x) = exp(-x^2 / 2) / sqrt(2 pi)
        dphi_dx = INV_SQRT_2PI * xp.exp(-0.5 * x * x)  # (...)
    dx = dy * (phi + x * dphi_dx)  # (...)
    return (dx,)
