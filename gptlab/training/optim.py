"""Optimizers written from their update equations, for NumPy or torch parameter dicts and for
any ``torch.nn.Module``.

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

The equations are written once, for one tensor: ``adamw_update`` and ``sgd_update``. Two front
ends call them (and the fused kernel is checked against ``adamw_update``):

- ``AdamW`` and ``SGD`` are functional, over a flat dict of arrays (NumPy, torch, any array API
  library): ``step(params, grads, lr)`` returns a new dict and never mutates its inputs; the
  object holds only its state (moments and step count), which ``state_dict`` and
  ``load_state_dict`` move in and out of checkpoints. ``decay_filter`` picks the decayed names.
- ``FusedAdamW`` is ``AdamW`` as one Triton kernel launch over every parameter
  (``gptlab.kernels.adamw``, chapter 23): the master weights, moments, gradients and compute
  copies are flat buffers (``gptlab.fast.FlatParams``), updated in place; same state format.
- ``TorchAdamW`` and ``TorchSGD`` are ``torch.optim.Optimizer``s: built over
  ``module.parameters()`` or parameter groups (``param_groups`` makes the usual "decay the
  matrices only" pair), updated in place from ``p.grad`` by ``step(closure=None)``, with
  torch's ``zero_grad``, ``state_dict``/``load_state_dict`` and learning-rate schedulers.
  The name says which world they live in; the update is the same as ``AdamW``'s and ``SGD``'s,
  bit for bit.

Book: chapter "Training", section "AdamW".
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..backend import array_namespace, asarray_like
from ..checks import check_adamw_hyperparameters, check_sgd_hyperparameters
from ..fast import FlatGrads, FlatParams, triton_refusal

DecayFilter = Callable[[str, object], bool]


def _is_matrix(name: str, x) -> bool:
    """A weight matrix, or a stack of them (the experts' (E, C, H)); never a bias or a gain,
    even when biases are stacked per expert into 2-D arrays."""
    return name.endswith(".weight") and len(x.shape) >= 2


def matrices_only(name: str, x) -> bool:
    """Decay every weight matrix except the position table (biases and norm gains never).

    minGPT decayed neither embedding table; today's nanoGPT decays every tensor with two or more
    dimensions, wpe included: that is ``matrices_and_positions``."""
    return _is_matrix(name, x) and name != "wpe.weight"


def matrices_and_positions(name: str, x) -> bool:
    """Decay every weight matrix, the learned position table included."""
    return _is_matrix(name, x)


# ------------------------------------------------------------------------------------------------
# The update equations, one tensor at a time: the one source of both front ends


def adamw_update(theta, g, m, v, *, step: int, lr: float, betas: tuple[float, float],
                 eps: float, weight_decay: float):
    """One AdamW update of one tensor -> (θ_t, m_t, v_t); ``step`` is t (1 for the first).

    theta, g, m, v: arrays of one shape; the results are new arrays, the inputs are left alone.
    """
    xp = array_namespace(theta)
    beta1, beta2 = betas
    m = beta1 * m + (1.0 - beta1) * g  # m_t = β1 m_{t-1} + (1 - β1) g
    v = beta2 * v + (1.0 - beta2) * (g * g)  # v_t = β2 v_{t-1} + (1 - β2) g²
    m_hat = m / (1.0 - beta1**step)  # bias corrections
    v_hat = v / (1.0 - beta2**step)
    # decoupled weight decay: θ(1 - ηλ) first (torch's order), then the Adam step
    theta = theta * (1.0 - lr * weight_decay) - lr * (m_hat / (xp.sqrt(v_hat) + eps))
    return theta, m, v


def sgd_update(theta, g, b, *, lr: float, momentum: float, weight_decay: float, nesterov: bool):
    """One SGD update of one tensor -> (θ_t, b_t), with b the momentum buffer (b_0 = 0).

    theta, g, b: arrays of one shape; the results are new arrays, the inputs are left alone.
    """
    d = g + weight_decay * theta if weight_decay != 0.0 else g  # d = g + λθ (L2 decay)
    b = momentum * b + d  # b_t = μ b_{t-1} + d
    direction = d + momentum * b if nesterov else b
    return theta - lr * direction, b


# ------------------------------------------------------------------------------------------------
# Functional front end: dicts of arrays in, a new dict out

class _Optimizer:
    """State shared by the optimizers: one moment buffer per (kind, name), a step count."""

    kind: str
    buffers: tuple[str, ...]

    def __init__(self, params: dict, lr: float, weight_decay: float, decay_filter: DecayFilter):
        self.lr = lr
        self.weight_decay = weight_decay
        self.decay = {name: decay_filter(name, x) for name, x in params.items()}
        self.step_count = 0
        self.state = self._zero_state(params)

    def _zero_state(self, params: dict) -> dict:
        """"<buffer>.<name>" -> zeros like the parameter: m_0 = v_0 = b_0 = 0."""
        return {f"{buf}.{name}": array_namespace(x).zeros_like(x)
                for buf in self.buffers for name, x in params.items()}  # fmt: skip

    def _set_state(self, key: str, saved) -> None:
        """Take a saved moment buffer, moved to the backend, dtype and device of the state's."""
        self.state[key] = asarray_like(saved, self.state[key])

    def _start_step(self, params: dict, grads: dict, lr: float | None) -> float:
        """Check the names, count the step; the learning rate of this step."""
        if set(params) != set(self.decay) or set(grads) != set(self.decay):
            raise ValueError("params and grads must have the names the optimizer was built with")
        self.step_count += 1
        return self.lr if lr is None else lr

    def _weight_decay(self, name: str) -> float:
        return self.weight_decay if self.decay[name] else 0.0

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
        for key in self.state:
            self._set_state(key, saved[key])
        self.step_count = int(state_dict["step"])


class AdamW(_Optimizer):
    """AdamW over a flat dict of parameters (see the module docstring for the equations)."""

    kind = "adamw"
    buffers = ("m", "v")

    def __init__(self, params: dict, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1,
                 decay_filter: DecayFilter = matrices_only):
        check_adamw_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, lr, weight_decay, decay_filter)
        self.betas = tuple(betas)
        self.eps = eps

    def step(self, params: dict, grads: dict, lr: float | None = None) -> dict:
        """One update: new params (same names, shapes, backend). ``lr`` overrides ``self.lr``."""
        lr = self._start_step(params, grads, lr)
        new = {}
        for name, theta in params.items():
            new[name], self.state[f"m.{name}"], self.state[f"v.{name}"] = adamw_update(
                theta, grads[name], self.state[f"m.{name}"], self.state[f"v.{name}"],
                step=self.step_count, lr=lr, betas=self.betas, eps=self.eps,
                weight_decay=self._weight_decay(name))
        return new


class FusedAdamW(AdamW):
    """AdamW over ``gptlab.fast.FlatParams`` as ONE Triton kernel launch per update
    (``gptlab.kernels.adamw``; book: chapter 23, "The fused optimizer"). The update is
    ``adamw_update``'s, the equations of the module docstring, on the float32 master weights and
    moments; the kernel reads the gradients where the backward left them (``FlatGrads``, in the
    compute dtype), multiplies in their scale (the clip factor, float16's 1 / loss scale) as it
    reads them, and writes the bfloat16/float16 compute copies in the same pass.

    The moments m and v are two flat float32 buffers in the layout of the parameters, the
    decayed names first (``FlatParams(params, precision, decayed=decay_filter)``, the same
    filter). ``state_dict`` and ``load_state_dict`` are ``AdamW``'s, "m.<name>" and "v.<name>"
    (views of the flat buffers; a load copies into them): a checkpoint of one resumes with the
    other. ``step(params, grads, lr)`` updates ``params`` IN PLACE and returns it, where
    ``AdamW.step`` returns a new dict.

    One process only: a parallel mode never runs the fused path (``TrainConfig.runs_fused``), so
    the training loop gives it ``AdamW`` (``TrainConfig.fused_optimizer``). Needs Triton where
    the masters lie: CUDA, or the CPU under the interpreter (``TRITON_INTERPRET=1``).
    """

    state_class = AdamW  # the kind a checkpoint names: the state is AdamW's

    def __init__(self, params, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1,
                 decay_filter: DecayFilter = matrices_only):
        if not isinstance(params, FlatParams):
            raise TypeError(f"FusedAdamW updates a gptlab.fast.FlatParams, got "
                            f"{type(params).__name__}: use AdamW for a dict of arrays")
        reason = triton_refusal(params.master.device)
        if reason is not None:
            raise RuntimeError(f"FusedAdamW runs a Triton kernel, which cannot run here: {reason}; "
                               "use AdamW")
        super().__init__(params, lr, betas, eps, weight_decay, decay_filter)
        flags = [self.decay[name] for name in params]  # the layout: True first, then False
        decayed = sum(params[name].numel() for name in params if self.decay[name])
        if flags != sorted(flags, reverse=True) or decayed != params.n_decayed:
            raise ValueError("the FlatParams were laid out for another decay filter: make them "
                             "with FlatParams(params, precision, decayed=decay_filter), the "
                             "optimizer's filter")
        self.params = params

    def _zero_state(self, params) -> dict:
        self.m, self.v = torch.zeros_like(params.master), torch.zeros_like(params.master)  # (n,)
        views = {"m": params.views(self.m), "v": params.views(self.v)}
        return {f"{buf}.{name}": views[buf][name] for buf in self.buffers for name in params}

    def _set_state(self, key: str, saved) -> None:
        self.state[key].copy_(asarray_like(saved, self.state[key]))  # into the flat buffer

    def step(self, params, grads, lr: float | None = None):
        """One update of every parameter, one launch, in place: returns ``params``, which must
        be the FlatParams the optimizer was built over; ``grads``: the FlatGrads of a FlatStep
        over them. ``lr`` overrides ``self.lr``."""
        from ..kernels.adamw import adamw_update as fused_adamw_update  # imports Triton

        if params is not self.params or not (isinstance(grads, FlatGrads)
                                             and grads.params is params):
            raise ValueError("FusedAdamW.step takes the FlatParams it was built over and the "
                             "FlatGrads of a FlatStep over them")
        fused_adamw_update(params.master, params.grad, self.m, self.v, step=self.step_count + 1,
                           lr=self.lr if lr is None else lr, betas=self.betas, eps=self.eps,
                           weight_decay=self.weight_decay, compute=params.compute,
                           grad_scale=grads.scale, decayed=params.n_decayed)
        self.step_count += 1  # counted once the update is in (bad input raises before it)
        params.copies_written()
        return params


class SGD(_Optimizer):
    """SGD with (optionally Nesterov) momentum and L2 weight decay, torch.optim.SGD's update."""

    kind = "sgd"
    buffers = ("momentum",)

    def __init__(self, params: dict, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, nesterov: bool = False,
                 decay_filter: DecayFilter = matrices_only):
        check_sgd_hyperparameters(lr, momentum, weight_decay, nesterov)
        super().__init__(params, lr, weight_decay, decay_filter)
        self.momentum = momentum
        self.nesterov = nesterov

    def step(self, params: dict, grads: dict, lr: float | None = None) -> dict:
        """One update: new params (same names, shapes, backend). ``lr`` overrides ``self.lr``."""
        lr = self._start_step(params, grads, lr)
        new = {}
        for name, theta in params.items():
            new[name], self.state[f"momentum.{name}"] = sgd_update(
                theta, grads[name], self.state[f"momentum.{name}"], lr=lr,
                momentum=self.momentum, weight_decay=self._weight_decay(name),
                nesterov=self.nesterov)
        return new


# ------------------------------------------------------------------------------------------------
# torch.optim front end: parameters (or groups) of an nn.Module, updated in place from p.grad


def param_groups(params: dict, weight_decay: float,
                 decay_filter: DecayFilter = matrices_only) -> list[dict]:
    """Two torch.optim parameter groups: the tensors ``decay_filter`` picks get ``weight_decay``,
    the others none. ``params``: name -> tensor, e.g. ``gptlab.autograd.GPT(cfg).params``
    (GPT-2 names) or ``dict(module.named_parameters())``. Empty groups are left out."""
    decayed = [p for name, p in params.items() if decay_filter(name, p)]
    others = [p for name, p in params.items() if not decay_filter(name, p)]
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": others, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


class _TorchOptimizer(torch.optim.Optimizer):
    """What TorchAdamW and TorchSGD share: hyperparameters checked per group, the step loop.

    Per parameter, ``self.state[p]`` holds "step" (its update count t) and one tensor per name
    in ``buffers``, zero before the first update.
    """

    buffers: tuple[str, ...]

    def _check_group(self, group: dict) -> None:
        raise NotImplementedError

    def _update(self, p, state: dict, group: dict):
        """The new value of ``p`` from ``p.grad``; updates the buffers in ``state``."""
        raise NotImplementedError

    def add_param_group(self, param_group: dict) -> None:
        self._check_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient; returns ``closure()`` (the loss,
        re-evaluated with gradients on) when a closure is given, else None."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:  # the first update of p: m_0 = v_0 = b_0 = 0
                    state["step"] = 0
                    state.update({buf: torch.zeros_like(p) for buf in self.buffers})
                state["step"] += 1
                p.copy_(self._update(p, state, group))
        return loss


class TorchAdamW(_TorchOptimizer):
    """AdamW as a ``torch.optim.Optimizer``: ``adamw_update`` on every parameter with a grad.

    ``params``: ``module.parameters()`` or groups with their own lr, betas, eps, weight_decay
    (``param_groups(model.params, 0.1)`` decays the matrices only). Defaults are GPT-3's, as in
    ``AdamW``; torch.optim.AdamW's are lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01.
    """

    buffers = ("m", "v")

    def __init__(self, params, lr: float = 6e-4, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.1):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps,
                                      weight_decay=weight_decay))

    def _check_group(self, group: dict) -> None:
        check_adamw_hyperparameters(group["lr"], group["betas"], group["eps"],
                                    group["weight_decay"])

    def _update(self, p, state: dict, group: dict):
        theta, state["m"], state["v"] = adamw_update(
            p, p.grad, state["m"], state["v"], step=state["step"], lr=group["lr"],
            betas=group["betas"], eps=group["eps"], weight_decay=group["weight_decay"])
        return theta


class TorchSGD(_TorchOptimizer):
    """SGD as a ``torch.optim.Optimizer``: ``sgd_update`` on every parameter with a grad.

    ``params``: ``module.parameters()`` or groups with their own lr, momentum, weight_decay,
    nesterov. torch.optim.SGD's update with dampening 0.
    """

    buffers = ("momentum",)

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9,
                 weight_decay: float = 0.0, nesterov: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      nesterov=nesterov))

    def _check_group(self, group: dict) -> None:
        check_sgd_hyperparameters(group["lr"], group["momentum"], group["weight_decay"],
                                  group["nesterov"])

    def _update(self, p, state: dict, group: dict):
        theta, state["momentum"] = sgd_update(
            p, p.grad, state["momentum"], lr=group["lr"], momentum=group["momentum"],
            weight_decay=group["weight_decay"], nesterov=group["nesterov"])
        return theta


def decay_filter_of(cfg) -> DecayFilter:
    """The names ``cfg`` (a TrainConfig) decays: the matrices, and wpe if asked."""
    return matrices_and_positions if cfg.decay_position_embeddings else matrices_only


def make_optimizer(cfg, params: dict):
    """AdamW or SGD as ``cfg`` (a TrainConfig) asks, decaying the matrices (and wpe if asked);
    FusedAdamW for AdamW over a ``gptlab.fast.FlatParams`` (``TrainConfig.fused_optimizer``)."""
    decay_filter = decay_filter_of(cfg)
    if cfg.optimizer == "adamw":
        adamw = FusedAdamW if isinstance(params, FlatParams) else AdamW
        return adamw(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                     weight_decay=cfg.weight_decay, decay_filter=decay_filter)
    return SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
               decay_filter=decay_filter)


__all__ = ["AdamW", "FusedAdamW", "SGD", "TorchAdamW", "TorchSGD", "adamw_update", "sgd_update",
           "make_optimizer", "param_groups", "matrices_only", "matrices_and_positions",
           "decay_filter_of", "DecayFilter"]
