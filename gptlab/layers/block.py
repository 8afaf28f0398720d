"""The residual block of a GPT, in both orderings, built from GPT-2's parts or LLaMA's.

    pre-LN  (GPT-2, GPT-3, LLaMA):      x1 = x + attn(LN1(x));      y = x1 + mlp(LN2(x1))
    post-LN (the original transformer): x1 = LN1(x + attn(x));      y = LN2(x1 + mlp(x1))

Each of the three parts comes in two kinds, chosen independently (``GPTConfig`` names them):

    norm  "layernorm"  LN(x) = xhat * w + b                          layernorm.py
          "rmsnorm"    RMSNorm(x) = x / rms(x) * w                   rmsnorm.py
    attn  n_kv_head None: GPT-2's, one fused projection c_attn      attention.py
          n_kv_head NKV:  LLaMA's, q_proj, k_proj, v_proj, o_proj, NKV key/value heads, and with
                          ``rope_base`` rotary embeddings on q and k   gqa.py, rope.py
    mlp   "gelu"       gelu(x @ c_fc + b) @ c_proj + b                mlp.py
          "swiglu"     (silu(x @ gate_proj) * (x @ up_proj)) @ down_proj     swiglu.py
          "moe"        a router and E GELU MLPs (mlp.router, mlp.experts.*)   moe.py

A block with a mixture of experts returns the pair (y, aux), aux its load-balancing loss, and its
backward takes the pair (dy, daux), as ``moe_forward`` and ``moe_backward`` do.

``p`` holds the block's parameters without the ``h.{i}.`` prefix (``ln_1.weight``,
``attn.c_attn.weight``, ``attn.q_proj.weight``, ``mlp.gate_proj.weight``, ...; see
``block_param_shapes``). With ``dropout > 0`` and a ``seed``, dropout is applied to the output of
each branch (GPT-2's residual dropout). A block without biases (nanoGPT's ``bias=False``) simply
has no ``*.bias`` entries in ``p``; LLaMA's parts have none at all.
A residual connection y = x + f(x) sends dy down both paths: dx = dy + df's input gradient.

x may have any leading dims, (..., T, C) as (B, T, C). Packed documents: ``mask`` (..., T, T) bool
hides keys from queries besides the causal mask (False across documents), and ``positions``
(..., T) are the positions RoPE turns q and k by (restarting with every document); without them
row t is position t. ``rope_pairing`` is RoPE's pairing of coordinates (``rope.py``).

Book: chapter 4 (forward), chapter 8 (backward), and the chapter on today's open-model blocks.
"""

from __future__ import annotations

import functools

from ..backend import array_namespace
from .attention import attention_backward, attention_forward
from .dropout import dropout_backward, dropout_forward
from .gqa import gqa_attention_backward, gqa_attention_forward
from .layernorm import layernorm_backward, layernorm_forward
from .mlp import mlp_backward, mlp_forward
from .moe import moe_backward, moe_forward
from .rmsnorm import rmsnorm_backward, rmsnorm_forward
from .rope import rope_backward, rope_forward
from .swiglu import swiglu_backward, swiglu_forward

# Each part's parameter names, in the order its forward takes them (a missing bias goes in as None)
NORM_NAMES = {"layernorm": ("weight", "bias"), "rmsnorm": ("weight",)}
GPT2_ATTN_NAMES = ("c_attn.weight", "c_attn.bias", "c_proj.weight", "c_proj.bias")
GROUPED_ATTN_NAMES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
MLP_NAMES = {"gelu": ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"),
             "swiglu": ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
             "moe": ("router.weight", "experts.c_fc.weight", "experts.c_fc.bias",
                     "experts.c_proj.weight", "experts.c_proj.bias")}


def block_param_shapes(C: int, bias: bool = True, *, n_head: int = 1, n_kv_head: int | None = None,
                       norm: str = "layernorm", mlp: str = "gelu", hidden: int | None = None,
                       n_expert: int | None = None) -> dict[str, tuple[int, ...]]:  # fmt: skip
    """Every block parameter's name and shape for width C, in the package's (in, out) layout.

    The defaults give GPT-2's block (12 parameters; without ``bias`` the six biases are left out,
    nanoGPT's ``bias=False``). ``n_kv_head`` picks LLaMA's attention, whose k_proj and v_proj
    have n_kv_head * (C // n_head) columns; ``hidden`` is the MLP's width (None: 4C), and
    ``n_expert`` E the number of experts of mlp="moe", whose weights are stacked (E, in, out)."""
    H, E = 4 * C if hidden is None else hidden, n_expert
    if n_kv_head is None:
        attn_names, attn_shapes = GPT2_ATTN_NAMES, [(C, 3 * C), (3 * C,), (C, C), (C,)]
    else:
        kv = n_kv_head * (C // n_head)
        attn_names, attn_shapes = GROUPED_ATTN_NAMES, [(C, C), (C, kv), (C, kv), (C, C)]
    mlp_shapes = {"gelu": [(C, H), (H,), (H, C), (C,)], "swiglu": [(C, H), (C, H), (H, C)],
                  "moe": [(C, E), (E, C, H), (E, H), (E, H, C), (E, C)]}[mlp]
    norm_shapes = [(C,), (C,)]  # the gain, and LayerNorm's bias
    parts = [("ln_1", NORM_NAMES[norm], norm_shapes), ("attn", attn_names, attn_shapes),
             ("ln_2", NORM_NAMES[norm], norm_shapes), ("mlp", MLP_NAMES[mlp], mlp_shapes)]
    shapes = {f"{prefix}.{name}": shape for prefix, names, part_shapes in parts
              for name, shape in zip(names, part_shapes)}  # fmt: skip
    return shapes if bias else {name: s for name, s in shapes.items() if not name.endswith(".bias")}


BLOCK_PARAM_NAMES = tuple(block_param_shapes(1))  # GPT-2's block


# --- the parts: each returns (y, part), and part_backward(dy, part) -> (dx, grads by name) ------


def _run(forward, backward, prefix: str, names: tuple, x, p: dict, **hyperparams):
    """forward(x, p[prefix.name] for name in names, **hyperparams) -> (y, part)."""
    y, cache = forward(x, *(p.get(f"{prefix}.{name}") for name in names), **hyperparams)
    return y, (backward, prefix, names, cache)


def part_backward(dy, part):
    """dy -> (dx, {name: gradient}) of a part run by block_norm, block_attention or block_mlp;
    a missing bias has gradient None and is left out."""
    backward, prefix, names, cache = part
    dx, *grads = backward(dy, cache)
    return dx, {f"{prefix}.{name}": g for name, g in zip(names, grads) if g is not None}


def block_norm(x, p, name: str, opts: dict):
    """The norm ``name`` (ln_1, ln_2, or ln_f with the model's params): opts["norm"], "eps"."""
    if opts["norm"] == "rmsnorm":
        return _run(rmsnorm_forward, rmsnorm_backward, name, NORM_NAMES["rmsnorm"], x, p,
                    eps=opts["eps"])  # fmt: skip
    return _run(layernorm_forward, layernorm_backward, name, NORM_NAMES["layernorm"], x, p,
                eps=opts["eps"])  # fmt: skip


def block_attention(x, p, opts: dict):
    """GPT-2's attention (opts["n_kv_head"] None) or LLaMA's, with RoPE when opts["rope_base"]
    (pairing opts["rope_pairing"], at opts["positions"] when given); keys hidden by opts["mask"]."""
    if opts["n_kv_head"] is None:
        return _run(attention_forward, attention_backward, "attn", GPT2_ATTN_NAMES, x, p,
                    n_head=opts["n_head"], mask=opts["mask"])  # fmt: skip
    rotate = None
    if opts["rope_base"] is not None:
        positions = opts["positions"]
        if positions is not None:  # (..., T) -> (..., 1, T), the same for every head
            positions = array_namespace(positions).expand_dims(positions, axis=-2)
        rotate = (functools.partial(rope_forward, base=opts["rope_base"], positions=positions,
                                    pairing=opts["rope_pairing"]), rope_backward)  # fmt: skip
    return _run(gqa_attention_forward, gqa_attention_backward, "attn", GROUPED_ATTN_NAMES, x, p,
                n_head=opts["n_head"], n_kv_head=opts["n_kv_head"], rotate=rotate,
                mask=opts["mask"])  # fmt: skip


def block_mlp(x, p, opts: dict):
    """The MLP of kind opts["mlp"]: GPT-2's GELU MLP (opts["gelu"]), LLaMA's SwiGLU, or a
    mixture of GELU experts with moe_forward's keywords opts["moe"], whose y is a pair (y, aux)."""
    if opts["mlp"] == "swiglu":
        return _run(swiglu_forward, swiglu_backward, "mlp", MLP_NAMES["swiglu"], x, p)
    if opts["mlp"] == "moe":
        return _run(moe_forward, moe_backward, "mlp", MLP_NAMES["moe"], x, p,
                    approximate=opts["gelu"], **(opts["moe"] or {}))  # fmt: skip
    return _run(mlp_forward, mlp_backward, "mlp", MLP_NAMES["gelu"], x, p,
                approximate=opts["gelu"])  # fmt: skip


def _mlp(x, p, opts: dict):
    """block_mlp with a MoE's pair taken apart: (y, aux (a MoE's) or None, part)."""
    y, part = block_mlp(x, p, opts)
    return (*y, part) if opts["mlp"] == "moe" else (y, None, part)


def _with_aux(dm, daux):
    """What the MLP's backward takes: dm, or a MoE's pair (dm, daux)."""
    return dm if daux is None else (dm, daux)


def _drop(x, opts, offset):
    """Residual dropout on a branch output; the identity when dropout is off."""
    if opts["dropout"] == 0.0 or opts["seed"] is None:
        return x, None
    return dropout_forward(x, p=opts["dropout"], seed=opts["seed"] + offset)


def _drop_back(dy, cache):
    return dy if cache is None else dropout_backward(dy, cache)[0]


def _check_options(p: dict, opts: dict) -> None:
    """ValueError for unknown kinds and for parameters the chosen parts need but p lacks."""
    choices = {"ln_order": ("pre", "post"), "norm": tuple(NORM_NAMES), "mlp": tuple(MLP_NAMES)}
    for name, allowed in choices.items():
        if opts[name] not in allowed:
            allowed_text = " or ".join(map(repr, allowed))
            raise ValueError(f"{name} must be {allowed_text}, got {opts[name]!r}")
    if opts["rope_base"] is not None and opts["n_kv_head"] is None:
        raise ValueError("rope_base needs LLaMA's attention (q_proj, k_proj: RoPE turns q and k "
                         "after their projections): give n_kv_head too")  # fmt: skip
    if opts["positions"] is not None and opts["rope_base"] is None:
        raise ValueError("positions are what RoPE turns q and k by: give rope_base too (a block "
                         "without RoPE has no positions; a model adds them to the embeddings)")
    expected = block_param_shapes(1, bias=any(name.endswith(".bias") for name in p),
                                  n_kv_head=None if opts["n_kv_head"] is None else 1,
                                  norm=opts["norm"], mlp=opts["mlp"], n_expert=1)  # fmt: skip
    missing = [name for name in expected if name not in p]
    if missing:
        raise ValueError(f"block parameters missing: {missing}")


def block_forward(x, p, *, n_head: int, ln_order: str = "pre", gelu: str = "tanh",
                  eps: float = 1e-5, dropout: float = 0.0, seed: int | None = None,
                  norm: str = "layernorm", mlp: str = "gelu", n_kv_head: int | None = None,
                  rope_base: float | None = None, rope_pairing: str = "rotate_half",
                  moe: dict | None = None, mask=None, positions=None):  # fmt: skip
    """x (B, T, C), p dict of the block's parameters (``block_param_shapes``) -> y (B, T, C),
    or (y, aux) with mlp="moe" (``moe``: the keywords k, capacity_factor, aux_weight of
    moe_forward). Any leading dims (..., T, C); ``mask`` (..., T, T) bool and ``positions``
    (..., T) int for packed documents (see the module's docstring)."""
    opts = dict(n_head=n_head, ln_order=ln_order, gelu=gelu, eps=eps, dropout=dropout, seed=seed,
                norm=norm, mlp=mlp, n_kv_head=n_kv_head, rope_base=rope_base,
                rope_pairing=rope_pairing, moe=moe, mask=mask, positions=positions)
    _check_options(p, opts)
    c = {"moe": mlp == "moe"}
    if ln_order == "pre":
        h1, c["ln_1"] = block_norm(x, p, "ln_1", opts)  # (B, T, C)
        a, c["attn"] = block_attention(h1, p, opts)  # (B, T, C)
        a, c["drop_1"] = _drop(a, opts, 0)  # (B, T, C)
        x1 = x + a  # (B, T, C)
        h2, c["ln_2"] = block_norm(x1, p, "ln_2", opts)  # (B, T, C)
        m, aux, c["mlp"] = _mlp(h2, p, opts)  # (B, T, C), aux () a MoE's load-balancing loss
        m, c["drop_2"] = _drop(m, opts, 1)  # (B, T, C)
        y = x1 + m  # (B, T, C)
    else:
        a, c["attn"] = block_attention(x, p, opts)  # (B, T, C)
        a, c["drop_1"] = _drop(a, opts, 0)  # (B, T, C)
        x1, c["ln_1"] = block_norm(x + a, p, "ln_1", opts)  # (B, T, C)
        m, aux, c["mlp"] = _mlp(x1, p, opts)  # (B, T, C), aux () a MoE's load-balancing loss
        m, c["drop_2"] = _drop(m, opts, 1)  # (B, T, C)
        y, c["ln_2"] = block_norm(x1 + m, p, "ln_2", opts)  # (B, T, C)
    return ((y, aux) if c["moe"] else y), (ln_order, c)


def block_backward(dout, cache):
    """dout: dy (B, T, C), or (dy, daux) for a MoE block -> (dx (B, T, C), dp with p's keys)."""
    ln_order, c = cache
    dy, daux = dout if c["moe"] else (dout, None)
    if ln_order == "pre":
        # y = x1 + m: the residual passes dy to x1 unchanged, and dy goes into the branch
        dm = _drop_back(dy, c["drop_2"])  # (B, T, C)
        dh2, dmlp = part_backward(_with_aux(dm, daux), c["mlp"])  # (B, T, C)
        # h2 = LN2(x1)
        dx1_ln, dln2 = part_backward(dh2, c["ln_2"])  # (B, T, C)
        dx1 = dy + dx1_ln  # (B, T, C)
        # x1 = x + a
        da = _drop_back(dx1, c["drop_1"])  # (B, T, C)
        dh1, dattn = part_backward(da, c["attn"])  # (B, T, C)
        # h1 = LN1(x)
        dx_ln, dln1 = part_backward(dh1, c["ln_1"])  # (B, T, C)
        dx = dx1 + dx_ln  # (B, T, C)
    else:
        # y = LN2(x1 + m)
        dsum2, dln2 = part_backward(dy, c["ln_2"])  # (B, T, C)
        dm = _drop_back(dsum2, c["drop_2"])  # (B, T, C)
        dx1_mlp, dmlp = part_backward(_with_aux(dm, daux), c["mlp"])  # (B, T, C)
        dx1 = dsum2 + dx1_mlp  # (B, T, C)
        # x1 = LN1(x + a)
        dsum1, dln1 = part_backward(dx1, c["ln_1"])  # (B, T, C)
        da = _drop_back(dsum1, c["drop_1"])  # (B, T, C)
        dx_attn, dattn = part_backward(da, c["attn"])  # (B, T, C)
        dx = dsum1 + dx_attn  # (B, T, C)
    return dx, {**dln1, **dattn, **dln2, **dmlp}
