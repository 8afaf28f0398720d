"""Input validation shared by the layers and the model: clear errors that name the problem."""

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
