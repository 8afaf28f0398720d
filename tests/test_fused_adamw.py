"""The fused AdamW (gptlab.training.optim.FusedAdamW: one Triton launch over gptlab.fast.FlatParams,
whose gradients gptlab.fast.FlatStep leaves in place) against the functional AdamW, the plain
training step and whole training runs.

Without CUDA the kernel runs under Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by
tests/conftest.py before any kernel is defined). float64 is not a Triton dtype: the kernel runs
in float32 and is compared with AdamW in float64 on the same (rounded) gradients. Tolerances are
derived bounds (tests/bounds.py) on the largest error relative to the largest reference value:
UPDATE for master weights and moments (a dozen float32 operations per element and update); RUN_BOUNDS
for a training run with kernels="triton" against kernels="torch" (in bfloat16 the Triton LayerNorm,
GELU, attention and classifier round their outputs differently: one rounding per operation).
"""

from __future__ import annotations

import weakref

import numpy as np
import pytest
import torch
from bounds import Bound, assert_relative, assert_within, model_roundoff, roundoff

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton = pytest.importorskip("triton", reason="Triton does not import on this machine")

from gptlab import GPTConfig, init_params  # noqa: E402
from gptlab.fast import FastStep, FlatGrads, FlatParams, FlatStep, LossScaler  # noqa: E402
from gptlab.kernels import adamw  # noqa: E402
from gptlab.training.checkpoint import (  # noqa: E402
    load_checkpoint,
    load_run_checkpoint,
    save_checkpoint,
)
from gptlab.training.config import TrainConfig  # noqa: E402
from gptlab.training.data import embedded_corpus  # noqa: E402
from gptlab.training.optim import (  # noqa: E402
    SGD,
    AdamW,
    FusedAdamW,
    matrices_and_positions,
    matrices_only,
)
from gptlab.training.parallel.base import clipped_grads  # noqa: E402
from gptlab.training.steps import OneProcess  # noqa: E402
from gptlab.training import train as train_module  # noqa: E402
from gptlab.training.train import train  # noqa: E402

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)
HYPER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def master_params(seed=0) -> dict:
    """CFG's parameters in float32 on the kernels' device, perturbed so no entry is exactly 0."""
    rng = np.random.default_rng(seed)
    return {name: torch.tensor(value + rng.normal(0.0, 0.02, value.shape), dtype=torch.float32,
                               device=DEVICE)
            for name, value in init_params(CFG, seed, dtype="float64").items()}  # fmt: skip


UPDATE = roundoff("float32", 12, steps=4, why="a dozen float32 operations per element, 4 updates")
# A run of up to 4 updates of RUN's one layer (4 steps a pass; the longest sum: 64 hidden units).
RUN_BOUNDS = {"float32": roundoff("float32", 64, steps=4 * 4, why="1 layer, 4 updates"),
              "bfloat16": roundoff("bfloat16", 1, steps=4, why="one rounding of each operation's "
                                   "output, float32 accumulation")}


def assert_tensors_within(got: dict, want: dict, bound, label: str) -> None:
    """Every tensor of ``got`` within ``bound`` of ``want``'s, relative to its largest entry."""
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert_relative(got[name], w, bound, label, name)


def max_error(got: dict, want: dict) -> float:
    """The largest |got - want| over every entry, relative to the largest |want| of its tensor."""
    return max(float((got[n].double().cpu() - w.double().cpu()).abs().max())
               / max(float(w.abs().max()), 1e-30) for n, w in want.items())  # fmt: skip


# --- the update against AdamW ------------------------------------------------------------------


@pytest.mark.roundoff
@pytest.mark.parametrize("precision,decay_filter", [("float32", matrices_only),
                                                    ("bfloat16", matrices_and_positions),
                                                    ("float16", matrices_only)])
def test_the_fused_update_is_adamw_over_a_gpt(precision, decay_filter):
    """Four updates of a GPT's parameters with the learning rate changing and the gradients
    scaled (a clip factor) on every other step: masters and moments equal AdamW.step's in float64
    to the bound UPDATE; the state has AdamW's keys and step; the bfloat16 / float16 copies are exactly the
    masters rounded to nearest (torch's cast)."""
    flat = FlatParams(master_params(), precision, decayed=decay_filter)
    decayed = [decay_filter(name, p) for name, p in flat.items()]
    assert decayed == sorted(decayed, reverse=True) and decayed[0] and not decayed[-1]
    fused = FusedAdamW(flat, decay_filter=decay_filter, **HYPER)
    want = {name: p.double().cpu() for name, p in flat.items()}
    adamw = AdamW(want, decay_filter=decay_filter, **HYPER)
    rng = np.random.default_rng(1)
    for lr, scale in ((1e-2, 1.0), (3e-2, 0.5), (2e-2, 1.0), (5e-3, 0.25)):
        for g in flat.grads.values():  # the backward's output, in the compute dtype
            g.copy_(torch.tensor(rng.standard_normal(tuple(g.shape))))
        assert fused.step(flat, FlatGrads(flat, scale), lr=lr) is flat  # in place
        want = adamw.step(want, {name: g.double().cpu() * scale
                                 for name, g in flat.grads.items()}, lr=lr)  # fmt: skip
    assert_tensors_within(dict(flat.items()), want, UPDATE, "fused AdamW vs float64, masters")
    got_state, want_state = fused.state_dict(), adamw.state_dict()
    assert (got_state["kind"], got_state["step"]) == (want_state["kind"], want_state["step"]) == (
        "adamw", 4)
    assert_tensors_within(got_state["state"], want_state["state"], UPDATE,
                          "fused AdamW vs float64, moments")
    if precision != "float32":
        assert torch.equal(flat.compute, flat.master.to(flat.compute.dtype))


def test_bfloat16_copies_round_to_nearest_even():
    """The kernel's copy is torch's rounding on the values where rounding is decided: ties (to
    even, down and up), a carry into the exponent, subnormals, the largest floats, signed zeros.
    With lr = 0 the update leaves theta as it is, so the copy is of these values."""
    values = [1 + 2**-8, 1 + 3 * 2**-8, 2 - 2**-9, -(1 + 2**-8 + 2**-20), 1e-40, -3e-39, 3.3e38,
              -3.4e38, 0.0, -0.0, 0.1, -2.7182817]  # fmt: skip
    theta = torch.tensor(values, dtype=torch.float32, device=DEVICE)
    zeros = torch.zeros_like(theta)
    copy = torch.empty_like(theta, dtype=torch.bfloat16)
    adamw.adamw_update(theta, zeros, zeros.clone(), zeros.clone(), step=1, lr=0.0,
                       compute=copy, **HYPER)  # fmt: skip
    assert torch.equal(theta.cpu(), torch.tensor(values, dtype=torch.float32))
    want = theta.to(torch.bfloat16)
    assert torch.equal(copy.view(torch.int16), want.view(torch.int16))  # bit for bit, -0.0 too


# Three updates of CFG on (2, 8) tokens; in bfloat16 and float16 a compute weight may land one
# rounding of the dtype away, once per update.
STEP_BOUNDS = {"float32": model_roundoff(CFG, 2, 8, updates=3),
               **{dtype: roundoff(dtype, 1, steps=3, why="one compute weight rounded the other "
                                  "way, 3 updates") for dtype in ("bfloat16", "float16")}}


@pytest.mark.roundoff
@pytest.mark.parametrize("precision", ["float32", "bfloat16", "float16"])
def test_steps_over_flat_params_follow_the_plain_loop(precision):
    """Three clipped updates (grad_clip 0.05, so the clip acts; the step in torch ops): FlatParams
    with FlatStep and FusedAdamW give the losses and gradient norms (relative) and the master
    weights (absolute: the weights are at most about 1) of a dict with FastStep and AdamW, to
    STEP_BOUNDS (float32: the same step in another order; bfloat16 and float16: a master on the
    edge of a rounding may round to
    another compute weight). Absolute, because the key part of c_attn.bias has a zero gradient up
    to round-off, which Adam's m / sqrt(v) turns into steps of order lr: in float32 the two paths
    differ there by about 1e-4 lr. float16 first runs two steps at a loss scale of 2^40: both
    overflow and are skipped on both sides, and the masters stay as they were."""
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, CFG.vocab_size, (2, 8), generator=generator).to(DEVICE)
               for _ in range(4)]  # fmt: skip
    runs = {}
    for kind in ("plain", "fused"):
        scaler = LossScaler(scale=2.0**40) if precision == "float16" else None
        params = master_params()
        if kind == "fused":
            params = FlatParams(params, precision, decayed=matrices_only)
        step = (FlatStep if kind == "fused" else FastStep)(CFG, precision, scaler=scaler,
                                                           kernels="torch")  # fmt: skip
        mode = OneProcess(params, lambda p, x, y, seed: step(p, x, y))
        optimizer = (FusedAdamW if kind == "fused" else AdamW)(mode.params, **HYPER)
        before = {name: p.clone() for name, p in mode.params.items()}
        history = []
        if precision == "float16":
            for x in batches[:2]:
                assert clipped_grads(mode, x, x.roll(1, 1), 0.05)[1] is None  # overflowed
            assert step.scaler.skipped == 2 and max_error(mode.params, before) == 0.0
            step.scaler.scale = 1024.0
        for x, lr in zip(batches[1:], (1e-2, 2e-2, 1e-2), strict=True):
            loss, grads, norm = clipped_grads(mode, x, x.roll(1, 1), 0.05)
            mode.params = optimizer.step(mode.params, grads, lr=lr)
            history.append((loss, norm))
        runs[kind] = history, mode.params
    bound = STEP_BOUNDS[precision]
    (plain, plain_params), (fused, fused_params) = runs["plain"], runs["fused"]
    assert min(norm for _, norm in plain) > 0.05  # every step clipped
    for got, want in zip(fused, plain, strict=True):
        assert_relative(got, want, bound, f"flat vs plain step, {precision} losses and norms")
    for name, p in plain_params.items():
        assert_within(fused_params[name], p, bound, f"flat vs plain step, {precision} masters",
                      name)


def test_compute_copies_follow_the_masters():
    """The copies are made on first use, written by the update itself (no second copy), and made
    again after an in-place edit of a master; an entry cannot be rebound."""
    flat = FlatParams(master_params(), "bfloat16", decayed=matrices_only)
    fused = FusedAdamW(flat, **HYPER)
    compute = flat.compute_weights()
    assert all(torch.equal(compute[n], p.to(torch.bfloat16)) for n, p in flat.items())
    flat.grad.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    fused.step(flat, FlatGrads(flat, 1.0), lr=0.1)
    assert torch.equal(flat.compute, flat.master.to(torch.bfloat16))  # the kernel wrote them
    written = flat.compute._version
    flat.compute_weights()
    assert flat.compute._version == written  # no copy: they were current
    flat["wte.weight"].mul_(2.0)  # an edit the update did not make
    assert torch.equal(flat.compute_weights()["wte.weight"],
                       flat["wte.weight"].to(torch.bfloat16))  # fmt: skip
    with pytest.raises(TypeError, match="never rebind"):
        flat["wte.weight"] = torch.zeros_like(flat["wte.weight"])



def test_a_single_file_checkpoint_resumes_with_either_optimizer(tmp_path):
    """save_checkpoint names FusedAdamW's state AdamW's: the file restores into AdamW (as on a
    machine without Triton) and into a new FusedAdamW, whose next update then equals the update
    of one that never stopped, bit for bit; another kind is still refused."""
    flat = FlatParams(master_params(), "bfloat16", decayed=matrices_only)
    fused = FusedAdamW(flat, **HYPER)
    flat.grad.normal_(generator=torch.Generator(DEVICE).manual_seed(0))
    fused.step(flat, FlatGrads(flat, 1.0), lr=0.1)
    path = tmp_path / "fused.safetensors"
    save_checkpoint(path, dict(flat.items()), fused, step=1, config=CFG)
    saved = load_checkpoint(path, backend="torch", device=DEVICE)
    assert saved.optimizer_kind == "gptlab.training.optim.AdamW"
    plain = AdamW(saved.params, **HYPER)
    saved.restore_optimizer(plain)
    assert plain.state_dict()["step"] == 1
    resumed_flat = FlatParams(saved.params, "bfloat16", decayed=matrices_only)
    resumed = FusedAdamW(resumed_flat, **HYPER)
    saved.restore_optimizer(resumed)
    for optimizer, params in ((fused, flat), (resumed, resumed_flat)):
        params.grad.copy_(torch.linspace(-1.0, 1.0, params.grad.numel(), device=DEVICE))
        optimizer.step(params, FlatGrads(params, 1.0), lr=0.1)
    assert torch.equal(resumed_flat.master, flat.master)
    assert torch.equal(resumed_flat.compute, flat.compute)
    with pytest.raises(ValueError, match="optimizer kind mismatch"):
        saved.restore_optimizer(SGD(saved.params))

# --- whole runs ---------------------------------------------------------------------------------

RUN = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2, eval_iters=1,
           warmup_iters=1, lr=1e-2, grad_clip=0.5, fused=True, device="cpu", threads=1)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(embedded_corpus()[:5_000], encoding="utf-8")
    return str(path)


def assert_close_histories(got, want, precision: str, label: str) -> None:
    """The same steps and learning rates, every loss within RUN_BOUNDS[precision] (relative)."""
    assert [(row["step"], row["lr"]) for row in got] == [(row["step"], row["lr"]) for row in want]
    for row, want_row in zip(got, want, strict=True):
        for split in ("train_loss", "val_loss"):
            assert_relative(row[split], want_row[split], RUN_BOUNDS[precision],
                            f"{label}, {precision}", f"{split} at step {row['step']}")


@pytest.mark.roundoff
@pytest.mark.skipif(DEVICE != "cpu", reason="the runs use device='cpu': the interpreter's")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_run_with_the_fused_optimizer_matches_the_torch_ops(tmp_path, corpus, monkeypatch,
                                                              precision):
    """kernels="triton" takes FusedAdamW for every update (counted); the loss history is
    kernels="torch"'s (AdamW, torch ops) within RUN_BOUNDS."""
    updates = []
    fused_step = FusedAdamW.step
    monkeypatch.setattr(FusedAdamW, "step", lambda self, *a, **k: updates.append(1)
                        or fused_step(self, *a, **k))  # fmt: skip
    runs = {}
    for kernels in ("torch", "triton"):
        cfg = TrainConfig(**RUN, data=corpus, max_iters=3, eval_interval=1, precision=precision,
                          kernels=kernels, out_dir=str(tmp_path / kernels))  # fmt: skip
        assert cfg.fused_optimizer == (kernels == "triton")
        runs[kernels] = train(cfg, progress=False).history
    assert len(updates) == 3
    assert_close_histories(runs["triton"], runs["torch"], precision, "triton vs torch run")


# The moments of runs on the two kernel sets: Adam's first steps are about lr x sign(g), so an
# element whose gradient is round-off may step the other way (2 lr), and the gradients after it
# move by up to 2 lr of their size, in each of the 4 updates. Loose, but a moment lost or mixed up
# on the way through a checkpoint is off by its whole size.
MOMENTS_BOUND = Bound(2 * RUN["lr"] * 4, "2 lr x 4 updates (Adam's sign-like first steps)")


@pytest.mark.roundoff
@pytest.mark.skipif(DEVICE != "cpu", reason="the runs use device='cpu': the interpreter's")
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_checkpoints_resume_across_the_two_optimizers(tmp_path, corpus, precision):
    """Stopped at step 2 and resumed to 4 with the other kernels: FusedAdamW's checkpoint
    (AdamW's format) goes on under AdamW and back, to the losses of runs that never stopped (the
    bounds RUN_BOUNDS: the kernels differ) and, in float32, to their final
    moments within MOMENTS_BOUND of each tensor's largest. A resumed bfloat16 fused run makes its
    compute copies from the loaded masters."""
    config = dict(RUN, data=corpus, eval_interval=2, lr_decay_iters=4, precision=precision)
    straight = {}
    for kernels in ("torch", "triton"):
        out_dir = str(tmp_path / f"straight-{kernels}")
        history = train(TrainConfig(**config, max_iters=4, kernels=kernels, out_dir=out_dir),
                        progress=False).history  # fmt: skip
        straight[kernels] = history, load_run_checkpoint(out_dir).optimizer_state["state"]
    for first, then in (("triton", "torch"), ("torch", "triton")):
        out_dir = str(tmp_path / f"{first}-{then}")
        train(TrainConfig(**config, max_iters=2, kernels=first, out_dir=out_dir), progress=False)
        assert load_run_checkpoint(out_dir).state["optimizer_kind"] == "adamw"
        resumed = train(TrainConfig(**config, max_iters=4, kernels=then, out_dir=out_dir,
                                    resume=True), progress=False).history  # fmt: skip
        moments = load_run_checkpoint(out_dir).optimizer_state["state"]
        assert [row["step"] for row in resumed] == [0, 2, 4]
        for kernels in (first, then):
            assert_close_histories(resumed, straight[kernels][0], precision,
                                   "resumed with the other kernels")
            if precision == "float32":
                want = straight[kernels][1]
                assert sorted(moments) == sorted(want)
                for name, value in moments.items():
                    assert_relative(value, want[name], MOMENTS_BOUND,
                                    "resumed with the other kernels, float32 moments", name)



@pytest.mark.skipif(DEVICE != "cpu", reason="the runs use device='cpu': the interpreter's")
def test_a_resumed_run_keeps_no_second_copy_of_the_loaded_arrays(tmp_path, corpus, monkeypatch):
    """After the optimizer took the loaded moments, the loaded checkpoint is let go: its
    parameters (copied into the flat buffers) are gone before the first step of the resumed
    run."""
    config = dict(RUN, data=corpus, eval_interval=2, lr_decay_iters=4, kernels="triton",
                  out_dir=str(tmp_path / "run"))
    train(TrainConfig(**config, max_iters=2), progress=False)
    load_run, clipped_grads = train_module.load_run, train_module.clipped_grads
    loaded, alive = [], []  # a weak reference to a loaded tensor; alive at each step?

    def watched_load_run(*args, **kwargs):
        ckpt = load_run(*args, **kwargs)
        loaded.append(weakref.ref(ckpt.params["wte.weight"]))
        return ckpt

    def watched_clipped_grads(*args, **kwargs):
        alive.append(loaded[0]() is not None)
        return clipped_grads(*args, **kwargs)

    monkeypatch.setattr(train_module, "load_run", watched_load_run)
    monkeypatch.setattr(train_module, "clipped_grads", watched_clipped_grads)
    train(TrainConfig(**config, max_iters=4, resume=True), progress=False)
    assert alive == [False, False]

# --- bad input ----------------------------------------------------------------------------------


def test_bad_input_gets_a_clear_error():
    params = master_params()
    flat = FlatParams(params, "bfloat16", decayed=matrices_only)
    with pytest.raises(TypeError, match="FlatParams holds float32"):
        FlatParams({**params, "wte.weight": params["wte.weight"].double()}, decayed=matrices_only)
    with pytest.raises(ValueError, match="precision must be one of"):
        FlatParams(params, "float8", decayed=matrices_only)
    with pytest.raises(TypeError, match="updates a gptlab.fast.FlatParams"):
        FusedAdamW(params, **HYPER)
    with pytest.raises(ValueError, match="another decay filter"):
        FusedAdamW(flat, decay_filter=matrices_and_positions, **HYPER)
    with pytest.raises(ValueError, match="lr"):
        FusedAdamW(flat, lr=-1.0)
    fused = FusedAdamW(flat, **HYPER)
    with pytest.raises(ValueError, match="FlatGrads of a FlatStep"):
        fused.step(flat, dict(flat.grads), lr=0.1)
    other = FlatParams(params, "bfloat16", decayed=matrices_only)
    with pytest.raises(ValueError, match="FlatParams it was built over"):
        fused.step(other, FlatGrads(other, 1.0), lr=0.1)
    with pytest.raises(ValueError, match="grad_scale"):
        fused.step(flat, FlatGrads(flat, float("nan")), lr=0.1)
    assert fused.step_count == 0  # nothing counted for the refused updates
    with pytest.raises(ValueError, match="decayed must be an integer in"):
        adamw.adamw_update(flat.master, flat.grad, fused.m, fused.v, step=1, lr=0.1,
                           decayed=flat.master.numel() + 1, **HYPER)  # fmt: skip
    tokens = [torch.zeros(1, 2, dtype=torch.long, device=DEVICE)] * 2
    with pytest.raises(ValueError, match="precision='float32', got bfloat16"):
        FlatStep(CFG, "float32")(flat, *tokens)
    with pytest.raises(ValueError, match="FlatParams of precision='bfloat16', got dict"):
        FlatStep(CFG, "bfloat16")(params, *tokens)
    ones = {key: torch.ones_like(x) for key, x in fused.state_dict()["state"].items()}
    with pytest.raises(ValueError, match="has shape"):  # the last name in the layout
        fused.load_state_dict({"kind": "adamw", "step": 3,
                               "state": {**ones, f"v.{list(flat)[-1]}": torch.ones(3)}})
    assert float(fused.m.abs().sum()) == 0.0  # refused before any moment was written
