"""The fused eager path: GPT-2's forward and hand-written backward on torch, with fewer temporaries.

The same model and the same formulas as ``gptlab.model`` (the book's readable layer functions),
written for speed instead of for reading one layer at a time:

- the inputs are checked once, here at the model's boundary, not in every inner call;
- tokens are rows: every activation is (N, C) with N = B*T, so a linear layer is one addmm
  (bias fused into the matmul) and its weight gradient one mm written ``out=`` a buffer;
- element-wise steps run in place where the formula allows (LayerNorm's xhat overwrites x - mean,
  its backward turns dy into dx with one temporary, the softmax exponentiates the scores where
  they lie, the GELU derivative is built in the dead forward buffer of gelu(h) and multiplied
  into dy);
- the cross-entropy gradient dlogits = (probs - onehot) / N is written into the probabilities'
  own buffer, which held the logits before;
- the gradients land in preallocated ``buffers`` (the grads dict returned, reused across steps).

Switches: ``attention="flash"`` (``layers/flash_attention.py``, O(T) memory per row),
``classifier="chunked"`` (``layers/chunked_classifier.py``, never the whole (N, V) logits),
``recompute=True`` (each block keeps only its input and runs its forward again in the backward),
``loss_scale`` (the backward starts from dloss = loss_scale: float16's loss scaling),
``kernels="triton"`` (``gptlab/kernels/``: LayerNorm, bias + GELU, flash attention and the
classifier as Triton kernels, whatever ``attention`` and ``classifier`` say; the matmuls stay
torch's). ``kernels="auto"``, the default, takes Triton on CUDA tensors when Triton imports and
the torch ops elsewhere.

Covered: GPT-2's models (pre-LN, LayerNorm, GELU MLP tanh or erf, learned positions, tied head,
with or without biases, no dropout). Other configs (LLaMA's parts, experts, post-LN, dropout,
sinusoidal positions, an untied head) are refused with a ValueError naming the field: use
``gptlab.model.loss_and_grads`` for them.

Mixed precision (``MixedPrecision``): float32 master weights, bfloat16 or float16 compute through
this path, gradients returned in float32; float16 with a dynamic ``LossScaler``.

For the fused AdamW (``gptlab.kernels.adamw``), ``FlatParams`` holds the master weights, the
compute copies and the gradients as views of one flat buffer each: ``FlatStep`` leaves the
gradients there (``FlatGrads``), and one kernel launch updates every parameter and rewrites its
compute copy.

Book: chapter 14.
"""

from __future__ import annotations

import functools
import math

import torch

from .backend import capture_cuda_graph
from .config import GPTConfig
from .layers.chunked_classifier import chunked_classifier_forward
from .layers.flash_attention import flash_attention_backward, flash_attention_forward
from .layers.gelu import GELU_CUBIC, INV_SQRT_2, INV_SQRT_2PI, SQRT_2_OVER_PI
from .model import check_idx, block_params, check_params

ATTENTIONS = ("sdpa", "flash")
CLASSIFIERS = ("full", "chunked")
PRECISIONS = ("float32", "bfloat16", "float16")
KERNELS = ("auto", "torch", "triton")


def check_fast_config(cfg: GPTConfig) -> None:
    """ValueError naming the first field the fused path does not cover (GPT-2's models only)."""
    gpt2 = {"ln_order": "pre", "norm": "layernorm", "mlp": "gelu", "position": "learned",
            "n_kv_head": None, "tie_embeddings": True, "dropout": 0.0}
    for name, value in gpt2.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"the fused path covers GPT-2's models only: GPTConfig.{name}="
                             f"{getattr(cfg, name)!r} (it needs {value!r}); use "
                             "gptlab.model.loss_and_grads for this config")  # fmt: skip


def new_grad_buffers(params: dict) -> dict:
    """Zeroed gradient buffers, one per parameter (same shape, dtype, device)."""
    return {name: torch.zeros_like(p) for name, p in params.items()}


def triton_refusal(device, dtype=torch.float32) -> str | None:
    """Why kernels="triton" cannot run on ``dtype`` tensors (a torch dtype or its name) on
    ``device``, or None when it can."""
    from .kernels.launch import DTYPES, interpreting, triton_unavailable

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype

    reason = triton_unavailable()
    if reason is None and torch.device(device or "cpu").type != "cuda" and not interpreting():
        reason = (f"the tensors are on {device or 'cpu'}; the kernels run on CUDA tensors (on the "
                  "CPU only under Triton's interpreter, TRITON_INTERPRET=1)")
    if reason is None and dtype not in DTYPES:
        reason = f"the kernels compute in float32, bfloat16 or float16, not {dtype}"
    return reason


def resolve_kernels(kernels: str, device, dtype=torch.float32) -> str:
    """The kernels a step on ``dtype`` tensors on ``device`` runs: "torch" or "triton" as asked,
    checked, or for "auto" "triton" on CUDA when Triton imports (and the dtype is not float64)
    and "torch" elsewhere. ValueError naming the option when "triton" cannot run there."""
    if kernels == "auto":
        on_cuda = torch.device(device or "cpu").type == "cuda"
        return "triton" if on_cuda and triton_refusal(device, dtype) is None else "torch"
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be one of {KERNELS}, got {kernels!r}")
    reason = triton_refusal(device, dtype) if kernels == "triton" else None
    if reason is not None:
        raise ValueError(f"kernels='triton' (--kernels triton) cannot run here: {reason}; use "
                         "kernels='torch' (--kernels torch)")
    return kernels


def _check_call(params, idx, targets, cfg, buffers, attention, classifier) -> None:
    """Every input check of a step, once, at the model's boundary."""
    check_fast_config(cfg)
    check_params(params, cfg)
    if not isinstance(params["wte.weight"], torch.Tensor):
        raise TypeError("the fused path runs on torch tensors, got "
                        f"{type(params['wte.weight']).__name__}: use backend='torch'")
    check_idx(idx, cfg)
    check_idx(targets, cfg, "targets")
    if tuple(targets.shape) != tuple(idx.shape):
        raise ValueError(f"targets has shape {tuple(targets.shape)}, idx has {tuple(idx.shape)}")
    if attention not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    if classifier not in CLASSIFIERS:
        raise ValueError(f"classifier must be one of {CLASSIFIERS}, got {classifier!r}")
    if buffers is not None:
        for name, p in params.items():
            g = buffers.get(name)
            if g is None or g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                raise ValueError(f"buffers[{name!r}] must be a tensor like params[{name!r}] "
                                 f"{tuple(p.shape)} {p.dtype}: make them with new_grad_buffers")


# --- the parts, on rows (N, C) ------------------------------------------------------------------


def _layernorm(x, w, b, eps):
    """x (N, C) -> (y (N, C), cache (xhat, w, rstd)). Two passes over x - mean (torch.var_mean,
    one pass, ran 4-14x slower on this CPU)."""
    xhat = x - x.mean(-1, keepdim=True)  # (N, C) x - mean, made xhat in place
    var = xhat.square().mean(-1, keepdim=True)  # (N, 1) biased variance, as GPT-2
    rstd = var.add_(eps).rsqrt_()  # (N, 1)
    xhat.mul_(rstd)  # (N, C)
    y = xhat * w if b is None else torch.addcmul(b, xhat, w)  # (N, C)
    return y, (xhat, w, rstd)


def _layernorm_back_(dy, cache, dw, db):
    """dy (N, C) becomes dx (N, C) in place (one temporary); dw, db (C,) written into the
    buffers (db None: no bias)."""
    xhat, w, rstd = cache
    # y = xhat * w + b
    dxhat_xhat = dy * xhat  # (N, C) dy * xhat, made dxhat * xhat below
    torch.sum(dxhat_xhat, 0, out=dw)
    if db is not None:
        torch.sum(dy, 0, out=db)
    # xhat = (x - mean) * rstd: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    mean_dxhat_xhat = dxhat_xhat.mul_(w).mean(-1, keepdim=True)  # (N, 1)
    dx = dy.mul_(w)  # (N, C) dxhat, in dy's buffer
    mean_dxhat = dx.mean(-1, keepdim=True)  # (N, 1)
    return dx.sub_(mean_dxhat).addcmul_(xhat, mean_dxhat_xhat, value=-1.0).mul_(rstd)  # (N, C)


def _linear(x, w, b, residual=None):
    """x (N, in) @ w (in, out) + b (+ residual (N, out)): one addmm; without a bias the
    residual is its addend, added as the product is written (no second pass over memory)."""
    if residual is None:
        return x @ w if b is None else torch.addmm(b, x, w)  # (N, out)
    if b is None:
        return torch.addmm(residual, x, w)  # (N, out)
    return torch.addmm(b, x, w).add_(residual)  # (N, out)


def _linear_back(dy, x, w, dw, db):
    """y = x @ w + b: dw = x^T dy and db = sum(dy) written into the buffers; returns dx."""
    torch.mm(x.T, dy, out=dw)
    if db is not None:
        torch.sum(dy, 0, out=db)
    return dy @ w.T  # (N, in)


def _gelu_phi(h, approximate):
    """Phi(h) (N, H) of the GELU y = h * Phi(h), in one buffer."""
    if approximate == "tanh":
        # Phi = 0.5 * (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) * (h + 0.044715 h^3)
        # (the same number; torch's sigmoid ran 6x faster than its tanh on this CPU)
        phi = h * h  # (N, H) h^2, made Phi in place
        phi.mul_(GELU_CUBIC).add_(1.0).mul_(h).mul_(2.0 * SQRT_2_OVER_PI)
        return phi.sigmoid_()  # (N, H)
    # Phi = 0.5 * (1 + erf(h / sqrt(2))) (torch.special.ndtr, the same, ran slower)
    return (h * INV_SQRT_2).erf_().add_(1.0).mul_(0.5)  # (N, H)


def _gelu_back_(dg, h, phi, g, approximate):
    """dg (N, H) becomes dh = dg * (Phi + h * Phi'(h)) in place, with no temporary: Phi' is
    built in the buffer of the forward's g = h * Phi (dead once c_proj's dw is made)."""
    slope = torch.mul(h, h, out=g)  # (N, H) h^2, made Phi' in g's buffer
    if approximate == "tanh":
        # Phi = sigmoid(2u): Phi' = 2 Phi (1 - Phi) * sqrt(2/pi) * (1 + 3 * 0.044715 h^2)
        slope.mul_(3.0 * GELU_CUBIC).add_(1.0).mul_(2.0 * SQRT_2_OVER_PI).mul_(phi)
        slope.addcmul_(slope, phi, value=-1.0)  # times (1 - Phi)
    else:
        # Phi' = exp(-h^2 / 2) / sqrt(2 pi)
        slope.mul_(-0.5).exp_().mul_(INV_SQRT_2PI)
    return dg.mul_(slope.mul_(h).add_(phi))  # (N, H) dy * (Phi + h * Phi')


def _mlp_up(h2, w, b, approximate):
    """g = gelu(h2 @ w + b) (N, 4C) and its cache."""
    hpre = _linear(h2, w, b)  # (N, 4C)
    phi = _gelu_phi(hpre, approximate)  # (N, 4C)
    g = hpre * phi  # (N, 4C) gelu(hpre)
    return g, (hpre, phi, g)


def _mlp_up_back(dg, cache, h2, w, dw, db, approximate):
    """dg (N, 4C) -> dh2 (N, C); dw, db written into the buffers."""
    hpre, phi, g = cache
    # g = hpre * Phi(hpre)
    dhpre = _gelu_back_(dg, hpre, phi, g, approximate)  # (N, 4C)
    # hpre = h2 @ w_fc + b_fc
    return _linear_back(dhpre, h2, w, dw, db)  # (N, C)


def _split_heads(x, B, T, n_head, parts: int):
    """x (N, parts * C) -> (parts, B, NH, T, hs): a view of x, the parts (q, k, v) and heads
    side by side as the projection wrote them."""
    hs = x.shape[1] // (parts * n_head)
    return x.view(B, T, parts, n_head, hs).permute(2, 0, 3, 1, 4)


def _attention_core(qkv, B, T, n_head, attention):
    """qkv (N, 3C) -> (heads (N, C), cache): causal multi-head attention, the layers' flash
    attention with attention="flash"."""
    C = qkv.shape[1] // 3
    hs = C // n_head
    # one copy into the heads' layout, which every matmul here and in the backward reads in place
    q, k, v = _split_heads(qkv, B, T, n_head, 3).contiguous()  # (B, NH, T, hs)
    if attention == "flash":
        out, cache = flash_attention_forward(q, k, v, causal=True)  # (B, NH, T, hs)
    else:
        # scores = q @ k^T / sqrt(hs) + mask (-inf where j > i), in one baddbmm
        mask = torch.full((T, T), -math.inf, dtype=qkv.dtype, device=qkv.device).triu_(1)  # (T, T)
        att = torch.baddbmm(mask, q.flatten(0, 1), k.flatten(0, 1).mT, alpha=1.0 / math.sqrt(hs))
        att = att.view(B, n_head, T, T)  # (B, NH, T, T) scores, made the weights in place
        att.sub_(att.amax(-1, keepdim=True)).exp_()
        att.div_(att.sum(-1, keepdim=True))  # (B, NH, T, T) rows sum to 1
        out, cache = att @ v, (q, k, v, att)  # (B, NH, T, hs)
    return out.transpose(1, 2).reshape(B * T, C), cache  # (N, C)


def _attention_core_back(dheads, cache, B, T, n_head, attention):
    """dheads (N, C) -> dqkv (N, 3C)."""
    C = dheads.shape[1]
    dout = dheads.view(B, T, n_head, C // n_head).transpose(1, 2).contiguous()  # (B, NH, T, hs)
    if attention == "flash":
        dq, dk, dv = flash_attention_backward(dout, cache)  # (B, NH, T, hs) each
    else:
        q, k, v, att = cache
        # out = att @ v
        dv = att.transpose(-1, -2) @ dout  # (B, NH, T, hs)
        datt = dout @ v.transpose(-1, -2)  # (B, NH, T, T)
        # att = softmax(scores): dscores = att * (datt - sum_j att * datt), in datt's buffer
        datt.mul_(att)
        datt.addcmul_(att, datt.sum(-1, keepdim=True), value=-1.0)
        # scores = q @ k^T * scale
        datt.mul_(1.0 / math.sqrt(C // n_head))
        dq, dk = datt @ k, datt.transpose(-1, -2) @ q  # (B, NH, T, hs)
    # q, k, v = split(qkv): one copy into qkv's layout (B, T, 3, NH, hs)
    dqkv = torch.stack((dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)), 2)
    return dqkv.view(B * T, 3 * C)  # (N, 3C)


class _Parts:
    """The steps that have Triton twins, as one set: torch ops (this module's functions) or
    the kernels of gptlab/kernels/ (``_triton_parts``)."""

    layernorm = staticmethod(_layernorm)
    layernorm_back_ = staticmethod(_layernorm_back_)
    mlp_up = staticmethod(_mlp_up)
    mlp_up_back = staticmethod(_mlp_up_back)
    attention_core = staticmethod(_attention_core)
    attention_core_back = staticmethod(_attention_core_back)
    classifier = None  # the torch path's head is written out in fast_loss_and_grads


@functools.cache
def _triton_parts():
    """_Parts with the Triton kernels (imported here: Triton is needed only when asked for).
    The kernels return new gradients; these copy dw, db into the buffers."""
    from .kernels import bias_gelu, flash_attention, layernorm
    from .kernels.classifier import fused_classifier

    class TritonParts:
        @staticmethod
        def layernorm(x, w, b, eps):
            return layernorm.layernorm_forward(x, w, b, eps=eps)  # (N, C)

        @staticmethod
        def layernorm_back_(dy, cache, dw, db):
            dx, dw_kernel, db_kernel = layernorm.layernorm_backward(dy, cache)  # (N, C)
            dw.copy_(dw_kernel)
            if db is not None:
                db.copy_(db_kernel)
            return dx

        @staticmethod
        def mlp_up(h2, w, b, approximate):
            return bias_gelu.bias_gelu_forward(h2 @ w, b, approximate=approximate)  # (N, 4C)

        @staticmethod
        def mlp_up_back(dg, cache, h2, w, dw, db, approximate):
            # g = gelu(hpre + b_fc)
            dhpre, db_kernel = bias_gelu.bias_gelu_backward(dg, cache)  # (N, 4C)
            if db is not None:
                db.copy_(db_kernel)
            # hpre = h2 @ w_fc
            torch.mm(h2.T, dhpre, out=dw)
            return dhpre @ w.T  # (N, C)

        @staticmethod
        def attention_core(qkv, B, T, n_head, attention):  # the flash kernel, always
            heads = qkv.new_empty(qkv.shape[0], qkv.shape[1] // 3)  # (N, C)
            # q, k, v read where qkv holds them; the heads written side by side: no copies
            q, k, v = _split_heads(qkv, B, T, n_head, 3)  # (B, NH, T, hs) views of qkv
            _, cache = flash_attention.flash_attention_forward(
                q, k, v, causal=True, out=_split_heads(heads, B, T, n_head, 1)[0])
            return heads, cache

        @staticmethod
        def attention_core_back(dheads, cache, B, T, n_head, attention):
            dqkv = dheads.new_empty(dheads.shape[0], 3 * dheads.shape[1])  # (N, 3C)
            # q, k, v = split(qkv): dq, dk, dv written into their places in dqkv
            flash_attention.flash_attention_backward(
                _split_heads(dheads, B, T, n_head, 1)[0], cache,
                grads=tuple(_split_heads(dqkv, B, T, n_head, 3)))
            return dqkv

        classifier = staticmethod(fused_classifier)  # on rows, unchecked

    return TritonParts


def _parts(kernels: str):
    return _triton_parts() if kernels == "triton" else _Parts


def _block_forward(x, p, cfg, B, T, attention, parts=_Parts):
    """Block ``p`` (names without ``h.{l}.``) on x (N, C) -> (y (N, C), cache), pre-LN:
    x1 = x + attn(LN1(x)),  y = x1 + mlp(LN2(x1))."""
    eps = cfg.layer_norm_epsilon
    h1, ln1 = parts.layernorm(x, p["ln_1.weight"], p.get("ln_1.bias"), eps)  # (N, C)
    qkv = _linear(h1, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"))  # (N, 3C)
    heads, core = parts.attention_core(qkv, B, T, cfg.n_head, attention)  # (N, C)
    x1 = _linear(heads, p["attn.c_proj.weight"], p.get("attn.c_proj.bias"), x)  # (N, C)
    h2, ln2 = parts.layernorm(x1, p["ln_2.weight"], p.get("ln_2.bias"), eps)  # (N, C)
    g, mlp = parts.mlp_up(h2, p["mlp.c_fc.weight"], p.get("mlp.c_fc.bias"),
                          cfg.gelu_approximate)  # (N, 4C) gelu(h2 @ w_fc + b_fc)
    y = _linear(g, p["mlp.c_proj.weight"], p.get("mlp.c_proj.bias"), x1)  # (N, C)
    return y, (h1, ln1, core, heads, h2, ln2, g, mlp)


def _block_backward(dy, cache, p, grads, prefix, cfg, B, T, attention, parts=_Parts):
    """dy (N, C) -> dx (N, C); the block's gradients written into grads[prefix + name]."""
    h1, ln1, core, heads, h2, ln2, g, mlp = cache
    d = {name: grads.get(prefix + name) for name in
         ("ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias",
          "attn.c_proj.weight", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
          "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias")}
    # y = x1 + gelu(hpre) @ w_proj + b_proj: dy reaches x1 and the MLP
    dg = _linear_back(dy, g, p["mlp.c_proj.weight"], d["mlp.c_proj.weight"], d["mlp.c_proj.bias"])
    # g = gelu(h2 @ w_fc + b_fc)
    dh2 = parts.mlp_up_back(dg, mlp, h2, p["mlp.c_fc.weight"], d["mlp.c_fc.weight"],
                            d["mlp.c_fc.bias"], cfg.gelu_approximate)  # (N, C)
    # h2 = LN2(x1), and the residual: dx1 = dy + LN2's input gradient
    dx1 = parts.layernorm_back_(dh2, ln2, d["ln_2.weight"], d["ln_2.bias"]).add_(dy)  # (N, C)
    # x1 = x + heads @ w_proj + b_proj
    dheads = _linear_back(dx1, heads, p["attn.c_proj.weight"], d["attn.c_proj.weight"],
                          d["attn.c_proj.bias"])  # (N, C)
    # heads = attention(qkv)
    dqkv = parts.attention_core_back(dheads, core, B, T, cfg.n_head, attention)  # (N, 3C)
    # qkv = h1 @ w_attn + b_attn
    dh1 = _linear_back(dqkv, h1, p["attn.c_attn.weight"], d["attn.c_attn.weight"],
                       d["attn.c_attn.bias"])  # (N, C)
    # h1 = LN1(x), and the residual: dx = dx1 + LN1's input gradient
    return parts.layernorm_back_(dh1, ln1, d["ln_1.weight"], d["ln_1.bias"]).add_(dx1)  # (N, C)


def fast_loss_and_grads(params: dict, idx, targets, cfg: GPTConfig, buffers=None, *,
                        attention: str = "sdpa", classifier: str = "full",
                        recompute: bool = False, loss_scale: float = 1.0,
                        kernels: str = "auto"):  # fmt: skip
    """One forward and hand-written backward of a GPT-2 model on torch: (loss as a Python float,
    grads dict), as ``gptlab.model.loss_and_grads``. ``buffers`` (``new_grad_buffers``): the
    tensors the gradients are written into, returned as the grads dict (so a caller that keeps
    last step's gradients must copy them). ``loss_scale``: the gradients are those of
    loss_scale * loss (the returned loss is not scaled). ``kernels``: see the module docstring."""
    _check_call(params, idx, targets, cfg, buffers, attention, classifier)
    wte = params["wte.weight"]
    grads = new_grad_buffers(params) if buffers is None else buffers
    loss, grads = forward_backward_(params, idx, targets, cfg, grads, attention=attention,
                                    classifier=classifier, recompute=recompute,
                                    loss_scale=loss_scale,
                                    kernels=resolve_kernels(kernels, wte.device, wte.dtype))
    return float(loss), grads


def forward_backward_(params: dict, idx, targets, cfg: GPTConfig, grads: dict, *, attention: str,
                      classifier: str, recompute: bool, loss_scale: float, kernels: str):
    """``fast_loss_and_grads`` after its checks, ``kernels`` resolved: (loss, a 0-d tensor on the
    device, grads). Nothing here reads a value back to the host, so a CUDA graph can hold it."""
    wte = params["wte.weight"]  # (V, C)
    parts = _parts(kernels)
    B, T = idx.shape
    N, C = B * T, cfg.n_embd
    ids, target_ids = idx.reshape(N), targets.reshape(N)  # (N,)
    # x0 = wte[idx] + wpe[0..T-1]
    x = wte[ids].view(B, T, C).add_(params["wpe.weight"][:T]).view(N, C)  # (N, C)
    blocks = []
    for layer in range(cfg.n_layer):
        p = block_params(params, layer)
        y, cache = _block_forward(x, p, cfg, B, T, attention, parts)  # (N, C)
        blocks.append(x if recompute else cache)  # recompute keeps the block's input only
        x = y
    # xf = LN_f(x)
    xf, ln_f = parts.layernorm(x, params["ln_f.weight"], params.get("ln_f.bias"),
                               cfg.layer_norm_epsilon)  # (N, C)
    dwte = grads["wte.weight"]  # (V, C), the head's share first
    if classifier == "chunked" or parts.classifier is not None:
        chunked = parts.classifier or chunked_classifier_forward
        loss, (dxf, dwte_head) = chunked(xf, wte, target_ids)  # dxf (N, C)
        dwte.copy_(dwte_head)
        if loss_scale != 1.0:  # float16: the gradients of loss_scale * loss
            dwte.mul_(loss_scale)
            dxf.mul_(loss_scale)
    else:
        logits = xf @ wte.T  # (N, V), becomes dlogits in place
        loss = _softmax_cross_entropy_(logits, target_ids, loss_scale)
        # logits = xf @ wte^T
        torch.mm(logits.T, xf, out=dwte)
        dxf = logits @ wte  # (N, C)
        del logits
    dx = parts.layernorm_back_(dxf, ln_f, grads["ln_f.weight"], grads.get("ln_f.bias"))  # (N, C)
    for layer in reversed(range(cfg.n_layer)):
        p = block_params(params, layer)
        cache = blocks[layer]
        if recompute:  # the block's forward again, from its kept input
            cache = _block_forward(cache, p, cfg, B, T, attention, parts)[1]
        dx = _block_backward(dx, cache, p, grads, f"h.{layer}.", cfg, B, T, attention, parts)
        blocks[layer] = None  # free the block's activations as soon as they are used
    # x0 = wte[idx] + wpe[0..T-1]
    torch.sum(dx.view(B, T, C), 0, out=grads["wpe.weight"][:T])
    grads["wpe.weight"][T:].zero_()
    dwte.index_add_(0, ids, dx)  # the embedding's share, added to the head's
    return loss, grads


def _softmax_cross_entropy_(logits, targets, scale: float):
    """logits (N, V), targets (N,) -> the mean cross-entropy (a 0-d float64 tensor); logits'
    buffer becomes dlogits = scale * (softmax(logits) - onehot(targets)) / N."""
    N = logits.shape[0]
    rows = torch.arange(N, device=logits.device)
    row_max = logits.amax(-1, keepdim=True)  # (N, 1)
    # loss_n = log(sum_j exp(logits_nj - max_n)) - (logits_n[target_n] - max_n)
    picked = logits[rows, targets] - row_max[:, 0]  # (N,)
    logits.sub_(row_max).exp_()  # (N, V) exp of the shifted logits
    total = logits.sum(-1, keepdim=True)  # (N, 1)
    loss = (total[:, 0].double().log() - picked.double()).mean()  # ()
    # dlogits = (probs - onehot) / N, times the loss scale
    logits.div_(total)  # (N, V) probs
    logits[rows, targets] -= 1.0
    logits.mul_(scale / N)
    return loss


class LossScaler:
    """float16's dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training").

    float16 ends at 65504 and its smallest subnormal is 6e-8: small gradients flush to zero. The
    backward therefore starts from dloss = ``scale`` (every gradient scaled up), and the float32
    gradients are divided by it again. A step whose scaled gradients overflow (inf or nan) is
    skipped and the scale halved; after ``growth_interval`` good steps in a row it doubles.
    Counts: ``skipped`` steps, ``growths`` of the scale, ``good_steps`` since the last change;
    ``state_dict`` / ``load_state_dict`` carry the scale and the counts through a checkpoint."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 1000, factor: float = 2.0):
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an integer >= 1, got {growth_interval!r}")
        if not (scale > 0 and math.isfinite(scale)) or not factor > 1:
            raise ValueError(f"scale must be a finite number > 0 and factor > 1, got "
                             f"scale={scale!r}, factor={factor!r}")  # fmt: skip
        self.scale, self.growth_interval, self.factor = float(scale), growth_interval, factor
        self.good_steps, self.skipped, self.growths = 0, 0, 0

    def update(self, finite: bool) -> bool:
        """Record a step whose scaled gradients were ``finite`` or not; True: take the step."""
        if not finite:  # overflow: skip the update, halve the scale
            self.scale /= self.factor
            self.good_steps, self.skipped = 0, self.skipped + 1
            return False
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:  # long enough without overflow: grow
            self.scale *= self.factor
            self.good_steps, self.growths = 0, self.growths + 1
        return True

    def state_dict(self) -> dict:
        """The schedule's position (JSON-friendly): the scale and the counts. A run resumed from
        it with ``load_state_dict`` goes on with the same scale."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped,
                "growths": self.growths}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a ``state_dict()``; ValueError naming a missing or bad entry."""
        scale = state.get("scale")
        if not (isinstance(scale, (int, float)) and scale > 0 and math.isfinite(scale)):
            raise ValueError(f"the loss scaler's state needs a finite scale > 0, got {scale!r}")
        counts = {name: state.get(name) for name in ("good_steps", "skipped", "growths")}
        for name, count in counts.items():
            if not (isinstance(count, int) and count >= 0):
                raise ValueError(f"the loss scaler's state needs {name} as an integer >= 0, "
                                 f"got {count!r}")
        self.scale = float(scale)
        self.good_steps, self.skipped, self.growths = counts.values()


class FlatParams(dict):
    """The parameters as views of flat buffers, for the fused AdamW (``gptlab.kernels.adamw``,
    run by ``gptlab.training.optim.FusedAdamW``): ONE kernel launch updates every parameter.

    ``self[name]``: a float32 view of ``master`` (n,), the master weights. The names are in one
    order, those ``decayed(name, tensor)`` picks first, so the decayed elements are
    ``master[:n_decayed]``. In that same order, one view per name:

        compute  (n,) bfloat16 / float16: the copies the step computes with (None at "float32",
                 where the step computes on the masters)
        grad     (n,) the gradients, in the compute dtype; ``grads``: its views, the buffers
                 FlatStep writes them into

    The fused update writes the masters and the compute copies in the same pass.
    ``compute_weights()`` gives the weights a step runs on: it copies the masters into the
    compute copies first when they changed since the copies were last written (a new FlatParams,
    a resumed run, any in-place edit of a master), so a step never computes with stale copies.
    An entry is never rebound (``params[name] = x`` raises): write into it in place.
    """

    def __init__(self, params: dict, precision: str = "float32", *, decayed):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        for name, p in params.items():
            if not (isinstance(p, torch.Tensor) and p.dtype == torch.float32):
                got = p.dtype if isinstance(p, torch.Tensor) else type(p).__name__
                raise TypeError(f"FlatParams holds float32 torch tensors (the master weights): "
                                f"{name} is {got}")
        devices = {p.device for p in params.values()}
        if len(devices) != 1:
            raise ValueError(f"the parameters must lie on one device, got "
                             f"{sorted(map(str, devices))}")
        first = {name for name, p in params.items() if decayed(name, p)}  # the decayed names
        order = sorted(params, key=lambda name: name not in first)  # stable: first, then the rest
        self.shapes = {name: tuple(params[name].shape) for name in order}
        self.n_decayed = sum(params[name].numel() for name in first)
        self.precision = precision
        n, device = sum(p.numel() for p in params.values()), devices.pop()
        self.master = torch.empty(n, dtype=torch.float32, device=device)
        super().__init__(self.views(self.master))
        torch._foreach_copy_(list(self.values()), [params[name] for name in self])
        dtype = getattr(torch, precision)  # of the compute copies and the gradients
        self.compute = (None if precision == "float32"
                        else torch.empty_like(self.master, dtype=dtype))  # (n,)
        self._compute_views = self if self.compute is None else self.views(self.compute)
        self.grad = torch.zeros_like(self.master, dtype=dtype)  # (n,)
        self.grads = self.views(self.grad)
        self._copied_at = None  # master._version when the copies were last written from it

    def views(self, flat) -> dict:
        """name -> the view of ``flat`` ((n,), this layout) that holds that parameter."""
        views, start = {}, 0
        for name, shape in self.shapes.items():
            size = math.prod(shape)
            views[name] = flat[start:start + size].view(shape)
            start += size
        return views

    def __setitem__(self, name, value):
        raise TypeError(f"FlatParams[{name!r}] is a view of the flat master buffer: write into "
                        "it in place (copy_), never rebind it")

    def compute_weights(self) -> dict:
        """name -> the weights a step computes with: the masters at "float32"; else the compute
        copies, rewritten from the masters (one copy of the flat buffer) when they are stale."""
        if self.compute is None:
            return self
        # every in-place torch write into a master view moves the buffer's version counter;
        # the fused update writes through the kernel and records it with copies_written
        if self.master._version != self._copied_at:
            self.compute.copy_(self.master)
            self.copies_written()
        return self._compute_views

    def copies_written(self) -> None:
        """Record that the compute copies hold the masters now (the fused update wrote both)."""
        self._copied_at = self.master._version


class FlatGrads:
    """The gradient of a step over ``FlatParams``: g = scale * params.grad, left where the
    backward wrote it. float16's 1 / loss scale and the clip factor are the one number ``scale``,
    which the fused update multiplies in as it reads each element: the gradients are never
    rewritten, and no float32 copy of them is made."""

    def __init__(self, params: FlatParams, scale: float):
        self.params, self.scale = params, scale

    def norm(self) -> float:
        """||g||_2 = scale ||params.grad||_2, accumulated in float32 (one reduction)."""
        return float(torch.linalg.vector_norm(self.params.grad, dtype=torch.float32)) * self.scale


class FastStep:
    """A training step through the fused path at a ``precision``: "float32" (the parameters' own
    dtype, float64 too), or "bfloat16" /
    "float16" compute from float32 master weights (the optimizer's state stays float32 too, as
    it is built over the master weights). float16 scales the loss with ``scaler`` (a fresh
    ``LossScaler`` by default). ``options``: fast_loss_and_grads's attention, classifier,
    recompute, kernels.

        loss, grads = step(master_params, idx, targets)
        grads: float32, like the master weights, in buffers the next call overwrites (copy
        them to keep them); None when float16 overflowed (skip the update)
    """

    def __init__(self, cfg: GPTConfig, precision: str = "float32", *, scaler=None, **options):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        check_fast_config(cfg)
        if options.get("kernels") == "triton":  # refused now, before any step
            resolve_kernels("triton", "cuda" if torch.cuda.is_available() else "cpu")
        self.cfg, self.precision, self.options = cfg, precision, options
        self.dtype = getattr(torch, precision)
        if scaler is not None and precision != "float16":
            raise ValueError(f"a loss scaler is for float16 (its range ends at 65504), not "
                             f"precision={precision!r}")
        self.scaler = (scaler or LossScaler()) if precision == "float16" else None
        self.buffers = self.compute = self.master_grads = None

    def __call__(self, params: dict, idx, targets):
        if self.precision != "float32" and params["wte.weight"].dtype != torch.float32:
            raise TypeError(f"mixed precision keeps float32 master weights, got "
                            f"{params['wte.weight'].dtype}")  # fmt: skip
        compute = params  # "float32": the model's own dtype (float64 too), no copy
        if self.precision != "float32":
            # the compute copies, rewritten in one multi-tensor pass (not one copy per parameter)
            self.compute = self.compute or {name: torch.empty_like(p, dtype=self.dtype)
                                            for name, p in params.items()}  # fmt: skip
            torch._foreach_copy_(list(self.compute.values()), list(params.values()))
            compute = self.compute
        if self.buffers is None:
            self.buffers = new_grad_buffers(compute)
        scale = 1.0 if self.scaler is None else self.scaler.scale
        loss, grads = fast_loss_and_grads(compute, idx, targets, self.cfg, self.buffers,
                                          loss_scale=scale, **self.options)  # fmt: skip
        if self.precision == "float32":
            return loss, grads
        # float32 gradients of the master weights, in buffers reused every step as self.buffers
        self.master_grads = self.master_grads or {name: torch.empty_like(g, dtype=torch.float32)
                                                  for name, g in grads.items()}  # fmt: skip
        master_grads = self.master_grads
        torch._foreach_copy_(list(master_grads.values()), list(grads.values()))
        if scale != 1.0:
            torch._foreach_div_(list(master_grads.values()), scale)
        if self.scaler is not None:
            finite = math.isfinite(loss) and all(bool(torch.isfinite(g).all())
                                                  for g in master_grads.values())
            if not self.scaler.update(finite):
                return loss, None
        return loss, master_grads


class FlatStep(FastStep):
    """``FastStep`` over ``FlatParams`` (of its precision), for the fused AdamW: the step computes
    with their compute weights (copied from the masters only when stale) and leaves the
    gradients in their flat ``grad`` buffer, in the compute dtype, returned as ``FlatGrads``
    whose scale is 1 / the loss scale: no float32 copy of the gradients, no pass that unscales
    them. float16 still skips a step whose scaled gradients overflowed (grads None).

        loss, grads = step(flat_params, idx, targets)
    """

    def __call__(self, params: FlatParams, idx, targets):
        self._check_flat(params)
        scale = 1.0 if self.scaler is None else self.scaler.scale
        loss, _ = fast_loss_and_grads(params.compute_weights(), idx, targets, self.cfg,
                                      params.grads, loss_scale=scale, **self.options)
        if self.scaler is not None:
            finite = math.isfinite(loss) and bool(torch.isfinite(params.grad).all())
            if not self.scaler.update(finite):
                return loss, None
        return loss, FlatGrads(params, 1.0 / scale)

    def _check_flat(self, params) -> None:
        if not (isinstance(params, FlatParams) and params.precision == self.precision):
            got = params.precision if isinstance(params, FlatParams) else type(params).__name__
            raise ValueError(f"{type(self).__name__} runs on FlatParams of "
                             f"precision={self.precision!r}, got {got}")


class GraphStep(FlatStep):
    """``FlatStep`` with its forward and backward captured once as a CUDA graph and replayed at
    every step: one launch from the host where the eager step makes some hundreds.

    What makes the step capturable: ``FlatParams`` keeps the weights, the compute copies and the
    gradients at fixed addresses; the batch is copied into buffers of its own; and the body,
    ``forward_backward_``, reads nothing back to the host (the inputs are checked before it, the
    loss stays on the device until the replay is over). A replay runs the kernels with the
    arguments they were captured with, so whatever changes between steps must live in memory:
    float16's loss scale does not (refused; bfloat16 needs none). The graph is captured again for
    another FlatParams or a batch of another shape. The body must be Triton's (kernels="triton")
    or the torch ops with attention="sdpa" and classifier="full": the layers' flash attention and
    chunked classifier check their inputs on the host.

    On CUDA tensors the graph is captured at the first call; anywhere else the same body runs
    eagerly through the same buffers, which is how a machine without a GPU checks it.
    """

    def __init__(self, cfg: GPTConfig, precision: str = "float32", **options):
        if precision == "float16":
            raise ValueError("a CUDA graph replays float16's loss scale as it was captured, but "
                             "the scale changes between steps: use precision='bfloat16'")
        super().__init__(cfg, precision, **options)
        checked = [f"{name}={options[name]!r}" for name, fused in (("attention", "sdpa"),
                                                                  ("classifier", "full"))
                   if options.get(name, fused) != fused]  # fmt: skip
        if options.get("kernels") == "torch" and checked:
            raise ValueError(f"with kernels='torch', {checked[0]} runs a layer that checks its "
                             "inputs on the host, which a CUDA graph cannot hold: use "
                             "kernels='triton'")
        self.graph = self.key = None

    def __call__(self, params: FlatParams, idx, targets):
        self._check_flat(params)
        weights = params.compute_weights()  # the compute copies, rewritten here if stale
        attention = self.options.get("attention", "sdpa")
        classifier = self.options.get("classifier", "full")
        _check_call(weights, idx, targets, self.cfg, params.grads, attention, classifier)
        key = (params, tuple(idx.shape), idx.device)  # holds params: its buffers stay put
        if self.key is None or key[0] is not self.key[0] or key[1:] != self.key[1:]:
            self.key, self.graph = key, None  # new buffers for the batch, and a new graph
            self.idx = torch.empty(idx.shape, dtype=torch.int64, device=idx.device)  # (B, T)
            self.targets = torch.empty_like(self.idx)  # (B, T)
            kernels = resolve_kernels(self.options.get("kernels", "auto"),
                                      weights["wte.weight"].device, self.dtype)  # fmt: skip
            options = {"recompute": False, **self.options, "attention": attention,
                       "classifier": classifier, "kernels": kernels}
            self.body = functools.partial(forward_backward_, weights, self.idx, self.targets,
                                          self.cfg, params.grads, loss_scale=1.0, **options)
        self.idx.copy_(idx)
        self.targets.copy_(targets)
        if self.graph is None and idx.device.type == "cuda":
            self.graph, (self.loss, _) = capture_cuda_graph(self.body)
        if self.graph is None:
            self.loss, _ = self.body()  # (), eagerly: no CUDA here
        else:
            self.graph.replay()  # rewrites self.loss and params.grad
        return float(self.loss), FlatGrads(params, 1.0)


__all__ = ["fast_loss_and_grads", "forward_backward_", "new_grad_buffers", "check_fast_config",
           "LossScaler", "FastStep", "FlatParams", "FlatGrads", "FlatStep", "GraphStep",
           "resolve_kernels", "ATTENTIONS", "CLASSIFIERS", "PRECISIONS", "KERNELS"]
