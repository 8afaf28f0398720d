"""Rotary position embeddings, RoPE (Su et al., 2021, RoFormer), applied to queries and keys.

The head's hs coordinates form hs/2 pairs; at position t the pair i is turned by the angle
t * theta_i, with the frequencies of the sinusoidal encoding (position_sinusoidal.py, C = hs):

    theta_i = base^(-2i / hs),  i = 0 .. hs/2 - 1,  base = 10000
    (y1, y2) = (x1 cos(t theta_i) - x2 sin(t theta_i),  x1 sin(t theta_i) + x2 cos(t theta_i))

Which coordinates (x1, x2) pair up is a convention (``pairing``):

    "rotate_half" (default; Hugging Face's LLaMA): x1 = x[i], x2 = x[i + hs/2]. In HF's words
        y = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin),  rotate_half(x) = cat(-x2, x1)
    "adjacent" (the paper, GPT-J, Meta's original LLaMA code): x1 = x[2i], x2 = x[2i + 1]

The two differ by a fixed permutation of the hs coordinates, so the scores agree once the rows of
the query and key weights are permuted to match (HF's conversion of Meta's checkpoints does so).

Per position, y = R(t) x with R(t) block-diagonal rotations (``rope_rotation_matrix``). Since
R(t)^T R(s) = R(s - t), a query at t and a key at s score
    (R(t) q) . (R(s) k) = q^T R(s - t) k,
which depends on the offset s - t alone: position enters attention only relatively. For the
adjacent pairing R(t) = M_t^T = M_(-t), with M_k chapter 2's staircase ``position_shift_matrix``
(e(t + k) = M_k e(t); the encoding orders each pair (sin, cos), which turns the other way).

``start`` shifts the positions to start .. start + T - 1 (new queries and keys after a KV cache
of ``start`` positions). ``positions`` gives every row its own position instead: an integer array
(..., T) that broadcasts against x's (..., T), e.g. positions that restart at 0 with every
document of a packed row (``gptlab.model``'s ``documents``).

Backward: R(t) is orthogonal, so dx = R(t)^T dy = R(-t) dy, the rotation by -angle: the same
lines with sin -> -sin.

Book: chapter 17, "Today's blocks", "Rotary position embeddings".
"""

from __future__ import annotations

import math

from ..backend import array_device, array_namespace
from ..checks import require_float, require_int, require_ndim_at_least
from .position_sinusoidal import _frequencies
from .sdpa import _broadcast

ROPE_PAIRINGS = ("rotate_half", "adjacent")


def rope_angles(T: int, hs: int, *, base: float = 10000.0, start: int = 0, positions=None, like):
    """(cos, sin) of the angles t * theta_i for t = start .. start + T - 1, each (T, hs/2), or for
    t = ``positions`` (..., T), each (..., T, hs/2), in the namespace, dtype and device of the
    array ``like``. A model can compute them once per length."""
    xp, dtype, device = array_namespace(like), like.dtype, array_device(like)
    if positions is None:
        t = xp.arange(start, start + T, dtype=dtype, device=device)  # (T,)
    else:
        t = xp.astype(positions, dtype)  # (..., T)
    angles = t[..., None] * _frequencies(hs, base, xp, dtype, device)  # (..., T, hs/2)
    return xp.cos(angles), xp.sin(angles)  # (..., T, hs/2) each


def rope_forward(x, *, base: float = 10000.0, start: int = 0, positions=None,
                 pairing: str = "rotate_half"):
    """x (..., T, hs) -> y (..., T, hs), position start + t (or positions[..., t]) rotated into
    row t; hs even."""
    array_namespace(x)  # an array, or a TypeError
    _check_inputs(x, base, start, positions, pairing)
    T, hs = x.shape[-2], x.shape[-1]
    cos, sin = rope_angles(T, hs, base=base, start=start, positions=positions,
                           like=x)  # (T, hs/2) or (..., T, hs/2) each
    y = _rotate(x, cos, sin, pairing)  # (..., T, hs)
    return y, (cos, sin, pairing)


def rope_backward(dy, cache):
    """dy (..., T, hs) -> (dx (..., T, hs),)."""
    cos, sin, pairing = cache
    # y = _rotate(x, cos, sin, pairing) = R(t) x: dx = R(t)^T dy = R(-t) dy
    dx = _rotate(dy, cos, -sin, pairing)  # (..., T, hs)
    return (dx,)


def rope_rotation_matrix(t: int, hs: int, *, base: float = 10000.0, pairing: str = "rotate_half",
                         like):
    """The (hs, hs) matrix R(t) with rope(x at position t) = R(t) @ x: block-diagonal 2x2
    rotations by t * theta_i (for "rotate_half" the blocks sit on the pairs (i, i + hs/2)). Its
    column j is the image of the unit vector e_j, which is how it is computed."""
    xp = array_namespace(like)
    eye = xp.eye(hs, dtype=like.dtype, device=array_device(like))  # (hs, hs): row j = e_j
    images, _ = rope_forward(eye[:, None, :], base=base, start=t, pairing=pairing)  # (hs, 1, hs)
    return images[:, 0, :].mT  # (hs, hs): column j = R(t) e_j


def _rotate(x, cos, sin, pairing: str):
    """x (..., T, hs) -> each pair (x1, x2) turned into (x1 cos - x2 sin, x1 sin + x2 cos)."""
    xp = array_namespace(x)
    half = x.shape[-1] // 2
    if pairing == "rotate_half":
        x1, x2 = x[..., :half], x[..., half:]  # (..., T, hs/2) each
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., T, hs/2) each
    y1 = x1 * cos - x2 * sin  # (..., T, hs/2)
    y2 = x1 * sin + x2 * cos  # (..., T, hs/2)
    if pairing == "rotate_half":
        return xp.concat([y1, y2], axis=-1)  # (..., T, hs)
    return xp.reshape(xp.stack([y1, y2], axis=-1), tuple(x.shape))  # (..., T, hs) interleaved


def _check_inputs(x, base, start, positions, pairing) -> None:
    """TypeError for a non-float x or non-integer positions, ValueError for their shapes and for
    the hyperparameters."""
    require_float("x", x)
    require_ndim_at_least("x", x, 2)
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"rope needs an even head size to form pairs: x has shape "
                         f"{tuple(x.shape)}, (..., T, hs) with hs={x.shape[-1]}")  # fmt: skip
    if pairing not in ROPE_PAIRINGS:
        raise ValueError(f"pairing must be one of {ROPE_PAIRINGS}, got {pairing!r}")
    if isinstance(start, bool) or not isinstance(start, int):
        raise ValueError(f"start must be an integer position, got {start!r}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 0):
        raise ValueError(f"base must be a positive number, got {base!r}")
    if positions is not None:
        require_int("positions", positions)
        if start != 0:
            raise ValueError(f"give start or positions, not both (start={start})")
        shape = tuple(x.shape[:-1])  # (..., T)
        if not positions.shape or positions.shape[-1] != shape[-1] or \
                _broadcast([positions.shape, shape]) != shape:
            raise ValueError(f"positions has shape {tuple(positions.shape)}, which does not "
                             f"broadcast to x's (..., T) = {shape}")  # fmt: skip
