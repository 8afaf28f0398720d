"""GPTConfig: the hyperparameters of a GPT, with GPT-2's defaults where they apply."""

from __future__ import annotations

from dataclasses import asdict, dataclass

GELU_FORMS = ("tanh", "erf")  # GPT-2's tanh approximation; the exact x * Phi(x), written with erf
# Other spellings of the exact GELU: "none" is torch's (F.gelu's approximate="none") and what
# configs stored before "erf" say. GPTConfig and TrainConfig store the canonical "erf".
GELU_ALIASES = {"exact": "erf", "none": "erf"}


@dataclass(frozen=True)
class GPTConfig:
    """Shape and wiring of a GPT.

    n_layer blocks of width n_embd with n_head heads; vocab_size tokens; contexts of at most
    block_size positions. ``ln_order`` picks the residual block: "pre" (GPT-2/GPT-3: x + f(LN(x)))
    or "post" (the original transformer: LN(x + f(x))). ``position`` picks learned position
    embeddings (GPT-2's wpe) or the fixed sinusoidal encoding. ``gelu`` is "tanh" (GPT-2's
    approximation) or "erf" (the exact GELU, nanoGPT's; "exact" and "none" are read as "erf").
    ``bias=False`` leaves out every linear and LayerNorm bias (nanoGPT's option; GPT-2 has them).
    ``dropout`` applies in training only (seeded, see gpt_forward).
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

    def __post_init__(self):
        if isinstance(self.gelu, str):  # frozen: set through object.__setattr__
            object.__setattr__(self, "gelu", GELU_ALIASES.get(self.gelu, self.gelu))
        for name in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                "each head gets n_embd // n_head channels"
            )
        if self.position == "sinusoidal" and self.n_embd % 2 != 0:
            raise ValueError(f"the sinusoidal encoding needs an even n_embd, got {self.n_embd}")
        choices = {"ln_order": ("pre", "post"), "position": ("learned", "sinusoidal"),
                   "gelu": GELU_FORMS}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not isinstance(self.bias, bool):
            raise ValueError(f"GPTConfig.bias must be True or False, got {self.bias!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")

    @property
    def gelu_approximate(self) -> str:
        """The GELU as the layers and torch's F.gelu name it: approximate="tanh" or "none"."""
        return "none" if self.gelu == "erf" else "tanh"

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head

    def to_dict(self) -> dict:
        return asdict(self)
