"""The fused classifier: the tied output head and cross-entropy, a chunk of tokens at a time.

    logits = x @ wte^T                               (N, V)   the head tied to the embedding
    loss = (1/N) sum_n (logsumexp(logits_n) - logits_n[target_n])
    dlogits = (softmax(logits) - onehot(targets)) / N
    dx = dlogits @ wte,  dwte = dlogits^T @ x

With GPT-2's vocabulary the (N, V) logits dwarf everything else a step holds: N = 8 x 1024
tokens and V = 50,257 make 1.6 GB of float32 logits, and the plain path keeps the probabilities
(another 1.6 GB) for its backward. Here the N rows are taken ``chunk_size`` at a time: each
chunk's logits, loss and dlogits are computed (``cross_entropy.py``, reused as it is) and at
once turned into the chunk's dx and its share of dwte. Only a chunk's (n, V)
arrays ever exist, so the memory of the head is O(chunk_size * V + V * C) instead of O(N * V).

The design (as llm.c's fused classifier): the gradient is computed DURING the forward, because
the forward is the only time a chunk's probabilities exist. The cache is therefore not what the
backward needs to compute the gradient but the gradient itself, d loss / dx and d loss / dwte;
the backward only scales them by the incoming dloss (1.0 when the loss is the last layer). So a
forward that is never followed by a backward (evaluation) does the backward's matmuls in vain:
use the plain head there, or call this layer only where the gradient is wanted.

Book: chapter 14, "The fused classifier".
"""

from __future__ import annotations

import math

from ..backend import array_device, array_namespace
from ..checks import (
    require_float,
    require_ids_in_range,
    require_int,
    require_same_dtype,
    require_shape,
)
from .cross_entropy import cross_entropy_backward, cross_entropy_forward


def chunked_classifier_forward(x, wte, targets, *, chunk_size: int = 128):
    """x (..., C), wte (V, C), targets (...) integer ids -> (loss (), cache (dx, dwte)), loss
    the mean cross-entropy over the N positions, as cross_entropy_forward(x @ wte^T, targets)."""
    xp = array_namespace(x, wte)
    check_classifier_inputs(x, wte, targets, chunk_size)
    V, C = wte.shape
    x_rows = xp.reshape(x, (-1, C))  # (N, C)
    target_rows = xp.reshape(targets, (-1,))  # (N,)
    N = x_rows.shape[0]
    loss = 0.0
    dx_rows = []
    dwte = xp.zeros((V, C), dtype=wte.dtype, device=array_device(wte))  # (V, C), accumulated
    for n0 in range(0, N, chunk_size):
        n1 = min(n0 + chunk_size, N)
        x_chunk = x_rows[n0:n1, :]  # (n, C)
        logits = x_chunk @ wte.mT  # (n, V)
        chunk_loss, ce_cache = cross_entropy_forward(logits, target_rows[n0:n1])  # (), chunk mean
        weight = (n1 - n0) / N  # the chunk's share of the mean over all N
        loss = loss + chunk_loss * weight
        # loss += weight * chunk_loss: dlogits = (probs - onehot) / n * weight, i.e. / N
        (dlogits,) = cross_entropy_backward(weight, ce_cache)  # (n, V)
        # logits = x_chunk @ wte^T
        dx_rows.append(dlogits @ wte)  # (n, C)
        dwte += dlogits.mT @ x_chunk  # (V, C)
    dx = xp.reshape(xp.concat(dx_rows, axis=0), x.shape)  # (..., C)
    return loss, (dx, dwte)


def chunked_classifier_backward(dloss, cache):
    """dloss (scalar, usually 1.0) -> (dx (..., C), dwte (V, C)): the gradients the forward
    computed for dloss = 1, scaled by dloss (the chain rule: d(dloss * loss) = dloss * d loss)."""
    dx, dwte = cache
    return dx * dloss, dwte * dloss


def check_classifier_inputs(x, wte, targets, chunk_size) -> None:
    require_float("x", x)
    require_float("wte", wte)
    require_same_dtype("x", x, "wte", wte)
    require_int("targets", targets)
    if len(wte.shape) != 2:
        raise ValueError(f"wte must have shape (V, C), got {tuple(wte.shape)}")
    require_shape("x", x, (*([None] * (len(x.shape) - 1)), wte.shape[1]))
    if tuple(targets.shape) != tuple(x.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)} but x has shape "
                         f"{tuple(x.shape)}: expected targets.shape == x.shape[:-1]")  # fmt: skip
    if math.prod(targets.shape) == 0:
        raise ValueError("targets is empty: the mean loss over no positions is undefined")
    require_ids_in_range("targets", targets, wte.shape[0])
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer (rows per chunk), "
                         f"got {chunk_size!r}")  # fmt: skip
