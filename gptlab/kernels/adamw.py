"""AdamW as one Triton kernel: the moments, the decoupled decay and the step of a tensor in one
pass, and the bfloat16 (or float16) compute copy written in the same pass.

The same update as ``gptlab.training.optim.adamw_update`` (its test oracle), chapter "Training":

    m_t = b1 m + (1 - b1) g,   v_t = b2 v + (1 - b2) g^2
    theta_t = theta (1 - lr wd) - lr (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)

on float32 master weights theta and float32 moments, with g in any float dtype (the gradient of
the compute copy). The torch-ops update is about ten element-wise passes over each parameter, and
mixed precision adds another for the compute copy; here each element of theta, g, m and v is read
once and theta, m, v and the copy written once. Unlike the layer function, the update is IN PLACE:
theta, m and v are overwritten and returned.

Book: chapter 23, "The fused optimizer".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..checks import check_adamw_hyperparameters
from .launch import check_tensors


@triton.jit
def _adamw_kernel(theta_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, n, lr, beta1, beta2, eps,
                  weight_decay, bias1, bias2, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """Program (BLOCK elements): theta, m, v updated in place; copy = theta in its dtype."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = at < n
    theta = tl.load(theta_ptr + at, mask=mask)  # (BLOCK,) float32
    g = tl.load(g_ptr + at, mask=mask).to(tl.float32)
    m = beta1 * tl.load(m_ptr + at, mask=mask) + (1.0 - beta1) * g  # m_t = b1 m + (1 - b1) g
    v = beta2 * tl.load(v_ptr + at, mask=mask) + (1.0 - beta2) * g * g  # v_t = b2 v + (1 - b2) g^2
    # decoupled weight decay first (torch's order), then the step with the bias corrections
    theta = theta * (1.0 - lr * weight_decay) - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
    tl.store(theta_ptr + at, theta, mask=mask)
    tl.store(m_ptr + at, m, mask=mask)
    tl.store(v_ptr + at, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + at, theta, mask=mask)  # rounded to the copy's dtype


def adamw_update(theta, g, m, v, *, step: int, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, compute=None, block: int = 1024):  # fmt: skip
    """One AdamW update of one tensor, in place -> (theta, m, v); ``step`` is t (1 for the
    first). theta, m, v: contiguous float32 tensors of one shape; g: that shape, any float dtype;
    ``compute``: a tensor of that shape (bf16, fp16) that receives the new theta, or None."""
    check_adamw_hyperparameters(lr, betas, eps, weight_decay)
    named = {"theta": theta, "g": g, "m": m, "v": v}
    if compute is not None:
        named["compute"] = compute
    check_tensors(**named)
    for name, t in named.items():
        if t.shape != theta.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor of theta's shape "
                             f"{tuple(theta.shape)}, got {tuple(t.shape)}")  # fmt: skip
        if name in ("theta", "m", "v") and t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the master weights and moments), "
                            f"got {t.dtype}")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"step must be an integer >= 1 (t of the first update is 1), got {step!r}")
    beta1, beta2 = betas
    n = theta.numel()
    _adamw_kernel[(triton.cdiv(n, block),)](
        theta, g, m, v, theta if compute is None else compute, n, lr, beta1, beta2, eps,
        weight_decay, 1.0 - beta1**step, 1.0 - beta2**step, HAS_COPY=compute is not None,
        BLOCK=block)
    return theta, m, v
