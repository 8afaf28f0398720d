"""The oracle: the same GPT written independently with plain torch ops, differentiated by autograd.

It reads the same flat params dict (GPT-2 names, (in, out) layout) and ``GPTConfig`` as
``gptlab.gpt_forward`` but shares no code with ``gptlab.layers``: LayerNorm, GELU and
cross-entropy come from ``torch.nn.functional``, attention is written out with ``masked_fill``,
and the sinusoidal table is built here. Dropout is not modelled (evaluation mode only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import GPTConfig

__all__ = ["reference_forward", "sinusoidal_table", "relative_error"]


def sinusoidal_table(T: int, C: int, *, dtype, device=None) -> torch.Tensor:
    """(T, C): PE[t, 2i] = sin(t / 10000^(2i/C)), PE[t, 2i+1] = cos(t / 10000^(2i/C))."""
    position = torch.arange(T, dtype=dtype, device=device)[:, None]  # (T, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, C, 2, dtype=dtype, device=device) / C)  # (C/2,)
    table = torch.zeros(T, C, dtype=dtype, device=device)  # (T, C)
    table[:, 0::2] = torch.sin(position * inv_freq)
    table[:, 1::2] = torch.cos(position * inv_freq)
    return table


def _affine(x, p: dict, prefix: str):
    """x @ w + b, or x @ w when the model has no biases."""
    y = x @ p[prefix + "weight"]
    bias = p.get(prefix + "bias")
    return y if bias is None else y + bias


def _attention(x, p: dict, prefix: str, n_head: int):
    """Causal self-attention, x (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    hs = C // n_head
    qkv = _affine(x, p, prefix + "c_attn.")  # (B, T, 3C)
    q, k, v = qkv.split(C, dim=-1)  # (B, T, C) each
    q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, NH, T, T)
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (T, T)
    att = scores.masked_fill(future, float("-inf")).softmax(dim=-1)  # (B, NH, T, T)
    y = (att @ v).transpose(1, 2).reshape(B, T, C)  # (B, T, C)
    return _affine(y, p, prefix + "c_proj.")  # (B, T, C)


def _mlp(x, p: dict, prefix: str, approximate: str):
    """x (B, T, C) -> (B, T, C)."""
    h = F.gelu(_affine(x, p, prefix + "c_fc."), approximate=approximate)  # (B, T, 4C)
    return _affine(h, p, prefix + "c_proj.")  # (B, T, C)


def reference_forward(params: dict, idx, cfg: GPTConfig, targets=None, *, training: bool = False):
    """idx (B, T) -> (logits (B, T, V), loss () or None), differentiable by torch autograd."""
    if training and cfg.dropout > 0.0:
        raise ValueError("the reference model has no dropout: use it with cfg.dropout == 0 or "
                         "in evaluation mode (training=False)")
    B, T = idx.shape
    C = cfg.n_embd
    eps = cfg.layer_norm_epsilon

    def ln(x, name):
        return F.layer_norm(x, (C,), params[name + ".weight"], params.get(name + ".bias"), eps)

    wte = params["wte.weight"]
    x = wte[idx]  # (B, T, C)
    if cfg.position == "learned":
        x = x + params["wpe.weight"][:T]  # (B, T, C)
    else:
        x = x + sinusoidal_table(T, C, dtype=wte.dtype, device=wte.device)  # (B, T, C)
    for layer in range(cfg.n_layer):
        h = f"h.{layer}."
        if cfg.ln_order == "pre":
            x = x + _attention(ln(x, h + "ln_1"), params, h + "attn.", cfg.n_head)  # (B, T, C)
            x = x + _mlp(ln(x, h + "ln_2"), params, h + "mlp.", cfg.gelu_approximate)  # (B, T, C)
        else:
            x = ln(x + _attention(x, params, h + "attn.", cfg.n_head), h + "ln_1")  # (B, T, C)
            x = ln(x + _mlp(x, params, h + "mlp.", cfg.gelu_approximate), h + "ln_2")  # (B, T, C)
    logits = ln(x, "ln_f") @ wte.T  # (B, T, V)
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))  # ()
    return logits, loss


def relative_error(a, b) -> float:
    """max |a - b| / max |b| (0 when both are 0): the yardstick of the model tests."""
    a = torch.as_tensor(a).detach().cpu().double()
    b = torch.as_tensor(b).detach().cpu().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff
