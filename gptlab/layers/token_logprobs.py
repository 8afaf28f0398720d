"""The log-probability a model gives to each token it was shown: what every preference loss
(DPO, PPO's ratio, the KL to a reference model) is written in.

    logp[n] = log softmax(logits_n)[target_n] = logits_n[target_n] - logsumexp(logits_n)
    dlogits_n = dlogp[n] * (onehot(target_n) - probs_n)

It is cross-entropy (``cross_entropy.py``) before the mean and the minus sign: a sequence's
log-probability is the sum of ``logp`` over its tokens.

Book: chapter 22, "Learning from preferences".
"""

from __future__ import annotations

from ..backend import array_namespace, one_hot, take_along_last
from ..checks import require_logits_and_targets
from .softmax import log_softmax


def token_logprobs_forward(logits, targets):
    """logits (..., V), targets (...) integer ids -> (logp (...), cache)."""
    xp = array_namespace(logits)
    require_logits_and_targets(logits, targets)
    logp_all = log_softmax(logits)  # (..., V), the log-sum-exp with the max subtracted
    logp = take_along_last(logp_all, targets)  # (...)
    probs = xp.exp(logp_all)  # (..., V)
    return logp, (probs, targets)


def token_logprobs_backward(dlogp, cache):
    """dlogp (...) -> (dlogits (..., V),)."""
    probs, targets = cache
    # logp = logits[target] - logsumexp(logits): d/dlogits = onehot(target) - probs
    dlogits = dlogp[..., None] * (one_hot(targets, probs.shape[-1], dtype=probs.dtype) - probs)
    return (dlogits,)  # (..., V)
