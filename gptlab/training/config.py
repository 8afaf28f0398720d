"""``TrainConfig``: everything a training run depends on, each field with the help of its
command-line option and its checks (one clear ValueError naming the option, before anything
runs). Book: chapter 11.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields


from ..config import GELU_ALIASES, GELU_FORMS, MLPS, NORMS, POSITIONS, GPTConfig
from ..fast import ATTENTIONS, CLASSIFIERS, KERNELS, PRECISIONS, check_fast_config, resolve_kernels
from .parallel import MODES
from .schedule import SCHEDULES, make_schedule


PARALLEL_CHOICES = ("none", *(name for name in MODES if name != "single"))


DATA_PARALLEL = ("ddp", "zero1", "zero2", "zero3")  # the modes that split the batch over ranks


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
                                         "none: max_iters (resumed: where the run's ended)")
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
                           "GELU, flash attention, the classifier and AdamW as Triton kernels "
                           "(gptlab/kernels); auto: triton on CUDA when Triton imports, torch "
                           "elsewhere", choices=KERNELS)
    cuda_graph: bool = setting(False, "capture the fused step's forward and backward once as a "
                               "CUDA graph and replay it at every step (needs the fused AdamW: "
                               "--fused, kernels triton, adamw, one process; not float16); "
                               "elsewhere than CUDA the same step runs eagerly")
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

    @property
    def fused_optimizer(self) -> bool:
        """Whether the update is ``gptlab.training.optim.FusedAdamW`` (AdamW as one Triton
        kernel over flat buffers): AdamW on the fused path with kernels resolving to "triton".
        Every other run keeps its optimizer; a parallel mode never runs the fused path, so it
        keeps AdamW."""
        return (self.runs_fused and self.optimizer == "adamw"
                and resolve_kernels(self.kernels, self.device, self.dtype) == "triton")

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
            if not self.fused:
                raise ValueError("kernels='triton' runs on the fused path: add fused=True "
                                 "(--fused)")
            if not self.runs_fused:
                raise ValueError(f"kernels='triton' runs on the fused path, and "
                                 f"{self._fused_refusal()}")
            resolve_kernels("triton", self.device, self.dtype)
        if self.cuda_graph and not self.fused_optimizer:
            raise ValueError("cuda_graph=True replays the step of the fused AdamW: it needs "
                             "fused=True, kernels resolving to 'triton', optimizer='adamw' and "
                             "parallel='none'")
        if self.cuda_graph and self.precision == "float16":
            raise ValueError("cuda_graph=True cannot replay float16's changing loss scale: use "
                             "precision='bfloat16'")
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


__all__ = ["TrainConfig", "setting", "PARALLEL_CHOICES", "DATA_PARALLEL"]
