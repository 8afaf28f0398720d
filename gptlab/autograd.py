"""torch integration: our hand-written backward passes as ``torch.autograd.Function``s.

``as_function(forward, backward)`` turns a layer pair into a function of torch tensors whose
``.backward()`` runs OUR backward, so any torch optimizer (on CPU or CUDA) is driven by the
formulas of the book. Every layer of ``gptlab.layers`` comes ready-wrapped under its own name
(``linear``, ``layernorm``, ..., ``sdpa``, ``block``, ``cross_entropy``, ``router``, ``moe``, the
preference losses ``bradley_terry``, ``dpo``, ``ppo``, ``value_loss``); a
boolean input (the mask of ``sdpa``) gets no gradient, like an integer one. A layer whose output
is a pair (``moe`` and ``router`` return ``(y, aux)`` and ``(gates, aux)``) returns both tensors,
and its backward gets both gradients. ``gpt_loss`` / ``gpt_logits`` and the
``GPT`` module do the same for the whole model, through ``gpt_forward`` / ``gpt_backward``.

The layer's cache (which holds the input tensors themselves) is kept on ``ctx`` rather than in
``ctx.save_for_backward``: do not modify an input in place between forward and backward.
"""

from __future__ import annotations

import importlib

import torch

from .config import GPTConfig
from .layers.cross_entropy import cross_entropy_backward
from .model import check_params, gpt_backward, gpt_forward, init_params

__all__ = ["as_function", "LAYERS", "gpt_logits", "gpt_loss", "GPT"]


def _require_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch tensor, got {type(x).__name__}")


def _flatten(args) -> tuple[tuple, tuple]:
    """Positional arrays -> (spec, flat tensors). A dict argument (the block's ``p``) contributes
    its values in key order and its keys to ``spec``; a tensor contributes itself and ``None``."""
    spec, flat = [], []
    for position, arg in enumerate(args):
        if isinstance(arg, dict):
            for key, value in arg.items():
                _require_tensor(f"argument {position}[{key!r}]", value)
            spec.append(tuple(arg))
            flat.extend(arg.values())
        else:
            _require_tensor(f"argument {position}", arg)
            spec.append(None)
            flat.append(arg)
    return tuple(spec), tuple(flat)


def _unflatten(spec: tuple, flat: tuple) -> list:
    """The inverse of ``_flatten``: flat tensors -> the positional arguments."""
    args, i = [], 0
    for keys in spec:
        if keys is None:
            args.append(flat[i])
            i += 1
        else:
            args.append(dict(zip(keys, flat[i : i + len(keys)])))
            i += len(keys)
    return args


def _flat_grads(args: list, grads: tuple) -> list:
    """Backward's grads (one per FLOAT input, a dict for a dict input) -> one entry per flat
    tensor, ``None`` for integer inputs such as token ids."""
    grads = iter(grads)
    flat = []
    for arg in args:
        if isinstance(arg, dict):
            dp = next(grads)
            flat.extend(dp[key] for key in arg)
        elif arg.is_floating_point():
            flat.append(next(grads))
        else:
            flat.append(None)
    return flat


class ManualFunction(torch.autograd.Function):
    """One autograd Function for every layer: forward and backward are passed in as arguments."""

    @staticmethod
    def forward(ctx, forward, backward, spec, hyper, *tensors):
        args = _unflatten(spec, tensors)
        out, cache = forward(*args, **hyper)
        ctx.backward, ctx.cache, ctx.args = backward, cache, args
        return out

    @staticmethod
    def backward(ctx, *douts):
        # a layer whose output is a pair (moe's (y, aux), router's (gates, aux)) takes a pair
        dout = douts[0] if len(douts) == 1 else douts
        grads = ctx.backward(dout, ctx.cache)
        return (None, None, None, None, *_flat_grads(ctx.args, grads))


def as_function(forward, backward):
    """``f(*arrays, **hyperparams)`` on torch tensors: ``forward``'s output, ``backward``'s grads.

    Positional arguments are tensors (float or integer) or dicts of tensors; keyword arguments
    are the layer's hyperparameters (``n_head=``, ``eps=``, ...).
    """

    def f(*arrays, **hyperparams):
        spec, flat = _flatten(arrays)
        return ManualFunction.apply(forward, backward, spec, hyperparams, *flat)

    f.__name__ = forward.__name__.removesuffix("_forward")
    f.__doc__ = f"{forward.__doc__}\n\nBackward: gptlab.layers.{f.__name__}.{backward.__name__}."
    return f


LAYERS = ("linear", "layernorm", "gelu", "relu", "softmax", "dropout", "embedding",
          "position_learned", "position_sinusoidal", "sdpa", "attention", "attention_single",
          "mlp", "block", "cross_entropy",
          "rmsnorm", "silu", "swiglu", "rope", "gqa", "router", "moe",
          "logistic",
          "token_logprobs", "bradley_terry", "dpo", "ppo", "value_loss")  # fmt: skip


def _wrap(name: str):
    """The wrapped pair ``<name>_forward`` / ``<name>_backward`` of ``gptlab.layers.<name>``."""
    module = importlib.import_module(f".layers.{name}", __package__)
    return as_function(getattr(module, f"{name}_forward"), getattr(module, f"{name}_backward"))


# linear = as_function(linear_forward, linear_backward), and so on for every layer
globals().update({name: _wrap(name) for name in LAYERS})
__all__ += list(LAYERS)


class ManualGPT(torch.autograd.Function):
    """The whole model as one Function: gpt_forward, then gpt_backward for every parameter."""

    @staticmethod
    def forward(ctx, cfg, idx, targets, dropout_seed, names, *tensors):
        params = dict(zip(names, tensors))
        logits, loss, cache = gpt_forward(params, idx, cfg, targets, dropout_seed=dropout_seed)
        ctx.cache, ctx.names = cache, names
        ctx.set_materialize_grads(False)
        return (logits,) if loss is None else (logits, loss)

    @staticmethod
    def backward(ctx, dlogits, dloss=None):
        # loss = cross_entropy(logits, targets): its share of dlogits adds to the direct one
        if dloss is not None:
            (dlogits_loss,) = cross_entropy_backward(dloss, ctx.cache["loss"])  # (B, T, V)
            dlogits = dlogits_loss if dlogits is None else dlogits + dlogits_loss  # (B, T, V)
        if dlogits is None:
            return (None,) * (5 + len(ctx.names))
        grads = gpt_backward(ctx.cache, dlogits)
        return (None,) * 5 + tuple(grads[name] for name in ctx.names)


def _gpt_apply(params: dict, idx, cfg: GPTConfig, targets, dropout_seed):
    """(logits (B, T, V), loss () or None) with the manual backward behind both."""
    _require_tensor("idx", idx)
    if targets is not None:
        _require_tensor("targets", targets)
    for name, value in params.items():
        _require_tensor(name, value)
    out = ManualGPT.apply(cfg, idx, targets, dropout_seed, tuple(params), *params.values())
    return out[0], (out[1] if targets is not None else None)


def gpt_loss(params: dict, idx, cfg: GPTConfig, targets, dropout_seed: int | None = None):
    """The mean next-token cross-entropy (); ``.backward()`` fills ``p.grad`` via gpt_backward."""
    if targets is None:
        raise ValueError("gpt_loss needs targets (B, T); use gpt_logits for logits alone")
    return _gpt_apply(params, idx, cfg, targets, dropout_seed)[1]


def gpt_logits(params: dict, idx, cfg: GPTConfig, dropout_seed: int | None = None):
    """The logits (B, T, V); their backward is gpt_backward(cache, dlogits)."""
    return _gpt_apply(params, idx, cfg, None, dropout_seed)[0]


def _safe_name(name: str) -> str:
    """'h.0.attn.c_attn.weight' -> 'h_0_attn_c_attn_weight' (nn.Module names have no dots)."""
    return name.replace(".", "_")


class GPT(torch.nn.Module):
    """The GPT as an ``nn.Module`` whose parameters get their gradients from gpt_backward.

    Parameters are registered under safe names (``h_0_ln_1_weight``); ``.params`` gives them by
    their GPT-2 names. ``torch.optim.AdamW(model.parameters())`` then trains with the manual
    backward.
    """

    def __init__(self, cfg: GPTConfig, params: dict | None = None, *, seed: int = 0,
                 dtype="float32", device=None):
        """``params``: a flat dict (NumPy or torch, copied), or None for init_params(cfg, seed)."""
        super().__init__()
        if params is None:
            params = init_params(cfg, seed, backend="torch", dtype=dtype, device=device)
        check_params(params, cfg)
        self.cfg = cfg
        self._names = {name: _safe_name(name) for name in params}
        for name, safe in self._names.items():
            value = torch.as_tensor(params[name]).detach().clone()
            self.register_parameter(safe, torch.nn.Parameter(value))

    @classmethod
    def from_params(cls, params: dict, cfg: GPTConfig) -> GPT:
        return cls(cfg, params)

    @property
    def params(self) -> dict:
        """GPT-2 name -> Parameter, in checkpoint order."""
        return {name: getattr(self, safe) for name, safe in self._names.items()}

    def forward(self, idx, targets=None, dropout_seed: int | None = None):
        """idx (B, T) -> (logits (B, T, V), loss () or None)."""
        return _gpt_apply(self.params, idx, self.cfg, targets, dropout_seed)
