"""Data parallel on 2 and 4 processes (gloo, 127.0.0.1): after 20 updates the weights equal one
process's with the same global batch (float64 to 1e-12, float32 to the derived FLOAT32_BOUND),
with and without gradient accumulation. One launch per world size runs every case; each case is
its own test. The helpers here serve test_parallel_zero.py too."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bounds import assert_relative, assert_within, model_roundoff

from gptlab.config import GPTConfig
from gptlab.model import backward_parts, gpt_backward, gpt_forward, init_params
from gptlab.training.optim import AdamW
from gptlab.training.parallel import mode_class
from gptlab.training.parallel.base import Single, clipped_grads
from gptlab.training.parallel.launch import launch

# vocab 13 and block_size 6 do not divide by 2 or 4: the ZeRO shards of wte and wpe are padded.
# float32 runs without biases: the key bias's gradient is exactly zero in exact arithmetic
# (softmax ignores a shift shared by all keys), so in float32 it is pure round-off, which Adam's
# m / sqrt(v) turns into lr-sized steps of random sign; two summation orders cannot agree there.
# "llama" (float64): LLaMA's wiring (RMSNorm, SwiGLU, RoPE, grouped-query attention, an untied
# head). A case is (mode, model: a key of CONFIGS, micro-steps).
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=13, block_size=6)
CONFIGS = {"float64": (CFG, "float64"),
           "float32": (GPTConfig(**{**CFG.to_dict(), "bias": False}), "float32"),
           "llama": (GPTConfig.llama(n_layer=1, n_head=2, n_kv_head=1, n_embd=8, vocab_size=13,
                                     block_size=6, mlp_hidden=16), "float64")}
BATCH, UPDATES, GRAD_CLIP = 8, 20, 0.5  # the clipping is active (the norms are above 0.5)
CASES = [("ddp", "float64", 1), ("ddp", "float32", 1), ("ddp", "float64", 2), ("ddp", "llama", 1)]
FLOAT64_TOLERANCE = 1e-12  # a sum of 48 rows in another order moves float64 by ~1e-14 a step
# Each update's gradients summed in another order (Adam's step is scale-free; weights <= 1).
FLOAT32_BOUND = model_roundoff(CONFIGS["float32"][0], BATCH, CFG.block_size, updates=UPDATES)


def batches(n_updates: int = UPDATES, seed: int = 0) -> list:
    """The global batches (idx, targets), each (BATCH, block_size), the same on every rank."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CFG.vocab_size, size=(n_updates, BATCH, CFG.block_size + 1))
    return [(torch.as_tensor(i[:, :-1]), torch.as_tensor(i[:, 1:])) for i in ids]


def run(mode_cls, model: str, accum_steps: int = 1):
    """20 updates of the mode on CONFIGS[model] -> (losses, the full parameters as NumPy)."""
    cfg, dtype = CONFIGS[model]
    params = init_params(cfg, seed=3, backend="torch", dtype=dtype)
    mode = mode_cls(cfg, params, accum_steps=accum_steps)
    optimizer = AdamW(mode.params, lr=1e-2, weight_decay=0.1)
    losses = []
    for idx, targets in batches():
        loss, grads, _ = clipped_grads(mode, idx, targets, GRAD_CLIP)
        mode.params = optimizer.step(mode.params, grads)
        losses.append(loss)
    return losses, {name: t.numpy() for name, t in mode.full_params().items()}


def run_cases(cases: list) -> dict:
    """On every rank: each case's losses and full weights."""
    return {case: run(mode_class(case[0]), case[1], case[2]) for case in cases}


def launched(cases: list, world_size: int) -> list:
    """Every rank's run_cases(cases) (a process per rank, gloo on 127.0.0.1)."""
    return launch(run_cases, world_size, cases, timeout_s=60)


def check_equal_to_one_process(per_rank: list, reference: dict, case: tuple) -> None:
    """Every rank's losses and final weights equal the one-process run's, to the dtype's bound."""
    ref_losses, ref_params = reference[case[1]]
    for rank, results in enumerate(per_rank):
        losses, params = results[case]
        where = f"rank {rank} of {len(per_rank)}"
        if CONFIGS[case[1]][1] == "float32":
            assert_relative(losses, ref_losses, FLOAT32_BOUND, "ddp/zero float32 losses", where)
            for name, ref in ref_params.items():
                assert_within(params[name], ref, FLOAT32_BOUND, "ddp/zero float32 weights",
                              f"{name}, {where}")
            continue
        np.testing.assert_allclose(losses, ref_losses, rtol=FLOAT64_TOLERANCE,
                                   atol=FLOAT64_TOLERANCE, err_msg=f"loss, {where}")
        for name, ref in ref_params.items():
            np.testing.assert_allclose(params[name], ref, rtol=0, atol=FLOAT64_TOLERANCE,
                                       err_msg=f"{name}, {where}")
    moved = max(float(np.max(np.abs(p - init))) for p, init in zip(
        ref_params.values(), init_params(CONFIGS[case[1]][0], seed=3).values()))
    assert moved > 1e-2  # the weights moved: the comparison is not of two untouched models


@pytest.fixture(scope="module")
def reference():
    return {model: run(Single, model) for model in CONFIGS}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    return launched(CASES, request.param)


@pytest.mark.roundoff
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-accum{c[2]}")
def test_weights_equal_one_process(world_results, reference, case):
    check_equal_to_one_process(world_results, reference, case)


def test_single_matches_the_model_with_micro_steps():
    """The reference itself: 2 micro-steps of 4 give the gradients of the batch of 8."""
    params = init_params(CFG, seed=3, backend="torch", dtype="float64")
    idx, targets = batches(1)[0]
    loss1, grads1 = Single(CFG, params).loss_and_grads(idx, targets)
    loss2, grads2 = Single(CFG, params, accum_steps=2).loss_and_grads(idx, targets)
    assert abs(loss1 - loss2) < 1e-14
    for name in grads1:
        torch.testing.assert_close(grads1[name], grads2[name], rtol=0, atol=1e-15)


def test_batch_that_does_not_split_is_an_error():
    params = init_params(CFG, seed=3, backend="torch", dtype="float64")
    idx, targets = batches(1)[0]
    with pytest.raises(ValueError, match="does not split evenly over 1 ranks x 3 micro-steps"):
        Single(CFG, params, accum_steps=3).loss_and_grads(idx, targets)


def test_numpy_params_are_a_clear_error():
    with pytest.raises(TypeError, match="backend='torch'"):
        mode_class("ddp")(CFG, init_params(CFG))


def test_unknown_and_missing_modes():
    with pytest.raises(ValueError, match="unknown parallel mode 'fsdp'"):
        mode_class("fsdp")
    for name in ("tensor", "pipeline"):  # H-tp's modes: a class, or a clear error until they exist
        try:
            assert callable(mode_class(name))
        except ValueError as err:
            assert "is not available in this gptlab" in str(err)


def test_backward_parts_come_last_block_first_and_add_up_to_gpt_backward():
    """The order data parallelism sends buckets in: LN_f, blocks L-1 .. 0, the embeddings;
    every gradient exactly once, each equal to gpt_backward's."""
    cfg = GPTConfig(n_layer=3, n_head=2, n_embd=8, vocab_size=13, block_size=6)
    params = init_params(cfg, seed=3, backend="torch", dtype="float64")
    idx, targets = batches(1)[0]
    _, _, cache = gpt_forward(params, idx, cfg, targets)
    parts = list(backward_parts(cache))
    owners = [{".".join(name.split(".")[:2 if name.startswith("h.") else 1]) for name in part}
              for part in parts]  # "h.2.attn.c_attn.weight" -> "h.2", "wte.weight" -> "wte"
    assert owners == [{"ln_f"}, {"h.2"}, {"h.1"}, {"h.0"}, {"wte", "wpe"}]
    whole = gpt_backward(cache)
    assert sorted(n for part in parts for n in part) == sorted(whole)
    for part in parts:
        for name, g in part.items():
            assert torch.equal(g, whole[name])
