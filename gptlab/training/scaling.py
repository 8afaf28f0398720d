"""GPT-3's calculator: parameters, FLOPs, training compute, memory per device, time; scaling laws.

Parameters. A GPT-2/GPT-3 model (pre-LayerNorm blocks, biases, learned positions, head tied to
the token embedding) of L blocks, width d, vocabulary V and context T has

    block:  ln_1 2d + c_attn (3d^2 + 3d) + c_proj (d^2 + d) + ln_2 2d
            + c_fc (4d^2 + 4d) + mlp.c_proj (4d^2 + d)                   = 12 d^2 + 13 d
    N = 12 L d^2 + 13 L d + (V + T) d + 2 d                              (wte, wpe, ln_f)

``count_params`` (gptlab.model) is the one source; ``params_closed_form`` is the formula above,
checked against it. The non-embedding count N - (V + T) d is Kaplan et al.'s N (2020, §2.1).

FLOPs (Kaplan et al. 2020, §2.1). A forward pass costs 2N + 2 L T d_attn per token (a multiply
and an add per weight; the attention scores and their weighted sum over a context of T), the
backward twice that: 6N + 6 L T d per token trained, and about C = 6 N D for D tokens.
Brown et al. (2020, Table D.1) count 6 N D with the total N: 3.14e23 FLOPs for GPT-3 175B and
300B tokens.

Memory per device (bytes) under data (dp), tensor (tp) and pipeline (pp) parallel degrees:
- model states: a model-parallel rank holds N / (tp pp) parameters (embeddings spread like the
  blocks: an approximation; Megatron keeps them on the first and last stage), and ZeRO
  (Rajbhandari et al. 2020, §5) splits their parameters, gradients and optimizer state over the
  dp ranks by stage (``zero_memory_per_rank``). Precision "mixed" is the paper's 2 + 2 + 12
  bytes per parameter (16-bit weights and gradients; float32 master weights, m and v); "float32"
  is gptlab's AdamW, 4 + 4 + 8.
- activations: Korthikanti et al. (2022), §4, per layer, with s the sequence, b the micro-batch,
  h the width, a the heads, e bytes per value (2 in 16-bit) and 1-byte dropout masks:

      s b h (34 + 5 a s / h)                               16-bit, no parallelism
      s b h (10 + 24 / t + 5 a s / (h t))                  tensor parallel t, no sequence parallel

  (written here for any e: s b h (4e + 2) + s b h 12e / t + a s^2 b (2e + 1) / t). The 10 s b h
  (LayerNorm inputs, the inputs of the first linear of attention and MLP, two dropout masks) are
  replicated on every tensor rank: that paper's Eq. 2, which is what is implemented (sequence
  parallelism, which splits them too, is not). Full recomputation keeps only each layer's input,
  e s b h. A pipeline stage has L / pp layers, and with 1F1B its first stage holds pp
  micro-batches in flight: L layers' worth for one micro-batch, whatever pp (their §4.2.3). The
  embedding output and the logits are left out.

Time: t = C / (n_devices * peak * MFU), MFU the model-FLOPs utilisation.

Scaling laws: ``fit_power_law`` fits L(N) = (N_c / N)^alpha (Kaplan et al.: alpha_N = 0.076,
N_c = 8.8e13 non-embedding parameters), optionally with an irreducible term E + (N_c / N)^alpha.
Chinchilla's compute-optimal rule (Hoffmann et al. 2022): D about 20 N, so with C = 6 N D,
N_opt = sqrt(C / 120), growing as C^0.5.

Book: chapter 16, "GPT-3's anatomy and scaling laws".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config import GPTConfig
from ..model import count_params, param_shapes

GPT3_VOCAB_SIZE = 50257
GPT3_CONTEXT = 2048
GPT3_TRAIN_TOKENS = 300e9  # Brown et al. (2020), §2.2 and Table D.1
KAPLAN_ALPHA_N = 0.076  # Kaplan et al. (2020), Eq. 1.1: L(N) = (N_c / N)^alpha_N
KAPLAN_N_C = 8.8e13  # non-embedding parameters
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. (2022): D_opt about 20 N_opt

# bytes per parameter of weights, gradients and optimizer state, and per activation value
PRECISIONS = {
    "mixed": dict(param_bytes=2, grad_bytes=2, optimizer_bytes=12, value_bytes=2),
    "float32": dict(param_bytes=4, grad_bytes=4, optimizer_bytes=8, value_bytes=4),
}
RECOMPUTE = ("none", "full")
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class GPT3Model:
    """One row of Brown et al. (2020), Table 2.1, as printed (n_params rounded by the paper)."""

    name: str
    n_params: float
    n_layers: int
    d_model: int
    n_heads: int
    d_head: int
    batch_tokens: float
    lr: float


# Table 2.1 as printed. Two rows are not self-consistent: XL's 24 heads x 128 = 3072 is not its
# d_model 2048, and 13B's 40 x 128 = 5120 is not its 5140 (which reproduces the printed 13.0B
# better). The recipe shared by all eight (Brown et al. 2020, Appendix B), where the GPT-3
# summary card differs: weight decay 0.1 (the card: 0.01); a linear warmup over 375M tokens,
# then cosine decay to 10% of the peak over 260B tokens (the card: inverse square root); every
# sequence the full 2048 tokens, documents packed (the card: random lengths); tensor and
# pipeline model parallelism (the card: ZeRO-3, which the paper does not mention).
GPT3_MODELS = (
    GPT3Model("GPT-3 Small", 125e6, 12, 768, 12, 64, 0.5e6, 6.0e-4),
    GPT3Model("GPT-3 Medium", 350e6, 24, 1024, 16, 64, 0.5e6, 3.0e-4),
    GPT3Model("GPT-3 Large", 760e6, 24, 1536, 16, 96, 0.5e6, 2.5e-4),
    GPT3Model("GPT-3 XL", 1.3e9, 24, 2048, 24, 128, 1e6, 2.0e-4),
    GPT3Model("GPT-3 2.7B", 2.7e9, 32, 2560, 32, 80, 1e6, 1.6e-4),
    GPT3Model("GPT-3 6.7B", 6.7e9, 32, 4096, 32, 128, 2e6, 1.2e-4),
    GPT3Model("GPT-3 13B", 13.0e9, 40, 5140, 40, 128, 2e6, 1.0e-4),
    GPT3Model("GPT-3 175B", 175.0e9, 96, 12288, 96, 128, 3.2e6, 0.6e-4),
)


def require_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_positive_number(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def require_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}")


# ---------------------------------------------------------------- parameters


def architecture_params(n_layer: int, d_model: int, vocab_size: int = GPT3_VOCAB_SIZE,
                        block_size: int = GPT3_CONTEXT) -> int:
    """Parameters of a GPT-2/GPT-3 model by ``count_params``. The count does not depend on how
    d_model is split into heads (n_head * d_head = d_model), so one head stands for any split."""
    cfg = GPTConfig(n_layer=n_layer, n_head=1, n_embd=d_model, vocab_size=vocab_size,
                    block_size=block_size)
    return count_params(cfg)


def params_closed_form(n_layer: int, d_model: int, vocab_size: int = GPT3_VOCAB_SIZE,
                       block_size: int = GPT3_CONTEXT) -> int:
    """12 L d^2 + 13 L d + (V + T) d + 2 d: the module docstring's count, term by term."""
    for name, value in (("n_layer", n_layer), ("d_model", d_model), ("vocab_size", vocab_size),
                        ("block_size", block_size)):
        require_positive_int(name, value)
    L, d = n_layer, d_model
    return 12 * L * d * d + 13 * L * d + (vocab_size + block_size) * d + 2 * d


def non_embedding_params(cfg: GPTConfig) -> int:
    """count_params less the token and position tables (Kaplan et al.'s N)."""
    shapes = param_shapes(cfg)
    tables = sum(math.prod(shapes[name]) for name in ("wte.weight", "wpe.weight") if name in shapes)
    return count_params(cfg) - tables


def gpt3_config(name: str) -> GPTConfig:
    """The GPTConfig of a Table 2.1 row: GPT-2's wiring, vocabulary 50257, context 2048, tied head.
    The rows whose n_heads * d_head is not d_model (XL: 24 x 128 = 3072 against 2048; 13B:
    40 x 128 = 5120 against 5140) name no consistent split of heads: ValueError."""
    rows = {model.name: model for model in GPT3_MODELS}
    require_choice("name", name, rows)
    model = rows[name]
    if model.n_heads * model.d_head != model.d_model:
        raise ValueError(f"{name}: Table 2.1 gives n_heads * d_head = {model.n_heads} x "
                         f"{model.d_head} = {model.n_heads * model.d_head}, not d_model = "
                         f"{model.d_model}; use architecture_params for its parameter count")
    return GPTConfig(n_layer=model.n_layers, n_head=model.n_heads, n_embd=model.d_model,
                     vocab_size=GPT3_VOCAB_SIZE, block_size=GPT3_CONTEXT)


def gpt3_table() -> list[dict]:
    """Table 2.1 with each row's parameters recomputed from its n_layers and d_model."""
    rows = []
    for model in GPT3_MODELS:
        computed = architecture_params(model.n_layers, model.d_model)
        rows.append({"name": model.name, "n_params_table": model.n_params,
                     "n_params_computed": computed,
                     "relative_error": (computed - model.n_params) / model.n_params,
                     "heads_consistent": model.n_heads * model.d_head == model.d_model})
    return rows


# ---------------------------------------------------------------- compute and time


def flops_per_token(cfg: GPTConfig, *, attention: bool = True) -> int:
    """Training FLOPs per token, 6 N + 6 L T d (Kaplan et al. 2020, §2.1; N non-embedding, T the
    context cfg.block_size, d_attn = n_embd); ``attention=False`` leaves out 6 L T d."""
    extra = 6 * cfg.n_layer * cfg.block_size * cfg.n_embd if attention else 0
    return 6 * non_embedding_params(cfg) + extra


def training_flops(n_params: float, n_tokens: float) -> float:
    """C = 6 N D: the training compute of N parameters seeing D tokens."""
    require_positive_number("n_params", n_params)
    require_positive_number("n_tokens", n_tokens)
    return 6.0 * n_params * n_tokens


def training_seconds(flops: float, n_devices: int, peak_flops: float, mfu: float) -> float:
    """Wall time C / (n_devices * peak * MFU) for ``flops`` on ``n_devices`` accelerators of
    ``peak_flops`` FLOP/s each, at model-FLOPs utilisation ``mfu`` in (0, 1]."""
    require_positive_number("flops", flops)
    require_positive_int("n_devices", n_devices)
    require_positive_number("peak_flops", peak_flops)
    if isinstance(mfu, bool) or not isinstance(mfu, (int, float)) or not 0 < mfu <= 1:
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")
    return flops / (n_devices * peak_flops * mfu)


# ---------------------------------------------------------------- memory


def zero_memory_per_rank(n_params: int, world_size: int, stage: int, *, param_bytes=4,
                         grad_bytes=4, optimizer_bytes=8) -> dict:
    """Bytes of parameters, gradients and optimizer state on one of ``world_size`` data-parallel
    ranks under ZeRO ``stage`` (Rajbhandari et al. 2020, §5): stage 0 keeps all three whole,
    stage 1 splits the optimizer state, 2 also the gradients, 3 also the parameters. A split
    tensor of n_params values is padded to world_size equal shards of ceil(n_params /
    world_size). Defaults: gptlab's float32 AdamW (K = 8 bytes of m and v)."""
    require_positive_int("n_params", n_params)
    require_positive_int("world_size", world_size)
    require_choice("stage", stage, ZERO_STAGES)
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes),
                        ("optimizer_bytes", optimizer_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    shard = -(-n_params // world_size)  # ceil
    split = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    per_value = {"params": param_bytes, "grads": grad_bytes, "optimizer": optimizer_bytes}
    out = {part: (shard if split[part] else n_params) * per_value[part] for part in per_value}
    out["total"] = sum(out.values())
    return out


def activation_bytes_per_layer(seq_len: int, micro_batch: int, d_model: int, n_head: int, *,
                               tensor_parallel: int = 1, value_bytes: int = 2,
                               dropout_masks: bool = True, recompute: str = "none") -> int:
    """Bytes one transformer layer keeps for its backward (Korthikanti et al. 2022, §4):
    s b h (4e + 2m) + s b h 12e / t + a s^2 b (2e + m) / t with e = ``value_bytes``, m = 1 byte
    per dropout mask (0 without), t = ``tensor_parallel``; in 16-bit with masks,
    s b h (10 + 24 / t + 5 a s / (h t)). ``recompute="full"`` keeps the layer input, e s b h."""
    for name, value in (("seq_len", seq_len), ("micro_batch", micro_batch), ("d_model", d_model),
                        ("n_head", n_head), ("tensor_parallel", tensor_parallel),
                        ("value_bytes", value_bytes)):
        require_positive_int(name, value)
    require_choice("recompute", recompute, RECOMPUTE)
    if n_head % tensor_parallel or d_model % tensor_parallel:
        raise ValueError(f"tensor_parallel={tensor_parallel} must divide n_head={n_head} and "
                         f"d_model={d_model}: each rank takes whole heads and equal columns")
    s, b, h, a, t, e = seq_len, micro_batch, d_model, n_head, tensor_parallel, value_bytes
    if recompute == "full":
        return e * s * b * h
    m = 1 if dropout_masks else 0
    replicated = s * b * h * (4 * e + 2 * m)  # LayerNorm inputs, linear inputs, 2 masks
    split = s * b * h * 12 * e // t  # q, k, v, attention output, GELU input and output
    scores = a * s * s * b * (2 * e + m) // t  # softmax output, its mask, dropout output
    return replicated + split + scores


def memory_per_device(cfg: GPTConfig, *, micro_batch: int, seq_len: int | None = None,
                      data_parallel: int = 1, tensor_parallel: int = 1,
                      pipeline_parallel: int = 1, zero_stage: int = 0, recompute: str = "none",
                      precision: str = "mixed", dropout_masks: bool = True) -> dict:
    """Bytes on the busiest device (a first pipeline stage) for training ``cfg``: params, grads,
    optimizer (``zero_memory_per_rank`` of the N / (tp pp) parameters of a model-parallel rank
    over the data-parallel ranks), activations (n_layer layers of ``activation_bytes_per_layer``
    for one micro-batch of ``seq_len`` tokens, default cfg.block_size) and total."""
    require_positive_int("micro_batch", micro_batch)
    seq_len = cfg.block_size if seq_len is None else seq_len
    for name, value in (("data_parallel", data_parallel), ("tensor_parallel", tensor_parallel),
                        ("pipeline_parallel", pipeline_parallel)):
        require_positive_int(name, value)
    require_choice("precision", precision, PRECISIONS)
    if cfg.n_layer % pipeline_parallel:
        raise ValueError(f"pipeline_parallel={pipeline_parallel} must divide n_layer="
                         f"{cfg.n_layer}: every stage takes the same number of blocks")
    sizes = dict(PRECISIONS[precision])
    value_bytes = sizes.pop("value_bytes")
    per_layer = activation_bytes_per_layer(seq_len, micro_batch, cfg.n_embd, cfg.n_head,
                                           tensor_parallel=tensor_parallel,
                                           value_bytes=value_bytes, dropout_masks=dropout_masks,
                                           recompute=recompute)  # fmt: skip
    model_rank_params = -(-count_params(cfg) // (tensor_parallel * pipeline_parallel))
    out = zero_memory_per_rank(model_rank_params, data_parallel, zero_stage, **sizes)
    out["activations"] = cfg.n_layer * per_layer  # L / pp layers x pp micro-batches in flight
    out["total"] += out["activations"]
    return out


# ---------------------------------------------------------------- scaling laws


def chinchilla_optimal(flops: float) -> dict:
    """Hoffmann et al.'s (2022) compute-optimal split of ``flops``: D = 20 N and C = 6 N D give
    N = sqrt(C / 120), D = 20 N."""
    require_positive_number("flops", flops)
    n_params = math.sqrt(flops / (6 * CHINCHILLA_TOKENS_PER_PARAM))
    return {"n_params": n_params, "n_tokens": CHINCHILLA_TOKENS_PER_PARAM * n_params}


def fit_power_law(n_params, loss, *, irreducible: bool = False) -> dict:
    """Least-squares fit in log space of L(N) = (N_c / N)^alpha, or with ``irreducible`` of
    L(N) = E + (N_c / N)^alpha (E scanned on a grid below min(loss), the line fitted for each).
    Returns n_c, alpha, e (0 without the term) and rmse, the root-mean-square error of log L."""
    n = np.asarray(n_params, dtype=np.float64)
    y = np.asarray(loss, dtype=np.float64)
    if n.ndim != 1 or n.shape != y.shape or len(n) < 3:
        raise ValueError(f"n_params and loss must be 1-D of the same length >= 3, got shapes "
                         f"{n.shape} and {y.shape}")
    if not (np.all(n > 0) and np.all(y > 0) and np.all(np.isfinite(y))):
        raise ValueError("n_params and loss must be positive and finite")

    def line(e: float) -> dict:
        # log(L - E) = alpha log N_c - alpha log N: a straight line in log N
        slope, intercept = np.polyfit(np.log(n), np.log(y - e), 1)
        alpha = -slope
        pred = e + np.exp(intercept + slope * np.log(n))
        rmse = float(np.sqrt(np.mean((np.log(pred) - np.log(y)) ** 2)))
        return {"n_c": float(np.exp(intercept / alpha)), "alpha": float(alpha), "e": e,
                "rmse": rmse}

    if not irreducible:
        return line(0.0)
    grid = np.linspace(0.0, float(y.min()), 2001)[:-1]
    return min((line(float(e)) for e in grid), key=lambda fit: fit["rmse"])


def power_law(n_params, fit: dict):
    """L(N) = e + (n_c / N)^alpha of a ``fit_power_law`` result."""
    return fit["e"] + (fit["n_c"] / np.asarray(n_params, dtype=np.float64)) ** fit["alpha"]
