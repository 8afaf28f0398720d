"""Quantizing a whole GPT: every weight matrix of a params dict, by round to nearest or GPTQ.

The matrices are the four of each block (``attn.c_attn``, ``attn.c_proj``, ``mlp.c_fc``,
``mlp.c_proj``: input axis 0 of their (in, out) layout). With ``embeddings=True`` the token and
position tables ``wte.weight`` and ``wpe.weight`` are quantized too, one scale per row (input
axis 1: the tied head computes x @ wte^T, so a row of wte is an output channel of the head, and
quantizing wte changes both the lookup and the head). Biases and LayerNorm parameters stay as
they are: they are vectors, a tiny share of the bytes.

Each function returns the dequantized params (same names, dtype and backend: ``gpt_forward`` and
``gptlab.training.metrics.split_loss`` run on them unchanged) and a ``QuantReport`` with the
quantized tensors and the bytes before and after. ``fake_quant_params_forward`` / ``_backward``
do the same with the straight-through estimator, for quantization-aware fine-tuning:

    params_hat, cache = fake_quant_params_forward(params, bits=4)
    loss, grads = loss_and_grads(params_hat, x, y, cfg)
    grads = fake_quant_params_backward(grads, cache)      # then the optimizer updates params
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import gpt_forward
from .gptq import gptq_quantize
from .rtn import (
    QuantizedTensor,
    array_nbytes,
    dequantize,
    fake_quant_backward,
    fake_quant_forward,
    quantize,
)

BLOCK_MATRICES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                  "mlp.c_proj.weight")  # fmt: skip
EMBEDDINGS = ("wte.weight", "wpe.weight")


def quantized_names(params: dict, *, embeddings: bool = False) -> dict[str, int]:
    """Name -> input axis of every matrix of ``params`` that gets quantized, in params order."""
    axes = {}
    for name in params:
        if name.startswith("h.") and name.split(".", 2)[-1] in BLOCK_MATRICES:
            axes[name] = 0
        elif embeddings and name in EMBEDDINGS:
            axes[name] = 1
    return axes


@dataclass(frozen=True)
class QuantReport:
    """The quantized tensors by name, and the storage of the whole params dict in bytes:
    before (every tensor as given) and after (the quantized ones as codes + scales + zero
    points, the others as given)."""

    quantized: dict[str, QuantizedTensor]
    nbytes_before: int
    nbytes_after: int

    @property
    def ratio(self) -> float:
        """How many times smaller the params are."""
        return self.nbytes_before / self.nbytes_after

    @property
    def bits_per_weight(self) -> float:
        """Stored bits per quantized weight, scales and zero points included."""
        n = sum(q.shape[0] * q.shape[1] for q in self.quantized.values())
        return 8 * sum(q.nbytes for q in self.quantized.values()) / n


def _report(params: dict, quantized: dict) -> QuantReport:
    before = sum(array_nbytes(a) for a in params.values())
    after = before + sum(q.nbytes - array_nbytes(params[name]) for name, q in quantized.items())
    return QuantReport(quantized, before, after)


def _replace(params: dict, quantized: dict) -> dict:
    """params with each quantized matrix replaced by its dequantized value."""
    return {name: dequantize(quantized[name]) if name in quantized else a
            for name, a in params.items()}  # fmt: skip


def quantize_params(params: dict, *, bits: int, scheme: str = "symmetric",
                    group_size: int | None = None, clip: float = 1.0,
                    embeddings: bool = False) -> tuple[dict, QuantReport]:
    """Round to nearest on every matrix -> (dequantized params, QuantReport)."""
    axes = quantized_names(params, embeddings=embeddings)
    quantized = {name: quantize(params[name], bits=bits, scheme=scheme, group_size=group_size,
                                axis=axis, clip=clip) for name, axis in axes.items()}  # fmt: skip
    return _replace(params, quantized), _report(params, quantized)


def block_matrix_inputs(block_cache) -> dict:
    """The input (B, T, in) of each of a block's four matrix products, read from the cache of
    ``block_forward`` of a GPT-2 block: each part's cache ends with its layer's own cache, and the
    attention and MLP caches hold each linear layer's (x, w, has_bias)."""
    _, c = block_cache
    (attn_in, *_), _, (attn_proj_in, *_) = c["attn"][-1]
    (fc_in, *_), _, (mlp_proj_in, *_) = c["mlp"][-1]
    return dict(zip(BLOCK_MATRICES, (attn_in, attn_proj_in, fc_in, mlp_proj_in)))


def gptq_quantize_params(params: dict, cfg, calib_idx, *, bits: int = 4,
                         scheme: str = "symmetric", group_size: int | None = None,
                         embeddings: bool = False, block_size: int = 128,
                         damp: float = 0.01) -> tuple[dict, QuantReport]:
    """GPTQ on every block matrix, block after block -> (dequantized params, QuantReport).

    calib_idx (B, T) token ids run through the model whose earlier blocks are already quantized
    (the paper's sequential order); the inputs that block l's four matrices receive are their
    calibration X. Embeddings, with ``embeddings=True``, get round to nearest: wte is looked up
    as well as multiplied, so no single input X stands for it.
    """
    if cfg.mlp != "gelu" or cfg.n_kv_head is not None or cfg.position == "rope":
        raise ValueError("gptq_quantize_params takes GPT-2 blocks (fused c_attn, GELU MLP); "
                         f"this config has mlp={cfg.mlp!r}, n_kv_head={cfg.n_kv_head!r}, "
                         f"position={cfg.position!r}")
    out = dict(params)
    quantized = {}
    for layer in range(cfg.n_layer):
        _, _, cache = gpt_forward(out, calib_idx, cfg)
        for name, X in block_matrix_inputs(cache["blocks"][layer]).items():
            full = f"h.{layer}.{name}"
            quantized[full] = gptq_quantize(params[full], X, bits=bits, scheme=scheme,
                                            group_size=group_size, block_size=block_size,
                                            damp=damp)  # fmt: skip
            out[full] = dequantize(quantized[full])
    for name in EMBEDDINGS if embeddings else ():
        if name in params:
            quantized[name] = quantize(params[name], bits=bits, scheme=scheme,
                                       group_size=group_size, axis=1)  # fmt: skip
    return _replace(params, quantized), _report(params, quantized)


def fake_quant_params_forward(params: dict, *, bits: int, scheme: str = "symmetric",
                              group_size: int | None = None, clip: float = 1.0,
                              embeddings: bool = False) -> tuple[dict, dict]:
    """params -> (params_hat, cache): every matrix through ``fake_quant_forward``."""
    out, cache = dict(params), {}
    for name, axis in quantized_names(params, embeddings=embeddings).items():
        out[name], cache[name] = fake_quant_forward(params[name], bits=bits, scheme=scheme,
                                                    group_size=group_size, axis=axis,
                                                    clip=clip)  # fmt: skip
    return out, cache


def fake_quant_params_backward(grads: dict, cache: dict) -> dict:
    """Gradients for params_hat -> gradients for params (the straight-through estimator on the
    quantized matrices, the others unchanged)."""
    return {name: fake_quant_backward(g, cache[name])[0] if name in cache else g
            for name, g in grads.items()}  # fmt: skip
