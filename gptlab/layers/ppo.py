"""PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), as a loss to minimise.

Sampled actions (here: tokens) were drawn from the policy with parameters theta_old, whose
log-probabilities old_logp are kept; advantages A say how much better each action did than
expected (``gptlab.alignment.rlhf.gae``). For the current log-probabilities logp:

    ratio = exp(logp - old_logp)                                    (...)
    loss = -mean(min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A))  ()

The min makes the objective a pessimistic bound: once ratio leaves [1 - eps, 1 + eps] in the
direction the advantage rewards, the clipped term is the smaller one and its gradient in logp
is zero, so one batch of samples cannot pull the policy far from the one that drew it.
Backward, with s = min(...) and ``take`` where the unclipped term is the min (ties included):

    ds = -dloss / n
    dratio = ds * A * take
    dA = ds * ratio * take + ds * clip(ratio) * (1 - take)
    dlogp = dratio * ratio,  dold_logp = -dlogp

The clipped term reaches ratio only through clip, whose slope is 1 inside [1 - eps, 1 + eps] and
0 outside. But inside, clip is the identity, the two terms are equal and the tie goes to the
unclipped one: the clipped term wins only outside, where its slope is 0. So dratio has no second
term, and the clip needs no mask.

Book: chapter 22, "RLHF with PPO".
"""

from __future__ import annotations

import math

from ..backend import array_namespace
from ..checks import require_float, require_same_dtype, require_shape


def ppo_forward(logp, old_logp, advantages, *, clip_eps: float = 0.2):
    """logp, old_logp, advantages (...) of the same shape -> (loss (), cache).

    The cache's ``clip_fraction`` (a 0-d array) is the share of actions whose clipped term won."""
    xp = array_namespace(logp, old_logp, advantages)
    for name, a in (("old_logp", old_logp), ("advantages", advantages)):
        require_float(name, a)
        require_shape(name, a, tuple(logp.shape))
        require_same_dtype("logp", logp, name, a)
    require_float("logp", logp)
    if math.prod(logp.shape) == 0:
        raise ValueError("logp holds no actions: expected at least one")
    if isinstance(clip_eps, bool) or not isinstance(clip_eps, (int, float)) or not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps must be a number in (0, 1), got {clip_eps!r}")
    ratio = xp.exp(logp - old_logp)  # (...)
    clipped_ratio = xp.clip(ratio, 1.0 - clip_eps, 1.0 + clip_eps)  # (...)
    unclipped, clipped = ratio * advantages, clipped_ratio * advantages  # (...)
    take = unclipped <= clipped  # (...) the unclipped term is the min
    loss = -xp.mean(xp.where(take, unclipped, clipped))  # ()
    clip_fraction = 1.0 - xp.mean(xp.astype(take, logp.dtype))  # ()
    cache = {"ratio": ratio, "clipped_ratio": clipped_ratio, "advantages": advantages,
             "take": take, "clip_eps": clip_eps, "clip_fraction": clip_fraction}
    return loss, cache


def ppo_backward(dloss, cache):
    """dloss -> (dlogp, dold_logp, dadvantages), each of logp's shape."""
    xp = array_namespace(cache["ratio"])
    ratio, clipped_ratio, A, take = (cache[k] for k in ("ratio", "clipped_ratio", "advantages",
                                                        "take"))  # fmt: skip
    # loss = -mean(where(take, unclipped, clipped))
    ds = -dloss / math.prod(ratio.shape)
    keep = xp.astype(take, ratio.dtype)  # (...) 1 where the unclipped term is the min
    dunclipped, dclipped = ds * keep, ds * (1.0 - keep)  # (...)
    # unclipped, clipped = ratio * A, clipped_ratio * A
    dA = dunclipped * ratio + dclipped * clipped_ratio  # (...)
    # clipped_ratio = clip(ratio, 1 - eps, 1 + eps): slope 1 inside, 0 outside; dclipped is 0
    # inside (there the terms tie and take is True), so only the unclipped term reaches ratio
    dratio = dunclipped * A  # (...)
    # ratio = exp(logp - old_logp)
    dlogp = dratio * ratio  # (...)
    return dlogp, -dlogp, dA
