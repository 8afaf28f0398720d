"""GPT-3's calculator and the scaling-law helpers (gptlab.training.scaling).

- parameters: the closed form equals count_params over many shapes (hypothesis), GPT-2 small's
  published 124,439,808, the eight models of Brown et al. (2020) Table 2.1 within the table's
  rounding, and the two rows whose heads do not split d_model;
- compute: FLOPs per token and 6ND on hand-computed cases, GPT-3's 3.14e23, the time formula;
- memory: the ZeRO stages against Rajbhandari et al.'s Figure 1 (7.5B parameters, 64 ranks),
  padding, what tensor and pipeline degrees divide, Korthikanti et al.'s activation formulas;
- scaling laws: a power law and one with an irreducible term recovered from exact data,
  Chinchilla's split;
- bad input raises a clear error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab import GPTConfig
from gptlab.model import count_params
from gptlab.training.scaling import (
    GPT3_MODELS,
    activation_bytes_per_layer,
    architecture_params,
    chinchilla_optimal,
    fit_power_law,
    flops_per_token,
    gpt3_config,
    gpt3_table,
    memory_per_device,
    non_embedding_params,
    params_closed_form,
    power_law,
    training_flops,
    training_seconds,
    zero_memory_per_rank,
)

GPT3_175B = GPTConfig(n_layer=96, n_head=96, n_embd=12288, vocab_size=50257, block_size=2048)


# ---------------------------------------------------------------- parameters

@settings(max_examples=40, deadline=None, derandomize=True, database=None)
@given(n_layer=st.integers(1, 6), n_head=st.integers(1, 4), head_size=st.integers(1, 8),
       vocab_size=st.integers(1, 300), block_size=st.integers(1, 64))
def test_closed_form_equals_count_params(n_layer, n_head, head_size, vocab_size, block_size):
    d = n_head * head_size
    cfg = GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=d, vocab_size=vocab_size,
                    block_size=block_size)
    assert params_closed_form(n_layer, d, vocab_size, block_size) == count_params(cfg)
    assert architecture_params(n_layer, d, vocab_size, block_size) == count_params(cfg)
    assert non_embedding_params(cfg) == count_params(cfg) - (vocab_size + block_size) * d


def test_gpt2_small_published_count():
    # GPT-2 small (12 layers, width 768, vocabulary 50257, context 1024): 124,439,808 parameters,
    # the figure Hugging Face's GPT2Model reports
    assert params_closed_form(12, 768, 50257, 1024) == 124_439_808


def test_gpt3_table_within_its_rounding():
    """The table prints at most three significant figures and rounds loosely (Medium, 355.9M,
    is printed 350M, as GPT-2 medium was called 345M): every row within 2%."""
    rows = {row["name"]: row for row in gpt3_table()}
    assert len(rows) == 8
    for row in rows.values():
        assert abs(row["relative_error"]) < 0.02, row
    assert rows["GPT-3 175B"]["n_params_computed"] == 174_604_259_328
    assert round(rows["GPT-3 Small"]["n_params_computed"], -6) == 125e6
    assert round(rows["GPT-3 Large"]["n_params_computed"], -7) == 760e6
    for name in ("GPT-3 XL", "GPT-3 2.7B", "GPT-3 6.7B"):  # printed to 0.1B
        assert round(rows[name]["n_params_computed"], -8) == dict(
            (m.name, m.n_params) for m in GPT3_MODELS)[name]
    inconsistent = [name for name, row in rows.items() if not row["heads_consistent"]]
    assert inconsistent == ["GPT-3 XL", "GPT-3 13B"]


def test_gpt3_13b_width_5140_fits_the_table_better_than_5120():
    # 40 heads of 128 give 5120, but the printed 5140 reproduces the printed 13.0B more closely
    printed, split = architecture_params(40, 5140), architecture_params(40, 5120)
    assert abs(printed - 13.0e9) < abs(split - 13.0e9)
    assert round(printed, -8) == 13.0e9


def test_gpt3_config():
    cfg = gpt3_config("GPT-3 175B")
    assert cfg == GPT3_175B
    assert count_params(cfg) == architecture_params(96, 12288)
    with pytest.raises(ValueError, match="24 x 128 = 3072, not d_model = 2048"):
        gpt3_config("GPT-3 XL")
    with pytest.raises(ValueError, match="name must be one of"):
        gpt3_config("GPT-4")


# ---------------------------------------------------------------- compute and time

def test_flops_per_token_hand_case():
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=10, block_size=4)
    # non-embedding: 2 blocks of 12 * 64 + 13 * 8 = 872, plus ln_f 16 -> 1760
    assert non_embedding_params(cfg) == 1760
    assert flops_per_token(cfg, attention=False) == 6 * 1760
    assert flops_per_token(cfg) == 6 * 1760 + 6 * 2 * 4 * 8  # + 6 L T d


def test_gpt3_training_compute():
    n = architecture_params(96, 12288)
    assert f"{training_flops(n, 300e9):.2e}" == "3.14e+23"  # Brown et al. (2020), Table D.1
    assert training_flops(2.0, 5.0) == 60.0
    # the attention term adds 6 L T d = 96 * 2048 * 12288 * 6 per token, about 1.4% for GPT-3
    ratio = flops_per_token(GPT3_175B) / flops_per_token(GPT3_175B, attention=False)
    assert ratio == pytest.approx(1 + 96 * 2048 * 12288 / non_embedding_params(GPT3_175B))


def test_training_seconds():
    assert training_seconds(6e20, 100, 1e15, 0.5) == pytest.approx(12_000.0)
    assert training_seconds(6e20, 200, 1e15, 0.5) == pytest.approx(6_000.0)


# ---------------------------------------------------------------- memory

def test_zero_stages_against_the_paper():
    # Rajbhandari et al. (2020), Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam
    # (2 + 2 + 12 bytes): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB for stages 0 to 3
    gb = [zero_memory_per_rank(7_500_000_000, 64, stage, param_bytes=2, grad_bytes=2,
                               optimizer_bytes=12)["total"] / 1e9 for stage in range(4)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_zero_stages_split_and_sum():
    n, ranks = 1000, 4
    expected = {0: (4000, 4000, 8000), 1: (4000, 4000, 2000), 2: (4000, 1000, 2000),
                3: (1000, 1000, 2000)}
    for stage, (params, grads, optimizer) in expected.items():
        mem = zero_memory_per_rank(n, ranks, stage)
        assert (mem["params"], mem["grads"], mem["optimizer"]) == (params, grads, optimizer)
        assert mem["total"] == params + grads + optimizer
    assert zero_memory_per_rank(n, 1, 3) == zero_memory_per_rank(n, 1, 0)
    # 10 values over 4 ranks: shards of ceil(10 / 4) = 3, padded
    assert zero_memory_per_rank(10, 4, 3, param_bytes=1, grad_bytes=1, optimizer_bytes=1) == {
        "params": 3, "grads": 3, "optimizer": 3, "total": 9}


def test_activations_korthikanti():
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s // h)
    for t in (1, 2, 4, 8):
        expected = s * b * h * 10 + s * b * h * 24 // t + 5 * a * s * s * b // t
        assert activation_bytes_per_layer(s, b, h, a, tensor_parallel=t) == expected
    assert activation_bytes_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h
    # float32, no dropout: 4 * (4 + 12) s b h + 2 * 4 a s^2 b
    assert activation_bytes_per_layer(64, 3, 32, 4, value_bytes=4, dropout_masks=False) == (
        64 * 3 * 32 * 64 + 4 * 64 * 64 * 3 * 8)


def test_memory_per_device_divides_what_it_should():
    base = memory_per_device(GPT3_175B, micro_batch=1)
    n = count_params(GPT3_175B)
    assert (base["params"], base["grads"], base["optimizer"]) == (2 * n, 2 * n, 12 * n)
    assert base["activations"] == 96 * activation_bytes_per_layer(2048, 1, 12288, 96)
    assert base["total"] == sum(base[k] for k in ("params", "grads", "optimizer", "activations"))

    tp = memory_per_device(GPT3_175B, micro_batch=1, tensor_parallel=8)
    pp = memory_per_device(GPT3_175B, micro_batch=1, pipeline_parallel=8)
    both = memory_per_device(GPT3_175B, micro_batch=1, tensor_parallel=8, pipeline_parallel=8)
    assert tp["params"] == pp["params"] == 2 * math.ceil(n / 8)
    assert both["params"] == 2 * math.ceil(n / 64)
    assert tp["activations"] == both["activations"] < base["activations"]
    assert pp["activations"] == base["activations"]  # 1F1B: p micro-batches of L / p layers

    dp = memory_per_device(GPT3_175B, micro_batch=1, data_parallel=16, zero_stage=0)
    assert dp["total"] == base["total"]  # plain data parallel replicates everything
    zero = memory_per_device(GPT3_175B, micro_batch=1, data_parallel=16, zero_stage=3,
                             tensor_parallel=8)
    assert zero["params"] == 2 * math.ceil(math.ceil(n / 8) / 16)
    full = memory_per_device(GPT3_175B, micro_batch=1, recompute="full")
    assert full["activations"] == 96 * 2 * 2048 * 12288
    fp32 = memory_per_device(GPT3_175B, micro_batch=1, precision="float32")
    assert (fp32["params"], fp32["grads"], fp32["optimizer"]) == (4 * n, 4 * n, 8 * n)
    assert memory_per_device(GPT3_175B, micro_batch=2, seq_len=1024)["activations"] == (
        96 * activation_bytes_per_layer(1024, 2, 12288, 96))


# ---------------------------------------------------------------- scaling laws

def test_fit_power_law_recovers_exact_data():
    n = np.logspace(3, 7, 6)
    fit = fit_power_law(n, (8.8e13 / n) ** 0.076)
    assert fit["alpha"] == pytest.approx(0.076, rel=1e-10)
    assert fit["n_c"] == pytest.approx(8.8e13, rel=1e-8)
    assert fit["e"] == 0.0 and fit["rmse"] < 1e-12
    loss = 1.5 + (2e4 / n) ** 0.3
    with_e = fit_power_law(n, loss, irreducible=True)
    assert with_e["e"] == pytest.approx(1.5, abs=2e-3)
    assert with_e["alpha"] == pytest.approx(0.3, rel=0.02)
    assert with_e["rmse"] < fit_power_law(n, loss)["rmse"]
    np.testing.assert_allclose(power_law(n, with_e), loss, rtol=1e-3)


def test_chinchilla():
    assert chinchilla_optimal(120e18) == {"n_params": 1e9, "n_tokens": 2e10}
    optimal = chinchilla_optimal(4 * 120e18)  # 4x the compute: 2x the parameters
    assert optimal["n_params"] == pytest.approx(2e9)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("call, message", [
    (lambda: params_closed_form(0, 8), "n_layer must be a positive integer"),
    (lambda: params_closed_form(2, -8), "d_model must be a positive integer"),
    (lambda: training_flops(-1, 10), "n_params must be a positive number"),
    (lambda: training_seconds(1e20, 0, 1e15, 0.5), "n_devices must be a positive integer"),
    (lambda: training_seconds(1e20, 8, 1e15, 1.5), r"mfu must be in \(0, 1\]"),
    (lambda: zero_memory_per_rank(100, 4, 4), "stage must be one of"),
    (lambda: zero_memory_per_rank(100, 0, 1), "world_size must be a positive integer"),
    (lambda: zero_memory_per_rank(-5, 2, 1), "n_params must be a positive integer"),
    (lambda: zero_memory_per_rank(100, 2, 1, optimizer_bytes=-1), "optimizer_bytes must be"),
    (lambda: activation_bytes_per_layer(64, 1, 48, 3, tensor_parallel=2),
     "tensor_parallel=2 must divide n_head=3"),
    (lambda: activation_bytes_per_layer(64, 1, 48, 3, recompute="some"), "recompute must be"),
    (lambda: memory_per_device(GPT3_175B, micro_batch=1, pipeline_parallel=5),
     "pipeline_parallel=5 must divide n_layer=96"),
    (lambda: memory_per_device(GPT3_175B, micro_batch=1, tensor_parallel=7),
     "tensor_parallel=7 must divide n_head=96"),
    (lambda: memory_per_device(GPT3_175B, micro_batch=0), "micro_batch must be"),
    (lambda: memory_per_device(GPT3_175B, micro_batch=1, precision="int8"), "precision must be"),
    (lambda: memory_per_device(GPT3_175B, micro_batch=1, data_parallel=-2), "data_parallel must"),
    (lambda: fit_power_law([1, 2], [3, 4]), "length >= 3"),
    (lambda: fit_power_law([1, 2, 3], [3, -4, 5]), "positive and finite"),
    (lambda: chinchilla_optimal(0), "flops must be a positive number"),
])
def test_bad_input(call, message):
    with pytest.raises(ValueError, match=message):
        call()
