"""A mixture-of-experts MLP: E GPT-2 MLPs, each token sent to k of them by a learned router
(Shazeer et al. 2017; Fedus et al. 2021, Switch Transformer; Jiang et al. 2024, Mixtral).

    logits = x @ w_router                                   (N, E)    N = B*T tokens
    experts, gates, aux = the router (router.py)            (N, k), (N, k), ()
    capacity = ceil(capacity_factor * N * k / E)            tokens an expert takes at most
    keep[n, e] = token n chose e and is among the first `capacity` tokens, in token order, that
                 chose e (whichever of its k slots it chose e in); capacity_factor=None: no limit
    combine[n, e] = gate of token n for expert e if keep[n, e], else 0       (N, E)
    y[n] = sum_e combine[n, e] * mlp_e(x[n])                                  (N, C)

Priority is token order alone (GShard, Lepikhin et al. 2020, serves all first choices before
any second choice; with k = 1 the two agree). A token over capacity gets nothing from that expert (a
token dropped by all its k experts has y = 0, and with the block's residual x + y it passes
through unchanged); the gates of its other experts are not rescaled. The experts' weights
are stacked: w_fc (E, C, 4C), b_fc (E, 4C), w_proj (E, 4C, C), b_proj (E, C), expert e is
``mlp_forward(x, w_fc[e], b_fc[e], w_proj[e], b_proj[e])``. Dispatch gathers each expert's
tokens (``take_rows``), runs its MLP on them at once, and scatter-adds the gated outputs back
(``scatter_add_rows``): a loop over the E experts, none over tokens.

The output is the pair (y, aux); the loss adds aux. Backward takes the pair (dy, daux):

    dh_e = combine[tokens_e, e] * dy[tokens_e],   dcombine[tokens_e, e] = sum_c dy * mlp_e(x)
    dx[tokens_e] += the MLP's backward of dh_e            (mlp.py; and its weight gradients)
    dgates[n, j] = sum_e dcombine[n, e] * choice[n, j, e] * keep[n, e]
    dlogits = the router's backward of (dgates, daux); dx += dlogits @ w_router^T

so the router learns through the gates of the experts a token reached and through aux's P_e,
nothing else (the choice itself is piecewise constant).

Book: chapter 18, "Mixture of experts".
"""

from __future__ import annotations

import math

from ..backend import array_namespace, one_hot, scatter_add_rows, take_rows
from ..checks import require_float, require_ndim_at_least, require_same_dtype, require_shape
from .linear import linear_backward, linear_forward
from .mlp import mlp_backward, mlp_forward
from .router import check_k, router_backward, router_forward, top_k_experts


def moe_forward(x, w_router, w_fc, b_fc, w_proj, b_proj, *, k: int = 2, renormalize: bool = True,
                capacity_factor: float | None = None, aux_weight: float = 0.01,
                approximate: str = "tanh"):  # fmt: skip
    """x (..., C), w_router (C, E), w_fc (E, C, H), b_fc (E, H), w_proj (E, H, C), b_proj (E, C)
    -> ((y (..., C), aux ()), cache). ``cache["stats"]`` tells which token went where."""
    xp = array_namespace(x, w_router, w_fc, b_fc, w_proj, b_proj)
    _check_inputs(x, w_router, w_fc, b_fc, w_proj, b_proj, k, capacity_factor)
    C, E = w_router.shape
    x_flat = xp.reshape(x, (-1, C))  # (N, C)
    N = x_flat.shape[0]
    logits, logits_cache = linear_forward(x_flat, w_router)  # (N, E)
    experts = top_k_experts(logits, k)  # (N, k)
    (gates, aux), router_cache = router_forward(logits, experts, renormalize=renormalize,
                                                aux_weight=aux_weight)  # fmt: skip
    choice = one_hot(experts, E, dtype=x.dtype)  # (N, k, E)
    chose = xp.sum(choice, axis=1) > 0.5  # (N, E)
    queue = xp.cumulative_sum(xp.astype(chose, xp.int64), axis=0)  # (N, E) place in e's queue
    capacity = None if capacity_factor is None else math.ceil(capacity_factor * N * k / E)
    keep = chose if capacity is None else xp.logical_and(chose, queue <= capacity)  # (N, E)
    keep = xp.astype(keep, x.dtype)  # (N, E)
    combine = xp.sum(gates[..., None] * choice, axis=1) * keep  # (N, E)
    y = xp.zeros_like(x_flat)  # (N, C)
    per_expert = []
    for e in range(E):
        (tokens,) = xp.nonzero(keep[:, e])  # (n_e,) in token order
        x_e = take_rows(x_flat, tokens)  # (n_e, C)
        h, mlp_cache = mlp_forward(x_e, w_fc[e, ...], b_fc[e, ...], w_proj[e, ...],
                                   b_proj[e, ...], approximate=approximate)  # (n_e, C)
        weight = xp.take(combine[:, e], tokens)  # (n_e,)
        y = y + scatter_add_rows(N, tokens, weight[:, None] * h)  # (N, C)
        per_expert.append((tokens, h, weight, mlp_cache))
    stats = _routing_stats(tuple(x.shape[:-1]), experts, gates, choice, keep, router_cache,
                           capacity)  # fmt: skip
    cache = {"logits_cache": logits_cache, "router_cache": router_cache, "choice": choice,
             "keep": keep, "per_expert": per_expert, "stats": stats}
    return (xp.reshape(y, x.shape), aux), cache


def moe_backward(dout, cache):
    """dout = (dy (..., C), daux (a float or a 0-d array))
    -> (dx, dw_router, dw_fc, db_fc, dw_proj, db_proj), each of its input's shape."""
    dy, daux = dout
    xp = array_namespace(dy)
    choice, keep = cache["choice"], cache["keep"]
    N, E = keep.shape
    dy_flat = xp.reshape(dy, (N, -1))  # (N, C)
    dx = xp.zeros_like(dy_flat)  # (N, C)
    dcombine, expert_grads = [], []
    for tokens, h, weight, mlp_cache in cache["per_expert"]:
        # y = y + scatter_add_rows(N, tokens, weight[:, None] * h)
        dy_e = take_rows(dy_flat, tokens)  # (n_e, C)
        dweight = xp.sum(dy_e * h, axis=-1)  # (n_e,)
        # weight = xp.take(combine[:, e], tokens): a column of dcombine, zero off the tokens
        dcombine.append(scatter_add_rows(N, tokens, dweight[:, None]))  # (N, 1)
        # h, mlp_cache = mlp_forward(x_e, w_fc[e, ...], ...), x_e = take_rows(x_flat, tokens)
        dx_e, *dweights = mlp_backward(weight[:, None] * dy_e, mlp_cache)  # (n_e, C)
        dx = dx + scatter_add_rows(N, tokens, dx_e)  # (N, C)
        expert_grads.append(dweights)
    dcombine = xp.concat(dcombine, axis=-1)  # (N, E)
    # combine = xp.sum(gates[..., None] * choice, axis=1) * keep
    dgates = xp.sum(dcombine[:, None, :] * choice * keep[:, None, :], axis=-1)  # (N, k)
    # (gates, aux), router_cache = router_forward(logits, experts, ...)
    (dlogits,) = router_backward((dgates, daux), cache["router_cache"])  # (N, E)
    # logits, logits_cache = linear_forward(x_flat, w_router)
    dx_router, dw_router, _ = linear_backward(dlogits, cache["logits_cache"])  # (N, C)
    dx = xp.reshape(dx + dx_router, dy.shape)  # (..., C)
    dw_fc, db_fc, dw_proj, db_proj = (xp.stack(g, axis=0) for g in zip(*expert_grads))
    return dx, dw_router, dw_fc, db_fc, dw_proj, db_proj


def _routing_stats(lead, experts, gates, choice, keep, router_cache, capacity) -> dict:
    """Where the tokens went, for pictures and logs; ``lead`` is x's shape without C:
    experts, gates, kept (..., k): each token's chosen experts (best first), their gates, and
    whether the expert took it (False: dropped over capacity); probs (..., E); routed (E,) and
    load (E,): the tokens that chose each expert and those it took; mean_probs (E,) (aux's P);
    capacity (None: no limit) and dropped (the choices that found their expert full)."""
    xp = array_namespace(experts)
    (N, k), E = experts.shape, keep.shape[1]
    kept = xp.sum(choice * keep[:, None, :], axis=-1) > 0.5  # (N, k)
    load = xp.astype(xp.sum(keep, axis=0), xp.int64)  # (E,)
    return {"experts": xp.reshape(experts, (*lead, k)), "gates": xp.reshape(gates, (*lead, k)),
            "kept": xp.reshape(kept, (*lead, k)),
            "probs": xp.reshape(router_cache["probs"], (*lead, E)),
            "routed": xp.astype(xp.sum(choice, axis=(0, 1)), xp.int64), "load": load,
            "mean_probs": router_cache["P"], "capacity": capacity,
            "dropped": N * k - int(xp.sum(load))}  # fmt: skip


def _check_inputs(x, w_router, w_fc, b_fc, w_proj, b_proj, k, capacity_factor) -> None:
    named = {"x": x, "w_router": w_router, "w_fc": w_fc, "b_fc": b_fc, "w_proj": w_proj,
             "b_proj": b_proj}  # fmt: skip
    for name, a in named.items():
        require_float(name, a)
        require_same_dtype("x", x, name, a)
    require_ndim_at_least("x", x, 1)
    C = x.shape[-1]
    require_shape("w_router", w_router, (C, None))
    E = w_router.shape[1]
    require_shape("w_fc", w_fc, (E, C, None))
    H = w_fc.shape[2]
    require_shape("b_fc", b_fc, (E, H))
    require_shape("w_proj", w_proj, (E, H, C))
    require_shape("b_proj", b_proj, (E, C))
    check_k(k, E)
    if capacity_factor is not None and not (
        isinstance(capacity_factor, (int, float)) and capacity_factor > 0
    ):
        raise ValueError(f"capacity_factor must be a number > 0 or None (no limit), "
                         f"got {capacity_factor!r}")  # fmt: skip
