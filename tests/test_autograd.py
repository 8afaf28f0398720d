"""gptlab.autograd: the hand-written backward passes behind torch.autograd and torch.optim."""

import importlib
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import random_attention_mask
from gptlab import GPTConfig, gpt_backward, gpt_forward, init_params, param_shapes
from gptlab import autograd as ag
from gptlab.layers.block import block_param_shapes
from gptlab.reference.torch_gpt import reference_forward, relative_error

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
C = 4


def _block_p(rng):
    return {name: rng.normal(size=shape) for name, shape in block_param_shapes(C).items()}


# name, positional arrays (NumPy, built from an rng), hyperparameters
CASES = [
    ("linear", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=(C, 5)), r.normal(size=5)), {}),
    ("layernorm", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=C), r.normal(size=C)), {"eps": 1e-5}),
    ("gelu", lambda r: (r.normal(size=(2, 3, C)),), {"approximate": "tanh"}),
    ("gelu", lambda r: (r.normal(size=(2, 3, C)),), {"approximate": "none"}),
    ("relu", lambda r: (r.normal(size=(2, 3, C)),), {}),
    ("softmax", lambda r: (r.normal(size=(2, 3, C)),), {"axis": -1}),
    ("softmax", lambda r: (r.normal(size=(2, 3, C)),), {"axis": 0}),
    ("dropout", lambda r: (r.normal(size=(2, 3, C)),), {"p": 0.3, "seed": 7}),
    ("embedding", lambda r: (r.integers(0, 7, size=(2, 5)), r.normal(size=(7, C))), {}),
    ("position_learned", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=(5, C))), {}),
    ("position_sinusoidal", lambda r: (r.normal(size=(2, 3, C)),), {}),
    ("attention", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=(C, 3 * C)), r.normal(size=3 * C),
                             r.normal(size=(C, C)), r.normal(size=C)), {"n_head": 2}),
    ("sdpa", lambda r: (*r.normal(size=(3, 2, 2, 3, C)),), {"causal": True}),
    ("sdpa", lambda r: (r.normal(size=(2, 2, 3, C)), r.normal(size=(2, 1, 5, C)), r.normal(size=(2, 1, 5, 3)),
                        random_attention_mask(r, (2, 1, 3, 5))), {"causal": True, "scale": 0.5}),
    ("gqa", lambda r: (r.normal(size=(2, 4, 3, C)), *r.normal(size=(2, 2, 2, 3, C))), {"causal": True}),
    ("gqa", lambda r: (r.normal(size=(2, 3, 2, C)), r.normal(size=(2, 1, 4, C)), r.normal(size=(2, 1, 4, 3)),
                       random_attention_mask(r, (2, 3, 2, 4))), {"causal": True}),
    ("attention_single", lambda r: (r.normal(size=(2, C, 3)), *r.normal(size=(3, 2, C))), {"causal": True}),
    ("mlp", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=(C, 4 * C)), r.normal(size=4 * C),
                       r.normal(size=(4 * C, C)), r.normal(size=C)), {"approximate": "tanh"}),
    ("block", lambda r: (r.normal(size=(2, 3, C)), _block_p(r)), {"n_head": 2, "ln_order": "pre"}),
    ("block", lambda r: (r.normal(size=(2, 3, C)), _block_p(r)),
     {"n_head": 2, "ln_order": "post", "gelu": "none", "dropout": 0.2, "seed": 3}),
    ("cross_entropy", lambda r: (r.normal(size=(2, 3, 7)), r.integers(0, 7, size=(2, 3))), {}),
    ("rmsnorm", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=C)), {"eps": 1e-6}),
    ("silu", lambda r: (r.normal(size=(2, 3, C)),), {}),
    ("swiglu", lambda r: (r.normal(size=(2, 3, C)), r.normal(size=(C, 6)), r.normal(size=(C, 6)),
                          r.normal(size=(6, C))), {}),
    ("rope", lambda r: (r.normal(size=(2, 2, 3, C)),), {}),
    ("rope", lambda r: (r.normal(size=(2, 2, 3, C)),), {"start": 4, "pairing": "adjacent"}),
    ("logistic", lambda r: (r.normal(size=(2, 3)), r.integers(0, 2, size=(2, 3))), {}),
]  # fmt: skip
CASE_IDS = [f"{name}-{i}" for i, (name, _, _) in enumerate(CASES)]


def to_torch(args, device):
    """NumPy arrays (and dicts of them) -> torch tensors; float ones become float64 leaves."""
    def leaf(a):
        t = torch.as_tensor(a, device=device)
        return t.double().requires_grad_() if t.is_floating_point() else t

    return [{k: leaf(v) for k, v in a.items()} if isinstance(a, dict) else leaf(a) for a in args]


def float_leaves(args):
    flat = [v for a in args for v in (a.values() if isinstance(a, dict) else [a])]
    return [t for t in flat if t.is_floating_point()]


def run(fn, args, hyper, dout_seed=0):
    """out, and the grads of sum(out * dout) for every float leaf."""
    out = fn(*args, **hyper)
    if isinstance(out, tuple):  # a raw layer forward: (out, cache)
        out = out[0]
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(dout_seed),
                       dtype=out.dtype).to(out.device)  # fmt: skip
    (out * dout).sum().backward()
    return out, [t.grad for t in float_leaves(args)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, make, hyper", CASES, ids=CASE_IDS)
def test_layer_grads_match_autograd_of_the_same_forward(name, make, hyper, device):
    """Our backward through as_function == torch autograd differentiating our forward."""
    args = make(np.random.default_rng(0))
    forward = getattr(importlib.import_module(f"gptlab.layers.{name}"), f"{name}_forward")
    out, grads = run(getattr(ag, name), to_torch(args, device), hyper)
    want_out, want_grads = run(forward, to_torch(args, device), hyper)
    assert out.device.type == device
    assert relative_error(out, want_out) < 1e-12
    assert len(grads) == len(want_grads) > 0
    for got, want in zip(grads, want_grads):
        assert got is not None and got.shape == want.shape
        assert relative_error(got, want) < 1e-10


def draws_dropout(name, hyper) -> bool:
    """Whether the layer draws a dropout mask: the dropout layer with p > 0, or any layer (a
    block) with dropout > 0."""
    return hyper.get("p" if name == "dropout" else "dropout", 0.0) > 0


# A dropout mask comes from the generator of the device it is drawn on, so the same seed gives
# different masks on the CPU and on a GPU, by design: every row that draws one (the dropout layer,
# a block with dropout > 0) is left out of the CPU-vs-CUDA comparison.
CUDA_ROWS = [(i, c) for i, c in zip(CASE_IDS, CASES) if not draws_dropout(c[0], c[2])]


def test_cuda_rows_leave_out_every_dropout_draw():
    """The dropout layer and the block with dropout 0.2 (which failed on an H100) are left out,
    every row left out has a positive rate, and no row kept has one."""
    kept = [case for _, case in CUDA_ROWS]
    left_out = [case for case in CASES if case not in kept]
    assert {name for name, _, _ in left_out} == {"dropout", "block"}
    for name, _, hyper in left_out:
        assert hyper.get("p", 0.0) > 0 or hyper.get("dropout", 0.0) > 0, name
    for name, _, hyper in kept:
        assert hyper.get("p", 0.0) == 0.0 and hyper.get("dropout", 0.0) == 0.0, name


@CUDA
@pytest.mark.parametrize("name, make, hyper", [c for _, c in CUDA_ROWS],
                         ids=[i for i, _ in CUDA_ROWS])  # fmt: skip
def test_layers_on_cuda_match_cpu_float64(name, make, hyper):
    args = make(np.random.default_rng(0))
    fn = getattr(ag, name)
    out, grads = run(fn, to_torch(args, "cuda"), hyper)
    want_out, want_grads = run(fn, to_torch(args, "cpu"), hyper)
    assert relative_error(out, want_out) < 1e-10
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 1e-10


def test_every_layer_module_is_wrapped():
    layer_dir = Path(importlib.import_module("gptlab.layers").__file__).parent
    modules = {path.stem for path in layer_dir.glob("*.py") if path.stem != "__init__"}
    assert set(ag.LAYERS) == modules
    for name in ag.LAYERS:
        assert getattr(ag, name).__name__ == name


def test_integer_inputs_get_no_grad_and_float_inputs_do():
    idx = torch.tensor([[1, 2, 2]])
    wte = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    ag.embedding(idx, wte).sum().backward()
    assert wte.grad[2].tolist() == [2.0, 2.0, 2.0] and wte.grad[0].tolist() == [0.0, 0.0, 0.0]


def test_sdpa_mask_gets_no_grad_and_may_be_a_keyword():
    rng = np.random.default_rng(0)
    q, k, v = to_torch([rng.normal(size=(2, 3, C)), rng.normal(size=(2, 4, C)),
                        rng.normal(size=(2, 4, 2))], "cpu")  # fmt: skip
    mask = torch.as_tensor(random_attention_mask(rng, (3, 4)))
    out = ag.sdpa(q, k, v, mask, causal=True)
    assert torch.equal(out, ag.sdpa(q, k, v, mask=mask, causal=True))
    out.sum().backward()
    assert mask.grad is None and all(t.grad is not None for t in (q, k, v))


def test_wrapped_layer_rejects_numpy_arrays():
    with pytest.raises(TypeError, match="argument 0 must be a torch tensor, got ndarray"):
        ag.gelu(np.zeros(3))
    with pytest.raises(TypeError, match=r"argument 1\['w'\] must be a torch tensor"):
        ag.block(torch.zeros(1, 1, 4), {"w": np.zeros(4)}, n_head=2)


def _moe_inputs(r, E=4, H=6):
    """x (2, 3, C) and the weights of E experts, as NumPy arrays."""
    return [r.normal(size=shape) for shape in ((2, 3, C), (C, E), (E, C, H), (E, H), (E, H, C),
                                               (E, C))]  # fmt: skip


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, make, hyper", [
    ("moe", _moe_inputs, {"k": 2, "capacity_factor": 0.75, "aux_weight": 0.5}),
    ("moe", _moe_inputs, {"k": 1, "renormalize": False, "aux_weight": 0.1}),
    ("router", lambda r: (r.normal(size=(6, 4)), np.stack([r.permutation(4)[:2] for _ in range(6)])),
     {"aux_weight": 0.5}),
])  # fmt: skip
def test_pair_output_layers_return_both_and_take_both_grads(name, make, hyper, device):
    """moe and router return a pair (y or gates, aux): the wrapper returns both tensors, and a
    loss that uses both drives our backward with both gradients, as autograd of the forward."""
    forward = getattr(importlib.import_module(f"gptlab.layers.{name}"), f"{name}_forward")
    args = make(np.random.default_rng(0))
    dy = torch.randn(args[0].shape[:-1] + (C if name == "moe" else 2,),
                     generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(device)  # fmt: skip
    results = []
    for fn in (getattr(ag, name), lambda *a, **h: forward(*a, **h)[0]):
        leaves_ = to_torch(args, device)
        y, aux = fn(*leaves_, **hyper)
        ((y * dy).sum() + 3.0 * aux).backward()
        results.append((y, aux, [t.grad for t in float_leaves(leaves_)]))
    (y, aux, grads), (want_y, want_aux, want_grads) = results
    assert y.device.type == device and aux.shape == ()
    assert relative_error(y, want_y) < 1e-12 and relative_error(aux, want_aux) < 1e-12
    assert len(grads) == len(want_grads) == (6 if name == "moe" else 1)
    for got, want in zip(grads, want_grads):
        assert relative_error(got, want) < 1e-10


# --- the whole model ---------------------------------------------------------------------------

TINY = dict(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)


def model_inputs(cfg, device="cpu", seed=0, B=3, T=8):
    """(float64 params with noise on every entry, idx, targets) as torch tensors."""
    rng = np.random.default_rng(seed)
    params = {name: torch.as_tensor(v + rng.normal(0.0, 0.2, v.shape), device=device)
              for name, v in init_params(cfg, seed, dtype="float64").items()}  # fmt: skip
    idx, targets = (torch.as_tensor(rng.integers(0, cfg.vocab_size, (B, T)), device=device)
                    for _ in range(2))  # fmt: skip
    return params, idx, targets


def leaves(params):
    return {name: value.clone().requires_grad_() for name, value in params.items()}


def assert_grads_close(got: dict, want: dict, tol=1e-10):
    assert list(got) == list(want)
    for name in got:
        err = relative_error(got[name].grad, want[name].grad)
        assert err < tol, f"d{name}: relative error {err:.2e}"


@pytest.mark.parametrize("ln_order, position", [("pre", "learned"), ("post", "sinusoidal")])
def test_gpt_loss_backward_fills_grads_like_reference(ln_order, position):
    cfg = GPTConfig(**TINY, ln_order=ln_order, position=position)
    params, idx, targets = model_inputs(cfg)
    ours, ref = leaves(params), leaves(params)
    loss = ag.gpt_loss(ours, idx, cfg, targets)
    loss.backward()
    ref_loss = reference_forward(ref, idx, cfg, targets)[1]
    ref_loss.backward()
    assert relative_error(loss, ref_loss) < 1e-12
    assert_grads_close(ours, ref)


def test_gpt_logits_backward_matches_reference():
    cfg = GPTConfig(**TINY, gelu="none")
    params, idx, _ = model_inputs(cfg, T=5)
    dlogits = torch.randn(3, 5, cfg.vocab_size, dtype=torch.float64)
    ours, ref = leaves(params), leaves(params)
    (ag.gpt_logits(ours, idx, cfg) * dlogits).sum().backward()
    (reference_forward(ref, idx, cfg)[0] * dlogits).sum().backward()
    assert_grads_close(ours, ref)


def test_module_uses_both_outputs_and_gpt2_names():
    """A loss that uses logits AND loss sends both gradients into one gpt_backward."""
    cfg = GPTConfig(**TINY)
    params, idx, targets = model_inputs(cfg)
    model = ag.GPT.from_params(params, cfg)
    assert list(model.params) == list(param_shapes(cfg))
    assert "h_0_attn_c_attn_weight" in dict(model.named_parameters())
    assert all(a is b for a, b in zip(model.parameters(), model.params.values()))
    logits, loss = model(idx, targets)
    (loss + 0.1 * logits.square().mean()).backward()
    ref = leaves(params)
    ref_logits, ref_loss = reference_forward(ref, idx, cfg, targets)
    (ref_loss + 0.1 * ref_logits.square().mean()).backward()
    assert_grads_close(model.params, ref)
    assert model(idx)[1] is None


def test_module_copies_its_params_and_inits_fresh():
    cfg = GPTConfig(**TINY)
    params, _, _ = model_inputs(cfg)
    model = ag.GPT.from_params(params, cfg)
    with torch.no_grad():
        model.params["wte.weight"].zero_()
    assert params["wte.weight"].abs().sum() > 0
    fresh = ag.GPT(cfg, seed=0, dtype="float64")
    assert torch.equal(fresh.params["h.1.mlp.c_fc.weight"],
                       torch.as_tensor(init_params(cfg, 0, dtype="float64")["h.1.mlp.c_fc.weight"]))


def optimizer_steps(params_module, loss_fn, steps=3):
    opt = torch.optim.AdamW(params_module, lr=1e-2, weight_decay=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()


def run_steps_manual(cfg, params, idx, targets, steps=3):
    model = ag.GPT.from_params(params, cfg)
    optimizer_steps(model.parameters(), lambda: model(idx, targets)[1], steps)
    return model.params


def test_adamw_steps_with_manual_backward_match_reference():
    cfg = GPTConfig(**TINY, ln_order="post")
    params, idx, targets = model_inputs(cfg)
    ours = run_steps_manual(cfg, params, idx, targets)
    ref = leaves(params)
    optimizer_steps(ref.values(), lambda: reference_forward(ref, idx, cfg, targets)[1])
    for name in ours:
        assert not torch.equal(ours[name], params[name]), f"{name} did not move"
        assert relative_error(ours[name], ref[name]) < 1e-10, name


def test_dropout_training_matches_gpt_forward_backward():
    cfg = GPTConfig(**TINY, dropout=0.2)
    params, idx, targets = model_inputs(cfg)
    ours = leaves(params)
    loss = ag.gpt_loss(ours, idx, cfg, targets, dropout_seed=5)
    loss.backward()
    _, want_loss, cache = gpt_forward(params, idx, cfg, targets, dropout_seed=5)
    want = gpt_backward(cache)
    assert loss.item() == want_loss.item()
    assert loss.item() != gpt_forward(params, idx, cfg, targets)[1].item()
    for name, grad in want.items():
        assert torch.equal(ours[name].grad, grad), name


def test_gpt_loss_rejects_bad_inputs():
    cfg = GPTConfig(**TINY)
    params, idx, targets = model_inputs(cfg)
    with pytest.raises(TypeError, match="wte.weight must be a torch tensor"):
        ag.gpt_loss({**params, "wte.weight": params["wte.weight"].numpy()}, idx, cfg, targets)
    with pytest.raises(TypeError, match="idx must be a torch tensor"):
        ag.gpt_loss(params, idx.numpy(), cfg, targets)
    with pytest.raises(ValueError, match="gpt_loss needs targets"):
        ag.gpt_loss(params, idx, cfg, None)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ag.gpt_loss(params, idx + cfg.vocab_size, cfg, targets)


@CUDA
def test_gpt_on_cuda_matches_cpu_float64():
    cfg = GPTConfig(**TINY)
    params, idx, targets = model_inputs(cfg)
    on_cpu = run_steps_manual(cfg, params, idx, targets, steps=2)
    on_cuda = run_steps_manual(cfg, {n: v.cuda() for n, v in params.items()}, idx.cuda(),
                               targets.cuda(), steps=2)  # fmt: skip
    for name in on_cpu:
        assert on_cuda[name].device.type == "cuda"
        assert relative_error(on_cuda[name], on_cpu[name]) < 1e-10, name
