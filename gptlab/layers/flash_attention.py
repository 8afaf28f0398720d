"""Flash attention: exact scaled dot-product attention in tiles, never holding the (Tq, Tk) weights.

Dao et al. 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with IO-Awareness".
The same function as ``sdpa.py`` (no mask argument; ``causal`` as there), computed one tile of
``block_q`` queries by ``block_k`` keys at a time with the ONLINE softmax. Per query row it keeps
a running max m, a running sum l = sum_j exp(s_j - m) and the unnormalized output acc; a new tile
of scores s (its max m_tile) updates them as

    m_new = max(m, m_tile)
    l   = exp(m - m_new) * l   + sum_j exp(s_j - m_new)
    acc = exp(m - m_new) * acc + exp(s - m_new) @ v_tile        (the old terms rescaled to m_new)

and after the last tile out = acc / l and the row's log-sum-exp L = m + log(l). The cache keeps
q, k, v (the inputs themselves), out and L: O(T) numbers per row instead of sdpa's O(T) weights
PER QUERY, i.e. O(T^2).

Backward, from the same tiles. With L the weights of a tile are recomputed, P = exp(s - L), and
sdpa's backward applies to it tile by tile; the softmax Jacobian's row sum sum_j P_ij dP_ij needs
the whole row, but it equals D_i = sum_d dout_id out_id (the paper's D_i), known before any tile:

    dv += P^T @ dout,   dP = dout @ v^T,   dS = P * (dP - D)
    dq += scale * dS @ k,   dk += scale * dS^T @ q

Causal: query i sees the keys j <= i + (Tk - Tq), as in sdpa. A tile entirely above that
diagonal is skipped (its weights are all 0), a tile across it is masked, a tile below needs no
mask. Block sizes change the order of the additions, not the result.

Book: chapter 14, "Flash attention".
"""

from __future__ import annotations

import math

from ..backend import array_device, array_namespace
from .sdpa import _broadcast, check_attention_inputs, _sum_to_shape


def flash_attention_forward(q, k, v, *, causal: bool = False, scale: float | None = None,
                            block_q: int = 128, block_k: int = 128):  # fmt: skip
    """q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv) -> out (..., Tq, hv), leading dims
    broadcast as in sdpa. The cache is (q, k, v, out, lse (..., Tq, 1), settings)."""
    xp = array_namespace(q, k, v)
    check_attention_inputs(q, k, v, None, causal)
    _check_block("block_q", block_q)
    _check_block("block_k", block_k)
    if q.shape[-2] == 0:
        raise ValueError("q has no positions (Tq=0): flash attention needs at least one query")
    Tq, hv = q.shape[-2], v.shape[-1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    settings = _Settings(Tq, k.shape[-2], scale, causal, block_q, block_k)
    lead = _broadcast([q.shape[:-2], k.shape[:-2], v.shape[:-2]])
    dtype, device = q.dtype, array_device(q)
    out_rows, lse_rows = [], []
    for r0, r1 in _blocks(Tq, block_q):
        q_tile = q[..., r0:r1, :]  # (..., bq, hs)
        m = xp.full((*lead, r1 - r0, 1), -math.inf, dtype=dtype, device=device)  # (..., bq, 1)
        l = xp.zeros((*lead, r1 - r0, 1), dtype=dtype, device=device)  # (..., bq, 1)
        acc = xp.zeros((*lead, r1 - r0, hv), dtype=dtype, device=device)  # (..., bq, hv)
        for c0, c1 in settings.key_tiles(r0, r1):
            scores = settings.tile_scores(q_tile, k[..., c0:c1, :], r0, c0)  # (..., bq, bk)
            m_new = xp.maximum(m, xp.max(scores, axis=-1, keepdims=True))  # (..., bq, 1)
            p = xp.exp(scores - m_new)  # (..., bq, bk), hidden keys 0
            rescale = xp.exp(m - m_new)  # (..., bq, 1), 0 on the first tile (m = -inf)
            l = rescale * l + xp.sum(p, axis=-1, keepdims=True)  # (..., bq, 1)
            acc = rescale * acc + p @ v[..., c0:c1, :]  # (..., bq, hv)
            m = m_new
        out_rows.append(acc / l)  # (..., bq, hv)
        lse_rows.append(m + xp.log(l))  # (..., bq, 1)
    out = xp.concat(out_rows, axis=-2)  # (..., Tq, hv)
    lse = xp.concat(lse_rows, axis=-2)  # (..., Tq, 1)
    return out, (q, k, v, out, lse, settings)


def flash_attention_backward(dout, cache):
    """dout (..., Tq, hv) -> (dq, dk, dv), each of its input's shape."""
    xp = array_namespace(dout)
    q, k, v, out, lse, settings = cache
    Tq, Tk, hs, hv = settings.Tq, settings.Tk, q.shape[-1], v.shape[-1]
    lead, dtype, device = tuple(out.shape[:-2]), q.dtype, array_device(q)
    key_tiles = _blocks(Tk, settings.block_k)
    dk_tiles = {c0: xp.zeros((*lead, c1 - c0, hs), dtype=dtype, device=device)
                for c0, c1 in key_tiles}  # fmt: skip
    dv_tiles = {c0: xp.zeros((*lead, c1 - c0, hv), dtype=dtype, device=device)
                for c0, c1 in key_tiles}  # fmt: skip
    # the softmax Jacobian's row sum over ALL keys, known before any tile:
    # sum_j att_ij datt_ij = sum_j att_ij (dout_i . v_j) = dout_i . out_i
    D = xp.sum(dout * out, axis=-1, keepdims=True)  # (..., Tq, 1)
    dq_rows = []
    for r0, r1 in _blocks(Tq, settings.block_q):
        q_tile, dout_tile = q[..., r0:r1, :], dout[..., r0:r1, :]  # (..., bq, hs), (..., bq, hv)
        dq_tile = xp.zeros((*lead, r1 - r0, hs), dtype=dtype, device=device)  # (..., bq, hs)
        for c0, c1 in settings.key_tiles(r0, r1):
            k_tile, v_tile = k[..., c0:c1, :], v[..., c0:c1, :]  # (..., bk, hs), (..., bk, hv)
            scores = settings.tile_scores(q_tile, k_tile, r0, c0)  # (..., bq, bk)
            # p = exp(scores - m_new) over all tiles, normalized by l: att = exp(scores - L)
            att = xp.exp(scores - lse[..., r0:r1, :])  # (..., bq, bk)
            # acc = rescale * acc + p @ v_tile, i.e. out = att @ v
            dv_tiles[c0] += att.mT @ dout_tile  # (..., bk, hv)
            datt = dout_tile @ v_tile.mT  # (..., bq, bk)
            # att = softmax(scores): dscores = att * (datt - sum_j att * datt)
            dscores = att * (datt - D[..., r0:r1, :])  # (..., bq, bk)
            # scores = q_tile @ k_tile.mT * scale
            dq_tile += dscores @ k_tile * settings.scale  # (..., bq, hs)
            dk_tiles[c0] += dscores.mT @ q_tile * settings.scale  # (..., bk, hs)
        dq_rows.append(dq_tile)
    dq = _sum_to_shape(xp.concat(dq_rows, axis=-2), q.shape)  # (..., Tq, hs)
    dk = _sum_to_shape(xp.concat(list(dk_tiles.values()), axis=-2), k.shape)  # (..., Tk, hs)
    dv = _sum_to_shape(xp.concat(list(dv_tiles.values()), axis=-2), v.shape)  # (..., Tk, hv)
    return dq, dk, dv


class _Settings:
    """The hyperparameters of one call, and the tiling they imply."""

    def __init__(self, Tq: int, Tk: int, scale: float, causal: bool, block_q: int, block_k: int):
        self.Tq, self.Tk, self.scale, self.causal = Tq, Tk, scale, causal
        self.block_q, self.block_k = block_q, block_k
        self.offset = Tk - Tq  # causal: query i sees the keys j <= i + offset

    def key_tiles(self, r0: int, r1: int):
        """The key tiles (c0, c1) that queries r0..r1-1 see at least in part: causal skips
        the tiles that start after the last query's last key, r1 - 1 + offset."""
        end = min(self.Tk, r1 + self.offset) if self.causal else self.Tk
        return [(c0, c1) for c0, c1 in _blocks(self.Tk, self.block_k) if c0 < end]

    def tile_scores(self, q_tile, k_tile, r0: int, c0: int):
        """scores = q_tile @ k_tile^T * scale (..., bq, bk), -inf where causal hides a key."""
        xp = array_namespace(q_tile, k_tile)
        scores = q_tile @ k_tile.mT * self.scale  # (..., bq, bk)
        c1 = c0 + k_tile.shape[-2]
        if not self.causal or c1 - 1 <= r0 + self.offset:  # every key visible to every query
            return scores
        query_pos = xp.arange(r0, r0 + q_tile.shape[-2], device=array_device(q_tile))  # (bq,)
        key_pos = xp.arange(c0, c1, device=array_device(q_tile))  # (bk,)
        visible = key_pos[None, :] <= query_pos[:, None] + self.offset  # (bq, bk)
        return xp.where(visible, scores, -math.inf)  # (..., bq, bk)


def _blocks(n: int, size: int):
    """(start, stop) of consecutive blocks of ``size`` covering range(n), the last one shorter."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def _check_block(name: str, size) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{name} must be a positive integer (rows per tile), got {size!r}")
