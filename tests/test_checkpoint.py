"""Checkpoints, one file and a training run directory: round trips, clear errors for missing,
truncated or foreign files, crash-safe saves."""

from __future__ import annotations

import ast
import errno
import io
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import requires_cuda
from safetensors import safe_open
from safetensors.numpy import save_file

import gptlab.training.checkpoint as ckpt_module
from gptlab import GPTConfig, init_params, param_shapes
from gptlab.autograd import GPT
from gptlab.backend import convert, to_numpy
from gptlab.training.checkpoint import (
    STATE_FILE,
    atomic_write,
    load_checkpoint,
    load_run_checkpoint,
    save_checkpoint,
    save_run_checkpoint,
)
from gptlab.training.optim import SGD, AdamW, TorchAdamW, TorchSGD, param_groups
from gptlab.tokenizers.char import CharTokenizer

CFG = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=5, block_size=4)
TOKENIZER = CharTokenizer.from_text("abcde")


def _trained(steps: int, backend="torch"):
    params = init_params(CFG, seed=0, backend=backend)
    opt = AdamW(params, lr=1e-2)
    rng = np.random.default_rng(steps)
    for _ in range(steps):
        grads = {n: torch.as_tensor(rng.standard_normal(s), dtype=torch.float32)
                 for n, s in param_shapes(CFG).items()}
        params = opt.step(params, grads)
    return params, opt


def _save(out_dir, step, params, opt):
    return save_run_checkpoint(out_dir, step=step, params=params, optimizer=opt,
                               tokenizer=TOKENIZER, model_config=CFG,
                               extra={"note": "hi", "rng": {"state": 2**100}})


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(to_numpy(a[name]), to_numpy(b[name]))


def test_run_round_trip(tmp_path):
    params, opt = _trained(3)
    state_path = _save(tmp_path, 3, params, opt)
    assert state_path == tmp_path / STATE_FILE
    ckpt = load_run_checkpoint(tmp_path)
    assert ckpt.step == 3 and ckpt.model_config == CFG
    assert ckpt.state["note"] == "hi" and ckpt.state["rng"]["state"] == 2**100
    assert ckpt.tokenizer.chars == TOKENIZER.chars
    _assert_same(ckpt.params, params)
    assert ckpt.params["wte.weight"].dtype == np.float32
    restored = AdamW(init_params(CFG, seed=1, backend="torch"))
    restored.load_state_dict(ckpt.optimizer_state)
    assert restored.step_count == 3
    _assert_same(restored.state, opt.state)
    on_torch = load_run_checkpoint(tmp_path, backend="torch", dtype="float64")
    assert on_torch.params["wte.weight"].dtype == torch.float64


def test_new_save_replaces_old_files(tmp_path):
    _save(tmp_path, 1, *_trained(1))
    _save(tmp_path, 2, *_trained(2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["model-00000002.safetensors", "optimizer-00000002.safetensors",
                     STATE_FILE, "tokenizer.json"]
    assert load_run_checkpoint(tmp_path).step == 2


class SimulatedCrash(BaseException):
    """A process dying mid-save: nothing catches it (the command line catches Ctrl-C)."""


@contextmanager
def killed_at_state_json(monkeypatch):
    """A save in the block dies (SimulatedCrash) as it comes to write state.json, every other
    file of its checkpoint written: what SIGKILL at the worst moment leaves."""
    real_write = ckpt_module.atomic_write

    def crash_on_state(path, data):
        if path.name == STATE_FILE:
            raise SimulatedCrash("simulated crash")
        real_write(path, data)

    monkeypatch.setattr(ckpt_module, "atomic_write", crash_on_state)
    with pytest.raises(SimulatedCrash):
        yield
    monkeypatch.undo()


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Kill the save after the new weights are written but before state.json is: step 1 loads."""
    params1, opt1 = _trained(1)
    _save(tmp_path, 1, params1, opt1)
    with killed_at_state_json(monkeypatch):
        _save(tmp_path, 2, *_trained(2))
    ckpt = load_run_checkpoint(tmp_path)
    assert ckpt.step == 1
    _assert_same(ckpt.params, params1)


def test_atomic_write_leaves_old_content_when_interrupted(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    atomic_write(path, b"old")

    def fail(src, dst):
        raise OSError("disk unplugged")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError):
        atomic_write(path, b"new")
    monkeypatch.undo()
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # no temporary file left behind


def test_truncated_weights_give_a_clear_error(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    model = tmp_path / "model-00000003.safetensors"
    model.write_bytes(model.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model-00000003.safetensors: truncated"):
        load_run_checkpoint(tmp_path)


def test_foreign_weights_give_a_clear_error(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    (tmp_path / "optimizer-00000003.safetensors").write_bytes(b"PK\x03\x04 a zip, not tensors" * 10)
    with pytest.raises(ValueError, match="optimizer-00000003.safetensors"):
        load_run_checkpoint(tmp_path)


def test_weights_of_another_step_are_rejected(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["step"] = 4
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="not the gptlab checkpoint of step 4"):
        load_run_checkpoint(tmp_path)


def test_weights_that_do_not_fit_the_config_are_rejected(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["model_config"]["n_embd"] = 16
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="model-00000003.safetensors: .*expected"):
        load_run_checkpoint(tmp_path)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not a gptlab checkpoint state file"),
    (b'{"step": 3}', "not a gptlab checkpoint"),
    (b'{"format": "gptlab-checkpoint", "format_version": 99}', "format version 99"),
])  # fmt: skip
def test_bad_state_file(tmp_path, content, message):
    _save(tmp_path, 3, *_trained(3))
    (tmp_path / STATE_FILE).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_run_checkpoint(tmp_path)


def test_missing_run_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        load_run_checkpoint(tmp_path / "empty")


# ------------------------------------------------------------------------------------------------
# One file: save_checkpoint / load_checkpoint


def _functional(opt_class, backend, steps, params=None, opt=None):
    """Updates ``steps`` of a functional optimizer on seeded random gradients, in float64."""
    if params is None:
        params = init_params(CFG, seed=0, backend=backend, dtype="float64")
        opt = opt_class(params, lr=1e-2)
    for step in steps:
        rng = np.random.default_rng(step)
        grads = {n: convert(rng.standard_normal(s), backend)
                 for n, s in param_shapes(CFG).items()}
        params = opt.step(params, grads)
    return params, opt


def _train_gpt(model: GPT, opt, steps, device="cpu"):
    """Updates ``steps`` of a GPT module by a torch optimizer, its gradients from gpt_backward."""
    for step in steps:
        rng = np.random.default_rng(step)
        x, y = (torch.as_tensor(rng.integers(0, CFG.vocab_size, (2, CFG.block_size)),
                                device=device) for _ in range(2))
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()


def _target(tmp_path, to: str):
    return tmp_path / "ckpt.safetensors" if to == "path" else io.BytesIO()


def _rewind(target):
    if isinstance(target, io.BytesIO):
        target.seek(0)
    return target


@pytest.mark.parametrize("to", ["path", "bytesio"])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("opt_class", [AdamW, SGD])
def test_file_round_trip_with_a_functional_optimizer(tmp_path, to, backend, opt_class):
    """Save after 3 steps, load, restore the optimizer: 2 more steps match the run that went on."""
    params, opt = _functional(opt_class, backend, range(3))
    target = _target(tmp_path, to)
    save_checkpoint(target, params, opt, step=3, config=CFG)
    ckpt = load_checkpoint(_rewind(target), backend=backend)
    assert ckpt.step == 3 and ckpt.config == CFG
    assert ckpt.optimizer_kind == f"gptlab.training.optim.{opt_class.__name__}"
    assert list(ckpt.params) == list(params)
    assert type(ckpt.params["wte.weight"]) is type(params["wte.weight"])
    _assert_same(ckpt.params, params)
    resumed = opt_class(ckpt.params, lr=1e-2)
    ckpt.restore_optimizer(resumed)
    assert resumed.step_count == 3
    went_on, _ = _functional(opt_class, backend, range(3, 5), params, opt)
    finished, _ = _functional(opt_class, backend, range(3, 5), ckpt.params, resumed)
    _assert_same(finished, went_on)


@pytest.mark.parametrize("to", ["path", "bytesio"])
@pytest.mark.parametrize("make_optimizer", [
    lambda groups: TorchAdamW(groups, lr=1e-2),
    lambda groups: TorchSGD(groups, lr=0.1, momentum=0.9, nesterov=True),
    lambda groups: torch.optim.AdamW(groups, lr=1e-2),
], ids=["TorchAdamW", "TorchSGD", "torch.optim.AdamW"])  # fmt: skip
def test_file_round_trip_with_a_torch_optimizer(tmp_path, to, make_optimizer):
    """A GPT module and its torch optimizer: save, load into a new module and optimizer, and
    both go on identically."""
    model = GPT(CFG, seed=0, dtype="float64")
    opt = make_optimizer(param_groups(model.params, 0.1))
    _train_gpt(model, opt, range(3))
    target = _target(tmp_path, to)
    save_checkpoint(target, model.params, opt, step=3, config=CFG)
    ckpt = load_checkpoint(_rewind(target), backend="torch")
    assert ckpt.optimizer_kind == f"{type(opt).__module__}.{type(opt).__qualname__}"
    _assert_same(ckpt.params, model.params)
    resumed_model = GPT(ckpt.config, ckpt.params)
    resumed_opt = make_optimizer(param_groups(resumed_model.params, 0.1))
    ckpt.restore_optimizer(resumed_opt)
    _train_gpt(model, opt, range(3, 5))
    _train_gpt(resumed_model, resumed_opt, range(3, 5))
    _assert_same(resumed_model.params, model.params)


def test_file_without_optimizer_or_config(tmp_path):
    params = init_params(CFG, seed=0)
    buffer = io.BytesIO()
    save_checkpoint(buffer, params)
    ckpt = load_checkpoint(_rewind(buffer), backend="torch", dtype="float64")
    assert ckpt.step == 0 and ckpt.config is None and ckpt.optimizer_state is None
    assert ckpt.params["wte.weight"].dtype == torch.float64
    _assert_same(ckpt.params, params)
    with pytest.raises(ValueError, match="<BytesIO>: the checkpoint holds no optimizer state"):
        ckpt.restore_optimizer(AdamW(params))


def test_file_object_opened_by_open(tmp_path):
    params, opt = _functional(SGD, "numpy", range(2))
    path = tmp_path / "ckpt.safetensors"
    with open(path, "wb") as f:
        save_checkpoint(f, params, opt, step=2)
    with open(path, "rb") as f:
        ckpt = load_checkpoint(f)
    assert ckpt.step == 2 and ckpt.source == str(path)
    _assert_same(ckpt.params, params)
    with open(path) as f, pytest.raises(TypeError, match="'rb'"):
        load_checkpoint(f)
    with open(tmp_path / "text.txt", "w") as f, pytest.raises(TypeError, match="'wb'"):
        save_checkpoint(f, params)


def test_interrupted_write_keeps_the_previous_file(tmp_path, monkeypatch):
    params, opt = _functional(AdamW, "numpy", range(2))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params, opt, step=2, config=CFG)
    before = path.read_bytes()
    newer, opt = _functional(AdamW, "numpy", range(2, 4), params, opt)

    def fail(fd):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(os, "fsync", fail)  # the new bytes are written, not yet made durable
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(path, newer, opt, step=4, config=CFG)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.safetensors"]
    assert load_checkpoint(path).step == 2


def test_save_rejects_bad_input(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    params = init_params(CFG, seed=0)
    with pytest.raises(ValueError, match=r"wte.weight has shape \(3, 8\), expected \(5, 8\)"):
        save_checkpoint(path, {**params, "wte.weight": np.zeros((3, 8))}, config=CFG)
    with pytest.raises(ValueError, match="step must be an integer >= 0"):
        save_checkpoint(path, params, step=-1)
    with pytest.raises(ValueError, match="at least one tensor"):
        save_checkpoint(path, {})
    with pytest.raises(ValueError, match="must not start with 'optimizer/'"):
        save_checkpoint(path, {"optimizer/m": np.zeros(2)})
    assert not path.exists()


def _saved(tmp_path) -> tuple:
    params, opt = _functional(AdamW, "numpy", range(2))
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, params, opt, step=2, config=CFG)
    return path, params


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors: no such file"):
        load_checkpoint(tmp_path / "nope.safetensors")
    with pytest.raises(IsADirectoryError, match="load_run_checkpoint reads"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("damage, message", [
    (lambda data: b"", "the file is empty"),
    (lambda data: data[:-100], "truncated: its tensors end at byte"),
    (lambda data: data[:60], "truncated: its header ends at byte"),
    (lambda data: b"PK\x03\x04 a zip archive, not tensors " * 10, "not a safetensors file"),
    (lambda data: b"abc", "not a safetensors file"),
], ids=["empty", "truncated-tensors", "truncated-header", "zip", "three-bytes"])  # fmt: skip
@pytest.mark.parametrize("via", ["path", "bytesio"])
def test_damaged_file(tmp_path, damage, message, via):
    path, _ = _saved(tmp_path)
    path.write_bytes(damage(path.read_bytes()))
    source, name = (path, str(path)) if via == "path" else (io.BytesIO(path.read_bytes()),
                                                            "<BytesIO>")
    with pytest.raises(ValueError, match=f"{re.escape(name)}: {message}"):
        load_checkpoint(source)


def test_safetensors_file_that_is_not_a_gptlab_checkpoint(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"wte.weight": np.zeros((5, 8))}, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.safetensors: a safetensors file, but not a gptlab"):
        load_checkpoint(path)
    _save(tmp_path / "run", 3, *_trained(3))  # a weight file of a run directory
    with pytest.raises(ValueError, match="weight file of a training run directory"):
        load_checkpoint(tmp_path / "run" / "model-00000003.safetensors")


def _drop(name, listed):
    """Remove tensor ``name`` from the file, and from its metadata's list too if ``listed``."""
    def edit(tensors, header):
        del tensors[name]
        if listed:
            header["params"].remove(name)
    return edit


def _add(name, shape, listed):
    """Add a tensor ``name`` to the file, and to its metadata's list too if ``listed``."""
    def edit(tensors, header):
        tensors[name] = np.zeros(shape)
        if listed:
            header["params"].append(name)
    return edit


WRONG_FILES = {  # id: (edit of the tensors and header, the error after the file name)
    "unlisted-missing": (_drop("h.0.ln_1.bias", listed=False),
                         r"do not match its metadata: missing \['h.0.ln_1.bias'\]"),
    "unlisted-extra": (_add("h.9.mlp.c_fc.weight", (8, 32), listed=False),
                       r"unexpected \['h.9.mlp.c_fc.weight'\]"),
    "missing-for-config": (_drop("h.0.ln_1.bias", listed=True),
                           r"do not match the config: missing \['h.0.ln_1.bias'\]"),
    "extra-for-config": (_add("h.1.ln_1.weight", (8,), listed=True),
                         r"config: missing \[\], unexpected \['h.1.ln_1.weight'\]"),
    "wrong-shape-for-config": (lambda tensors, header: header["config"].update(n_embd=16),
                               r"wte.weight has shape \(5, 8\), expected \(5, 16\)"),
    "format-version": (lambda tensors, header: header.update(format_version=99),
                       "checkpoint format version 99"),
    "no-step": (lambda tensors, header: header.pop("step"),
                r"metadata is malformed \(KeyError\('step'\)\)"),
}


@pytest.mark.parametrize("edit, error", WRONG_FILES.values(), ids=WRONG_FILES.keys())
def test_file_whose_tensors_or_metadata_are_wrong(tmp_path, edit, error):
    """Re-save a checkpoint with its tensors or its gptlab metadata changed, as a buggy or foreign
    writer would."""
    path, _ = _saved(tmp_path)
    with safe_open(str(path), framework="np") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    header = json.loads(metadata["gptlab"])
    edit(tensors, header)
    save_file(tensors, path, metadata={**metadata, "gptlab": json.dumps(header)})
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: .*{error}"):
        load_checkpoint(path)


def test_optimizer_kind_mismatch(tmp_path):
    path, _ = _saved(tmp_path)  # AdamW state
    ckpt = load_checkpoint(path)
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: optimizer kind mismatch: "
                                         "the checkpoint holds the state of gptlab.training.optim.AdamW, "
                                         "not of gptlab.training.optim.SGD"):
        ckpt.restore_optimizer(SGD(ckpt.params))
    with pytest.raises(ValueError, match="not of gptlab.training.optim.TorchAdamW"):
        ckpt.restore_optimizer(TorchAdamW([torch.zeros(3, requires_grad=True)]))
    fewer = {n: x for n, x in ckpt.params.items() if n != "wpe.weight"}
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: optimizer state does not "
                                         r"match: missing \[\], unexpected \['m.wpe.weight'"):
        ckpt.restore_optimizer(AdamW(fewer))


def test_file_with_changed_tensor_bytes_is_refused(tmp_path):
    """4,000 zero bytes written over the tensors of a single-file checkpoint: its header's
    sha256 no longer matches, and the load names the file."""
    path, _ = _saved(tmp_path)
    data = path.read_bytes()
    start = 8 + int.from_bytes(data[:8], "little") + 64
    assert any(data[start:start + 4000])
    path.write_bytes(data[:start] + bytes(4000) + data[start + 4000:])
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: its tensors do not match the "
                                         "sha256 its header records"):
        load_checkpoint(path)


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999)),
    lambda params: TorchAdamW(params, lr=1e-2, betas=(0.8, 0.99)),
], ids=["torch.optim.AdamW", "TorchAdamW"])  # fmt: skip
def test_optimizer_settings_round_trip_exactly(make_optimizer):
    """Every setting of every parameter group comes back as it was, of the same type: the betas
    a tuple, not the list that JSON would make of it."""
    model = GPT(CFG, seed=0, dtype="float64")
    opt = make_optimizer(param_groups(model.params, 0.1))
    _train_gpt(model, opt, range(2))
    buffer = io.BytesIO()
    save_checkpoint(buffer, model.params, opt, step=2, config=CFG)
    ckpt = load_checkpoint(_rewind(buffer), backend="torch")
    resumed = make_optimizer(param_groups(GPT(CFG, ckpt.params).params, 0.1))
    resumed.param_groups[0]["betas"] = (0.5, 0.5)  # the checkpoint's must win
    ckpt.restore_optimizer(resumed)
    for saved, restored in zip(opt.param_groups, resumed.param_groups, strict=True):
        settings = {key: value for key, value in saved.items() if key != "params"}
        assert {key: restored[key] for key in settings} == settings
        assert {key: type(restored[key]) for key in settings} == {
            key: type(value) for key, value in settings.items()}
        assert type(restored["betas"]) is tuple


@requires_cuda
def test_file_round_trip_onto_cuda(tmp_path):
    model = GPT(CFG, seed=0, dtype="float64", device="cuda")
    opt = TorchAdamW(param_groups(model.params, 0.1), lr=1e-2)
    _train_gpt(model, opt, range(2), device="cuda")
    buffer = io.BytesIO()
    save_checkpoint(buffer, model.params, opt, step=2, config=CFG)
    ckpt = load_checkpoint(_rewind(buffer), backend="torch", device="cuda")
    assert ckpt.params["wte.weight"].device.type == "cuda"
    resumed_model = GPT(ckpt.config, ckpt.params)
    resumed_opt = TorchAdamW(param_groups(resumed_model.params, 0.1), lr=1e-2)
    ckpt.restore_optimizer(resumed_opt)
    assert resumed_opt.state[resumed_model.params["wte.weight"]]["m"].device.type == "cuda"
    _train_gpt(model, opt, range(2, 4), device="cuda")
    _train_gpt(resumed_model, resumed_opt, range(2, 4), device="cuda")
    for name, p in model.params.items():  # CUDA's scatter-add may sum in another order
        torch.testing.assert_close(resumed_model.params[name], p, rtol=0.0, atol=1e-12)


VARIANTS = {
    "llama": GPTConfig.llama(n_layer=1, n_head=4, n_embd=8, vocab_size=5, block_size=4,
                             n_kv_head=2, mlp_hidden=12),
    "moe": GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=5, block_size=4, mlp="moe",
                     n_expert=3, capacity_factor=1.25, norm="rmsnorm", position="rope"),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variants_round_trip_with_their_names_and_config(tmp_path, variant):
    """A run directory and a single file keep the variant's parameters under their names
    (lm_head, q_proj, gate_proj, the experts' stacks) and its whole config in the JSON."""
    cfg = VARIANTS[variant]
    params = init_params(cfg, seed=3, backend="torch")
    opt = AdamW(params, lr=1e-2)
    params = opt.step(params, {n: torch.ones_like(p) for n, p in params.items()})
    save_run_checkpoint(tmp_path / "run", step=1, params=params, optimizer=opt,
                        tokenizer=TOKENIZER, model_config=cfg)  # fmt: skip
    state = json.loads((tmp_path / "run" / STATE_FILE).read_text())
    assert GPTConfig(**state["model_config"]) == cfg
    run = load_run_checkpoint(tmp_path / "run", backend="torch")
    assert run.model_config == cfg and set(run.params) == set(param_shapes(cfg))
    _assert_same(run.params, params)
    save_checkpoint(tmp_path / "one.safetensors", params, opt, step=1, config=cfg)
    one = load_checkpoint(tmp_path / "one.safetensors")
    assert one.config == cfg
    _assert_same(one.params, params)
    with safe_open(tmp_path / "one.safetensors", framework="np") as f:
        names = set(f.keys())
    assert set(param_shapes(cfg)) <= names  # the parameters under their own names


# ------------------------------------------------------------------------------------------------
# Nothing saved is lost or silently wrong (issue 33)

USER_FILES = ["model-best.safetensors", "tokenizer-2.json", "index-notes.json",
              "model-00001-of-00002.safetensors", "optimizer-notes.txt", "shard-a.safetensors"]


def test_a_save_removes_only_the_files_earlier_saves_recorded(tmp_path):
    """The user's files stay whatever their names (the patterns of checkpoint files too); the
    previous checkpoint's files, and those a killed save began, go."""
    _save(tmp_path, 1, *_trained(1))
    for name in USER_FILES:
        (tmp_path / name).write_bytes(b"the user's " + name.encode())
    _save(tmp_path, 2, *_trained(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [*USER_FILES, "model-00000002.safetensors", "optimizer-00000002.safetensors",
         STATE_FILE, "tokenizer.json"])
    for name in USER_FILES:
        assert (tmp_path / name).read_bytes() == b"the user's " + name.encode()


def test_the_files_of_a_killed_save_go_with_the_next_save(tmp_path, monkeypatch):
    _save(tmp_path, 1, *_trained(1))
    with killed_at_state_json(monkeypatch):
        _save(tmp_path, 2, *_trained(2))
    assert (tmp_path / "model-00000002.safetensors").is_file()
    _save(tmp_path, 3, *_trained(3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-00000003.safetensors", "optimizer-00000003.safetensors", STATE_FILE,
        "tokenizer.json"]


def _edit_state(run_dir, edit) -> None:
    state = json.loads((run_dir / STATE_FILE).read_text())
    edit(state)
    (run_dir / STATE_FILE).write_text(json.dumps(state))


def test_a_state_file_that_says_version_1_is_refused_not_read_unverified(tmp_path):
    """Version 1 had no checksums: a state.json that claims it would turn them off."""
    _save(tmp_path, 3, *_trained(3))
    _edit_state(tmp_path, lambda state: state.update(format_version=1))
    with pytest.raises(ValueError, match="format version 1, this gptlab reads version 2 only"):
        load_run_checkpoint(tmp_path)


@pytest.mark.parametrize("where", ["../outside", "{tmp}/outside", "sub"])
def test_file_names_that_leave_the_run_directory_are_refused(tmp_path, where):
    """Even with the file there and its sha256 recorded: a checkpoint names its own files."""
    run_dir = tmp_path / "run"
    _save(run_dir, 3, *_trained(3))
    name = f"{where.format(tmp=tmp_path)}/model-00000003.safetensors"
    (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
    (run_dir / name).write_bytes((run_dir / "model-00000003.safetensors").read_bytes())
    _edit_state(run_dir, lambda state: (state.update(model_file=name), state["sha256"].update(
        {name: state["sha256"]["model-00000003.safetensors"]})))
    with pytest.raises(ValueError, match=re.escape(f"the file name {name!r} is not a file of")):
        load_run_checkpoint(run_dir)


def _rehashed(run_dir, name: str) -> None:
    """Record the sha256 of ``name`` as it is now: the damage of a writer, not of the disk."""
    data = (run_dir / name).read_bytes()
    _edit_state(run_dir, lambda state: state["sha256"].update(
        {name: ckpt_module.sha256_of(data)}))


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_weights_that_are_not_finite_are_refused_naming_the_tensor(tmp_path, value):
    params, opt = _trained(3)
    params = {**params, "h.0.attn.c_proj.weight": params["h.0.attn.c_proj.weight"].clone()}
    params["h.0.attn.c_proj.weight"][1, 2] = value
    _save(tmp_path, 3, params, opt)
    with pytest.raises(ValueError, match=r"model-00000003.safetensors: the tensor "
                                         r"h.0.attn.c_proj.weight holds"):
        load_run_checkpoint(tmp_path)
    save_checkpoint(tmp_path / "one.safetensors", params, opt, step=3, config=CFG)
    with pytest.raises(ValueError, match=r"one.safetensors: the tensor h.0.attn.c_proj.weight"):
        load_checkpoint(tmp_path / "one.safetensors")


def test_a_tokenizer_with_other_ids_than_the_model_is_refused(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    CharTokenizer.from_text("abcd").save(tmp_path / "tokenizer.json")
    _rehashed(tmp_path, "tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer.json: the tokenizer has 4 ids, the model 5"):
        load_run_checkpoint(tmp_path)


def test_a_full_disk_names_the_file(tmp_path, monkeypatch):
    """The disk fills up after the save's journal, as the weights are written."""
    real_fsync, calls = os.fsync, []

    def fills_up(fd):
        calls.append(fd)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fills_up)
    with pytest.raises(OSError, match=f"cannot write {re.escape(str(tmp_path))}/model-00000003"
                                      r".safetensors: No space left on device"):
        _save(tmp_path, 3, *_trained(3))
    assert not list(tmp_path.glob(".*.tmp-*"))  # no temporary file left


def test_every_torch_load_unpickles_weights_only():
    """torch.load without weights_only=True runs any code a pickle names."""
    root = Path(__file__).resolve().parent.parent
    unsafe = []
    for path in sorted([*root.glob("gptlab/**/*.py"), *root.glob("benchmarks/*.py"),
                        *root.glob("tools/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"
                    and not any(k.arg == "weights_only" and ast.unparse(k.value) == "True"
                                for k in node.keywords)):
                unsafe.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not unsafe
