"""Causal multi-head self-attention as in GPT-2, in the row convention of code (x is B, T, C).

    qkv = x @ w_attn + b_attn                        (B, T, 3C)  fused query/key/value projection
    q, k, v = split(qkv) into NH heads of size hs    (B, NH, T, hs) each
    att = softmax(mask(q @ k^T / sqrt(hs)))          (B, NH, T, T), row t = weights of query t
    y = merge_heads(att @ v) @ w_proj + b_proj       (B, T, C)

Here ``att[t, i]`` is the weight that query t gives to key i: the transpose of the column
convention of ``attention_single``. The causal mask keeps i <= t (the lower triangle).
Per head, ``att @ v`` with its ``att`` is scaled dot-product attention (``sdpa.py``, causal);
its cache (q, k, v, att, softmax_cache, scale) is the cache of ``multihead_forward``.

Any leading dims work as B does: x (..., T, C) gives q, k, v (..., NH, T, hs), and x (T, C) is
one sequence. ``mask`` (..., T, T) bool, broadcasting against x's leading dims, hides more keys
than the causal mask does (True = may attend; the two combine by AND), the same for every head:
with a block-diagonal mask, the documents packed into one row never see each other.

Book: chapter 3 (forward) and chapter 7 (backward).
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_shape
from .linear import linear_backward, linear_forward
from .sdpa import _broadcast, causal_mask, sdpa_backward, sdpa_forward


def causal_mask_rows(T: int, like):
    """(T, T) boolean, True where query t may see key i, i.e. i <= t (lower triangle)."""
    return causal_mask(T, T, like)  # (T, T)


def split_heads(x, n_head: int):
    """(..., T, C) -> (..., NH, T, hs)."""
    xp = array_namespace(x)
    *lead, T, C = x.shape
    n = len(lead)
    x = xp.reshape(x, (*lead, T, n_head, C // n_head))  # (..., T, NH, hs)
    return xp.permute_dims(x, (*range(n), n + 1, n, n + 2))  # (..., NH, T, hs)


def split_qkv(qkv, n_head: int):
    """The fused projection (B, T, 3C) -> q, k, v, each (B, NH, T, hs)."""
    C = qkv.shape[-1] // 3
    q = split_heads(qkv[..., :C], n_head)  # (B, NH, T, hs)
    k = split_heads(qkv[..., C : 2 * C], n_head)  # (B, NH, T, hs)
    v = split_heads(qkv[..., 2 * C :], n_head)  # (B, NH, T, hs)
    return q, k, v


def merge_heads(x):
    """(..., NH, T, hs) -> (..., T, C)."""
    xp = array_namespace(x)
    *lead, NH, T, hs = x.shape
    n = len(lead)
    x = xp.permute_dims(x, (*range(n), n + 1, n, n + 2))  # (..., T, NH, hs)
    return xp.reshape(x, (*lead, T, NH * hs))  # (..., T, C)


def multihead_forward(qkv, *, n_head: int, causal: bool = True, mask=None):
    """The attention core: qkv (..., T, 3C) -> y (..., T, C), heads merged, before c_proj;
    ``mask`` None or (..., T, T) bool. The cache is sdpa's: (q, k, v (..., NH, T, hs),
    att (..., NH, T, T), softmax_cache, scale)."""
    xp = array_namespace(qkv, mask)
    require_float("qkv", qkv)
    if len(qkv.shape) < 2:
        raise ValueError(f"qkv must have shape (..., T, 3C), got {tuple(qkv.shape)}")
    C3 = qkv.shape[-1]
    if C3 % (3 * n_head) != 0:
        raise ValueError(f"qkv width {C3} is not 3 * n_head * head_size for n_head={n_head}")
    q, k, v = split_qkv(qkv, n_head)  # (..., NH, T, hs) each
    if mask is not None:
        _check_mask(mask, qkv.shape[:-1])
        mask = xp.expand_dims(mask, axis=-3)  # (..., 1, T, T) the same for every head
    heads, cache = sdpa_forward(q, k, v, mask, causal=causal)  # (..., NH, T, hs)
    y = merge_heads(heads)  # (..., T, C)
    return y, cache


def multihead_backward(dy, cache):
    """dy (B, T, C) -> (dqkv (B, T, 3C),)."""
    xp = array_namespace(dy)
    n_head = cache[0].shape[-3]  # sdpa's cache starts with q (..., NH, T, hs)
    # y = merge_heads(heads), heads = sdpa(q, k, v)
    dq, dk, dv = sdpa_backward(split_heads(dy, n_head), cache)  # (B, NH, T, hs) each
    # q, k, v = split(qkv)
    dqkv = xp.concat([merge_heads(dq), merge_heads(dk), merge_heads(dv)], axis=-1)  # (B,T,3C)
    return (dqkv,)


def attention_forward(x, w_attn, b_attn, w_proj, b_proj, *, n_head: int, causal: bool = True,
                      mask=None):
    """x (B, T, C), w_attn (C, 3C), b_attn (3C,), w_proj (C, C), b_proj (C,) -> y (B, T, C).
    Any leading dims (..., T, C) work as B does; ``mask`` None or (..., T, T) bool, True where
    query t may see key i besides the causal mask (the same for every head)."""
    require_float("x", x)
    if len(x.shape) < 2:
        raise ValueError(f"x must have shape (B, T, C) or (..., T, C), got {tuple(x.shape)}")
    C = x.shape[-1]
    if C % n_head != 0:
        raise ValueError(f"n_embd ({C}) must be divisible by n_head ({n_head})")
    require_shape("w_attn", w_attn, (C, 3 * C))
    require_shape("w_proj", w_proj, (C, C))
    qkv, attn_cache = linear_forward(x, w_attn, b_attn)  # (B, T, 3C)
    heads, core_cache = multihead_forward(qkv, n_head=n_head, causal=causal, mask=mask)  # (B,T,C)
    y, proj_cache = linear_forward(heads, w_proj, b_proj)  # (B, T, C)
    return y, (attn_cache, core_cache, proj_cache)


def attention_backward(dy, cache):
    """dy (B, T, C) -> (dx, dw_attn, db_attn, dw_proj, db_proj)."""
    attn_cache, core_cache, proj_cache = cache
    # y = heads @ w_proj + b_proj
    dheads, dw_proj, db_proj = linear_backward(dy, proj_cache)  # (B, T, C)
    # heads = multihead(qkv)
    (dqkv,) = multihead_backward(dheads, core_cache)  # (B, T, 3C)
    # qkv = x @ w_attn + b_attn
    dx, dw_attn, db_attn = linear_backward(dqkv, attn_cache)  # (B, T, C)
    return dx, dw_attn, db_attn, dw_proj, db_proj


def _check_mask(mask, tokens) -> None:
    """TypeError unless ``mask`` is a boolean array, ValueError unless it is (..., T, T) and
    broadcasts against the leading dims of ``tokens`` = x.shape[:-1] = (..., T)."""
    if not hasattr(mask, "dtype") or not array_namespace(mask).isdtype(mask.dtype, "bool"):
        got = f"dtype {mask.dtype}" if hasattr(mask, "dtype") else type(mask).__name__
        raise TypeError(f"mask must be a boolean array (True = may attend), got {got}")
    *lead, T = tokens
    shape = (*lead, T, T)
    if len(mask.shape) < 2 or _broadcast([mask.shape, shape]) != shape:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected (..., T, T) = {shape} "
                         "or a shape that broadcasts to it")  # fmt: skip


def attention_weights(x, w_attn, b_attn, *, n_head: int, causal: bool = True):
    """The attention maps alone: x (B, T, C) -> att (B, NH, T, T), for heatmaps."""
    qkv, _ = linear_forward(x, w_attn, b_attn)  # (B, T, 3C)
    _, (_, _, _, att, _, _) = multihead_forward(qkv, n_head=n_head, causal=causal)
    return att  # (B, NH, T, T)
