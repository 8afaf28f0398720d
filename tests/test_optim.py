"""Optimizers, schedules and clipping against torch.optim / torch.nn.utils, in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import get_backend

from gptlab import GPTConfig, param_shapes
from gptlab.backend import convert, to_numpy
from gptlab.optim import SGD, AdamW, matrices_and_positions, matrices_only
from gptlab.schedule import clip_grad_norm, cosine_lr, inverse_sqrt_lr, make_schedule

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=6)
STEPS = 50


def _params(backend: str) -> dict:
    rng = np.random.default_rng(0)
    return {name: convert(rng.standard_normal(shape), backend)
            for name, shape in param_shapes(CFG).items()}


def _grads(step: int, backend: str) -> dict:
    rng = np.random.default_rng(1000 + step)
    return {name: convert(rng.standard_normal(shape), backend)
            for name, shape in param_shapes(CFG).items()}


def _lr(step: int) -> float:
    return make_schedule("cosine", lr=1e-2, min_lr=1e-3, warmup_iters=5, decay_iters=40)(step + 1)


def _torch_run(make_optimizer, decayed: set[str]) -> dict:
    """STEPS updates with torch.optim: decayed names in one group, the rest in a no-decay group."""
    params = {name: p.clone().requires_grad_() for name, p in _params("torch").items()}
    groups = [{"params": [p for n, p in params.items() if n in decayed]},
              {"params": [p for n, p in params.items() if n not in decayed], "weight_decay": 0.0}]
    opt = make_optimizer(groups)
    for step in range(STEPS):
        for name, g in _grads(step, "torch").items():
            params[name].grad = g
        for group in opt.param_groups:
            group["lr"] = _lr(step)
        opt.step()
    return {name: p.detach().numpy() for name, p in params.items()}


def _our_run(opt_class, backend: str, steps=range(STEPS), params=None, opt=None, **kwargs):
    params = _params(backend) if params is None else params
    opt = opt_class(params, **kwargs) if opt is None else opt
    for step in steps:
        params = opt.step(params, _grads(step, backend), lr=_lr(step))
    return params, opt


def _max_diff(ours: dict, theirs: dict) -> float:
    return max(float(np.max(np.abs(to_numpy(ours[n]) - theirs[n]))) for n in theirs)


def test_decay_filters():
    params = _params("numpy")
    decayed = {n for n, x in params.items() if matrices_only(n, x)}
    assert "wte.weight" in decayed and "h.0.attn.c_attn.weight" in decayed
    assert "h.1.mlp.c_proj.weight" in decayed
    assert "wpe.weight" not in decayed and "h.0.ln_1.weight" not in decayed
    assert not any(n.endswith(".bias") for n in decayed)
    with_positions = {n for n, x in params.items() if matrices_and_positions(n, x)}
    assert with_positions == decayed | {"wpe.weight"}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("decay_filter", [matrices_only, matrices_and_positions])
def test_adamw_matches_torch(backend, decay_filter):
    kwargs = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    decayed = {n for n, x in _params("numpy").items() if decay_filter(n, x)}
    theirs = _torch_run(lambda groups: torch.optim.AdamW(groups, lr=1.0, **kwargs), decayed)
    ours, opt = _our_run(AdamW, backend, lr=1.0, decay_filter=decay_filter, **kwargs)
    assert opt.step_count == STEPS
    assert _max_diff(ours, theirs) < 1e-12


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_matches_torch(nesterov):
    kwargs = dict(momentum=0.9, weight_decay=0.01, nesterov=nesterov)
    decayed = {n for n, x in _params("numpy").items() if matrices_only(n, x)}
    theirs = _torch_run(lambda groups: torch.optim.SGD(groups, lr=1.0, **kwargs), decayed)
    ours, _ = _our_run(SGD, "numpy", lr=1.0, **kwargs)
    assert _max_diff(ours, theirs) < 1e-12


@pytest.mark.parametrize("opt_class", [AdamW, SGD])
def test_state_dict_resume_is_exact(opt_class):
    """20 steps straight == 10 steps, state_dict copied out, a new optimizer, 10 more."""
    straight, _ = _our_run(opt_class, "numpy", steps=range(20))
    half, opt = _our_run(opt_class, "numpy", steps=range(10))
    state = opt.state_dict()
    state["state"] = {k: to_numpy(v).copy() for k, v in state["state"].items()}
    resumed = opt_class(_params("numpy"))
    resumed.load_state_dict(state)
    assert resumed.step_count == 10
    finished, _ = _our_run(opt_class, "numpy", steps=range(10, 20), params=half, opt=resumed)
    assert _max_diff(finished, straight) == 0.0


def test_load_state_dict_rejects_foreign_state():
    opt = AdamW(_params("numpy"))
    with pytest.raises(ValueError, match="adamw"):
        opt.load_state_dict(SGD(_params("numpy")).state_dict())
    state = opt.state_dict()
    del state["state"]["m.wte.weight"]
    with pytest.raises(ValueError, match="m.wte.weight"):
        AdamW(_params("numpy")).load_state_dict(state)


def test_step_rejects_mismatched_names():
    params = _params("numpy")
    grads = _grads(0, "numpy")
    del grads["wte.weight"]
    with pytest.raises(ValueError, match="names"):
        AdamW(params).step(params, grads)


def test_cosine_schedule_key_values():
    lr = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)
    assert cosine_lr(0, **lr) == 0.0
    assert cosine_lr(5, **lr) == 0.5
    assert cosine_lr(10, **lr) == 1.0
    assert cosine_lr(60, **lr) == pytest.approx(0.55)  # half way: the mean of max and floor
    assert cosine_lr(110, **lr) == 0.1
    assert cosine_lr(10_000, **lr) == 0.1
    values = [cosine_lr(t, **lr) for t in range(200)]
    assert all(a <= b for a, b in zip(values[:11], values[1:11]))  # warmup rises
    assert all(a >= b for a, b in zip(values[10:], values[11:]))  # then never rises
    assert min(values[1:]) == 0.1  # the floor holds


def test_cosine_without_warmup_starts_at_the_peak():
    assert cosine_lr(0, lr=1.0, min_lr=0.0, warmup_iters=0, decay_iters=10) == 1.0


def test_inverse_sqrt_schedule():
    assert inverse_sqrt_lr(0, lr=1.0, warmup_iters=100) == 0.0
    assert inverse_sqrt_lr(50, lr=1.0, warmup_iters=100) == 0.5
    assert inverse_sqrt_lr(100, lr=1.0, warmup_iters=100) == 1.0  # both branches meet: E = w
    assert inverse_sqrt_lr(400, lr=1.0, warmup_iters=100) == 0.5  # (400/100)^-0.5
    # continuous at t = w: the steps on either side are within one warmup increment
    assert abs(inverse_sqrt_lr(101, lr=1.0, warmup_iters=100) - 1.0) < 0.01
    # the Transformer's d^-0.5 min(t^-0.5, t w^-1.5) with η_max = (d w)^-0.5
    d, w = 512, 4000
    for t in (1, 1000, 4000, 10_000):
        vaswani = d**-0.5 * min(t**-0.5, t * w**-1.5)
        assert inverse_sqrt_lr(t, lr=(d * w) ** -0.5, warmup_iters=w) == pytest.approx(vaswani)


def test_make_schedule_validates():
    assert make_schedule("constant", lr=0.3)(7) == 0.3
    with pytest.raises(ValueError, match="unknown lr schedule"):
        make_schedule("linear", lr=1.0)
    with pytest.raises(ValueError, match="warmup_iters >= 1"):
        make_schedule("inverse_sqrt", lr=1.0, warmup_iters=0)
    with pytest.raises(ValueError, match="decay_iters"):
        make_schedule("cosine", lr=1.0, warmup_iters=10, decay_iters=5)
    with pytest.raises(ValueError, match="min_lr"):
        make_schedule("cosine", lr=1.0, min_lr=2.0, decay_iters=5)


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_clip_grad_norm_matches_torch(max_norm, backend):
    grads = _grads(0, backend)
    tensors = {n: g.clone().requires_grad_() for n, g in _grads(0, "torch").items()}
    for t in tensors.values():
        t.grad = t.detach().clone()
    expected = torch.nn.utils.clip_grad_norm_(list(tensors.values()), max_norm)
    total = clip_grad_norm(grads, max_norm)
    assert total == pytest.approx(float(expected), rel=1e-13)
    assert _max_diff(grads, {n: t.grad.numpy() for n, t in tensors.items()}) < 1e-14
    clipped = math.sqrt(sum(float(np.sum(to_numpy(g) ** 2)) for g in grads.values()))
    assert clipped == pytest.approx(min(total, max_norm), rel=1e-6)


def test_array_api_strict_on_a_second_device():
    """The optimizers and clipping use only the array API, and create arrays on the right device."""
    strict = get_backend("strict")
    for opt_class in (AdamW, SGD):
        expected, _ = _our_run(opt_class, "numpy", steps=range(3))
        params = strict.convert(_params("numpy"))
        opt = opt_class(params)
        for step in range(3):
            params = opt.step(params, strict.convert(_grads(step, "numpy")), lr=_lr(step))
        assert _max_diff(params, expected) < 1e-15
    grads = strict.convert(_grads(0, "numpy"))
    assert clip_grad_norm(grads, 0.5) == pytest.approx(clip_grad_norm(_grads(0, "numpy"), 0.5))
