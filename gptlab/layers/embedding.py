"""Token embedding: a row lookup, which is the one-hot matrix product written efficiently.

    one-hot view:  X = onehot(idx) @ wte        (B, T, V) @ (V, C) -> (B, T, C)
    lookup:        X[b, t] = wte[idx[b, t]]
    backward:      dwte = onehot(idx)^T @ dX    = scatter-add of dX rows into the rows of wte

Book: chapter 1, "From text to vectors".
"""

from __future__ import annotations

from ..backend import array_namespace, one_hot, scatter_add_rows, take_rows
from ..checks import require_float, require_ids_in_range, require_int


def _check(idx, wte):
    require_int("idx", idx)
    require_float("wte", wte)
    if len(wte.shape) != 2:
        raise ValueError(f"wte must be a (V, C) matrix, got shape {tuple(wte.shape)}")
    require_ids_in_range("idx", idx, wte.shape[0])


def embedding_forward(idx, wte):
    """idx (B, T) integer token ids, wte (V, C) -> x (B, T, C) by row lookup."""
    _check(idx, wte)
    x = take_rows(wte, idx)  # (B, T, C)
    return x, (idx, wte.shape[0])


def embedding_backward(dx, cache):
    """dx (B, T, C) -> (dwte (V, C),). A token that appears n times collects n rows of dx."""
    idx, V = cache
    # x[b, t] = wte[idx[b, t]]
    dwte = scatter_add_rows(V, idx, dx)  # (V, C)
    return (dwte,)


def embedding_onehot_forward(idx, wte):
    """The same embedding as a matrix product: onehot(idx) (B, T, V) @ wte (V, C)."""
    _check(idx, wte)
    onehot = one_hot(idx, wte.shape[0], dtype=wte.dtype)  # (B, T, V)
    x = onehot @ wte  # (B, T, C)
    return x, (onehot,)


def embedding_onehot_backward(dx, cache):
    """dx (B, T, C) -> (dwte (V, C),) as onehot^T @ dx, summed over the batch."""
    xp = array_namespace(dx)
    (onehot,) = cache
    V, C = onehot.shape[-1], dx.shape[-1]
    # x = onehot @ wte
    dwte = xp.reshape(onehot, (-1, V)).mT @ xp.reshape(dx, (-1, C))  # (V, C)
    return (dwte,)
