"""Layer normalization (Ba, Kiros and Hinton, 2016) with a learned gain w and bias b.

    mean = x.mean(-1),  var = ((x - mean)**2).mean(-1),  rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd,  y = xhat * w + b

``b=None`` drops the bias (y = xhat * w, nanoGPT's ``bias=False``); the backward then returns
db = None.

Book: chapter 8, "LayerNorm, backward".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape


def layernorm_forward(x, w, b=None, *, eps: float = 1e-5):
    """x (..., C), w (C,), b (C,) or None -> y (..., C). Normalizes over the last axis."""
    named = {"x": x, "w": w} if b is None else {"x": x, "w": w, "b": b}
    xp = array_namespace(*named.values())
    for name, a in named.items():
        require_float(name, a)
    C = x.shape[-1]
    require_shape("w", w, (C,))
    if b is not None:
        require_shape("b", b, (C,))
    mean = xp.mean(x, axis=-1, keepdims=True)  # (..., 1)
    xc = x - mean  # (..., C)
    var = xp.mean(xc * xc, axis=-1, keepdims=True)  # (..., 1) biased variance, as GPT-2
    rstd = 1.0 / xp.sqrt(var + eps)  # (..., 1)
    xhat = xc * rstd  # (..., C)
    y = xhat * w if b is None else xhat * w + b  # (..., C)
    return y, (xhat, w, rstd, b is not None)


def layernorm_backward(dy, cache):
    """dy (..., C) -> (dx (..., C), dw (C,), db (C,) or None).

    The compact form: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),
    which folds the gradient through the mean and through the variance into two averages.
    """
    xp = array_namespace(dy)
    xhat, w, rstd, has_bias = cache
    C = dy.shape[-1]
    # y = xhat * w + b
    dw = xp.sum(xp.reshape(dy * xhat, (-1, C)), axis=0)  # (C,)
    db = xp.sum(xp.reshape(dy, (-1, C)), axis=0) if has_bias else None  # (C,)
    dxhat = dy * w  # (..., C)
    # xhat = (x - mean) * rstd, with mean and rstd themselves functions of x
    mean_dxhat = xp.mean(dxhat, axis=-1, keepdims=True)  # (..., 1)
    mean_dxhat_xhat = xp.mean(dxhat * xhat, axis=-1, keepdims=True)  # (..., 1)
    dx = rstd * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)  # (..., C)
    return dx, dw, db
