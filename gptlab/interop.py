"""Hugging Face interop, GPT-2 and LLaMA: state dicts, configs and checkpoint directories.

Hugging Face's GPT-2 stores its linear layers as ``Conv1D`` with (in, out) weights, the layout
of ``gptlab``, so its checkpoints map onto our params by renaming alone: strip ``transformer.``,
drop the tied ``lm_head.weight`` and the attention mask buffers. No transposes.

Its LLaMA (``LlamaForCausalLM``) stores ``nn.Linear`` weights, (out, in): every matrix but the
embedding table is transposed on the way in and out, and the names map part by part
(``from_hf_llama``, ``to_hf_llama``):

    model.embed_tokens.weight                     wte.weight (V, C), not transposed
    model.layers.{i}.input_layernorm.weight       h.{i}.ln_1.weight
    model.layers.{i}.self_attn.q_proj.weight      h.{i}.attn.q_proj.weight (C, NH*hs)^T, so k, v, o
    model.layers.{i}.post_attention_layernorm.weight   h.{i}.ln_2.weight
    model.layers.{i}.mlp.gate_proj.weight         h.{i}.mlp.gate_proj.weight (C, H)^T, so up, down
    model.norm.weight                             ln_f.weight
    lm_head.weight                                lm_head.weight (C, V)^T (absent when tied)

Hugging Face's rotary embedding pairs channel i with i + hs/2 (``rotate_half``), the default
pairing of ``gptlab.layers.rope``, so q_proj and k_proj need no permutation.

Checkpoint directories hold ``model.safetensors`` and ``config.json``; we read and write them
with the ``safetensors`` package only (never pickle), so loading a file runs no code.
``from_hf_directory`` reads either model type.
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
from .config import GPTConfig, swiglu_hidden_size
from .layers.block import BLOCK_PARAM_NAMES
from .model import check_params, param_shapes

__all__ = ["from_hf", "to_hf_config", "from_hf_config", "to_hf", "from_hf_directory",
           "from_hf_llama", "to_hf_llama_config", "from_hf_llama_config", "to_hf_llama"]

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

LLAMA_PREFIX = "model."
LLAMA_NAMES = {"wte.weight": "embed_tokens.weight", "ln_f.weight": "norm.weight"}  # after model.
LLAMA_PARTS = {"ln_order": "pre", "norm": "rmsnorm", "mlp": "swiglu", "position": "rope",
               "bias": False, "rope_pairing": "rotate_half"}  # what a LLaMA-shaped GPTConfig has
LLAMA_BLOCK_NAMES = {  # ours after h.{i}. -> Hugging Face's after model.layers.{i}.
    "ln_1.weight": "input_layernorm.weight",
    **{f"attn.{p}.weight": f"self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")},
    "ln_2.weight": "post_attention_layernorm.weight",
    **{f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")},
}


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


def _require_parts(cfg: GPTConfig, model: str, parts: dict) -> None:
    """ValueError naming the first field of ``cfg`` whose value is not ``parts[field]``."""
    for name, value in parts.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"Hugging Face {model} has {name}={value!r} only: cannot express "
                             f"{name}={getattr(cfg, name)!r}")  # fmt: skip


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
    _require_parts(cfg, "GPT-2", {"norm": "layernorm", "mlp": "gelu", "n_kv_head": None,
                                  "tie_embeddings": True})
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": cfg.mlp_hidden,
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
        mlp_hidden=None if config.get("n_inner") == 4 * config["n_embd"] else config.get("n_inner"),
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
    dtype = to_numpy(params["wte.weight"]).dtype
    tensors = {HF_PREFIX + name: to_numpy(params[name]) if name in params
               else np.zeros(shape, dtype=dtype)
               for name, shape in param_shapes(replace(cfg, bias=True)).items()}  # fmt: skip
    return _write_directory(directory, tensors, config)


def _write_directory(directory, tensors: dict, config: dict) -> Path:
    """model.safetensors (the arrays, made contiguous) and config.json into ``directory``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: np.ascontiguousarray(value) for name, value in tensors.items()}
    weights = safetensors.numpy.save(tensors, metadata={"format": "pt"})  # HF wants format=pt
    _write_atomic(directory / WEIGHTS_NAME, weights)
    _write_atomic(directory / CONFIG_NAME, (json.dumps(config, indent=2) + "\n").encode())
    return directory


# --- LLaMA ------------------------------------------------------------------------------------


def _llama_name(name: str) -> str:
    """Our parameter name (of a LLaMA-shaped config) -> Hugging Face LlamaForCausalLM's."""
    if name == "lm_head.weight":
        return name
    if name in LLAMA_NAMES:
        return LLAMA_PREFIX + LLAMA_NAMES[name]
    layer, part = name.removeprefix("h.").split(".", 1)  # h.{layer}.{part}
    return f"{LLAMA_PREFIX}layers.{layer}.{LLAMA_BLOCK_NAMES[part]}"


def _transposed(name: str, value):
    """nn.Linear's (out, in) <-> our (in, out): every matrix but the embedding table."""
    return value.mT if len(value.shape) == 2 and name != "wte.weight" else value


def from_hf_llama(state_dict: dict, cfg: GPTConfig) -> dict:
    """A Hugging Face LlamaForCausalLM / LlamaModel state dict (or a dict of its gradients) ->
    our params for ``cfg``, in ``param_shapes(cfg)`` order, linear weights transposed into the
    (in, out) layout (NumPy arrays or torch tensors as given; transposes are views).

    A tied config (``cfg.tie_embeddings``) drops ``lm_head.weight``, which must then hold the
    values of the embedding; an untied one needs it. Unknown names raise ValueError."""
    _require_parts(cfg, "LLaMA", LLAMA_PARTS)
    hf_to_ours = {_llama_name(name): name for name in param_shapes(cfg)}
    params, head = {}, None
    for key, value in state_dict.items():
        # LlamaModel's names lack the "model." of LlamaForCausalLM's
        full = key if key == "lm_head.weight" else LLAMA_PREFIX + key.removeprefix(LLAMA_PREFIX)
        if full == "lm_head.weight" and cfg.tie_embeddings:
            head = value
            continue
        if full not in hf_to_ours:
            raise ValueError(f"unexpected LLaMA parameter {key!r} for this config (expected "
                             f"names like 'model.layers.0.self_attn.q_proj.weight')")  # fmt: skip
        name = hf_to_ours[full]
        params[name] = _transposed(name, value)
    wte = params.get("wte.weight")
    if head is not None and (wte is None or not _same_values(head, wte)):
        raise ValueError("lm_head.weight differs from model.embed_tokens.weight, but the config "
                         "ties the head to the embedding (tie_embeddings=True)")  # fmt: skip
    check_params(params, cfg)
    return {name: params[name] for name in param_shapes(cfg)}


def to_hf_llama_config(cfg: GPTConfig) -> dict:
    """The LlamaConfig fields of ``cfg`` as a plain dict (config.json); ValueError unless cfg is
    LLaMA-shaped (pre-norm RMSNorm, SwiGLU, rotary positions, no biases).

    Our dropout (on the residual branches) has no LLaMA counterpart and is not written: it only
    matters in training. The rotary base goes in both ``rope_parameters`` (today's transformers)
    and ``rope_theta`` (older releases)."""
    _require_parts(cfg, "LLaMA", LLAMA_PARTS)
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.mlp_hidden_size,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": cfg.layer_norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "rope_theta": cfg.rope_base,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": None,
        "eos_token_id": None,
    }


LLAMA_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "max_position_embeddings")


def from_hf_llama_config(config: dict) -> GPTConfig:
    """A LlamaConfig dict (config.json) -> a LLaMA-style GPTConfig; ValueError for what gptlab
    cannot express (RoPE scaling, biases, another activation, a head size other than
    hidden_size / num_attention_heads). Attention dropout is ignored: it only matters in
    training."""
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        raise ValueError("not a LLaMA config: expected a dict with model_type 'llama'")
    missing = [key for key in LLAMA_REQUIRED if key not in config]
    if missing:
        raise ValueError(f"the LLaMA config lacks {missing}")
    C, n_head = config["hidden_size"], config["num_attention_heads"]
    rope = config.get("rope_parameters") or {"rope_type": "default"}
    rope_scaling = config.get("rope_scaling") or {}
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
        "head_dim": config.get("head_dim") not in (None, C // n_head),
        "rope_parameters": rope.get("rope_type", "default") != "default",
        "rope_scaling": rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
                        != "default",
    }  # fmt: skip
    bad = [name for name, flag in unsupported.items() if flag]
    if bad:
        raise ValueError(f"gptlab cannot express these LLaMA config settings: {bad}")
    intermediate = config["intermediate_size"]
    return GPTConfig.llama(
        n_layer=config["num_hidden_layers"], n_head=n_head, n_embd=C,
        vocab_size=config["vocab_size"], block_size=config["max_position_embeddings"],
        n_kv_head=config.get("num_key_value_heads") or n_head,
        mlp_hidden=None if intermediate == swiglu_hidden_size(C) else intermediate,
        layer_norm_epsilon=config.get("rms_norm_eps", 1e-6),
        rope_base=rope.get("rope_theta", config.get("rope_theta", 10000.0)),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )  # fmt: skip


def to_hf_llama(params: dict, cfg: GPTConfig, directory) -> Path:
    """Write a checkpoint that ``LlamaForCausalLM.from_pretrained(directory)`` loads: the
    parameters under Hugging Face's names, linear weights transposed to (out, in) (a tied head
    is not stored), and ``to_hf_llama_config(cfg)``. Returns the directory."""
    config = to_hf_llama_config(cfg)
    check_params(params, cfg)
    tensors = {_llama_name(name): to_numpy(_transposed(name, value))
               for name, value in params.items()}  # fmt: skip
    return _write_directory(directory, tensors, config)


def from_hf_directory(directory) -> tuple[dict, GPTConfig]:
    """Read a Hugging Face GPT-2 or LLaMA checkpoint directory (by its config's model_type) ->
    (params as NumPy arrays in checkpoint order, cfg).

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
    llama = isinstance(config, dict) and config.get("model_type") == "llama"
    cfg = from_hf_llama_config(config) if llama else from_hf_config(config)
    try:
        state_dict = safetensors.numpy.load_file(directory / WEIGHTS_NAME)
    except safetensors.SafetensorError as err:
        raise ValueError(f"{directory / WEIGHTS_NAME} is not a readable safetensors file "
                         f"(truncated or another format?): {err}") from err
    if llama:
        params = {name: np.ascontiguousarray(value)
                  for name, value in from_hf_llama(state_dict, cfg).items()}  # fmt: skip
        return params, cfg
    params = from_hf(state_dict)
    check_params(params, cfg)
    return {name: params[name] for name in param_shapes(cfg)}, cfg
