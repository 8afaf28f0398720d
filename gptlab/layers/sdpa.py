"""Scaled dot-product attention: queries against keys and values, with an optional mask.

    scores = q @ k^T * scale                 (..., Tq, Tk)   scale = 1/sqrt(hs) unless given
    scores[i, j] = -inf where query i may not see key j           (mask AND causal)
    att = softmax(scores) along the keys      (..., Tq, Tk)   row i = the weights of query i
    out = att @ v                             (..., Tq, hv)

``mask``: a boolean array of any pattern that broadcasts to (..., Tq, Tk), True where query i
may attend to key j. ``causal=True`` aligns the queries with the LAST Tq keys, as when new
queries meet a KV cache: query i sits at position i + (Tk - Tq) and sees the keys
j <= i + (Tk - Tq); for Tq == Tk that is GPT's lower triangle. The two combine by AND. A query
that sees no key at all would get softmax(-inf, ..., -inf) = 0/0, so the forward refuses it.

The leading (batch, head) dims of q, k and v broadcast as in NumPy: k and v of shape
(B, 1, Tk, hs) serve every head of q (B, NH, Tq, hs). The output takes the broadcast shape, and
each gradient is summed back to the shape of its own input.

Backward, the forward lines in reverse; the softmax goes through its Jacobian (softmax.py),
where a hidden key has att = 0 and so passes no gradient on (the mask gets none itself):

    dv = att^T @ dout,  datt = dout @ v^T
    dscores = att * (datt - sum_j att * datt)
    dq = scale * dscores @ k,  dk = scale * dscores^T @ q

Book: chapter 7, "Attention, backward" (the row convention of the package's multi-head code).
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import array_device, array_namespace, to_numpy
from ..checks import require_float, require_ndim_at_least, require_same_dtype
from .softmax import softmax_backward, softmax_forward


def causal_mask(Tq: int, Tk: int, like):
    """(Tq, Tk) boolean, True where query i may see key j: j <= i + (Tk - Tq)."""
    xp = array_namespace(like)
    query_pos = xp.arange(Tk - Tq, Tk, device=array_device(like))  # (Tq,) among the keys
    key_pos = xp.arange(Tk, device=array_device(like))  # (Tk,)
    return key_pos[None, :] <= query_pos[:, None]  # (Tq, Tk)


def sdpa_forward(q, k, v, mask=None, *, causal: bool = False, scale: float | None = None):
    """q (..., Tq, hs), k (..., Tk, hs), v (..., Tk, hv), mask (..., Tq, Tk) bool or None
    -> out (..., Tq, hv). The cache is (q, k, v, att, softmax_cache, scale)."""
    xp = array_namespace(q, k, v, mask)
    check_attention_inputs(q, k, v, mask, causal)
    Tq, Tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    visible = causal_mask(Tq, Tk, q) if causal else None  # (Tq, Tk)
    if mask is not None:
        visible = mask if visible is None else xp.logical_and(mask, visible)  # (..., Tq, Tk)
        _require_every_query_sees_a_key(visible, causal)
    return attend(q, k, v, visible, scale)


def attend(q, k, v, visible, scale: float):
    """The formula of ``sdpa_forward`` once its inputs are checked: visible (..., Tq, Tk) bool
    or None -> (out (..., Tq, hv), cache). Unchecked: every query row must see a key
    (``sdpa_forward`` checks it; the check reads the mask back to the host, which a step captured
    as a CUDA graph cannot do)."""
    xp = array_namespace(q)
    scores = q @ k.mT * scale  # (..., Tq, Tk)
    if visible is not None:
        scores = xp.where(visible, scores, -math.inf)  # (..., Tq, Tk)
    att, softmax_cache = softmax_forward(scores, axis=-1)  # (..., Tq, Tk), rows sum to 1
    out = att @ v  # (..., Tq, hv)
    return out, (q, k, v, att, softmax_cache, scale)


def sdpa_backward(dout, cache):
    """dout (..., Tq, hv) -> (dq, dk, dv), each of its input's shape. The mask gets none."""
    q, k, v, att, softmax_cache, scale = cache
    # out = att @ v
    datt = dout @ v.mT  # (..., Tq, Tk)
    dv = _sum_to_shape(att.mT @ dout, v.shape)  # (..., Tk, hv)
    # att, softmax_cache = softmax_forward(scores, axis=-1): through the softmax Jacobian,
    # dscores = att * (datt - sum_j att * datt)
    (dscores,) = softmax_backward(datt, softmax_cache)  # (..., Tq, Tk)
    # scores = xp.where(visible, scores, -math.inf): a hidden key has att = 0 and so already
    # dscores = 0; visible scores pass dscores on unchanged, and the mask gets no gradient
    # scores = q @ k.mT * scale
    dq = _sum_to_shape(dscores @ k * scale, q.shape)  # (..., Tq, hs)
    dk = _sum_to_shape(dscores.mT @ q * scale, k.shape)  # (..., Tk, hs)
    return dq, dk, dv


def _sum_to_shape(x, shape):
    """Undo broadcasting: sum x over the leading axes it has beyond ``shape`` and over the axes
    where ``shape`` has 1 and x does not, so that the result has ``shape``."""
    xp = array_namespace(x)
    extra = len(x.shape) - len(shape)
    if extra > 0:
        x = xp.sum(x, axis=tuple(range(extra)))  # as many axes as shape
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if stretched:
        x = xp.sum(x, axis=stretched, keepdims=True)  # shape
    return x


def _broadcast(shapes) -> tuple | None:
    """The NumPy broadcast of some shapes, or None when they do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*(tuple(s) for s in shapes)))
    except ValueError:
        return None


def check_attention_inputs(q, k, v, mask, causal) -> None:
    """TypeError for dtypes (and a mask that is not boolean), ValueError for shapes and for
    queries that causal=True leaves without a key; each message names the argument."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        require_float(name, a)
        require_ndim_at_least(name, a, 2)
    require_same_dtype("q", q, "k", k)
    require_same_dtype("q", q, "v", v)
    (Tq, hs), (Tk, hs_k) = q.shape[-2:], k.shape[-2:]
    if hs_k != hs:
        raise ValueError(f"k has head size {hs_k} but q has {hs}: q (..., Tq, hs) and "
                         f"k (..., Tk, hs) must share hs")  # fmt: skip
    if v.shape[-2] != Tk:
        raise ValueError(f"v has {v.shape[-2]} positions but k has {Tk}: k (..., Tk, hs) and "
                         f"v (..., Tk, hv) must share Tk")  # fmt: skip
    lead = _broadcast([q.shape[:-2], k.shape[:-2], v.shape[:-2]])
    if lead is None:
        raise ValueError(f"the leading dims of q {tuple(q.shape)}, k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} do not broadcast")  # fmt: skip
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    if mask is not None:
        if not hasattr(mask, "dtype") or not array_namespace(mask).isdtype(mask.dtype, "bool"):
            got = f"dtype {mask.dtype}" if hasattr(mask, "dtype") else type(mask).__name__
            raise TypeError(f"mask must be a boolean array (True = may attend), got {got}")
        weights = (*lead, Tq, Tk)  # the shape of att
        if _broadcast([mask.shape, weights]) != weights:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, which does not broadcast to "
                             f"the attention weights' shape (..., Tq, Tk) = {weights}")  # fmt: skip
    if Tq > 0 and Tk == 0:
        raise ValueError("query row 0 can see no key: k and v have no positions (Tk=0)")
    if causal and Tq > Tk:
        raise ValueError(f"query row 0 can see no key: causal=True aligns the {Tq} queries with "
                         f"the last of the {Tk} keys, so the first {Tq - Tk} come before every "
                         "key")  # fmt: skip


def _require_every_query_sees_a_key(visible, causal: bool) -> None:
    """ValueError naming the first query row whose keys are all hidden (its softmax is 0/0)."""
    xp = array_namespace(visible)
    blind = xp.logical_not(xp.any(visible, axis=-1))  # (..., Tq)
    if bool(xp.any(blind)):
        first = [int(i) for i in np.argwhere(to_numpy(blind))[0]]  # [*leading index, row]
        at = f" (mask's leading index {tuple(first[:-1])})" if len(first) > 1 else ""
        by = "the mask and causal=True together hide" if causal else "the mask hides"
        raise ValueError(f"query row {first[-1]}{at} can see no key: {by} every key from "
                         "it, and its softmax would be 0/0 (NaN); every query needs at least "
                         "one visible key")  # fmt: skip
