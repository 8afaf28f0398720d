"""Bias + GELU as Triton kernels: y = gelu(h + b) in one pass over h, tanh and erf forms.

The same function as ``gptlab/layers/gelu.py`` applied to h + b (its test oracle):

    exact ("none"): Phi(x) = 0.5 * (1 + erf(x / sqrt(2))),    Phi'(x) = exp(-x^2/2) / sqrt(2 pi)
    tanh (GPT-2):   Phi(x) = 0.5 * (1 + tanh(u)) = sigmoid(2u),  u = sqrt(2/pi) (x + 0.044715 x^3)
                    Phi'(x) = 2 Phi (1 - Phi) * sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    y = x * Phi(x),  dx = dy * (Phi + x * Phi'(x)),  x = h + b

The MLP's first linear layer then needs no bias of its own (a plain matmul), and the bias add,
the GELU and, in the backward, the GELU derivative and db = sum_n dx come in one kernel each
instead of a chain of element-wise passes over the (N, 4C) activations. The cache keeps h (the
input) only: the backward recomputes x and Phi. db: partial sums per tile of rows, added in a
second stage (``reduce.column_sum``), no atomics.

Book: chapter 23, "Bias + GELU".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import require_float, require_shape
from ..layers import gelu
from .launch import check_tensors, check_tile
from .reduce import column_sum

# the layer's constants, as the compile-time globals a kernel may read
_SQRT_2_OVER_PI = tl.constexpr(gelu.SQRT_2_OVER_PI)
_INV_SQRT_2 = tl.constexpr(gelu.INV_SQRT_2)
_INV_SQRT_2PI = tl.constexpr(gelu.INV_SQRT_2PI)
_GELU_CUBIC = tl.constexpr(gelu.GELU_CUBIC)


@triton.jit
def _phi(x, TANH: tl.constexpr):
    """Phi(x), the GELU's gate: y = x * Phi(x)."""
    if TANH:
        return tl.sigmoid((x + x * x * x * _GELU_CUBIC) * (2.0 * _SQRT_2_OVER_PI))  # sigmoid(2u)
    return 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT_2))


@triton.jit
def _load_x(h_ptr, b_ptr, N, H, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_H: tl.constexpr):  # fmt: skip
    """x = h + b of this program's (BLOCK_N, BLOCK_H) tile in float32, with the tile's offsets,
    its mask (the edges) and its columns."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (bn,)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # (bh,)
    at = rows[:, None].to(tl.int64) * H + cols[None, :]  # (bn, bh)
    mask = (rows[:, None] < N) & (cols[None, :] < H)
    x = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32)  # (bn, bh)
    if HAS_BIAS:
        x += tl.load(b_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)[None, :]
    return x, at, mask, cols


@triton.jit
def _bias_gelu_forward_kernel(h_ptr, b_ptr, y_ptr, N, H, HAS_BIAS: tl.constexpr,
                              TANH: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (row tile, column tile): y = gelu(h + b) of a (BLOCK_N, BLOCK_H) tile."""
    x, at, mask, cols = _load_x(h_ptr, b_ptr, N, H, HAS_BIAS, BLOCK_N, BLOCK_H)  # (bn, bh)
    tl.store(y_ptr + at, x * _phi(x, TANH), mask=mask)


@triton.jit
def _bias_gelu_backward_kernel(dy_ptr, h_ptr, b_ptr, dh_ptr, db_part_ptr, N, H,
                               HAS_BIAS: tl.constexpr, TANH: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_H: tl.constexpr):  # fmt: skip
    """Program (row tile i, column tile): dh of its tile, and row i of db's partial sums."""
    x, at, mask, cols = _load_x(h_ptr, b_ptr, N, H, HAS_BIAS, BLOCK_N, BLOCK_H)  # (bn, bh)
    dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)  # (bn, bh)
    phi = _phi(x, TANH)  # (bn, bh)
    if TANH:
        # Phi = sigmoid(2u): Phi' = 2 Phi (1 - Phi) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
        slope = 2.0 * phi * (1.0 - phi) * _SQRT_2_OVER_PI * (x * x * (3.0 * _GELU_CUBIC) + 1.0)
    else:
        # Phi' = exp(-x^2 / 2) / sqrt(2 pi)
        slope = tl.exp(-0.5 * x * x) * _INV_SQRT_2PI
    # y = x * Phi(x)
    dx = tl.where(mask, dy * (phi + x * slope), 0.0)  # (bn, bh)
    tl.store(dh_ptr + at, dx, mask=mask)
    if HAS_BIAS:  # x = h + b: db = sum_n dx, this tile's rows first
        tl.store(db_part_ptr + tl.program_id(0).to(tl.int64) * H + cols, tl.sum(dx, 0),
                 mask=cols < H)  # fmt: skip


def bias_gelu_forward(h, b=None, *, approximate: str = "tanh", block_n: int = 64,
                      block_h: int = 128, num_warps: int = 4):  # fmt: skip
    """h (..., H), b (H,) or None -> (y = gelu(h + b) (..., H), cache). ``approximate`` as the
    layer: 'tanh' (GPT-2) or 'none' (erf)."""
    named = {"h": h} if b is None else {"h": h, "b": b}
    for name, a in named.items():
        require_float(name, a)
    gelu._check_approximate(approximate)
    check_tensors(**named)
    check_tile("block_n", block_n)
    check_tile("block_h", block_h)
    H = h.shape[-1]
    if b is not None:
        require_shape("b", b, (H,))
    rows = h.reshape(-1, H).contiguous()  # (N, H)
    N = rows.shape[0]
    y = torch.empty_like(rows)  # (N, H)
    launch = dict(HAS_BIAS=b is not None, TANH=approximate == "tanh", BLOCK_N=block_n,
                  BLOCK_H=block_h, num_warps=num_warps)  # fmt: skip
    grid = (triton.cdiv(N, block_n), triton.cdiv(H, block_h))
    _bias_gelu_forward_kernel[grid](rows, rows if b is None else b, y, N, H, **launch)
    return y.view(h.shape), (rows, b, launch, grid)


def bias_gelu_backward(dy, cache):
    """dy (..., H) -> (dh (..., H), db (H,) or None)."""
    h, b, launch, grid = cache
    check_tensors(dy=dy)
    N, H = h.shape
    dh = torch.empty_like(h)  # (N, H)
    db_part = torch.empty(grid[0] if b is not None else 1, H, dtype=torch.float32,
                          device=h.device)  # (row tiles, H)  # fmt: skip
    dy_rows = dy.reshape(N, H).to(h.dtype).contiguous()  # (N, H)
    _bias_gelu_backward_kernel[grid](dy_rows, h, h if b is None else b, dh, db_part, N, H,
                                     **launch)  # fmt: skip
    db = column_sum(db_part, b.dtype) if b is not None else None  # (H,)
    return dh.view(dy.shape), db
