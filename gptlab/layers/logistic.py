"""Logistic loss: the sigmoid and binary cross-entropy fused into one layer, averaged.

A binary classifier (GPT-3's quality filter, Brown et al. 2020, Appendix A) scores a document
with p = sigmoid(z) = P(label = 1), z its logit. With labels y in {0, 1} and N = number of logits,

    loss = -(1/N) sum_n [y_n log p_n + (1 - y_n) log(1 - p_n)]
         = (1/N) sum_n [softplus(z_n) - y_n z_n],      softplus(z) = log(1 + exp(z))
    dz   = (p - y) / N

the two-class case of cross_entropy.py (logits [0, z]). The forward computes both the sigmoid
and the softplus from e = exp(-|z|), which never overflows:

    sigmoid(z)  = 1 / (1 + e) for z >= 0,   e / (1 + e) for z < 0
    softplus(z) = max(z, 0) + log(1 + e)

Book: chapter 20, "Data at GPT-3's scale, in miniature", "The quality classifier".
"""

from __future__ import annotations

import math

from ..backend import array_namespace
from ..checks import require_float, require_int


def logistic_forward(logits, labels):
    """logits (...) float, labels (...) integer 0 or 1 -> (loss (), cache). Mean over logits."""
    xp = array_namespace(logits)
    require_float("logits", logits)
    require_int("labels", labels)
    if tuple(labels.shape) != tuple(logits.shape):
        raise ValueError(f"labels has shape {tuple(labels.shape)} but logits has shape "
                         f"{tuple(logits.shape)}: expected one label per logit")  # fmt: skip
    if bool(xp.any(xp.logical_and(labels != 0, labels != 1))):
        raise ValueError("labels must be 0 or 1 (the class of each logit), got other values")
    y = xp.astype(labels, logits.dtype)  # (...) 0.0 or 1.0
    e = xp.exp(-xp.abs(logits))  # (...) in (0, 1]
    probs = xp.where(logits >= 0.0, 1.0 / (1.0 + e), e / (1.0 + e))  # (...) sigmoid(logits)
    softplus = xp.maximum(logits, 0.0) + xp.log1p(e)  # (...) log(1 + exp(logits))
    N = math.prod(logits.shape)
    loss = xp.sum(softplus - y * logits) / N  # ()
    return loss, (probs, y)


def logistic_backward(dloss, cache):
    """dloss (scalar, usually 1.0) -> (dlogits (...),)."""
    probs, y = cache
    N = math.prod(probs.shape)
    # loss = mean_n(softplus(z_n) - y_n z_n), softplus'(z) = sigmoid(z) = p
    dlogits = (probs - y) * (dloss / N)  # (...)
    return (dlogits,)
