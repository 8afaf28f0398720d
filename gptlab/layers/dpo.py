"""Direct preference optimization (Rafailov et al. 2023, eq. 7): the Bradley-Terry loss on the
policy's implicit reward, no reward model and no sampling.

    r(y) = beta * (logpi(y) - logpi_ref(y))                    the implicit reward (N,)
    loss = bradley_terry(r(y_w), r(y_l))
         = mean_n -log sigmoid(beta * ((logpi(y_w) - logpi_ref(y_w))
                                      - (logpi(y_l) - logpi_ref(y_l))))

logpi(y) is a whole answer's log-probability (the sum of ``token_logprobs`` over its tokens).
Backward through the two lines: with (dr_w, dr_l) from ``bradley_terry_backward``,

    dlogp_chosen = beta * dr_w,    dref_chosen = -beta * dr_w
    dlogp_rejected = beta * dr_l,  dref_rejected = -beta * dr_l

The reference model is frozen in training (its gradient is computed, as for any float input,
and not used). The gradient on logpi(y_w) is beta * sigmoid(-z) / N: largest for the pairs the
implicit reward orders wrongly, zero once the margin is large.

Book: chapter 22, "DPO".
"""

from __future__ import annotations

from ..backend import array_namespace
from .bradley_terry import bradley_terry_backward, bradley_terry_forward, check_pair


def dpo_forward(logp_chosen, logp_rejected, ref_chosen, ref_rejected, *, beta: float = 0.1):
    """logp_chosen, logp_rejected (N,) the policy's log-probabilities of the preferred and the
    other answer, ref_chosen, ref_rejected (N,) the reference model's -> (loss (), cache).
    The cache holds the implicit rewards ``chosen_rewards`` and ``rejected_rewards`` (N,)."""
    array_namespace(logp_chosen, logp_rejected, ref_chosen, ref_rejected)
    check_pair("logp_chosen", logp_chosen, "logp_rejected", logp_rejected)
    check_pair("ref_chosen", ref_chosen, "ref_rejected", ref_rejected)
    check_pair("logp_chosen", logp_chosen, "ref_chosen", ref_chosen)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0, got {beta!r}")
    r_chosen = beta * (logp_chosen - ref_chosen)  # (N,)
    r_rejected = beta * (logp_rejected - ref_rejected)  # (N,)
    loss, bt_cache = bradley_terry_forward(r_chosen, r_rejected)  # ()
    cache = {"bt": bt_cache, "beta": beta, "chosen_rewards": r_chosen,
             "rejected_rewards": r_rejected}
    return loss, cache


def dpo_backward(dloss, cache):
    """dloss -> (dlogp_chosen, dlogp_rejected, dref_chosen, dref_rejected), each (N,)."""
    beta = cache["beta"]
    # loss = bradley_terry(r_chosen, r_rejected)
    dr_chosen, dr_rejected = bradley_terry_backward(dloss, cache["bt"])  # (N,) each
    # r = beta * (logp - ref)
    return beta * dr_chosen, beta * dr_rejected, -beta * dr_chosen, -beta * dr_rejected
