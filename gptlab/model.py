"""The whole GPT: embeddings, a stack of blocks, a final LayerNorm and a tied output head.

    x0 = wte[idx] + wpe[0..T-1]                  (B, T, C)   (or + the sinusoidal encoding)
    x_l = block_l(x_{l-1})                       l = 1 .. n_layer
    logits = LN_f(x_L) @ wte^T                   (B, T, V)   the head reuses the token embedding
    loss = cross_entropy(logits, targets)

Parameters are a flat dict with GPT-2's checkpoint names and (in, out) weight layout, so a
Hugging Face GPT-2 state dict maps onto it by renaming alone (see ``gptlab.interop``).

Book: chapter 4 (forward) and chapter 9 (backward).
"""

from __future__ import annotations

import math

import numpy as np

from .backend import array_namespace, convert
from .checks import require_float, require_ids_in_range, require_int
from .config import GPTConfig
from .layers.block import BLOCK_PARAM_NAMES, block_backward, block_forward, block_param_shapes
from .layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from .layers.dropout import dropout_backward, dropout_forward
from .layers.embedding import embedding_backward, embedding_forward
from .layers.layernorm import layernorm_backward, layernorm_forward
from .layers.position_learned import position_learned_backward, position_learned_forward
from .layers.position_sinusoidal import (
    position_sinusoidal_backward,
    position_sinusoidal_forward,
)


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's GPT-2 name and shape, in checkpoint order."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = {"wte.weight": (V, C)}
    if cfg.position == "learned":
        shapes["wpe.weight"] = (cfg.block_size, C)
    block = block_param_shapes(C, bias=cfg.bias)
    for layer in range(cfg.n_layer):
        shapes.update({f"h.{layer}.{name}": shape for name, shape in block.items()})
    shapes["ln_f.weight"] = (C,)
    if cfg.bias:
        shapes["ln_f.bias"] = (C,)
    return shapes


def count_params(cfg: GPTConfig) -> int:
    """The number of parameters (the tied head counted once, as GPT-2 and GPT-3 report it)."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


def init_params(cfg: GPTConfig, seed: int = 0, backend: str = "numpy", dtype="float32",
                device=None) -> dict:
    """A fresh flat dict of parameters, initialised as nanoGPT does after GPT-2.

    Weights and both embedding tables ~ N(0, 0.02) (OpenAI's GPT-2 release drew wpe with 0.01),
    the two residual projections of every block scaled by 1/sqrt(2 n_layer) (GPT-2), biases 0,
    LayerNorm gains 1. The numbers are drawn in float64 by
    NumPy from ``seed`` and then converted, so every backend, dtype and device starts from the
    same model.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            value = np.ones(shape)
        elif name.endswith(".bias"):
            value = np.zeros(shape)
        else:
            std = 0.02
            if name.endswith("attn.c_proj.weight") or name.endswith("mlp.c_proj.weight"):
                std = 0.02 / math.sqrt(2 * cfg.n_layer)
            value = rng.normal(0.0, std, size=shape)
        params[name] = convert(value, backend, dtype=dtype, device=device)
    return params


def block_params(params: dict, layer: int) -> dict:
    """The parameters of block ``layer`` with the ``h.{layer}.`` prefix removed."""
    prefix = f"h.{layer}."
    return {name: params[prefix + name] for name in BLOCK_PARAM_NAMES if prefix + name in params}


def check_params(params: dict, cfg: GPTConfig) -> None:
    """Raise a clear error if ``params`` does not fit ``cfg`` (names, shapes, float dtypes)."""
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameters do not match the config: missing {missing}, unexpected {extra}")
    dtype = params["wte.weight"].dtype
    for name, shape in expected.items():
        require_float(name, params[name])
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(params[name].shape)}, expected {shape}")
        if params[name].dtype != dtype:
            raise TypeError(f"{name} has dtype {params[name].dtype}, but wte.weight has {dtype}")


def _check_idx(idx, cfg: GPTConfig, name: str = "idx") -> None:
    require_int(name, idx)
    if len(idx.shape) != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(idx.shape)}")
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(idx.shape)}")
    if idx.shape[1] > cfg.block_size:
        raise ValueError(
            f"sequence length {idx.shape[1]} is longer than the context (block_size={cfg.block_size})"
        )
    require_ids_in_range(name, idx, cfg.vocab_size)


def gpt_forward(params: dict, idx, cfg: GPTConfig, targets=None, *, dropout_seed: int | None = None):
    """idx (B, T) token ids -> (logits (B, T, V), loss or None, cache).

    ``targets`` (B, T) gives the mean next-token cross-entropy. Dropout (``cfg.dropout``) is
    applied only when ``dropout_seed`` is given: a training step passes a fresh seed, evaluation
    passes none.
    """
    check_params(params, cfg)
    _check_idx(idx, cfg)
    if targets is not None:
        _check_idx(targets, cfg, "targets")
        if tuple(targets.shape) != tuple(idx.shape):
            raise ValueError(f"targets has shape {tuple(targets.shape)}, idx has {tuple(idx.shape)}")
    training = cfg.dropout > 0.0 and dropout_seed is not None
    cache = {"cfg": cfg, "training": training}
    tok, cache["wte"] = embedding_forward(idx, params["wte.weight"])  # (B, T, C)
    if cfg.position == "learned":
        x, cache["wpe"] = position_learned_forward(tok, params["wpe.weight"])  # (B, T, C)
    else:
        x, cache["wpe"] = position_sinusoidal_forward(tok)  # (B, T, C)
    if training:
        x, cache["drop"] = dropout_forward(x, p=cfg.dropout, seed=dropout_seed)  # (B, T, C)
    cache["blocks"] = []
    for layer in range(cfg.n_layer):
        seed = None if not training else dropout_seed + 2 * (layer + 1)
        x, block_cache = block_forward(
            x, block_params(params, layer), n_head=cfg.n_head, ln_order=cfg.ln_order,
            gelu=cfg.gelu_approximate, eps=cfg.layer_norm_epsilon, dropout=cfg.dropout, seed=seed,
        )  # (B, T, C)
        cache["blocks"].append(block_cache)
    xf, cache["ln_f"] = layernorm_forward(
        x, params["ln_f.weight"], params.get("ln_f.bias"), eps=cfg.layer_norm_epsilon
    )  # (B, T, C)
    logits = xf @ params["wte.weight"].mT  # (B, T, V), the head tied to the token embedding
    cache["xf"] = xf
    cache["wte.weight"] = params["wte.weight"]
    loss = None
    if targets is not None:
        loss, cache["loss"] = cross_entropy_forward(logits, targets)  # ()
    return logits, loss, cache


def gpt_backward(cache, dlogits=None) -> dict:
    """Gradients of the loss (or of sum(logits * dlogits)) for every parameter, by name.

    Without ``dlogits`` the forward must have been given targets: the backward starts from
    dloss = 1.
    """
    cfg = cache["cfg"]
    if dlogits is None:
        if "loss" not in cache:
            raise ValueError("gpt_backward needs the forward to have computed a loss (pass "
                             "targets to gpt_forward) or an explicit dlogits")
        (dlogits,) = cross_entropy_backward(1.0, cache["loss"])  # (B, T, V)
    xp = array_namespace(dlogits)
    grads = {}
    xf, wte = cache["xf"], cache["wte.weight"]
    V, C = wte.shape
    # logits = xf @ wte^T: the head's share of dwte
    dxf = dlogits @ wte  # (B, T, C)
    dwte_head = xp.reshape(dlogits, (-1, V)).mT @ xp.reshape(xf, (-1, C))  # (V, C)
    # xf = LN_f(x)   (the bias gradient is None in a model without biases)
    dx, grads["ln_f.weight"], grads["ln_f.bias"] = layernorm_backward(dxf, cache["ln_f"])
    for layer in reversed(range(cfg.n_layer)):
        # x = block(x)
        dx, dblock = block_backward(dx, cache["blocks"][layer])  # (B, T, C)
        grads.update({f"h.{layer}.{name}": g for name, g in dblock.items()})
    if cache["training"]:
        (dx,) = dropout_backward(dx, cache["drop"])  # (B, T, C)
    # x = tok + position
    if cfg.position == "learned":
        dtok, grads["wpe.weight"] = position_learned_backward(dx, cache["wpe"])  # (B, T, C)
    else:
        (dtok,) = position_sinusoidal_backward(dx, cache["wpe"])  # (B, T, C)
    # tok = wte[idx]: the embedding's share of dwte; a tied matrix sums the grads of both uses
    (dwte_embed,) = embedding_backward(dtok, cache["wte"])  # (V, C)
    grads["wte.weight"] = dwte_embed + dwte_head  # (V, C)
    return {name: grads[name] for name in param_shapes(cfg)}


def loss_and_grads(params: dict, idx, targets, cfg: GPTConfig, *, dropout_seed=None):
    """One forward and backward: (loss as a Python float, grads dict)."""
    _, loss, cache = gpt_forward(params, idx, cfg, targets, dropout_seed=dropout_seed)
    grads = gpt_backward(cache)
    return float(loss), grads


__all__ = [
    "GPTConfig", "param_shapes", "count_params", "init_params", "block_params", "check_params",
    "gpt_forward", "gpt_backward", "loss_and_grads",
]  # fmt: skip
