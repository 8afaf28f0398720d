"""Learning-rate schedules and gradient-norm clipping.

Steps are counted like Adam's t: ``t`` is the number of the update about to be made (1, 2, ...),
so t = 0 means "before any update" (a warmup gives η_0 = 0; training never uses t = 0).

- ``cosine_lr``: GPT-3's schedule (Brown et al., 2020, appendix B): a linear warmup to η_max over
  w updates, a cosine decay to the floor η_min at update D, then η_min.
- ``inverse_sqrt_lr``: the formula η_t = η_max · min(t/w, (t/E)^-0.5) of the GPT-3 summary card
  (an undated one-page summary of GPT-3), which never defines E (its pseudo-code uses E for the
  number of epochs). With E < w the two branches cross before the warmup ends, at
  t* = (E·w²)^(1/3), and η peaks there at only η_max·(E/w)^(1/3). We take E = w: the branches
  meet at t = w, where η peaks at η_max, and this is the Transformer's schedule (Vaswani et al., 2017:
  d^-0.5 · min(t^-0.5, t·w^-1.5) = η_max · min(t/w, (t/w)^-0.5) with η_max = (d·w)^-0.5).
  Note the paper's GPT-3 itself used the cosine schedule, not this one.
- ``clip_grad_norm``: rescale all gradients together so their global L2 norm is at most
  ``max_norm`` (GPT-3 clips at 1.0), torch.nn.utils.clip_grad_norm_'s rule.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..backend import array_namespace

SCHEDULES = ("cosine", "inverse_sqrt", "constant")


def cosine_lr(t: int, *, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """η_t: η_max·t/w for t <= w, a cosine from η_max down to η_min at t = D, then η_min."""
    if t <= warmup_iters and warmup_iters > 0:
        return lr * t / warmup_iters
    if t >= decay_iters:
        return min_lr
    progress = (t - warmup_iters) / (decay_iters - warmup_iters)  # in (0, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def inverse_sqrt_lr(t: int, *, lr: float, warmup_iters: int) -> float:
    """η_t = η_max · min(t/w, (t/w)^-0.5), the GPT-3 summary card's formula with E = w; η_0 = 0."""
    if t == 0:
        return 0.0  # (t/w)^-0.5 is infinite, t/w is 0: the min is 0
    return lr * min(t / warmup_iters, (t / warmup_iters) ** -0.5)


def make_schedule(name: str, *, lr: float, min_lr: float = 0.0, warmup_iters: int = 0,
                  decay_iters: int | None = None) -> Callable[[int], float]:
    """The schedule ``name`` ("cosine", "inverse_sqrt" or "constant") as a function t -> η_t."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown lr schedule {name!r}: expected one of {SCHEDULES}")
    if warmup_iters < 0 or (name == "inverse_sqrt" and warmup_iters < 1):
        raise ValueError(f"the {name} schedule needs warmup_iters >= "
                         f"{1 if name == 'inverse_sqrt' else 0}, got {warmup_iters}")
    if name == "constant":
        return lambda t: lr
    if name == "inverse_sqrt":
        return lambda t: inverse_sqrt_lr(t, lr=lr, warmup_iters=warmup_iters)
    if decay_iters is None or decay_iters <= warmup_iters:
        raise ValueError(f"the cosine schedule needs decay_iters > warmup_iters ({warmup_iters}), "
                         f"got {decay_iters}")
    if not 0.0 <= min_lr <= lr:
        raise ValueError(f"the cosine schedule needs 0 <= min_lr <= lr, got {min_lr} and {lr}")
    return lambda t: cosine_lr(t, lr=lr, min_lr=min_lr, warmup_iters=warmup_iters,
                               decay_iters=decay_iters)


def global_norm(grads: dict) -> float:
    """‖g‖₂ = sqrt(Σ over every array and element of g²), as a Python float."""
    total = 0.0
    for g in grads.values():
        xp = array_namespace(g)
        total += float(xp.sum(g * g))
    return math.sqrt(total)


def clip_grad_norm(grads: dict, max_norm: float, norm: float | None = None) -> float:
    """Scale ``grads`` in place (the dict's entries are replaced) to a global norm <= max_norm.

    Returns the norm before clipping. Like torch.nn.utils.clip_grad_norm_, the factor is
    max_norm / (norm + 1e-6), applied only when it is below 1. A non-finite norm is returned as
    it is and the grads are left alone: the caller decides what divergence means. ``norm``: the
    global norm when ``grads`` hold only a part of the gradient (a shard of a parallel run).
    """
    total_norm = global_norm(grads) if norm is None else norm
    coef = max_norm / (total_norm + 1e-6)
    if math.isfinite(total_norm) and coef < 1.0:
        for name in grads:
            grads[name] = grads[name] * coef
    return total_norm


def clip_grad_norm_(parameters, max_norm: float, norm: float | None = None) -> float:
    """``clip_grad_norm`` in place, with the arguments of torch.nn.utils.clip_grad_norm_:
    ``parameters`` is one tensor or array, or an iterable of them. A torch tensor stands for its
    ``.grad``, as in torch: a None grad (a frozen parameter, or no backward yet) is skipped and
    the tensor itself is never touched. An array with no ``.grad`` (NumPy, array API) is itself
    a gradient and scaled in place. Returns the norm before clipping, as a Python float."""
    if hasattr(parameters, "shape"):
        parameters = [parameters]
    grads = [p.grad if hasattr(p, "grad") else p for p in parameters]
    grads = {i: g for i, g in enumerate(grads) if g is not None}
    scaled = dict(grads)
    total_norm = clip_grad_norm(scaled, max_norm, norm)
    for i, g in grads.items():
        if scaled[i] is not g:  # clipped: write the scaled gradient back into its array
            g[...] = scaled[i]
    return total_norm


__all__ = ["SCHEDULES", "cosine_lr", "inverse_sqrt_lr", "make_schedule", "global_norm",
           "clip_grad_norm", "clip_grad_norm_"]
