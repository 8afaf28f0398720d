"""The fused (chunked) classifier against the plain head + cross-entropy it replaces.

The table of tests/test_layers.py checks its gradients. Here: equality with
linear_forward(x, wte^T) + cross_entropy_forward for chunk sizes that do and do not divide N,
against torch's cross_entropy and its autograd, the backward's scaling by dloss, and the cache's
size in bytes: no (N, V) array survives the forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bounds import assert_relative, roundoff

from conftest import get_backend, to_host
from gptlab import autograd as ag
from gptlab.layers.chunked_classifier import chunked_classifier_backward, chunked_classifier_forward
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.linear import linear_backward, linear_forward

B, T, C, V = 2, 7, 4, 11


def _inputs(rng):
    return rng.standard_normal((B, T, C)), rng.standard_normal((V, C)), rng.integers(0, V, (B, T))


def _plain(backend, x, wte, targets, dloss):
    """The head and the loss as two layers: logits (B, T, V) and probs (B, T, V) whole."""
    logits, head_cache = linear_forward(backend.asarray(x), backend.asarray(wte).mT)
    loss, ce_cache = cross_entropy_forward(logits, backend.asarray(targets))
    (dlogits,) = cross_entropy_backward(dloss, ce_cache)
    dx, dwte_t, _ = linear_backward(dlogits, head_cache)
    return to_host(loss), to_host(dx), to_host(dwte_t).T


@pytest.mark.parametrize("chunk_size", [1, 3, 5, B * T, 1000])
def test_chunked_equals_plain_head_and_cross_entropy(backend, chunk_size, rng):
    x, wte, targets = _inputs(rng)
    loss, cache = chunked_classifier_forward(*map(backend.asarray, (x, wte, targets)),
                                             chunk_size=chunk_size)  # fmt: skip
    dx, dwte = to_host(chunked_classifier_backward(0.7, cache))
    want_loss, want_dx, want_dwte = _plain(backend, x, wte, targets, 0.7)
    np.testing.assert_allclose(to_host(loss), want_loss, rtol=1e-13)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(dwte, want_dwte, rtol=1e-12, atol=1e-14)


@pytest.mark.roundoff
def test_chunked_matches_torch_cross_entropy_in_float32(rng):
    """float32 torch against F.cross_entropy(x @ wte^T) and its autograd in float64."""
    x, wte, targets = _inputs(rng)
    backend = get_backend("torch", "float32")
    loss, cache = chunked_classifier_forward(*map(backend.asarray, (x, wte, targets)), chunk_size=4)
    dx, dwte = chunked_classifier_backward(2.0, cache)
    assert loss.dtype == dx.dtype == dwte.dtype == torch.float32
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(wte, requires_grad=True)
    logits = (tx @ tw.T).reshape(-1, V)
    want = torch.nn.functional.cross_entropy(logits, torch.tensor(targets).ravel())
    (2.0 * want).backward()
    bound = roundoff("float32", B * T, steps=2, why=f"{B * T} rows summed into dwte and the loss "
                     f"(more than the {V} logits or {C} columns), forward and backward")
    label = "chunked classifier float32 vs float64"
    assert_relative(float(loss), want.item(), bound, label, "loss")
    assert_relative(to_host(dx), tx.grad, bound, label, "dx")
    assert_relative(to_host(dwte), tw.grad, bound, label, "dwte")


def test_autograd_wrapper_drives_both_gradients(rng):
    """gptlab.autograd.chunked_classifier: .backward() scales the stored gradients by dloss."""
    x, wte, targets = _inputs(rng)
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(wte, requires_grad=True)
    (3.0 * ag.chunked_classifier(tx, tw, torch.tensor(targets), chunk_size=5)).backward()
    _, want_dx, want_dwte = _plain(get_backend("numpy"), x, wte, targets, 3.0)
    np.testing.assert_allclose(tx.grad.numpy(), want_dx, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(tw.grad.numpy(), want_dwte, rtol=1e-12, atol=1e-14)


def test_no_N_by_V_array_survives_the_forward(rng):
    """The cache is the gradient itself: dx (N, C) and dwte (V, C), exactly; the plain layers'
    caches hold the probabilities (N, V)."""
    N, C_big, V_big = 64, 8, 500
    x, wte = rng.standard_normal((N, C_big)), rng.standard_normal((V_big, C_big))
    targets = rng.integers(0, V_big, N)
    _, cache = chunked_classifier_forward(x, wte, targets, chunk_size=16)
    assert sum(a.nbytes for a in cache) == (N * C_big + V_big * C_big) * x.itemsize
    logits, _ = linear_forward(x, wte.T)
    _, (probs, _) = cross_entropy_forward(logits, targets)
    assert probs.nbytes == N * V_big * x.itemsize
