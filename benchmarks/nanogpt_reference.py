"""nanoGPT's own recipe, re-typed: the yardstick for the published 1.88.

A short, faithful rewrite of what nanoGPT's ``model.py`` and ``train.py`` do for the README's CPU
run of ``config/train_shakespeare_char.py`` (Karpathy, nanoGPT, 2023): ``nn.Linear`` and
``nn.Embedding`` modules without biases, ``F.scaled_dot_product_attention``, the exact GELU,
N(0, 0.02) init with the residual projections at 0.02/sqrt(2 n_layer), ``torch.manual_seed``,
batches from ``torch.randint``, AdamW with weight decay on every parameter of two or more
dimensions, nanoGPT's ``get_lr`` (warmup (it+1)/(w+1), then cosine), clipping at 1.0, 2000
updates. It shares no code with gptlab; ``bench_shakespeare.py`` trains it beside gptlab's two
backends and scores all three with the same function, after ``to_gptlab_params``.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn
from torch.nn import functional as F

N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, BATCH_SIZE = 4, 4, 128, 64, 12
MAX_ITERS, WARMUP_ITERS, LR, MIN_LR = 2000, 100, 1e-3, 1e-4  # lr_decay_iters = max_iters


class LayerNorm(nn.Module):
    """LayerNorm with a gain and no bias (nanoGPT's bias=False)."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD, bias=False)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, NH, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD, bias=False)
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD, bias=False)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.attn = LayerNorm(N_EMBD), CausalSelfAttention()
        self.ln_2, self.mlp = LayerNorm(N_EMBD), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, N_EMBD)
        self.wpe = nn.Embedding(BLOCK_SIZE, N_EMBD)
        self.h = nn.ModuleList([Block() for _ in range(N_LAYER)])
        self.ln_f = LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def get_lr(it: int, max_iters: int = MAX_ITERS) -> float:
    """nanoGPT's schedule for update ``it`` = 0, 1, ..."""
    if it < WARMUP_ITERS:
        return LR * (it + 1) / (WARMUP_ITERS + 1)
    if it > max_iters:
        return MIN_LR
    decay_ratio = (it - WARMUP_ITERS) / (max_iters - WARMUP_ITERS)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (LR - MIN_LR)


def train_nanogpt(ids: np.ndarray, vocab_size: int, seed: int,
                  max_iters: int = MAX_ITERS) -> NanoGPT:
    """ids (N,) character ids of the whole text -> the model after ``max_iters`` updates (2000 in
    the recipe) on the first 90% (nanoGPT's split)."""
    train_data = torch.from_numpy(ids[: int(len(ids) * 0.9)].astype(np.int64))
    torch.manual_seed(seed)
    model = NanoGPT(vocab_size)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(
        [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
         {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.99))  # fmt: skip
    for it in range(max_iters):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(it, max_iters)
        ix = torch.randint(len(train_data) - BLOCK_SIZE, (BATCH_SIZE,))
        x = torch.stack([train_data[i : i + BLOCK_SIZE] for i in ix])  # (B, T)
        y = torch.stack([train_data[i + 1 : i + 1 + BLOCK_SIZE] for i in ix])  # (B, T)
        model(x, y).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def to_gptlab_params(model: NanoGPT) -> dict:
    """The trained weights under gptlab's names and (in, out) layout (nn.Linear is (out, in))."""
    params = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to wte.weight
        params[name] = value.T.contiguous() if name.endswith(
            ("c_attn.weight", "c_proj.weight", "c_fc.weight")) else value  # fmt: skip
    return params
