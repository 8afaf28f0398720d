"""Hugging Face GPT-2 interop: state dicts, configs and checkpoint directories.

Hugging Face's GPT-2 stores its linear layers as ``Conv1D`` with (in, out) weights, the layout
of ``gptlab``, so its checkpoints map onto our params by renaming alone: strip ``transformer.``,
drop the tied ``lm_head.weight`` and the attention mask buffers. No transposes.

Checkpoint directories hold ``model.safetensors`` and ``config.json``; we read and write them
with the ``safetensors`` package only (never pickle), so loading a file runs no code.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import safetensors
import safetensors.numpy

from .backend import to_numpy
from .config import GPTConfig
from .layers.block import BLOCK_PARAM_NAMES
from .model import check_params, param_shapes

__all__ = ["from_hf", "to_hf_config", "from_hf_config", "to_hf", "from_hf_directory"]

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
HF_PREFIX = "transformer."
HF_HEAD = "lm_head.weight"
HF_BUFFERS = (".attn.bias", ".attn.masked_bias")  # the causal mask, not parameters
HF_REQUIRED = ("n_layer", "n_head", "n_embd", "vocab_size", "n_positions")
GELU_TO_HF = {"tanh": "gelu_new", "erf": "gelu"}
GELU_FROM_HF = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "erf"}

_BLOCK = "|".join(re.escape(name) for name in BLOCK_PARAM_NAMES)
_OUR_NAME = re.compile(rf"wte\.weight|wpe\.weight|ln_f\.(weight|bias)|h\.\d+\.({_BLOCK})")


def _same_values(a, b) -> bool:
    """True if ``a`` is ``b``, or they hold equal values (tensors or arrays)."""
    if a is b:
        return True
    a, b = to_numpy(a), to_numpy(b)
    return a.shape == b.shape and bool(np.array_equal(a, b))


def from_hf(state_dict: dict) -> dict:
    """A Hugging Face GPT2LMHeadModel / GPT2Model state dict (or a dict of its gradients) -> our
    flat params dict. The values are passed through unchanged (tensors stay tensors).

    ``lm_head.weight`` is dropped because our head is tied to ``wte.weight``; a head that holds
    other values than ``wte.weight`` (an untied model) raises ValueError.
    """
    params, head = {}, None
    for key, value in state_dict.items():
        if key == HF_HEAD:
            head = value
            continue
        name = key.removeprefix(HF_PREFIX)
        if name.endswith(HF_BUFFERS):
            continue
        if not _OUR_NAME.fullmatch(name):
            raise ValueError(f"unknown GPT-2 parameter {key!r} (expected names like "
                             "'transformer.h.0.attn.c_attn.weight')")
        params[name] = value
    wte = params.get("wte.weight")
    if head is not None and (wte is None or not _same_values(head, wte)):
        raise ValueError("lm_head.weight differs from transformer.wte.weight: the output head is "
                         "untied, but gptlab's head is tied to the token embedding")
    return params


def to_hf_config(cfg: GPTConfig) -> dict:
    """The GPT2Config fields of ``cfg`` as a plain dict (the contents of config.json).

    Our dropout is GPT-2's residual and embedding dropout; we have no attention-probability
    dropout, so ``attn_pdrop`` is 0. The end-of-text id is the last token, as in GPT-2.
    """
    if cfg.ln_order != "pre":
        raise ValueError("Hugging Face GPT-2 has pre-LN blocks only: cannot express "
                         f"ln_order={cfg.ln_order!r}")
    if cfg.position != "learned":
        raise ValueError("Hugging Face GPT-2 has learned positions only: cannot express "
                         f"position={cfg.position!r}")
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,
        "activation_function": GELU_TO_HF[cfg.gelu],
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": True,
        "bos_token_id": cfg.vocab_size - 1,
        "eos_token_id": cfg.vocab_size - 1,
    }


def from_hf_config(config: dict) -> GPTConfig:
    """A GPT2Config dict (config.json) -> GPTConfig; ValueError for what gptlab cannot express.

    Attention-probability dropout (``attn_pdrop``) has no counterpart and is ignored: it only
    matters for training.
    """
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        raise ValueError("not a GPT-2 config: expected a dict with model_type 'gpt2'")
    missing = [key for key in HF_REQUIRED if key not in config]
    if missing:
        raise ValueError(f"the GPT-2 config lacks {missing}")
    activation = config.get("activation_function", "gelu_new")
    if activation not in GELU_FROM_HF:
        raise ValueError(f"activation_function {activation!r} is not one of {sorted(GELU_FROM_HF)}")
    unsupported = {
        "n_inner": config.get("n_inner") not in (None, 4 * config["n_embd"]),
        "tie_word_embeddings": not config.get("tie_word_embeddings", True),
        "scale_attn_weights": not config.get("scale_attn_weights", True),
        "scale_attn_by_inverse_layer_idx": config.get("scale_attn_by_inverse_layer_idx", False),
        "add_cross_attention": config.get("add_cross_attention", False),
    }
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"gptlab cannot express these GPT-2 config settings: {bad}")
    if config.get("resid_pdrop", 0.0) != config.get("embd_pdrop", 0.0):
        raise ValueError("gptlab has one dropout rate: resid_pdrop and embd_pdrop must be equal")
    return GPTConfig(
        n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
        vocab_size=config["vocab_size"], block_size=config["n_positions"],
        gelu=GELU_FROM_HF[activation], dropout=config.get("resid_pdrop", 0.0),
        layer_norm_epsilon=config.get("layer_norm_epsilon", 1e-5),
    )  # fmt: skip


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file next to ``path``, then rename it over ``path``."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def to_hf(params: dict, cfg: GPTConfig, directory) -> Path:
    """Write a checkpoint that ``GPT2LMHeadModel.from_pretrained(directory)`` loads.

    ``model.safetensors`` holds every parameter (NumPy or torch) as a contiguous array under
    ``transformer.<GPT-2 name>`` (as Hugging Face saves GPT2LMHeadModel; the tied head is not
    stored); ``config.json`` holds ``to_hf_config(cfg)``. GPT-2 always has biases, so a model
    without them (``cfg.bias=False``) is written with zero biases: the same function. Returns
    the directory.
    """
    config = to_hf_config(cfg)
    check_params(params, cfg)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = to_numpy(params["wte.weight"]).dtype
    tensors = {HF_PREFIX + name: np.ascontiguousarray(to_numpy(params[name])) if name in params
               else np.zeros(shape, dtype=dtype)
               for name, shape in param_shapes(replace(cfg, bias=True)).items()}  # fmt: skip
    weights = safetensors.numpy.save(tensors, metadata={"format": "pt"})  # HF wants format=pt
    _write_atomic(directory / WEIGHTS_NAME, weights)
    _write_atomic(directory / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return directory


def from_hf_directory(directory) -> tuple[dict, GPTConfig]:
    """Read a Hugging Face GPT-2 checkpoint directory -> (params as NumPy arrays in checkpoint
    order, cfg).

    Reads ``config.json`` and ``model.safetensors`` only (no pickle: ``pytorch_model.bin`` is
    refused by design).
    """
    directory = Path(directory)
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} not found: a checkpoint directory needs "
                                    f"{CONFIG_NAME} and {WEIGHTS_NAME}")
    try:
        config = json.loads((directory / CONFIG_NAME).read_text())
    except ValueError as err:
        raise ValueError(f"{directory / CONFIG_NAME} is not valid JSON: {err}") from err
    cfg = from_hf_config(config)
    try:
        state_dict = safetensors.numpy.load_file(directory / WEIGHTS_NAME)
    except safetensors.SafetensorError as err:
        raise ValueError(f"{directory / WEIGHTS_NAME} is not a readable safetensors file "
                         f"(truncated or another format?): {err}") from err
    params = from_hf(state_dict)
    check_params(params, cfg)
    return {name: params[name] for name in param_shapes(cfg)}, cfg
