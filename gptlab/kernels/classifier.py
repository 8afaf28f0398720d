"""The tied classifier fused with the cross-entropy: a chunk of tokens at a time, the softmax, the
loss and dlogits in one Triton kernel that walks the vocabulary in tiles.

The same function as ``gptlab/layers/chunked_classifier.py`` (its test oracle):

    logits = x @ wte^T                                   (N, V), a chunk of n rows at a time
    loss = (1/N) sum_n (logsumexp(logits_n) - logits_n[target_n])
    dlogits = (softmax(logits) - onehot(targets)) / N
    dx = dlogits @ wte,  dwte = dlogits^T @ x

The matrix products are torch's (cuBLAS's tensor-core matmuls); what the kernel fuses is
everything between them. One program per row of a chunk's logits, two passes over its V numbers
in tiles of BLOCK_V (the design of Liger's fused linear cross-entropy and llm.c's classifier):

    pass 1   the online max and sum:
             m_new = max(m, max(tile)),  l = exp(m - m_new) l + sum(exp(tile - m_new))
    pass 2   dlogits = (exp(tile - m) / l - onehot) / N, written over the logits in place

and the row's loss log(l) + m - logits[target]. So a chunk's (n, V) logits are read twice and
written once, and never more than a chunk of them exist: the whole (N, V) logits are never held.
As in the layer, the gradient is computed during the forward, and the cache holds dx and dwte.
dwte adds up the chunks in float32.

Book: chapter 23, "The fused classifier as a kernel".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..layers.chunked_classifier import check_classifier_inputs
from .launch import check_tensors, check_tile


@triton.jit
def _softmax_cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, V, inv_N,
                                  BLOCK_V: tl.constexpr):  # fmt: skip
    """Program (row): the row's loss; its logits (V,) overwritten by dlogits."""
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * V
    target = tl.load(targets_ptr + row)
    m = tl.full((), -float("inf"), tl.float32)  # running max of the row
    l = tl.zeros((), tl.float32)  # running sum of exp(logits - m)
    for c0 in range(0, V, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)  # (bv,)
        tile = tl.load(logits_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(tile, 0))
        l = l * tl.exp(m - m_new) + tl.sum(tl.exp(tile - m_new), 0)
        m = m_new
    picked = tl.load(logits_ptr + target).to(tl.float32)  # logits[target]
    tl.store(loss_ptr + row, tl.log(l) + m - picked)  # logsumexp - logits[target]
    for c0 in range(0, V, BLOCK_V):
        cols = c0 + tl.arange(0, BLOCK_V)  # (bv,)
        tile = tl.load(logits_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
        # loss = (1/N) sum (logsumexp - logits[target]): dlogits = (probs - onehot) / N
        probs = tl.exp(tile - m) / l  # (bv,)
        dlogits = (probs - tl.where(cols == target, 1.0, 0.0)) * inv_N  # (bv,)
        tl.store(logits_ptr + cols, dlogits, mask=cols < V)


def classifier_forward(x, wte, targets, *, chunk_size: int = 2048, block_v: int = 1024,
                       num_warps: int = 8):  # fmt: skip
    """x (..., C), wte (V, C), targets (...) integer ids -> (loss () float32, cache (dx, dwte)),
    as the layer: the mean cross-entropy of x @ wte^T over the N positions."""
    check_classifier_inputs(x, wte, targets, chunk_size)
    check_tensors(x=x, wte=wte)
    check_tile("block_v", block_v)
    loss, (dx, dwte) = fused_classifier(x.reshape(-1, wte.shape[1]), wte, targets.reshape(-1),
                                        chunk_size=chunk_size, block_v=block_v,
                                        num_warps=num_warps)  # fmt: skip
    return loss, (dx.view(x.shape), dwte)


def fused_classifier(x_rows, wte, target_rows, *, chunk_size: int = 2048, block_v: int = 1024,
                     num_warps: int = 8):  # fmt: skip
    """``classifier_forward`` on rows, x_rows (N, C), target_rows (N,), without its checks (the
    fused path checks its inputs once, at the model's boundary): nothing is read back to the
    host, so a CUDA graph can hold it -> (loss () float32, (dx (N, C), dwte (V, C)))."""
    V, C = wte.shape
    target_rows = target_rows.to(device=x_rows.device, dtype=torch.int64).contiguous()  # (N,)
    N = x_rows.shape[0]
    losses = torch.empty(N, dtype=torch.float32, device=x_rows.device)  # (N,) each row's loss
    dx = torch.empty_like(x_rows)  # (N, C)
    dwte = torch.zeros(V, C, dtype=torch.float32, device=x_rows.device)  # (V, C), over the chunks
    for n0 in range(0, N, chunk_size):
        n1 = min(n0 + chunk_size, N)
        x_chunk = x_rows[n0:n1]  # (n, C)
        logits = x_chunk @ wte.mT  # (n, V), becomes dlogits in place
        _softmax_cross_entropy_kernel[(n1 - n0,)](logits, target_rows[n0:n1], losses[n0:n1], V,
                                                  1.0 / N, BLOCK_V=block_v, num_warps=num_warps)
        # logits = x_chunk @ wte^T
        torch.mm(logits, wte, out=dx[n0:n1])  # (n, C)
        dwte += logits.mT @ x_chunk  # (V, C)
    return losses.sum() / N, (dx, dwte.to(wte.dtype))


def classifier_backward(dloss, cache):
    """dloss (scalar, usually 1.0) -> (dx (..., C), dwte (V, C)): the forward's gradients times
    dloss (the cache itself when dloss is 1)."""
    dx, dwte = cache
    return (dx, dwte) if dloss == 1.0 else (dx * dloss, dwte * dloss)
