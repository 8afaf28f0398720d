"""Learning from preferences (issue 15): the losses of the reward model, PPO and DPO against
independent torch formulations, their properties and errors, GAE against its definition, the
model-level gradients (reward head, PPO with a value head, DPO) against torch autograd, the
hidden-state gradient of gpt_backward, determinism, and tiny PPO and DPO runs that raise the
programmatic reward. The layers' finite-difference, autograd and backend checks are rows of
the CASES table in test_layers.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gptlab.autograd as ag
from gptlab.alignment import rlhf
from gptlab.gradcheck import check_layer
from gptlab.layers.bradley_terry import bradley_terry_backward, bradley_terry_forward
from gptlab.layers.dpo import dpo_backward, dpo_forward
from gptlab.layers.ppo import ppo_backward, ppo_forward
from gptlab.layers.token_logprobs import token_logprobs_forward
from gptlab.layers.value_loss import value_loss_forward
from gptlab.model import GPTConfig, gpt_backward, gpt_forward, init_params

F = torch.nn.functional
TEXT = "the cat sat on the mat; see the tree.\n" * 40  # a tiny corpus with a few characters


def _t(rng, *shape):
    return torch.tensor(rng.standard_normal(shape), requires_grad=True)


def _manual_and_reference(manual, reference, inputs):
    """Forward and grads of ``manual`` (an ``ag`` wrapper, hand-written backward) and of
    ``reference`` (plain torch, autograd) at the same inputs: both lists must agree."""
    a = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    b = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out_a, out_b = manual(*a), reference(*b)
    out_a.backward()
    out_b.backward()
    torch.testing.assert_close(out_a, out_b, rtol=1e-12, atol=1e-13)
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-11, atol=1e-13)


# --------------------------------------------------------------------------------------------
# The losses against independent torch formulations


def test_token_logprobs_is_log_softmax_gathered():
    rng = np.random.default_rng(0)
    logits, targets = _t(rng, 2, 3, 7), torch.tensor(rng.integers(0, 7, (2, 3)))
    dlogp = torch.tensor(rng.standard_normal((2, 3)))
    _manual_and_reference(
        lambda x, t: (ag.token_logprobs(x, t) * dlogp).sum(),
        lambda x, t: (F.log_softmax(x, -1).gather(-1, t[..., None])[..., 0] * dlogp).sum(),
        [logits, targets])


def test_bradley_terry_is_minus_logsigmoid():
    rng = np.random.default_rng(1)
    _manual_and_reference(ag.bradley_terry, lambda w, l: -F.logsigmoid(w - l).mean(),
                          [_t(rng, 6), _t(rng, 6)])  # fmt: skip


def test_dpo_is_rafailovs_eq7():
    rng = np.random.default_rng(2)
    beta = 0.3

    def reference(lw, ll, rw, rl):
        return -F.logsigmoid(beta * ((lw - rw) - (ll - rl))).mean()

    _manual_and_reference(lambda *a: ag.dpo(*a, beta=beta), reference,
                          [_t(rng, 5) for _ in range(4)])  # fmt: skip


@pytest.mark.parametrize("clip_eps", [0.1, 0.2])
def test_ppo_is_the_clipped_surrogate(clip_eps):
    rng = np.random.default_rng(3)
    old = torch.tensor(rng.standard_normal((4, 6)))
    logp = (old + torch.tensor(rng.uniform(-0.5, 0.5, (4, 6)))).requires_grad_()
    adv = _t(rng, 4, 6)

    def reference(lp, o, a):
        ratio = torch.exp(lp - o)
        return -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps) * a).mean()

    _manual_and_reference(lambda *a: ag.ppo(*a, clip_eps=clip_eps), reference, [logp, old, adv])


def test_value_loss_is_half_the_mse():
    rng = np.random.default_rng(4)
    _manual_and_reference(ag.value_loss, lambda v, r: 0.5 * F.mse_loss(v, r),
                          [_t(rng, 3, 5), _t(rng, 3, 5)])  # fmt: skip


# --------------------------------------------------------------------------------------------
# Properties


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-50, 50), min_size=1, max_size=8), st.floats(-20, 20))
def test_bradley_terry_sees_only_the_margin(margins, shift):
    """loss = mean softplus(-z) >= 0; adding the same constant to both rewards changes nothing;
    the gradients of the two sides are opposite and push the margin up."""
    z = np.array(margins)
    r_l = np.linspace(-1, 1, len(z))
    loss, cache = bradley_terry_forward(r_l + z, r_l)
    shifted, _ = bradley_terry_forward(r_l + z + shift, r_l + shift)
    assert loss >= 0 and loss == pytest.approx(np.mean(np.log1p(np.exp(-z))), rel=1e-9, abs=1e-12)
    assert shifted == pytest.approx(loss, rel=1e-9, abs=1e-12)
    dw, dl = bradley_terry_backward(1.0, cache)
    np.testing.assert_array_equal(dw, -dl)
    assert np.all(dw <= 0)  # descending the loss raises r_chosen


def test_bradley_terry_is_finite_for_huge_margins():
    loss, cache = bradley_terry_forward(np.array([1000.0, -1000.0]), np.array([0.0, 0.0]))
    assert loss == pytest.approx(500.0)  # softplus(-1000) = 0, softplus(1000) = 1000
    dw, _ = bradley_terry_backward(1.0, cache)
    np.testing.assert_allclose(dw, [0.0, -0.5], atol=1e-300)


def test_dpo_at_the_reference_is_log2_and_is_bradley_terry_of_implicit_rewards():
    rng = np.random.default_rng(5)
    lw, ll, rw, rl = (-1 - np.abs(rng.standard_normal(4)) for _ in range(4))
    loss0, _ = dpo_forward(rw, rl, rw, rl, beta=0.5)  # the policy is the reference
    assert loss0 == pytest.approx(math.log(2), rel=1e-14)
    loss, cache = dpo_forward(lw, ll, rw, rl, beta=0.5)
    bt, _ = bradley_terry_forward(0.5 * (lw - rw), 0.5 * (ll - rl))
    assert loss == pytest.approx(bt, rel=1e-14)
    dlw, dll, drw, drl = dpo_backward(1.0, cache)
    np.testing.assert_array_equal(dlw, -drw)
    np.testing.assert_array_equal(dll, -drl)
    assert np.all(dlw < 0) and np.all(dll > 0)  # raise the chosen, lower the rejected


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 0.5))
def test_ppo_gradient_vanishes_where_the_clip_wins(seed, clip_eps):
    """At ratio = 1 the loss is -mean(A) with dlogp = -A / n; wherever the clipped term is the
    min, logp gets no gradient; the share of such entries is the clip fraction."""
    rng = np.random.default_rng(seed)
    old, adv = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    loss, cache = ppo_forward(old, old, adv, clip_eps=clip_eps)
    assert loss == pytest.approx(-adv.mean(), rel=1e-12, abs=1e-14)
    np.testing.assert_allclose(ppo_backward(1.0, cache)[0], -adv / adv.size, rtol=1e-12)
    logp = old + rng.uniform(-1, 1, (3, 4))
    _, cache = ppo_forward(logp, old, adv, clip_eps=clip_eps)
    dlogp = ppo_backward(1.0, cache)[0]
    ratio = np.exp(logp - old)
    clipped = ((adv > 0) & (ratio > 1 + clip_eps)) | ((adv < 0) & (ratio < 1 - clip_eps))
    np.testing.assert_array_equal(dlogp[clipped], 0.0)
    assert np.all(dlogp[~clipped] != 0.0)
    assert float(cache["clip_fraction"]) == pytest.approx(clipped.mean())


def test_token_logprobs_of_every_token_sum_to_one():
    rng = np.random.default_rng(6)
    logits = rng.standard_normal((2, 5))
    every = np.stack([token_logprobs_forward(logits, np.full(2, v))[0] for v in range(5)])
    np.testing.assert_allclose(np.exp(every).sum(axis=0), 1.0, rtol=1e-14)


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("call, error, match", [
    (lambda: bradley_terry_forward(np.zeros(3), np.zeros(4)), ValueError, "r_rejected has shape"),
    (lambda: bradley_terry_forward(np.zeros((3, 1)), np.zeros((3, 1))), ValueError, "r_chosen"),
    (lambda: bradley_terry_forward(np.zeros(0), np.zeros(0)), ValueError, "no pairs"),
    (lambda: bradley_terry_forward(np.zeros(3, int), np.zeros(3)), TypeError, "r_chosen must be"),
    (lambda: bradley_terry_forward(np.zeros(3), np.zeros(3, np.float32)), TypeError, "dtype"),
    (lambda: dpo_forward(*[np.zeros(3)] * 4, beta=0.0), ValueError, "beta must be"),
    (lambda: dpo_forward(np.zeros(3), np.zeros(3), np.zeros(2), np.zeros(2)), ValueError,
     "ref_chosen has shape"),
    (lambda: ppo_forward(np.zeros(3), np.zeros(3), np.zeros(3), clip_eps=1.5), ValueError,
     "clip_eps"),
    (lambda: ppo_forward(np.zeros(3), np.zeros(4), np.zeros(3)), ValueError, "old_logp has shape"),
    (lambda: ppo_forward(np.zeros(3), np.zeros(3), np.zeros(3, int)), TypeError, "advantages"),
    (lambda: ppo_forward(np.zeros(0), np.zeros(0), np.zeros(0)), ValueError, "no actions"),
    (lambda: value_loss_forward(np.zeros(3), np.zeros((3, 1))), ValueError, "returns has shape"),
    (lambda: token_logprobs_forward(np.zeros((2, 5)), np.array([0, 5])), ValueError, "outside"),
    (lambda: token_logprobs_forward(np.zeros((2, 5)), np.zeros(2)), TypeError, "targets"),
    (lambda: rlhf.gae(np.zeros((2, 3)), np.zeros((2, 4))), ValueError, "same shape"),
    (lambda: rlhf.gae(np.zeros((2, 3)), np.zeros((2, 3)), lam=1.5), ValueError, "lam"),
    (lambda: rlhf.ToyTask.from_text(TEXT, preferred="Z"), ValueError, "preferred"),
    (lambda: rlhf.ToyTask.from_text(TEXT, prompt_len=0), ValueError, "prompt_len"),
])  # fmt: skip
def test_bad_input_gets_a_clear_error(call, error, match):
    with pytest.raises(error, match=match):
        call()


# --------------------------------------------------------------------------------------------
# GAE


def gae_by_definition(rewards, values, gamma, lam):
    """A_t = sum_{l >= 0} (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t, V_L = 0,
    as a double sum."""
    N, L = rewards.shape
    next_values = np.concatenate([values[:, 1:], np.zeros((N, 1))], axis=1)
    delta = rewards + gamma * next_values - values
    return np.stack([sum((gamma * lam) ** (k - t) * delta[:, k] for k in range(t, L))
                     for t in range(L)], axis=1)  # fmt: skip


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.integers(1, 7))
def test_gae_is_the_discounted_sum_of_td_errors(seed, gamma, lam, L):
    rng = np.random.default_rng(seed)
    rewards, values = rng.standard_normal((3, L)), rng.standard_normal((3, L))
    advantages, returns = rlhf.gae(rewards, values, gamma=gamma, lam=lam)
    np.testing.assert_allclose(advantages, gae_by_definition(rewards, values, gamma, lam),
                               rtol=1e-10, atol=1e-12)  # fmt: skip
    np.testing.assert_allclose(returns, advantages + values, rtol=1e-15)


def test_gae_limits_lam1_is_monte_carlo_and_lam0_is_one_step():
    rng = np.random.default_rng(7)
    rewards, values, gamma = rng.standard_normal((2, 5)), rng.standard_normal((2, 5)), 0.9
    _, returns = rlhf.gae(rewards, values, gamma=gamma, lam=1.0)
    discounted = np.stack([sum(gamma ** (k - t) * rewards[:, k] for k in range(t, 5))
                           for t in range(5)], axis=1)  # fmt: skip
    np.testing.assert_allclose(returns, discounted, rtol=1e-12)
    advantages, _ = rlhf.gae(rewards, values, gamma=gamma, lam=0.0)
    next_values = np.concatenate([values[:, 1:], np.zeros((2, 1))], axis=1)
    np.testing.assert_allclose(advantages, rewards + gamma * next_values - values, rtol=1e-12)


# --------------------------------------------------------------------------------------------
# Model-level gradients: heads on the GPT, against torch autograd in float64

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=6, block_size=7)
P, L, N = 3, 4, 3


def _seqs(rng, n=N):
    return rng.integers(0, CFG.vocab_size, (n, P + L))


def _with_random_head(name, seed):
    params = rlhf.init_head(init_params(CFG, seed, dtype="float64"), CFG, name)
    rng = np.random.default_rng(seed)
    params[f"{name}.weight"] = rng.standard_normal((CFG.n_embd, 1))
    params[f"{name}.bias"] = rng.standard_normal(1)
    return params


def test_gpt_backward_takes_the_gradient_at_the_final_hidden_states():
    """gpt_backward(cache, dlogits, dxf): the gradient of sum(logits * dlogits) + sum(xf * dxf)."""
    rng = np.random.default_rng(8)
    idx = rng.integers(0, CFG.vocab_size, (2, 5))
    dlogits, dxf = rng.standard_normal((2, 5, CFG.vocab_size)), rng.standard_normal((2, 5, 8))

    def forward(params, idx):
        logits, _, cache = gpt_forward(params, idx, CFG)
        xp = torch if isinstance(logits, torch.Tensor) else np
        flat = xp.concatenate([xp.reshape(logits, (-1,)), xp.reshape(cache["xf"], (-1,))])
        return flat, cache

    def backward(dout, cache):
        return (gpt_backward(cache, dout[: dlogits.size].reshape(dlogits.shape),
                             dout[dlogits.size :].reshape(dxf.shape)),)  # fmt: skip

    dout = np.concatenate([dlogits.ravel(), dxf.ravel()])
    params = init_params(CFG, 0, dtype="float64")
    check_layer(forward, backward, params, idx, oracle="autograd", dout=dout).assert_ok(1e-10)
    # dxf alone: the logits carry no loss
    _, _, cache = gpt_forward(params, idx, CFG)
    alone = gpt_backward(cache, dxf=dxf)
    with_zero = gpt_backward(cache, np.zeros_like(dlogits), dxf)
    for name in alone:
        np.testing.assert_array_equal(alone[name], with_zero[name])


def test_reward_model_gradient_matches_autograd():
    rm = _with_random_head("score", 1)
    result = check_layer(rlhf.reward_forward, rlhf.reward_backward, rm,
                         _seqs(np.random.default_rng(9)), oracle="autograd", cfg=CFG)
    result.assert_ok(1e-10)


def test_ppo_loss_gradient_matches_autograd_policy_and_value_head():
    rng = np.random.default_rng(10)
    params = _with_random_head("value", 2)
    seqs = _seqs(rng)
    old_logp, _ = rlhf.completion_logprobs_forward(params, seqs, cfg=CFG, prompt_len=P)
    old_logp = old_logp + rng.uniform(-0.4, 0.4, (N, L))  # ratios on both sides of the clip
    advantages, returns = rng.standard_normal((N, L)), rng.standard_normal((N, L))
    result = check_layer(rlhf.ppo_loss_forward, rlhf.ppo_loss_backward, params, seqs, old_logp,
                         advantages, returns, oracle="autograd", cfg=CFG, prompt_len=P,
                         clip_eps=0.2, vf_coef=0.5)  # fmt: skip
    result.assert_ok(1e-10)


def test_dpo_loss_gradient_matches_autograd():
    rng = np.random.default_rng(11)
    params = init_params(CFG, 3, dtype="float64")
    chosen, rejected = _seqs(rng), _seqs(rng)
    ref_c, ref_r = -3 - rng.random(N), -3 - rng.random(N)
    result = check_layer(rlhf.dpo_loss_forward, rlhf.dpo_loss_backward, params, chosen, rejected,
                         ref_c, ref_r, oracle="autograd", cfg=CFG, prompt_len=P, beta=0.5)
    result.assert_ok(1e-10)


def test_completion_logprobs_sum_to_the_sequence_logprob():
    """The completion's log-probability is the full sequence's minus the prompt's."""
    rng = np.random.default_rng(12)
    params, seqs = init_params(CFG, 4, dtype="float64"), _seqs(rng)
    logits, _, _ = gpt_forward(params, seqs[:, :-1], CFG)
    every, _ = token_logprobs_forward(logits, seqs[:, 1:])  # (N, P + L - 1)
    np.testing.assert_allclose(rlhf.sequence_logprobs(params, seqs, cfg=CFG, prompt_len=P),
                               every[:, P - 1 :].sum(-1), rtol=1e-13)  # fmt: skip


def test_completion_kl_is_zero_to_itself_and_positive_otherwise():
    seqs = _seqs(np.random.default_rng(13))
    a, b = init_params(CFG, 5, dtype="float64"), init_params(CFG, 6, dtype="float64")
    np.testing.assert_allclose(rlhf.completion_kl(a, a, seqs, cfg=CFG, prompt_len=P), 0.0,
                               atol=1e-15)  # fmt: skip
    assert np.all(rlhf.completion_kl(a, b, seqs, cfg=CFG, prompt_len=P) > 0)


# --------------------------------------------------------------------------------------------
# The toy task, determinism, and tiny runs that move the policy


@pytest.fixture(scope="module")
def toy():
    task = rlhf.ToyTask.from_text(TEXT, preferred="e", prompt_len=4, completion_len=8)
    cfg = rlhf.policy_config(task, n_layer=1, n_head=2, n_embd=16)
    policy, losses = rlhf.pretrain_policy(task, cfg, steps=60, batch_size=16, lr=1e-2, seed=0)
    assert losses[-1] < losses[0] - 0.5
    return task, cfg, policy


def test_task_scores_the_share_of_preferred_characters(toy):
    task, _, _ = toy
    seqs = np.array([task.tokenizer.encode("the eeee tt "), task.tokenizer.encode("thecat sat ")
                     + task.tokenizer.encode(" ")])  # fmt: skip
    np.testing.assert_allclose(task.score(seqs), [4 / 8, 0 / 8])
    assert task.decode(seqs[:1]) == [("the ", "eeee tt ")]


def test_sampling_and_pairs_are_fixed_by_the_seed(toy):
    task, cfg, policy = toy
    prompts = task.prompts(6, np.random.default_rng(0))
    a = rlhf.sample_completions(policy, cfg, prompts, 8, seed=3)
    np.testing.assert_array_equal(a, rlhf.sample_completions(policy, cfg, prompts, 8, seed=3))
    assert not np.array_equal(a, rlhf.sample_completions(policy, cfg, prompts, 8, seed=4))
    np.testing.assert_array_equal(a[:, :4], prompts)
    pairs = rlhf.make_preference_pairs(policy, cfg, task, 40, seed=1)
    again = rlhf.make_preference_pairs(policy, cfg, task, 40, seed=1)
    np.testing.assert_array_equal(pairs.chosen, again.chosen)
    assert np.all(pairs.score_chosen > pairs.score_rejected)
    np.testing.assert_array_equal(pairs.chosen[:, :4], pairs.rejected[:, :4])  # one prompt


def test_reward_model_learns_the_preference(toy):
    task, cfg, policy = toy
    pairs = rlhf.make_preference_pairs(policy, cfg, task, 300, seed=2)
    assert len(pairs) > 60
    train, held = pairs.split(len(pairs) // 2)
    rm = rlhf.init_reward_model(policy, cfg)
    assert rlhf.reward_accuracy(rm, cfg, held) == 0.0  # every reward 0: no pair ordered right
    rm, log = rlhf.train_reward_model(rm, cfg, train, steps=60, batch_size=16, lr=3e-3, seed=0)
    assert log[-1]["loss"] < log[0]["loss"] == pytest.approx(math.log(2))
    assert rlhf.reward_accuracy(rm, cfg, held) > 0.75


def test_tiny_ppo_run_raises_the_programmatic_reward_and_is_deterministic(toy):
    task, cfg, policy = toy
    prompts = task.prompts(32, np.random.default_rng(1), "eval")
    kwargs = dict(iterations=8, batch_size=16, beta=0.02, minibatch=8, lr=3e-3, seed=0,
                  eval_prompts=prompts, eval_every=8)  # fmt: skip
    params, log = rlhf.train_ppo(policy, policy, task.score, cfg, task, **kwargs)
    first, last = log[0]["eval"], log[-1]["eval"]
    assert first["kl"] == 0.0
    assert last["score"] > first["score"] + 0.1 and last["kl"] > 0
    again, _ = rlhf.train_ppo(policy, policy, task.score, cfg, task, **kwargs)
    for name in params:
        np.testing.assert_array_equal(params[name], again[name])


def test_tiny_dpo_run_raises_the_programmatic_reward(toy):
    task, cfg, policy = toy
    pairs = rlhf.make_preference_pairs(policy, cfg, task, 200, seed=3)
    prompts = task.prompts(32, np.random.default_rng(1), "eval")
    _, log = rlhf.train_dpo(policy, policy, task.score, cfg, task, pairs, steps=30,
                            batch_size=16, beta=0.5, lr=3e-3, seed=0, eval_prompts=prompts,
                            eval_every=30)  # fmt: skip
    assert log[0]["loss"] == pytest.approx(math.log(2))
    assert log[-1]["eval"]["score"] > log[0]["eval"]["score"] + 0.1
