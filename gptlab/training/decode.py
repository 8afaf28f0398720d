"""Decoding in steps of one fixed shape, so that a GPU runs each step as one replayed CUDA graph.

``generate`` grows its KV cache by concatenation, so every step has new shapes, and it reads each
token back to the host (``int(token)``) before it runs the next step. On a GPU a decode step of
GPT-2 124M is about a hundred small kernels; launched one by one from Python, and with a wait
for the device at every token, the host sets the pace, not the GPU.

``StaticDecoder`` makes every step the same program on the same memory:

    k_cache[l], v_cache[l]   (B, NH, T_max, hs), allocated once; position t is written at step t
    pos                      (1,) int64 on the device: the position of the token being fed
    token                    (B, 1) int64 on the device: the token being fed

    one step:  x = wte[token] + wpe[pos]                               (B, 1, C)
               per block, its attention:
                   q, k, v = split(x @ W_attn)                           (B, NH, 1, hs) each
                   k_cache[:, :, pos] = k,  v_cache[:, :, pos] = v
                   out = softmax(q k_cache^T / sqrt(hs), keys j > pos hidden) v_cache
               logits = ln_f(x) @ wte^T                                   (B, V)
               pos += 1

The attention reads all T_max cached positions and hides those past ``pos`` (their weight is
exactly 0): more arithmetic than reading ``pos + 1`` of them, but the same shapes at every step.
The next token is picked on the device (argmax, or a draw from ``next_token_distribution``) and
copied into ``token``; the ids are read back to the host once at the end, or every
``check_every`` tokens when a ``stop_token`` can end the text early. On CUDA the step is
captured once as a ``torch.cuda.CUDAGraph`` (Triton's and torch's kernels alike) and each token
replays it: one launch from the host instead of one per kernel. Elsewhere the same step runs
eagerly. Either way the ids are those of ``generate`` with the same arguments.

Covered: GPT-2-style models (learned or sinusoidal positions, multi-head attention, pre- or
post-LN, LayerNorm or RMSNorm, GELU or SwiGLU MLPs) on torch tensors, prompt + new tokens within
block_size. Refused with a clear error: rotary positions and grouped-query attention (their
step depends on the position as a Python number), mixtures of experts (their routing has
data-dependent shapes), NumPy arrays, and texts longer than block_size (``generate`` crops them).

Book: chapter 23, "Generation on the GPU".
"""

from __future__ import annotations

import functools
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..backend import capture_cuda_graph, is_torch_array, make_generator, take_rows
from ..config import GPTConfig
from ..layers.attention import merge_heads, split_qkv
from ..layers.linear import linear_forward
from ..layers.position_sinusoidal import sinusoidal_encoding
from ..layers.sdpa import attend
from ..model import block_params
from .sample import block_around, check_generate_args, head_logits, pick_token


def static_refusal(cfg: GPTConfig) -> str | None:
    """Why a fixed-shape step cannot run ``cfg``'s decoding (naming the field), or None."""
    if cfg.position not in ("learned", "sinusoidal"):
        return (f"the static decoder covers learned and sinusoidal positions, not "
                f"GPTConfig.position={cfg.position!r}; use generate")
    if cfg.grouped_attention:
        return (f"the static decoder covers multi-head attention, not GPTConfig."
                f"n_kv_head={cfg.n_kv_head!r}; use generate")
    if cfg.mlp == "moe":
        return ("the static decoder does not cover GPTConfig.mlp='moe' (the routing has "
                "data-dependent shapes); use generate")
    return None


class HostReads(TorchDispatchMode):
    """Inside ``with HostReads() as reads:``, ``reads.ops`` lists every torch op that reads a
    tensor's value back to the host (``.item()``, ``int(t)``, ``.tolist()``) or whose output shape
    depends on values (``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask):
    what a CUDA graph cannot contain. A step that leaves the list empty can be captured."""

    HOST = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item")

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        masked = name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1])
        if name in self.HOST or masked:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))


class StaticDecoder:
    """A decoder over ``params`` (torch tensors of ``cfg``) with a cache of ``max_len`` positions
    (block_size by default), one text at a time (B = 1). ``cuda_graph``: capture the step as a
    CUDA graph (default: when the parameters are on a CUDA device).

        decoder = StaticDecoder(params, cfg)
        ids = decoder.generate(prompt_ids, 256, greedy=True)   # generate's arguments and ids

    The decoder is reused across calls: the graph is captured at the first one.
    """

    def __init__(self, params: dict, cfg: GPTConfig, *, max_len: int | None = None,
                 cuda_graph: bool | None = None):
        wte = params["wte.weight"]
        if not is_torch_array(wte):
            raise TypeError(f"the static decoder runs on torch tensors, got "
                            f"{type(wte).__module__}.{type(wte).__name__}; use generate")
        if static_refusal(cfg):
            raise ValueError(static_refusal(cfg))
        max_len = cfg.block_size if max_len is None else max_len
        if not (isinstance(max_len, int) and 1 <= max_len <= cfg.block_size):
            raise ValueError(f"max_len must be an integer in [1, block_size={cfg.block_size}], "
                             f"got {max_len!r}")
        on_cuda = wte.device.type == "cuda"
        if cuda_graph and not on_cuda:
            raise ValueError(f"cuda_graph=True needs the parameters on a CUDA device, they are "
                             f"on {wte.device}")
        self.params, self.cfg, self.max_len = params, cfg, max_len
        self.cuda_graph = on_cuda if cuda_graph is None else cuda_graph
        self.blocks = [block_params(params, layer) for layer in range(cfg.n_layer)]
        if cfg.position == "learned":
            self.positions = params["wpe.weight"][:max_len]  # (T_max, C)
        else:
            self.positions = sinusoidal_encoding(max_len, cfg.n_embd, like=wte)  # (T_max, C)
        self.key_positions = torch.arange(max_len, device=wte.device)  # (T_max,)
        self.graph = self.token = None

    def _allocate(self) -> None:
        """The step's memory, allocated at the first call: caches, pos, token."""
        cfg, wte = self.cfg, self.params["wte.weight"]
        hs = cfg.n_embd // cfg.n_head
        shape = (cfg.n_layer, 1, cfg.n_head, self.max_len, hs)  # (L, B, NH, T_max, hs)
        self.k_cache = torch.zeros(shape, dtype=wte.dtype, device=wte.device)
        self.v_cache = torch.zeros(shape, dtype=wte.dtype, device=wte.device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=wte.device)  # (1,)
        self.token = torch.zeros((1, 1), dtype=torch.int64, device=wte.device)  # (B, 1)

    def _attention(self, z, p, layer: int):
        """z (B, 1, C), the fed position -> (a (B, 1, C),): its keys and values go into the
        cache at ``pos``; its query attends to the cache with the positions past ``pos`` hidden."""
        qkv, _ = linear_forward(z, p["attn.c_attn.weight"], p.get("attn.c_attn.bias"))  # (B,1,3C)
        q, k, v = split_qkv(qkv, self.cfg.n_head)  # (B, NH, 1, hs) each
        self.k_cache[layer].index_copy_(2, self.pos, k)  # k_cache[l][:, :, pos] = k
        self.v_cache[layer].index_copy_(2, self.pos, v)
        visible = self.key_positions <= self.pos  # (T_max,) the keys 0 .. pos
        scale = 1.0 / math.sqrt(q.shape[-1])
        out, _ = attend(q, self.k_cache[layer], self.v_cache[layer], visible, scale)  # (B,NH,1,hs)
        a, _ = linear_forward(merge_heads(out), p["attn.c_proj.weight"],
                              p.get("attn.c_proj.bias"))  # fmt: skip
        return (a,)  # (B, 1, C)

    def _step(self):
        """Feed ``token`` at ``pos`` -> logits (B, V) of the next token; pos += 1."""
        x = take_rows(self.params["wte.weight"], self.token)  # (B, 1, C)
        x = x + self.positions.index_select(0, self.pos)  # (B, 1, C) + (1, C)
        for layer, p in enumerate(self.blocks):
            attention = functools.partial(self._attention, p=p, layer=layer)
            (x,) = block_around(x, p, self.cfg, attention)  # (B, 1, C)
        self.pos.add_(1)
        return head_logits(self.params, self.cfg, x[:, -1, :])  # (B, V)

    def step(self):
        """One step: the logits (B, V) after ``token`` at ``pos`` (the graph's buffer on CUDA)."""
        if self.graph is None:
            return self._step()
        self.graph.replay()
        return self.logits

    def check_fits(self, prompt_len: int, max_new_tokens: int) -> None:
        """ValueError unless a text of ``prompt_len`` + ``max_new_tokens`` fits in the cache (the
        last new token is never fed: prompt_len + max_new_tokens - 1 positions)."""
        if prompt_len + max_new_tokens - 1 > self.max_len:
            raise ValueError(f"the prompt ({prompt_len} tokens) and max_new_tokens={max_new_tokens}"
                             f" need {prompt_len + max_new_tokens - 1} cached positions, more than "
                             f"the decoder's {self.max_len}; use generate, which crops the "
                             "context to the last block_size tokens")  # fmt: skip

    def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 stop_token: int | None = None, seed: int = 0, greedy: bool = False,
                 on_token=None, check_every: int = 32) -> list[int]:
        """``generate``'s arguments and ids (see ``gptlab.training.sample.generate``), decoded
        in fixed-shape steps. ``on_token`` reads every token back as it is drawn (a wait per
        token); otherwise the ids come back every ``check_every`` tokens when ``stop_token`` is
        set, else once at the end."""
        params, cfg = self.params, self.cfg
        ids = check_generate_args(params, cfg, prompt_ids, max_new_tokens, temperature, top_k,
                                  top_p, stop_token)  # fmt: skip
        self.check_fits(len(ids), max_new_tokens)
        if not (isinstance(check_every, int) and check_every >= 1):
            raise ValueError(f"check_every must be a positive integer, got {check_every!r}")
        if max_new_tokens == 0:
            return ids
        if self.token is None:
            self._allocate()
        if self.cuda_graph and self.graph is None:
            # one warm-up step: it feeds position 0, which a cache of any max_len has
            self.graph, self.logits = capture_cuda_graph(self._step, warmups=1)
        self.k_cache.zero_()  # a fresh text: nothing cached, feeding starts at position 0
        self.v_cache.zero_()
        self.pos.zero_()
        greedy = greedy or temperature == 0.0
        generator = make_generator(seed, params["wte.weight"])
        prompt = torch.tensor(ids, dtype=torch.int64, device=self.token.device)  # (Tp,)
        for i in range(len(ids) - 1):  # the prompt but its last token fills the cache
            self.token.copy_(prompt[i].view(1, 1))
            self.step()
        self.token.copy_(prompt[-1].view(1, 1))
        new = torch.empty(max_new_tokens, dtype=torch.int64, device=self.token.device)  # (N,)
        for i in range(max_new_tokens):
            token = pick_token(self.step(), greedy, temperature, top_k, top_p, generator)  # (1,)
            new[i] = token[0]
            self.token.copy_(token.view(1, 1))
            if on_token is not None:
                on_token(int(token[0]))
            if stop_token is not None and ((i + 1) % check_every == 0 or on_token is not None):
                if stop_token in new[: i + 1].tolist():
                    break
        new_ids = new[: i + 1].tolist()
        if stop_token in new_ids:
            new_ids = new_ids[: new_ids.index(stop_token) + 1]
        return ids + new_ids


__all__ = ["StaticDecoder", "HostReads", "static_refusal"]
