"""The SwiGLU MLP (Shazeer, 2020, "GLU Variants Improve Transformer"), LLaMA's feed-forward layer.

    a = x @ w_gate,  u = x @ w_up,  h = silu(a) * u,  y = h @ w_down

A gated linear unit: a second projection u of the same input is multiplied, entry by entry, by
the SiLU of the gate projection a, in place of GPT-2's gelu(x @ w_fc + b_fc). No biases, as in
LLaMA; weights in the package's (in, out) layout: w_gate, w_up (C, H), w_down (H, C_out). Three
matrices instead of two, so LLaMA takes H = 2/3 * 4C (rounded up to a multiple of 256) to keep
GPT-2's parameter count. (Hugging Face's LlamaMLP stores gate_proj, up_proj and down_proj as
(out, in): w_gate = gate_proj.weight.T, and so on.)

Backward: the product rule at h = silu(a) * u sends dh to both factors,

    dh = dy @ w_down^T,  du = dh * silu(a),  da = silu'(a) * (dh * u)
    dx = da @ w_gate^T + du @ w_up^T    (x feeds both projections: the two gradients add)

Book: chapter 17, "Today's blocks", "SwiGLU".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape
from .linear import linear_backward, linear_forward
from .silu import silu_backward, silu_forward


def swiglu_forward(x, w_gate, w_up, w_down):
    """x (..., C), w_gate (C, H), w_up (C, H), w_down (H, C_out) -> y (..., C_out)."""
    array_namespace(x, w_gate, w_up, w_down)  # one array library for all of them, or a TypeError
    for name, a in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        require_float(name, a)
    require_shape("w_gate", w_gate, (x.shape[-1], None))
    require_shape("w_up", w_up, tuple(w_gate.shape))
    require_shape("w_down", w_down, (w_gate.shape[1], None))
    a, gate_cache = linear_forward(x, w_gate)  # (..., H)
    u, up_cache = linear_forward(x, w_up)  # (..., H)
    g, silu_cache = silu_forward(a)  # (..., H)
    h = g * u  # (..., H)
    y, down_cache = linear_forward(h, w_down)  # (..., C_out)
    return y, (gate_cache, up_cache, silu_cache, down_cache, g, u)


def swiglu_backward(dy, cache):
    """dy (..., C_out) -> (dx (..., C), dw_gate (C, H), dw_up (C, H), dw_down (H, C_out))."""
    gate_cache, up_cache, silu_cache, down_cache, g, u = cache
    # y = h @ w_down
    dh, dw_down, _ = linear_backward(dy, down_cache)  # (..., H)
    # h = g * u
    dg = dh * u  # (..., H)
    du = dh * g  # (..., H)
    # g = silu(a)
    (da,) = silu_backward(dg, silu_cache)  # (..., H)
    # u = x @ w_up
    dx_up, dw_up, _ = linear_backward(du, up_cache)  # (..., C)
    # a = x @ w_gate
    dx_gate, dw_gate, _ = linear_backward(da, gate_cache)  # (..., C)
    dx = dx_gate + dx_up  # (..., C)
    return dx, dw_gate, dw_up, dw_down
