"""The training loop: data -> batches -> loss and gradients -> clipping -> AdamW, with evaluation,
logging, checkpoints and exact resume.

One update, number t = 1, 2, ..., max_iters:

    x, y  = get_batch(train, batch_size, block_size, rng)       (B, T) windows, y shifted by one
    loss, g = forward + backward (dropout seeded by (seed, t - 1))
    ‖g‖ = clip_grad_norm(g, grad_clip)                          GPT-3 clips at 1.0
    θ = AdamW(θ, g, η_t)                                        η_t from the lr schedule

Three ways to get the gradients (``TrainConfig.backend``): "numpy" and "torch" run the
hand-written backward (``gptlab.loss_and_grads``); "autograd" runs the independent torch
reference model (``gptlab.reference.torch_gpt``) and ``loss.backward()``. With ``fused`` (the
default: measured faster, benchmarks/results/step.md) a one-process torch run of a GPT-2 model
without dropout takes the fused eager path ``gptlab.fast``, and any other run the plain one.
The fused path's options: ``recompute``, ``attention="flash"``, ``classifier="chunked"``,
``precision="bfloat16"`` or ``"float16"`` from float32 master weights (a float16 step whose
scaled gradients overflow is skipped; the loss scale and its counts are checkpointed, so a
resumed run goes on with the same scale).
Everything random is a function of ``seed`` (batches from a saved ``numpy.random.Generator``,
dropout from (seed, step), evaluation batches fixed per split), so a run stopped at a checkpoint
and resumed ends with the same weights as a run that never stopped.

The loop drives a parallel mode (``gptlab.training.parallel``; one process is a mode of one rank):
``loss, g = mode.loss_and_grads(x, y)`` on the global batch, the norm from ``mode.grad_norm``
and ``mode.params = AdamW(mode.params, g)``. ``parallel="ddp"`` or ``"zero1"``-``"zero3"`` with
``nproc`` processes (or under torchrun) trains the same model on many ranks; every rank draws the
same global batch and takes its share. Checkpoints of parallel runs are sharded, and any run
resumes from any checkpoint, whatever the mode and world size that wrote it.

Book: chapter "Training".
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import sys
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .checkpoint import (
    STATE_FILE,
    claim_run_dir,
    read_state,
    recorded_sha256,
    require_fields,
    save_run_checkpoint,
)
from ..config import GELU_ALIASES, GELU_FORMS, MLPS, NORMS, POSITIONS, GPTConfig, check_device
from .data import EMBEDDED, get_batch, load_text, split_train_val
from ..fast import (
    ATTENTIONS,
    CLASSIFIERS,
    KERNELS,
    PRECISIONS,
    FastStep,
    LossScaler,
    check_fast_config,
    resolve_kernels,
)
from ..model import gpt_forward, init_params, loss_and_grads
from .optim import SGD, AdamW, matrices_and_positions, matrices_only
from .parallel import MODES, mode_class
from .parallel.base import Replicated, clipped_grads, rank_and_world
from .parallel.checkpoint import load_run, save_sharded, shard_optimizer_state
from .parallel.launch import init_process_group, launch, under_launcher
from .parallel.pipeline import check_pipeline_config
from .parallel.tensor import check_tensor_config
from .schedule import SCHEDULES, make_schedule
from ..tokenizers.bpe import ByteBPETokenizer
from ..tokenizers.char import CharTokenizer, Tokenizer, load_tokenizer

LOG_FIELDS = ("step", "lr", "train_loss", "val_loss")
# What a resumed run may change without a word: how far it goes and where it runs (any mode and
# world size resumes any checkpoint); every other changed setting is printed as it resumes.
RESUME_FREE = ("max_iters", "resume", "out_dir", "device", "threads", "parallel", "nproc",
               "accum_steps")
CLAIMED_ENV = "GPTLAB_RUN_DIR_CLAIMED"  # set by the launching process that holds the lock
PARALLEL_CHOICES = ("none", *(name for name in MODES if name != "single"))
DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")  # the modes that split the batch over ranks


class TrainingDiverged(RuntimeError):
    """The loss (or the gradient norm) stopped being finite; the last checkpoint is untouched."""


def setting(default, description: str, *, choices: tuple | None = None,
            aliases: dict | None = None):
    """A TrainConfig field that carries its own description (the --help text of its option).
    ``choices``: the only values allowed (TrainConfig checks them, --help lists them);
    ``aliases``: other accepted spellings, each mapped to one of the choices."""
    return field(default=default, metadata={"help": description, "choices": choices,
                                            "aliases": aliases or {}})


@dataclass
class TrainConfig:
    """Everything a training run depends on. The defaults train a small character-level model
    (0.8 M parameters) on the embedded corpus (Python's reference text) to a validation loss of
    about 1.95 nats per character in about a minute of CPU time (torch backend). Each field's
    description is the help of its command-line option."""

    # model (the vocabulary size comes from the tokenizer)
    n_layer: int = setting(4, "number of transformer blocks")
    n_head: int = setting(4, "attention heads per block; they split n_embd evenly")
    n_embd: int = setting(128, "width of the residual stream (channels per position)")
    block_size: int = setting(64, "context length: the most tokens the model looks back on")
    gelu: str = setting("tanh", "the MLP's GELU: tanh (GPT-2's approximation) or erf (the exact "
                        "form, nanoGPT's; exact and none mean erf too)",
                        choices=GELU_FORMS, aliases=GELU_ALIASES)
    bias: bool = setting(True, "biases in GPT-2's linear layers and LayerNorm (GPT-2 has them; "
                         "nanoGPT's --no-bias drops them; LLaMA's parts have none)")
    dropout: float = setting(0.0, "dropout rate in training, in [0, 1)")
    position: str = setting("learned", "learned: GPT-2's position table; sinusoidal: the fixed "
                            "encoding; rope: rotary embeddings of q and k (LLaMA)",
                            choices=POSITIONS)
    norm: str = setting("layernorm", "layernorm (GPT-2) or rmsnorm (LLaMA: a gain, no bias)",
                        choices=NORMS)
    mlp: str = setting("gelu", "gelu: GPT-2's MLP; swiglu: LLaMA's gated MLP; moe: a mixture "
                       "of n_expert GELU MLPs", choices=MLPS)
    mlp_hidden: int | None = setting(None, "the MLP's hidden width; none: 4 n_embd (gelu, moe) "
                                     "or LLaMA's 8/3 n_embd rounded up to a multiple of 256")
    n_kv_head: int | None = setting(None, "key/value heads of LLaMA's grouped-query attention, "
                                    "a divisor of n_head; none: GPT-2's attention (or, with "
                                    "rope, LLaMA's with n_head)")
    rope_base: float = setting(10000.0, "the base of the rotary frequencies")
    tie_embeddings: bool = setting(True, "the output head is the token embedding (GPT-2); "
                                   "--no-tie-embeddings gives it its own matrix (LLaMA)")
    n_expert: int | None = setting(None, "number of experts of mlp=moe")
    expert_top_k: int = setting(2, "experts each token is sent to (mlp=moe)")
    capacity_factor: float | None = setting(None, "an expert takes at most this times its fair "
                                            "share of a batch's tokens (mlp=moe); none: no limit")
    aux_loss_weight: float = setting(0.01, "weight of the experts' load-balancing loss, added to "
                                     "the training loss (mlp=moe)")
    # data
    data: str | None = setting(None, "UTF-8 text file to train on; none: the embedded corpus")
    tokenizer: str = setting("char", "char: one id per character of the corpus; bpe: byte-level "
                             "BPE learned from the training part", choices=("char", "bpe"))
    vocab_size: int = setting(512, "vocabulary size of the bpe tokenizer")
    tokenizer_path: str | None = setting(None, "a saved tokenizer (tokenizer.json) to use; "
                                         "none: build one from the corpus")
    val_fraction: float = setting(0.1, "the last fraction of the text, held out for validation")
    batch_size: int = setting(12, "sequences per update")
    # optimisation
    optimizer: str = setting("adamw", "adamw, or sgd with momentum", choices=("adamw", "sgd"))
    lr: float = setting(3e-3, "peak learning rate")
    weight_decay: float = setting(0.1, "weight decay of the matrices (decoupled in adamw, "
                                  "L2 in sgd)")
    betas: tuple[float, float] = setting((0.9, 0.95), "AdamW's decay rates of the first and "
                                         "second moments")
    eps: float = setting(1e-8, "AdamW's epsilon, added to the root of the second moment")
    momentum: float = setting(0.9, "SGD's momentum coefficient (0: plain SGD)")
    decay_position_embeddings: bool = setting(False, "decay the learned position table too "
                                              "(today's nanoGPT does; minGPT did not)")
    grad_clip: float = setting(1.0, "clip the gradient's global norm to this (0: no clipping)")
    # schedule
    max_iters: int = setting(500, "number of updates")
    lr_schedule: str = setting("cosine", "cosine: warmup, then down to min_lr at lr_decay_iters; "
                               "inverse_sqrt: warmup, then lr * (warmup_iters / t)^0.5; "
                               "constant: lr throughout", choices=SCHEDULES)
    warmup_iters: int = setting(20, "updates of linear warmup from 0 to lr")
    min_lr: float = setting(3e-4, "the cosine's final learning rate")
    lr_decay_iters: int | None = setting(None, "update at which the cosine reaches min_lr; "
                                         "none: max_iters")
    # evaluation (mean loss over eval_iters batches per split), logs, checkpoints
    eval_interval: int = setting(100, "evaluate every this many updates (and after the last)")
    eval_iters: int = setting(10, "batches per split in each evaluation")
    log_format: str = setting("csv", "format of the loss log out_dir/log.csv or log.jsonl",
                              choices=("csv", "jsonl"))
    out_dir: str = setting("runs/gptlab", "folder of the loss log and the checkpoint")
    checkpoint_interval: int = setting(100, "write a checkpoint every this many updates "
                                       "(0: only after the last)")
    resume: bool = setting(False, "continue the run checkpointed in out_dir")
    # runtime
    backend: str = setting("torch", "numpy or torch: the hand-written backward; autograd: the "
                           "torch reference model and loss.backward()",
                           choices=("numpy", "torch", "autograd"))
    device: str | None = setting(None, "torch device: cpu, cuda, cuda:1, mps...; none: cpu")
    dtype: str = setting("float32", "floating-point type of the parameters and activations",
                         choices=("float32", "float64"))
    threads: int | None = setting(None, "CPU threads torch uses during the run; none: torch's "
                                  "default")
    seed: int = setting(1337, "seed of the initialisation, the batches and dropout")
    # speed and memory on one device (gptlab.fast, GPT-2's models on torch)
    fused: bool = setting(True, "the fused eager path gptlab.fast (the same model with fewer "
                          "temporaries, in-place updates, gradient buffers) wherever it applies: "
                          "torch backend, one process, GPT-2's models without dropout; other "
                          "runs, and --no-fused, take the plain hand-written path")
    recompute: bool = setting(False, "activation recomputation: keep each block's input only "
                              "and run the block again in the backward (less memory, one more "
                              "forward)")
    attention: str = setting("sdpa", "sdpa: the (T, T) weights held; flash: tiled, O(T) memory "
                             "(needs --fused)", choices=ATTENTIONS)
    classifier: str = setting("full", "full: the (B T, V) logits held; chunked: the head and "
                              "cross-entropy a chunk of tokens at a time (needs --fused)",
                              choices=CLASSIFIERS)
    precision: str = setting("float32", "compute precision of --fused: float32, or bfloat16 / "
                             "float16 (dynamic loss scaling) from float32 master weights",
                             choices=PRECISIONS)
    kernels: str = setting("auto", "torch: the fused path in torch ops; triton: LayerNorm, bias + "
                           "GELU, flash attention and the classifier as Triton kernels "
                           "(gptlab/kernels); auto: triton on CUDA when Triton imports, torch "
                           "elsewhere", choices=KERNELS)
    loss_scale_interval: int = setting(1000, "float16: good steps in a row before the loss "
                                       "scale doubles")
    # parallel training (gptlab.training.parallel)
    parallel: str = setting("none", "none: one process; ddp: data parallel; zero1, zero2, zero3: "
                            "ZeRO's stages; tensor, pipeline: the model split over the ranks",
                            choices=PARALLEL_CHOICES)
    nproc: int = setting(1, "processes a parallel run starts on this machine with torch's "
                         "elastic launcher (under torchrun: ignored, torchrun starts them)")
    accum_steps: int = setting(1, "micro-steps per update of a parallel run (gradient "
                               "accumulation): batch_size splits over ranks x micro-steps")

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)  # JSON gives a list
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str):
                value = f.metadata["aliases"].get(value, value)
                setattr(self, f.name, value)
            allowed = f.metadata["choices"]
            if allowed is not None and value not in allowed:
                raise ValueError(f"TrainConfig.{f.name} must be one of {allowed}, got {value!r}")
        for name in ("batch_size", "max_iters", "eval_interval", "eval_iters", "nproc",
                     "accum_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)!r}")
        self._check_numbers()
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(f"TrainConfig.threads must be None or >= 1, got {self.threads!r}")
        if self.backend == "numpy" and self.threads is not None:
            raise ValueError("TrainConfig.threads sets torch's thread count; the numpy backend "
                             "takes its threads from the environment (OMP_NUM_THREADS)")
        if self.backend == "numpy" and self.device not in (None, "cpu"):
            raise ValueError(f"the numpy backend runs on the CPU only, got device {self.device!r}")
        if self.backend == "autograd" and self.dropout > 0.0:
            raise ValueError("the autograd reference model has no dropout: use dropout=0")
        if self.parallel != "none" and self.backend != "torch":
            raise ValueError(f"parallel={self.parallel!r} runs the hand-written backward on "
                             f"torch tensors: use backend='torch', not {self.backend!r}")
        if self.parallel == "none" and (self.nproc > 1 or self.accum_steps > 1):
            raise ValueError("nproc > 1 and accum_steps > 1 need a parallel mode (--parallel "
                             "ddp, zero1, ...)")
        self._check_fast_options()
        if len(self.betas) != 2:
            raise ValueError(f"TrainConfig.betas must be two numbers, got {self.betas!r}")
        self.model_config(vocab_size=1)  # validates the model fields now, not mid-run

    def _check_numbers(self) -> None:
        """The numeric options a run would trip over only later: ValueError naming the option."""
        def refuse(name: str, expected: str):
            option = "--" + name.replace("_", "-")
            raise ValueError(f"TrainConfig.{name} ({option}) must be {expected}, got "
                             f"{getattr(self, name)!r}")

        for name in ("checkpoint_interval", "warmup_iters", "seed"):  # 0 allowed
            if getattr(self, name) < 0:
                refuse(name, "an integer >= 0")
        for name in ("grad_clip", "lr", "weight_decay", "momentum"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0.0):
                refuse(name, "a finite number >= 0")
        if not (math.isfinite(self.eps) and self.eps > 0.0):
            refuse("eps", "a number > 0 (AdamW divides by sqrt(v) + eps; 0 divides by zero)")
        if not all(0.0 <= beta < 1.0 for beta in self.betas):
            refuse("betas", "two numbers in [0, 1)")
        if self.lr_decay_iters is not None and self.lr_decay_iters < 1:
            refuse("lr_decay_iters", "an integer >= 1 or None")
        decay_iters = self.lr_decay_iters or self.max_iters
        if self.lr_schedule == "cosine" and self.warmup_iters >= decay_iters:
            raise ValueError(f"TrainConfig.warmup_iters (--warmup-iters {self.warmup_iters}) must "
                             f"be below the update where the cosine ends (--lr-decay-iters, else "
                             f"--max-iters: {decay_iters}): lower --warmup-iters, or raise "
                             "--max-iters")
        make_schedule(self.lr_schedule, lr=self.lr, min_lr=self.min_lr,
                      warmup_iters=self.warmup_iters, decay_iters=decay_iters)  # the rest
        if self.accum_steps > 1 and self.parallel in ("tensor", "pipeline"):
            raise ValueError(f"TrainConfig.accum_steps (--accum-steps) splits the batch of the "
                             f"data-parallel modes (ddp, zero1-3); parallel={self.parallel!r} "
                             "takes the whole batch on every rank: use --accum-steps 1")
        shares = self.nproc * self.accum_steps if self.parallel in DATA_PARALLEL else 1
        if self.batch_size % shares:
            raise ValueError(f"TrainConfig.batch_size (--batch-size {self.batch_size}) must split "
                             f"evenly over --nproc {self.nproc} ranks x --accum-steps "
                             f"{self.accum_steps} micro-steps: use a multiple of {shares}")

    def _fused_refusal(self) -> str | None:
        """Why the fused path cannot run this config, or None when it can."""
        if self.backend != "torch":
            return f"it runs on torch: use backend='torch', not {self.backend!r}"
        if self.parallel != "none":
            return "it runs in one process: use parallel='none'"
        try:
            check_fast_config(self.model_config(vocab_size=1))
        except ValueError as err:
            return str(err)
        return None

    @property
    def runs_fused(self) -> bool:
        """Whether the run takes the fused path (``fused`` and a config it covers)."""
        return self.fused and self._fused_refusal() is None

    def _check_fast_options(self) -> None:
        """The options of gptlab.fast: ValueError naming the conflict."""
        needs_fused = [f"{name}={getattr(self, name)!r}" for name, plain in
                       (("attention", "sdpa"), ("classifier", "full"), ("precision", "float32"))
                       if getattr(self, name) != plain]  # fmt: skip
        if needs_fused and not self.fused:
            raise ValueError(f"{', '.join(needs_fused)} runs on the fused path: add fused=True "
                             "(--fused)")
        refusal = self._fused_refusal() if needs_fused else None
        if refusal is not None:
            raise ValueError(f"{', '.join(needs_fused)} runs on the fused path, and {refusal}")
        if self.recompute and self.parallel != "none":
            raise ValueError("recompute runs in one process: use parallel='none'")
        if self.recompute and self.backend == "autograd":
            raise ValueError("recompute is an option of the hand-written backward, not of "
                             "backend='autograd'")
        if self.precision != "float32" and self.dtype != "float32":
            raise ValueError(f"precision={self.precision!r} keeps float32 master weights: use "
                             f"dtype='float32', not {self.dtype!r}")
        if self.kernels == "triton":
            if not self.runs_fused:
                raise ValueError("kernels='triton' runs on the fused path: add fused=True "
                                 "(--fused)")
            resolve_kernels("triton", self.device, self.dtype)
        if self.loss_scale_interval < 1:
            raise ValueError(f"TrainConfig.loss_scale_interval must be >= 1, got "
                             f"{self.loss_scale_interval!r}")

    def model_config(self, vocab_size: int) -> GPTConfig:
        return GPTConfig(n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd,
                         vocab_size=vocab_size, block_size=self.block_size, gelu=self.gelu,
                         bias=self.bias, dropout=self.dropout, position=self.position,
                         norm=self.norm, mlp=self.mlp, mlp_hidden=self.mlp_hidden,
                         n_kv_head=self.n_kv_head, rope_base=self.rope_base,
                         tie_embeddings=self.tie_embeddings, n_expert=self.n_expert,
                         expert_top_k=self.expert_top_k, capacity_factor=self.capacity_factor,
                         aux_loss_weight=self.aux_loss_weight)

    @property
    def array_backend(self) -> str:
        """Where the parameters live: 'numpy' or 'torch' (the autograd path is torch too)."""
        return "numpy" if self.backend == "numpy" else "torch"


@dataclass
class TrainResult:
    history: list[dict]  # one row per evaluation: step, lr, train_loss, val_loss
    params: dict
    tokenizer: Tokenizer
    model_config: GPTConfig
    out_dir: Path
    log_path: Path
    checkpoint_path: Path  # the state.json of the last checkpoint


def make_tokenizer(cfg: TrainConfig, text: str) -> Tokenizer:
    """The run's tokenizer: loaded from ``cfg.tokenizer_path``, or built from the corpus."""
    if cfg.tokenizer_path is not None:
        return load_tokenizer(cfg.tokenizer_path)
    if cfg.tokenizer == "bpe":  # merges learned from the training part only: no peek at val
        return ByteBPETokenizer.train(text[: int(len(text) * (1 - cfg.val_fraction))],
                                     cfg.vocab_size)
    return CharTokenizer.from_text(text)  # every character, so val never meets an unknown one


def dropout_seed(seed: int, step: int) -> int:
    """The dropout seed of update ``step`` (0-based): a pure function of (seed, step)."""
    return int(np.random.SeedSequence([seed, step]).generate_state(1)[0])


def _loss_functions(cfg: TrainConfig, model_cfg: GPTConfig, scaler: LossScaler | None):
    """(loss_and_grads(params, x, y, dropout_seed) -> (float, grads),
    loss(params, x, y) -> float); ``scaler``: float16's loss scaler (the fused path)."""
    if cfg.backend != "autograd":
        if cfg.runs_fused:
            step = FastStep(model_cfg, cfg.precision, attention=cfg.attention,
                            classifier=cfg.classifier, recompute=cfg.recompute, scaler=scaler,
                            kernels=cfg.kernels)

            def train_loss(params, x, y, seed):  # grads None: float16 overflowed, no update
                return step(params, x, y)
        else:
            def train_loss(params, x, y, seed):
                return loss_and_grads(params, x, y, model_cfg, dropout_seed=seed,
                                      recompute=cfg.recompute)

        def eval_loss(params, x, y):
            return float(gpt_forward(params, x, model_cfg, y)[1])

        return train_loss, eval_loss

    import torch

    from ..reference.torch_gpt import reference_forward

    def train_loss(params, x, y, seed):
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        _, loss = reference_forward(leaves, x, model_cfg, y, training=True)
        loss.backward()
        return float(loss.detach()), {name: p.grad for name, p in leaves.items()}

    def eval_loss(params, x, y):
        with torch.no_grad():
            return float(reference_forward(params, x, model_cfg, y)[1])

    return train_loss, eval_loss


class _OneProcess(Replicated):
    """The one-process run as a parallel mode of one rank (any backend, the autograd path too),
    so that the loop drives every run the same way."""

    def __init__(self, params: dict, train_loss):
        self.params, self.train_loss = params, train_loss

    def loss_and_grads(self, idx, targets, *, dropout_seed=None):
        return self.train_loss(self.params, idx, targets, dropout_seed)


def _make_mode(cfg: TrainConfig, model_cfg: GPTConfig, params: dict, train_loss):
    if cfg.parallel == "none":
        return _OneProcess(params, train_loss)
    options = {"accum_steps": cfg.accum_steps} if cfg.accum_steps > 1 else {}
    return mode_class(cfg.parallel)(model_cfg, params, **options)


def make_optimizer(cfg: TrainConfig, params: dict):
    """AdamW or SGD as ``cfg`` asks, decaying the matrices (and wpe if asked)."""
    decay_filter = matrices_and_positions if cfg.decay_position_embeddings else matrices_only
    if cfg.optimizer == "adamw":
        return AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, decay_filter=decay_filter)
    return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
               decay_filter=decay_filter)


def _write_log(path: Path, fmt: str, rows: list[dict], append: bool) -> None:
    """Append ``rows`` to the loss log, or (append=False) rewrite it with exactly ``rows``."""
    with open(path, "a" if append else "w", newline="", encoding="utf-8") as f:
        if fmt == "csv":
            writer = csv.DictWriter(f, fieldnames=LOG_FIELDS)
            if not append:
                writer.writeheader()
            writer.writerows(rows)
        else:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def read_log(path) -> list[dict]:
    """The rows of a loss log written by ``train`` (.csv or .jsonl), numbers as numbers."""
    path = Path(path)
    with open(path, encoding="utf-8") as f:
        if path.suffix == ".csv":
            return [{"step": int(r["step"]), **{k: float(r[k]) for k in LOG_FIELDS[1:]}}
                    for r in csv.DictReader(f)]
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(source, ax=None):
    """Train and validation loss against step, from a log file or a history list; returns ax."""
    import matplotlib.pyplot as plt

    rows = read_log(source) if isinstance(source, (str, Path)) else source
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    steps = [row["step"] for row in rows]
    ax.plot(steps, [row["train_loss"] for row in rows], marker=".", label="train")
    ax.plot(steps, [row["val_loss"] for row in rows], marker=".", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats per token)")
    ax.legend()
    return ax


def train(cfg: TrainConfig, progress: bool = True, *,
          overwrite: bool = False) -> TrainResult | None:
    """Train (or, with ``cfg.resume``, continue) a GPT as ``cfg`` says; see the module docstring.
    With ``cfg.threads``, torch runs on that many CPU threads, and on its previous count after.

    The run holds ``cfg.out_dir`` (``gptlab.training.checkpoint.claim_run_dir``): another run there
    at the same time is refused, naming its pid, and so is a directory that already holds a run,
    unless ``cfg.resume`` continues it or ``overwrite`` replaces it (its checkpoint stays until
    the new run's first checkpoint is complete).

    A parallel run (``cfg.parallel``) starts ``cfg.nproc`` processes with torch's elastic
    launcher (one thread each unless ``cfg.threads``) and returns rank 0's result. Under
    torchrun (or inside such a process) this process is one rank: it opens the process group
    and returns its result on rank 0, None on the others. Rank 0 alone writes the log and shows
    progress; every rank writes its shard of the checkpoints (``training/parallel/checkpoint.py``).

    Raises TrainingDiverged when the loss or gradient norm is not finite, before the update is
    applied, so the last checkpoint on disk stays the last good one.
    """
    check_start(cfg, int(os.environ["WORLD_SIZE"]) if under_launcher() else cfg.nproc)
    with _claim(cfg, overwrite):
        if cfg.parallel != "none" and not under_launcher():
            if cfg.resume:  # a damaged checkpoint is an error here, not in every rank
                load_run(cfg.out_dir)
            return launch(_train_rank, cfg.nproc, asdict(cfg), progress,
                          threads=cfg.threads or 1, device=cfg.device)[0]
        return _train_on_threads(cfg, progress)


def _claim(cfg: TrainConfig, overwrite: bool):
    """The claim on ``cfg.out_dir`` this process takes: the launching process (or one process)
    takes it for the whole run and tells its ranks so; under torchrun rank 0 takes it."""
    out_dir = str(Path(cfg.out_dir).resolve())
    if under_launcher() and (os.environ["RANK"] != "0" or os.environ.get(CLAIMED_ENV) == out_dir):
        return nullcontext()
    claim = claim_run_dir(out_dir, resume=cfg.resume, overwrite=overwrite)
    if cfg.parallel == "none" or under_launcher():
        return claim
    return _telling_ranks(claim, out_dir)


@contextmanager
def _telling_ranks(claim, out_dir: str):
    """``claim``, with CLAIMED_ENV set for the ranks that launch starts meanwhile."""
    with claim:
        before = os.environ.get(CLAIMED_ENV)
        os.environ[CLAIMED_ENV] = out_dir
        try:
            yield
        finally:
            if before is None:
                del os.environ[CLAIMED_ENV]
            else:
                os.environ[CLAIMED_ENV] = before


def _train_on_threads(cfg: TrainConfig, progress: bool) -> TrainResult | None:
    """``_train``, on ``cfg.threads`` CPU threads if set."""
    if cfg.threads is None:
        return _train(cfg, progress)
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        return _train(cfg, progress)
    finally:
        torch.set_num_threads(threads_before)


def _check_resume(cfg: TrainConfig, ckpt, out_dir: Path, data_sha256: str, source: str,
                  report: bool) -> None:
    """ValueError unless the run in ``out_dir`` (``ckpt``) can go on as ``cfg`` asks: the same
    model, data and tokenizer, and the fields train writes into state.json. With ``report``,
    print (to stderr) every other setting that differs from the saved run's."""
    state_path = out_dir / STATE_FILE
    require_fields(ckpt.state, {"history": list, "batch_rng_state": dict, "data_sha256": str,
                                "train_config": dict}, state_path)
    if cfg.tokenizer_path is not None:  # compared as saved: the same JSON for the same tokenizer
        saved_as = load_tokenizer(cfg.tokenizer_path).to_json().encode("utf-8")
        recorded = recorded_sha256(out_dir, ckpt.state, ckpt.state["tokenizer_file"])
        if recorded is not None and hashlib.sha256(saved_as).hexdigest() != recorded:
            raise ValueError(f"cannot resume {out_dir}: the tokenizer {cfg.tokenizer_path} is not "
                             f"the one it was trained with, "
                             f"{out_dir / ckpt.state['tokenizer_file']}")
    model_cfg = cfg.model_config(ckpt.tokenizer.vocab_size)
    if ckpt.model_config != model_cfg:
        raise ValueError(f"cannot resume {out_dir}: its model is {ckpt.model_config}, "
                         f"the config asks for {model_cfg}")
    if ckpt.state["data_sha256"] != data_sha256:
        raise ValueError(f"cannot resume {out_dir}: it was trained on other data than {source}")
    saved, now = ckpt.state["train_config"], json.loads(json.dumps(asdict(cfg)))
    changed = [f"{name} {saved[name]!r} -> {value!r}" for name, value in now.items()
               if name in saved and name not in RESUME_FREE and saved[name] != value]
    if changed and report:
        print(f"resuming {out_dir} at step {ckpt.step} with changed settings: "
              f"{', '.join(changed)}", file=sys.stderr)


def check_start(cfg: TrainConfig, world_size: int) -> None:
    """What ``cfg`` asks of this machine and of ``world_size`` ranks, checked before any process
    starts (ValueError naming the option): the device, and a parallel mode that can split this
    model and batch over the ranks."""
    check_device(cfg.device, ranks=world_size if cfg.parallel != "none" else 1)
    if cfg.parallel == "none":
        return
    mode_class(cfg.parallel)  # a mode this gptlab lacks
    model_cfg = cfg.model_config(vocab_size=world_size)  # the tokenizer comes later: any size
    try:
        if cfg.parallel == "tensor":
            check_tensor_config(model_cfg, world_size)
        elif cfg.parallel == "pipeline":
            check_pipeline_config(model_cfg, world_size, batch_size=cfg.batch_size)
    except ValueError as err:
        raise ValueError(f"--parallel {cfg.parallel} on {world_size} ranks (--nproc): "
                         f"{err}") from None


def _train_rank(settings: dict, progress: bool):
    """One rank of ``train``'s launch (a module-level function: the launcher pickles it)."""
    return train(TrainConfig(**settings), progress)


def _train(cfg: TrainConfig, progress: bool) -> TrainResult | None:
    """The run of ``train``, on the threads torch has now."""
    if cfg.parallel != "none":
        init_process_group(device=cfg.device)
    rank, world_size = rank_and_world()
    lead = rank == 0  # the rank that writes the log and shows progress
    out_dir = Path(cfg.out_dir)
    log_path = out_dir / f"log.{cfg.log_format}"
    text = load_text(cfg.data)
    source = EMBEDDED if cfg.data is None else str(cfg.data)
    data_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    device = cfg.device if cfg.array_backend == "torch" else None
    rng = np.random.default_rng(cfg.seed)  # batch offsets; its state is checkpointed

    if cfg.resume:
        ckpt = load_run(out_dir, backend=cfg.array_backend, dtype=cfg.dtype, device=device)
        tokenizer, params, step = ckpt.tokenizer, ckpt.params, ckpt.step
        _check_resume(cfg, ckpt, out_dir, data_sha256, source, report=lead)
        model_cfg = cfg.model_config(tokenizer.vocab_size)
        rng.bit_generator.state = ckpt.state["batch_rng_state"]
        history = ckpt.state["history"]
        checkpoint_path = out_dir / STATE_FILE
    else:  # the directory's old checkpoint, if any (--overwrite), stays until a new one is in
        tokenizer = make_tokenizer(cfg, text)
        model_cfg = cfg.model_config(tokenizer.vocab_size)
        params = init_params(model_cfg, seed=cfg.seed, backend=cfg.array_backend,
                             dtype=cfg.dtype, device=device)
        step, history, checkpoint_path = 0, [], None
        if lead:
            out_dir.mkdir(parents=True, exist_ok=True)

    scaler = None  # float16's loss scale; its state goes into the checkpoints
    if cfg.precision == "float16":
        scaler = LossScaler(growth_interval=cfg.loss_scale_interval)
        if cfg.resume and ckpt.state.get("loss_scaler") is not None:
            scaler.load_state_dict(ckpt.state["loss_scaler"])
    train_loss, eval_loss = _loss_functions(cfg, model_cfg, scaler)
    mode = _make_mode(cfg, model_cfg, params, train_loss)
    optimizer = make_optimizer(cfg, mode.params)
    if cfg.resume:  # moments saved whole, cut to this mode's layout
        optimizer.load_state_dict(shard_optimizer_state(mode, ckpt.optimizer_state))

    ids = np.asarray(tokenizer.encode(text), dtype=np.int64)  # (N,)
    train_ids, val_ids = split_train_val(ids, cfg.block_size, cfg.val_fraction, source)
    lr_at = make_schedule(cfg.lr_schedule, lr=cfg.lr, min_lr=cfg.min_lr,
                          warmup_iters=cfg.warmup_iters,
                          decay_iters=cfg.lr_decay_iters or cfg.max_iters)

    def evaluate(step: int) -> dict:
        params = mode.full_params()  # every rank evaluates the same batches on the same weights
        row = {"step": step, "lr": lr_at(step)}
        for split, data, index in (("train", train_ids, 1), ("val", val_ids, 2)):
            eval_rng = np.random.default_rng([cfg.seed, index])  # the same batches every time
            losses = [eval_loss(params, *get_batch(data, cfg.batch_size, cfg.block_size, eval_rng,
                                                   cfg.array_backend, device))
                      for _ in range(cfg.eval_iters)]
            row[f"{split}_loss"] = sum(losses) / len(losses)
        history.append(row)
        if lead:
            _write_log(log_path, cfg.log_format, [row], append=True)
        return row

    def save(step: int) -> Path:
        extra = {"train_config": asdict(cfg), "batch_rng_state": rng.bit_generator.state,
                 "history": history, "data_source": source, "data_sha256": data_sha256,
                 "loss_scaler": None if scaler is None else scaler.state_dict()}
        if cfg.parallel != "none":
            return save_sharded(out_dir, step=step, mode=mode, optimizer=optimizer,
                                tokenizer=tokenizer, model_config=model_cfg, extra=extra)
        return save_run_checkpoint(out_dir, step=step, params=mode.params, optimizer=optimizer,
                                   tokenizer=tokenizer, model_config=model_cfg, extra=extra)

    if lead:
        _write_log(log_path, cfg.log_format, history, append=False)  # drops rows past the ckpt
    if step == 0:
        evaluate(0)
    bar = tqdm(total=cfg.max_iters, initial=step, disable=not (progress and lead), desc="train",
               unit="step")
    while step < cfg.max_iters:
        lr = lr_at(step + 1)
        x, y = get_batch(train_ids, cfg.batch_size, cfg.block_size, rng, cfg.array_backend, device)
        seed = {"dropout_seed": dropout_seed(cfg.seed, step)} if cfg.dropout > 0.0 else {}
        loss, grads, norm = clipped_grads(mode, x, y, cfg.grad_clip, **seed)
        # grads None: float16's scaled gradients overflowed, so no update (the scaler halved
        # the scale); the step still counts, and evaluates and checkpoints on schedule
        if grads is not None and not (math.isfinite(loss) and math.isfinite(norm)):
            bar.close()
            kept = (f"the checkpoint of step {read_state(out_dir)['step']} in {out_dir} is "
                    "untouched" if checkpoint_path else "no checkpoint had been written yet")
            raise TrainingDiverged(
                f"training diverged at step {step + 1}: loss {loss}, gradient norm {norm} "
                f"(lr {lr:.3g}). Stopped before this update; {kept}. Try a lower lr, a longer "
                "warmup or gradient clipping."
            )
        if grads is not None:
            mode.params = optimizer.step(mode.params, grads, lr=lr)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if step % cfg.eval_interval == 0 or step == cfg.max_iters:
            row = evaluate(step)
            if progress and lead:
                bar.write(f"step {step}: train {row['train_loss']:.4f}, val {row['val_loss']:.4f}")
        interval = cfg.checkpoint_interval
        if (interval > 0 and step % interval == 0) or step == cfg.max_iters:
            checkpoint_path = save(step)
    bar.close()
    params = mode.full_params()  # a collective in ZeRO 3: every rank takes part
    if not lead:
        return None
    return TrainResult(history, params, tokenizer, model_cfg, out_dir, log_path, checkpoint_path)


__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "train", "check_start",
           "make_optimizer", "dropout_seed", "read_log", "plot_losses", "LOG_FIELDS"]
