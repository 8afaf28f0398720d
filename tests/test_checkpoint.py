"""Checkpoints: round trip, clear errors for truncated or foreign files, crash-safe saves."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

import gptlab.checkpoint as ckpt_module
from gptlab import GPTConfig, init_params, param_shapes
from gptlab.backend import to_numpy
from gptlab.checkpoint import STATE_FILE, atomic_write, load_checkpoint, save_checkpoint
from gptlab.optim import AdamW
from gptlab.tokenizer import CharTokenizer

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
    return save_checkpoint(out_dir, step=step, params=params, optimizer=opt, tokenizer=TOKENIZER,
                           model_config=CFG, extra={"note": "hi", "rng": {"state": 2**100}})


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_array_equal(to_numpy(a[name]), to_numpy(b[name]))


def test_round_trip(tmp_path):
    params, opt = _trained(3)
    state_path = _save(tmp_path, 3, params, opt)
    assert state_path == tmp_path / STATE_FILE
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.step == 3 and ckpt.model_config == CFG
    assert ckpt.state["note"] == "hi" and ckpt.state["rng"]["state"] == 2**100
    assert ckpt.tokenizer.chars == TOKENIZER.chars
    _assert_same(ckpt.params, params)
    assert ckpt.params["wte.weight"].dtype == np.float32
    restored = AdamW(init_params(CFG, seed=1, backend="torch"))
    restored.load_state_dict(ckpt.optimizer_state)
    assert restored.step_count == 3
    _assert_same(restored.state, opt.state)
    on_torch = load_checkpoint(tmp_path, backend="torch", dtype="float64")
    assert on_torch.params["wte.weight"].dtype == torch.float64


def test_new_save_replaces_old_files(tmp_path):
    _save(tmp_path, 1, *_trained(1))
    _save(tmp_path, 2, *_trained(2))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["model-00000002.safetensors", "optimizer-00000002.safetensors",
                     STATE_FILE, "tokenizer.json"]
    assert load_checkpoint(tmp_path).step == 2


def test_crash_mid_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Kill the save after the new weights are written but before state.json is: step 1 loads."""
    params1, opt1 = _trained(1)
    _save(tmp_path, 1, params1, opt1)
    real_write = ckpt_module.atomic_write

    def crash_on_state(path, data):
        if path.name == STATE_FILE:
            raise KeyboardInterrupt("simulated crash")
        real_write(path, data)

    monkeypatch.setattr(ckpt_module, "atomic_write", crash_on_state)
    with pytest.raises(KeyboardInterrupt):
        _save(tmp_path, 2, *_trained(2))
    monkeypatch.undo()
    ckpt = load_checkpoint(tmp_path)
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


def test_truncated_weights_give_a_clear_error(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    model = tmp_path / "model-00000003.safetensors"
    model.write_bytes(model.read_bytes()[:-100])
    with pytest.raises(ValueError, match=r"model-00000003.safetensors: not a readable safetensors"):
        load_checkpoint(tmp_path)


def test_foreign_weights_give_a_clear_error(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    (tmp_path / "optimizer-00000003.safetensors").write_bytes(b"PK\x03\x04 a zip, not tensors" * 10)
    with pytest.raises(ValueError, match="optimizer-00000003.safetensors"):
        load_checkpoint(tmp_path)


def test_weights_of_another_step_are_rejected(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["step"] = 4
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="not the gptlab checkpoint of step 4"):
        load_checkpoint(tmp_path)


def test_weights_that_do_not_fit_the_config_are_rejected(tmp_path):
    _save(tmp_path, 3, *_trained(3))
    state = json.loads((tmp_path / STATE_FILE).read_text())
    state["model_config"]["n_embd"] = 16
    (tmp_path / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="model-00000003.safetensors: .*expected"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("content, message", [
    (b"{not json", "not a gptlab checkpoint state file"),
    (b'{"step": 3}', "not a gptlab checkpoint"),
    (b'{"format": "gptlab-checkpoint", "format_version": 99}', "format version 99"),
])  # fmt: skip
def test_bad_state_file(tmp_path, content, message):
    _save(tmp_path, 3, *_trained(3))
    (tmp_path / STATE_FILE).write_bytes(content)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path)


def test_missing_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint in"):
        load_checkpoint(tmp_path / "empty")
