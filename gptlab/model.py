"""The whole GPT: embeddings, a stack of blocks, a final LayerNorm and a tied output head.

    x0 = wte[idx] + wpe[0..T-1]                  (B, T, C)   (or + the sinusoidal encoding)
    x_l = block_l(x_{l-1})                       l = 1 .. n_layer
    logits = LN_f(x_L) @ wte^T                   (B, T, V)   the head reuses the token embedding
    loss = cross_entropy(logits, targets)

Parameters are a flat dict with GPT-2's checkpoint names and (in, out) weight layout, so a
Hugging Face GPT-2 state dict maps onto it by renaming alone (see ``gptlab.interop``).

Packed documents (several short documents in one row, Brown et al. 2020, Appendix B) are an
input of their own: ``documents`` (B, T) says which document each token belongs to. Attention
then never crosses documents (``same_document_mask``, the block-diagonal causal mask) and
positions restart at 0 with every document (``positions_in_documents``), so each document gets
the logits it would get alone. ``positions`` (B, T) sets the position of every token directly
(wpe[positions], the sinusoidal encoding or RoPE at those positions).

A LLaMA-style config (``GPTConfig.llama``) changes the parts, not the plan: no position is added
(RoPE turns q and k inside every attention), the blocks and LN_f use RMSNorm, SwiGLU and
grouped-query attention (``layers/block.py``), and the head is its own matrix,
logits = RMSNorm_f(x_L) @ lm_head (C, V). With mixture-of-experts MLPs (mlp="moe") every block
also returns its load-balancing loss aux_l, and loss = cross_entropy + sum_l aux_l.

Book: chapter 4 (forward) and chapter 9 (backward).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .backend import array_device, array_namespace, convert
from .checks import require_float, require_ids_in_range, require_int, require_shape
from .config import GPTConfig
from .layers.block import (
    block_backward,
    block_forward,
    block_norm,
    block_param_shapes,
    part_backward,
)
from .layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from .layers.dropout import dropout_backward, dropout_forward
from .layers.embedding import embedding_backward, embedding_forward
from .layers.position_learned import position_learned_backward, position_learned_forward
from .layers.position_sinusoidal import (
    position_sinusoidal_backward,
    position_sinusoidal_forward,
)


def param_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name (GPT-2's, and LLaMA's part names) and shape, in checkpoint order."""
    C, V = cfg.n_embd, cfg.vocab_size
    shapes = {"wte.weight": (V, C)}
    if cfg.position == "learned":
        shapes["wpe.weight"] = (cfg.block_size, C)
    block = block_param_shapes(C, bias=cfg.bias, **_block_sizes(cfg))
    for layer in range(cfg.n_layer):
        shapes.update({f"h.{layer}.{name}": shape for name, shape in block.items()})
    shapes["ln_f.weight"] = (C,)
    if cfg.bias and cfg.norm == "layernorm":
        shapes["ln_f.bias"] = (C,)
    if not cfg.tie_embeddings:
        shapes["lm_head.weight"] = (C, V)
    return shapes


def _block_sizes(cfg: GPTConfig) -> dict:
    """The keywords of ``block_param_shapes`` besides C and bias."""
    return dict(n_head=cfg.n_head, n_kv_head=cfg.kv_heads if cfg.grouped_attention else None,
                norm=cfg.norm, mlp=cfg.mlp, hidden=cfg.mlp_hidden_size, n_expert=cfg.n_expert)


def block_options(cfg: GPTConfig) -> dict:
    """The keywords of ``block_forward`` (all but the dropout seed) for the blocks of ``cfg``."""
    return dict(n_head=cfg.n_head, ln_order=cfg.ln_order, gelu=cfg.gelu_approximate,
                eps=cfg.layer_norm_epsilon, dropout=cfg.dropout, norm=cfg.norm, mlp=cfg.mlp,
                n_kv_head=cfg.kv_heads if cfg.grouped_attention else None,
                rope_base=cfg.rope_base if cfg.position == "rope" else None,
                rope_pairing=cfg.rope_pairing,
                moe=None if cfg.mlp != "moe" else dict(k=cfg.expert_top_k,
                                                       capacity_factor=cfg.capacity_factor,
                                                       aux_weight=cfg.aux_loss_weight))


def head_weight(params: dict, cfg: GPTConfig):
    """The output head (C, V): wte^T when tied (GPT-2), else lm_head.weight (LLaMA)."""
    return params["wte.weight"].mT if cfg.tie_embeddings else params["lm_head.weight"]


def count_params(cfg: GPTConfig) -> int:
    """The number of parameters (the tied head counted once, as GPT-2 and GPT-3 report it)."""
    return sum(math.prod(shape) for shape in param_shapes(cfg).values())


RESIDUAL_PROJECTIONS = ("attn.c_proj.weight", "mlp.c_proj.weight", "attn.o_proj.weight",
                        "mlp.down_proj.weight", "mlp.experts.c_proj.weight")  # write the residual


def init_params(cfg: GPTConfig, seed: int = 0, backend: str = "numpy", dtype="float32",
                device=None) -> dict:
    """A fresh flat dict of parameters, initialised as nanoGPT does after GPT-2.

    Weights and both embedding tables ~ N(0, 0.02) (OpenAI's GPT-2 release drew wpe with 0.01),
    the two residual projections of every block (c_proj, LLaMA's o_proj and down_proj, the
    experts' c_proj) scaled
    by 1/sqrt(2 n_layer) (GPT-2), biases 0, LayerNorm and RMSNorm gains 1, an untied lm_head
    ~ N(0, 0.02). The numbers are drawn in float64 by
    NumPy from ``seed`` and then converted, so every backend, dtype and device starts from the
    same model.
    """
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            value = np.ones(shape)
        elif name.endswith(".bias"):
            value = np.zeros(shape)
        else:
            std = 0.02
            if name.endswith(RESIDUAL_PROJECTIONS):
                std = 0.02 / math.sqrt(2 * cfg.n_layer)
            value = rng.normal(0.0, std, size=shape)
        params[name] = convert(value, backend, dtype=dtype, device=device)
    return params


def block_params(params: dict, layer: int) -> dict:
    """The parameters of block ``layer`` with the ``h.{layer}.`` prefix removed."""
    prefix = f"h.{layer}."
    return {name.removeprefix(prefix): value for name, value in params.items()
            if name.startswith(prefix)}


def check_params(params: dict, cfg: GPTConfig) -> None:
    """Raise a clear error if ``params`` does not fit ``cfg`` (names, shapes, float dtypes)."""
    expected = param_shapes(cfg)
    missing = sorted(set(expected) - set(params))
    extra = sorted(set(params) - set(expected))
    if missing or extra:
        raise ValueError(f"parameters do not match the config: missing {missing}, unexpected {extra}")
    dtype = params["wte.weight"].dtype
    for name, shape in expected.items():
        require_float(name, params[name])
        if tuple(params[name].shape) != shape:
            raise ValueError(f"{name} has shape {tuple(params[name].shape)}, expected {shape}")
        if params[name].dtype != dtype:
            raise TypeError(f"{name} has dtype {params[name].dtype}, but wte.weight has {dtype}")


def check_idx(idx, cfg: GPTConfig, name: str = "idx") -> None:
    require_int(name, idx)
    if len(idx.shape) != 2:
        raise ValueError(f"{name} must have shape (B, T), got {tuple(idx.shape)}")
    if idx.shape[0] == 0 or idx.shape[1] == 0:
        raise ValueError(f"{name} must hold at least one token, got shape {tuple(idx.shape)}")
    if idx.shape[1] > cfg.block_size:
        raise ValueError(
            f"sequence length {idx.shape[1]} is longer than the context (block_size={cfg.block_size})"
        )
    require_ids_in_range(name, idx, cfg.vocab_size)


def gpt_forward(params: dict, idx, cfg: GPTConfig, targets=None, *, dropout_seed: int | None = None,
                recompute: bool = False, positions=None, documents=None):
    """idx (B, T) token ids -> (logits (B, T, V), loss or None, cache).

    ``targets`` (B, T) gives the mean next-token cross-entropy, plus the blocks' load-balancing
    losses in a model with experts (their sum is ``cache["aux_loss"]``). Dropout
    (``cfg.dropout``) is applied only when ``dropout_seed`` is given: a training step passes a
    fresh seed, evaluation passes none.

    ``recompute`` (activation recomputation, gradient checkpointing): the cache keeps only each
    block's input (B, T, C), and the backward runs the block's forward again from it
    (``backward_parts``): n_layer * B*T*C numbers instead of every block's activations.

    ``documents`` (B, T) int: packed documents, no attention across them and positions that
    restart with each (unless ``positions`` (B, T) int gives every token's position). Experts
    with a ``capacity_factor`` still share their capacity across the whole batch.
    """
    check_params(params, cfg)
    check_idx(idx, cfg)
    if targets is not None:
        check_idx(targets, cfg, "targets")
        if tuple(targets.shape) != tuple(idx.shape):
            raise ValueError(f"targets has shape {tuple(targets.shape)}, idx has {tuple(idx.shape)}")
    mask, positions = packed_inputs(idx, cfg, positions, documents)  # (B, T, T), (B, T) or None
    training = cfg.dropout > 0.0 and dropout_seed is not None
    cache = {"cfg": cfg, "training": training, "recompute": recompute, "mask": mask,
             "positions": positions}
    seed = dropout_seed if training else None
    if recompute:  # what the backward needs to run the blocks again
        cache["params"], cache["dropout_seed"] = params, seed
    x = embed_forward(params, idx, cfg, cache, seed, positions)  # (B, T, C)
    cache["blocks"], aux_losses = [], []
    for layer in range(cfg.n_layer):
        p = block_params(params, layer)
        y, aux, block_cache = layer_forward(x, p, cfg, layer, seed, mask, positions)  # (B,T,C)
        aux_losses.append(aux)
        cache["blocks"].append(x if recompute else block_cache)  # recompute: the input only
        x = y
    logits, loss = head_forward(params, x, cfg, cache, targets, aux_losses)  # (B, T, V)
    return logits, loss, cache


def packed_inputs(idx, cfg: GPTConfig, positions=None, documents=None):
    """Check ``positions`` and ``documents`` (each (B, T) int or None) against idx (B, T) ->
    (mask (B, T, T) bool or None, positions (B, T) or None): the mask of ``documents``, and
    their positions within each document when ``positions`` is not given."""
    mask = None
    if documents is not None:
        require_int("documents", documents)
        require_shape("documents", documents, tuple(idx.shape))
        mask = same_document_mask(documents)  # (B, T, T)
        if positions is None:
            positions = positions_in_documents(mask)  # (B, T)
    elif positions is not None:
        require_int("positions", positions)
        require_shape("positions", positions, tuple(idx.shape))
    if positions is not None and math.prod(positions.shape) > 0:
        xp = array_namespace(positions)
        low, high = int(xp.min(positions)), int(xp.max(positions))
        if low < 0 or high >= cfg.block_size:
            raise ValueError(f"positions must lie in [0, block_size={cfg.block_size}), got "
                             f"{low} .. {high}")  # fmt: skip
    return mask, positions


def same_document_mask(documents):
    """documents (B, T) int, the document of each token -> (B, T, T) bool, True where query t may
    see key i: i <= t and the same document (the block-diagonal causal mask)."""
    xp = array_namespace(documents)
    T = documents.shape[-1]
    t = xp.arange(T, device=array_device(documents))  # (T,)
    causal = t[None, :] <= t[:, None]  # (T, T) key i <= query t
    same = documents[..., :, None] == documents[..., None, :]  # (B, T, T)
    return xp.logical_and(same, causal)  # (B, T, T)


def positions_in_documents(mask):
    """mask (B, T, T) of ``same_document_mask`` -> positions (B, T): how many earlier tokens of
    its own document each token sees, i.e. 0 at every document's first token, then 1, 2, ..."""
    xp = array_namespace(mask)
    return xp.sum(xp.astype(mask, xp.int64), axis=-1) - 1  # (B, T)


def embed_forward(params: dict, idx, cfg: GPTConfig, cache: dict, dropout_seed=None,
                  positions=None):
    """x0 = wte[idx] + position (B, T, C), dropped out when ``dropout_seed`` is given (then
    ``cache["training"]`` must be True); the backward's state goes into ``cache``. ``positions``
    (B, T): each token's position (None: 0 .. T-1); learned ones are then the embedding lookup
    wpe[positions]."""
    tok, cache["wte"] = embedding_forward(idx, params["wte.weight"])  # (B, T, C)
    if cfg.position == "learned" and positions is not None:
        pos, cache["wpe"] = embedding_forward(positions, params["wpe.weight"])  # (B, T, C)
        x = tok + pos  # (B, T, C)
    elif cfg.position == "learned":
        x, cache["wpe"] = position_learned_forward(tok, params["wpe.weight"])  # (B, T, C)
    elif cfg.position == "sinusoidal":
        x, cache["wpe"] = position_sinusoidal_forward(tok, positions=positions)  # (B, T, C)
    else:
        x = tok  # (B, T, C) rope: the positions turn q and k inside every attention
    if dropout_seed is not None:
        x, cache["drop"] = dropout_forward(x, p=cfg.dropout, seed=dropout_seed)  # (B, T, C)
    return x


def layer_forward(x, p: dict, cfg: GPTConfig, layer: int, dropout_seed=None, mask=None,
                  positions=None):
    """Block ``layer`` with its parameters ``p`` (``block_params``): x (B, T, C) ->
    (y (B, T, C), aux (a MoE block's load-balancing loss) or None, the block's cache).
    ``mask`` (B, T, T) and ``positions`` (B, T): packed documents (see ``packed_inputs``)."""
    seed = None if dropout_seed is None else dropout_seed + 2 * (layer + 1)
    rope = cfg.position == "rope"
    y, block_cache = block_forward(x, p, **block_options(cfg), seed=seed, mask=mask,
                                   positions=positions if rope else None)  # (B, T, C)
    if cfg.mlp == "moe":
        return (*y, block_cache)  # a block of experts returns its load-balancing loss too
    return y, None, block_cache


def head_forward(params: dict, x, cfg: GPTConfig, cache: dict, targets=None, aux_losses=()):
    """x_L (B, T, C) -> (logits (B, T, V), loss or None): LN_f, the head, the cross-entropy plus
    the blocks' load-balancing losses ``aux_losses`` (None entries are skipped)."""
    xf, cache["ln_f"] = block_norm(x, params, "ln_f", block_options(cfg))  # (B, T, C)
    head = head_weight(params, cfg)  # (C, V), GPT-2's is wte^T
    logits = xf @ head  # (B, T, V)
    cache["xf"], cache["head"] = xf, head
    if cfg.tie_embeddings:
        cache["wte.weight"] = params["wte.weight"]
    loss = None
    if targets is not None:
        loss, cache["loss"] = cross_entropy_forward(logits, targets)  # ()
        aux_losses = [aux for aux in aux_losses if aux is not None]
        if aux_losses:
            cache["aux_loss"] = sum(aux_losses)  # ()
            loss = loss + cache["aux_loss"]  # ()
    return logits, loss


def gpt_backward(cache, dlogits=None, dxf=None) -> dict:
    """Gradients of the loss (or of sum(logits * dlogits) + sum(xf * dxf)) for every parameter.

    Without ``dlogits`` and ``dxf`` the forward must have been given targets: the backward starts
    from dloss = 1 (which reaches every block's load-balancing loss too, daux = 1). ``dxf``
    (B, T, C) is the gradient arriving at the final hidden states ``cache["xf"]`` from a head of
    the caller's own (a reward or value head); alone, it stands for dlogits = 0.
    """
    grads = {}
    for part in backward_parts(cache, dlogits, dxf):
        grads.update(part)
    return {name: grads[name] for name in param_shapes(cache["cfg"])}


def backward_parts(cache: dict, dlogits=None, dxf=None, block_cache=None):
    """gpt_backward one part at a time: yields the final gradients of LN_f (and lm_head), then
    of each block from the last to the first, then of the embeddings (wte with the tied head's
    share). A data-parallel step sends each part's gradients off as soon as it is yielded.
    ``dlogits`` and ``dxf`` as in ``gpt_backward``.

    ``block_cache(layer)``: the cache of block ``layer`` (default ``cache["blocks"][layer]``, or
    after a ``recompute`` forward the block's forward run again from its kept input,
    ``recompute_block``); ZeRO 3 passes one that gathers the block's weights and runs its
    forward again.
    """
    cfg = cache["cfg"]
    if block_cache is None and cache.get("recompute"):
        block_cache = functools.partial(recompute_block, cache)
    # loss = cross_entropy + sum of the blocks' aux: daux = 1 only when starting from the loss
    daux = 1.0 if dlogits is None and dxf is None else 0.0
    if dlogits is None and dxf is not None:
        xp = array_namespace(dxf)
        dlogits = xp.zeros((*dxf.shape[:-1], cache["head"].shape[1]), dtype=dxf.dtype,
                           device=array_device(dxf))  # (B, T, V) no loss on the logits
    if dlogits is None:
        if "loss" not in cache:
            raise ValueError("gpt_backward needs the forward to have computed a loss (pass "
                             "targets to gpt_forward) or an explicit dlogits")
        (dlogits,) = cross_entropy_backward(1.0, cache["loss"])  # (B, T, V)
    xp = array_namespace(dlogits)
    grads = {}
    xf, head = cache["xf"], cache["head"]
    C, V = head.shape
    # logits = xf @ head
    dxf = dlogits @ head.mT if dxf is None else dlogits @ head.mT + dxf  # (B, T, C)
    if cfg.tie_embeddings:  # head = wte^T: the head's share of dwte, added at the end
        dwte_head = xp.reshape(dlogits, (-1, V)).mT @ xp.reshape(xf, (-1, C))  # (V, C)
    else:
        grads["lm_head.weight"] = xp.reshape(xf, (-1, C)).mT @ xp.reshape(dlogits, (-1, V))  # (C,V)
    # xf = LN_f(x)
    dx, dln_f = part_backward(dxf, cache["ln_f"])  # (B, T, C)
    grads.update(dln_f)
    yield grads
    del xf, head  # the head is done: ZeRO 3 frees its gathered weights now
    for layer in reversed(range(cfg.n_layer)):
        # x = block(x), or (x, aux) = block(x) with experts
        dout = (dx, daux) if cfg.mlp == "moe" else dx
        block = cache["blocks"][layer] if block_cache is None else block_cache(layer)
        dx, dblock = block_backward(dout, block)  # (B, T, C)
        yield {f"h.{layer}.{name}": g for name, g in dblock.items()}
    grads = {}
    if cache["training"]:
        (dx,) = dropout_backward(dx, cache["drop"])  # (B, T, C)
    # x = tok + position
    if cfg.position == "learned" and cache.get("positions") is not None:
        # x = tok + pos, pos = wpe[positions]
        dtok = dx  # (B, T, C)
        (grads["wpe.weight"],) = embedding_backward(dx, cache["wpe"])  # (block_size, C)
    elif cfg.position == "learned":
        dtok, grads["wpe.weight"] = position_learned_backward(dx, cache["wpe"])  # (B, T, C)
    elif cfg.position == "sinusoidal":
        (dtok,) = position_sinusoidal_backward(dx, cache["wpe"])  # (B, T, C)
    else:
        dtok = dx  # (B, T, C) rope: x = tok
    # tok = wte[idx]: the embedding's share of dwte; a tied matrix sums the grads of both uses
    (dwte_embed,) = embedding_backward(dtok, cache["wte"])  # (V, C)
    grads["wte.weight"] = dwte_embed + dwte_head if cfg.tie_embeddings else dwte_embed  # (V, C)
    yield grads


def recompute_block(cache: dict, layer: int):
    """The cache of block ``layer`` made again from the input a ``recompute`` forward kept, with
    the forward's parameters and dropout seed (so the same dropout masks)."""
    x = cache["blocks"][layer]  # (B, T, C) the block's input
    p = block_params(cache["params"], layer)
    return layer_forward(x, p, cache["cfg"], layer, cache["dropout_seed"], cache["mask"],
                         cache["positions"])[2]


def cache_bytes(cache, params: dict | None = None) -> int:
    """The bytes of the arrays a cache holds (nested tuples, lists, dicts), each memory buffer
    counted once (views of one array share it): what the forward keeps for the backward.
    The buffers of ``params`` are left out (the cache refers to the weights, it does not hold
    them)."""
    weights = _buffers(params or {}, {})
    return sum(size for key, size in _buffers(cache, {}).items() if key not in weights)


def _buffers(obj, found: dict) -> dict:
    """{a key of each memory buffer the arrays in ``obj`` use: its bytes}, added to ``found``."""
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        for value in obj:
            _buffers(value, found)
    elif hasattr(obj, "untyped_storage"):  # a torch tensor: its whole storage
        storage = obj.untyped_storage()
        found[storage.data_ptr()] = storage.nbytes()
    elif isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):  # a view: count the array it views
            obj = obj.base
        found[id(obj)] = obj.nbytes
    return found


def loss_and_grads(params: dict, idx, targets, cfg: GPTConfig, *, dropout_seed=None,
                   recompute: bool = False):
    """One forward and backward: (loss as a Python float, grads dict). ``recompute``: activation
    recomputation (see gpt_forward)."""
    _, loss, cache = gpt_forward(params, idx, cfg, targets, dropout_seed=dropout_seed,
                                 recompute=recompute)
    grads = gpt_backward(cache)
    return float(loss), grads


__all__ = [
    "GPTConfig", "param_shapes", "count_params", "init_params", "block_params", "block_options",
    "head_weight", "check_params", "gpt_forward", "gpt_backward", "loss_and_grads",
    "embed_forward", "layer_forward", "head_forward", "backward_parts", "recompute_block",
    "cache_bytes", "packed_inputs", "same_document_mask", "positions_in_documents",
]  # fmt: skip
