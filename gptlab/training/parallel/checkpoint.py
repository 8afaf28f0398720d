"""Sharded checkpoints of a parallel run: every rank writes its part, and any mode at any world
size reads them back.

A run directory written by W ranks at step s holds

    shard-<s>-<r>-of-<W>.safetensors   rank r's rows of every parameter ("param/<name>") and of
                                       every optimizer moment ("optimizer/m.<name>", ...):
                                       rows [r k, (r + 1) k) of the full tensor, k = ceil(rows / W);
                                       its metadata records step, rank, world size and mode
    index-<s>.json                     per tensor its full shape and which file holds which rows;
                                       per shard file its rank and sha256
    tokenizer.json, state.json         as a one-process run (``training/checkpoint.py``); state.json
                                       names the index instead of one model file, and records
                                       the sha256 of the index and the tokenizer

Every file is written atomically and never over a file of other bytes
(``gptlab.training.checkpoint.write_files``); the ranks meet at a barrier once their shards are on
disk, and only then does rank 0 write the index and, last, state.json, and remove the files of older
checkpoints (of any world size, or of one process). A run killed at any moment leaves the
previous state.json and the files it names whole. Reading checks every shard's metadata and
sha256 against the index, so shards swapped between ranks or changed on disk are refused,
naming the file. Nothing is pickled.

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

from ...backend import asarray_like, convert, to_numpy
from ...model import check_params
from ..checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    STATE_FILE,
    TOKENIZER_FILE,
    RunCheckpoint,
    check_moments,
    check_sha256,
    commit_state,
    load_run_checkpoint,
    read_bytes,
    read_run_tokenizer,
    read_state,
    read_tensors,
    recorded_sha256,
    require_fields,
    require_plain_file_name,
    safetensors_bytes,
    state_model_config,
    write_files,
)
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
    rows = {key: rank_rows(t.shape[0], rank, world_size) for key, t in full.items()}
    mine = {key: full[key][start:stop] for key, (start, stop) in rows.items() if stop > start}
    metadata = {"format": FORMAT, "step": str(step), "rank": str(rank),
                "world_size": str(world_size), "mode": type(mode).__name__}
    shard_file = f"shard-{step:08d}-{rank}-of-{world_size}.safetensors"
    names, sha256 = write_files(out_dir, {"shard": (shard_file,
                                                    safetensors_bytes(mine, metadata))})
    shards = [{"file": names["shard"], "rank": rank, "sha256": sha256[names["shard"]]}]
    if world_size > 1:  # every shard is on disk; rank 0 learns their names and checksums
        gathered = [None] * world_size
        dist.all_gather_object(gathered, shards[0], group=group)
        shards = gathered
    if rank == 0:
        index = {"format": FORMAT, "step": step, "world_size": world_size,
                 "mode": type(mode).__name__, "shards": shards,
                 "tensors": {key: {"shape": list(t.shape),
                                   "pieces": _pieces(t.shape[0], shards)}
                             for key, t in full.items()}}
        names, sha256 = write_files(out_dir, {
            "index_file": (f"index-{step:08d}.json", json.dumps(index).encode("utf-8")),
            "tokenizer_file": (TOKENIZER_FILE, tokenizer.to_json().encode("utf-8"))})
        state = {"format": FORMAT, "format_version": FORMAT_VERSION, "step": step, **names,
                 "sha256": sha256, "optimizer_kind": optimizer.kind,
                 "optimizer_step": optimizer.step_count,
                 "model_config": model_config.to_dict(), **(extra or {})}
        commit_state(out_dir, state, keep={*sha256, *(shard["file"] for shard in shards)})
    if world_size > 1:
        dist.barrier(group=group)  # nobody reads or writes the directory before state.json is in
    return out_dir / STATE_FILE


def _pieces(n_rows: int, shards: list[dict]) -> list:
    """[[shard file, start, stop]] of the ranks that hold rows of a tensor of ``n_rows``."""
    pieces = []
    for shard in shards:
        start, stop = rank_rows(n_rows, shard["rank"], len(shards))
        if stop > start:
            pieces.append([shard["file"], start, stop])
    return pieces


def _read_index(ckpt_dir: Path, state: dict) -> tuple[dict, dict]:
    """(the index that state.json names, {shard file: its entry}), checked: ValueError naming
    the index when it is empty, changed, not JSON, or lacks a field."""
    path = ckpt_dir / state["index_file"]
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (the checkpoint is incomplete)")
    data = read_bytes(path)
    if not data:
        raise ValueError(f"{path}: the file is empty (0 bytes), not a checkpoint index")
    check_sha256(path, data, recorded_sha256(ckpt_dir, state, state["index_file"]),
                 ckpt_dir / STATE_FILE)
    try:
        index = json.loads(data)
    except ValueError as err:
        raise ValueError(f"{path}: not a checkpoint index, not JSON ({err})") from err
    if not isinstance(index, dict):
        raise ValueError(f"{path}: not a checkpoint index (a JSON {type(index).__name__})")
    require_fields(index, {"step": int, "tensors": dict, "world_size": int, "mode": str,
                           "shards": list}, path)
    if index["step"] != state["step"]:
        raise ValueError(f"{path}: the index of step {index['step']}, state.json is at step "
                         f"{state['step']}")
    try:
        shards = {shard["file"]: shard for shard in index["shards"]}
        for file in shards:
            require_plain_file_name(file, path)
        for key, entry in index["tensors"].items():
            for file, start, stop in entry["pieces"]:
                if file not in shards:
                    raise ValueError(f"the file {file} of {key} is none of its shards")
            if not isinstance(entry["shape"], list):
                raise ValueError(f"the shape of {key} is {entry['shape']!r}, not a list")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        problem = str(err) if type(err) is ValueError else f"{type(err).__name__}: {err}"
        raise ValueError(f"{path}: not a valid checkpoint index ({problem})") from err
    return index, shards


def _read_shard(ckpt_dir: Path, index: dict, shard: dict, file: str, index_path: Path):
    """The tensors of one shard file, its metadata and sha256 checked against the index."""
    expected = {"format": FORMAT, "step": str(index["step"]), "rank": str(shard["rank"]),
                "world_size": str(index["world_size"]), "mode": index["mode"]}
    return read_tensors(ckpt_dir / file, expected, shard["sha256"], index_path)


def read_sharded(ckpt_dir, state: dict) -> tuple[dict, dict]:
    """(params, optimizer moments) as full NumPy arrays, from the index that ``state`` (a
    state.json) names; ValueError naming the file when a piece is missing or does not fit."""
    ckpt_dir = Path(ckpt_dir)
    index_path = ckpt_dir / state["index_file"]
    index, shards = _read_index(ckpt_dir, state)
    files, full = {}, {}
    for key, entry in index["tensors"].items():
        pieces = []
        for file, start, stop in entry["pieces"]:
            if file not in files:
                files[file] = _read_shard(ckpt_dir, index, shards[file], file, index_path)
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
    """A run directory written by one process (``gptlab.training.checkpoint``) or by the ranks of a
    parallel run, as a RunCheckpoint with FULL params and optimizer moments."""
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    if "index_file" not in state:
        return load_run_checkpoint(ckpt_dir, backend=backend, dtype=dtype, device=device)
    params, moments = read_sharded(ckpt_dir, state)
    model_config = state_model_config(ckpt_dir, state)
    index_path = ckpt_dir / state["index_file"]
    try:
        check_params(params, model_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{index_path}: {err}") from err
    check_moments(state, moments, params, index_path)
    params = {name: convert(x, backend, dtype=dtype, device=device) for name, x in params.items()}
    optimizer_state = {"kind": state["optimizer_kind"], "step": state["optimizer_step"],
                       "state": moments}
    tokenizer = read_run_tokenizer(ckpt_dir, state, model_config)
    return RunCheckpoint(state["step"], params, optimizer_state, tokenizer, model_config, state)


__all__ = ["save_sharded", "read_sharded", "load_run", "shard_optimizer_state", "rank_rows"]
