"""Softmax along one axis, and its backward as a Jacobian-vector product.

    p = exp(x - max(x)) / sum(exp(x - max(x)))          (subtracting the max changes nothing
                                                          mathematically and keeps exp finite)
    dx = J^T dp,  J = diag(p) - p p^T  =>  dx = p * (dp - sum(p * dp))

Book: chapter 6, "The softmax Jacobian".
"""

from __future__ import annotations

from ..backend import array_device, array_namespace
from ..checks import require_float


def softmax_forward(x, *, axis: int = -1):
    """x (...) -> p (...), normalized along ``axis`` (axis=0: the column-wise softmax of the
    blog post "Understanding Transformers and GPT")."""
    xp = array_namespace(x)
    require_float("x", x)
    shifted = x - xp.max(x, axis=axis, keepdims=True)  # (...)
    e = xp.exp(shifted)  # (...)
    p = e / xp.sum(e, axis=axis, keepdims=True)  # (...)
    return p, (p, axis)


def softmax_backward(dp, cache):
    """dp (...) -> (dx (...),), without forming the Jacobian."""
    xp = array_namespace(dp)
    p, axis = cache
    # p = softmax(x):  dx = (diag(p) - p p^T) dp = p * dp - (p . dp) p
    dx = p * (dp - xp.sum(p * dp, axis=axis, keepdims=True))  # (...)
    return (dx,)


def softmax_jacobian(p):
    """The Jacobian diag(p) - p p^T of softmax at output p (..., n) -> (..., n, n)."""
    xp = array_namespace(p)
    n = p.shape[-1]
    eye = xp.eye(n, dtype=p.dtype, device=array_device(p))  # (n, n)
    return p[..., :, None] * eye - p[..., :, None] * p[..., None, :]  # (..., n, n)


def log_softmax(x):
    """x (..., V) -> log softmax(x) (..., V), with the max subtracted so that exp stays finite."""
    xp = array_namespace(x)
    shifted = x - xp.max(x, axis=-1, keepdims=True)  # (..., V)
    return shifted - xp.log(xp.sum(xp.exp(shifted), axis=-1, keepdims=True))  # (..., V)
