"""Input validation shared by the layers, the model and the optimizers: clear errors that name the
problem."""

from __future__ import annotations

import math

from .backend import array_namespace, is_floating, is_integer


def require_float(name: str, x) -> None:
    """Raise TypeError unless ``x`` is a floating-point array."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if not is_floating(x):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def require_int(name: str, x) -> None:
    """Raise TypeError unless ``x`` is an integer array (token ids)."""
    if not hasattr(x, "dtype") or not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an integer array, got {type(x).__name__}")
    if not is_integer(x):
        raise TypeError(f"{name} must be an integer array of token ids, got dtype {x.dtype}")


def require_shape(name: str, x, shape: tuple) -> None:
    """Raise ValueError unless ``x.shape`` matches ``shape`` (``None`` entries match anything)."""
    ok = len(x.shape) == len(shape) and all(s is None or s == d for s, d in zip(shape, x.shape))
    if not ok:
        want = "(" + ", ".join("*" if s is None else str(s) for s in shape)
        want += ",)" if len(shape) == 1 else ")"
        raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want}")


def require_ndim_at_least(name: str, x, ndim: int) -> None:
    if len(x.shape) < ndim:
        raise ValueError(f"{name} must have at least {ndim} dimensions, got shape {tuple(x.shape)}")


def require_logits_and_targets(logits, targets) -> None:
    """The checks of a loss over logits (..., V) and target ids (...): float logits, integer
    targets of shape logits.shape[:-1], every id in [0, V)."""
    require_float("logits", logits)
    require_int("targets", targets)
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets has shape {tuple(targets.shape)} but logits has shape {tuple(logits.shape)}:"
            " expected targets.shape == logits.shape[:-1]"
        )
    require_ids_in_range("targets", targets, logits.shape[-1])


def require_ids_in_range(name: str, idx, upper: int) -> None:
    """Raise ValueError unless every id satisfies 0 <= id < upper."""
    xp = array_namespace(idx)
    if math.prod(idx.shape) == 0:
        return
    if int(xp.min(idx)) < 0:
        raise ValueError(f"{name} holds a negative token id ({int(xp.min(idx))})")
    if int(xp.max(idx)) >= upper:
        raise ValueError(
            f"{name} holds token id {int(xp.max(idx))}, outside the vocabulary of size {upper}"
        )


def require_same_dtype(name_a: str, a, name_b: str, b) -> None:
    if a.dtype != b.dtype:
        raise TypeError(f"{name_a} has dtype {a.dtype} but {name_b} has dtype {b.dtype}")


def _require_nonnegative(name: str, value) -> None:
    if not value >= 0.0:  # NaN fails too
        raise ValueError(f"{name} must be >= 0, got {value!r}")


def check_adamw_hyperparameters(lr, betas, eps, weight_decay) -> None:
    """Raise ValueError naming the bad one: lr, eps, weight_decay >= 0; β1, β2 in [0, 1).

    ε = 0 is allowed, as in torch.optim.AdamW: the first step is then exactly ±η."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        _require_nonnegative(name, value)
    if len(betas) != 2:
        raise ValueError(f"betas must be two numbers (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {beta!r}")


def check_sgd_hyperparameters(lr, momentum, weight_decay, nesterov) -> None:
    """Raise ValueError naming the bad one: lr, momentum, weight_decay >= 0; Nesterov needs
    momentum > 0."""
    for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
        _require_nonnegative(name, value)
    if nesterov and momentum <= 0.0:
        raise ValueError("Nesterov momentum needs momentum > 0")

