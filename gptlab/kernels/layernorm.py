"""LayerNorm as Triton kernels: one program per group of rows, each row's statistics in one pass.

The same function as ``gptlab/layers/layernorm.py`` (its test oracle):

    mean = x.mean(-1),  var = ((x - mean)**2).mean(-1),  rstd = 1 / sqrt(var + eps)
    xhat = (x - mean) * rstd,  y = xhat * w + b

Forward: a row of C numbers is read from memory once into registers; its mean and variance come
from there (two reductions over registers, one pass over memory), and y is written. The cache
keeps x, mean and rstd (N floats each), not xhat: the backward rebuilds xhat from them.

Backward, the compact form of chapter 8:

    dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)),  dxhat = dy * w

row by row, and dw = sum_n dy * xhat, db = sum_n dy, sums over ALL rows, in two stages: each
program adds up its own rows into one row of partial sums (G, C) in float32, and a second kernel
(``reduce.column_sum``) adds the G rows. No atomics: every run adds in the same order.

Book: chapter 23, "LayerNorm's two-stage reduction".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import require_float, require_shape
from .launch import check_tensors, pow2
from .reduce import column_sum


@triton.jit
def _layernorm_forward_kernel(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, N, C, eps,
                              HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                              BLOCK_C: tl.constexpr):  # fmt: skip
    """Program (group of ROWS rows): y, mean, rstd of each of its rows."""
    cols = tl.arange(0, BLOCK_C)  # (BC,)
    in_row = cols < C
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # (BC,)
    b = tl.load(b_ptr + cols, mask=in_row, other=0.0).to(tl.float32) if HAS_BIAS else 0.0
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < N:
            at = row.to(tl.int64) * C + cols  # (BC,)
            x = tl.load(x_ptr + at, mask=in_row, other=0.0).to(tl.float32)  # (BC,)
            mean = tl.sum(x, 0) / C
            xc = tl.where(in_row, x - mean, 0.0)  # (BC,) x - mean, 0 past the row's end
            rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, 0) / C + eps)  # biased variance, as GPT-2
            tl.store(y_ptr + at, xc * rstd * w + b, mask=in_row)  # y = xhat * w + b
            tl.store(mean_ptr + row, mean)
            tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layernorm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dw_part_ptr,
                               db_part_ptr, N, C, ROWS: tl.constexpr,
                               BLOCK_C: tl.constexpr):  # fmt: skip
    """Program g (group of ROWS rows): dx of its rows, and row g of the partial sums of dw, db."""
    cols = tl.arange(0, BLOCK_C)  # (BC,)
    in_row = cols < C
    w = tl.load(w_ptr + cols, mask=in_row, other=0.0).to(tl.float32)  # (BC,)
    dw = tl.zeros((BLOCK_C,), tl.float32)  # (BC,) this group's share of dw
    db = tl.zeros((BLOCK_C,), tl.float32)  # (BC,) and of db
    for i in range(ROWS):
        row = tl.program_id(0) * ROWS + i
        if row < N:
            at = row.to(tl.int64) * C + cols  # (BC,)
            x = tl.load(x_ptr + at, mask=in_row, other=0.0).to(tl.float32)  # (BC,)
            dy = tl.load(dy_ptr + at, mask=in_row, other=0.0).to(tl.float32)  # (BC,)
            xhat = (x - tl.load(mean_ptr + row)) * tl.load(rstd_ptr + row)  # (BC,)
            xhat = tl.where(in_row, xhat, 0.0)
            # y = xhat * w + b
            dw += dy * xhat
            db += dy
            dxhat = dy * w  # (BC,)
            # xhat = (x - mean) * rstd, with mean and rstd themselves functions of x
            mean_dxhat = tl.sum(dxhat, 0) / C
            mean_dxhat_xhat = tl.sum(dxhat * xhat, 0) / C
            dx = tl.load(rstd_ptr + row) * (dxhat - mean_dxhat - xhat * mean_dxhat_xhat)  # (BC,)
            tl.store(dx_ptr + at, dx, mask=in_row)
    part = tl.program_id(0).to(tl.int64) * C + cols  # (BC,) row g of the partial sums
    tl.store(dw_part_ptr + part, dw, mask=in_row)
    tl.store(db_part_ptr + part, db, mask=in_row)


BACKWARD_PROGRAMS = 512  # the backward's programs at most: a few per SM of an H100 (132)


def layernorm_forward(x, w, b=None, *, eps: float = 1e-5, rows_per_program: int = 4,
                      num_warps: int | None = None):  # fmt: skip
    """x (..., C), w (C,), b (C,) or None -> (y (..., C), cache), as the layer. ``rows_per_program``
    rows share a program (and, in the backward, one row of partial sums)."""
    named = {"x": x, "w": w} if b is None else {"x": x, "w": w, "b": b}
    for name, a in named.items():
        require_float(name, a)
    check_tensors(**named)
    C = x.shape[-1]
    require_shape("w", w, (C,))
    if b is not None:
        require_shape("b", b, (C,))
    rows = x.reshape(-1, C).contiguous()  # (N, C)
    N = rows.shape[0]
    y = torch.empty_like(rows)  # (N, C)
    mean = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,)
    rstd = torch.empty(N, dtype=torch.float32, device=x.device)  # (N,)
    BLOCK_C = pow2(C)
    warps = num_warps or min(max(BLOCK_C // 256, 1), 8)  # a warp per 256 columns, up to 8
    launch = dict(ROWS=rows_per_program, BLOCK_C=BLOCK_C, num_warps=warps)
    _layernorm_forward_kernel[(triton.cdiv(N, rows_per_program),)](
        rows, w, w if b is None else b, y, mean, rstd, N, C, eps, HAS_BIAS=b is not None, **launch)
    return y.view(x.shape), (rows, w, mean, rstd, b is not None, launch)


def layernorm_backward(dy, cache):
    """dy (..., C) -> (dx (..., C), dw (C,), db (C,) or None)."""
    x, w, mean, rstd, has_bias, launch = cache
    check_tensors(dy=dy)
    N, C = x.shape
    dy_rows = dy.reshape(N, C).to(x.dtype).contiguous()  # (N, C)
    dx = torch.empty_like(x)  # (N, C)
    # rows per program: the forward's, or more, so that at most BACKWARD_PROGRAMS rows of
    # partial sums are left for the second stage
    launch = {**launch, "ROWS": max(launch["ROWS"], triton.cdiv(N, BACKWARD_PROGRAMS))}
    G = triton.cdiv(N, launch["ROWS"])
    dw_part = torch.empty(G, C, dtype=torch.float32, device=x.device)  # (G, C)
    db_part = torch.empty(G, C, dtype=torch.float32, device=x.device)  # (G, C)
    _layernorm_backward_kernel[(G,)](dy_rows, x, w, mean, rstd, dx, dw_part, db_part, N, C,
                                     **launch)  # fmt: skip
    dw = column_sum(dw_part, w.dtype)  # (C,)
    db = column_sum(db_part, w.dtype) if has_bias else None  # (C,)
    return dx.view(dy.shape), dw, db
