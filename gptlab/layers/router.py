"""The router of a mixture of experts: which k of the E experts see a token, with what weight,
and the load-balancing loss that keeps them all busy (Shazeer et al. 2017; Fedus et al. 2021,
Switch Transformer, eq. 4-6).

    probs = softmax(logits)                       (N, E)   logits = x @ w_router
    experts = the k largest logits per row        (N, k)   largest first, a tie to the lower id
    selected[n, j] = probs[n, experts[n, j]]      (N, k)
    gates = selected / sum_j selected[n, j]       (N, k)   renormalize=True  (Mixtral, Shazeer)
    gates = selected                              (N, k)   renormalize=False (Switch: k = 1)
    aux = aux_weight * E * sum_e f_e * P_e        ()
    f_e = (number of j, n with experts[n, j] = e) / (N k)   the share of the choices (no gradient)
    P_e = mean_n probs[n, e]                                the mean router probability

Renormalized, gates[n] = softmax over the chosen logits alone: the unchosen logits drop out of
the gates, and with k = 1 the gate is always 1 (the router then learns from aux alone). Raw, a
gate is a full-softmax probability, so every logit of the row enters it through the
denominator. f counts the router's choices before any capacity limit, as the paper's eq. 5
does; aux = aux_weight when the load is balanced (f_e = P_e = 1/E) and grows with imbalance.

The choice of experts is an integer input to ``router_forward`` (made by ``top_k_experts``): it
is piecewise constant in the logits and gets no gradient. Backward, with ``choice`` the one-hot
(N, k, E) of ``experts``:

    dP_e = daux * aux_weight * E * f_e,  dprobs[n, e] = dP_e / N
    dselected = (dgates - sum_j dgates * gates) / sum_j selected       (renormalized; else dgates)
    dprobs += sum_j dselected[n, j] * choice[n, j, e]
    dlogits = probs * (dprobs - sum_e probs * dprobs)                   (softmax.py)

Book: chapter 18, "Mixture of experts".
"""

from __future__ import annotations

import math

from ..backend import array_namespace, one_hot
from ..checks import require_float, require_int, require_shape
from .softmax import softmax_backward, softmax_forward


def top_k_experts(logits, k: int):
    """logits (N, E) -> experts (N, k) int64: the ids of the k largest logits of each row, the
    largest first; of equal logits the lower id comes first (``argmax`` returns the first)."""
    xp = array_namespace(logits)
    require_float("logits", logits)
    require_shape("logits", logits, (None, None))
    check_k(k, logits.shape[1])
    if not bool(xp.all(xp.isfinite(logits))):
        raise ValueError("logits must be finite: a NaN or infinite router logit has no rank")
    E = logits.shape[1]
    remaining, experts = logits, []
    for _ in range(k):
        best = xp.argmax(remaining, axis=-1)  # (N,) the first largest
        experts.append(best)
        taken = one_hot(best, E, dtype=xp.bool)  # (N, E)
        remaining = xp.where(taken, -math.inf, remaining)  # (N, E)
    return xp.astype(xp.stack(experts, axis=-1), xp.int64)  # (N, k)


def router_forward(logits, experts, *, renormalize: bool = True, aux_weight: float = 0.0):
    """logits (N, E), experts (N, k) integer ids -> ((gates (N, k), aux ()), cache).

    The cache is a dict; ``probs`` (N, E), ``f`` (E,) and ``P`` (E,) are there to be looked at."""
    xp = array_namespace(logits, experts)
    _check_inputs(logits, experts, renormalize, aux_weight)
    (N, E), k = logits.shape, experts.shape[1]
    probs, softmax_cache = softmax_forward(logits, axis=-1)  # (N, E)
    choice = one_hot(experts, E, dtype=logits.dtype)  # (N, k, E)
    selected = xp.sum(choice * probs[:, None, :], axis=-1)  # (N, k)
    total = xp.sum(selected, axis=-1, keepdims=True)  # (N, 1)
    gates = selected / total if renormalize else selected  # (N, k)
    f = xp.sum(choice, axis=(0, 1)) / float(N * k)  # (E,)
    P = xp.mean(probs, axis=0)  # (E,)
    aux = aux_weight * E * xp.sum(f * P)  # ()
    cache = {"probs": probs, "softmax_cache": softmax_cache, "choice": choice, "gates": gates,
             "total": total, "f": f, "P": P, "renormalize": renormalize, "aux_weight": aux_weight}
    return (gates, aux), cache


def router_backward(dout, cache):
    """dout = (dgates (N, k), daux (a float or a 0-d array)) -> (dlogits (N, E),)."""
    xp = array_namespace(cache["probs"])
    dgates, daux = dout
    probs, choice, gates, f = cache["probs"], cache["choice"], cache["gates"], cache["f"]
    N, E = probs.shape
    # aux = aux_weight * E * xp.sum(f * P): f counts choices and gets no gradient
    dP = daux * cache["aux_weight"] * E * f  # (E,)
    # P = xp.mean(probs, axis=0)
    dprobs = xp.zeros_like(probs) + dP / float(N)  # (N, E)
    # gates = selected / total, total = xp.sum(selected, axis=-1, keepdims=True)
    if cache["renormalize"]:
        dselected = (dgates - xp.sum(dgates * gates, axis=-1, keepdims=True)) / cache["total"]
    else:
        dselected = dgates  # (N, k)
    # selected = xp.sum(choice * probs[:, None, :], axis=-1)
    dprobs = dprobs + xp.sum(dselected[..., None] * choice, axis=1)  # (N, E)
    # probs, softmax_cache = softmax_forward(logits, axis=-1)
    return softmax_backward(dprobs, cache["softmax_cache"])


def check_k(k, E: int, name: str = "k") -> None:
    """ValueError unless 1 <= k <= E (k experts chosen out of E)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= E:
        raise ValueError(f"{name} must be an integer between 1 and the number of experts E={E}, "
                         f"got {k!r}")  # fmt: skip


def _check_inputs(logits, experts, renormalize, aux_weight) -> None:
    require_float("logits", logits)
    require_shape("logits", logits, (None, None))
    require_int("experts", experts)
    N, E = logits.shape
    require_shape("experts", experts, (N, None))
    check_k(experts.shape[1], E, name="experts.shape[1] (k)")
    xp = array_namespace(experts)
    if N > 0 and (int(xp.min(experts)) < 0 or int(xp.max(experts)) >= E):
        raise ValueError(f"experts holds ids from {int(xp.min(experts))} to "
                         f"{int(xp.max(experts))}; expert ids must lie in 0..{E - 1}")  # fmt: skip
    if not isinstance(renormalize, bool):
        raise ValueError(f"renormalize must be True or False, got {renormalize!r}")
    if not isinstance(aux_weight, (int, float)) or not aux_weight >= 0:
        raise ValueError(f"aux_weight must be a number >= 0, got {aux_weight!r}")
