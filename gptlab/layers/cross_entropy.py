"""Softmax cross-entropy fused into one layer, averaged over all positions.

    loss = -(1/N) sum_n log softmax(logits_n)[target_n]          (N = B*T)
         = (1/N) sum_n (logsumexp(logits_n) - logits_n[target_n])
    dlogits = (probs - onehot(targets)) / N

Book: chapter 6, "Softmax and cross-entropy".
"""

from __future__ import annotations

import math

from ..backend import array_namespace, one_hot, take_along_last
from ..checks import require_logits_and_targets


def cross_entropy_forward(logits, targets):
    """logits (..., V), targets (...) integer ids -> (loss (), cache). Mean over positions."""
    xp = array_namespace(logits)
    require_logits_and_targets(logits, targets)
    shifted = logits - xp.max(logits, axis=-1, keepdims=True)  # (..., V)
    logsumexp = xp.log(xp.sum(xp.exp(shifted), axis=-1))  # (...)
    logprob_target = take_along_last(shifted, targets) - logsumexp  # (...)
    N = math.prod(targets.shape)
    loss = -xp.sum(logprob_target) / N  # ()
    probs = xp.exp(shifted - logsumexp[..., None])  # (..., V)
    return loss, (probs, targets)


def cross_entropy_backward(dloss, cache):
    """dloss (scalar, usually 1.0) -> (dlogits (..., V),)."""
    probs, targets = cache
    N = math.prod(targets.shape)
    # loss = mean_n(logsumexp(logits_n) - logits_n[target_n])
    dlogits = (probs - one_hot(targets, probs.shape[-1], dtype=probs.dtype)) * (dloss / N)  # (...,V)
    return (dlogits,)
