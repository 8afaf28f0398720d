"""GPTConfig: the hyperparameters of a GPT, with GPT-2's defaults where they apply."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .layers.rope import ROPE_PAIRINGS

GELU_FORMS = ("tanh", "erf")  # GPT-2's tanh approximation; the exact x * Phi(x), written with erf
# Other spellings of the exact GELU: "none" is torch's (F.gelu's approximate="none") and what
# configs stored before "erf" say. GPTConfig and TrainConfig store the canonical "erf".
GELU_ALIASES = {"exact": "erf", "none": "erf"}
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu", "moe")
POSITIONS = ("learned", "sinusoidal", "rope")
SWIGLU_MULTIPLE_OF = 256  # LLaMA rounds its SwiGLU width up to a multiple of this


def swiglu_hidden_size(n_embd: int, multiple_of: int = SWIGLU_MULTIPLE_OF) -> int:
    """LLaMA's SwiGLU width for n_embd C: 2/3 of GPT-2's 4C (three matrices instead of two, so
    about the same parameters), rounded up to a multiple of ``multiple_of``. C = 4096 gives 11008,
    LLaMA-7B's (Hugging Face's ``intermediate_size``)."""
    return multiple_of * math.ceil(int(2 * 4 * n_embd / 3) / multiple_of)


@dataclass(frozen=True)
class GPTConfig:
    """Shape and wiring of a GPT.

    n_layer blocks of width n_embd with n_head heads; vocab_size tokens; contexts of at most
    block_size positions. ``ln_order`` picks the residual block: "pre" (GPT-2/GPT-3: x + f(LN(x)))
    or "post" (the original transformer: LN(x + f(x))). ``gelu`` is "tanh" (GPT-2's
    approximation) or "erf" (the exact GELU, nanoGPT's; "exact" and "none" are read as "erf").
    ``bias=False`` leaves out every linear and LayerNorm bias (nanoGPT's option; GPT-2 has them).
    ``dropout`` applies in training only (seeded, see gpt_forward).

    The parts of today's open models (LLaMA; ``GPTConfig.llama`` sets them all):

    - ``norm``: "layernorm" (GPT-2) or "rmsnorm" (LLaMA; a gain, no bias), for ln_1, ln_2 and ln_f;
      ``layer_norm_epsilon`` is the eps of either.
    - ``mlp``: "gelu" (GPT-2's c_fc, GELU, c_proj), "swiglu" (LLaMA's gate_proj, up_proj,
      down_proj, no biases) or "moe", a mixture of ``n_expert`` GELU MLPs with biases (layers/
      moe.py): a router sends each token to ``expert_top_k`` of them (gates renormalized over
      the chosen, as Mixtral), an expert takes at most ``capacity_factor`` times its fair share
      of a batch's tokens (None: no limit), and every block's load-balancing loss, weighted by
      ``aux_loss_weight``, adds to the training loss. ``mlp_hidden`` is the width of the MLP (of
      each expert); None: 4 * n_embd for "gelu" and "moe" and LLaMA's
      ``swiglu_hidden_size(n_embd)`` for "swiglu" (see ``mlp_hidden_size``).
    - ``position``: "learned" (GPT-2's wpe), "sinusoidal" (the fixed encoding, added to the
      embeddings) or "rope" (rotary embeddings: q and k turned by their positions in every
      attention, base ``rope_base``). ``rope_pairing`` says which coordinates of a head turn
      together: "rotate_half" (Hugging Face's LLaMA: i with i + hs/2) or "adjacent" (Meta's
      original LLaMA code, GPT-J: 2i with 2i + 1), so Meta-layout weights load unpermuted.
    - ``n_kv_head``: None keeps GPT-2's attention (one fused c_attn projection, biases as
      ``bias``). An integer chooses LLaMA's attention: separate q_proj, k_proj, v_proj, o_proj
      without biases, and grouped-query attention with n_kv_head key/value heads (n_head: plain
      multi-head attention; 1: multi-query). RoPE turns q and k between the projections and the
      scores, so ``position="rope"`` always takes LLaMA's attention (with n_kv_head = n_head when
      None): see ``grouped_attention`` and ``kv_heads``.
    - ``tie_embeddings``: the output head is wte (GPT-2), or its own ``lm_head.weight`` (LLaMA).
    """

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab_size: int = 50257
    block_size: int = 1024
    ln_order: str = "pre"
    position: str = "learned"
    gelu: str = "tanh"
    bias: bool = True
    dropout: float = 0.0
    layer_norm_epsilon: float = 1e-5
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: int | None = None
    n_kv_head: int | None = None
    rope_base: float = 10000.0
    rope_pairing: str = "rotate_half"
    tie_embeddings: bool = True
    n_expert: int | None = None
    expert_top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_weight: float = 0.01

    @classmethod
    def llama(cls, **fields) -> GPTConfig:
        """A LLaMA-style config (Touvron et al. 2023): RMSNorm (eps 1e-6, Hugging Face's default),
        SwiGLU of LLaMA's width, rotary embeddings (base 10000), multi-head attention in LLaMA's
        layout unless ``n_kv_head`` says otherwise, an untied head and no biases. ``fields``
        sets the sizes (n_layer, n_head, n_embd, vocab_size, block_size; else GPTConfig's
        defaults) and overrides any of these choices."""
        wiring = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False,
                      tie_embeddings=False, layer_norm_epsilon=1e-6)
        wiring.update(fields)
        wiring.setdefault("n_kv_head", wiring.get("n_head", cls.n_head))
        return cls(**wiring)

    def __post_init__(self):
        if isinstance(self.gelu, str):  # frozen: set through object.__setattr__
            object.__setattr__(self, "gelu", GELU_ALIASES.get(self.gelu, self.gelu))
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            _require_positive_int(name, getattr(self, name))
        for name in ("mlp_hidden", "n_kv_head", "n_expert"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name), "or None")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                "each head gets n_embd // n_head channels"
            )
        if self.position == "sinusoidal" and self.n_embd % 2 != 0:
            raise ValueError(f"the sinusoidal encoding needs an even n_embd, got {self.n_embd}")
        choices = {"ln_order": ("pre", "post"), "position": POSITIONS, "gelu": GELU_FORMS,
                   "norm": NORMS, "mlp": MLPS, "rope_pairing": ROPE_PAIRINGS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        self._check_variants()

    def _check_variants(self) -> None:
        """The combinations of the LLaMA-style parts: ValueError naming the conflict."""
        if self.n_kv_head is not None and self.n_head % self.n_kv_head != 0:
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head "
                             f"({self.n_kv_head}): each key/value head serves n_head / n_kv_head "
                             "query heads")  # fmt: skip
        if self.position == "rope" and self.head_size % 2 != 0:
            raise ValueError(f"rotary embeddings turn pairs of channels: the head size "
                             f"n_embd // n_head = {self.head_size} must be even")  # fmt: skip
        base = self.rope_base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not (
                math.isfinite(base) and base > 0.0):
            raise ValueError(f"GPTConfig.rope_base must be a positive number, got {base!r}")
        biased = [name for name, has_bias in (("LayerNorm", self.norm == "layernorm"),
                                              ("the GELU MLP", self.mlp in ("gelu", "moe")),
                                              ("GPT-2's attention", not self.grouped_attention))
                  if has_bias]  # fmt: skip
        if self.bias and not biased:
            raise ValueError("bias=True, but RMSNorm, SwiGLU and LLaMA's attention have no "
                             "biases: set bias=False")  # fmt: skip
        self._check_experts()

    def _check_experts(self) -> None:
        """The mixture-of-experts fields: n_expert with mlp="moe" only, 1 <= top_k <= n_expert."""
        if self.mlp != "moe":
            for name in ("n_expert", "capacity_factor"):
                if getattr(self, name) is not None:
                    raise ValueError(f"{name}={getattr(self, name)!r} needs mlp='moe', got "
                                     f"mlp={self.mlp!r}")  # fmt: skip
            return
        if self.n_expert is None:
            raise ValueError("mlp='moe' needs n_expert, the number of experts")
        if not self.bias:
            raise ValueError("the experts of mlp='moe' are GELU MLPs with biases (layers/moe.py): "
                             "bias=False cannot leave them out")  # fmt: skip
        k = self.expert_top_k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.n_expert:
            raise ValueError(f"GPTConfig.expert_top_k must be an integer from 1 to n_expert="
                             f"{self.n_expert}, got {k!r}")  # fmt: skip
        factor = self.capacity_factor
        if factor is not None and (isinstance(factor, bool) or not isinstance(factor, (int, float))
                                   or not factor > 0):
            raise ValueError(f"GPTConfig.capacity_factor must be a number > 0 or None (no limit), "
                             f"got {factor!r}")  # fmt: skip
        weight = self.aux_loss_weight
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"GPTConfig.aux_loss_weight must be a number >= 0, got {weight!r}")

    @property
    def gelu_approximate(self) -> str:
        """The GELU as the layers and torch's F.gelu name it: approximate="tanh" or "none"."""
        return "none" if self.gelu == "erf" else "tanh"

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    @property
    def grouped_attention(self) -> bool:
        """True for LLaMA's attention (q_proj, k_proj, v_proj, o_proj, kv_heads key/value heads),
        False for GPT-2's fused c_attn: chosen by n_kv_head, or by rotary positions."""
        return self.n_kv_head is not None or self.position == "rope"

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: n_kv_head, or n_head when it is None."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def mlp_hidden_size(self) -> int:
        """The MLP's hidden width: mlp_hidden, else 4 * n_embd (GELU, the experts) or LLaMA's
        SwiGLU width."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return swiglu_hidden_size(self.n_embd) if self.mlp == "swiglu" else 4 * self.n_embd

    def to_dict(self) -> dict:
        return asdict(self)


def _require_positive_int(name: str, value, also: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        allowed = f"a positive integer {also}".strip()
        raise ValueError(f"GPTConfig.{name} must be {allowed}, got {value!r}")


def check_device(device: str | None, ranks: int = 1, option: str = "--device") -> None:
    """ValueError (naming ``option``) unless torch can put tensors on ``device`` (None: the CPU),
    and, for a CUDA device, this machine has a GPU for each of ``ranks`` processes."""
    if device is None:
        return
    import torch  # only here: the configs themselves need no torch

    try:
        where = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{option} {device!r} is not a torch device: cpu, cuda, cuda:1, mps, "
                         "...") from None
    if where.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{option} {device}: torch finds no CUDA GPU here "
                         "(torch.cuda.is_available() is False): use --device cpu")
    try:
        torch.empty(0, device=where)  # no such GPU index, a backend this torch lacks
    except (RuntimeError, AssertionError, NotImplementedError) as err:
        reason = str(err).split(". ")[0][:120]
        raise ValueError(f"{option} {device}: torch cannot use this device ({reason})") from None
    if where.type == "cuda" and ranks > torch.cuda.device_count():
        raise ValueError(f"{option} {device}: {ranks} ranks need a GPU each, this machine has "
                         f"{torch.cuda.device_count()}")
