"""Flash attention as Triton kernels: one program per tile of queries, never the (Tq, Tk) weights.

The same function as ``gptlab/layers/flash_attention.py`` (its test oracle), with the same
online softmax (FlashAttention-2, Dao 2023, Algorithm 1). One program takes BLOCK_Q query rows of
one (batch, head) and walks over the key tiles, keeping per row the running max m, the running
sum l and the unnormalized output acc in registers (float32):

    m_new = max(m, rowmax(s)),  l = exp(m - m_new) l + rowsum(exp(s - m_new))
    acc = exp(m - m_new) acc + exp(s - m_new) @ v

It stores only out = acc / l and the row's log-sum-exp L = m + log(l).

Backward (Algorithm 2), without atomics, in three launches:
    D = rowsum(dout * out)                 one program per query tile
    dk, dv: one program per KEY tile, walking over the query tiles that see it
    dq:     one program per QUERY tile, walking over the key tiles it sees
each recomputing the weights of a tile from L, P = exp(s - L), and

    dv += P^T @ dout,  dP = dout @ v^T,  dS = P * (dP - D)
    dq += scale dS @ k,  dk += scale dS^T @ q

Causal: query i sees the keys j <= i + (Tk - Tq); a tile past the last query's diagonal is never
loaded, the tiles across it are masked, and the tiles wholly below it run without a mask (each loop
over tiles is split in two or three: the whole tiles, and the masked ones). A late query tile sees
more keys than an early one, so each head's programs start with its longest tiles (the longest
first: a GPU starts programs, in practice, in the order of their ids, and short ones left for
the end keep its multiprocessors evenly busy to the last), one head after another, so that the
programs running together share a head's keys in the L2 cache (that order is not timed yet).

Edge tiles (T not a multiple of the tile, head sizes not a power of two) are masked on load. Every
tensor is addressed through its (batch, head, row) strides, its columns next to each other: q, k,
v can be views of one (B, T, 3, NH, hs) projection and out, dq, dk, dv views of the step's own
(B, T, C) and (B, T, 3C) buffers (gptlab/fast.py), with no copy into or out of a (B, NH, T, hs)
layout.

Tiles, warps and pipeline stages were picked by a sweep on an H100 (GPT-2's heads, T = 1024 and
4096, bf16; benchmarks/results/gpu.md): the forward takes 64 queries x 64 keys, the backward
BACKWARD_BLOCKS, 4 warps for head sizes up to 64 (8 above), and STAGES by the dtype's size
(float32 tiles fill shared memory sooner).

Under the interpreter (NumPy has no bfloat16) bfloat16 tiles are multiplied in float32 after
rounding to bfloat16: the same products as the tensor cores'.

Book: chapter 23, "Flash attention as kernels".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..layers.sdpa import check_attention_inputs
from .launch import check_tensors, check_tile, dot_dtype, input_precision, pow2


@triton.jit
def _load_tile(ptr, rows, stride, n_rows, n_cols, BLOCK_COLS: tl.constexpr, DOT: tl.constexpr):
    """The (rows, BLOCK_COLS) tile at ``ptr`` of a (n_rows, n_cols) matrix whose rows lie
    ``stride`` elements apart (its columns next to each other), 0 off the edges, in DOT."""
    cols = tl.arange(0, BLOCK_COLS)  # (bc,)
    return tl.load(ptr + rows[:, None] * stride + cols[None, :],
                   mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0).to(DOT)


@triton.jit
def _store_tile(ptr, tile, rows, stride, n_rows, n_cols, BLOCK_COLS: tl.constexpr):
    """Write ``tile`` (rows, BLOCK_COLS) where _load_tile reads it, inside the edges."""
    cols = tl.arange(0, BLOCK_COLS)  # (bc,)
    tl.store(ptr + rows[:, None] * stride + cols[None, :], tile,
             mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols))


@triton.jit
def _tile_weights(q, k, lse, rows, cols, Tq, Tk, scale, MASKED: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """P = exp(q @ k^T * scale - L) (BLOCK_Q, BLOCK_K). MASKED: 0 where a key is hidden or a row
    or key is off the edge; else the tile lies wholly inside the edges and below the diagonal."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (bq, bk)
    p = tl.exp(s - lse[:, None])  # (bq, bk)
    if MASKED:
        visible = (rows[:, None] < Tq) & (cols[None, :] < Tk)  # (bq, bk)
        if CAUSAL:
            visible &= cols[None, :] <= rows[:, None] + (Tk - Tq)
        p = tl.where(visible, p, 0.0)
    return p


@triton.jit
def _whole_key_tiles(r0, Tq, Tk, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr):
    """The end of the key tiles that every row of the query tile starting at r0 sees whole:
    inside Tk and, causal, at or below the first row's diagonal r0 + (Tk - Tq)."""
    end = (Tk // BLOCK_K) * BLOCK_K
    if CAUSAL:
        end = tl.minimum(end, ((r0 + (Tk - Tq) + 1) // BLOCK_K) * BLOCK_K)
    return end


@triton.jit
def _forward_tiles(q, k_ptr, stride_kt, v_ptr, stride_vt, m, l, acc, rows, c_begin, c_end, Tq,
                   Tk, HS, HV, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr,
                   DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """The online softmax over the key tiles [c_begin, c_end): (m, l, acc) updated. MASKED as
    in _tile_weights."""
    for c0 in range(c_begin, c_end, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
        k = _load_tile(k_ptr, cols, stride_kt, Tk, HS, BLOCK_HS, DOT)  # (bk, BHS)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (bq, bk)
        if MASKED:
            visible = cols[None, :] < Tk  # (1, bk)
            if CAUSAL:
                visible &= cols[None, :] <= rows[:, None] + (Tk - Tq)  # (bq, bk)
            s = tl.where(visible, s, -float("inf"))  # (bq, bk)
        m_new = tl.maximum(m, tl.max(s, 1))  # (bq,)
        p = tl.exp(s - m_new[:, None])  # (bq, bk), hidden keys 0
        rescale = tl.exp(m - m_new)  # (bq,), 0 on the first tile (m = -inf)
        l = rescale * l + tl.sum(p, 1)
        v = _load_tile(v_ptr, cols, stride_vt, Tk, HV, BLOCK_HV, DOT)  # (bk, BHV)
        p = p.to(v_ptr.dtype.element_ty).to(DOT)  # P in the inputs' dtype, for the tensor cores
        acc = rescale[:, None] * acc + tl.dot(p, v, input_precision=PRECISION)  # (bq, BHV)
        m = m_new
    return m, l, acc


@triton.jit
def _flash_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr,
                          stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                          stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, stride_ot,
                          NH, Tq, Tk, HS, HV, GROUP, scale, CAUSAL: tl.constexpr,
                          BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_HS: tl.constexpr,
                          BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                          PRECISION: tl.constexpr):  # fmt: skip
    """Program (query tile, batch*head): out (bq, hv) and L (bq,) of its rows. Query head h
    reads key/value head h // GROUP. The key tiles every row sees whole come first, unmasked;
    then the tiles across the diagonal or the edge, masked. The query tiles go last to first
    (causal: the longest first), so that a head's shortest tiles fill the grid's end."""
    r0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // NH, bh % NH
    q_ptr += b * stride_qb + h * stride_qh  # this head's (Tq, hs) rows
    k_ptr += b * stride_kb + (h // GROUP) * stride_kh  # (Tk, hs)
    v_ptr += b * stride_vb + (h // GROUP) * stride_vh  # (Tk, hv)
    rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
    q = _load_tile(q_ptr, rows, stride_qt, Tq, HS, BLOCK_HS, DOT)  # (bq, BHS)
    m = tl.full((BLOCK_Q,), -float("inf"), tl.float32)  # (bq,) running max
    l = tl.zeros((BLOCK_Q,), tl.float32)  # (bq,) running sum of exp(s - m)
    acc = tl.zeros((BLOCK_Q, BLOCK_HV), tl.float32)  # (bq, BHV) unnormalized output
    end = tl.minimum(Tk, r0 + BLOCK_Q + Tk - Tq) if CAUSAL else Tk  # the last key any row sees + 1
    whole = _whole_key_tiles(r0, Tq, Tk, CAUSAL, BLOCK_K)
    m, l, acc = _forward_tiles(q, k_ptr, stride_kt, v_ptr, stride_vt, m, l, acc, rows, 0, whole,
                               Tq, Tk, HS, HV, scale, False, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV,
                               DOT, PRECISION)  # fmt: skip
    m, l, acc = _forward_tiles(q, k_ptr, stride_kt, v_ptr, stride_vt, m, l, acc, rows, whole, end,
                               Tq, Tk, HS, HV, scale, True, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV,
                               DOT, PRECISION)  # fmt: skip
    _store_tile(out_ptr + b * stride_ob + h * stride_oh, acc / l[:, None], rows, stride_ot, Tq, HV,
                BLOCK_HV)  # out = acc / l  (bq, BHV)
    tl.store(lse_ptr + bh * Tq + rows, m + tl.log(l), mask=rows < Tq)  # L = m + log(l)


@triton.jit
def _flash_backward_D_kernel(dout_ptr, out_ptr, D_ptr, stride_db, stride_dh, stride_dt,
                             stride_ob, stride_oh, stride_ot, NH, Tq, HV, BLOCK_Q: tl.constexpr,
                             BLOCK_HV: tl.constexpr):  # fmt: skip
    """Program (query tile, batch*head): D = rowsum(dout * out) (bq,), the softmax Jacobian's
    row sum, sum_j P_ij dP_ij."""
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (bq,)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // NH, bh % NH
    dout = _load_tile(dout_ptr + b * stride_db + h * stride_dh, rows, stride_dt, Tq, HV, BLOCK_HV,
                      tl.float32)  # (bq, BHV)
    out = _load_tile(out_ptr + b * stride_ob + h * stride_oh, rows, stride_ot, Tq, HV, BLOCK_HV,
                     tl.float32)  # (bq, BHV)
    tl.store(D_ptr + bh * Tq + rows, tl.sum(dout * out, 1), mask=rows < Tq)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_ptr, stride_qt, dout_ptr, stride_dt, lse_ptr, D_ptr, cols,
                r_begin, r_end, Tq, Tk, HS, HV, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                BLOCK_Q: tl.constexpr, BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr,
                DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dk (bk, BHS), dv (bk, BHV) plus the query tiles [r_begin, r_end) of one head (q_ptr,
    dout_ptr, lse_ptr, D_ptr at that head). MASKED as in _tile_weights."""
    for r0 in range(r_begin, r_end, BLOCK_Q):
        rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
        q = _load_tile(q_ptr, rows, stride_qt, Tq, HS, BLOCK_HS, DOT)  # (bq, BHS)
        dout = _load_tile(dout_ptr, rows, stride_dt, Tq, HV, BLOCK_HV, DOT)  # (bq, BHV)
        lse = tl.load(lse_ptr + rows, mask=rows < Tq, other=0.0)  # (bq,)
        D = tl.load(D_ptr + rows, mask=rows < Tq, other=0.0)  # (bq,)
        # p = exp(scores - m_new) over all tiles, normalized by l: P = exp(s - L)
        p = _tile_weights(q, k, lse, rows, cols, Tq, Tk, scale, MASKED, CAUSAL, PRECISION)
        # acc = rescale * acc + p @ v, i.e. out = P @ v
        dv += tl.dot(tl.trans(p.to(q_ptr.dtype.element_ty).to(DOT)), dout,
                     input_precision=PRECISION)  # (bk, BHV)
        dp = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # (bq, bk)
        # P = softmax(s): dS = P * (dP - D)
        dscores = (p * (dp - D[:, None])).to(q_ptr.dtype.element_ty).to(DOT)  # (bq, bk)
        # s = q @ k^T * scale
        dk += tl.dot(tl.trans(dscores), q, input_precision=PRECISION)  # (bk, BHS)
    return dk, dv


@triton.jit
def _flash_backward_dkdv_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, D_ptr, dk_ptr, dv_ptr,
                                stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                                stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
                                stride_dkb, stride_dkh, stride_dkt, stride_dvb, stride_dvh,
                                stride_dvt, NH, Tq, Tk, HS, HV, GROUP, scale,
                                CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                                BLOCK_K: tl.constexpr, BLOCK_HS: tl.constexpr,
                                BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                                PRECISION: tl.constexpr):  # fmt: skip
    """Program (key tile, batch*key/value head): dk (bk, hs) and dv (bk, hv) of its keys, summed
    over the query tiles that see them, of each of the GROUP query heads that read them. The
    query tiles across the diagonal and past Tq are masked, those that see the key tile whole
    are not. The key tiles go first to last (causal: the longest first)."""
    c0 = tl.program_id(0) * BLOCK_K
    bkv = tl.program_id(1).to(tl.int64)
    b, kvh = bkv // (NH // GROUP), bkv % (NH // GROUP)
    cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
    k = _load_tile(k_ptr + b * stride_kb + kvh * stride_kh, cols, stride_kt, Tk, HS, BLOCK_HS,
                   DOT)  # (bk, BHS)
    v = _load_tile(v_ptr + b * stride_vb + kvh * stride_vh, cols, stride_vt, Tk, HV, BLOCK_HV,
                   DOT)  # (bk, BHV)
    dk = tl.zeros((BLOCK_K, BLOCK_HS), tl.float32)  # (bk, BHS)
    dv = tl.zeros((BLOCK_K, BLOCK_HV), tl.float32)  # (bk, BHV)
    # causal: the first query that sees key c0 is c0 - (Tk - Tq); start at its tile. The first
    # query tile that sees the whole key tile starts at or after c0 + BLOCK_K - 1 - (Tk - Tq).
    start = (tl.maximum(c0 - (Tk - Tq), 0) // BLOCK_Q) * BLOCK_Q if CAUSAL else 0
    whole_begin = 0
    if CAUSAL:
        whole_begin = tl.cdiv(tl.maximum(c0 + BLOCK_K - 1 - (Tk - Tq), 0), BLOCK_Q) * BLOCK_Q
    whole_begin = tl.where(c0 + BLOCK_K > Tk, Tq, whole_begin)  # a key tile across the edge
    whole_end = (Tq // BLOCK_Q) * BLOCK_Q  # the query tiles inside Tq
    for g in range(GROUP):  # the query heads that read this key/value head
        h = kvh * GROUP + g
        q_head = q_ptr + b * stride_qb + h * stride_qh
        dout_head = dout_ptr + b * stride_db + h * stride_dh
        lse_head, D_head = lse_ptr + (b * NH + h) * Tq, D_ptr + (b * NH + h) * Tq
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, stride_qt, dout_head, stride_dt, lse_head,
                             D_head, cols, start, tl.minimum(whole_begin, Tq), Tq, Tk, HS, HV,
                             scale, True, CAUSAL, BLOCK_Q, BLOCK_HS, BLOCK_HV, DOT,
                             PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, stride_qt, dout_head, stride_dt, lse_head,
                             D_head, cols, whole_begin, whole_end, Tq, Tk, HS, HV, scale, False,
                             CAUSAL, BLOCK_Q, BLOCK_HS, BLOCK_HV, DOT, PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, stride_qt, dout_head, stride_dt, lse_head,
                             D_head, cols, tl.maximum(whole_begin, whole_end), Tq, Tq, Tk, HS, HV,
                             scale, True, CAUSAL, BLOCK_Q, BLOCK_HS, BLOCK_HV, DOT,
                             PRECISION)  # fmt: skip
    _store_tile(dk_ptr + b * stride_dkb + kvh * stride_dkh, dk * scale, cols, stride_dkt, Tk, HS,
                BLOCK_HS)
    _store_tile(dv_ptr + b * stride_dvb + kvh * stride_dvh, dv, cols, stride_dvt, Tk, HV, BLOCK_HV)


@triton.jit
def _dq_tiles(dq, q, dout, lse, D, k_ptr, stride_kt, v_ptr, stride_vt, rows, c_begin, c_end, Tq,
              Tk, HS, HV, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_K: tl.constexpr, BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr,
              DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """dq (bq, BHS) plus the key tiles [c_begin, c_end). MASKED as in _tile_weights."""
    for c0 in range(c_begin, c_end, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
        k = _load_tile(k_ptr, cols, stride_kt, Tk, HS, BLOCK_HS, DOT)  # (bk, BHS)
        v = _load_tile(v_ptr, cols, stride_vt, Tk, HV, BLOCK_HV, DOT)  # (bk, BHV)
        # P = exp(s - L);  dP = dout @ v^T;  dS = P * (dP - D)
        p = _tile_weights(q, k, lse, rows, cols, Tq, Tk, scale, MASKED, CAUSAL, PRECISION)
        dp = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # (bq, bk)
        dscores = (p * (dp - D[:, None])).to(k_ptr.dtype.element_ty).to(DOT)  # (bq, bk)
        # s = q @ k^T * scale
        dq += tl.dot(dscores, k, input_precision=PRECISION)  # (bq, BHS)
    return dq


@triton.jit
def _flash_backward_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, D_ptr, dq_ptr,
                              stride_qb, stride_qh, stride_qt, stride_kb, stride_kh, stride_kt,
                              stride_vb, stride_vh, stride_vt, stride_db, stride_dh, stride_dt,
                              stride_dqb, stride_dqh, stride_dqt, NH, Tq, Tk, HS, HV, GROUP,
                              scale, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_HS: tl.constexpr,
                              BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                              PRECISION: tl.constexpr):  # fmt: skip
    """Program (query tile, batch*head): dq (bq, hs), summed over the key tiles it sees: those
    it sees whole unmasked, then those across the diagonal or the edge. The query tiles go
    last to first (causal: the longest first), as in the forward."""
    r0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_Q
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // NH, bh % NH
    k_ptr += b * stride_kb + (h // GROUP) * stride_kh  # (Tk, hs)
    v_ptr += b * stride_vb + (h // GROUP) * stride_vh  # (Tk, hv)
    rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
    q = _load_tile(q_ptr + b * stride_qb + h * stride_qh, rows, stride_qt, Tq, HS, BLOCK_HS,
                   DOT)  # (bq, BHS)
    dout = _load_tile(dout_ptr + b * stride_db + h * stride_dh, rows, stride_dt, Tq, HV, BLOCK_HV,
                      DOT)  # (bq, BHV)
    lse = tl.load(lse_ptr + bh * Tq + rows, mask=rows < Tq, other=0.0)  # (bq,)
    D = tl.load(D_ptr + bh * Tq + rows, mask=rows < Tq, other=0.0)  # (bq,)
    dq = tl.zeros((BLOCK_Q, BLOCK_HS), tl.float32)  # (bq, BHS)
    end = tl.minimum(Tk, r0 + BLOCK_Q + Tk - Tq) if CAUSAL else Tk
    whole = _whole_key_tiles(r0, Tq, Tk, CAUSAL, BLOCK_K)
    dq = _dq_tiles(dq, q, dout, lse, D, k_ptr, stride_kt, v_ptr, stride_vt, rows, 0, whole, Tq,
                   Tk, HS, HV, scale, False, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT,
                   PRECISION)  # fmt: skip
    dq = _dq_tiles(dq, q, dout, lse, D, k_ptr, stride_kt, v_ptr, stride_vt, rows, whole, end, Tq,
                   Tk, HS, HV, scale, True, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT,
                   PRECISION)  # fmt: skip
    _store_tile(dq_ptr + b * stride_dqb + h * stride_dqh, dq * scale, rows, stride_dqt, Tq, HS,
                BLOCK_HS)


# Tiles of the backward, (query rows, key rows) per program, by the inputs' dtype: a dk/dv
# program holds a key tile and walks the query tiles, a dq program the reverse; each keeps its
# own tile tall (FlashAttention-2's backward; measured on an H100, benchmarks/results/gpu.md).
BACKWARD_BLOCKS = {"dkdv": {2: (64, 64), 4: (32, 64)}, "dq": {2: (64, 32), 4: (64, 32)}}
# Software-pipeline stages (loads in flight) by bytes per element: (forward, backward).
STAGES = {2: (4, 3), 4: (2, 2)}


@dataclass(frozen=True)
class _Launch:
    """One call's hyperparameters: what the backward needs of the forward's call."""

    causal: bool
    scale: float
    group: int  # query heads per key/value head
    shapes: tuple  # q's, k's and v's: the shapes of dq, dk, dv


def _heads_group(q, k, v) -> int:
    """NH / NKV, the query heads that share a key/value head (1: none shared). ValueError
    unless k, v have q's leading dims, or fewer heads (dim -3) that divide q's."""
    lead_q, lead_k = tuple(q.shape[:-2]), tuple(k.shape[:-2])
    gqa = (len(lead_q) >= 1 and len(lead_k) == len(lead_q) and lead_k[:-1] == lead_q[:-1]
           and lead_k[-1] >= 1 and lead_q[-1] % lead_k[-1] == 0)  # fmt: skip
    if tuple(v.shape[:-2]) != lead_k or not (lead_k == lead_q or gqa):
        raise ValueError(f"the Triton kernel needs k, v with q's leading dims, or fewer heads "
                         f"(dim -3) that divide q's, got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")  # fmt: skip
    return lead_q[-1] // lead_k[-1] if lead_q else 1


def _heads_shape(shape) -> tuple:
    """(..., T, h) -> (B, NH, T, h): NH the dim -3 (1 without one), B the dims before it."""
    *lead, T, h = shape
    return (math.prod(lead[:-1]), lead[-1] if lead else 1, T, h)


def _rows_fit(heads) -> bool:
    """Whether a head's rows of the (B, NH, T, h) view lie within 2^31 elements: the kernels
    offset rows in 32-bit integers (batches and heads in 64-bit)."""
    T, h = heads.shape[-2:]
    return heads.stride(-1) == 1 and (T - 1) * heads.stride(-2) + h < 2**31


def _as_heads(x):
    """x (..., T, h) as (B, NH, T, h) with its columns next to each other: a view of x (any
    strides between rows, heads and batches: the kernels take them), a copy only where no view
    has unit stride along h, or a head's rows lie too far apart (``_rows_fit``)."""
    x = x.reshape(_heads_shape(x.shape))
    return x if _rows_fit(x) else x.contiguous()


def _written_heads(name: str, x, shape, like):
    """The (B, NH, T, h) view of the tensor ``x`` a kernel writes into: ValueError unless it has
    ``shape`` and ``like``'s dtype and device, and such a view with unit stride along h."""
    if (not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape) or x.dtype != like.dtype
            or x.device != like.device):  # fmt: skip
        got = (f"{x.dtype} {tuple(x.shape)} on {x.device}" if isinstance(x, torch.Tensor)
               else type(x).__name__)  # fmt: skip
        raise ValueError(f"{name} must be a {like.dtype} tensor of shape {tuple(shape)} on "
                         f"{like.device}, got {got}")  # fmt: skip
    try:
        heads = x.view(_heads_shape(x.shape))
    except RuntimeError:
        heads = None
    if heads is None or not _rows_fit(heads):
        raise ValueError(f"{name} must be viewable as (B, NH, T, h) with its last dim contiguous "
                         f"and a head's rows within 2^31 elements, got strides "
                         f"{x.stride()}")  # fmt: skip
    return heads


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                            block_q: int = 64, block_k: int = 64, out=None,
                            num_warps: int | None = None, num_stages: int | None = None):
    """q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv) -> (out (..., Tq, hv), cache), as the
    layer, with hs, hv at most 128. The leading dims of k and v equal q's (no broadcast), except
    that k and v may have fewer heads (dim -3, GQA): NKV dividing NH, query head h reads
    key/value head h // (NH / NKV), as LLaMA's repeat_interleave.

    The kernels read q, k, v in place, with any strides between rows, heads and batches (q, k, v
    split from one (B, T, 3, NH, hs) projection need no copy), and write into ``out`` where one
    is given (a (..., Tq, hv) tensor of q's dtype, e.g. a view of (B, T, NH, hv), so that the
    heads come out side by side); None: a new one. The cache is the (B, NH, T, h) views of q,
    k, v, out, lse (..., Tq, 1) float32 and the settings. ``num_stages`` None: the dtype's STAGES.
    """
    group = _heads_group(q, k, v)
    # the layer's checks, on q's first NKV heads (the layer itself has no GQA)
    check_attention_inputs(q if group == 1 else q[..., : k.shape[-3], :, :], k, v, None, causal)
    check_tensors(q=q, k=k, v=v)
    (Tq, hs), (Tk, hv) = q.shape[-2:], v.shape[-2:]
    check_tile("block_q", block_q, least=16)
    check_tile("block_k", block_k, least=16)
    if Tq == 0 or max(hs, hv) > 128:
        raise ValueError(f"the Triton kernel needs Tq >= 1 and head sizes up to 128, got "
                         f"Tq={Tq}, hs={hs}, hv={hv}")  # fmt: skip
    if causal and Tq > Tk:
        raise ValueError(f"causal=True with Tq={Tq} > Tk={Tk} leaves queries without a key")
    out_shape = q.shape[:-1] + (hv,)
    if out is None:
        out = torch.empty(out_shape, dtype=q.dtype, device=q.device)  # (..., Tq, hv)
    out4 = _written_heads("out", out, out_shape, q)  # (B, NH, Tq, hv)
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    settings = _Launch(causal, scale, group, (q.shape, k.shape, v.shape))
    q4, k4, v4 = _as_heads(q), _as_heads(k), _as_heads(v)  # (B, NH or NKV, T, h)
    B, NH = q4.shape[:2]
    lse = torch.empty(q.shape[:-1] + (1,), dtype=torch.float32, device=q.device)  # (..., Tq, 1)
    _flash_forward_kernel[(triton.cdiv(Tq, block_q), B * NH)](
        q4, k4, v4, out4, lse, *_strides(q4, k4, v4, out4), NH, Tq, Tk, hs, hv, group, scale,
        **_constants(causal, (block_q, block_k), q.dtype, hs, hv, num_warps,
                     num_stages or STAGES[min(q.element_size(), 4)][0]))
    return out, (q4, k4, v4, out4, lse, settings)


def flash_attention_backward(dout, cache, *, dkdv_blocks: tuple | None = None,
                             dq_blocks: tuple | None = None, grads: tuple | None = None,
                             num_warps: int | None = None, num_stages: int | None = None):
    """dout (..., Tq, hv), read in place with any strides between rows, heads and batches ->
    (dq, dk, dv), each of its input's shape and dtype, written into ``grads`` where given (three
    tensors of those shapes and dtype, e.g. views of one (B, T, 3, NH, hs) buffer); None: new
    ones. ``dkdv_blocks``, ``dq_blocks``: the (query rows, key rows) tiles of the two kinds of
    programs; None: the dtype's BACKWARD_BLOCKS. ``num_stages`` None: the dtype's STAGES."""
    q4, k4, v4, out4, lse, settings = cache
    check_tensors(dout=dout)
    if tuple(dout.shape) != tuple(settings.shapes[0][:-1]) + (out4.shape[-1],):
        raise ValueError(f"dout must have out's shape {tuple(settings.shapes[0][:-1])} + "
                         f"({out4.shape[-1]},), got {tuple(dout.shape)}")  # fmt: skip
    dout4 = _as_heads(dout.to(q4.dtype))  # (B, NH, Tq, hv)
    (B, NH, Tq, hs), (Tk, hv) = q4.shape, v4.shape[-2:]
    size = min(q4.element_size(), 4)
    dkdv_blocks = dkdv_blocks or BACKWARD_BLOCKS["dkdv"][size]
    dq_blocks = dq_blocks or BACKWARD_BLOCKS["dq"][size]
    num_stages = num_stages or STAGES[size][1]
    for name, blocks in (("dkdv_blocks", dkdv_blocks), ("dq_blocks", dq_blocks)):
        for block in blocks:
            check_tile(name, block, least=16)
    if grads is None:
        grads = [torch.empty(shape, dtype=q4.dtype, device=q4.device) for shape in settings.shapes]
    elif not (isinstance(grads, (tuple, list)) and len(grads) == 3):
        raise ValueError(f"grads must be three tensors (dq, dk, dv), got {type(grads).__name__}")
    dq4, dk4, dv4 = (_written_heads(name, g, shape, q4) for name, g, shape in
                     zip(("dq", "dk", "dv"), grads, settings.shapes))  # fmt: skip
    D = torch.empty_like(lse)  # (..., Tq, 1) float32
    rows = 64
    _flash_backward_D_kernel[(triton.cdiv(Tq, rows), B * NH)](
        dout4, out4, D, *_strides(dout4, out4), NH, Tq, hv, BLOCK_Q=rows, BLOCK_HV=pow2(hv))
    group, scale = settings.group, settings.scale
    _flash_backward_dkdv_kernel[(triton.cdiv(Tk, dkdv_blocks[1]), B * NH // group)](
        q4, k4, v4, dout4, lse, D, dk4, dv4, *_strides(q4, k4, v4, dout4, dk4, dv4), NH, Tq, Tk,
        hs, hv, group, scale,
        **_constants(settings.causal, dkdv_blocks, q4.dtype, hs, hv, num_warps, num_stages))
    _flash_backward_dq_kernel[(triton.cdiv(Tq, dq_blocks[0]), B * NH)](
        q4, k4, v4, dout4, lse, D, dq4, *_strides(q4, k4, v4, dout4, dq4), NH, Tq, Tk, hs, hv,
        group, scale,
        **_constants(settings.causal, dq_blocks, q4.dtype, hs, hv, num_warps, num_stages))
    return tuple(grads)


def _strides(*heads) -> list:
    """The (batch, head, row) strides of each (B, NH, T, h) view, in order: the kernels' stride
    arguments."""
    return [stride for x in heads for stride in x.stride()[:3]]


def _constants(causal: bool, blocks: tuple, dtype, hs: int, hv: int, num_warps: int | None,
               num_stages: int) -> dict:  # fmt: skip
    """The compile-time arguments every flash kernel takes; ``blocks`` (query rows, key rows);
    ``num_warps`` None: 4 for head sizes up to 64, 8 above."""
    return dict(CAUSAL=causal, BLOCK_Q=blocks[0], BLOCK_K=blocks[1], BLOCK_HS=pow2(hs),
                BLOCK_HV=pow2(hv), DOT=dot_dtype(dtype), PRECISION=input_precision(),
                num_warps=num_warps or (4 if max(hs, hv) <= 64 else 8), num_stages=num_stages)
