"""Linear (affine) layer: y = x @ w + b, with GPT-2's (in, out) weight layout.

``b=None`` drops the bias (y = x @ w, nanoGPT's ``bias=False``); the backward then returns
db = None.

Book: chapter 8, "The linear layer".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape


def linear_forward(x, w, b=None):
    """x (..., C_in), w (C_in, C_out), b (C_out,) or None -> y (..., C_out)."""
    named = {"x": x, "w": w} if b is None else {"x": x, "w": w, "b": b}
    array_namespace(*named.values())  # one array library for all of them, or a TypeError
    for name, a in named.items():
        require_float(name, a)
    require_shape("w", w, (x.shape[-1], None))
    if b is not None:
        require_shape("b", b, (w.shape[1],))
    y = x @ w if b is None else x @ w + b  # (..., C_out)
    return y, (x, w, b is not None)


def linear_backward(dy, cache):
    """dy (..., C_out) -> (dx (..., C_in), dw (C_in, C_out), db (C_out,) or None)."""
    xp = array_namespace(dy)
    x, w, has_bias = cache
    C_in, C_out = w.shape
    # y = x @ w + b
    dx = dy @ w.mT  # (..., C_in)
    dw = xp.reshape(x, (-1, C_in)).mT @ xp.reshape(dy, (-1, C_out))  # (C_in, C_out)
    db = xp.sum(xp.reshape(dy, (-1, C_out)), axis=0) if has_bias else None  # (C_out,)
    return dx, dw, db
