"""Learning from preferences on a toy task: a reward model, RLHF with PPO, and DPO.

The recipe of InstructGPT (Ouyang et al. 2022), after Christiano et al. (2017) and Stiennon et
al. (2020), with Rafailov et al.'s (2023) DPO beside it, small enough for a CPU:

1. a policy, a tiny char-level GPT pretrained briefly on the corpus (``pretrain_policy``); a
   frozen copy of it is the reference pi_ref;
2. pairs (chosen, rejected) of its completions of the same prompt, labelled by a programmatic
   preference (``ToyTask.score``: the share of the completion's characters in ``task.preferred``);
3. a reward model, the GPT with a scalar head on the last position's final hidden state,
   fitted to the pairs with the Bradley-Terry loss (``reward_forward``, ``train_reward_model``);
4. RLHF: completions sampled from the policy, scored by the reward model minus beta times the
   per-token log-ratio to pi_ref, advantages by GAE (``gae``), and PPO's clipped surrogate plus
   a value head's squared error on the same trunk (``ppo_loss_forward``, ``train_ppo``);
5. DPO on the same pairs (``dpo_loss_forward``, ``train_dpo``): no reward model, no sampling.

Sequences are ``prompt (P tokens) + completion (L tokens)``, all completions the same length.
The logits at position P + j - 1 predict completion token j, so a completion's per-token
log-probabilities are ``token_logprobs`` of the last L positions of gpt_forward(seqs[:, :-1]),
and the value of the state before token j is the value head at that same position. Every
gradient is hand-written: the losses are layers (``gptlab/layers``: token_logprobs,
bradley_terry, ppo, value_loss, dpo), the heads are ``linear`` layers, and the GPT is
``gpt_backward`` fed at its logits and at its final hidden states (``dxf``).

Book: chapter 22, "Learning from preferences: RLHF and DPO".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import (
    array_device,
    array_namespace,
    asarray_like,
    make_generator,
    sample_categorical,
    to_numpy,
)
from ..checks import require_int, require_shape
from ..config import GPTConfig
from ..layers.bradley_terry import bradley_terry_backward, bradley_terry_forward
from ..layers.dpo import dpo_backward, dpo_forward
from ..layers.linear import linear_backward, linear_forward
from ..layers.ppo import ppo_backward, ppo_forward
from ..layers.softmax import softmax_forward
from ..layers.token_logprobs import token_logprobs_backward, token_logprobs_forward
from ..layers.value_loss import value_loss_backward, value_loss_forward
from ..model import gpt_backward, gpt_forward, init_params, loss_and_grads, param_shapes
from ..tokenizers.char import CharTokenizer
from ..training.optim import AdamW

# ------------------------------------------------------------------------------------------------
# The toy task


@dataclass
class ToyTask:
    """Prompts are windows of ``prompt_len`` characters of a corpus; a completion is
    ``completion_len`` characters; its score is the share of them that lie in ``preferred``.

    ``train_ids`` and ``eval_ids`` are the first 90% and the last 10% of the encoded corpus:
    training prompts come from the first, evaluation prompts from the second."""

    tokenizer: CharTokenizer
    train_ids: np.ndarray
    eval_ids: np.ndarray
    preferred: str = "e"
    prompt_len: int = 8
    completion_len: int = 16

    @classmethod
    def from_text(cls, text: str, preferred: str = "e", prompt_len: int = 8,
                  completion_len: int = 16) -> ToyTask:
        """The task on ``text`` (a character tokenizer over all of it)."""
        tokenizer = CharTokenizer.from_text(text)
        missing = [ch for ch in preferred if ch not in tokenizer.ids]
        if not preferred or missing:
            raise ValueError(f"preferred must be characters of the text, got {preferred!r}")
        for name, value in (("prompt_len", prompt_len), ("completion_len", completion_len)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int64)
        cut = int(len(ids) * 0.9)
        if min(cut, len(ids) - cut) <= prompt_len + completion_len:
            raise ValueError(f"the text ({len(ids)} characters) is too short for windows of "
                             f"{prompt_len + completion_len}")  # fmt: skip
        return cls(tokenizer, ids[:cut], ids[cut:], preferred, prompt_len, completion_len)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.completion_len

    def prompts(self, n: int, rng: np.random.Generator, split: str = "train") -> np.ndarray:
        """n random windows of prompt_len ids (n, P) from the train or eval part."""
        ids = self.train_ids if split == "train" else self.eval_ids
        starts = rng.integers(0, len(ids) - self.prompt_len, size=n)  # (n,)
        return ids[starts[:, None] + np.arange(self.prompt_len)]  # (n, P)

    def score(self, seqs) -> np.ndarray:
        """seqs (N, P + L) -> the programmatic score (N,): the share of the completion's
        characters that lie in ``preferred``."""
        completion = to_numpy(seqs)[:, self.prompt_len :]  # (N, L)
        wanted = [self.tokenizer.ids[ch] for ch in self.preferred]
        return np.mean(np.isin(completion, wanted), axis=-1)  # (N,)

    def decode(self, seqs) -> list[tuple[str, str]]:
        """seqs (N, P + L) -> (prompt, completion) texts."""
        seqs = to_numpy(seqs)
        decode = self.tokenizer.decode
        return [(decode(row[: self.prompt_len].tolist()), decode(row[self.prompt_len :].tolist()))
                for row in seqs]


def policy_config(task: ToyTask, n_layer: int = 2, n_head: int = 2, n_embd: int = 32) -> GPTConfig:
    """A tiny GPT whose context holds a prompt and its completion."""
    return GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd,
                     vocab_size=task.tokenizer.vocab_size, block_size=task.seq_len)  # fmt: skip


def _gpt_part(params: dict, cfg: GPTConfig) -> dict:
    """The GPT's own parameters of a dict that also holds a head."""
    return {name: params[name] for name in param_shapes(cfg)}


def _ids_like(ids, like):
    """Token ids on ``like``'s backend and device (int64)."""
    return asarray_like(to_numpy(ids), like, dtype=array_namespace(like).int64)


def pretrain_policy(task: ToyTask, cfg: GPTConfig, *, steps: int = 300, batch_size: int = 32,
                    lr: float = 3e-3, seed: int = 0, backend: str = "numpy",
                    dtype="float64") -> tuple[dict, list[float]]:
    """Next-token training on random windows of the train part: (params, losses per step)."""
    params = init_params(cfg, seed, backend=backend, dtype=dtype)
    opt = AdamW(params, lr=lr, weight_decay=0.0)
    rng, losses = np.random.default_rng(seed), []
    for _ in range(steps):
        starts = rng.integers(0, len(task.train_ids) - cfg.block_size, size=batch_size)  # (B,)
        window = task.train_ids[starts[:, None] + np.arange(cfg.block_size + 1)]  # (B, T + 1)
        x, y = (_ids_like(a, params["wte.weight"]) for a in (window[:, :-1], window[:, 1:]))
        loss, grads = loss_and_grads(params, x, y, cfg)
        params = opt.step(params, grads)
        losses.append(loss)
    return params, losses


def sample_completions(params: dict, cfg: GPTConfig, prompts, length: int, *, seed: int = 0,
                       temperature: float = 1.0) -> np.ndarray:
    """prompts (N, P) -> seqs (N, P + length) int64 NumPy: each prompt continued by ``length``
    tokens drawn from softmax(logits / temperature), all rows at once, from a generator seeded
    by ``seed`` (same seed, same completions)."""
    require_int("prompts", np.asarray(prompts))
    require_shape("prompts", np.asarray(prompts), (None, None))
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    wte = params["wte.weight"]
    generator = make_generator(seed, wte)
    seqs = _ids_like(prompts, wte)  # (N, P)
    xp = array_namespace(wte)
    for _ in range(length):
        logits, _, _ = gpt_forward(params, seqs[:, -cfg.block_size :], cfg)  # (N, T, V)
        probs, _ = softmax_forward(logits[:, -1, :] / temperature)  # (N, V)
        token = sample_categorical(probs, generator)  # (N,)
        seqs = xp.concat([seqs, xp.reshape(xp.astype(token, xp.int64), (-1, 1))], axis=1)
    return np.asarray(to_numpy(seqs), dtype=np.int64)  # (N, P + length)


@dataclass
class PreferencePairs:
    """N labelled pairs: ``chosen`` and ``rejected`` (N, P + L) share their prompt (the first P
    ids); ``score_chosen`` > ``score_rejected`` (N,) are their programmatic scores."""

    chosen: np.ndarray
    rejected: np.ndarray
    score_chosen: np.ndarray
    score_rejected: np.ndarray

    def __len__(self) -> int:
        return len(self.chosen)

    def split(self, n_first: int) -> tuple[PreferencePairs, PreferencePairs]:
        """The first ``n_first`` pairs and the rest (held-out pairs)."""
        first = PreferencePairs(*(a[:n_first] for a in vars(self).values()))
        return first, PreferencePairs(*(a[n_first:] for a in vars(self).values()))


def make_preference_pairs(params: dict, cfg: GPTConfig, task: ToyTask, n_prompts: int, *,
                          seed: int = 0, split: str = "train") -> PreferencePairs:
    """Two completions of each of ``n_prompts`` prompts by the policy, labelled by the task's
    score; pairs whose scores tie carry no preference and are dropped."""
    prompts = task.prompts(n_prompts, np.random.default_rng(seed), split)  # (n, P)
    both = sample_completions(params, cfg, np.concatenate([prompts, prompts]),
                              task.completion_len, seed=seed)  # (2n, P + L)
    first, second = both[:n_prompts], both[n_prompts:]
    s1, s2 = task.score(first), task.score(second)  # (n,)
    keep = s1 != s2
    better = (s1 > s2)[:, None]  # (n, 1)
    chosen, rejected = np.where(better, first, second), np.where(better, second, first)
    return PreferencePairs(chosen[keep], rejected[keep], np.maximum(s1, s2)[keep],
                           np.minimum(s1, s2)[keep])  # fmt: skip


# ------------------------------------------------------------------------------------------------
# Heads on the final hidden states, and a completion's log-probabilities


def init_head(params: dict, cfg: GPTConfig, name: str) -> dict:
    """``params`` plus a zero scalar head ``{name}.weight`` (C, 1), ``{name}.bias`` (1,)."""
    xp, wte = array_namespace(params["wte.weight"]), params["wte.weight"]
    zeros = {f"{name}.weight": (cfg.n_embd, 1), f"{name}.bias": (1,)}
    head = {key: xp.zeros(shape, dtype=wte.dtype, device=array_device(wte))
            for key, shape in zeros.items()}  # fmt: skip
    return {**params, **head}


def init_reward_model(policy: dict, cfg: GPTConfig) -> dict:
    """The reward model starts as the policy (InstructGPT starts it from the SFT model) with a
    zero ``score`` head: every reward is 0 and the Bradley-Terry loss log 2."""
    return init_head(policy, cfg, "score")


def reward_forward(params: dict, seqs, *, cfg: GPTConfig):
    """seqs (N, T) -> (rewards (N,), cache): the ``score`` head on the last position's final
    hidden state, r = xf[:, -1] @ score.weight + score.bias."""
    xp = array_namespace(params["wte.weight"])
    _, _, gpt_cache = gpt_forward(_gpt_part(params, cfg), seqs, cfg)
    x_last = gpt_cache["xf"][:, -1, :]  # (N, C)
    r, head_cache = linear_forward(x_last, params["score.weight"], params["score.bias"])  # (N, 1)
    return xp.reshape(r, (-1,)), (gpt_cache, head_cache)


def reward_backward(drewards, cache) -> tuple[dict]:
    """drewards (N,) -> ({name: dparam},) for the GPT and its score head."""
    gpt_cache, head_cache = cache
    xp = array_namespace(drewards)
    xf = gpt_cache["xf"]
    N, T, C = xf.shape
    # r = xf[:, -1] @ score.weight + score.bias
    dx_last, dw, db = linear_backward(xp.reshape(drewards, (-1, 1)), head_cache)  # (N, C)
    before = xp.zeros((N, T - 1, C), dtype=xf.dtype, device=array_device(xf))  # (N, T - 1, C)
    dxf = xp.concat([before, dx_last[:, None, :]], axis=1)  # (N, T, C)
    grads = gpt_backward(gpt_cache, dxf=dxf)
    return ({**grads, "score.weight": dw, "score.bias": db},)


def _completion_part(x, prompt_len: int):
    """(N, T - 1, ...) -> the positions that predict the completion, (N, L, ...)."""
    return x[:, prompt_len - 1 :, ...]


def completion_logprobs_forward(params: dict, seqs, *, cfg: GPTConfig, prompt_len: int):
    """seqs (N, P + L) -> (logp (N, L), cache): log pi(completion token j | everything before).

    With a ``value`` head in ``params`` the cache also holds ``values`` (N, L), the value head
    on the final hidden states of the same positions (the states before each token)."""
    xp = array_namespace(params["wte.weight"])
    logits, _, gpt_cache = gpt_forward(_gpt_part(params, cfg), seqs[:, :-1], cfg)  # (N, T-1, V)
    targets = seqs[:, prompt_len:]  # (N, L)
    logp, lp_cache = token_logprobs_forward(_completion_part(logits, prompt_len), targets)
    cache = {"gpt": gpt_cache, "logprobs": lp_cache, "prompt_len": prompt_len}
    if "value.weight" in params:
        xf = _completion_part(gpt_cache["xf"], prompt_len)  # (N, L, C)
        values, cache["value_head"] = linear_forward(xf, params["value.weight"],
                                                     params["value.bias"])  # (N, L, 1)
        cache["values"] = xp.reshape(values, tuple(values.shape[:2]))  # (N, L)
    return logp, cache


def completion_logprobs_backward(dlogp, cache, dvalues=None) -> dict:
    """dlogp (N, L) (and dvalues (N, L) for a value head) -> {name: dparam}."""
    xp = array_namespace(dlogp)
    gpt_cache, prompt_len = cache["gpt"], cache["prompt_len"]
    N, T1, C = gpt_cache["xf"].shape
    (dlogits_c,) = token_logprobs_backward(dlogp, cache["logprobs"])  # (N, L, V)
    like = gpt_cache["xf"]

    def pad(d):  # the prompt's positions predict no completion token: gradient 0
        before = xp.zeros((N, prompt_len - 1, d.shape[-1]), dtype=like.dtype,
                          device=array_device(like))  # (N, P - 1, ...)
        return xp.concat([before, d], axis=1)  # (N, T - 1, ...)

    dxf, head_grads = None, {}
    if dvalues is not None:
        # values = xf @ value.weight + value.bias on the completion's positions
        dxf_c, dw, db = linear_backward(dvalues[..., None], cache["value_head"])  # (N, L, C)
        dxf, head_grads = pad(dxf_c), {"value.weight": dw, "value.bias": db}
    grads = gpt_backward(gpt_cache, pad(dlogits_c), dxf)
    return {**grads, **head_grads}


def sequence_logprobs(params: dict, seqs, *, cfg: GPTConfig, prompt_len: int) -> np.ndarray:
    """seqs (N, P + L) -> log pi(completion | prompt) (N,) as NumPy, no gradient."""
    idx = _ids_like(seqs, params["wte.weight"])  # (N, P + L)
    logp, _ = completion_logprobs_forward(_gpt_part(params, cfg), idx, cfg=cfg,
                                          prompt_len=prompt_len)  # (N, L)
    return np.sum(to_numpy(logp), axis=-1)


def completion_kl(params: dict, ref: dict, seqs, *, cfg: GPTConfig, prompt_len: int) -> np.ndarray:
    """The KL divergence KL(pi || pi_ref) of each completion (N,): the exact per-token KL
    sum_v pi(v) (log pi(v) - log pi_ref(v)) over the vocabulary at every completion position,
    summed over the positions. Averaged over completions sampled from pi, it estimates the KL
    between the two models' distributions of whole completions."""
    idx = _ids_like(seqs, params["wte.weight"])[:, :-1]  # (N, T - 1)
    logps = []
    for p in (params, ref):
        logits = to_numpy(gpt_forward(_gpt_part(p, cfg), idx, cfg)[0])[:, prompt_len - 1 :]
        shifted = logits - logits.max(axis=-1, keepdims=True)  # (N, L, V)
        logps.append(shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True)))
    logp, logq = logps
    return np.sum(np.exp(logp) * (logp - logq), axis=(-2, -1))  # (N,)


# ------------------------------------------------------------------------------------------------
# The reward model


def train_reward_model(rm: dict, cfg: GPTConfig, pairs: PreferencePairs, *, steps: int = 200,
                       batch_size: int = 32, lr: float = 1e-3, seed: int = 0) -> tuple[dict, list]:
    """Bradley-Terry on random minibatches of pairs: (trained reward model, log of
    {"step", "loss", "accuracy"} per step, accuracy = the share of the batch ordered right)."""
    opt = AdamW(rm, lr=lr, weight_decay=0.0)
    rng, log = np.random.default_rng(seed), []
    for step in range(steps):
        pick = rng.integers(0, len(pairs), size=batch_size)  # (B,)
        seqs = _ids_like(np.concatenate([pairs.chosen[pick], pairs.rejected[pick]]),
                         rm["wte.weight"])  # (2B, T)  # fmt: skip
        rewards, cache = reward_forward(rm, seqs, cfg=cfg)  # (2B,)
        loss, bt_cache = bradley_terry_forward(rewards[:batch_size], rewards[batch_size:])
        dchosen, drejected = bradley_terry_backward(1.0, bt_cache)  # (B,) each
        xp = array_namespace(dchosen)
        (grads,) = reward_backward(xp.concat([dchosen, drejected]), cache)
        rm = opt.step(rm, grads)
        accuracy = float(np.mean(to_numpy(bt_cache["margin"]) > 0))
        log.append({"step": step, "loss": float(loss), "accuracy": accuracy})
    return rm, log


def rewards_of(rm: dict, cfg: GPTConfig, seqs) -> np.ndarray:
    """The reward model's scores of seqs (N, T) as NumPy (N,)."""
    return to_numpy(reward_forward(rm, _ids_like(seqs, rm["wte.weight"]), cfg=cfg)[0])


def reward_accuracy(rm: dict, cfg: GPTConfig, pairs: PreferencePairs) -> float:
    """The share of pairs whose chosen answer the reward model scores higher."""
    return float(np.mean(rewards_of(rm, cfg, pairs.chosen) > rewards_of(rm, cfg, pairs.rejected)))


# ------------------------------------------------------------------------------------------------
# RLHF with PPO


def gae(rewards, values, *, gamma: float = 1.0, lam: float = 0.95):
    """Generalized advantage estimation (Schulman et al. 2016, eq. 16) over the last axis.

    rewards, values (N, L): the reward after action t and the value of the state before it; the
    state after the last action ends the episode (value 0). Backwards from t = L - 1:

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t = delta_t + gamma * lam * A_{t+1}        = sum_l (gamma lam)^l delta_{t+l}

    Returns (advantages, returns = advantages + values), both (N, L).
    """
    rewards, values = np.asarray(rewards, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if rewards.shape != values.shape or rewards.ndim != 2:
        raise ValueError(f"rewards and values must have the same shape (N, L), got "
                         f"{rewards.shape} and {values.shape}")  # fmt: skip
    for name, value in (("gamma", gamma), ("lam", lam)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value!r}")
    L = rewards.shape[1]
    advantages = np.zeros_like(rewards)  # (N, L)
    next_value, next_advantage = np.zeros(len(rewards)), np.zeros(len(rewards))  # (N,)
    for t in reversed(range(L)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # (N,)
        advantages[:, t] = next_advantage = delta + gamma * lam * next_advantage
        next_value = values[:, t]
    return advantages, advantages + values


def ppo_loss_forward(params: dict, seqs, old_logp, advantages, returns, *, cfg: GPTConfig,
                     prompt_len: int, clip_eps: float = 0.2, vf_coef: float = 0.5):
    """The PPO loss of one minibatch, policy and value head on one trunk:
    loss = ppo(logp, old_logp, advantages) + vf_coef * value_loss(values, returns).

    seqs (N, P + L) ids; old_logp, advantages, returns (N, L) -> (loss (), cache)."""
    logp, lp_cache = completion_logprobs_forward(params, seqs, cfg=cfg, prompt_len=prompt_len)
    policy_loss, ppo_cache = ppo_forward(logp, old_logp, advantages, clip_eps=clip_eps)  # ()
    v_loss, v_cache = value_loss_forward(lp_cache["values"], returns)  # ()
    loss = policy_loss + vf_coef * v_loss  # ()
    cache = {"logprobs": lp_cache, "ppo": ppo_cache, "value": v_cache, "vf_coef": vf_coef,
             "policy_loss": policy_loss, "value_loss": v_loss}
    return loss, cache


def ppo_loss_backward(dloss, cache):
    """dloss -> ({name: dparam}, dold_logp, dadvantages, dreturns)."""
    # loss = policy_loss + vf_coef * v_loss
    dlogp, dold_logp, dadvantages = ppo_backward(dloss, cache["ppo"])  # (N, L) each
    dvalues, dreturns = value_loss_backward(cache["vf_coef"] * dloss, cache["value"])  # (N, L)
    grads = completion_logprobs_backward(dlogp, cache["logprobs"], dvalues)
    return grads, dold_logp, dadvantages, dreturns


def evaluate_policy(params: dict, ref: dict, reward_fn, cfg: GPTConfig, task: ToyTask,
                    prompts, *, seed: int = 0) -> dict:
    """Sample one completion per prompt: the mean programmatic ``score``, ``reward`` (by
    ``reward_fn(seqs) -> (N,)``, e.g. the reward model's ``rewards_of``) and ``kl`` to the
    reference (nats per completion), and the ``samples``."""
    seqs = sample_completions(_gpt_part(params, cfg), cfg, prompts, task.completion_len, seed=seed)
    return {"score": float(np.mean(task.score(seqs))),
            "reward": float(np.mean(reward_fn(seqs))),
            "kl": float(np.mean(completion_kl(params, ref, seqs, cfg=cfg,
                                              prompt_len=task.prompt_len))),
            "samples": seqs}  # fmt: skip


def _start_row(log: list, row: dict, step: int, steps: int, eval_every: int, evaluate):
    """The log row of ``step``, with ``eval`` (``evaluate()``, unless None) every ``eval_every``
    steps and after the last update. After the last update the row is logged here and the
    answer is None: the loop stops."""
    if evaluate is not None and (step % eval_every == 0 or step == steps):
        row["eval"] = evaluate()
    if step == steps:
        log.append(row)
        return None
    return row


def train_ppo(policy: dict, ref: dict, reward_fn, cfg: GPTConfig, task: ToyTask, *,
              iterations: int = 40, batch_size: int = 32, beta: float = 0.05,
              clip_eps: float = 0.2, gamma: float = 1.0, lam: float = 0.95, epochs: int = 4,
              minibatch: int = 16, lr: float = 1e-3, vf_coef: float = 0.5, seed: int = 0,
              eval_prompts=None, eval_every: int = 10) -> tuple[dict, list[dict]]:
    """RLHF: per iteration, ``batch_size`` completions of fresh prompts sampled from the policy,
    token rewards -beta * (log pi_old - log pi_ref) with ``reward_fn(seqs)`` (N,) (the reward
    model's score, ``lambda s: rewards_of(rm, cfg, s)``) added at the last token, GAE
    advantages (whitened over the batch), then ``epochs`` passes of PPO over minibatches. The
    value head starts at zero on the policy's trunk.

    Returns (policy with its ``value`` head, log). Each log row: iteration, samples so far, the
    batch's mean ``reward``, programmatic ``score`` and sampled KL estimate
    sum_t (log pi_old - log pi_ref), the clip fraction and value loss of the last minibatch;
    every ``eval_every`` iterations (and at the end) also ``eval`` = evaluate_policy on
    ``eval_prompts`` (with the same seed each time).
    """
    params = init_head(policy, cfg, "value")
    opt = AdamW(params, lr=lr, weight_decay=0.0)
    rng, log = np.random.default_rng(seed), []
    P = task.prompt_len
    evaluate = None if eval_prompts is None else lambda: evaluate_policy(
        params, ref, reward_fn, cfg, task, eval_prompts, seed=seed + 1)
    for it in range(iterations + 1):
        row = _start_row(log, {"iteration": it, "samples": it * batch_size}, it, iterations,
                         eval_every, evaluate)  # fmt: skip
        if row is None:
            break
        seqs_np = sample_completions(_gpt_part(params, cfg), cfg, task.prompts(batch_size, rng),
                                     task.completion_len, seed=seed + 1000 + it)  # fmt: skip
        seqs = _ids_like(seqs_np, params["wte.weight"])
        old_logp, cache = completion_logprobs_forward(params, seqs, cfg=cfg, prompt_len=P)
        ref_logp, _ = completion_logprobs_forward(ref, seqs, cfg=cfg, prompt_len=P)
        old_logp, values = to_numpy(old_logp), to_numpy(cache["values"])  # (N, L)
        log_ratio = old_logp - to_numpy(ref_logp)  # (N, L)
        scores = np.asarray(reward_fn(seqs_np), dtype=np.float64)  # (N,)
        token_rewards = -beta * log_ratio  # (N, L)
        token_rewards[:, -1] += scores
        advantages, returns = gae(token_rewards, values, gamma=gamma, lam=lam)
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        for _ in range(epochs):
            order = rng.permutation(batch_size)
            for start in range(0, batch_size, minibatch):
                pick = order[start : start + minibatch]
                batch = [asarray_like(a[pick], params["wte.weight"])
                         for a in (old_logp, advantages, returns)]  # fmt: skip
                _, ppo_cache = ppo_loss_forward(params, seqs[pick], *batch, cfg=cfg, prompt_len=P,
                                                clip_eps=clip_eps, vf_coef=vf_coef)  # fmt: skip
                grads = ppo_loss_backward(1.0, ppo_cache)[0]
                params = opt.step(params, grads)
        row.update(reward=float(scores.mean()), score=float(task.score(seqs_np).mean()),
                   kl=float(log_ratio.sum(axis=-1).mean()),
                   clip_fraction=float(ppo_cache["ppo"]["clip_fraction"]),
                   value_loss=float(ppo_cache["value_loss"]))  # fmt: skip
        log.append(row)
    return params, log


# ------------------------------------------------------------------------------------------------
# DPO


def dpo_loss_forward(params: dict, chosen, rejected, ref_chosen, ref_rejected, *, cfg: GPTConfig,
                     prompt_len: int, beta: float = 0.1):
    """chosen, rejected (N, P + L) ids, ref_chosen, ref_rejected (N,) the reference model's
    log-probabilities of the two completions -> (loss (), cache). One forward over the 2N
    sequences; a completion's log-probability is the sum of its tokens'."""
    xp = array_namespace(params["wte.weight"])
    N = chosen.shape[0]
    token_logp, lp_cache = completion_logprobs_forward(params, xp.concat([chosen, rejected]),
                                                       cfg=cfg, prompt_len=prompt_len)  # (2N, L)
    logp = xp.sum(token_logp, axis=-1)  # (2N,)
    loss, dpo_cache = dpo_forward(logp[:N], logp[N:], ref_chosen, ref_rejected, beta=beta)
    return loss, {"logprobs": lp_cache, "dpo": dpo_cache, "L": token_logp.shape[1]}


def dpo_loss_backward(dloss, cache):
    """dloss -> ({name: dparam}, dref_chosen (N,), dref_rejected (N,))."""
    xp = array_namespace(cache["dpo"]["chosen_rewards"])
    dchosen, drejected, dref_chosen, dref_rejected = dpo_backward(dloss, cache["dpo"])  # (N,)
    # logp = sum(token_logp, axis=-1): every token of a completion gets its gradient
    dlogp = xp.concat([dchosen, drejected])  # (2N,)
    dtoken = xp.broadcast_to(dlogp[:, None], (dlogp.shape[0], cache["L"]))  # (2N, L)
    grads = completion_logprobs_backward(dtoken, cache["logprobs"])
    return grads, dref_chosen, dref_rejected


def train_dpo(policy: dict, ref: dict, reward_fn, cfg: GPTConfig, task: ToyTask,
              pairs: PreferencePairs, *, steps: int = 100, batch_size: int = 16,
              beta: float = 0.1, lr: float = 1e-3, seed: int = 0, eval_prompts=None,
              eval_every: int = 25) -> tuple[dict, list[dict]]:
    """DPO on random minibatches of ``pairs`` (the reference log-probabilities computed once).
    ``reward_fn`` only scores the evaluations. Log rows: step, loss, the batch's accuracy of the
    implicit reward and its mean margin; every ``eval_every`` steps (and at the end) ``eval``
    as in ``train_ppo``."""
    P = task.prompt_len
    ref_chosen, ref_rejected = (sequence_logprobs(ref, s, cfg=cfg, prompt_len=P)
                                for s in (pairs.chosen, pairs.rejected))  # fmt: skip
    params = policy
    opt = AdamW(params, lr=lr, weight_decay=0.0)
    rng, log = np.random.default_rng(seed), []
    wte = params["wte.weight"]
    evaluate = None if eval_prompts is None else lambda: evaluate_policy(
        params, ref, reward_fn, cfg, task, eval_prompts, seed=seed + 1)
    for step in range(steps + 1):
        row = _start_row(log, {"step": step}, step, steps, eval_every, evaluate)
        if row is None:
            break
        pick = rng.integers(0, len(pairs), size=batch_size)
        loss, cache = dpo_loss_forward(params, _ids_like(pairs.chosen[pick], wte),
                                       _ids_like(pairs.rejected[pick], wte),
                                       asarray_like(ref_chosen[pick], wte),
                                       asarray_like(ref_rejected[pick], wte), cfg=cfg,
                                       prompt_len=P, beta=beta)  # fmt: skip
        params = opt.step(params, dpo_loss_backward(1.0, cache)[0])
        margin = to_numpy(cache["dpo"]["bt"]["margin"])
        row.update(loss=float(loss), accuracy=float(np.mean(margin > 0)),
                   margin=float(np.mean(margin)))  # fmt: skip
        log.append(row)
    return params, log


__all__ = [
    "ToyTask", "policy_config", "pretrain_policy", "sample_completions", "PreferencePairs",
    "make_preference_pairs", "init_head", "init_reward_model", "reward_forward",
    "reward_backward", "completion_logprobs_forward", "completion_logprobs_backward",
    "sequence_logprobs", "completion_kl", "train_reward_model", "rewards_of", "reward_accuracy",
    "gae", "ppo_loss_forward", "ppo_loss_backward", "evaluate_policy", "train_ppo",
    "dpo_loss_forward", "dpo_loss_backward", "train_dpo",
]  # fmt: skip
