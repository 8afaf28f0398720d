"""Sharded checkpoints of a parallel run: every rank writes its part, and any mode at any world
size reads them back.

A run directory written by W ranks at step s holds

    shard-<s>-<r>-of-<W>.safetensors   rank r's rows of every parameter ("param/<name>") and of
                                       every optimizer moment ("optimizer/m.<name>", ...):
                                       rows [r k, (r + 1) k) of the full tensor, k = ceil(rows / W)
    index-<s>.json                     per tensor its full shape and which file holds which rows
    tokenizer.json, state.json         as a one-process run (``gptlab.checkpoint``); state.json
                                       names the index instead of one model file

Every file is written atomically (``gptlab.checkpoint.atomic_write``); the ranks meet at a
barrier once their shards are on disk, and only then does rank 0 write the index and, last,
state.json. A run killed at any moment leaves the previous state.json and the files it names
whole (the files carry the step in their names). Nothing is pickled.

Reading gathers the rows back into full tensors (``read_sharded``); a mode then takes its own
part with ``mode.shard``, so a run resumes at another world size or in another mode. The part a
rank writes is computed from full tensors (``mode.unshard``), so every mode that keeps the
contract of ``base.ParallelMode`` can write one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch.distributed as dist

from ..backend import asarray_like, convert, to_numpy
from ..checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    STATE_FILE,
    TOKENIZER_FILE,
    RunCheckpoint,
    _read_tensors,
    _safetensors_bytes,
    atomic_write,
    load_run_checkpoint,
    read_state,
)
from ..config import GPTConfig
from ..model import check_params
from ..tokenizer import load_tokenizer
from .base import rank_and_world, rows_per_rank

PARAM_PREFIX, OPTIMIZER_PREFIX = "param/", "optimizer/"


def rank_rows(n_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of the rows rank ``rank`` writes (empty past the end of the tensor)."""
    k = rows_per_rank(n_rows, world_size)
    return min(rank * k, n_rows), min((rank + 1) * k, n_rows)


def _full_state(mode, optimizer) -> dict:
    """Every tensor of the checkpoint, full, keyed by its name in the shard files."""
    full = {PARAM_PREFIX + name: t for name, t in mode.unshard(mode.params).items()}
    for buffer in optimizer.buffers:
        local = {name: optimizer.state[f"{buffer}.{name}"] for name in mode.params}
        full.update({f"{OPTIMIZER_PREFIX}{buffer}.{name}": t
                     for name, t in mode.unshard(local).items()})
    return full


def save_sharded(out_dir, *, step: int, mode, optimizer, tokenizer, model_config,
                 extra: dict | None = None, group=None) -> Path:
    """Every rank: write its shard; rank 0: then the index, the tokenizer and state.json (see
    the module docstring). A collective: every rank of ``group`` calls it. Returns the path of
    state.json."""
    out_dir = Path(out_dir)
    rank, world_size = rank_and_world(group)
    full = _full_state(mode, optimizer)  # a collective: before any rank writes
    shard_file = f"shard-{step:08d}-{rank}-of-{world_size}.safetensors"
    rows = {key: rank_rows(t.shape[0], rank, world_size) for key, t in full.items()}
    mine = {key: full[key][start:stop] for key, (start, stop) in rows.items() if stop > start}
    atomic_write(out_dir / shard_file, _safetensors_bytes(mine, {"format": FORMAT,
                                                                 "step": str(step)}))
    if world_size > 1:
        dist.barrier(group=group)  # every shard is on disk
    if rank == 0:
        index = {"format": FORMAT, "step": step, "world_size": world_size,
                 "tensors": {key: {"shape": list(t.shape),
                                   "pieces": _pieces(t.shape[0], step, world_size)}
                             for key, t in full.items()}}
        index_file = f"index-{step:08d}.json"
        atomic_write(out_dir / index_file, json.dumps(index).encode("utf-8"))
        atomic_write(out_dir / TOKENIZER_FILE, tokenizer.to_json().encode("utf-8"))
        state = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step,
                 "index_file": index_file, "tokenizer_file": TOKENIZER_FILE,
                 "optimizer_kind": optimizer.kind, "optimizer_step": optimizer.step_count,
                 "model_config": model_config.to_dict(), **(extra or {})}
        atomic_write(out_dir / STATE_FILE, json.dumps(state, indent=1).encode("utf-8"))
        _remove_older(out_dir, step)
    if world_size > 1:
        dist.barrier(group=group)  # nobody reads or writes the directory before state.json is in
    return out_dir / STATE_FILE


def _pieces(n_rows: int, step: int, world_size: int) -> list:
    """[[shard file, start, stop]] of the ranks that hold rows of a tensor of ``n_rows``."""
    pieces = []
    for r in range(world_size):
        start, stop = rank_rows(n_rows, r, world_size)
        if stop > start:
            pieces.append([f"shard-{step:08d}-{r}-of-{world_size}.safetensors", start, stop])
    return pieces


def _remove_older(out_dir: Path, step: int) -> None:
    """Drop the weight files of other steps (and of one-process checkpoints) and stale temps."""
    keep = f"{step:08d}"
    for pattern in ("shard-*.safetensors", "index-*.json", "model-*.safetensors",
                    "optimizer-*.safetensors", ".*.tmp-*"):
        for path in out_dir.glob(pattern):
            if keep not in path.name or path.name.startswith("."):
                path.unlink(missing_ok=True)


def read_sharded(ckpt_dir, state: dict) -> tuple[dict, dict]:
    """(params, optimizer moments) as full NumPy arrays, from the index that ``state`` (a
    state.json) names; ValueError naming the file when a piece is missing or does not fit."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / state["index_file"]
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: no such file (the checkpoint is incomplete)")
    index = json.loads(index_path.read_text(encoding="utf-8"))
    step, files = state["step"], {}
    full = {}
    for key, entry in index["tensors"].items():
        pieces = []
        for file, start, stop in entry["pieces"]:
            if file not in files:
                files[file] = _read_tensors(ckpt_dir / file, step)
            piece = files[file].get(key)
            if piece is None or piece.shape[0] != stop - start:
                raise ValueError(f"{ckpt_dir / file}: rows {start}:{stop} of {key} are missing")
            pieces.append(piece)
        full[key] = np.concatenate(pieces)
        if list(full[key].shape) != entry["shape"]:
            raise ValueError(f"{index_path}: the pieces of {key} make {full[key].shape}, "
                             f"expected {entry['shape']}")
    params = {k.removeprefix(PARAM_PREFIX): v for k, v in full.items()
              if k.startswith(PARAM_PREFIX)}
    moments = {k.removeprefix(OPTIMIZER_PREFIX): v for k, v in full.items()
               if k.startswith(OPTIMIZER_PREFIX)}
    return params, moments


def shard_optimizer_state(mode, optimizer_state: dict) -> dict:
    """A full optimizer state (``{"kind", "step", "state": {"m.<name>": full array}}``) cut
    to the mode's layout, ready for ``optimizer.load_state_dict``."""
    buffers = sorted({key.split(".", 1)[0] for key in optimizer_state["state"]})
    state = {}
    for buffer in buffers:
        full = {name: asarray_like(to_numpy(optimizer_state["state"][f"{buffer}.{name}"]), like)
                for name, like in mode.params.items()}
        state.update({f"{buffer}.{name}": t for name, t in mode.shard(full).items()})
    return {**optimizer_state, "state": state}


def load_run(ckpt_dir, backend: str = "torch", dtype=None, device=None) -> RunCheckpoint:
    """A run directory written by one process (``gptlab.checkpoint``) or by the ranks of a
    parallel run, as a RunCheckpoint with FULL params and optimizer moments."""
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    if "index_file" not in state:
        return load_run_checkpoint(ckpt_dir, backend=backend, dtype=dtype, device=device)
    params, moments = read_sharded(ckpt_dir, state)
    model_config = GPTConfig(**state["model_config"])
    check_params(params, model_config)
    params = {name: convert(x, backend, dtype=dtype, device=device) for name, x in params.items()}
    optimizer_state = {"kind": state["optimizer_kind"], "step": state["optimizer_step"],
                       "state": moments}
    tokenizer = load_tokenizer(ckpt_dir / state["tokenizer_file"])
    return RunCheckpoint(state["step"], params, optimizer_state, tokenizer, model_config, state)


__all__ = ["save_sharded", "read_sharded", "load_run", "shard_optimizer_state", "rank_rows"]
