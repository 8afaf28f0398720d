"""Optimizers (functional and torch.optim), schedules and clipping against torch.optim /
torch.nn.utils, in float64."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from conftest import get_backend

from gptlab import GPTConfig, init_params, loss_and_grads, param_shapes
from gptlab.backend import convert, to_numpy
from gptlab.autograd import GPT
from gptlab.training.optim import (
    SGD,
    AdamW,
    TorchAdamW,
    TorchSGD,
    matrices_and_positions,
    matrices_only,
    param_groups,
)
from gptlab.training.schedule import (
    clip_grad_norm,
    clip_grad_norm_,
    cosine_lr,
    inverse_sqrt_lr,
    make_schedule,
)

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


# ------------------------------------------------------------------------------------------------
# The torch.optim front end: TorchAdamW and TorchSGD on nn.Modules


def _module() -> torch.nn.Module:
    """A small float64 MLP with a LayerNorm: matrices, biases and a gain."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7), torch.nn.Tanh(),
                               torch.nn.Linear(7, 3)).double()


def _groups(module: torch.nn.Module, weight_decay: float, **no_decay_overrides) -> list[dict]:
    """Decay the matrices; the other group gets its own hyperparameters (lr, betas, ...)."""
    decay, no_decay = param_groups(dict(module.named_parameters()), weight_decay)
    return [decay, {**no_decay, **no_decay_overrides}]


_X = torch.as_tensor(np.random.default_rng(0).standard_normal((8, 5)))  # (8, 5) inputs
_TARGET = torch.as_tensor(np.random.default_rng(1).standard_normal((8, 3)))  # (8, 3) to regress


def _train(module: torch.nn.Module, opt, steps) -> list[float]:
    """One update per item of ``steps``, by a closure (zero_grad, loss, backward) that ``step``
    calls; the losses it returned."""
    def closure():
        opt.zero_grad()
        loss = ((module(_X) - _TARGET) ** 2).mean()
        loss.backward()
        return loss

    return [opt.step(closure).item() for _ in steps]


def _module_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def test_param_groups_decay_what_the_filter_decays():
    model = GPT(CFG, seed=0)
    decay, no_decay = param_groups(model.params, 0.1)
    decayed = {n for n, p in model.params.items() if any(p is q for q in decay["params"])}
    assert decayed == {n for n, x in _params("numpy").items() if matrices_only(n, x)}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(model.params)
    (only,) = param_groups({"b": torch.zeros(3)}, 0.1)  # no matrices: no empty decay group
    assert only["weight_decay"] == 0.0


TORCH_CASES = {  # id: (ours, torch's, the no-decay group's own hyperparameters)
    "adamw": (TorchAdamW, torch.optim.AdamW,
              dict(lr=3e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), dict(lr=1e-2)),
    "adamw-group-betas": (TorchAdamW, torch.optim.AdamW,
                          dict(lr=3e-2, betas=(0.9, 0.95), weight_decay=0.1),
                          dict(betas=(0.5, 0.9), eps=1e-3)),
    "sgd": (TorchSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.0, weight_decay=0.0), {}),
    "sgd-momentum": (TorchSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01),
                     dict(lr=0.05)),
    "sgd-nesterov": (TorchSGD, torch.optim.SGD,
                     dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
                     dict(momentum=0.5)),
}


@pytest.mark.parametrize("ours, theirs, kwargs, overrides", TORCH_CASES.values(),
                         ids=TORCH_CASES.keys())
def test_torch_optimizers_match_torch_optim(ours, theirs, kwargs, overrides):
    """Two parameter groups, 20 steps with closures, float64: the same parameters and losses."""
    module, reference = _module(), _module()
    opt = ours(_groups(module, kwargs["weight_decay"], **overrides), **kwargs)
    torch_opt = theirs(_groups(reference, kwargs["weight_decay"], **overrides), **kwargs)
    losses, torch_losses = _train(module, opt, range(20)), _train(reference, torch_opt, range(20))
    assert losses == pytest.approx(torch_losses, rel=1e-12, abs=0.0)
    assert losses[-1] < losses[0]
    assert _module_diff(module, reference) < 1e-12
    assert _module_diff(module, _module()) > 1e-2  # it did move


@pytest.mark.parametrize("ours, kwargs, functional", [
    (TorchAdamW, dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), AdamW),
    (TorchSGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True), SGD),
], ids=["adamw", "sgd"])  # fmt: skip
def test_gpt_module_functional_and_torch_optim_paths_are_identical(ours, kwargs, functional):
    """gptlab's GPT (hand-written backward) trained three ways on the same batches: the functional
    optimizer on a dict, ours on the module (bit for bit the same), torch's on the module."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=6)
    model, reference = GPT(cfg, seed=0, dtype="float64"), GPT(cfg, seed=0, dtype="float64")
    params = {name: p.detach().clone() for name, p in model.params.items()}
    opt = ours(param_groups(model.params, kwargs["weight_decay"]), **kwargs)
    torch_class = torch.optim.AdamW if ours is TorchAdamW else torch.optim.SGD
    torch_opt = torch_class(param_groups(reference.params, kwargs["weight_decay"]), **kwargs)
    functional_opt = functional(params, **kwargs)
    for step in range(5):
        rng = np.random.default_rng(step)
        x, y = (torch.as_tensor(rng.integers(0, cfg.vocab_size, (3, cfg.block_size)))
                for _ in range(2))
        for module, optimizer in ((model, opt), (reference, torch_opt)):
            optimizer.zero_grad()
            module(x, y)[1].backward()
            optimizer.step()
        _, grads = loss_and_grads(params, x, y, cfg)
        params = functional_opt.step(params, grads)
        for name, p in model.params.items():
            assert torch.equal(p.detach(), params[name]), name
    assert _max_diff(params, {n: p.detach().numpy() for n, p in reference.params.items()}) < 1e-12
    assert not torch.equal(params["wte.weight"], GPT(cfg, seed=0, dtype="float64").params[
        "wte.weight"].detach())


@pytest.mark.parametrize("ours, kwargs", [
    (TorchAdamW, dict(lr=1e-2, weight_decay=0.1)),
    (TorchSGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
], ids=["adamw", "sgd"])  # fmt: skip
def test_torch_state_dict_resume_is_exact(ours, kwargs):
    """12 steps straight == 6 steps, state_dict deep-copied, a new module and optimizer, 6 more."""
    straight = _module()
    _train(straight, ours(_groups(straight, kwargs["weight_decay"], lr=5e-3), **kwargs),
           range(12))
    half = _module()
    opt = ours(_groups(half, kwargs["weight_decay"], lr=5e-3), **kwargs)
    _train(half, opt, range(6))
    state = copy.deepcopy(opt.state_dict())
    resumed = copy.deepcopy(half)
    resumed_opt = ours(_groups(resumed, 0.0), lr=123.0)  # hyperparameters come from the state
    resumed_opt.load_state_dict(state)
    assert resumed_opt.param_groups[1]["lr"] == 5e-3
    _train(resumed, resumed_opt, range(6, 12))
    assert _module_diff(resumed, straight) == 0.0


@pytest.mark.parametrize("ours, theirs, kwargs", [
    (TorchAdamW, torch.optim.AdamW, dict(betas=(0.9, 0.95))),
    (TorchSGD, torch.optim.SGD, dict(momentum=0.9)),
], ids=["adamw", "sgd"])  # fmt: skip
def test_lr_scheduler_drives_the_torch_optimizers(ours, theirs, kwargs):
    """LambdaLR (warmup, then halving) sets each group's lr as it does for torch's optimizers."""
    schedule = lambda epoch: min(1.0, (epoch + 1) / 4) * 0.5 ** max(0, epoch - 4)  # noqa: E731
    module, reference = _module(), _module()
    opt = ours(_groups(module, 0.01, lr=0.05), lr=0.1, weight_decay=0.01, **kwargs)
    torch_opt = theirs(_groups(reference, 0.01, lr=0.05), lr=0.1, weight_decay=0.01, **kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    torch_scheduler = torch.optim.lr_scheduler.LambdaLR(torch_opt, schedule)
    for epoch in range(10):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx(
            [0.1 * schedule(epoch), 0.05 * schedule(epoch)], rel=1e-15)
        assert scheduler.get_last_lr() == torch_scheduler.get_last_lr()
        _train(module, opt, [epoch])
        _train(reference, torch_opt, [epoch])
        scheduler.step()
        torch_scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**6)  # epoch 10: six halvings
    assert _module_diff(module, reference) < 1e-12


def test_torch_optimizers_leave_parameters_without_gradients_alone():
    module = _module()
    frozen = module[1].weight  # the LayerNorm gain
    frozen.requires_grad_(False)
    before = frozen.detach().clone()
    opt = TorchAdamW(module.parameters(), lr=0.1, weight_decay=0.5)
    _train(module, opt, range(3))
    assert torch.equal(frozen, before) and frozen not in opt.state
    assert opt.state[module[0].weight]["step"] == 3


BAD_HYPERPARAMETERS = [  # (AdamW or SGD, keyword arguments, the error)
    ("adamw", dict(lr=-1e-3), r"lr must be >= 0, got -0.001"),
    ("adamw", dict(lr=float("nan")), r"lr must be >= 0, got nan"),
    ("adamw", dict(betas=(1.0, 0.9)), r"betas\[0\] must be in \[0, 1\), got 1.0"),
    ("adamw", dict(betas=(0.9, -0.1)), r"betas\[1\] must be in \[0, 1\), got -0.1"),
    ("adamw", dict(betas=(0.9,)), r"betas must be two numbers"),
    ("adamw", dict(eps=-1e-8), r"eps must be >= 0, got -1e-08"),
    ("adamw", dict(weight_decay=-0.1), r"weight_decay must be >= 0"),
    ("sgd", dict(lr=-0.1), r"lr must be >= 0"),
    ("sgd", dict(momentum=-0.9), r"momentum must be >= 0"),
    ("sgd", dict(weight_decay=-1.0), r"weight_decay must be >= 0"),
    ("sgd", dict(momentum=0.0, nesterov=True), r"Nesterov momentum needs momentum > 0"),
]


@pytest.mark.parametrize("kind, kwargs, error", BAD_HYPERPARAMETERS)
def test_bad_hyperparameters_are_rejected_by_every_front_end(kind, kwargs, error):
    functional, ours = (AdamW, TorchAdamW) if kind == "adamw" else (SGD, TorchSGD)
    module = _module()
    with pytest.raises(ValueError, match=error):
        functional(_params("numpy"), **kwargs)
    with pytest.raises(ValueError, match=error):
        ours(module.parameters(), **kwargs)
    with pytest.raises(ValueError, match=error):  # in one group only
        ours([{"params": [module[0].weight]}, {"params": [module[0].bias], **kwargs}])


def test_eps_zero_is_allowed_as_in_torch():
    """eps = 0: Adam's first step is then exactly ±lr (chapter 10 uses it), in both front ends."""
    params, grads = {"w": np.array([3.0, -0.5])}, {"w": np.array([2.0, -1.0])}
    new = AdamW(params, lr=0.1, eps=0.0, weight_decay=0.0).step(params, grads)
    np.testing.assert_allclose(new["w"] - params["w"], [-0.1, 0.1], rtol=1e-14)
    w = torch.tensor([3.0, -0.5], dtype=torch.float64, requires_grad=True)
    w.grad = torch.tensor([2.0, -1.0], dtype=torch.float64)
    TorchAdamW([w], lr=0.1, eps=0.0, weight_decay=0.0).step()
    assert torch.equal(w.detach(), torch.as_tensor(new["w"]))


def test_decay_filters_take_matrices_and_expert_stacks_never_biases_or_gains():
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4, mlp="moe",
                    n_expert=3)
    params = init_params(cfg, seed=0)
    decayed = {name for name, x in params.items() if matrices_only(name, x)}
    assert "h.0.mlp.experts.c_fc.weight" in decayed and "h.0.mlp.router.weight" in decayed
    assert "h.0.mlp.experts.c_fc.bias" not in decayed  # (E, H): 2-D, but a bias
    assert "wpe.weight" not in decayed and "wte.weight" in decayed
    assert not any(name.endswith(".bias") or ".ln_" in name for name in decayed)
    everything = {name for name, x in params.items() if matrices_and_positions(name, x)}
    assert everything == decayed | {"wpe.weight"}


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_in_place_matches_torch(max_norm):
    """clip_grad_norm_ takes what torch.nn.utils.clip_grad_norm_ takes: tensors (through their
    .grad, a None grad skipped), NumPy arrays (the gradients themselves), or one tensor; it
    scales them in place and returns the same norm."""
    def parameters():
        params = [g.clone().requires_grad_() for g in _grads(0, "torch").values()]
        for p in params:
            p.grad = p.detach().clone() * 3.0
        return params + [torch.zeros(2, requires_grad=True)]  # .grad None: skipped

    expected = parameters()
    norm = torch.nn.utils.clip_grad_norm_(expected, max_norm)
    ours = parameters()
    assert clip_grad_norm_(ours, max_norm) == pytest.approx(float(norm), rel=1e-13)
    for p, q in zip(ours, expected):
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            assert torch.equal(p.detach(), q.detach())  # the parameters are not touched
            assert float((p.grad - q.grad).abs().max()) < 1e-14
    arrays = [3.0 * g for g in _grads(0, "numpy").values()]  # (a generator works too)
    assert clip_grad_norm_((a for a in arrays), max_norm) == pytest.approx(float(norm), rel=1e-13)
    for a, q in zip(arrays, expected):
        assert np.abs(a - q.grad.numpy()).max() < 1e-14
    single = torch.ones(4, dtype=torch.float64, requires_grad=True)
    single.grad = torch.full((4,), 2.0, dtype=torch.float64)  # norm 4
    assert clip_grad_norm_(single, max_norm) == pytest.approx(4.0, rel=1e-15)
    assert float((single.grad - min(2.0, 2.0 * max_norm / 4.0)).abs().max()) < 1e-6


@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_grad_norm_in_place_skips_frozen_parameters(max_norm):
    """A frozen parameter (requires_grad=False, so .grad None) holds no gradient: torch skips it,
    and so does clip_grad_norm_, which neither counts nor rescales its weights (issue 33)."""
    def parameters():
        params = [torch.nn.Parameter(3.0 * g) for g in _grads(0, "torch").values()]
        for i, p in enumerate(params):
            if i % 3 == 0:
                p.requires_grad_(False)  # frozen: an embedding or a quantized layer, say
            else:
                p.grad = p.detach().clone()
        return params

    expected = parameters()
    norm = torch.nn.utils.clip_grad_norm_(expected, max_norm)
    ours = parameters()
    assert clip_grad_norm_(ours, max_norm) == pytest.approx(float(norm), rel=1e-13)
    for p, q in zip(ours, expected):
        assert torch.equal(p.detach(), q.detach())  # frozen or trainable, no weight is touched
        assert (p.grad is None) == (q.grad is None) == (not p.requires_grad)
        if p.grad is not None:
            assert float((p.grad - q.grad).abs().max()) < 1e-14
