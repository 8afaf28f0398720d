"""Deliberately WRONG backward formulas, kept so that the gradient checker can catch them live.

Nothing here is used by the model. Each function has the signature of the correct backward it
imitates, so ``check_layer(forward, wrong_backward, ...)`` shows what a slip looks like: a
relative error of order 1 on the inputs it touches, and a pass on the others.

From the earlier draft of the source post "Understanding Transformers and GPT" (column
convention, X (d, T); Q = A X, K = B X, V = C X; att = softmax(Q^T K / sqrt(h)) column by
column; Z = V att; E = dF/dZ; att (x) G = the column-wise softmax Jacobian-vector product).
The draft's "Backward Pass" section, compared with the corrected post:

- "Putting all the above steps together":  dF/dA = (1/sqrt(h)) K (att (x) (V^T E)) X^T.
  The transpose is missing: the corrected post has K (att (x) (V^T E))^T X^T, because
  dF/dq_i = (1/sqrt(h)) sum_t (dF/dc_it) k_t runs over the ROW i of dF/dc. (The draft's
  step 3 drops the same transpose, and its step 4 adds a second 1/sqrt(h) that the summary
  formula no longer has; we reproduce the summary formula.)
- The final dF/dX:  (1/sqrt(h)) (A^T K + B^T Q) (att (x) (V^T E)) + C^T E att^T.
  Factoring out (att (x) (V^T E)) merges the query and key paths, which need it transposed
  and untransposed respectively: (1/sqrt(h)) (A^T K (att (x) V^T E)^T + B^T Q (att (x) V^T E)).
- The draft's dF/dB = (1/sqrt(h)) Q (att (x) (V^T E)) X^T and dF/dC = E att^T X^T are right.

And a planted bug of the most common kind, a dropped transpose in the linear layer.
"""

from __future__ import annotations

import math

from ..backend import array_namespace
from ..layers.linear import linear_backward
from ..layers.softmax import softmax_backward


def draft_attention_single_backward(E, cache):
    """The draft's formulas, literally. E (..., h, T), the cache of ``attention_single_forward``
    -> (dX (..., d, T), dA (h, d), dB (h, d), dC (h, d)); dA and dX are WRONG."""
    xp = array_namespace(E)
    X, A, B, C, Q, K, V, att, softmax_cache = cache
    h, d = A.shape
    (dscores,) = softmax_backward(V.mT @ E, softmax_cache)  # (..., T, T)  att (x) (V^T E)

    def sum_batch(M):  # (..., h, d) -> (h, d)
        return xp.sum(xp.reshape(M, (-1, h, d)), axis=0)

    dA = sum_batch(K @ dscores @ X.mT / math.sqrt(h))  # (h, d)  WRONG: no transpose on dscores
    dB = sum_batch(Q @ dscores @ X.mT / math.sqrt(h))  # (h, d)
    dC = sum_batch(E @ att.mT @ X.mT)  # (h, d)
    dX = (A.mT @ K + B.mT @ Q) @ dscores / math.sqrt(h) + C.mT @ E @ att.mT  # (..., d, T) WRONG
    return dX, dA, dB, dC


def dropped_transpose_linear_backward(dy, cache):
    """``linear_backward`` with dx = dy @ w instead of dy @ w^T: WRONG dx, correct dw and db.

    The shapes only line up when w is square (C_in == C_out), which is exactly why such a slip
    survives a shape check; for a non-square w it fails with a shape error instead.
    """
    _, w, _ = cache  # (x, w, has_bias)
    _, dw, db = linear_backward(dy, cache)
    dx = dy @ w  # (..., C_in)  WRONG: should be dy @ w.mT
    return dx, dw, db
