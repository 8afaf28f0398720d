"""The second stage of a column sum: partial sums (G, C), one row per program of the first
stage, added over G. Two stages instead of atomic adds: the order of the additions is fixed,
so the result is the same on every run."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _column_sum_kernel(partials_ptr, out_ptr, G, C, BLOCK_G: tl.constexpr,
                       BLOCK_C: tl.constexpr):  # fmt: skip
    """Program (column block): out[cols] = sum over the G rows of partials[:, cols]."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # (bc,)
    total = tl.zeros((BLOCK_C,), tl.float32)  # (bc,)
    for g0 in range(0, G, BLOCK_G):
        rows = g0 + tl.arange(0, BLOCK_G)  # (bg,)
        part = tl.load(partials_ptr + rows[:, None].to(tl.int64) * C + cols[None, :],
                       mask=(rows[:, None] < G) & (cols[None, :] < C), other=0.0)  # (bg, bc)
        total += tl.sum(part, 0)
    tl.store(out_ptr + cols, total, mask=cols < C)


def column_sum(partials, dtype: torch.dtype, block_g: int = 64, block_c: int = 32):
    """partials (G, C) float32 -> (C,) in ``dtype``, summed over G in float32. Narrow column
    blocks: C / 32 programs (24 for GPT-2's 768), each walking G rows."""
    G, C = partials.shape
    out = torch.empty(C, dtype=dtype, device=partials.device)  # (C,)
    _column_sum_kernel[(triton.cdiv(C, block_c),)](partials, out, G, C, BLOCK_G=block_g,
                                                   BLOCK_C=block_c)  # fmt: skip
    return out
