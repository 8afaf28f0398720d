"""Generating text: next-token distributions, sampling, and a KV cache for incremental decoding.

One step of generation turns the logits of the last position into a distribution and picks a
token from it:

    probs = softmax(logits / temperature)          temperature -> 0 gives argmax (greedy)
    top-k:  keep the k most likely tokens           (exactly k, ties broken by lower id)
    top-p:  keep the smallest set of most likely tokens whose probability sums to >= p
    next ~ probs (renormalised over the kept tokens)

A causal model never lets position t look at positions > t, so the keys and values of the past
do not change when a token is appended. The KV cache keeps them (per layer, (B, NH, T, hs)) and
each step runs the model on the NEW positions only: O(T) work per token instead of O(T^2).
With grouped-query attention it keeps the NKV key/value heads only, (B, NKV, T, hs), and with
rotary embeddings the new queries and keys are turned as positions Tp, Tp + 1, ... (Tp = the
cache length); the cached keys were turned when they were new. A mixture of experts generates
without its capacity limit: which tokens an expert drops depends on how many tokens are routed
together, which differs between cached and uncached decoding, so ``generate`` routes every token
to its experts.

Book: chapter 12, "Generation".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..backend import (
    array_namespace,
    asarray_like,
    make_generator,
    one_hot,
    sample_categorical,
    take_rows,
    to_numpy,
)
from ..checks import require_ids_in_range, require_int
from ..config import GPTConfig
from ..layers.attention import merge_heads, split_qkv
from ..layers.block import GROUPED_ATTN_NAMES, block_mlp, block_norm
from ..layers.gqa import gqa_attention_step
from ..layers.linear import linear_forward
from ..layers.position_sinusoidal import sinusoidal_encoding
from ..layers.rope import rope_forward
from ..layers.sdpa import sdpa_forward
from ..layers.softmax import softmax_forward
from ..model import block_options, block_params, check_params, gpt_forward, head_weight


@dataclass
class KVCache:
    """The keys and values of the positions decoded so far: k[l], v[l] (B, NKV, T, hs) per layer
    (NKV = NH, the number of heads, unless the model has grouped-query attention).

    An empty cache (``KVCache()``) starts a sequence; ``forward_step`` returns a new, longer one.
    """

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)

    @property
    def length(self) -> int:
        """T, the number of positions held (0 for an empty cache)."""
        return self.k[0].shape[2] if self.k else 0


def _attention_step(x, p, k_past, v_past, *, n_head: int):
    """Attention of the new positions against past + new keys.

    x (B, Tn, C) the new positions (already layer-normed for pre-LN), k_past / v_past
    (B, NH, Tp, hs) or None -> (y (B, Tn, C), k (B, NH, Tp+Tn, hs), v (B, NH, Tp+Tn, hs)).
    New query j sits at absolute position Tp + j and may see keys i <= Tp + j: the causal
    alignment of ``sdpa_forward``, which puts the Tn queries at the end of the Tp + Tn keys.
    """
    xp = array_namespace(x)
    qkv, _ = linear_forward(x, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"))  # (B, Tn, 3C)
    q, k, v = split_qkv(qkv, n_head)  # (B, NH, Tn, hs) each
    if k_past is not None:
        k = xp.concat([k_past, k], axis=2)  # (B, NH, T, hs), T = Tp + Tn
        v = xp.concat([v_past, v], axis=2)  # (B, NH, T, hs)
    out, _ = sdpa_forward(q, k, v, causal=True)  # (B, NH, Tn, hs), query j sees keys <= Tp + j
    heads = merge_heads(out)  # (B, Tn, C)
    y, _ = linear_forward(heads, p["attn.c_proj.weight"], p.get("attn.c_proj.bias"))  # (B, Tn, C)
    return y, k, v


def _block_step(x, p, k_past, v_past, cfg: GPTConfig, Tp: int):
    """One block (pre- or post-LN, with the parts of ``block_forward``) on the new positions
    x (B, Tn, C), which follow Tp cached ones -> (y (B, Tn, C), k, v (B, NKV, Tp + Tn, hs))."""

    def attention(z):
        if not cfg.grouped_attention:
            return _attention_step(z, p, k_past, v_past, n_head=cfg.n_head)
        rotate = None  # RoPE turns the new queries and keys as positions Tp, ..., Tp + Tn - 1
        if cfg.position == "rope":
            rotate = functools.partial(rope_forward, base=cfg.rope_base, start=Tp,
                                       pairing=cfg.rope_pairing)
        weights = (p[f"attn.{name}"] for name in GROUPED_ATTN_NAMES)  # wq, wk, wv, wo
        return gqa_attention_step(z, *weights, k_past, v_past, n_head=cfg.n_head,
                                  n_kv_head=cfg.kv_heads, rotate=rotate)  # fmt: skip

    return block_around(x, p, cfg, attention)


def block_around(x, p, cfg: GPTConfig, attention):
    """A block (pre- or post-LN, the norms and MLP of ``block_forward``) around an ``attention``
    of the decoder's own: attention(z (B, Tn, C)) -> (a (B, Tn, C), *kept), where ``kept`` is
    what that attention returns besides (the generator's new keys and values)
    -> (y (B, Tn, C), *kept). Evaluation mode: no dropout."""
    opts = block_options(cfg)

    def ln(z, name):
        return block_norm(z, p, name, opts)[0]

    def mlp(z):
        y, _ = block_mlp(z, p, opts)
        return y[0] if cfg.mlp == "moe" else y  # a mixture of experts returns (y, aux)

    if cfg.ln_order == "pre":
        a, *kept = attention(ln(x, "ln_1"))  # (B, Tn, C)
        x1 = x + a  # (B, Tn, C)
        y = x1 + mlp(ln(x1, "ln_2"))  # (B, Tn, C)
    else:
        a, *kept = attention(x)  # (B, Tn, C)
        x1 = ln(x + a, "ln_1")  # (B, Tn, C)
        y = ln(x1 + mlp(x1), "ln_2")  # (B, Tn, C)
    return (y, *kept)


def forward_step(params: dict, cfg: GPTConfig, new_ids, cache: KVCache):
    """new_ids (B, Tn) the next tokens after the cached ones -> (logits_last (B, V), new cache).

    Runs embeddings, blocks, ln_f and the head on the new positions Tp .. Tp+Tn-1 only
    (Tp = cache.length); the logits equal ``gpt_forward`` on the whole sequence at its last
    position. Evaluation mode (no dropout). The total length may not exceed ``cfg.block_size``.
    """
    check_params(params, cfg)
    require_int("new_ids", new_ids)
    if len(new_ids.shape) != 2 or new_ids.shape[1] == 0:
        raise ValueError(f"new_ids must have shape (B, Tn), Tn >= 1, got {tuple(new_ids.shape)}")
    require_ids_in_range("new_ids", new_ids, cfg.vocab_size)
    if cache.length + new_ids.shape[1] > cfg.block_size:
        raise ValueError(f"the cache holds {cache.length} positions and {new_ids.shape[1]} new "
                         f"ones would exceed block_size={cfg.block_size}: recompute from a "
                         "cropped window")
    return _forward_step(params, cfg, new_ids, cache)


def _forward_step(params: dict, cfg: GPTConfig, new_ids, cache: KVCache):
    """``forward_step`` without the checks (``generate`` validates its inputs once)."""
    Tp, Tn = cache.length, new_ids.shape[1]
    wte = params["wte.weight"]
    x = take_rows(wte, new_ids)  # (B, Tn, C)
    if cfg.position == "learned":
        x = x + params["wpe.weight"][Tp : Tp + Tn, :]  # (B, Tn, C)
    elif cfg.position == "sinusoidal":
        x = x + sinusoidal_encoding(Tp + Tn, cfg.n_embd, like=x)[Tp:, :]  # (B, Tn, C)
    # rope: no addition; every attention turns q and k as positions Tp .. Tp + Tn - 1
    ks, vs = [], []
    for layer in range(cfg.n_layer):
        k_past = cache.k[layer] if Tp else None
        v_past = cache.v[layer] if Tp else None
        x, k, v = _block_step(x, block_params(params, layer), k_past, v_past, cfg, Tp)  # (B,Tn,C)
        ks.append(k)
        vs.append(v)
    return head_logits(params, cfg, x[:, -1, :]), KVCache(ks, vs)


def head_logits(params: dict, cfg: GPTConfig, x_last):
    """x_last (B, C), the last position's residual stream -> logits (B, V): ln_f, then the head
    (GPT-2's is wte^T). Only the last position is needed for the next token."""
    xf, _ = block_norm(x_last, params, "ln_f", block_options(cfg))  # (B, C)
    return xf @ head_weight(params, cfg)  # (B, V)


def check_sampling(temperature, top_k, top_p) -> None:
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")


def next_token_distribution(logits_last, temperature: float = 1.0, top_k: int | None = None,
                            top_p: float | None = None):
    """logits_last (..., V) -> probs (..., V), the distribution the next token is drawn from.

    Temperature first (0 gives the one-hot of the argmax, the limit of softmax(logits / t) as
    t -> 0), then top-k, then top-p on the distribution that top-k left (as Hugging Face's
    warpers do). Both filters keep the tokens of rank < n in the descending order of
    probability, so ties are broken by the lower token id and top-k keeps exactly k tokens.
    """
    xp = array_namespace(logits_last)
    check_sampling(temperature, top_k, top_p)
    V = logits_last.shape[-1]
    if temperature == 0.0:
        return one_hot(xp.argmax(logits_last, axis=-1), V, dtype=logits_last.dtype)  # (..., V)
    logits = logits_last / temperature  # (..., V)
    order = xp.argsort(logits, axis=-1, descending=True, stable=True)  # (..., V) ids, best first
    rank = xp.argsort(order, axis=-1, stable=True)  # (..., V) rank of every id, 0 = best
    if top_k is not None:
        logits = xp.where(rank < top_k, logits, -math.inf)  # (..., V)
    if top_p is not None:
        sorted_probs, _ = softmax_forward(xp.sort(logits, axis=-1, descending=True))  # (..., V)
        mass_before = xp.cumulative_sum(sorted_probs, axis=-1) - sorted_probs  # (..., V)
        # keep rank j while the tokens ranked before it hold less than p: the smallest nucleus
        n_keep = xp.sum(xp.astype(mass_before < top_p, xp.int64), axis=-1, keepdims=True)  # (...,1)
        logits = xp.where(rank < n_keep, logits, -math.inf)  # (..., V)
    probs, _ = softmax_forward(logits, axis=-1)  # (..., V)
    return probs


def _prompt_list(prompt_ids, vocab_size: int) -> list[int]:
    """The prompt as a list of Python ints, checked (1-D, non-empty, inside the vocabulary)."""
    ids = np.asarray(prompt_ids if isinstance(prompt_ids, (list, tuple)) else to_numpy(prompt_ids))
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"prompt_ids must be a non-empty 1-D sequence of ids, got {ids.shape}")
    require_int("prompt_ids", ids)
    require_ids_in_range("prompt_ids", ids, vocab_size)
    return [int(i) for i in ids]


def _last_logits(params, cfg: GPTConfig, ids: list[int], cache: KVCache | None):
    """Logits (1, V) of the next token after ``ids`` and the updated cache (None: no cache).

    The context is the last block_size ids. With a cache, only the ids it lacks are run; once the
    sequence is longer than block_size every window starts at a new position, so the cache is
    rebuilt from the cropped window (learned positions must be those of the window). Experts
    take every token routed to them (no capacity limit), with or without the cache.
    """
    if cfg.capacity_factor is not None:
        cfg = replace(cfg, capacity_factor=None)
    wte = params["wte.weight"]
    window = ids[-cfg.block_size :]
    if cache is None:
        idx = asarray_like([window], wte, dtype=array_namespace(wte).int64)  # (1, T)
        logits, _, _ = gpt_forward(params, idx, cfg)  # (1, T, V)
        return logits[:, -1, :], None
    if len(ids) > cfg.block_size:
        cache = KVCache()
    new = window[cache.length :]
    idx = asarray_like([new], wte, dtype=array_namespace(wte).int64)  # (1, Tn)
    return _forward_step(params, cfg, idx, cache)


def check_generate_args(params: dict, cfg: GPTConfig, prompt_ids, max_new_tokens: int,
                        temperature: float, top_k, top_p, stop_token) -> list[int]:
    """The checks of ``generate``'s arguments, before any work -> the prompt as a list of ints."""
    check_params(params, cfg)
    check_sampling(temperature, top_k, top_p)
    ids = _prompt_list(prompt_ids, cfg.vocab_size)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
    if stop_token is not None and not 0 <= stop_token < cfg.vocab_size:
        raise ValueError(f"stop_token must be in [0, {cfg.vocab_size}), got {stop_token!r}")
    return ids


def pick_token(logits, greedy: bool, temperature: float, top_k, top_p, generator):
    """logits (B, V) -> the next token of each row (B,), on the logits' device: the argmax when
    ``greedy``, else a draw from ``next_token_distribution`` with ``generator``."""
    if greedy:
        return array_namespace(logits).argmax(logits, axis=-1)  # (B,)
    probs = next_token_distribution(logits, temperature, top_k, top_p)  # (B, V)
    return sample_categorical(probs, generator)  # (B,)


def generate(params: dict, cfg: GPTConfig, prompt_ids, max_new_tokens: int, *,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             stop_token: int | None = None, seed: int = 0, use_kv_cache: bool = True,
             greedy: bool = False, on_token=None) -> list[int]:
    """Extend ``prompt_ids`` by up to ``max_new_tokens`` tokens -> prompt + generated ids.
    ``on_token(id)`` is called with each new token as soon as it is drawn (the command line
    prints it then).

    ``greedy`` (or temperature 0) picks the argmax; otherwise tokens are drawn from
    ``next_token_distribution`` with a generator seeded by ``seed`` on the parameters' backend
    and device (same seed, same output). Generation stops early after emitting ``stop_token``
    (which is included). The context is cropped to the last block_size tokens. With or without
    the KV cache the tokens are the same; the cache only saves work.
    """
    ids = check_generate_args(params, cfg, prompt_ids, max_new_tokens, temperature, top_k, top_p,
                              stop_token)  # fmt: skip
    generator = make_generator(seed, params["wte.weight"])
    cache = KVCache() if use_kv_cache else None
    for _ in range(max_new_tokens):
        logits, cache = _last_logits(params, cfg, ids, cache)  # (1, V)
        token = pick_token(logits, greedy or temperature == 0.0, temperature, top_k, top_p,
                           generator)  # (1,)
        ids.append(int(token[0]))
        if on_token is not None:
            on_token(ids[-1])
        if ids[-1] == stop_token:
            break
    return ids


__all__ = ["KVCache", "forward_step", "next_token_distribution", "generate"]
