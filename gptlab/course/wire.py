"""The narrow channel between the grader and a submission's sandbox (docs/COURSE.md, "Grading").

The grader sends requests (which student function to call, on which inputs, under which guard)
as pickles: the sandbox trusts the grader. The sandbox answers with :func:`encode`, which the
grader reads with :func:`decode`: JSON for the structure, each array's dtype (numbers, booleans
and strings only) and shape, then the arrays' raw bytes. Nothing the student's code returns is
unpickled or executed by the grader: it gets numbers, strings, arrays, and containers of them;
any other object stays in the sandbox and travels as a :class:`Handle` that only the sandbox
can resolve.

Messages are framed by an 8-byte length.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import select
import struct
import time

import numpy as np

MAX_MESSAGE = 512 * 2**20  # bytes: a larger answer is refused, not read
ARRAY_KINDS = "biufcSU"  # the dtypes that travel: no objects, no structured records
_LENGTH = struct.Struct("<Q")

__all__ = ["ChannelError", "Handle", "array_leaves", "decode", "dump_request", "encode",
           "load_request", "read_message", "write_message"]


class ChannelError(RuntimeError):
    """A message that is malformed, too large, late, or never came (the sandbox ended)."""


class Handle:
    """An object the sandbox keeps (a student's config, a closure): only its number crosses."""

    def __init__(self, number: int):
        self.number = number

    def __deepcopy__(self, memo):
        return self

    def __repr__(self):
        return f"<an object of the submission's sandbox, #{self.number}>"


def array_leaves(obj):
    """The NumPy arrays of a structure of tuples, lists and dicts, in a fixed order."""
    if isinstance(obj, np.ndarray):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from array_leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from array_leaves(item)


# ---------------------------------------------------------------------------------------------
# The sandbox's answers: JSON and arrays, no pickle.


def encode(obj, keep=None) -> bytes:
    """``obj`` as a JSON description followed by the raw bytes of its arrays. ``keep(obj) ->
    int``: the handle number of an object that cannot travel (without it, such an object is an
    error)."""
    arrays: list[np.ndarray] = []

    def walk(x):
        if x is None or type(x) in (bool, int, str):
            return x
        if type(x) is float:
            return {"t": "float", "v": repr(x)}  # inf and nan as well
        if isinstance(x, (np.ndarray, np.generic)) and np.asarray(x).dtype.kind in ARRAY_KINDS:
            arrays.append(np.asarray(x))
            return {"t": "scalar" if isinstance(x, np.generic) else "array",
                    "i": len(arrays) - 1, "dtype": arrays[-1].dtype.str,
                    "shape": list(arrays[-1].shape)}
        if type(x) in (tuple, list):
            return {"t": type(x).__name__, "v": [walk(item) for item in x]}
        if type(x) is dict:
            return {"t": "dict", "k": [walk(k) for k in x], "v": [walk(v) for v in x.values()]}
        if keep is None:
            raise TypeError(f"cannot send a {type(x).__name__}")
        return {"t": "handle", "i": keep(x)}

    meta = json.dumps(walk(obj)).encode()
    return b"".join([_LENGTH.pack(len(meta)), meta, *(a.tobytes() for a in arrays)])


def decode(data: bytes):
    """What :func:`encode` wrote, read without pickle; ChannelError if it is malformed."""
    try:
        (length,) = _LENGTH.unpack_from(data)
        meta = json.loads(data[_LENGTH.size:_LENGTH.size + length].decode())
        return _rebuild(meta, _Arrays(memoryview(data)[_LENGTH.size + length:]))
    except ChannelError:
        raise
    except Exception as error:  # whatever a forged message makes NumPy or json raise
        raise ChannelError(f"a malformed answer from the submission ({type(error).__name__})") \
            from None


class _Arrays:
    """The arrays of a message, read in order from its raw bytes."""

    def __init__(self, raw: memoryview):
        self.raw, self.offset = raw, 0

    def take(self, dtype: str, shape: list) -> np.ndarray:
        dtype = np.dtype(dtype)
        if dtype.kind not in ARRAY_KINDS or not all(type(n) is int and n >= 0 for n in shape):
            raise ChannelError(f"an array of {dtype} {shape!r:.40} in an answer")
        count = math.prod(shape)
        array = np.frombuffer(self.raw, dtype, count, self.offset).reshape(shape).copy()
        self.offset += array.nbytes
        return array


def _rebuild(node, arrays: _Arrays):
    if node is None or type(node) in (bool, int, str):
        return node
    kind = node["t"]
    if kind == "float":
        return float(node["v"])
    if kind in ("array", "scalar"):
        array = arrays.take(node["dtype"], node["shape"])
        return array[()] if kind == "scalar" else array
    if kind in ("tuple", "list"):
        items = [_rebuild(item, arrays) for item in node["v"]]
        return tuple(items) if kind == "tuple" else items
    if kind == "dict":
        return dict(zip((_rebuild(k, arrays) for k in node["k"]),
                        (_rebuild(v, arrays) for v in node["v"]), strict=True))
    if kind == "handle":
        return Handle(int(node["i"]))
    raise ChannelError(f"an unknown kind {kind!r:.20} in an answer of the submission")


# ---------------------------------------------------------------------------------------------
# The grader's requests: pickles, with handles for the sandbox's own objects.


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        return obj.number if isinstance(obj, Handle) else None


def dump_request(request) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(request)
    return buffer.getvalue()


def load_request(data: bytes, handles: dict):
    """A request of the grader, its handles resolved to the sandbox's objects (in the sandbox)."""
    unpickler = pickle.Unpickler(io.BytesIO(data))
    unpickler.persistent_load = handles.__getitem__
    return unpickler.load()


# ---------------------------------------------------------------------------------------------
# Framing.


def write_message(fd: int, data: bytes, deadline: float | None = None) -> None:
    """Write one framed message; with a ``deadline``, ``fd`` must be non-blocking, and a reader
    that takes no more past it is a ChannelError."""
    view = memoryview(_LENGTH.pack(len(data)) + data)
    while view:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([], [fd], [], wait)[1]:
                raise ChannelError("the submission ran past its time limit")
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            continue
        except BrokenPipeError:
            raise ChannelError("the submission's process ended") from None


def read_message(fd: int, deadline: float | None = None) -> bytes:
    """One framed message from ``fd``; ChannelError at end of file, past ``deadline``
    (``time.monotonic()``) or beyond MAX_MESSAGE bytes."""
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size, deadline))
    if length > MAX_MESSAGE:
        raise ChannelError(f"an answer of {length} bytes, more than {MAX_MESSAGE}")
    return _read_exactly(fd, length, deadline)


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    chunks, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise ChannelError("the submission ran past its time limit")
        chunk = os.read(fd, min(left, 2**20))
        if not chunk:
            raise ChannelError("the submission's process ended")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
