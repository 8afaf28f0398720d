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

Over a whole model it is ONE launch: ``gptlab.fast.FlatParams`` holds every parameter's master
weights, compute copy and gradient as views of one flat buffer each, the decayed matrices first,
so the decay is lambda for the first ``decayed`` elements and 0 after them. One scalar multiplies
g as it is read, ``grad_scale`` = c / s, from the clip factor c = min(1, max_norm / ||g||) and
float16's loss scale s (the backward gave the gradients of s * loss). So the gradients are never
rewritten to be clipped or unscaled, and a float32 copy of the bfloat16 gradients is never made
(``gptlab.training.optim.FusedAdamW`` drives it). The copy is theta rounded to the nearest
bfloat16 (or float16) number, ties to even, as torch's cast rounds.

Book: chapter 23, "The fused optimizer".
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..checks import check_adamw_hyperparameters
from .launch import check_tensors, check_tile


@triton.jit
def _round_to_bfloat16(x):
    """float32 -> bfloat16, rounded to nearest, ties to even, in integer arithmetic: add half a
    unit of bfloat16's last place (less one, plus the kept last bit) and drop the low 16 bits.
    The GPU's own cast rounds so too; Triton's interpreter truncates, hence the explicit form.
    (A NaN whose low mantissa bits are all set would carry into the sign; the loop never updates
    from a gradient that is not finite.)"""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _adamw_kernel(theta_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, n, n_decayed, grad_scale, lr,
                  beta1, beta2, eps, weight_decay, bias1, bias2, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):  # fmt: skip
    """Program (BLOCK elements): theta, m, v updated in place; copy = theta in its dtype."""
    at = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,)
    mask = at < n
    theta = tl.load(theta_ptr + at, mask=mask)  # (BLOCK,) float32
    g = tl.load(g_ptr + at, mask=mask).to(tl.float32) * grad_scale  # g = (c / s) g_stored
    decay = tl.where(at < n_decayed, weight_decay, 0.0)  # (BLOCK,) the decayed names first
    m = beta1 * tl.load(m_ptr + at, mask=mask) + (1.0 - beta1) * g  # m_t = b1 m + (1 - b1) g
    v = beta2 * tl.load(v_ptr + at, mask=mask) + (1.0 - beta2) * g * g  # v_t = b2 v + (1 - b2) g^2
    # decoupled weight decay first (torch's order), then the step with the bias corrections
    theta = theta * (1.0 - lr * decay) - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
    tl.store(theta_ptr + at, theta, mask=mask)
    tl.store(m_ptr + at, m, mask=mask)
    tl.store(v_ptr + at, v, mask=mask)
    if HAS_COPY:  # the compute copy: theta rounded to nearest in the copy's dtype
        if copy_ptr.dtype.element_ty == tl.bfloat16:
            tl.store(copy_ptr + at, _round_to_bfloat16(theta), mask=mask)
        else:
            tl.store(copy_ptr + at, theta.to(copy_ptr.dtype.element_ty), mask=mask)


def adamw_update(theta, g, m, v, *, step: int, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float, compute=None, grad_scale: float = 1.0,
                 decayed: int | None = None, block: int = 1024):  # fmt: skip
    """One AdamW update of one tensor, in place -> (theta, m, v); ``step`` is t (1 for the
    first). theta, m, v: contiguous float32 tensors of one shape; g: that shape, any float dtype;
    ``compute``: a tensor of that shape (bf16, fp16) that receives the new theta, or None.
    ``grad_scale``: the gradient is grad_scale * g (the clip factor over the loss scale);
    ``decayed``: only the first ``decayed`` elements (in memory order) get ``weight_decay``,
    the others none (None: every element)."""
    check_adamw_hyperparameters(lr, betas, eps, weight_decay)
    if not (isinstance(grad_scale, (int, float)) and math.isfinite(grad_scale) and grad_scale > 0):
        raise ValueError(f"grad_scale must be a finite number > 0, got {grad_scale!r}")
    n = theta.numel()
    decayed = n if decayed is None else decayed
    if not (isinstance(decayed, int) and 0 <= decayed <= n):
        raise ValueError(f"decayed must be an integer in [0, {n}] (theta's size), got {decayed!r}")
    named = {"theta": theta, "g": g, "m": m, "v": v}
    if compute is not None:
        named["compute"] = compute
    check_tensors(**named)
    check_tile("block", block)
    for name, t in named.items():
        if t.shape != theta.shape or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous tensor of theta's shape "
                             f"{tuple(theta.shape)}, got {tuple(t.shape)}")  # fmt: skip
        if t.device != theta.device:
            raise ValueError(f"{name} is on {t.device}, theta on {theta.device}")
        if name in ("theta", "m", "v") and t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 (the master weights and moments), "
                            f"got {t.dtype}")
    if not (isinstance(step, int) and step >= 1):
        raise ValueError(f"step must be an integer >= 1 (t of the first update is 1), got {step!r}")
    beta1, beta2 = betas
    _adamw_kernel[(triton.cdiv(n, block),)](
        theta, g, m, v, theta if compute is None else compute, n, decayed, float(grad_scale), lr,
        beta1, beta2, eps, weight_decay, 1.0 - beta1**step, 1.0 - beta2**step,
        HAS_COPY=compute is not None, BLOCK=block)
    return theta, m, v
