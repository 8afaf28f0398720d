"""The position-wise MLP of a GPT block: linear (C -> 4C), GELU, linear (4C -> C).

    h = x @ w_fc + b_fc,  g = gelu(h),  y = g @ w_proj + b_proj

Book: chapter 4 (forward) and chapter 8 (backward).
"""

from __future__ import annotations

from .gelu import gelu_backward, gelu_forward
from .linear import linear_backward, linear_forward


def mlp_forward(x, w_fc, b_fc, w_proj, b_proj, *, approximate: str = "tanh"):
    """x (..., C), w_fc (C, 4C), b_fc (4C,), w_proj (4C, C), b_proj (C,) -> y (..., C)."""
    h, fc_cache = linear_forward(x, w_fc, b_fc)  # (..., 4C)
    g, gelu_cache = gelu_forward(h, approximate=approximate)  # (..., 4C)
    y, proj_cache = linear_forward(g, w_proj, b_proj)  # (..., C)
    return y, (fc_cache, gelu_cache, proj_cache)


def mlp_backward(dy, cache):
    """dy (..., C) -> (dx, dw_fc, db_fc, dw_proj, db_proj)."""
    fc_cache, gelu_cache, proj_cache = cache
    # y = g @ w_proj + b_proj
    dg, dw_proj, db_proj = linear_backward(dy, proj_cache)  # (..., 4C)
    # g = gelu(h)
    (dh,) = gelu_backward(dg, gelu_cache)  # (..., 4C)
    # h = x @ w_fc + b_fc
    dx, dw_fc, db_fc = linear_backward(dh, fc_cache)  # (..., C)
    return dx, dw_fc, db_fc, dw_proj, db_proj
