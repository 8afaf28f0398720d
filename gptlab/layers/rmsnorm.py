"""RMS normalization (Zhang and Sennrich, 2019; LLaMA, Touvron et al., 2023) with a learned gain w.

    rstd = 1 / sqrt(mean(x**2) + eps),  xhat = x * rstd,  y = xhat * w

LayerNorm without its two shifts: no mean is subtracted and there is no bias, so a row is
rescaled to root-mean-square 1 (up to eps) and then multiplied by the gain. The backward, in the
compact form of LayerNorm's (layernorm.py), loses the average that came from the mean:

    LayerNorm:  dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    RMSNorm:    dx = rstd * (dxhat               - xhat * mean(dxhat * xhat))

with dxhat = dy * w: the first term is the gradient through x at fixed rstd, the second the
gradient through rstd, d rstd / dx_j = -rstd**3 * x_j / C.

eps defaults to LLaMA's 1e-6 (Hugging Face's ``rms_norm_eps``; Llama 2 uses 1e-5).

Book: chapter 17, "Today's blocks", "RMSNorm".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape


def rmsnorm_forward(x, w, *, eps: float = 1e-6):
    """x (..., C), w (C,) -> y (..., C). Normalizes over the last axis."""
    xp = array_namespace(x, w)
    require_float("x", x)
    require_float("w", w)
    C = x.shape[-1]
    require_shape("w", w, (C,))
    ms = xp.mean(x * x, axis=-1, keepdims=True)  # (..., 1) mean square
    rstd = 1.0 / xp.sqrt(ms + eps)  # (..., 1)
    xhat = x * rstd  # (..., C)
    y = xhat * w  # (..., C)
    return y, (xhat, w, rstd)


def rmsnorm_backward(dy, cache):
    """dy (..., C) -> (dx (..., C), dw (C,))."""
    xp = array_namespace(dy)
    xhat, w, rstd = cache
    C = dy.shape[-1]
    # y = xhat * w
    dw = xp.sum(xp.reshape(dy * xhat, (-1, C)), axis=0)  # (C,)
    dxhat = dy * w  # (..., C)
    # xhat = x * rstd, with rstd = 1 / sqrt(mean(x**2) + eps) itself a function of x
    mean_dxhat_xhat = xp.mean(dxhat * xhat, axis=-1, keepdims=True)  # (..., 1)
    dx = rstd * (dxhat - xhat * mean_dxhat_xhat)  # (..., C)
    return dx, dw
