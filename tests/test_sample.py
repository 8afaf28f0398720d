"""Sampling and the KV cache: cached decoding equals full recomputation, and the filters do what
they promise (greedy, temperature, top-k, top-p, stop token, seeds, bad inputs)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import GPTConfig, gpt_forward
from gptlab.backend import convert, make_generator, sample_categorical, to_numpy
from gptlab.model import param_shapes
from gptlab.training.sample import KVCache, forward_step, generate, next_token_distribution

BACKENDS = ["numpy", "torch"]


ARCHS = [("pre", "learned"), ("pre", "sinusoidal"), ("post", "learned"), ("post", "sinusoidal")]


def tiny_cfg(ln_order="pre", position="learned", bias=True):
    return GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8,
                     ln_order=ln_order, position=position, bias=bias)  # fmt: skip


def random_params(cfg, backend, seed=0):
    """float64 parameters far from GPT-2's tiny init, so that every position matters."""
    rng = np.random.default_rng(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        gain = 1.0 if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")) else 0.0
        params[name] = convert(gain + rng.normal(0.0, 0.5, shape), backend, dtype="float64")
    return params


def last_logits_full(params, cfg, ids):
    """Reference: gpt_forward on the last block_size ids -> logits of the last position (V,)."""
    window = np.asarray([ids[-cfg.block_size :]])  # (1, T)
    logits, _, _ = gpt_forward(params, convert(window, backend_of(params)), cfg)  # (1, T, V)
    return to_numpy(logits)[0, -1]


def backend_of(params):
    return "numpy" if isinstance(params["wte.weight"], np.ndarray) else "torch"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ln_order, position", ARCHS)
def test_kv_cache_logits_equal_full_forward_at_every_step(backend, ln_order, position, bias):
    cfg = tiny_cfg(ln_order, position, bias)
    params = random_params(cfg, backend)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, cfg.block_size))  # (B, T)
    cache, t = KVCache(), 0
    for n_new in (3, 1, 2, 1, 1):  # a prompt, single tokens, and a chunk of two
        new = convert(ids[:, t : t + n_new], backend)  # (B, Tn)
        t += n_new
        logits, cache = forward_step(params, cfg, new, cache)  # (B, V)
        full, _, _ = gpt_forward(params, convert(ids[:, :t], backend), cfg)  # (B, t, V)
        assert cache.length == t
        assert np.max(np.abs(to_numpy(logits) - to_numpy(full)[:, -1])) < 1e-12


def test_forward_step_refuses_to_grow_past_block_size():
    cfg = tiny_cfg()
    params = random_params(cfg, "numpy")
    _, cache = forward_step(params, cfg, np.zeros((1, cfg.block_size), dtype=np.int64), KVCache())
    with pytest.raises(ValueError, match="block_size"):
        forward_step(params, cfg, np.zeros((1, 1), dtype=np.int64), cache)


SAMPLING = [
    dict(greedy=True),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=4),
    dict(temperature=1.3, top_p=0.8),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ln_order, position", [ARCHS[0], ARCHS[3]])
@pytest.mark.parametrize("options", SAMPLING)
def test_same_tokens_with_and_without_cache_past_block_size(backend, ln_order, position, options):
    cfg = tiny_cfg(ln_order, position)
    params = random_params(cfg, backend)
    n_new = 2 * cfg.block_size  # the context is cropped, and the cache rebuilt, many times
    cached = generate(params, cfg, [1, 2, 3], n_new, seed=5, use_kv_cache=True, **options)
    uncached = generate(params, cfg, [1, 2, 3], n_new, seed=5, use_kv_cache=False, **options)
    assert cached == uncached
    assert len(cached) == 3 + n_new


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_picks_the_argmax_of_the_cropped_context(backend):
    cfg = tiny_cfg()
    params = random_params(cfg, backend)
    ids = generate(params, cfg, [4, 7], 2 * cfg.block_size, greedy=True)
    for t in range(2, len(ids)):
        assert ids[t] == int(np.argmax(last_logits_full(params, cfg, ids[:t])))


def test_temperature_zero_is_greedy():
    cfg = tiny_cfg()
    params = random_params(cfg, "numpy")
    greedy = generate(params, cfg, [1], 12, greedy=True)
    assert generate(params, cfg, [1], 12, temperature=0.0, seed=3) == greedy
    probs = next_token_distribution(np.array([[0.5, 2.0, -1.0]]), temperature=0.0)  # (1, V)
    np.testing.assert_array_equal(probs, [[0.0, 1.0, 0.0]])


def test_temperature_scales_the_logits():
    logits = np.array([1.0, 2.0, -0.5, 0.0])  # (V,)
    for temperature in (0.5, 1.0, 3.0):
        e = np.exp(logits / temperature)  # (V,)
        expected = e / e.sum()
        np.testing.assert_allclose(next_token_distribution(logits, temperature), expected,
                                   rtol=1e-14)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_keeps_exactly_k_tokens_even_with_ties(backend):
    logits = convert(np.array([[1.0, 3.0, 3.0, 3.0, 0.0, 2.0]]), backend)  # (1, V)
    for k in range(1, 7):
        probs = to_numpy(next_token_distribution(logits, top_k=k))[0]  # (V,)
        assert np.count_nonzero(probs) == k
        assert probs.sum() == pytest.approx(1.0, abs=1e-15)
    probs = to_numpy(next_token_distribution(logits, top_k=2))[0]
    np.testing.assert_allclose(probs, [0, 0.5, 0.5, 0, 0, 0])  # ties go to the lower ids


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_p_keeps_the_smallest_nucleus(backend):
    logits = convert(np.log(np.array([0.125, 0.5, 0.125, 0.25])), backend)  # (V,) exact in binary
    cases = {  # p -> the renormalised nucleus
        0.01: [0, 1, 0, 0],
        0.5: [0, 1, 0, 0],  # 0.5 >= 0.5: one token is enough
        0.7: [0, 2 / 3, 0, 1 / 3],
        0.75: [0, 2 / 3, 0, 1 / 3],
        0.8: [1 / 7, 4 / 7, 0, 2 / 7],  # 0.875 >= 0.8: of the tied 0.125s the lower id stays
        0.9: [0.125, 0.5, 0.125, 0.25],
        1.0: [0.125, 0.5, 0.125, 0.25],
    }
    for top_p, expected in cases.items():
        np.testing.assert_allclose(to_numpy(next_token_distribution(logits, top_p=top_p)),
                                   expected, atol=1e-15)  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), top_p=st.floats(0.01, 1.0), V=st.integers(1, 12))
def test_top_p_property_smallest_prefix_with_enough_mass(seed, top_p, V):
    logits = np.random.default_rng(seed).normal(0.0, 2.0, size=V)  # (V,)
    e = np.exp(logits - logits.max())
    full = e / e.sum()  # (V,)
    kept = next_token_distribution(logits, top_p=top_p) > 0  # (V,)
    n = int(kept.sum())
    order = np.argsort(-full, kind="stable")  # (V,)
    assert set(order[:n]) == set(np.flatnonzero(kept))  # the n most likely tokens
    assert full[order[:n]].sum() >= top_p - 1e-12 or n == V  # enough mass ...
    assert full[order[: n - 1]].sum() < top_p + 1e-12  # ... and one fewer is not enough


@pytest.mark.parametrize("backend", BACKENDS)
def test_top_k_then_top_p(backend):
    logits = convert(np.log(np.array([0.4, 0.3, 0.2, 0.1])), backend)  # (V,)
    # top-k=3 renormalises to [4/9, 3/9, 2/9, 0]; top-p=0.7 then needs 4/9 + 3/9 = 7/9 >= 0.7
    probs = to_numpy(next_token_distribution(logits, top_k=3, top_p=0.7))
    np.testing.assert_allclose(probs, [4 / 7, 3 / 7, 0, 0], atol=1e-15)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_categorical_follows_the_probabilities(backend):
    probs = convert(np.tile([0.1, 0.0, 0.6, 0.3], (20_000, 1)), backend, dtype="float64")  # (N, V)
    ids = to_numpy(sample_categorical(probs, make_generator(0, probs)))  # (N,)
    frequencies = np.bincount(ids, minlength=4) / ids.size
    assert frequencies[1] == 0.0
    np.testing.assert_allclose(frequencies, [0.1, 0.0, 0.6, 0.3], atol=0.015)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seeded_sampling_is_reproducible(backend):
    cfg = tiny_cfg()
    params = random_params(cfg, backend)
    runs = {seed: generate(params, cfg, [2, 3], 15, seed=seed) for seed in (0, 1, 2)}
    assert generate(params, cfg, [2, 3], 15, seed=1) == runs[1]
    assert len({tuple(run) for run in runs.values()}) > 1  # different seeds, different text


def test_prompt_can_be_an_array_of_any_backend():
    cfg = tiny_cfg()
    params = random_params(cfg, "torch")
    as_list = generate(params, cfg, [5, 6], 4, greedy=True)
    assert generate(params, cfg, np.array([5, 6]), 4, greedy=True) == as_list
    assert generate(params, cfg, convert([5, 6], "torch"), 4, greedy=True) == as_list


def test_long_prompt_is_cropped_to_the_context():
    cfg = tiny_cfg()
    params = random_params(cfg, "numpy")
    prompt = [i % cfg.vocab_size for i in range(3 * cfg.block_size)]
    ids = generate(params, cfg, prompt, 3, greedy=True)
    cropped = generate(params, cfg, prompt[-cfg.block_size :], 3, greedy=True)
    assert ids == prompt + cropped[cfg.block_size :]


def test_stop_token_ends_generation_and_is_kept():
    cfg = tiny_cfg()
    params = random_params(cfg, "numpy")
    prompt = [1, 2]
    free = generate(params, cfg, prompt, 20, seed=4)
    stop = free[len(prompt) + 3]
    first = free.index(stop, len(prompt))  # its first appearance among the generated tokens
    assert generate(params, cfg, prompt, 20, seed=4, stop_token=stop) == free[: first + 1]


def test_max_new_tokens_zero_returns_the_prompt():
    cfg = tiny_cfg()
    assert generate(random_params(cfg, "numpy"), cfg, [3, 4], 0) == [3, 4]


@pytest.mark.parametrize(
    "prompt, kwargs, match",
    [
        ([], {}, "non-empty"),
        ([[1, 2]], {}, "1-D"),
        ([1, 11], {}, "outside the vocabulary"),
        ([-1, 2], {}, "negative"),
        ([1], dict(max_new_tokens=-1), "max_new_tokens"),
        ([1], dict(temperature=-0.5), "temperature"),
        ([1], dict(temperature=math.nan), "temperature"),
        ([1], dict(top_k=0), "top_k"),
        ([1], dict(top_k=2.5), "top_k"),
        ([1], dict(top_p=0.0), "top_p"),
        ([1], dict(top_p=1.5), "top_p"),
        ([1], dict(stop_token=11), "stop_token"),
    ],
)
def test_bad_inputs_raise_clear_errors(prompt, kwargs, match):
    cfg = tiny_cfg()
    params = random_params(cfg, "numpy")
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(params, cfg, prompt, **kwargs)


def test_float_prompt_is_a_type_error():
    cfg = tiny_cfg()
    with pytest.raises(TypeError, match="prompt_ids"):
        generate(random_params(cfg, "numpy"), cfg, [1.0, 2.0], 3)


# --- model variants: RoPE offsets the new positions by the cache length; GQA caches NKV heads --

TINY_VARIANT = dict(n_layer=2, n_head=4, n_embd=16, vocab_size=11, block_size=8)
VARIANTS = {
    "llama-gqa": GPTConfig.llama(**TINY_VARIANT, n_kv_head=2, mlp_hidden=24),
    "llama-mqa-tied-post": GPTConfig.llama(**TINY_VARIANT, n_kv_head=1, mlp_hidden=24,
                                           tie_embeddings=True, ln_order="post"),
    "rmsnorm-swiglu-gqa-sinusoidal": GPTConfig(**TINY_VARIANT, norm="rmsnorm", mlp="swiglu",
                                               mlp_hidden=24, n_kv_head=2, bias=False,
                                               position="sinusoidal"),
    "layernorm-gelu-rope": GPTConfig(**TINY_VARIANT, position="rope", tie_embeddings=False),
    "llama-gqa-adjacent": GPTConfig.llama(**TINY_VARIANT, n_kv_head=2, mlp_hidden=24,
                                          rope_pairing="adjacent"),
    # experts without a capacity limit route every token on its own: the cache changes nothing
    "moe-top2": GPTConfig(**TINY_VARIANT, mlp="moe", n_expert=3, mlp_hidden=12),
    "moe-top1-llama-parts": GPTConfig(**TINY_VARIANT, mlp="moe", n_expert=4, expert_top_k=1,
                                      mlp_hidden=12, norm="rmsnorm", position="rope", n_kv_head=2),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_variants_kv_cache_logits_equal_full_forward(backend, name):
    cfg = VARIANTS[name]
    params = random_params(cfg, backend)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(2, cfg.block_size))  # (B, T)
    cache, t = KVCache(), 0
    for n_new in (3, 1, 2, 1, 1):
        new = convert(ids[:, t : t + n_new], backend)  # (B, Tn)
        t += n_new
        logits, cache = forward_step(params, cfg, new, cache)  # (B, V)
        full, _, _ = gpt_forward(params, convert(ids[:, :t], backend), cfg)  # (B, t, V)
        assert cache.length == t
        assert all(tuple(k.shape) == (2, cfg.kv_heads, t, cfg.head_size) for k in cache.k + cache.v)
        assert np.max(np.abs(to_numpy(logits) - to_numpy(full)[:, -1])) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("options", [SAMPLING[0], SAMPLING[2]])
def test_variants_same_tokens_with_and_without_cache(backend, name, options):
    cfg = VARIANTS[name]
    params = random_params(cfg, backend)
    n_new = 2 * cfg.block_size  # past the context: the cache is rebuilt from cropped windows
    cached = generate(params, cfg, [1, 2, 3], n_new, seed=5, use_kv_cache=True, **options)
    assert cached == generate(params, cfg, [1, 2, 3], n_new, seed=5, use_kv_cache=False, **options)
    assert len(cached) == 3 + n_new


@pytest.mark.parametrize("options", [SAMPLING[0], SAMPLING[3]])
def test_experts_with_a_capacity_generate_the_same_tokens_with_and_without_cache(options):
    """Generation lifts the capacity limit: a cached step routes fewer tokens at once than a
    full forward, and would otherwise drop others."""
    cfg = GPTConfig(**TINY_VARIANT, mlp="moe", n_expert=3, expert_top_k=1, capacity_factor=0.5,
                    mlp_hidden=12)  # fmt: skip
    params = random_params(cfg, "torch")
    cached = generate(params, cfg, [1, 2, 3], 12, seed=5, use_kv_cache=True, **options)
    assert cached == generate(params, cfg, [1, 2, 3], 12, seed=5, use_kv_cache=False, **options)
    unlimited = GPTConfig(**{**cfg.to_dict(), "capacity_factor": None})
    assert cached == generate(params, unlimited, [1, 2, 3], 12, seed=5, **options)
