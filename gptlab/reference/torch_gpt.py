"""The oracle: the same GPT written independently with plain torch ops, differentiated by autograd.

It reads the same flat params dict (GPT-2 names, (in, out) layout) and ``GPTConfig`` as
``gptlab.gpt_forward`` but shares no code with ``gptlab.layers``: LayerNorm, GELU and
cross-entropy come from ``torch.nn.functional``, attention is written out with ``masked_fill``,
and the sinusoidal table is built here. Dropout is not modelled (evaluation mode only).

The LLaMA-style parts are written the same way: RMSNorm is ``F.rms_norm``, SwiGLU
``F.silu(x @ w_gate) * (x @ w_up)``, grouped-query attention repeats each key/value head for its
query heads (``repeat_interleave``, as Hugging Face's ``repeat_kv``), and rotary embeddings
multiply complex numbers: the pair (x[i], x[i + hs/2]) is x[i] + i x[i + hs/2], turned by
exp(i t theta_i) (``rotary``), where the package rotates real pairs (Meta's "adjacent" pairing
reads the pair (x[2i], x[2i + 1]) instead). A mixture of experts runs
every expert on every token and weighs the outputs by gates that are zero where a token did not
choose the expert or found it full (``_experts``), where the package gathers each expert's tokens.

Packed documents: ``documents`` (B, T) hides every key of another document (``masked_fill``
with the document ids compared), and the positions count the earlier tokens of the same
document, unless ``positions`` (B, T) gives them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..config import GPTConfig

__all__ = ["reference_forward", "sinusoidal_table", "rotary", "relative_error"]


def sinusoidal_table(T: int, C: int, *, dtype, device=None, positions=None) -> torch.Tensor:
    """(T, C): PE[t, 2i] = sin(t / 10000^(2i/C)), PE[t, 2i+1] = cos(t / 10000^(2i/C)); with
    ``positions`` (..., T), the rows at those positions (..., T, C)."""
    if positions is None:
        positions = torch.arange(T, device=device)  # (T,)
    position = positions.to(dtype)[..., None]  # (..., T, 1)
    inv_freq = 10000.0 ** (-torch.arange(0, C, 2, dtype=dtype, device=device) / C)  # (C/2,)
    table = torch.zeros(*positions.shape, C, dtype=dtype, device=device)  # (..., T, C)
    table[..., 0::2] = torch.sin(position * inv_freq)
    table[..., 1::2] = torch.cos(position * inv_freq)
    return table


def rotary(x, base: float = 10000.0, positions=None, pairing: str = "rotate_half") -> torch.Tensor:
    """x (..., T, hs) with position t in row t (or positions[..., t], (..., T)) -> each pair
    (x[i], x[i + hs/2]) ("adjacent": (x[2i], x[2i + 1])), read as the complex number
    z = x[i] + i x[i + hs/2], multiplied by exp(i t theta_i), theta_i = base^(-2i / hs)."""
    T, hs = x.shape[-2], x.shape[-1]
    if positions is None:
        positions = torch.arange(T, device=x.device)  # (T,)
    theta = base ** (-torch.arange(0, hs, 2, dtype=x.dtype, device=x.device) / hs)  # (hs/2,)
    angle = positions.to(x.dtype)[..., None] * theta  # (..., T, hs/2)
    turn = torch.polar(torch.ones_like(angle), angle)  # (..., T, hs/2) exp(i t theta_i)
    if pairing == "adjacent":
        z = torch.view_as_complex(x.reshape(*x.shape[:-1], hs // 2, 2).contiguous()) * turn
        return torch.view_as_real(z).reshape(x.shape)  # (..., T, hs) pairs interleaved
    z = torch.complex(x[..., : hs // 2], x[..., hs // 2 :]) * turn  # (..., T, hs/2)
    return torch.cat([z.real, z.imag], dim=-1)  # (..., T, hs)


def _affine(x, p: dict, prefix: str):
    """x @ w + b, or x @ w when the model has no biases."""
    y = x @ p[prefix + "weight"]
    bias = p.get(prefix + "bias")
    return y if bias is None else y + bias


def _causal(q, k, v, documents=None):
    """q, k, v (B, NH, T, hs) -> the heads merged (B, T, NH*hs), each query seeing keys <= it
    (and, with ``documents`` (B, T), only those of its own document)."""
    B, NH, T, hs = q.shape
    scores = q @ k.transpose(-2, -1) / math.sqrt(hs)  # (B, NH, T, T)
    hidden = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)  # (T, T) the future
    if documents is not None:
        other = documents[:, None, :, None] != documents[:, None, None, :]  # (B, 1, T, T)
        hidden = hidden | other  # (B, 1, T, T)
    att = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)  # (B, NH, T, T)
    return (att @ v).transpose(1, 2).reshape(B, T, NH * hs)  # (B, T, NH*hs)


def _attention(x, p: dict, prefix: str, n_head: int, documents=None):
    """GPT-2's causal self-attention, x (B, T, C) -> (B, T, C)."""
    B, T, C = x.shape
    hs = C // n_head
    qkv = _affine(x, p, prefix + "c_attn.")  # (B, T, 3C)
    q, k, v = qkv.split(C, dim=-1)  # (B, T, C) each
    q, k, v = (t.view(B, T, n_head, hs).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
    return _affine(_causal(q, k, v, documents), p, prefix + "c_proj.")  # (B, T, C)


def _grouped_attention(x, p: dict, prefix: str, cfg: GPTConfig, positions=None, documents=None):
    """LLaMA's attention: x (B, T, C) -> (B, T, C), kv_heads key/value heads, RoPE if asked."""
    B, T, C = x.shape
    NH, NKV, hs = cfg.n_head, cfg.kv_heads, cfg.head_size
    q = (x @ p[prefix + "q_proj.weight"]).view(B, T, NH, hs).transpose(1, 2)  # (B, NH, T, hs)
    k = (x @ p[prefix + "k_proj.weight"]).view(B, T, NKV, hs).transpose(1, 2)  # (B, NKV, T, hs)
    v = (x @ p[prefix + "v_proj.weight"]).view(B, T, NKV, hs).transpose(1, 2)  # (B, NKV, T, hs)
    if cfg.position == "rope":
        pos = None if positions is None else positions[:, None, :]  # (B, 1, T) every head
        q = rotary(q, cfg.rope_base, pos, cfg.rope_pairing)  # (B, NH, T, hs)
        k = rotary(k, cfg.rope_base, pos, cfg.rope_pairing)  # (B, NKV, T, hs)
    k = k.repeat_interleave(NH // NKV, dim=1)  # (B, NH, T, hs): query head h reads k[h // G]
    v = v.repeat_interleave(NH // NKV, dim=1)  # (B, NH, T, hs)
    return _causal(q, k, v, documents) @ p[prefix + "o_proj.weight"]  # (B, T, C)


def _experts(x, p: dict, prefix: str, cfg: GPTConfig):
    """A mixture of GELU experts, x (B, T, C) -> (y (B, T, C), load-balancing loss ())."""
    B, T, C = x.shape
    xs = x.reshape(B * T, C)  # (N, C), tokens in order
    N, E, k = B * T, cfg.n_expert, cfg.expert_top_k
    logits = xs @ p[prefix + "router.weight"]  # (N, E)
    probs = logits.softmax(dim=-1)  # (N, E)
    chosen = F.one_hot(logits.topk(k, dim=-1).indices, E).sum(dim=1).bool()  # (N, E)
    gates = torch.where(chosen, probs, 0.0)  # (N, E)
    gates = gates / gates.sum(dim=-1, keepdim=True)  # (N, E) renormalized over the k chosen
    if cfg.capacity_factor is not None:  # an expert takes the first tokens that chose it
        capacity = math.ceil(cfg.capacity_factor * N * k / E)
        gates = torch.where(chosen.long().cumsum(dim=0) <= capacity, gates, 0.0)  # (N, E)
    y = torch.zeros_like(xs)  # (N, C)
    for e in range(E):
        w_fc, b_fc = p[prefix + "experts.c_fc.weight"][e], p[prefix + "experts.c_fc.bias"][e]
        w_proj, b_proj = p[prefix + "experts.c_proj.weight"][e], p[prefix + "experts.c_proj.bias"][e]
        h = F.gelu(xs @ w_fc + b_fc, approximate=cfg.gelu_approximate) @ w_proj + b_proj  # (N, C)
        y = y + gates[:, e : e + 1] * h  # (N, C)
    share = chosen.sum(dim=0).to(probs.dtype) / (N * k)  # (E,) of the choices, before capacity
    aux = cfg.aux_loss_weight * E * (share * probs.mean(dim=0)).sum()  # ()
    return y.reshape(B, T, C), aux


def _mlp(x, p: dict, prefix: str, cfg: GPTConfig):
    """GPT-2's GELU MLP or LLaMA's SwiGLU, x (B, T, C) -> (B, T, C)."""
    if cfg.mlp == "swiglu":
        gate = F.silu(x @ p[prefix + "gate_proj.weight"])  # (B, T, H)
        return (gate * (x @ p[prefix + "up_proj.weight"])) @ p[prefix + "down_proj.weight"]
    h = F.gelu(_affine(x, p, prefix + "c_fc."), approximate=cfg.gelu_approximate)  # (B, T, H)
    return _affine(h, p, prefix + "c_proj.")  # (B, T, C)


def reference_forward(params: dict, idx, cfg: GPTConfig, targets=None, *, training: bool = False,
                      positions=None, documents=None):
    """idx (B, T) -> (logits (B, T, V), loss () or None), differentiable by torch autograd.
    ``documents`` (B, T): packed documents; ``positions`` (B, T): each token's position."""
    if training and cfg.dropout > 0.0:
        raise ValueError("the reference model has no dropout: use it with cfg.dropout == 0 or "
                         "in evaluation mode (training=False)")
    B, T = idx.shape
    C = cfg.n_embd
    eps = cfg.layer_norm_epsilon
    if documents is not None and positions is None:  # the earlier tokens of the same document
        same = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
        earlier = torch.ones(T, T, dtype=torch.bool, device=idx.device).tril()  # (T, T)
        positions = (same & earlier).sum(dim=-1) - 1  # (B, T)

    def ln(x, name):
        if cfg.norm == "rmsnorm":
            return F.rms_norm(x, (C,), params[name + ".weight"], eps)
        return F.layer_norm(x, (C,), params[name + ".weight"], params.get(name + ".bias"), eps)

    def attention(x, prefix):
        if cfg.grouped_attention:
            return _grouped_attention(x, params, prefix, cfg, positions, documents)
        return _attention(x, params, prefix, cfg.n_head, documents)

    wte = params["wte.weight"]
    x = wte[idx]  # (B, T, C)
    if cfg.position == "learned":
        wpe = params["wpe.weight"]
        x = x + (wpe[:T] if positions is None else wpe[positions])  # (B, T, C)
    elif cfg.position == "sinusoidal":
        x = x + sinusoidal_table(T, C, dtype=wte.dtype, device=wte.device,
                                 positions=positions)  # (B, T, C)
    aux_losses = []

    def mlp(x, prefix):
        if cfg.mlp != "moe":
            return _mlp(x, params, prefix, cfg)
        y, aux = _experts(x, params, prefix, cfg)
        aux_losses.append(aux)
        return y

    for layer in range(cfg.n_layer):
        h = f"h.{layer}."
        if cfg.ln_order == "pre":
            x = x + attention(ln(x, h + "ln_1"), h + "attn.")  # (B, T, C)
            x = x + mlp(ln(x, h + "ln_2"), h + "mlp.")  # (B, T, C)
        else:
            x = ln(x + attention(x, h + "attn."), h + "ln_1")  # (B, T, C)
            x = ln(x + mlp(x, h + "mlp."), h + "ln_2")  # (B, T, C)
    head = wte.T if cfg.tie_embeddings else params["lm_head.weight"]  # (C, V)
    logits = ln(x, "ln_f") @ head  # (B, T, V)
    loss = None
    if targets is not None:
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))  # ()
        loss = loss + sum(aux_losses)  # () the experts' load-balancing losses, if any
    return logits, loss


def relative_error(a, b) -> float:
    """max |a - b| / max |b| (0 when both are 0): the yardstick of the model tests."""
    a = torch.as_tensor(a).detach().cpu().double()
    b = torch.as_tensor(b).detach().cpu().double()
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff
