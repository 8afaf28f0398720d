"""Grouped-query attention (GQA, Ainslie et al. 2023) and multi-query attention (MQA, Shazeer
2019): NH query heads share NKV key/value heads, G = NH / NKV query heads to each.

    G = NH / NKV                                    query heads per key/value head
    query head h reads key/value head h // G        (h = n * G + g: group n, member g)
    out[:, h] = sdpa(q[:, h], k[:, h // G], v[:, h // G])                 (B, NH, Tq, hv)

NKV = NH is multi-head attention (G = 1); NKV = 1 is multi-query attention (every query head
reads the one k and v). The grouping is Hugging Face LlamaAttention's ``repeat_kv`` and torch's
``enable_gqa=True``: repeating each key/value head G times in a row, k_rep[:, h] = k[:, h // G],
and running multi-head attention gives the same output. Nothing is repeated here: q is viewed as
(B, NKV, G, Tq, hs) and k, v as (B, NKV, 1, Tk, hs), and sdpa broadcasts the one k[:, n], v[:, n]
to the G query heads of group n.

Backward. Key head n enters the scores of all G query heads of its group,
scores[n, g] = q[n, g] @ k[n]^T * scale, and value head n all their outputs,
out[n, g] = att[n, g] @ v[n]. An input used in several places receives the sum of the gradients
of its uses (the multivariable chain rule), so with sdpa's dscores:

    dk[n] = sum_g scale * dscores[n, g]^T @ q[n, g],    dv[n] = sum_g att[n, g]^T @ dout[n, g]
    dq[n, g] = scale * dscores[n, g] @ k[n]             (each query head is used once: no sum)

That sum over g is what sdpa_backward does when it sums a broadcast gradient back to the shape
(B, NKV, 1, Tk, hs) of k and v: the multi-head backward on repeated heads, the G copies of each
key/value head's gradient then added up.

The attention layer of LLaMA-style models puts bias-free projections around it:

    q = heads(x @ wq) (B, NH, T, hs),  k = heads(x @ wk), v = heads(x @ wv) (B, NKV, T, hs)
    q, k = rotate(q), rotate(k)         optional: a rotation by position, such as RoPE
    y = merge_heads(gqa(q, k, v)) @ wo                                      (B, T, C)

Generation keeps k and v of every layer: 2 * n_layer * B * NKV * T * hs numbers, NH / NKV times
fewer than multi-head attention keeps (``kv_cache_size``).

Book: chapter 17, "Today's blocks", "Grouped queries".
"""

from __future__ import annotations

from typing import NamedTuple

from ..backend import array_namespace
from ..checks import require_float, require_same_dtype, require_shape
from .attention import _check_mask, merge_heads, split_heads
from .linear import linear_backward, linear_forward
from .sdpa import _broadcast, sdpa_backward, sdpa_forward


def gqa_forward(q, k, v, mask=None, *, causal: bool = True):
    """q (B, NH, Tq, hs), k (B, NKV, Tk, hs), v (B, NKV, Tk, hv), mask None or bool broadcasting
    to (B, NH, Tq, Tk) -> out (B, NH, Tq, hv); query head h reads key/value head h // (NH / NKV).
    ``causal`` aligns the queries with the last Tq keys (sdpa). The cache is sdpa's.
    Any leading dims (..., NH, Tq, hs) work as B does (the same in q, k and v)."""
    xp = array_namespace(q, k, v, mask)
    _check_inputs(q, k, v, mask)
    *B, NH, Tq, hs = q.shape
    NKV = k.shape[-3]
    G = NH // NKV
    q_grouped = xp.reshape(q, (*B, NKV, G, Tq, hs))  # (B, NKV, G, Tq, hs), head h = n * G + g
    k_grouped = xp.expand_dims(k, axis=-3)  # (B, NKV, 1, Tk, hs), shared by the G of group n
    v_grouped = xp.expand_dims(v, axis=-3)  # (B, NKV, 1, Tk, hv)
    mask = _group_mask(mask, NKV, G)  # (..., Tq, Tk) or None
    out, cache = sdpa_forward(q_grouped, k_grouped, v_grouped, mask, causal=causal)
    return xp.reshape(out, (*B, NH, Tq, out.shape[-1])), cache  # (B, NH, Tq, hv)


def gqa_backward(dout, cache):
    """dout (B, NH, Tq, hv) -> (dq (B, NH, Tq, hs), dk (B, NKV, Tk, hs), dv (B, NKV, Tk, hv))."""
    xp = array_namespace(dout)
    *B, NKV, G, Tq, hs = cache[0].shape  # sdpa's cache starts with q_grouped
    # return xp.reshape(out, (B, NH, Tq, hv))
    dout_grouped = xp.reshape(dout, (*B, NKV, G, Tq, dout.shape[-1]))  # (B, NKV, G, Tq, hv)
    # out = sdpa_forward(q_grouped, k_grouped, v_grouped, ...): k and v are broadcast over the G
    # query heads of a group, so sdpa_backward sums their G gradients,
    # dk[n] = sum_g scale * dscores[n, g]^T @ q[n, g], dv[n] = sum_g att[n, g]^T @ dout[n, g]
    dq, dk, dv = sdpa_backward(dout_grouped, cache)  # (B,NKV,G,Tq,hs), (B,NKV,1,Tk,hs|hv)
    # q_grouped = xp.reshape(q, (B, NKV, G, Tq, hs))
    dq = xp.reshape(dq, (*B, NKV * G, Tq, hs))  # (B, NH, Tq, hs)
    # k_grouped = xp.expand_dims(k, axis=-3), v_grouped = xp.expand_dims(v, axis=-3)
    dk = xp.squeeze(dk, axis=-3)  # (B, NKV, Tk, hs)
    dv = xp.squeeze(dv, axis=-3)  # (B, NKV, Tk, hv)
    return dq, dk, dv


def gqa_attention_forward(x, wq, wk, wv, wo, *, n_head: int, n_kv_head: int, causal: bool = True,
                          rotate=None, mask=None):  # fmt: skip
    """x (B, T, C), wq (C, NH*hs), wk and wv (C, NKV*hs), wo (NH*hs, C) -> y (B, T, C).
    Any leading dims (..., T, C) work as B does; ``mask`` None or (..., T, T) bool, the same
    for every head, as in ``attention_forward``.

    ``rotate``: None, or the pair (rotate_forward, rotate_backward) of a layer that rotates the
    rows of q (B, NH, T, hs) and k (B, NKV, T, hs) by their positions 0..T-1, such as RoPE:
    rotate_forward(a) -> (a_rotated, cache), rotate_backward(da_rotated, cache) -> (da, ...), of
    which da alone is used (a rotation with learned angles would need its own gradient here)."""
    _check_projections(x, wq, wk, wv, wo, n_head, n_kv_head)
    if rotate is not None and not (isinstance(rotate, (tuple, list)) and len(rotate) == 2
                                   and all(map(callable, rotate))):
        raise TypeError(f"rotate must be None or a pair (rotate_forward, rotate_backward) of "
                        f"functions, got {rotate!r:.60}")
    q, k, v, proj_caches = _heads(x, wq, wk, wv, n_head, n_kv_head,
                                  None if rotate is None else rotate[0])
    if mask is not None:
        _check_mask(mask, x.shape[:-1])
        mask = array_namespace(mask).expand_dims(mask, axis=-3)  # (..., 1, T, T) every head
    heads, core_cache = gqa_forward(q, k, v, mask, causal=causal)  # (B, NH, T, hs)
    y, o_cache = linear_forward(merge_heads(heads), wo)  # (B, T, C)
    return y, (proj_caches, core_cache, o_cache, rotate)


def gqa_attention_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), dwq, dwk, dwv, dwo), each of its weight's shape."""
    (q_cache, k_cache, v_cache, q_rot_cache, k_rot_cache), core_cache, o_cache, rotate = cache
    n_kv_head, group = core_cache[0].shape[-4:-2]  # sdpa's q_grouped (B, NKV, G, T, hs)
    # y = merge_heads(heads) @ wo
    dheads, dwo, _ = linear_backward(dy, o_cache)  # (B, T, NH*hs)
    # heads = gqa_forward(q, k, v)
    dq, dk, dv = gqa_backward(split_heads(dheads, n_kv_head * group), core_cache)  # (B,NH|NKV,T,hs)
    # q, k = rotate_forward(q), rotate_forward(k)
    if rotate is not None:
        dq = rotate[1](dq, q_rot_cache)[0]  # (B, NH, T, hs)
        dk = rotate[1](dk, k_rot_cache)[0]  # (B, NKV, T, hs)
    # q = split_heads(x @ wq), k = split_heads(x @ wk), v = split_heads(x @ wv): x feeds all three
    dx_q, dwq, _ = linear_backward(merge_heads(dq), q_cache)  # (B, T, C)
    dx_k, dwk, _ = linear_backward(merge_heads(dk), k_cache)  # (B, T, C)
    dx_v, dwv, _ = linear_backward(merge_heads(dv), v_cache)  # (B, T, C)
    return dx_q + dx_k + dx_v, dwq, dwk, dwv, dwo


def gqa_attention_step(x, wq, wk, wv, wo, k_past, v_past, *, n_head: int, n_kv_head: int,
                       rotate=None):  # fmt: skip
    """Generation with a KV cache (forward only): x (B, Tn, C) the new positions, k_past and
    v_past (B, NKV, Tp, hs) or None -> (y (B, Tn, C), k and v (B, NKV, Tp + Tn, hs)).

    New query j sits at position Tp + j and sees the keys <= Tp + j (sdpa's causal alignment to
    the last keys), as in ``gptlab.training.sample``. ``rotate``: None or a rotate_forward alone
    that rotates its rows as positions Tp, ..., Tp + Tn - 1 (the caller binds the offset Tp)."""
    xp = array_namespace(x)
    _check_projections(x, wq, wk, wv, wo, n_head, n_kv_head)
    if len(x.shape) != 3:
        raise ValueError(f"x must have shape (B, Tn, C), got {tuple(x.shape)}")
    if rotate is not None and not callable(rotate):
        raise TypeError(f"rotate must be None or a function (rotate_forward), got {rotate!r:.60}")
    q, k, v, _ = _heads(x, wq, wk, wv, n_head, n_kv_head, rotate)
    if _check_past(k_past, v_past, k):
        k = xp.concat([k_past, k], axis=2)  # (B, NKV, Tp + Tn, hs)
        v = xp.concat([v_past, v], axis=2)  # (B, NKV, Tp + Tn, hs)
    heads, _ = gqa_forward(q, k, v, causal=True)  # (B, NH, Tn, hs), query j sees keys <= Tp + j
    y, _ = linear_forward(merge_heads(heads), wo)  # (B, Tn, C)
    return y, k, v


class KVCacheSize(NamedTuple):
    """The size of a KV cache: how many numbers it holds, and their bytes."""

    elements: int
    nbytes: int


ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


def kv_cache_size(n_layer: int, n_kv_head: int, head_size: int, T: int, dtype="float32", *,
                  batch: int = 1) -> KVCacheSize:  # fmt: skip
    """The numbers a KV cache holds for T positions, k and v of every layer:
    2 * n_layer * batch * n_kv_head * T * head_size, and their bytes at ``dtype`` (a name in
    ``ITEMSIZE``, or a NumPy or torch dtype). n_kv_head = n_head gives multi-head attention's
    cache, n_head / n_kv_head times that of grouped-query attention."""
    for name, n in (("n_layer", n_layer), ("n_kv_head", n_kv_head), ("head_size", head_size),
                    ("batch", batch)):  # fmt: skip
        _require_count(name, n, least=1)
    _require_count("T", T, least=0)
    itemsize = ITEMSIZE.get(dtype) if isinstance(dtype, str) else getattr(dtype, "itemsize", None)
    if not isinstance(itemsize, int):
        raise ValueError(f"dtype must be one of {tuple(ITEMSIZE)} or a NumPy/torch dtype, "
                         f"got {dtype!r}")  # fmt: skip
    elements = 2 * n_layer * batch * n_kv_head * T * head_size
    return KVCacheSize(elements, elements * itemsize)


def _heads(x, wq, wk, wv, n_head: int, n_kv_head: int, rotate_forward):
    """The projections in heads: q (B, NH, T, hs), k and v (B, NKV, T, hs), q and k rotated when
    ``rotate_forward`` is given; and the caches (q, k, v projections, q, k rotations)."""
    q, q_cache = linear_forward(x, wq)  # (B, T, NH*hs)
    k, k_cache = linear_forward(x, wk)  # (B, T, NKV*hs)
    v, v_cache = linear_forward(x, wv)  # (B, T, NKV*hs)
    q = split_heads(q, n_head)  # (B, NH, T, hs)
    k = split_heads(k, n_kv_head)  # (B, NKV, T, hs)
    v = split_heads(v, n_kv_head)  # (B, NKV, T, hs)
    q_rot_cache = k_rot_cache = None
    if rotate_forward is not None:
        q, q_rot_cache = rotate_forward(q)  # (B, NH, T, hs)
        k, k_rot_cache = rotate_forward(k)  # (B, NKV, T, hs)
    return q, k, v, (q_cache, k_cache, v_cache, q_rot_cache, k_rot_cache)


def _group_mask(mask, n_kv_head: int, group: int):
    """A mask for the weights (B, NH, Tq, Tk) -> the same mask for the grouped (B, NKV, G, Tq, Tk).
    A mask without a head axis (fewer than 3 dims) is the same for every head and stays as it is."""
    if mask is None or not hasattr(mask, "shape") or len(mask.shape) < 3:
        return mask  # sdpa refuses a mask that is not an array
    xp = array_namespace(mask)
    *lead, heads, Tq, Tk = mask.shape
    split = (1, 1) if heads == 1 else (n_kv_head, group)
    return xp.reshape(mask, (*lead, *split, Tq, Tk))  # (..., NKV, G, Tq, Tk) or (..., 1, 1, Tq, Tk)


def _check_inputs(q, k, v, mask) -> None:
    """q, k, v 4-D float arrays with one batch, k and v with the same heads, NH a multiple of
    NKV, and a mask that broadcasts to (B, NH, Tq, Tk); sdpa checks the rest (head sizes, Tk,
    dtypes, causal). TypeError for dtypes, ValueError for shapes; the messages name the argument."""
    for name, a in (("q", q), ("k", k), ("v", v)):
        require_float(name, a)
        if len(a.shape) < 3 or len(a.shape) != len(q.shape):
            heads = "NH" if name == "q" else "NKV"
            raise ValueError(f"{name} must have shape (B, {heads}, T, hs), got {tuple(a.shape)}")
    (*B, NH, Tq, _), (NKV, Tk) = q.shape, k.shape[-3:-1]
    for name, a in (("k", k), ("v", v)):
        if list(a.shape[:-3]) != B:
            batch = ", ".join(map(str, a.shape[:-3]))
            raise ValueError(f"{name} has batch size {batch} but q has {', '.join(map(str, B))}")
    if v.shape[-3] != NKV:
        raise ValueError(f"v has {v.shape[-3]} heads but k has {NKV}: they are the same heads")
    if NKV == 0 or NH % NKV != 0:
        raise ValueError(f"q has {NH} heads, not a multiple of k's {NKV} key/value heads: each "
                         "key/value head serves NH / NKV query heads")  # fmt: skip
    if mask is not None and hasattr(mask, "shape"):
        weights = (*B, NH, Tq, Tk)
        if _broadcast([mask.shape, weights]) != weights:
            raise ValueError(f"mask has shape {tuple(mask.shape)}, which does not broadcast to the "
                             f"attention weights' shape (B, NH, Tq, Tk) = {weights}")  # fmt: skip


def _check_projections(x, wq, wk, wv, wo, n_head: int, n_kv_head: int) -> None:
    """x (B, T, C) and the weights: floats of one dtype, wq (C, NH*hs), wk and wv (C, NKV*hs),
    wo (NH*hs, C), with n_head a multiple of n_kv_head."""
    weights = {"wq": wq, "wk": wk, "wv": wv, "wo": wo}
    require_float("x", x)
    for name, w in weights.items():
        require_float(name, w)
        require_same_dtype("x", x, name, w)
    if len(x.shape) < 2:
        raise ValueError(f"x must have shape (B, T, C) or (..., T, C), got {tuple(x.shape)}")
    _require_count("n_head", n_head, least=1)
    _require_count("n_kv_head", n_kv_head, least=1)
    if n_head % n_kv_head != 0:
        raise ValueError(f"n_head ({n_head}) must be a multiple of n_kv_head ({n_kv_head})")
    C = x.shape[-1]
    require_shape("wq", wq, (C, None))
    if wq.shape[1] % n_head != 0:
        raise ValueError(f"wq has {wq.shape[1]} columns, not n_head * head_size for "
                         f"n_head={n_head}")  # fmt: skip
    hs = wq.shape[1] // n_head
    require_shape("wk", wk, (C, n_kv_head * hs))
    require_shape("wv", wv, (C, n_kv_head * hs))
    require_shape("wo", wo, (n_head * hs, C))


def _check_past(k_past, v_past, k) -> bool:
    """False for no past (k_past and v_past both None); True for a past to append to, after
    checking that both are (B, NKV, Tp, hs) arrays like the new k (B, NKV, Tn, hs)."""
    if k_past is None and v_past is None:
        return False
    B, NKV, _, hs = k.shape
    for name, past in (("k_past", k_past), ("v_past", v_past)):
        if past is None:
            raise ValueError("k_past and v_past go together: give both or neither")
        require_float(name, past)
        require_same_dtype(name, past, "x", k)
        require_shape(name, past, (B, NKV, None, hs))
    if v_past.shape[2] != k_past.shape[2]:
        raise ValueError(f"v_past holds {v_past.shape[2]} positions but k_past {k_past.shape[2]}")
    return True


def _require_count(name: str, n, least: int) -> None:
    """ValueError unless n is an integer (not a bool) >= least."""
    if isinstance(n, bool) or not isinstance(n, int) or n < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {n!r}")
