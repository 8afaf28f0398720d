"""The fused eager path (gptlab.fast), activation recomputation and mixed precision, against the
readable path gptlab.model (itself checked against autograd and finite differences)."""

import itertools
import math

import numpy as np
import pytest
import torch
from bounds import assert_relative, assert_within, model_roundoff, roundoff

from gptlab import GPTConfig, init_params
from gptlab.fast import FastStep, LossScaler, fast_loss_and_grads, new_grad_buffers
from gptlab.model import cache_bytes, gpt_backward, gpt_forward, loss_and_grads
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

TINY = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)
SWITCHES = list(itertools.product((True, False), ("tanh", "erf"), ("sdpa", "flash"),
                                  ("full", "chunked"), (False, True)))  # fmt: skip


def noisy_params(cfg, dtype=torch.float64, seed=0):
    """GPT-2's init plus N(0, 0.2) noise, so biases and gains are exercised."""
    rng = np.random.default_rng(seed + 1)
    return {name: torch.tensor(value + rng.normal(0.0, 0.2, value.shape), dtype=dtype)
            for name, value in init_params(cfg, seed, dtype="float64").items()}  # fmt: skip


def tokens(cfg, B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randint(0, cfg.vocab_size, (B, T), generator=g) for _ in range(2))


def max_error(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[n] - b[n]).abs().max()) for n in a)


@pytest.mark.parametrize("bias,gelu,attention,classifier,recompute", SWITCHES)
def test_fast_matches_model_float64(bias, gelu, attention, classifier, recompute):
    cfg = GPTConfig(**TINY, bias=bias, gelu=gelu)
    params = noisy_params(cfg)
    idx, targets = tokens(cfg, 3, 7)  # T < block_size: wpe's unused rows get 0
    loss, grads = loss_and_grads(params, idx, targets, cfg)
    fast_loss, fast_grads = fast_loss_and_grads(params, idx, targets, cfg, attention=attention,
                                                classifier=classifier, recompute=recompute)
    assert abs(fast_loss - loss) < 1e-12
    assert max_error(fast_grads, grads) < 1e-12


@pytest.mark.roundoff
@pytest.mark.parametrize("attention,classifier", [("sdpa", "full"), ("flash", "chunked")])
def test_fast_matches_model_float32(attention, classifier):
    cfg = GPTConfig(**TINY)
    params = noisy_params(cfg, torch.float32)
    idx, targets = tokens(cfg, 4, 8)
    loss, grads = loss_and_grads(params, idx, targets, cfg)
    fast_loss, fast_grads = fast_loss_and_grads(params, idx, targets, cfg, attention=attention,
                                                classifier=classifier)
    bound = model_roundoff(cfg, 4, 8)  # the same float32 math, fused and in another order
    assert_relative(fast_loss, loss, bound, "fused vs readable float32 loss")
    for name, g in grads.items():
        assert_relative(fast_grads[name], g, bound, "fused vs readable float32 gradients", name)


def test_buffers_are_reused_and_overwritten():
    """The grads dict IS the buffers; a second step with other tokens leaves nothing stale."""
    cfg = GPTConfig(**TINY)
    params = noisy_params(cfg)
    buffers = new_grad_buffers(params)
    fast_loss_and_grads(params, *tokens(cfg, 2, 8, seed=1), cfg, buffers)
    idx, targets = tokens(cfg, 2, 5, seed=2)
    _, grads = fast_loss_and_grads(params, idx, targets, cfg, buffers)
    assert all(grads[name] is buffers[name] for name in params)
    assert max_error(grads, loss_and_grads(params, idx, targets, cfg)[1]) < 1e-12


@pytest.mark.parametrize("fields,named", [
    (dict(ln_order="post"), "ln_order"), (dict(position="sinusoidal"), "position"),
    (dict(dropout=0.1), "dropout"), (dict(tie_embeddings=False), "tie_embeddings"),
    (dict(mlp="moe", n_expert=2), "mlp"), (dict(n_kv_head=1), "n_kv_head"),
])  # fmt: skip
def test_refuses_what_it_does_not_cover(fields, named):
    cfg = GPTConfig(**TINY, **fields)
    params = {name: torch.as_tensor(v) for name, v in init_params(cfg).items()}
    with pytest.raises(ValueError, match=f"GPTConfig.{named}"):
        fast_loss_and_grads(params, *tokens(cfg, 1, 4), cfg)


def test_refuses_bad_inputs():
    cfg = GPTConfig(**TINY)
    params = noisy_params(cfg)
    idx, targets = tokens(cfg, 2, 4)
    with pytest.raises(TypeError, match="torch tensors"):
        fast_loss_and_grads(init_params(cfg), idx.numpy(), targets.numpy(), cfg)
    with pytest.raises(ValueError, match="attention"):
        fast_loss_and_grads(params, idx, targets, cfg, attention="sparse")
    with pytest.raises(ValueError, match="classifier"):
        fast_loss_and_grads(params, idx, targets, cfg, classifier="fused")
    with pytest.raises(ValueError, match="targets"):
        fast_loss_and_grads(params, idx, targets[:, :3], cfg)
    with pytest.raises(ValueError, match="block_size"):
        fast_loss_and_grads(params, *tokens(cfg, 1, 9), cfg)
    with pytest.raises(ValueError, match="buffers"):
        fast_loss_and_grads(params, idx, targets, cfg, new_grad_buffers(
            {n: p.float() for n, p in params.items()}))


# --- activation recomputation in the readable path -----------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_recompute_gives_identical_gradients(backend):
    cfg = GPTConfig(**TINY, dropout=0.2)  # the same dropout masks when the blocks run again
    params = init_params(cfg, seed=3, backend=backend, dtype="float64")
    idx, targets = (t.numpy() if backend == "numpy" else t for t in tokens(cfg, 2, 8))
    grads = [gpt_backward(gpt_forward(params, idx, cfg, targets, dropout_seed=7,
                                      recompute=recompute)[2]) for recompute in (False, True)]
    for name in grads[0]:
        np.testing.assert_array_equal(np.asarray(grads[0][name]), np.asarray(grads[1][name]))


def test_recompute_cache_holds_block_inputs_only():
    """A recompute cache keeps n_layer inputs of B*T*C float64 numbers for the blocks, exactly;
    the plain cache keeps more per block, so the saving grows with depth."""
    B, T, C = 2, 8, TINY["n_embd"]
    saved = []
    for n_layer in (1, 2, 4):
        cfg = GPTConfig(**{**TINY, "n_layer": n_layer})
        params = init_params(cfg, backend="torch", dtype="float64")
        idx, targets = tokens(cfg, B, T)
        plain = gpt_forward(params, idx, cfg, targets)[2]
        kept = gpt_forward(params, idx, cfg, targets, recompute=True)[2]
        assert cache_bytes(kept["blocks"]) == n_layer * B * T * C * 8
        saved.append(cache_bytes(plain, params) - cache_bytes(kept, params))
    per_block = saved[0]
    assert per_block > 0 and saved == [per_block, 2 * per_block, 4 * per_block]


# --- mixed precision ----------------------------------------------------------------------------


def test_loss_scaler_schedule():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    assert [scaler.update(True) for _ in range(2)] == [True, True] and scaler.scale == 1024.0
    assert scaler.update(True) and scaler.scale == 2048.0 and scaler.growths == 1
    assert not scaler.update(False) and scaler.scale == 1024.0 and scaler.skipped == 1
    assert scaler.good_steps == 0  # an overflow restarts the count of good steps
    assert not scaler.update(False) and scaler.scale == 512.0 and scaler.skipped == 2
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 1024.0 and scaler.growths == 2
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaler(growth_interval=0)
    with pytest.raises(ValueError, match="loss scaler is for float16"):
        FastStep(GPTConfig(**TINY), "bfloat16", scaler=LossScaler())


def test_float16_overflow_skips_and_halves():
    cfg = GPTConfig(**TINY)
    params = noisy_params(cfg, torch.float32)
    idx, targets = tokens(cfg, 2, 8)
    step = FastStep(cfg, "float16", scaler=LossScaler(scale=2.0**40))  # beyond float16's 65504
    loss, grads = step(params, idx, targets)
    assert grads is None and step.scaler.skipped == 1 and step.scaler.scale == 2.0**39
    step.scaler.scale = 2.0**10
    loss, grads = step(params, idx, targets)
    reference_loss, reference = loss_and_grads(params, idx, targets, cfg)
    assert loss == pytest.approx(reference_loss, rel=1e-2)
    assert all(g.dtype == torch.float32 for g in grads.values())
    scale = max(float(g.abs().max()) for g in reference.values())
    assert max_error(grads, reference) < 0.05 * scale


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_mixed_precision_keeps_float32_master_weights(precision):
    cfg = GPTConfig(**TINY)
    params = noisy_params(cfg, torch.float32)
    loss, grads = FastStep(cfg, precision)(params, *tokens(cfg, 2, 8))
    assert math.isfinite(loss) and all(g.dtype == torch.float32 for g in grads.values())
    assert all(p.dtype == torch.float32 for p in params.values())
    with pytest.raises(TypeError, match="float32 master"):
        FastStep(cfg, precision)({n: p.double() for n, p in params.items()}, *tokens(cfg, 2, 8))


def tiny_run(tmp_path, name, **options):
    cfg = TrainConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=40,
                      eval_interval=10, eval_iters=2, warmup_iters=5, out_dir=str(tmp_path / name),
                      threads=1, **options)  # fmt: skip
    return train(cfg, progress=False)


@pytest.mark.roundoff
def test_bfloat16_run_follows_float32(tmp_path):
    full = tiny_run(tmp_path, "fp32")
    half = tiny_run(tmp_path, "bf16", fused=True, precision="bfloat16")
    assert all(p.dtype == torch.float32 for p in half.params.values())
    first, last = full.history[0]["val_loss"], full.history[-1]["val_loss"]
    assert last < first - 0.3  # the run learns
    # bfloat16 rounds each operation's output once (float32 accumulation, float32 masters): a
    # pass of 1 layer has 4 steps, each off by up to bfloat16's eps of the loss's size
    bound = roundoff("bfloat16", 1, steps=4, scale=first, why="one rounding per operation")
    for a, b in zip(full.history, half.history, strict=True):
        assert_within(b["val_loss"], a["val_loss"], bound, "bfloat16 run vs float32 run, losses",
                      f"step {a['step']}")


def test_recompute_and_fused_runs_match_the_plain_run(tmp_path):
    plain = tiny_run(tmp_path, "plain", fused=False)
    recompute = tiny_run(tmp_path, "recompute", fused=False, recompute=True)
    assert recompute.history == plain.history  # the same operations: bitwise equal
    plain64 = tiny_run(tmp_path, "plain64", dtype="float64", fused=False)
    fused64 = tiny_run(tmp_path, "fused64", dtype="float64", recompute=True)  # fused: default
    for a, b in zip(plain64.history, fused64.history):  # the same numbers up to rounding
        assert b["val_loss"] == pytest.approx(a["val_loss"], abs=1e-9)


@pytest.mark.parametrize("options,message", [
    (dict(fused=False, precision="bfloat16"), "fused=True"),
    (dict(fused=False, attention="flash"), "fused=True"),
    (dict(precision="bfloat16", backend="numpy"), "torch"),
    (dict(classifier="chunked", parallel="ddp", nproc=2), "one process"),
    (dict(attention="flash", norm="rmsnorm", bias=False), "GPTConfig.norm"),
    (dict(recompute=True, parallel="ddp", nproc=2), "one process"),
    (dict(fused=True, precision="float16", dtype="float64"), "master"),
    (dict(recompute=True, backend="autograd"), "hand-written"),
])  # fmt: skip
def test_train_config_checks_the_fast_options(options, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**options)


def test_loss_scaler_state_round_trip():
    scaler = LossScaler(scale=1024.0, growth_interval=3)
    for finite in (True, True, True, False, True):
        scaler.update(finite)
    restored = LossScaler(growth_interval=3)
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict() == {
        "scale": 1024.0, "good_steps": 1, "skipped": 1, "growths": 1}  # fmt: skip
    for _ in range(2):  # both go on the same way: two more good steps make the third
        assert restored.update(True) == scaler.update(True)
    assert restored.scale == scaler.scale == 2048.0
    with pytest.raises(ValueError, match="finite scale"):
        restored.load_state_dict({**scaler.state_dict(), "scale": math.inf})
    with pytest.raises(ValueError, match="good_steps"):
        restored.load_state_dict({"scale": 1.0, "skipped": 0, "growths": 0})


@pytest.mark.parametrize("options,fused", [
    ({}, True), (dict(dtype="float64", recompute=True, gelu="erf", bias=False), True),
    (dict(fused=False), False), (dict(backend="numpy"), False), (dict(backend="autograd"), False),
    (dict(dropout=0.1), False), (dict(parallel="ddp", nproc=2), False),
    (dict(norm="rmsnorm", bias=False), False), (dict(tie_embeddings=False), False),
])  # fmt: skip
def test_the_fused_path_is_the_default_where_it_applies(options, fused):
    """fused=True (the default) takes the fused path for GPT-2's models on torch in one process;
    every other config the plain path handles runs there, with no error."""
    assert TrainConfig(**options).runs_fused is fused
