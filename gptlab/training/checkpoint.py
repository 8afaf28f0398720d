"""Checkpoints in safetensors (plain tensors, never pickle) with JSON metadata. Two kinds:

One file, the checkpoint of a library user (``save_checkpoint`` / ``load_checkpoint``): the
parameters, the optimizer's state (a ``gptlab.training.optim`` optimizer, functional or torch.optim,
or any ``torch.optim.Optimizer``), the step and the GPTConfig, in ONE safetensors payload: the
parameters under their GPT-2 names, the optimizer's tensors under ``optimizer/...``, everything
else as JSON in the header's metadata, with the sha256 of the tensors (checked on load). The
optimizer's settings come back as they were saved, tuples (AdamW's betas) as tuples. It goes to
a path (written atomically) or to a binary file object (``io.BytesIO``, a file opened "wb").

A training run directory (``save_run_checkpoint`` / ``load_run_checkpoint``, used by
``gptlab.training.train``) holds

    model-<step>.safetensors      the parameters, GPT-2 names
    optimizer-<step>.safetensors  the optimizer's moments ("m.<name>", "v.<name>", ...)
    tokenizer.json                the tokenizer (``gptlab.tokenizers.char.load_tokenizer``)
    state.json                    step, configs, RNG state, loss history, float16's loss
                                  scale (train's ``extra``), the file names and the sha256 of
                                  each file it names (the tokenizer's binds it to the weights)

Every file is written atomically (a temporary file in the same directory, fsync, ``os.replace``)
and ``state.json`` goes last. A save never replaces a file with other bytes: a name that is
taken by other content (the same step of an earlier run that ``--overwrite`` replaces, another
tokenizer) gets a suffix, ``model-<step>-1.safetensors``. So a crash (even SIGKILL) at any
point of a save leaves the previous checkpoint whole, and the files it alone names are removed
only after the new ``state.json`` is in place. A save removes only files that a save recorded
(the previous state.json and index, and a journal, ``.gptlab-journal-<pid>``, of the files each
save begins, so that a killed save's files go with the next one): the user's own files stay,
whatever their names (``model-best.safetensors``, Hugging Face's shards).

Loading verifies what each file records (format, step; rank, world size and mode for shards)
and its sha256 against state.json (or the index), and raises ValueError naming the file and the
problem (missing, empty, truncated, changed bytes, not safetensors, not a gptlab checkpoint,
metadata missing a field, a file name outside the run directory, tensors that do not fit the
config, NaN or infinite values, a tokenizer with another number of ids than the model). Only
the format version that records checksums is read: a state.json that claims an older one would
turn them off.

One run at a time (``claim_run_dir``): a run holds a lock on its directory (``run.lock``, an
flock, the holder's pid inside) and refuses a directory that holds anything without ``resume``
or ``overwrite``.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import io
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as safetensors_load
from safetensors.numpy import save as safetensors_save

from ..backend import convert, to_numpy
from ..config import GPTConfig
from ..model import check_params
from ..tokenizers.char import Tokenizer, load_tokenizer
from .optim import SGD, AdamW

FORMAT = "gptlab-checkpoint"  # the weight files and state.json of a training run directory
FORMAT_VERSION = 2  # 2: checksums in state.json and the index, rank/world size/mode in shards
FILE_FORMAT = "gptlab-checkpoint-file"  # the single-file checkpoint
FILE_FORMAT_VERSION = 1
OPTIMIZER_PREFIX = "optimizer/"  # the optimizer's tensors in a single-file checkpoint
STATE_FILE = "state.json"
TOKENIZER_FILE = "tokenizer.json"
LOCK_FILE = "run.lock"
# The names of the files a checkpoint writes. A save removes such a file only once an earlier
# checkpoint of the run recorded it, and the temporary files of killed saves (``atomic_write``
# names them ".<name>.tmp-<pid>"); the user's own files stay, whatever their names.
CHECKPOINT_PATTERNS = ("model-*.safetensors", "optimizer-*.safetensors", "shard-*.safetensors",
                       "index-*.json", "tokenizer*.json")
TEMP_PATTERNS = tuple(f".{pattern}.tmp-[0-9]*" for pattern in (*CHECKPOINT_PATTERNS, STATE_FILE))
JOURNAL_PREFIX = ".gptlab-journal-"  # + pid: the files a save of that process began to write
OPTIMIZER_BUFFERS = {AdamW.kind: AdamW.buffers, SGD.kind: SGD.buffers}


@contextmanager
def naming(path):
    """An OSError inside the block (a full disk, say) names ``path``, the file being written."""
    try:
        yield
    except OSError as err:
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from err


def atomic_write(path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one.

    A write that fails (or is interrupted) removes its temporary file and leaves ``path`` as it
    was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with naming(path):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _host(arrays: dict) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(to_numpy(x)) for name, x in arrays.items()}


def safetensors_bytes(arrays: dict, metadata: dict[str, str]) -> bytes:
    """The bytes of a safetensors file holding ``arrays`` (NumPy or torch, any device)."""
    return safetensors_save(_host(arrays), metadata=metadata)


def _tensors_sha256(tensors: dict[str, np.ndarray]) -> str:
    """The sha256 of the tensors' names, dtypes, shapes and bytes, in name order: the checksum a
    single-file checkpoint carries in its own header."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        x = tensors[name]
        digest.update(f"{name}:{x.dtype.str}:{x.shape}:".encode("utf-8"))
        digest.update(np.ascontiguousarray(x).tobytes())
    return digest.hexdigest()


def _safetensors_problem(data: bytes) -> str:
    """Why safetensors refused ``data``: cut short, or not a safetensors file at all.

    The format: an 8-byte little-endian header length n, n bytes of JSON (per tensor its dtype,
    shape and data_offsets; "__metadata__"), then the tensor bytes."""
    if len(data) < 9 or data[8:9] != b"{":
        return "not a safetensors file"
    end_of_header = 8 + int.from_bytes(data[:8], "little")
    if len(data) < end_of_header:
        return f"truncated: its header ends at byte {end_of_header}, the file has {len(data)} bytes"
    try:
        header = json.loads(data[8:end_of_header])
        end = end_of_header + max((entry["data_offsets"][1] for key, entry in header.items()
                                   if key != "__metadata__"), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        return "not a safetensors file (its header is not safetensors JSON)"
    if len(data) < end:
        return f"truncated: its tensors end at byte {end}, the file has {len(data)} bytes"
    return "not a readable safetensors file"


def _read_safetensors(data: bytes, name: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, tensors) of a safetensors payload; ValueError naming ``name`` and the problem."""
    if not data:
        raise ValueError(f"{name}: the file is empty (0 bytes), not a checkpoint")
    try:
        tensors = safetensors_load(data)
    except SafetensorError as err:
        raise ValueError(f"{name}: {_safetensors_problem(data)} ({err})") from err
    header = json.loads(data[8 : 8 + int.from_bytes(data[:8], "little")])
    return header.get("__metadata__") or {}, tensors


def read_bytes(path: Path) -> bytes:
    """The bytes of the file ``path``; FileNotFoundError naming it when it is missing."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    return path.read_bytes()


# ------------------------------------------------------------------------------------------------
# One file: params, optimizer state, step, config


def _class_path(obj) -> str:
    """'gptlab.training.optim.AdamW', 'torch.optim.adamw.AdamW', ...: the kind of an optimizer,
    named by the class whose state it keeps (``state_class``: FusedAdamW keeps AdamW's, so a file
    written by one resumes with the other, on a machine without Triton too)."""
    kind = getattr(type(obj), "state_class", type(obj))
    return f"{kind.__module__}.{kind.__qualname__}"


TUPLE_TAG = "__tuple__"  # a tuple in the JSON of a single-file checkpoint: {"__tuple__": [...]}


def _json_tuples(obj):
    """``obj`` with every tuple written {"__tuple__": [...]}, so that JSON keeps tuples (AdamW's
    betas) apart from lists."""
    if isinstance(obj, tuple):
        return {TUPLE_TAG: [_json_tuples(x) for x in obj]}
    if isinstance(obj, list):
        return [_json_tuples(x) for x in obj]
    if isinstance(obj, dict):
        return {key: _json_tuples(value) for key, value in obj.items()}
    return obj


def _tuples_back(obj: dict):
    """The ``object_hook`` of json.loads that undoes ``_json_tuples``."""
    return tuple(obj[TUPLE_TAG]) if obj.keys() == {TUPLE_TAG} else obj


def _optimizer_payload(optimizer) -> tuple[dict, dict]:
    """(JSON description, tensors by key) of ``optimizer.state_dict()``, in either layout:
    gptlab's functional ``{"kind", "step", "state": {"<buffer>.<name>": array}}`` or
    torch.optim's ``{"state": {index: {key: tensor or number}}, "param_groups": [...]}``."""
    state_dict = optimizer.state_dict()
    if "param_groups" not in state_dict:  # gptlab.training.optim.AdamW, SGD
        skeleton = {"kind": state_dict["kind"], "step": state_dict["step"]}
        tensors = dict(state_dict["state"])
    else:  # a torch.optim.Optimizer: tensors become "<index>/<key>", numbers stay in the JSON
        skeleton = {"param_groups": state_dict["param_groups"], "state": {}}
        tensors = {}
        for index, values in state_dict["state"].items():
            skeleton["state"][str(index)] = {k: v for k, v in values.items()
                                             if not hasattr(v, "shape")}
            tensors.update({f"{index}/{k}": v for k, v in values.items() if hasattr(v, "shape")})
    description = {"kind": _class_path(optimizer), "state_dict": skeleton, "tensors": list(tensors)}
    return description, tensors


def _optimizer_state(description: dict, tensors: dict) -> dict:
    """The inverse of ``_optimizer_payload``: a state dict for the optimizer's load_state_dict
    (NumPy arrays for the functional layout, torch tensors for the torch.optim one)."""
    skeleton = description["state_dict"]
    saved = {key: tensors[OPTIMIZER_PREFIX + key] for key in description["tensors"]}
    if "param_groups" not in skeleton:
        return {**skeleton, "state": saved}
    state = {int(index): dict(values) for index, values in skeleton["state"].items()}
    for key, x in saved.items():
        index, name = key.split("/", 1)
        state[int(index)][name] = convert(x, "torch")
    return {"state": state, "param_groups": skeleton["param_groups"]}


def save_checkpoint(target, params: dict, optimizer=None, step: int = 0,
                    config: GPTConfig | None = None) -> None:
    """Write ``params`` (name -> NumPy or torch array), ``optimizer``'s state, ``step`` and
    ``config`` as one safetensors payload to ``target``: a path (written atomically, so a crash
    leaves the previous file whole) or a binary file object.

    ``optimizer``: ``gptlab.training.optim``'s AdamW/SGD/TorchAdamW/TorchSGD or any
    torch.optim.Optimizer (its param_groups must be JSON-friendly). With ``config``, ``params``
    must fit it.
    """
    to_path = isinstance(target, (str, os.PathLike))
    if not to_path and (isinstance(target, io.TextIOBase) or not hasattr(target, "write")):
        raise TypeError(f"target must be a path or a file object opened with 'wb', "
                        f"got {type(target).__name__}")
    if not params:
        raise ValueError("params must hold at least one tensor")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    clashes = [name for name in params if name.startswith(OPTIMIZER_PREFIX)]
    if clashes:
        raise ValueError(f"parameter names must not start with {OPTIMIZER_PREFIX!r}: {clashes}")
    if config is not None:
        check_params(params, config)
    header = {"format_version": FILE_FORMAT_VERSION, "step": step,
              "config": None if config is None else config.to_dict(), "params": list(params),
              "optimizer": None}
    tensors = dict(params)
    if optimizer is not None:
        header["optimizer"], optimizer_tensors = _optimizer_payload(optimizer)
        tensors.update({OPTIMIZER_PREFIX + key: x for key, x in optimizer_tensors.items()})
    tensors = _host(tensors)
    header["tensors_sha256"] = _tensors_sha256(tensors)
    try:
        metadata = {"format": FILE_FORMAT, "gptlab": json.dumps(_json_tuples(header))}
    except TypeError as err:
        raise ValueError(f"the optimizer's state is not JSON-friendly: {err}") from err
    data = safetensors_save(tensors, metadata=metadata)
    if to_path:
        atomic_write(target, data)
    else:
        target.write(data)


@dataclass
class Checkpoint:
    """A loaded single-file checkpoint (``load_checkpoint``)."""

    params: dict  # on the requested backend, dtype and device
    step: int
    config: GPTConfig | None
    optimizer_kind: str | None  # its class ("gptlab.training.optim.AdamW", ...), None: none
    optimizer_state: dict | None  # for its load_state_dict (NumPy arrays, or torch tensors)
    source: str  # the file it was read from, for messages

    def restore_optimizer(self, optimizer) -> None:
        """Load the saved state into ``optimizer``, an optimizer of the saved kind built over the
        loaded params (the same names, or the same parameter groups, as the saved one)."""
        if self.optimizer_state is None:
            raise ValueError(f"{self.source}: the checkpoint holds no optimizer state")
        kind = _class_path(optimizer)
        if kind != self.optimizer_kind:
            raise ValueError(f"{self.source}: optimizer kind mismatch: the checkpoint holds the "
                             f"state of {self.optimizer_kind}, not of {kind}")
        try:
            optimizer.load_state_dict(self.optimizer_state)
        except ValueError as err:
            raise ValueError(f"{self.source}: {err}") from err


def _read_source(source) -> tuple[bytes, str]:
    """(the bytes, a name for messages) of a path or a binary file object."""
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if path.is_dir():
            raise IsADirectoryError(f"{path} is a directory: load_run_checkpoint reads a "
                                    "training run directory, load_checkpoint one file")
        return read_bytes(path), str(path)
    name = str(getattr(source, "name", f"<{type(source).__name__}>"))
    if isinstance(source, io.TextIOBase) or not hasattr(source, "read"):
        raise TypeError(f"source must be a path or a file object opened with 'rb', got {name}")
    return source.read(), name


def _file_header(metadata: dict, name: str) -> dict:
    """The gptlab part of a single-file checkpoint's metadata, checked."""
    if metadata.get("format") != FILE_FORMAT:
        hint = (" (it is a weight file of a training run directory: load_run_checkpoint reads "
                "the directory)" if metadata.get("format") == FORMAT else "")
        raise ValueError(f"{name}: a safetensors file, but not a gptlab checkpoint (its metadata "
                         f"is {metadata}){hint}")
    try:
        header = json.loads(metadata["gptlab"], object_hook=_tuples_back)
    except (KeyError, ValueError) as err:
        raise ValueError(f"{name}: its gptlab metadata is missing or not JSON ({err!r})") from err
    if header.get("format_version") != FILE_FORMAT_VERSION:
        raise ValueError(f"{name}: checkpoint format version {header.get('format_version')!r}, "
                         f"this gptlab reads version {FILE_FORMAT_VERSION}")
    return header


def load_checkpoint(source, backend: str = "numpy", dtype=None, device=None) -> Checkpoint:
    """Read a checkpoint written by ``save_checkpoint`` from a path or a binary file object;
    params go to ``backend`` ("numpy" | "torch"), ``dtype`` and ``device``.

    A missing file raises FileNotFoundError; an empty, truncated or foreign file, or tensors that
    do not fit the saved config, raise ValueError naming the file. Nothing is ever unpickled.
    """
    data, name = _read_source(source)
    metadata, tensors = _read_safetensors(data, name)
    header = _file_header(metadata, name)
    try:
        names, optimizer = list(header["params"]), header["optimizer"]
        listed = names + [OPTIMIZER_PREFIX + key for key in (optimizer or {}).get("tensors", [])]
        config = None if header["config"] is None else GPTConfig(**header["config"])
        step = int(header["step"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{name}: its gptlab metadata is malformed ({err!r})") from err
    missing, extra = sorted(set(listed) - set(tensors)), sorted(set(tensors) - set(listed))
    if missing or extra:
        raise ValueError(f"{name}: its tensors do not match its metadata: missing {missing}, "
                         f"unexpected {extra}")
    params = {n: tensors[n] for n in names}
    if config is not None:
        try:
            check_params(params, config)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{name}: {err}") from err
    recorded = header.get("tensors_sha256")  # None: a file of a gptlab that did not record it
    if recorded is not None and recorded != _tensors_sha256(tensors):
        raise ValueError(f"{name}: its tensors do not match the sha256 its header records: the "
                         "file was damaged or changed after it was saved")
    check_finite(tensors, name)
    params = {n: convert(x, backend, dtype=dtype, device=device) for n, x in params.items()}
    if optimizer is None:
        return Checkpoint(params, step, config, None, None, name)
    return Checkpoint(params, step, config, optimizer["kind"],
                      _optimizer_state(optimizer, tensors), name)


# ------------------------------------------------------------------------------------------------
# A training run directory: weights, optimizer moments, tokenizer, state.json


def sha256_of(data: bytes) -> str:
    """The checksum that state.json and the index record for a file: sha256 of its bytes."""
    return hashlib.sha256(data).hexdigest()


def _write_new(out_dir: Path, name: str, data: bytes) -> str:
    """Write ``data`` into ``out_dir`` as ``name`` and return the name used: ``name``, unless a
    file of that name holds other bytes (the last complete checkpoint may name it); then the
    first free or equal ``<stem>-1.<ext>``, ``<stem>-2.<ext>``, ... A file of equal bytes stays."""
    stem, ext = name.split(".", 1)
    candidate, n = name, 0
    while (out_dir / candidate).exists():
        if (out_dir / candidate).read_bytes() == data:
            return candidate
        n += 1
        candidate = f"{stem}-{n}.{ext}"
    _journal(out_dir, candidate)
    atomic_write(out_dir / candidate, data)
    return candidate


def _journal(out_dir: Path, name: str) -> None:
    """Note in this process's journal (JOURNAL_PREFIX + pid) that a save is about to write
    ``name``: should it die before its state.json, the next save knows the file for its own."""
    path = out_dir / f"{JOURNAL_PREFIX}{os.getpid()}"
    with naming(path), open(path, "a", encoding="utf-8") as journal:
        journal.write(name + "\n")
        journal.flush()
        os.fsync(journal.fileno())


def write_files(out_dir: Path, files: dict[str, tuple[str, bytes]]) -> tuple[dict, dict]:
    """Write {state key: (name, bytes)} into ``out_dir`` (``_write_new``); returns
    ({state key: name used}, {name used: sha256}) for state.json."""
    names, sha256 = {}, {}
    for key, (name, data) in files.items():
        names[key] = _write_new(out_dir, name, data)
        sha256[names[key]] = sha256_of(data)
    return names, sha256


def recorded_files(out_dir: Path) -> set[str]:
    """The checkpoint files (CHECKPOINT_PATTERNS) that the saves in ``out_dir`` recorded: the
    ones its state.json names, the shards its index names, and those in the journals of saves
    since (killed ones' too). A file no save recorded is never removed."""
    names = set()
    for journal in out_dir.glob(JOURNAL_PREFIX + "*"):
        names.update(journal.read_text(encoding="utf-8").split())
    try:
        state = read_state(out_dir)
    except (OSError, ValueError):  # no checkpoint, or a damaged one: its files stay
        state = {"sha256": {}}
    names.update(state["sha256"])
    if "index_file" in state:
        try:
            index = json.loads(read_bytes(out_dir / state["index_file"]))
            names.update(shard["file"] for shard in index["shards"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged index: its shards stay
    return {name for name in names if is_plain_file_name(name)
            and any(fnmatch.fnmatchcase(name, pattern) for pattern in CHECKPOINT_PATTERNS)}


def commit_state(out_dir: Path, state: dict, keep) -> Path:
    """Write ``state`` as out_dir/state.json (atomically: this completes the checkpoint), then
    remove the files that earlier saves recorded (``recorded_files``) and ``keep`` (the new
    checkpoint's) does not name, the journals and the temporary files of killed saves
    (TEMP_PATTERNS). The user's own files stay, whatever their names."""
    previous = recorded_files(out_dir)
    atomic_write(out_dir / STATE_FILE, json.dumps(state, indent=1).encode("utf-8"))
    for name in previous - set(keep):
        (out_dir / name).unlink(missing_ok=True)
    for pattern in (JOURNAL_PREFIX + "*", *TEMP_PATTERNS):
        for path in out_dir.glob(pattern):
            path.unlink(missing_ok=True)
    return out_dir / STATE_FILE


def save_run_checkpoint(out_dir, *, step: int, params: dict, optimizer, tokenizer: Tokenizer,
                        model_config: GPTConfig, extra: dict | None = None) -> Path:
    """Write the checkpoint of ``step`` into the run directory ``out_dir``; returns the path of
    its state.json.

    ``optimizer`` is a functional ``gptlab.training.optim`` optimizer (AdamW, SGD); ``extra``
    (JSON-friendly: train config, RNG state, history, ...) is stored in state.json as it is.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    check_params(params, model_config)
    opt_state = optimizer.state_dict()
    tensor_metadata = {"format": FORMAT, "step": str(step)}
    names, sha256 = write_files(out_dir, {
        "model_file": (f"model-{step:08d}.safetensors",
                       safetensors_bytes(params, tensor_metadata)),
        "optimizer_file": (f"optimizer-{step:08d}.safetensors",
                           safetensors_bytes(opt_state["state"], tensor_metadata)),
        "tokenizer_file": (TOKENIZER_FILE, tokenizer.to_json().encode("utf-8")),
    })  # fmt: skip
    state = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "step": step, **names,
        "sha256": sha256, "optimizer_kind": opt_state["kind"],
        "optimizer_step": opt_state["step"], "model_config": model_config.to_dict(),
        **(extra or {}),
    }  # fmt: skip
    return commit_state(out_dir, state, keep=sha256)


@dataclass
class RunCheckpoint:
    """A loaded run directory: params on the requested backend, NumPy optimizer moments."""

    step: int
    params: dict
    optimizer_state: dict  # {"kind", "step", "state": {name: np.ndarray}}: training/optim.py
    tokenizer: Tokenizer
    model_config: GPTConfig
    state: dict  # the whole state.json


KIND_NAMES = {int: "an integer >= 0", str: "a string", dict: "a JSON object", list: "a JSON list"}
STATE_FIELDS = {"step": int, "model_config": dict, "tokenizer_file": str, "optimizer_kind": str,
                "optimizer_step": int}


def require_fields(state: dict, kinds: dict, path) -> None:
    """ValueError naming ``path`` when a field of ``kinds`` ({key: int | str | dict | list}) is
    missing from ``state`` or of another type (ints must be >= 0)."""
    for key, kind in kinds.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and (isinstance(value, bool) or value < 0)):
            got = f"{value!r}" if key in state else "nothing (the field is missing)"
            raise ValueError(f'{path}: "{key}" must be {KIND_NAMES[kind]}, got {got}')


def read_state(ckpt_dir) -> dict:
    """The parsed state.json of ``ckpt_dir``, its fields checked (FileNotFoundError / ValueError
    naming the file when unusable)."""
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
                         f"this gptlab reads version {FORMAT_VERSION} only (the one whose files "
                         "carry checksums)")
    files = ({"index_file": str} if "index_file" in state
             else {"model_file": str, "optimizer_file": str})
    require_fields(state, {**STATE_FIELDS, **files, "sha256": dict}, path)
    for key in (*files, "tokenizer_file"):
        require_plain_file_name(state[key], path)
    if state["optimizer_kind"] not in OPTIMIZER_BUFFERS:
        raise ValueError(f"{path}: unknown optimizer_kind {state['optimizer_kind']!r}, expected "
                         f"one of {sorted(OPTIMIZER_BUFFERS)}")
    return state


def state_model_config(ckpt_dir, state: dict) -> GPTConfig:
    """The GPTConfig that state.json records; ValueError naming the file when it is not one."""
    try:
        return GPTConfig(**state["model_config"])
    except (TypeError, ValueError) as err:
        raise ValueError(f"{Path(ckpt_dir) / STATE_FILE}: its model_config is not a valid "
                         f"GPTConfig ({err})") from err


def recorded_sha256(ckpt_dir, state: dict, name: str) -> str:
    """The sha256 that state.json records for the file ``name``."""
    sha256 = state["sha256"].get(name)
    if not isinstance(sha256, str):
        raise ValueError(f"{Path(ckpt_dir) / STATE_FILE}: records no sha256 for {name}")
    return sha256


def check_sha256(path: Path, data: bytes, expected: str, recorded_in: Path) -> None:
    """ValueError naming ``path`` when ``data`` (its bytes) are not the ones saved."""
    if sha256_of(data) != expected:
        raise ValueError(f"{path}: its bytes do not match the sha256 that {recorded_in} records "
                         "for it: the file was damaged or replaced after it was saved")


def read_tensors(path: Path, expected: dict[str, str], sha256: str,
                 recorded_in: Path) -> dict[str, np.ndarray]:
    """The tensors of a weight file of a run directory, after checking its metadata (format,
    step; a shard's rank, world size, mode: ``expected``), its sha256 and that every value is
    finite."""
    data = read_bytes(path)
    metadata, tensors = _read_safetensors(data, str(path))
    if any(metadata.get(key) != value for key, value in expected.items()):
        what = ", ".join(f"{key} {value}" for key, value in expected.items() if key != "format")
        raise ValueError(f"{path}: not the gptlab checkpoint of {what} (its metadata is "
                         f"{metadata})")
    check_sha256(path, data, sha256, recorded_in)
    check_finite(tensors, path)
    return tensors


def check_finite(tensors: dict[str, np.ndarray], path) -> None:
    """ValueError naming ``path`` and the first tensor that holds NaN or infinity."""
    for name, x in tensors.items():
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            raise ValueError(f"{path}: the tensor {name} holds {np.isnan(x).sum()} NaN and "
                             f"{np.isinf(x).sum()} infinite values: the weights were damaged "
                             "(or saved from a diverged run)")


def is_plain_file_name(name) -> bool:
    """Whether ``name`` names a file inside a run directory: no folder, no "..", not absolute."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name)


def require_plain_file_name(name, recorded_in) -> None:
    """ValueError naming ``recorded_in`` when ``name`` leaves the run directory."""
    if not is_plain_file_name(name):
        raise ValueError(f"{recorded_in}: the file name {name!r} is not a file of the run "
                         "directory (a checkpoint names its files without folders)")


def check_moments(state: dict, moments: dict, params: dict, path) -> None:
    """ValueError naming ``path`` unless ``moments`` holds every buffer of the optimizer that
    state.json names for every parameter, and nothing else."""
    expected = {f"{buffer}.{name}" for buffer in OPTIMIZER_BUFFERS[state["optimizer_kind"]]
                for name in params}
    missing, extra = sorted(expected - set(moments)), sorted(set(moments) - expected)
    if missing or extra:
        raise ValueError(f"{path}: the optimizer moments do not match the parameters: missing "
                         f"{missing}, unexpected {extra}")


def read_run_tokenizer(ckpt_dir, state: dict, model_config: GPTConfig) -> Tokenizer:
    """The tokenizer that state.json names, after checking it is the one saved with the weights
    and that it has one id per row of the model's embedding."""
    path = Path(ckpt_dir) / state["tokenizer_file"]
    if sha256_of(read_bytes(path)) != recorded_sha256(ckpt_dir, state, state["tokenizer_file"]):
        raise ValueError(f"{path}: not the tokenizer this checkpoint was trained with (its sha256 "
                         f"differs from the one {Path(ckpt_dir) / STATE_FILE} records); put back "
                         "the run's own tokenizer file")
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size != model_config.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} ids, the model "
                         f"{model_config.vocab_size} (vocab_size): not the tokenizer of this "
                         "model")
    return tokenizer


def load_run_checkpoint(ckpt_dir, backend: str = "numpy", dtype=None,
                        device=None) -> RunCheckpoint:
    """Read the run directory ``ckpt_dir``; params go to ``backend`` (and ``dtype``/``device``).

    Truncated, changed or foreign files raise ValueError naming the file; nothing is unpickled.
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_state(ckpt_dir)
    step, state_path = state["step"], ckpt_dir / STATE_FILE
    model_config = state_model_config(ckpt_dir, state)
    tensors = {}
    for key in ("model_file", "optimizer_file"):
        path = ckpt_dir / state[key]
        tensors[key] = read_tensors(path, {"format": FORMAT, "step": str(step)},
                                    recorded_sha256(ckpt_dir, state, state[key]), state_path)
    params, moments = tensors["model_file"], tensors["optimizer_file"]
    try:
        check_params(params, model_config)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{ckpt_dir / state['model_file']}: {err}") from err
    check_moments(state, moments, params, ckpt_dir / state["optimizer_file"])
    params = {name: convert(x, backend, dtype=dtype, device=device) for name, x in params.items()}
    optimizer_state = {"kind": state["optimizer_kind"], "step": state["optimizer_step"],
                       "state": moments}
    tokenizer = read_run_tokenizer(ckpt_dir, state, model_config)
    return RunCheckpoint(step, params, optimizer_state, tokenizer, model_config, state)


# ------------------------------------------------------------------------------------------------
# One run per directory: the lock, and no run replaced by accident


class RunDirectoryError(ValueError):
    """A run directory this run may not use: another run holds it, or it holds a run and
    neither resume nor overwrite was asked for."""


def _lock(path: Path) -> int:
    """An open descriptor of ``path`` that holds its exclusive flock, this pid written in it;
    RunDirectoryError naming the holder's pid when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirectoryError(f"{path.parent} is in use by another run (pid {holder} holds "
                                    f"{path}): wait for it to end, stop it, or choose another "
                                    "--out-dir") from None
        try:
            if os.path.samestat(os.fstat(fd), os.stat(path)):
                break
        except FileNotFoundError:
            pass
        os.close(fd)  # its holder removed the file as we opened it: open the new one
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode("ascii"))
    return fd


def _what_it_holds(out_dir: Path, held: list[str]) -> str:
    """Why a fresh run refuses ``out_dir``, which holds the files ``held``: a run, or files of
    no run."""
    shown = ", ".join(held[:4]) + (", ..." if len(held) > 4 else "")
    if STATE_FILE not in held:
        return (f"{out_dir} is not empty: it holds files of no run ({shown}; no "
                f"{STATE_FILE}): choose an empty or new --out-dir, or start a run among them with "
                "--overwrite (it removes only files of its own checkpoints)")
    return (f"{out_dir} already holds a run ({shown}): continue it with --resume, replace it "
            "with --overwrite (its checkpoint stays until the new one is complete), or choose "
            "another --out-dir")


@contextmanager
def claim_run_dir(out_dir, *, resume: bool = False, overwrite: bool = False):
    """Hold the run directory ``out_dir`` (created if need be) for the ``with`` block: its lock
    (an flock of out_dir/run.lock with the holder's pid; the kernel drops it when the holder
    ends, even by SIGKILL, so the lock of a dead run is taken over), after checking that it
    holds nothing but the lock unless ``resume`` (continue the run there) or ``overwrite`` (a
    new run replaces it; its checkpoint stays until the new run's first one is complete).
    RunDirectoryError (a ValueError) naming the directory otherwise."""
    if resume and overwrite:
        raise RunDirectoryError("resume continues the run in out_dir and overwrite replaces it "
                                "with a new one: choose one")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = _lock(out_dir / LOCK_FILE)
    try:
        held = sorted(path.name for path in out_dir.iterdir() if path.name != LOCK_FILE)
        if held and not (resume or overwrite):
            raise RunDirectoryError(_what_it_holds(out_dir, held))
        yield out_dir
    finally:
        (out_dir / LOCK_FILE).unlink(missing_ok=True)  # while still holding it: see _lock
        os.close(fd)


__all__ = ["FORMAT_VERSION", "FILE_FORMAT_VERSION", "STATE_FILE", "LOCK_FILE", "atomic_write",
           "naming",
           "save_checkpoint", "load_checkpoint", "Checkpoint", "save_run_checkpoint",
           "load_run_checkpoint", "read_state", "RunCheckpoint", "RunDirectoryError",
           "claim_run_dir", "require_fields"]
