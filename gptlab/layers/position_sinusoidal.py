"""The sinusoidal positional encoding of "Attention Is All You Need" (Vaswani et al., 2017).

    e(t)[2i]   = sin(t * w_i),   e(t)[2i+1] = cos(t * w_i),   w_i = base^(-2i / C)

It has no parameters: y = x + e(0..T-1), so the backward passes the gradient straight through.
Each (sin, cos) pair turns by the angle w_i per step: e(t + k) = T^k e(t) with T a
block-diagonal rotation (``position_shift_matrix``). Book: chapter 2, "Positional-encoding
staircases".
"""

from __future__ import annotations

import math

from ..backend import array_device, array_namespace
from ..checks import require_float, require_int
from .sdpa import _broadcast


def _frequencies(C: int, base: float, xp, dtype, device):
    """w_i = base^(-2i/C) for i = 0 .. C/2 - 1 -> (C/2,)."""
    i = xp.arange(C // 2, dtype=dtype, device=device)  # (C/2,)
    return xp.exp(-(2.0 * i / C) * math.log(base))  # (C/2,)


def sinusoidal_encoding(T: int, C: int, *, base: float = 10000.0, like=None, xp=None, dtype=None,
                        device=None):
    """The (T, C) table e(0), ..., e(T-1); sin in even columns, cos in odd columns.

    Give ``like`` (an array whose namespace, dtype and device to use) or ``xp``/``dtype``/``device``.
    """
    if C % 2 != 0:
        raise ValueError(f"the sinusoidal encoding needs an even width, got C={C}")
    if like is not None:
        xp, dtype, device = array_namespace(like), like.dtype, array_device(like)
    t = xp.arange(T, dtype=dtype, device=device)  # (T,)
    return _encoding(t, C, base)  # (T, C)


def _encoding(t, C: int, base: float):
    """The encoding at the positions t (...,), a float array -> (..., C)."""
    xp = array_namespace(t)
    angles = t[..., None] * _frequencies(C, base, xp, t.dtype, array_device(t))  # (..., C/2)
    pairs = xp.stack([xp.sin(angles), xp.cos(angles)], axis=-1)  # (..., C/2, 2)
    return xp.reshape(pairs, (*t.shape, C))  # (..., C)


def position_sinusoidal_forward(x, *, base: float = 10000.0, positions=None):
    """x (B, T, C) -> y (B, T, C) = x + e(0..T-1), or x + e(positions) for integer positions
    (B, T) (any shape that broadcasts against x's (B, T)): each token its own position, such as
    positions that restart with every document of a packed row."""
    xp = array_namespace(x)
    require_float("x", x)
    T, C = x.shape[-2], x.shape[-1]
    if positions is None:
        y = x + sinusoidal_encoding(T, C, base=base, like=x)  # (B, T, C)
        return y, ()
    require_int("positions", positions)
    if _broadcast([positions.shape, x.shape[:-1]]) != tuple(x.shape[:-1]):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, which does not "
                         f"broadcast to x's (B, T) = {tuple(x.shape[:-1])}")  # fmt: skip
    y = x + _encoding(xp.astype(positions, x.dtype), C, base)  # (B, T, C)
    return y, ()


def position_sinusoidal_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C),): the encoding is a constant, so dx = dy."""
    # y = x + e(0..T-1), or y = x + e(positions)
    dx = dy  # (B, T, C)
    return (dx,)


def position_shift_matrix(k: int, C: int, *, base: float = 10000.0, like=None, xp=None, dtype=None,
                          device=None):
    """The (C, C) matrix M_k with e(t + k) = M_k e(t) for every t: one 2x2 rotation per pair.

    For the pair (sin(t w), cos(t w)) a shift by k is a rotation by the angle k w:
        sin((t+k) w) =  cos(k w) sin(t w) + sin(k w) cos(t w)
        cos((t+k) w) = -sin(k w) sin(t w) + cos(k w) cos(t w)
    M_k = M_1^k, so the map T between steps in the talk "Demystifying GPT-3" (2020) is M_1.
    """
    if like is not None:
        xp, dtype, device = array_namespace(like), like.dtype, array_device(like)
    angle = k * _frequencies(C, base, xp, dtype, device)  # (C/2,)
    c, s = xp.cos(angle), xp.sin(angle)  # (C/2,)
    blocks = xp.stack([xp.stack([c, s], axis=-1), xp.stack([-s, c], axis=-1)], axis=-2)  # (C/2,2,2)
    eye = xp.eye(C // 2, dtype=dtype, device=device)  # (C/2, C/2)
    M = eye[:, None, :, None] * blocks[:, :, None, :]  # (C/2, 2, C/2, 2)
    return xp.reshape(M, (C, C))  # (C, C)
