"""Single-head attention in the column convention of the blog post "Understanding Transformers
and GPT: An In-depth Overview" (2023): tokens are the COLUMNS of X (d, T).

    Q = A X,  K = B X,  V = C X                                   (h, T) each
    att = softmax(Q^T K / sqrt(h)), softmax over each column      (T, T), att[i, t] = a_it
    Z = V att                                                      (h, T), z_t = sum_i a_it v_i

Column t of ``att`` holds the weights with which output t mixes the values v_i. Mind the roles:
the blog post scores c_it = q_i . k_t and normalizes over i, so position t probes with its KEY k_t
and the positions i answer with their QUERIES q_i, the transpose of Vaswani et al.'s q_t . k_i.
It is the same function class with A and B swapped: GPT-2's row convention (``attention.py``)
with query weight B^T, key weight A^T and value weight C^T gives the same Z^T. The causal mask
keeps i <= t: the upper triangle, including the diagonal.

The backward follows the blog post step by step (E = dF/dZ):

    dF/datt = V^T E
    dF/dc_t = J_sm(a_t) dF/da_t  for every column  (written  att (x) (V^T E))
    dQ = K (dF/dc)^T / sqrt(h),  dK = Q (dF/dc) / sqrt(h),  dV = E att^T
    dA = dQ X^T,  dB = dK X^T,  dC = dV X^T,  dX = A^T dQ + B^T dK + C^T dV

Book: chapter 3 (forward) and chapter 7 (backward).
"""

from __future__ import annotations

import math

from ..backend import array_device, array_namespace
from ..checks import require_float, require_ndim_at_least, require_shape
from .softmax import softmax_backward, softmax_forward


def causal_mask_columns(T: int, like):
    """(T, T) boolean, True where key i may be seen by query t, i.e. i <= t (upper triangle)."""
    xp = array_namespace(like)
    i = xp.arange(T, device=array_device(like))  # (T,)
    return i[:, None] <= i[None, :]  # (T, T)


def attention_single_forward(X, A, B, C, *, causal: bool = False):
    """X (..., d, T), A/B/C (h, d) -> Z (..., h, T)."""
    xp = array_namespace(X, A, B, C)
    for name, m in (("X", X), ("A", A), ("B", B), ("C", C)):
        require_float(name, m)
    require_ndim_at_least("X", X, 2)
    d, T = X.shape[-2], X.shape[-1]
    require_shape("A", A, (None, d))
    h = A.shape[0]
    require_shape("B", B, (h, d))
    require_shape("C", C, (h, d))
    Q = A @ X  # (..., h, T)
    K = B @ X  # (..., h, T)
    V = C @ X  # (..., h, T)
    scores = Q.mT @ K / math.sqrt(h)  # (..., T, T), scores[i, t] = q_i . k_t / sqrt(h)
    if causal:
        scores = xp.where(causal_mask_columns(T, X), scores, -math.inf)  # (..., T, T)
    att, softmax_cache = softmax_forward(scores, axis=-2)  # (..., T, T), columns sum to 1
    Z = V @ att  # (..., h, T)
    return Z, (X, A, B, C, Q, K, V, att, softmax_cache)


def attention_single_backward(E, cache):
    """E = dF/dZ (..., h, T) -> (dX (..., d, T), dA (h, d), dB (h, d), dC (h, d))."""
    xp = array_namespace(E)
    X, A, B, C, Q, K, V, att, softmax_cache = cache
    h, d = A.shape
    # Z = V att
    datt = V.mT @ E  # (..., T, T)   dF/datt = V^T E
    dV = E @ att.mT  # (..., h, T)   dF/dV = E att^T
    # att = softmax(scores) column by column: dF/dc_t = J_sm(a_t) dF/da_t. A masked entry has
    # a_it = 0, so its row and column of J_sm vanish: the causal case needs no extra step.
    (dscores,) = softmax_backward(datt, softmax_cache)  # (..., T, T)
    # scores = Q^T K / sqrt(h)
    dQ = K @ dscores.mT / math.sqrt(h)  # (..., h, T)
    dK = Q @ dscores / math.sqrt(h)  # (..., h, T)
    # Q = A X,  K = B X,  V = C X
    dA = xp.sum(xp.reshape(dQ @ X.mT, (-1, h, d)), axis=0)  # (h, d)
    dB = xp.sum(xp.reshape(dK @ X.mT, (-1, h, d)), axis=0)  # (h, d)
    dC = xp.sum(xp.reshape(dV @ X.mT, (-1, h, d)), axis=0)  # (h, d)
    dX = A.mT @ dQ + B.mT @ dK + C.mT @ dV  # (..., d, T)
    return dX, dA, dB, dC


def attention_single_backward_compact(E, cache):
    """The same gradients through the blog post's compact (3h, T) matrix P:

        P = [ K (att (x) V^T E)^T / sqrt(h) ;  Q (att (x) V^T E) / sqrt(h) ;  E att^T ]
        [dA; dB; dC] = P X^T,      dX = [A^T  B^T  C^T] P
    """
    xp = array_namespace(E)
    X, A, B, C, Q, K, V, att, softmax_cache = cache
    h, d = A.shape
    (dscores,) = softmax_backward(V.mT @ E, softmax_cache)  # (..., T, T)  att (x) (V^T E)
    P = xp.concat(
        [K @ dscores.mT / math.sqrt(h), Q @ dscores / math.sqrt(h), E @ att.mT], axis=-2
    )  # (..., 3h, T)
    dABC = xp.sum(xp.reshape(P @ X.mT, (-1, 3 * h, d)), axis=0)  # (3h, d)
    dX = xp.concat([A, B, C], axis=0).mT @ P  # (..., d, T)
    return dX, dABC[:h, :], dABC[h : 2 * h, :], dABC[2 * h :, :]
