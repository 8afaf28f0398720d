"""Optimizers written from their update equations, for NumPy or torch parameter dicts.

AdamW (Loshchilov & Hutter, 2019), the optimizer of GPT-2 and GPT-3, for every parameter θ
with gradient g at step t = 1, 2, ...:

    m_t = β1 m_{t-1} + (1 - β1) g                  first moment (a running mean of g)
    v_t = β2 v_{t-1} + (1 - β2) g²                 second moment (a running mean of g²)
    m̂_t = m_t / (1 - β1^t),  v̂_t = v_t / (1 - β2^t)     bias corrections (m_0 = v_0 = 0)
    θ_t = θ_{t-1} - η_t (m̂_t / (√v̂_t + ε) + λ θ_{t-1})

The weight decay λθ is *decoupled*: it shrinks θ directly instead of being added to g, so Adam's
per-coordinate scaling never touches it. This is torch.optim.AdamW's formula. Decay applies to
the matrices only (attention and MLP weights, and wte, the token embedding tied to the output
head); biases, LayerNorm gains and (unless asked) the position table are left alone.

SGD with momentum, torch.optim.SGD's formula (dampening 0; L2 weight decay added to g):

    d = g + λ θ;   b_t = μ b_{t-1} + d  (b_0 = 0);   θ_t = θ_{t-1} - η b_t
    (Nesterov: θ_t = θ_{t-1} - η (d + μ b_t))

Both are functional: ``step(params, grads, lr)`` returns a new dict and never mutates its inputs;
the optimizer object holds only its state (moments and step count), which ``state_dict`` and
``load_state_dict`` move in and out of checkpoints.

Book: chapter "Training", section "AdamW".
"""

from __future__ import annotations

from collections.abc import Callable

from .backend import array_namespace, asarray_like

DecayFilter = Callable[[str, object], bool]


def matrices_only(name: str, x) -> bool:
    """Decay every 2-D weight except the position table (biases and LayerNorm gains never).

    minGPT decayed neither embedding table; today's nanoGPT decays every tensor with two or more
    dimensions, wpe included: that is ``matrices_and_positions``."""
    return len(x.shape) == 2 and name != "wpe.weight"


def matrices_and_positions(name: str, x) -> bool:
    """Decay every 2-D weight, the learned position table included."""
    return len(x.shape) == 2


class _Optimizer:
    """State shared by the optimizers: one moment buffer per (kind, name), a step count."""

    kind: str
    buffers: tuple[str, ...]

    def __init__(self, params: dict, lr: float, weight_decay: float, decay_filter: DecayFilter):
        if lr < 0.0 or weight_decay < 0.0:
            raise ValueError(f"lr and weight_decay must be >= 0, got {lr!r} and {weight_decay!r}")
        self.lr = lr
        self.weight_decay = weight_decay
        self.decay = {name: decay_filter(name, x) for name, x in params.items()}
        self.step_count = 0
        self.state = {
            f"{buf}.{name}": array_namespace(x).zeros_like(x)
            for buf in self.buffers for name, x in params.items()
        }  # fmt: skip

    def _check(self, params: dict, grads: dict) -> None:
        if set(params) != set(self.decay) or set(grads) != set(self.decay):
            raise ValueError("params and grads must have the names the optimizer was built with")

    def state_dict(self) -> dict:
        """``{"kind", "step", "state": {"<buffer>.<param name>": array}}`` (not copied)."""
        return {"kind": self.kind, "step": self.step_count, "state": dict(self.state)}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore moments and step count, moved to this optimizer's backend, dtype, device."""
        if state_dict.get("kind") != self.kind:
            kind = state_dict.get("kind")
            raise ValueError(f"optimizer state is for {kind!r}, not {self.kind!r}")
        saved = state_dict["state"]
        if set(saved) != set(self.state):
            missing, extra = set(self.state) - set(saved), set(saved) - set(self.state)
            raise ValueError(f"optimizer state does not match: missing {sorted(missing)}, "
                             f"unexpected {sorted(extra)}")
        for key, like in self.state.items():
            if tuple(saved[key].shape) != tuple(like.shape):
                raise ValueError(f"optimizer state {key} has shape {tuple(saved[key].shape)}, "
                                 f"expected {tuple(like.shape)}")
            self.state[key] = asarray_like(saved[key], like)
        self.step_count = int(state_dict["step"])


class AdamW(_Optimizer):
    """AdamW over a flat dict of parameters (see the module docstring for the equations)."""

    kind = "adamw"
    buffers = ("m", "v")

    def __init__(self, params: dict, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1,
                 decay_filter: DecayFilter = matrices_only):
        super().__init__(params, lr, weight_decay, decay_filter)
        self.beta1, self.beta2 = betas
        self.eps = eps

    def step(self, params: dict, grads: dict, lr: float | None = None) -> dict:
        """One update: new params (same names, shapes, backend). ``lr`` overrides ``self.lr``."""
        self._check(params, grads)
        lr = self.lr if lr is None else lr
        self.step_count += 1
        t, b1, b2 = self.step_count, self.beta1, self.beta2
        new = {}
        for name, theta in params.items():
            xp = array_namespace(theta)
            g = grads[name]
            m = b1 * self.state[f"m.{name}"] + (1.0 - b1) * g  # m_t = β1 m + (1-β1) g
            v = b2 * self.state[f"v.{name}"] + (1.0 - b2) * (g * g)  # v_t = β2 v + (1-β2) g²
            self.state[f"m.{name}"], self.state[f"v.{name}"] = m, v
            m_hat = m / (1.0 - b1**t)  # bias corrections
            v_hat = v / (1.0 - b2**t)
            decay = self.weight_decay if self.decay[name] else 0.0
            # decoupled weight decay: θ(1 - ηλ) first (torch's order), then the Adam step
            new[name] = theta * (1.0 - lr * decay) - lr * (m_hat / (xp.sqrt(v_hat) + self.eps))
        return new


class SGD(_Optimizer):
    """SGD with (optionally Nesterov) momentum and L2 weight decay, torch.optim.SGD's update."""

    kind = "sgd"
    buffers = ("momentum",)

    def __init__(self, params: dict, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 decay_filter: DecayFilter = matrices_only):
        super().__init__(params, lr, weight_decay, decay_filter)
        if nesterov and momentum <= 0.0:
            raise ValueError("Nesterov momentum needs momentum > 0")
        self.momentum = momentum
        self.nesterov = nesterov

    def step(self, params: dict, grads: dict, lr: float | None = None) -> dict:
        """One update: new params (same names, shapes, backend). ``lr`` overrides ``self.lr``."""
        self._check(params, grads)
        lr = self.lr if lr is None else lr
        self.step_count += 1
        mu = self.momentum
        new = {}
        for name, theta in params.items():
            d = grads[name]
            if self.decay[name] and self.weight_decay > 0.0:
                d = d + self.weight_decay * theta  # d = g + λθ
            b = mu * self.state[f"momentum.{name}"] + d  # b_t = μ b_{t-1} + d, b_0 = 0
            self.state[f"momentum.{name}"] = b
            direction = d + mu * b if self.nesterov else b
            new[name] = theta - lr * direction
        return new


__all__ = ["AdamW", "SGD", "matrices_only", "matrices_and_positions", "DecayFilter"]
