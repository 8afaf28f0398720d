"""The residual block of a GPT, in both orderings.

    pre-LN  (GPT-2, GPT-3):            x1 = x + attn(LN1(x));      y = x1 + mlp(LN2(x1))
    post-LN (the original transformer): x1 = LN1(x + attn(x));     y = LN2(x1 + mlp(x1))

``p`` holds the block's parameters under GPT-2's names without the ``h.{i}.`` prefix
(``ln_1.weight``, ``attn.c_attn.weight``, ``mlp.c_proj.bias``, ...). With ``dropout > 0`` and a
``seed``, dropout is applied to the output of each branch (GPT-2's residual dropout). A block
without biases (nanoGPT's ``bias=False``) simply has no ``*.bias`` entries in ``p``.
A residual connection y = x + f(x) sends dy down both paths: dx = dy + df's input gradient.

Book: chapter 4 (forward) and chapter 8 (backward).
"""

from __future__ import annotations

from .attention import attention_backward, attention_forward
from .dropout import dropout_backward, dropout_forward
from .layernorm import layernorm_backward, layernorm_forward
from .mlp import mlp_backward, mlp_forward

def block_param_shapes(C: int, bias: bool = True) -> dict[str, tuple[int, ...]]:
    """Every block parameter's name and shape for width C (GPT-2's (in, out) layout); without
    ``bias`` the six biases are left out (nanoGPT's ``bias=False``)."""
    shapes = {
        "ln_1.weight": (C,), "ln_1.bias": (C,),
        "attn.c_attn.weight": (C, 3 * C), "attn.c_attn.bias": (3 * C,),
        "attn.c_proj.weight": (C, C), "attn.c_proj.bias": (C,),
        "ln_2.weight": (C,), "ln_2.bias": (C,),
        "mlp.c_fc.weight": (C, 4 * C), "mlp.c_fc.bias": (4 * C,),
        "mlp.c_proj.weight": (4 * C, C), "mlp.c_proj.bias": (C,),
    }  # fmt: skip
    return shapes if bias else {name: s for name, s in shapes.items() if not name.endswith(".bias")}


BLOCK_PARAM_NAMES = tuple(block_param_shapes(1))


def _attn(x, p, opts):
    return attention_forward(x, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"),
                             p["attn.c_proj.weight"], p.get("attn.c_proj.bias"),
                             n_head=opts["n_head"])  # fmt: skip


def _mlp(x, p, opts):
    return mlp_forward(x, p["mlp.c_fc.weight"], p.get("mlp.c_fc.bias"), p["mlp.c_proj.weight"],
                       p.get("mlp.c_proj.bias"), approximate=opts["gelu"])  # fmt: skip


def _ln(x, p, name, opts):
    return layernorm_forward(x, p[f"{name}.weight"], p.get(f"{name}.bias"), eps=opts["eps"])


def _drop(x, opts, offset):
    """Residual dropout on a branch output; the identity when dropout is off."""
    if opts["dropout"] == 0.0 or opts["seed"] is None:
        return x, None
    return dropout_forward(x, p=opts["dropout"], seed=opts["seed"] + offset)


def _drop_back(dy, cache):
    return dy if cache is None else dropout_backward(dy, cache)[0]


def block_forward(x, p, *, n_head: int, ln_order: str = "pre", gelu: str = "tanh",
                  eps: float = 1e-5, dropout: float = 0.0, seed: int | None = None):
    """x (B, T, C), p dict of the 12 block parameters (6 without biases) -> y (B, T, C)."""
    expected = block_param_shapes(1, bias=any(name.endswith(".bias") for name in p))
    missing = [name for name in expected if name not in p]
    if missing:
        raise ValueError(f"block parameters missing: {missing}")
    if ln_order not in ("pre", "post"):
        raise ValueError(f"ln_order must be 'pre' or 'post', got {ln_order!r}")
    opts = dict(n_head=n_head, gelu=gelu, eps=eps, dropout=dropout, seed=seed)
    c = {}
    if ln_order == "pre":
        h1, c["ln_1"] = _ln(x, p, "ln_1", opts)  # (B, T, C)
        a, c["attn"] = _attn(h1, p, opts)  # (B, T, C)
        a, c["drop_1"] = _drop(a, opts, 0)  # (B, T, C)
        x1 = x + a  # (B, T, C)
        h2, c["ln_2"] = _ln(x1, p, "ln_2", opts)  # (B, T, C)
        m, c["mlp"] = _mlp(h2, p, opts)  # (B, T, C)
        m, c["drop_2"] = _drop(m, opts, 1)  # (B, T, C)
        y = x1 + m  # (B, T, C)
    else:
        a, c["attn"] = _attn(x, p, opts)  # (B, T, C)
        a, c["drop_1"] = _drop(a, opts, 0)  # (B, T, C)
        x1, c["ln_1"] = _ln(x + a, p, "ln_1", opts)  # (B, T, C)
        m, c["mlp"] = _mlp(x1, p, opts)  # (B, T, C)
        m, c["drop_2"] = _drop(m, opts, 1)  # (B, T, C)
        y, c["ln_2"] = _ln(x1 + m, p, "ln_2", opts)  # (B, T, C)
    return y, (ln_order, c)


def _named(prefix, names, grads):
    """The gradients under their parameter names; a missing bias has gradient None: left out."""
    return {f"{prefix}.{name}": g for name, g in zip(names, grads) if g is not None}


def block_backward(dy, cache):
    """dy (B, T, C) -> (dx (B, T, C), dp dict with the same keys as p)."""
    ln_order, c = cache
    attn_names = ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")
    mlp_names = ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias")
    ln_names = ("weight", "bias")
    dp = {}
    if ln_order == "pre":
        # y = x1 + m: the residual passes dy to x1 unchanged, and dy goes into the branch
        dm = _drop_back(dy, c["drop_2"])  # (B, T, C)
        dh2, *dmlp = mlp_backward(dm, c["mlp"])  # (B, T, C)
        # h2 = LN2(x1)
        dx1_ln, *dln2 = layernorm_backward(dh2, c["ln_2"])  # (B, T, C)
        dx1 = dy + dx1_ln  # (B, T, C)
        # x1 = x + a
        da = _drop_back(dx1, c["drop_1"])  # (B, T, C)
        dh1, *dattn = attention_backward(da, c["attn"])  # (B, T, C)
        # h1 = LN1(x)
        dx_ln, *dln1 = layernorm_backward(dh1, c["ln_1"])  # (B, T, C)
        dx = dx1 + dx_ln  # (B, T, C)
    else:
        # y = LN2(x1 + m)
        dsum2, *dln2 = layernorm_backward(dy, c["ln_2"])  # (B, T, C)
        dm = _drop_back(dsum2, c["drop_2"])  # (B, T, C)
        dx1_mlp, *dmlp = mlp_backward(dm, c["mlp"])  # (B, T, C)
        dx1 = dsum2 + dx1_mlp  # (B, T, C)
        # x1 = LN1(x + a)
        dsum1, *dln1 = layernorm_backward(dx1, c["ln_1"])  # (B, T, C)
        da = _drop_back(dsum1, c["drop_1"])  # (B, T, C)
        dx_attn, *dattn = attention_backward(da, c["attn"])  # (B, T, C)
        dx = dsum1 + dx_attn  # (B, T, C)
    dp.update(_named("ln_1", ln_names, dln1))
    dp.update(_named("attn", attn_names, dattn))
    dp.update(_named("ln_2", ln_names, dln2))
    dp.update(_named("mlp", mlp_names, dmlp))
    return dx, dp
