"""Checkpoints: weights and optimizer moments in safetensors, everything else in a JSON sidecar.

A checkpoint directory holds

    model-<step>.safetensors      the parameters, GPT-2 names (plain tensors: never pickle)
    optimizer-<step>.safetensors  the optimizer's moments ("m.<name>", "v.<name>", ...)
    tokenizer.json                the tokenizer (``gptlab.tokenizer.load_tokenizer``)
    state.json                    step, configs, RNG state, loss history, and the file names

Every file is written atomically (a temporary file in the same directory, fsync, ``os.replace``)
and ``state.json`` goes last. The weight files carry the step in their names, so a new save
never overwrites the files the current ``state.json`` names: a crash (even SIGKILL) at any point
of a save leaves the previous checkpoint whole. Files of older steps are removed only after the
new ``state.json`` is in place.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save as safetensors_bytes

from .backend import convert, to_numpy
from .config import GPTConfig
from .model import check_params
from .tokenizer import Tokenizer, load_tokenizer

FORMAT = "gptlab-checkpoint"
FORMAT_VERSION = 1
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tensors_bytes(arrays: dict, step: int) -> bytes:
    host = {name: np.ascontiguousarray(to_numpy(x)) for name, x in arrays.items()}
    return safetensors_bytes(host, metadata={"format": FORMAT, "step": str(step)})


def _read_tensors(path: Path, step: int) -> dict[str, np.ndarray]:
    try:
        with safe_open(str(path), framework="np") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"{path}: not a readable safetensors file (truncated or foreign?): "
                         f"{err}") from err
    if metadata.get("format") != FORMAT or metadata.get("step") != str(step):
        raise ValueError(f"{path}: not the gptlab checkpoint of step {step} "
                         f"(its metadata is {metadata})")
    return tensors


def save_checkpoint(out_dir, *, step: int, params: dict, optimizer, tokenizer: Tokenizer,
                    model_config: GPTConfig, extra: dict | None = None) -> Path:
    """Write the checkpoint of ``step`` into ``out_dir``; returns the path of its state.json.

    ``optimizer`` is anything with ``state_dict()`` (``gptlab.optim``); ``extra`` (JSON-friendly:
    train config, RNG state, history, ...) is stored in state.json as it is.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_params(params, model_config)
    opt_state = optimizer.state_dict()
    model_file = f"model-{step:08d}.safetensors"
    optimizer_file = f"optimizer-{step:08d}.safetensors"
    atomic_write(out_dir / model_file, _tensors_bytes(params, step))
    atomic_write(out_dir / optimizer_file, _tensors_bytes(opt_state["state"], step))
    atomic_write(out_dir / TOKENIZER_FILE, tokenizer.to_json().encode("utf-8"))
    state = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
        "model_file": model_file, "optimizer_file": optimizer_file,
        "tokenizer_file": TOKENIZER_FILE, "optimizer_kind": opt_state["kind"],
        "optimizer_step": opt_state["step"], "model_config": model_config.to_dict(),
        **(extra or {}),
    }  # fmt: skip
    atomic_write(out_dir / STATE_FILE, json.dumps(state, indent=1).encode("utf-8"))
    for old in [*out_dir.glob("model-*.safetensors"), *out_dir.glob("optimizer-*.safetensors")]:
        if old.name not in (model_file, optimizer_file):
            old.unlink()
    for stale in out_dir.glob(".*.tmp-*"):  # left by a save that was killed
        stale.unlink()
    return out_dir / STATE_FILE


@dataclass
class Checkpoint:
    """A loaded checkpoint: params on the requested backend, NumPy optimizer moments."""

    step: int
    params: dict
    optimizer_state: dict  # {"kind", "step", "state": {name: np.ndarray}}, see gptlab.optim
    tokenizer: Tokenizer
    model_config: GPTConfig
    state: dict  # the whole state.json


def read_state(ckpt_dir) -> dict:
    """The parsed state.json of ``ckpt_dir`` (FileNotFoundError / ValueError when unusable)."""
    path = Path(ckpt_dir) / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint in {ckpt_dir}: {path} does not exist")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a gptlab checkpoint state file ({err})") from err
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path}: not a gptlab checkpoint (no \"format\": \"{FORMAT}\")")
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: checkpoint format version {state.get('format_version')!r}, "
                         f"this gptlab reads version {FORMAT_VERSION}")
    return state


def load_checkpoint(ckpt_dir, backend: str = "numpy", dtype=None, device=None) -> Checkpoint:
    """Read the checkpoint in ``ckpt_dir``; params go to ``backend`` (and ``dtype``/``device``).

    Truncated or foreign files raise ValueError naming the file; nothing is ever unpickled.
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    step = state["step"]
    model_config = GPTConfig(**state["model_config"])
    params = _read_tensors(ckpt_dir / state["model_file"], step)
    try:
        check_params(params, model_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{ckpt_dir / state['model_file']}: {err}") from err
    params = {name: convert(x, backend, dtype=dtype, device=device) for name, x in params.items()}
    moments = _read_tensors(ckpt_dir / state["optimizer_file"], step)
    optimizer_state = {"kind": state["optimizer_kind"], "step": state["optimizer_step"],
                       "state": moments}
    tokenizer = load_tokenizer(ckpt_dir / state["tokenizer_file"])
    return Checkpoint(step, params, optimizer_state, tokenizer, model_config, state)


__all__ = ["FORMAT_VERSION", "STATE_FILE", "atomic_write", "save_checkpoint", "read_state",
           "load_checkpoint", "Checkpoint"]
