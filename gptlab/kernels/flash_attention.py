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
over tiles is split in two or three: the whole tiles, and the masked ones). Edge tiles (T not a
multiple of the tile, head sizes not a power of two) are masked on load. Tiles, warps and pipeline
stages were picked by a sweep on an H100 (GPT-2's heads, T = 1024 and 4096, bf16;
benchmarks/results/gpu.md): the forward takes 64 queries x 64 keys, the backward BACKWARD_BLOCKS, 4
warps for head sizes up to 64 (8 above), and STAGES by the dtype's size (float32 tiles fill shared
memory sooner).

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

from ..layers.sdpa import _check_inputs
from .launch import check_tensors, check_tile, dot_dtype, input_precision, pow2


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
def _forward_tiles(q, k_ptr, v_ptr, m, l, acc, rows, c_begin, c_end, Tq, Tk, HS, HV, scale,
                   MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                   PRECISION: tl.constexpr):  # fmt: skip
    """The online softmax over the key tiles [c_begin, c_end): (m, l, acc) updated. MASKED as
    in _tile_weights."""
    ds, dv = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)  # (BHS,), (BHV,)
    for c0 in range(c_begin, c_end, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
        k = tl.load(k_ptr + cols[:, None] * HS + ds[None, :],
                    mask=(cols[:, None] < Tk) & (ds[None, :] < HS), other=0.0).to(DOT)  # (bk, BHS)
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
        v = tl.load(v_ptr + cols[:, None] * HV + dv[None, :],
                    mask=(cols[:, None] < Tk) & (dv[None, :] < HV), other=0.0).to(DOT)  # (bk, BHV)
        p = p.to(v_ptr.dtype.element_ty).to(DOT)  # P in the inputs' dtype, for the tensor cores
        acc = rescale[:, None] * acc + tl.dot(p, v, input_precision=PRECISION)  # (bq, BHV)
        m = m_new
    return m, l, acc


@triton.jit
def _flash_forward_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, Tq, Tk, HS, HV, GROUP, scale,
                          CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                          BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                          PRECISION: tl.constexpr):  # fmt: skip
    """Program (query tile, batch*head): out (bq, hv) and L (bq,) of its rows. Query head bh
    reads key/value head bh // GROUP. The key tiles every row sees whole come first, unmasked;
    then the tiles across the diagonal or the edge, masked."""
    r0 = tl.program_id(0) * BLOCK_Q
    bh = tl.program_id(1).to(tl.int64)
    q_ptr += bh * Tq * HS
    k_ptr += (bh // GROUP) * Tk * HS
    v_ptr += (bh // GROUP) * Tk * HV
    rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
    ds, dv = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)  # (BHS,), (BHV,)
    q = tl.load(q_ptr + rows[:, None] * HS + ds[None, :],
                mask=(rows[:, None] < Tq) & (ds[None, :] < HS), other=0.0).to(DOT)  # (bq, BHS)
    m = tl.full((BLOCK_Q,), -float("inf"), tl.float32)  # (bq,) running max
    l = tl.zeros((BLOCK_Q,), tl.float32)  # (bq,) running sum of exp(s - m)
    acc = tl.zeros((BLOCK_Q, BLOCK_HV), tl.float32)  # (bq, BHV) unnormalized output
    end = tl.minimum(Tk, r0 + BLOCK_Q + Tk - Tq) if CAUSAL else Tk  # the last key any row sees + 1
    whole = _whole_key_tiles(r0, Tq, Tk, CAUSAL, BLOCK_K)
    m, l, acc = _forward_tiles(q, k_ptr, v_ptr, m, l, acc, rows, 0, whole, Tq, Tk, HS, HV, scale,
                               False, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT, PRECISION)
    m, l, acc = _forward_tiles(q, k_ptr, v_ptr, m, l, acc, rows, whole, end, Tq, Tk, HS, HV,
                               scale, True, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT, PRECISION)
    out = acc / l[:, None]  # (bq, BHV)
    tl.store(out_ptr + bh * Tq * HV + rows[:, None] * HV + dv[None, :], out,
             mask=(rows[:, None] < Tq) & (dv[None, :] < HV))
    tl.store(lse_ptr + bh * Tq + rows, m + tl.log(l), mask=rows < Tq)  # L = m + log(l)


@triton.jit
def _flash_backward_D_kernel(dout_ptr, out_ptr, D_ptr, N, HV, BLOCK_Q: tl.constexpr,
                             BLOCK_HV: tl.constexpr):  # fmt: skip
    """D = rowsum(dout * out) (bq,) of BLOCK_Q of the N = B*NH*Tq rows: the softmax Jacobian's
    row sum, sum_j P_ij dP_ij."""
    rows = tl.program_id(0) * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (bq,)
    dv = tl.arange(0, BLOCK_HV)
    at = rows[:, None].to(tl.int64) * HV + dv[None, :]  # (bq, BHV)
    mask = (rows[:, None] < N) & (dv[None, :] < HV)
    dout = tl.load(dout_ptr + at, mask=mask, other=0.0).to(tl.float32)  # (bq, BHV)
    out = tl.load(out_ptr + at, mask=mask, other=0.0).to(tl.float32)  # (bq, BHV)
    tl.store(D_ptr + rows, tl.sum(dout * out, 1), mask=rows < N)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_ptr, dout_ptr, lse_ptr, D_ptr, cols, r_begin, r_end, Tq, Tk, HS,
                HV, scale, MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_Q: tl.constexpr,
                BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
                PRECISION: tl.constexpr):  # fmt: skip
    """dk (bk, BHS), dv (bk, BHV) plus the query tiles [r_begin, r_end) of one head (q_ptr,
    dout_ptr, lse_ptr, D_ptr at that head). MASKED as in _tile_weights."""
    ds, dvs = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)
    for r0 in range(r_begin, r_end, BLOCK_Q):
        rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
        q = tl.load(q_ptr + rows[:, None] * HS + ds[None, :],
                    mask=(rows[:, None] < Tq) & (ds[None, :] < HS), other=0.0).to(DOT)
        dout = tl.load(dout_ptr + rows[:, None] * HV + dvs[None, :],
                       mask=(rows[:, None] < Tq) & (dvs[None, :] < HV), other=0.0).to(DOT)
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
                                Tq, Tk, HS, HV, GROUP, scale, CAUSAL: tl.constexpr,
                                BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr,
                                DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Program (key tile, batch*key/value head): dk (bk, hs) and dv (bk, hv) of its keys, summed
    over the query tiles that see them, of each of the GROUP query heads that read them. The
    query tiles across the diagonal and past Tq are masked, those that see the key tile whole
    are not."""
    c0 = tl.program_id(0) * BLOCK_K
    kvh = tl.program_id(1).to(tl.int64)
    cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
    ds, dvs = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)
    k_at = kvh * Tk * HS + cols[:, None] * HS + ds[None, :]  # (bk, BHS)
    v_at = kvh * Tk * HV + cols[:, None] * HV + dvs[None, :]  # (bk, BHV)
    k_mask = (cols[:, None] < Tk) & (ds[None, :] < HS)
    v_mask = (cols[:, None] < Tk) & (dvs[None, :] < HV)
    k = tl.load(k_ptr + k_at, mask=k_mask, other=0.0).to(DOT)  # (bk, BHS)
    v = tl.load(v_ptr + v_at, mask=v_mask, other=0.0).to(DOT)  # (bk, BHV)
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
        bh = kvh * GROUP + g
        q_head, dout_head = q_ptr + bh * Tq * HS, dout_ptr + bh * Tq * HV
        lse_head, D_head = lse_ptr + bh * Tq, D_ptr + bh * Tq
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, dout_head, lse_head, D_head, cols, start,
                             tl.minimum(whole_begin, Tq), Tq, Tk, HS, HV, scale, True, CAUSAL,
                             BLOCK_Q, BLOCK_HS, BLOCK_HV, DOT, PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, dout_head, lse_head, D_head, cols, whole_begin,
                             whole_end, Tq, Tk, HS, HV, scale, False, CAUSAL, BLOCK_Q, BLOCK_HS,
                             BLOCK_HV, DOT, PRECISION)  # fmt: skip
        dk, dv = _dkdv_tiles(dk, dv, k, v, q_head, dout_head, lse_head, D_head, cols,
                             tl.maximum(whole_begin, whole_end), Tq, Tq, Tk, HS, HV, scale, True,
                             CAUSAL, BLOCK_Q, BLOCK_HS, BLOCK_HV, DOT, PRECISION)  # fmt: skip
    tl.store(dk_ptr + k_at, dk * scale, mask=k_mask)
    tl.store(dv_ptr + v_at, dv, mask=v_mask)


@triton.jit
def _dq_tiles(dq, q, dout, lse, D, k_ptr, v_ptr, rows, c_begin, c_end, Tq, Tk, HS, HV, scale,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr, DOT: tl.constexpr,
              PRECISION: tl.constexpr):  # fmt: skip
    """dq (bq, BHS) plus the key tiles [c_begin, c_end). MASKED as in _tile_weights."""
    ds, dvs = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)
    for c0 in range(c_begin, c_end, BLOCK_K):
        cols = c0 + tl.arange(0, BLOCK_K)  # (bk,)
        k = tl.load(k_ptr + cols[:, None] * HS + ds[None, :],
                    mask=(cols[:, None] < Tk) & (ds[None, :] < HS), other=0.0).to(DOT)  # (bk, BHS)
        v = tl.load(v_ptr + cols[:, None] * HV + dvs[None, :],
                    mask=(cols[:, None] < Tk) & (dvs[None, :] < HV), other=0.0).to(DOT)  # (bk, BHV)
        # P = exp(s - L);  dP = dout @ v^T;  dS = P * (dP - D)
        p = _tile_weights(q, k, lse, rows, cols, Tq, Tk, scale, MASKED, CAUSAL, PRECISION)
        dp = tl.dot(dout, tl.trans(v), input_precision=PRECISION)  # (bq, bk)
        dscores = (p * (dp - D[:, None])).to(k_ptr.dtype.element_ty).to(DOT)  # (bq, bk)
        # s = q @ k^T * scale
        dq += tl.dot(dscores, k, input_precision=PRECISION)  # (bq, BHS)
    return dq


@triton.jit
def _flash_backward_dq_kernel(q_ptr, k_ptr, v_ptr, dout_ptr, lse_ptr, D_ptr, dq_ptr,
                              Tq, Tk, HS, HV, GROUP, scale, CAUSAL: tl.constexpr,
                              BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_HS: tl.constexpr, BLOCK_HV: tl.constexpr,
                              DOT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """Program (query tile, batch*head): dq (bq, hs), summed over the key tiles it sees: those
    it sees whole unmasked, then those across the diagonal or the edge."""
    r0 = tl.program_id(0) * BLOCK_Q
    bh = tl.program_id(1).to(tl.int64)
    k_ptr += (bh // GROUP) * Tk * HS
    v_ptr += (bh // GROUP) * Tk * HV
    rows = r0 + tl.arange(0, BLOCK_Q)  # (bq,)
    ds, dvs = tl.arange(0, BLOCK_HS), tl.arange(0, BLOCK_HV)
    q_at = bh * Tq * HS + rows[:, None] * HS + ds[None, :]  # (bq, BHS)
    q_mask = (rows[:, None] < Tq) & (ds[None, :] < HS)
    q = tl.load(q_ptr + q_at, mask=q_mask, other=0.0).to(DOT)  # (bq, BHS)
    dout = tl.load(dout_ptr + bh * Tq * HV + rows[:, None] * HV + dvs[None, :],
                   mask=(rows[:, None] < Tq) & (dvs[None, :] < HV), other=0.0).to(DOT)  # (bq, BHV)
    lse = tl.load(lse_ptr + bh * Tq + rows, mask=rows < Tq, other=0.0)  # (bq,)
    D = tl.load(D_ptr + bh * Tq + rows, mask=rows < Tq, other=0.0)  # (bq,)
    dq = tl.zeros((BLOCK_Q, BLOCK_HS), tl.float32)  # (bq, BHS)
    end = tl.minimum(Tk, r0 + BLOCK_Q + Tk - Tq) if CAUSAL else Tk
    whole = _whole_key_tiles(r0, Tq, Tk, CAUSAL, BLOCK_K)
    dq = _dq_tiles(dq, q, dout, lse, D, k_ptr, v_ptr, rows, 0, whole, Tq, Tk, HS, HV, scale,
                   False, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT, PRECISION)
    dq = _dq_tiles(dq, q, dout, lse, D, k_ptr, v_ptr, rows, whole, end, Tq, Tk, HS, HV, scale,
                   True, CAUSAL, BLOCK_K, BLOCK_HS, BLOCK_HV, DOT, PRECISION)
    tl.store(dq_ptr + q_at, dq * scale, mask=q_mask)


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


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                            block_q: int = 64, block_k: int = 64, num_warps: int | None = None,
                            num_stages: int | None = None):  # fmt: skip
    """q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv) -> (out (..., Tq, hv), cache), as the
    layer, with hs, hv at most 128. The leading dims of k and v equal q's (no broadcast), except
    that k and v may have fewer heads (dim -3, GQA): NKV dividing NH, query head h reads
    key/value head h // (NH / NKV), as LLaMA's repeat_interleave. The cache is (q, k, v, out,
    lse (..., Tq, 1) float32, settings). ``num_stages`` None: the dtype's STAGES.
    """
    group = _heads_group(q, k, v)
    # the layer's checks, on q's first NKV heads (the layer itself has no GQA)
    _check_inputs(q if group == 1 else q[..., : k.shape[-3], :, :], k, v, None, causal)
    check_tensors(q=q, k=k, v=v)
    (Tq, hs), (Tk, hv) = q.shape[-2:], v.shape[-2:]
    check_tile("block_q", block_q, least=16)
    check_tile("block_k", block_k, least=16)
    if Tq == 0 or max(hs, hv) > 128:
        raise ValueError(f"the Triton kernel needs Tq >= 1 and head sizes up to 128, got "
                         f"Tq={Tq}, hs={hs}, hv={hv}")  # fmt: skip
    if causal and Tq > Tk:
        raise ValueError(f"causal=True with Tq={Tq} > Tk={Tk} leaves queries without a key")
    scale = 1.0 / math.sqrt(hs) if scale is None else float(scale)
    settings = _Launch(causal, scale, group)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    BH = math.prod(q.shape[:-2])
    out = torch.empty(q.shape[:-1] + (hv,), dtype=q.dtype, device=q.device)  # (..., Tq, hv)
    lse = torch.empty(q.shape[:-1] + (1,), dtype=torch.float32, device=q.device)  # (..., Tq, 1)
    _flash_forward_kernel[(triton.cdiv(Tq, block_q), BH)](
        q, k, v, out, lse, Tq, Tk, hs, hv, group, scale,
        **_constants(causal, (block_q, block_k), q.dtype, hs, hv, num_warps,
                     num_stages or STAGES[min(q.element_size(), 4)][0]))
    return out, (q, k, v, out, lse, settings)


def flash_attention_backward(dout, cache, *, dkdv_blocks: tuple | None = None,
                             dq_blocks: tuple | None = None, num_warps: int | None = None,
                             num_stages: int | None = None):  # fmt: skip
    """dout (..., Tq, hv) -> (dq, dk, dv), each of its input's shape and dtype. ``dkdv_blocks``,
    ``dq_blocks``: the (query rows, key rows) tiles of the two kinds of programs; None: the
    dtype's BACKWARD_BLOCKS. ``num_stages`` None: the dtype's STAGES."""
    q, k, v, out, lse, settings = cache
    check_tensors(dout=dout)
    dout = dout.to(q.dtype).contiguous()
    (Tq, hs), (Tk, hv) = q.shape[-2:], v.shape[-2:]
    BH = math.prod(q.shape[:-2])
    size = min(q.element_size(), 4)
    dkdv_blocks = dkdv_blocks or BACKWARD_BLOCKS["dkdv"][size]
    dq_blocks = dq_blocks or BACKWARD_BLOCKS["dq"][size]
    num_stages = num_stages or STAGES[size][1]
    for name, blocks in (("dkdv_blocks", dkdv_blocks), ("dq_blocks", dq_blocks)):
        for block in blocks:
            check_tile(name, block, least=16)
    D = torch.empty_like(lse)  # (..., Tq, 1) float32
    rows = 64
    _flash_backward_D_kernel[(triton.cdiv(BH * Tq, rows),)](
        dout, out, D, BH * Tq, hv, BLOCK_Q=rows, BLOCK_HV=pow2(hv))
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    group, scale = settings.group, settings.scale
    _flash_backward_dkdv_kernel[(triton.cdiv(Tk, dkdv_blocks[1]), BH // group)](
        q, k, v, dout, lse, D, dk, dv, Tq, Tk, hs, hv, group, scale,
        **_constants(settings.causal, dkdv_blocks, q.dtype, hs, hv, num_warps, num_stages))
    _flash_backward_dq_kernel[(triton.cdiv(Tq, dq_blocks[0]), BH)](
        q, k, v, dout, lse, D, dq, Tq, Tk, hs, hv, group, scale,
        **_constants(settings.causal, dq_blocks, q.dtype, hs, hv, num_warps, num_stages))
    return dq, dk, dv


def _constants(causal: bool, blocks: tuple, dtype, hs: int, hv: int, num_warps: int | None,
               num_stages: int) -> dict:  # fmt: skip
    """The compile-time arguments every flash kernel takes; ``blocks`` (query rows, key rows);
    ``num_warps`` None: 4 for head sizes up to 64, 8 above."""
    return dict(CAUSAL=causal, BLOCK_Q=blocks[0], BLOCK_K=blocks[1], BLOCK_HS=pow2(hs),
                BLOCK_HV=pow2(hv), DOT=dot_dtype(dtype), PRECISION=input_precision(),
                num_warps=num_warps or (4 if max(hs, hv) <= 64 else 8), num_stages=num_stages)
