"""Learned position embeddings (GPT-2's wpe): x + wpe[t] at every position t.

    y[b, t] = x[b, t] + wpe[t]                  for t < T <= block_size
    dx = dy,  dwpe[t] = sum_b dy[b, t]  (rows t >= T get no gradient)

Book: chapter 1, "Learned position embeddings".
"""

from __future__ import annotations

from ..backend import array_device, array_namespace
from ..checks import require_float


def position_learned_forward(x, wpe):
    """x (B, T, C), wpe (block_size, C) -> y (B, T, C)."""
    array_namespace(x, wpe)  # one array library for both, or a TypeError
    require_float("x", x)
    require_float("wpe", wpe)
    T, C = x.shape[-2], x.shape[-1]
    if len(wpe.shape) != 2 or wpe.shape[1] != C:
        raise ValueError(f"wpe must have shape (block_size, {C}), got {tuple(wpe.shape)}")
    if T > wpe.shape[0]:
        raise ValueError(f"sequence length {T} is longer than the {wpe.shape[0]} learned positions")
    y = x + wpe[:T, :]  # (B, T, C)
    return y, (wpe.shape[0],)


def position_learned_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), dwpe (block_size, C))."""
    xp = array_namespace(dy)
    (block_size,) = cache
    T, C = dy.shape[-2], dy.shape[-1]
    # y = x + wpe[:T]
    dx = dy  # (B, T, C)
    dwpe_used = xp.sum(xp.reshape(dy, (-1, T, C)), axis=0)  # (T, C)
    unused = xp.zeros((block_size - T, C), dtype=dy.dtype, device=array_device(dy))  # (bs-T, C)
    dwpe = xp.concat([dwpe_used, unused], axis=0)  # (block_size, C)
    return dx, dwpe
