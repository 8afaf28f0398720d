"""Linear (affine) layer: y = x @ w + b, with GPT-2's (in, out) weight layout.

Book: chapter 8, "The linear layer".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape


def linear_forward(x, w, b):
    """x (..., C_in), w (C_in, C_out), b (C_out,) -> y (..., C_out)."""
    array_namespace(x, w, b)  # one array library for all three, or a TypeError
    for name, a in (("x", x), ("w", w), ("b", b)):
        require_float(name, a)
    require_shape("w", w, (x.shape[-1], None))
    require_shape("b", b, (w.shape[1],))
    y = x @ w + b  # (..., C_out)
    return y, (x, w)


def linear_backward(dy, cache):
    """dy (..., C_out) -> (dx (..., C_in), dw (C_in, C_out), db (C_out,))."""
    xp = array_namespace(dy)
    x, w = cache
    C_in, C_out = w.shape
    # y = x @ w + b
    dx = dy @ w.mT  # (..., C_in)
    dw = xp.reshape(x, (-1, C_in)).mT @ xp.reshape(dy, (-1, C_out))  # (C_in, C_out)
    db = xp.sum(xp.reshape(dy, (-1, C_out)), axis=0)  # (C_out,)
    return dx, dw, db
