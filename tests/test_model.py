"""The whole model (gpt_forward / gpt_backward) against the independent torch-autograd reference."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from bounds import assert_relative, assert_within, model_roundoff

from gptlab import GPTConfig, count_params, gpt_backward, gpt_forward, init_params, param_shapes
from gptlab.backend import convert, to_numpy
from gptlab.reference.torch_gpt import reference_forward, relative_error

TINY = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)
CONFIGS = [
    GPTConfig(**TINY, ln_order=ln, position=pos, gelu=gelu, bias=bias)
    for ln, pos, gelu, bias in itertools.product(("pre", "post"), ("learned", "sinusoidal"),
                                                 ("tanh", "none"), (True, False))
]
CONFIG_IDS = [f"{c.ln_order}-{c.position}-{c.gelu}{'' if c.bias else '-nobias'}" for c in CONFIGS]
BACKENDS = ("numpy", "torch")


def random_params(cfg, seed=0):
    """GPT-2's init plus N(0, 0.2) noise everywhere, so biases and gains are exercised: float64."""
    rng = np.random.default_rng(seed + 1)
    return {name: value + rng.normal(0.0, 0.2, value.shape)
            for name, value in init_params(cfg, seed, dtype="float64").items()}  # fmt: skip


def random_tokens(cfg, B, T, seed=0):
    """(idx, targets), both (B, T) int64."""
    rng = np.random.default_rng(seed)
    return tuple(rng.integers(0, cfg.vocab_size, size=(B, T)) for _ in range(2))


def reference(params, idx, cfg, targets=None, dlogits=None):
    """The oracle in float64: (logits, loss, grads by name) of loss, or of sum(logits * dlogits)."""
    leaves = {name: torch.tensor(value, dtype=torch.float64, requires_grad=True)
              for name, value in params.items()}  # fmt: skip
    tg = None if targets is None else torch.as_tensor(targets)
    logits, loss = reference_forward(leaves, torch.as_tensor(idx), cfg, tg)
    objective = loss if dlogits is None else (logits * torch.as_tensor(dlogits)).sum()
    objective.backward()
    return logits, loss, {name: leaf.grad for name, leaf in leaves.items()}


def ours(params, idx, cfg, targets=None, dlogits=None, backend="numpy", dtype="float64"):
    """gptlab on ``backend``: (logits, loss, grads by name)."""
    p = {name: convert(value, backend, dtype=dtype) for name, value in params.items()}
    tg = None if targets is None else convert(targets, backend)
    logits, loss, cache = gpt_forward(p, convert(idx, backend), cfg, tg)
    dl = None if dlogits is None else convert(dlogits, backend, dtype=dtype)
    return logits, loss, gpt_backward(cache, dl)


def assert_close(got, want, tol, what):
    if relative_error(want, torch.zeros(())) < 1e-14:  # round-off around an exact zero (the
        want = torch.zeros(())  # router of a top-1 MoE gets no gradient through its gate of 1)
    err = relative_error(got, want)
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol:.0e}"


def assert_float32_close(got, want, bound, label, what):
    """A float32 result within ``bound`` of the float64 reference, relative to its size (an
    exact zero's round-off, as in assert_close, absolutely)."""
    if relative_error(want, torch.zeros(())) < 1e-14:
        assert_within(got, 0.0, bound, label, what)
    else:
        assert_relative(got, want, bound, label, what)


def assert_all_close(got, want, cfg, tol):
    logits, loss, grads = got
    ref_logits, ref_loss, ref_grads = want
    assert_close(logits, ref_logits, tol, "logits")
    if ref_loss is not None:
        assert_close(loss, ref_loss, tol, "loss")
    assert list(grads) == list(param_shapes(cfg))
    for name in grads:
        assert tuple(grads[name].shape) == tuple(ref_grads[name].shape), name
        assert_close(grads[name], ref_grads[name], tol, f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_matches_reference_float64(cfg, backend):
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, B=3, T=cfg.block_size)
    got = ours(params, idx, cfg, targets, backend=backend)
    assert_all_close(got, reference(params, idx, cfg, targets), cfg, 1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS[::3], ids=CONFIG_IDS[::3])
def test_dlogits_path_matches_reference(cfg, backend):
    """gpt_backward(cache, dlogits): the gradient of sum(logits * dlogits), without a loss."""
    params = random_params(cfg)
    idx, _ = random_tokens(cfg, B=2, T=5)
    dlogits = np.random.default_rng(3).normal(size=(2, 5, cfg.vocab_size))
    got = ours(params, idx, cfg, dlogits=dlogits, backend=backend)
    assert got[1] is None
    assert_all_close(got, reference(params, idx, cfg, dlogits=dlogits), cfg, 1e-10)


@pytest.mark.roundoff
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cfg", CONFIGS[::5], ids=CONFIG_IDS[::5])
def test_float32_logits(cfg, backend):
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, B=3, T=cfg.block_size)
    logits, loss, grads = ours(params, idx, cfg, targets, backend=backend, dtype="float32")
    ref_logits, ref_loss, ref_grads = reference(params, idx, cfg, targets)
    assert str(logits.dtype).endswith("float32")
    bound = model_roundoff(cfg, 3, cfg.block_size)
    label = "float32 model vs float64 reference"
    assert_float32_close(logits, ref_logits, bound, label, "logits")
    assert_float32_close(loss, ref_loss, bound, label, "loss")
    for name in grads:
        assert_float32_close(grads[name], ref_grads[name], bound, label, f"d{name}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B, T", [(1, 1), (2, 1), (1, 8), (4, 3)])
@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[-1]], ids=[CONFIG_IDS[0], CONFIG_IDS[-1]])
def test_batch_and_sequence_edges(cfg, B, T, backend):
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, B, T)
    got = ours(params, idx, cfg, targets, backend=backend)
    assert tuple(got[0].shape) == (B, T, cfg.vocab_size)
    assert_all_close(got, reference(params, idx, cfg, targets), cfg, 1e-10)


@settings(max_examples=15, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 8), seed=st.integers(0, 2**16),
       cfg=st.sampled_from(CONFIGS))  # fmt: skip
def test_property_any_shape(B, T, seed, cfg):
    params = random_params(cfg, seed)
    idx, targets = random_tokens(cfg, B, T, seed)
    assert_all_close(ours(params, idx, cfg, targets), reference(params, idx, cfg, targets), cfg, 1e-10)


def test_dropout_config_in_evaluation_matches_reference():
    """cfg.dropout > 0 without a dropout_seed is evaluation: no dropout, as the reference."""
    cfg = GPTConfig(**TINY, dropout=0.3)
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, 2, 6)
    assert_all_close(ours(params, idx, cfg, targets), reference(params, idx, cfg, targets), cfg, 1e-10)


def test_reference_refuses_training_with_dropout():
    cfg = GPTConfig(**TINY, dropout=0.1)
    params = {name: torch.as_tensor(v) for name, v in random_params(cfg).items()}
    idx = torch.zeros((1, 2), dtype=torch.int64)
    with pytest.raises(ValueError, match="no dropout"):
        reference_forward(params, idx, cfg, training=True)


def test_reference_sinusoidal_table_is_independent_but_equal():
    from gptlab.layers.position_sinusoidal import sinusoidal_encoding
    from gptlab.reference.torch_gpt import sinusoidal_table

    table = sinusoidal_table(7, 6, dtype=torch.float64)
    assert table[3, 4].item() == pytest.approx(np.sin(3 / 10000 ** (4 / 6)), rel=1e-14)
    assert table[5, 1].item() == pytest.approx(np.cos(5.0), rel=1e-14)
    assert_close(sinusoidal_encoding(7, 6, like=np.zeros(1)), table, 1e-14, "sinusoidal table")


# --- bad inputs: clear errors that name the problem -------------------------------------------


@pytest.fixture(params=BACKENDS)
def setup(request):
    cfg = CONFIGS[0]
    params = {name: convert(v, request.param) for name, v in random_params(cfg).items()}
    idx, targets = (convert(a, request.param) for a in random_tokens(cfg, 2, 4))
    return cfg, params, idx, targets, request.param


def test_rejects_float_idx(setup):
    cfg, params, idx, _, backend = setup
    with pytest.raises(TypeError, match="idx must be an integer array"):
        gpt_forward(params, convert(to_numpy(idx).astype(np.float64), backend), cfg)


def test_rejects_ids_outside_the_vocabulary(setup):
    cfg, params, idx, _, backend = setup
    too_big = convert(np.full((2, 4), cfg.vocab_size), backend)
    with pytest.raises(ValueError, match=f"idx holds token id {cfg.vocab_size}, outside the vocab"):
        gpt_forward(params, too_big, cfg)
    with pytest.raises(ValueError, match="negative token id"):
        gpt_forward(params, convert(np.full((2, 4), -1), backend), cfg)


def test_rejects_sequence_longer_than_block_size(setup):
    cfg, params, _, _, backend = setup
    idx = convert(np.zeros((1, cfg.block_size + 1), dtype=np.int64), backend)
    with pytest.raises(ValueError, match=r"sequence length 9 is longer .*block_size=8"):
        gpt_forward(params, idx, cfg)


def test_rejects_idx_that_is_not_2d(setup):
    cfg, params, idx, _, _ = setup
    with pytest.raises(ValueError, match=r"idx must have shape \(B, T\)"):
        gpt_forward(params, idx[0], cfg)


def test_rejects_mismatched_targets(setup):
    cfg, params, idx, targets, _ = setup
    with pytest.raises(ValueError, match=r"targets has shape \(2, 3\), idx has \(2, 4\)"):
        gpt_forward(params, idx, cfg, targets[:, :3])


def test_rejects_missing_and_unexpected_params(setup):
    cfg, params, idx, _, _ = setup
    missing = {name: v for name, v in params.items() if name != "h.1.ln_2.bias"}
    with pytest.raises(ValueError, match=r"missing \['h.1.ln_2.bias'\]"):
        gpt_forward(missing, idx, cfg)
    with pytest.raises(ValueError, match=r"unexpected \['h.2.ln_1.weight'\]"):
        gpt_forward({**params, "h.2.ln_1.weight": params["ln_f.weight"]}, idx, cfg)


def test_rejects_misshapen_params(setup):
    cfg, params, idx, _, _ = setup
    bad = {**params, "h.0.attn.c_attn.weight": params["h.0.attn.c_attn.weight"][:, :16]}
    with pytest.raises(ValueError, match=r"h.0.attn.c_attn.weight has shape \(8, 16\), expected \(8, 24\)"):
        gpt_forward(bad, idx, cfg)


def test_gpt_backward_without_loss_or_dlogits(setup):
    cfg, params, idx, _, _ = setup
    _, _, cache = gpt_forward(params, idx, cfg)
    with pytest.raises(ValueError, match="pass targets"):
        gpt_backward(cache)


def test_config_rejects_n_embd_not_divisible_by_n_head():
    with pytest.raises(ValueError, match=r"n_embd \(10\) must be divisible by n_head \(3\)"):
        GPTConfig(n_layer=1, n_head=3, n_embd=10, vocab_size=11, block_size=8)


# --- model variants: LLaMA's parts (RMSNorm, SwiGLU, RoPE, grouped-query attention, untied head)


VARIANTS = {
    "llama-gqa": GPTConfig.llama(n_layer=2, n_head=4, n_embd=16, vocab_size=11, block_size=8,
                                 n_kv_head=2, mlp_hidden=20),
    "llama-mqa": GPTConfig.llama(**TINY, n_kv_head=1, mlp_hidden=12),
    "llama-mha-tied": GPTConfig.llama(**TINY, mlp_hidden=12, tie_embeddings=True),
    "rmsnorm-gelu-sinusoidal-post": GPTConfig(**TINY, norm="rmsnorm", position="sinusoidal",
                                              ln_order="post"),
    "layernorm-swiglu-gqa-learned-nobias": GPTConfig(**TINY, mlp="swiglu", mlp_hidden=12,
                                                     n_kv_head=1, bias=False),
    "layernorm-gelu-rope-post-untied": GPTConfig(**TINY, position="rope", ln_order="post",
                                                 tie_embeddings=False, gelu="erf"),
    "moe-top2": GPTConfig(**TINY, mlp="moe", n_expert=4, aux_loss_weight=0.1),
    "moe-top1-capacity-rmsnorm-rope-mqa": GPTConfig(**TINY, mlp="moe", n_expert=3, expert_top_k=1,
                                                    capacity_factor=1.0, aux_loss_weight=0.05,
                                                    norm="rmsnorm", position="rope", n_kv_head=1,
                                                    tie_embeddings=False, mlp_hidden=12),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", VARIANTS)
def test_variants_match_reference_float64(name, backend):
    """Logits, loss and every gradient by name against the independent torch reference."""
    cfg = VARIANTS[name]
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, B=3, T=cfg.block_size)
    got = ours(params, idx, cfg, targets, backend=backend)
    assert_all_close(got, reference(params, idx, cfg, targets), cfg, 1e-10)


@pytest.mark.roundoff
@pytest.mark.parametrize("name", VARIANTS)
def test_variants_dlogits_path_and_float32(name):
    cfg = VARIANTS[name]
    params = random_params(cfg)
    idx, targets = random_tokens(cfg, B=2, T=5)
    dlogits = np.random.default_rng(3).normal(size=(2, 5, cfg.vocab_size))
    got = ours(params, idx, cfg, dlogits=dlogits, backend="torch")
    assert_all_close(got, reference(params, idx, cfg, dlogits=dlogits), cfg, 1e-10)
    logits, loss, grads = ours(params, idx, cfg, targets, backend="numpy", dtype="float32")
    ref_logits, ref_loss, ref_grads = reference(params, idx, cfg, targets)
    assert logits.dtype == np.float32
    bound, label = model_roundoff(cfg, 2, 5), "float32 variant vs float64 reference"
    assert_float32_close(logits, ref_logits, bound, label, "logits")
    for name_ in grads:
        assert_float32_close(grads[name_], ref_grads[name_], bound, label, f"d{name_}")


@settings(max_examples=10, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 8), seed=st.integers(0, 2**16),
       name=st.sampled_from(list(VARIANTS)))  # fmt: skip
def test_property_variants_any_shape(B, T, seed, name):
    cfg = VARIANTS[name]
    params = random_params(cfg, seed)
    idx, targets = random_tokens(cfg, B, T, seed)
    got = ours(params, idx, cfg, targets)
    assert_all_close(got, reference(params, idx, cfg, targets), cfg, 1e-10)


def test_llama_parameter_names_and_shapes():
    """LLaMA's parts under names that say what they are, in the (in, out) layout."""
    cfg = VARIANTS["llama-gqa"]  # C = 16, NH = 4, NKV = 2, hs = 4, H = 20, V = 11
    assert param_shapes(cfg) == {
        "wte.weight": (11, 16),
        **{name: shape for layer in range(2) for name, shape in {
            f"h.{layer}.ln_1.weight": (16,),
            f"h.{layer}.attn.q_proj.weight": (16, 16),
            f"h.{layer}.attn.k_proj.weight": (16, 8),
            f"h.{layer}.attn.v_proj.weight": (16, 8),
            f"h.{layer}.attn.o_proj.weight": (16, 16),
            f"h.{layer}.ln_2.weight": (16,),
            f"h.{layer}.mlp.gate_proj.weight": (16, 20),
            f"h.{layer}.mlp.up_proj.weight": (16, 20),
            f"h.{layer}.mlp.down_proj.weight": (20, 16),
        }.items()},
        "ln_f.weight": (16,),
        "lm_head.weight": (16, 11),
    }  # fmt: skip
    C, V, L, H, kv = 16, 11, 2, 20, 8
    assert count_params(cfg) == V * C + L * (2 * C + 2 * C * C + 2 * C * kv + 3 * C * H) + C + C * V


def test_llama_preset_and_init():
    cfg = GPTConfig.llama(n_layer=32, n_head=32, n_embd=4096, vocab_size=32000, block_size=2048)
    assert (cfg.norm, cfg.mlp, cfg.position, cfg.bias, cfg.tie_embeddings) == (
        "rmsnorm", "swiglu", "rope", False, False)
    assert cfg.kv_heads == cfg.n_kv_head == 32 and cfg.grouped_attention
    assert cfg.mlp_hidden_size == 11008 and cfg.layer_norm_epsilon == 1e-6  # LLaMA-7B's
    assert 6.7e9 < count_params(cfg) < 6.8e9  # "LLaMA 7B": 6.74 billion
    tiny = VARIANTS["llama-gqa"]
    params = init_params(tiny, seed=0, dtype="float64")
    assert np.all(params["h.1.ln_2.weight"] == 1.0) and np.all(params["ln_f.weight"] == 1.0)
    std = {name: float(np.std(params[name])) for name in ("h.0.attn.o_proj.weight",
                                                          "h.0.mlp.down_proj.weight",
                                                          "h.0.mlp.up_proj.weight")}  # fmt: skip
    assert std["h.0.attn.o_proj.weight"] < 0.7 * std["h.0.mlp.up_proj.weight"]  # 1/sqrt(2L)
    assert std["h.0.mlp.down_proj.weight"] < 0.7 * std["h.0.mlp.up_proj.weight"]


def test_default_config_is_gpt2():
    """The new fields default to GPT-2's model: the same names, shapes and initial values."""
    cfg = GPTConfig(**TINY)
    assert (cfg.norm, cfg.mlp, cfg.position, cfg.n_kv_head) == ("layernorm", "gelu", "learned", None)
    assert cfg.tie_embeddings and cfg.bias
    assert not cfg.grouped_attention and cfg.kv_heads == 2 and cfg.mlp_hidden_size == 32
    assert list(param_shapes(cfg))[:4] == ["wte.weight", "wpe.weight", "h.0.ln_1.weight",
                                           "h.0.ln_1.bias"]
    assert "lm_head.weight" not in param_shapes(cfg)


@pytest.mark.parametrize("fields, message", [
    (dict(norm="batchnorm"), r"GPTConfig.norm must be one of \('layernorm', 'rmsnorm'\)"),
    (dict(mlp="relu"), r"GPTConfig.mlp must be one of \('gelu', 'swiglu', 'moe'\)"),
    (dict(position="alibi"), r"GPTConfig.position must be one of \('learned', .*'rope'\)"),
    (dict(n_kv_head=0), "GPTConfig.n_kv_head must be a positive integer or None, got 0"),
    (dict(n_head=4, n_kv_head=3), r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
    (dict(mlp_hidden=2.5), "GPTConfig.mlp_hidden must be a positive integer or None, got 2.5"),
    (dict(n_head=4, n_embd=12, position="rope"), "head size n_embd // n_head = 3 must be even"),
    (dict(position="rope", rope_base=0.0), "GPTConfig.rope_base must be a positive number"),
    (dict(tie_embeddings="no"), "GPTConfig.tie_embeddings must be True or False, got 'no'"),
    (dict(norm="rmsnorm", mlp="swiglu", n_kv_head=2), "bias=True, but RMSNorm, SwiGLU and "
                                                      "LLaMA's attention have no biases"),
])  # fmt: skip
def test_config_rejects_bad_variants(fields, message):
    with pytest.raises(ValueError, match=message):
        GPTConfig(**{**TINY, **fields})
