"""The Bradley-Terry loss of a reward model: the chosen answer should score above the rejected.

Bradley and Terry (1952) model the probability that y_w is preferred to y_l as
sigmoid(r_w - r_l); fitting r by maximum likelihood on labelled pairs is the reward model's loss
(Christiano et al. 2017; Stiennon et al. 2020; Ouyang et al. 2022, eq. 1):

    z = r_chosen - r_rejected                         (N,)
    loss = mean_n -log sigmoid(z_n) = mean_n softplus(-z_n)          ()
    softplus(-z) = max(-z, 0) + log1p(exp(-|z|))      (finite for every z)
    dr_chosen = -dloss * sigmoid(-z) / N,  dr_rejected = -dr_chosen

Only the difference of the two rewards enters: adding a constant to every reward changes
nothing. DPO (``dpo.py``) is this loss on implicit rewards.

Book: chapter 22, "The reward model".
"""

from __future__ import annotations

from ..backend import array_namespace
from ..checks import require_float, require_same_dtype, require_shape


def softplus(x):
    """log(1 + exp(x)) elementwise, computed as max(x, 0) + log1p(exp(-|x|)) (never overflows)."""
    xp = array_namespace(x)
    return xp.maximum(x, 0.0) + xp.log1p(xp.exp(-xp.abs(x)))  # (...)


def bradley_terry_forward(r_chosen, r_rejected):
    """r_chosen (N,), r_rejected (N,) rewards of the preferred and the other answer -> (loss (),
    cache). The cache's ``margin`` z (N,) is there to be looked at (accuracy = mean(z > 0))."""
    xp = array_namespace(r_chosen, r_rejected)
    check_pair("r_chosen", r_chosen, "r_rejected", r_rejected)
    z = r_chosen - r_rejected  # (N,)
    loss = xp.mean(softplus(-z))  # ()
    return loss, {"margin": z}


def bradley_terry_backward(dloss, cache):
    """dloss (a float or 0-d array) -> (dr_chosen (N,), dr_rejected (N,))."""
    xp = array_namespace(cache["margin"])
    z = cache["margin"]
    N = z.shape[0]
    # loss = mean(softplus(-z)), softplus'(-z) = sigmoid(-z) = exp(-softplus(z))
    dz = -dloss * xp.exp(-softplus(z)) / N  # (N,)
    # z = r_chosen - r_rejected
    return dz, -dz


def check_pair(name_a: str, a, name_b: str, b) -> None:
    """Two float vectors (N,) of the same shape and dtype, N >= 1 (the two sides of N pairs)."""
    require_float(name_a, a)
    require_float(name_b, b)
    require_shape(name_a, a, (None,))
    require_shape(name_b, b, (a.shape[0],))
    require_same_dtype(name_a, a, name_b, b)
    if a.shape[0] == 0:
        raise ValueError(f"{name_a} holds no pairs: expected at least one")
