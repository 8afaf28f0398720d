"""Shared fixtures: the three backends every layer runs on, and seeded random inputs for them.

- ``numpy``: NumPy float64 arrays;
- ``torch``: CPU torch float64 tensors;
- ``strict``: ``array_api_strict`` float64 arrays on the NON-default device ``device1``. An array
  made without ``device=`` lands on the default device, and mixing it with our inputs raises a
  device-mismatch error: a layer that forgets ``device=`` fails here on a CPU-only machine, as it
  would on CUDA.

Inputs are always drawn by a seeded NumPy generator in float64 and then moved to the backend with
``gptlab.backend.asarray_like``, so every backend sees the same numbers.

Test modules import the helpers (``from conftest import BACKENDS, get_backend``); pytest puts
this directory on ``sys.path``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import array_api_strict
import numpy as np
import pytest
import torch

from gptlab.backend import array_device, array_namespace, asarray_like, to_numpy

# The array API version the layers are written against: 2024.12 and later accept Python scalars
# in ``where``/``clip`` (``xp.where(mask, scores, -math.inf)``). Set it explicitly, not by default.
array_api_strict.set_array_api_strict_flags(api_version="2025.12")

# pytest-xdist runs one worker per core: one torch thread per worker avoids oversubscribing
# the cores (tiny float64 ops get many times slower when threads fight over a core). `make test`
# runs the round-off comparisons again at GPTLAB_TEST_THREADS=2: another reduction order.
torch.set_num_threads(int(os.environ.get("GPTLAB_TEST_THREADS", "1")))

# Without CUDA, the Triton kernels (gptlab/kernels/) run under Triton's interpreter on CPU
# tensors. Triton reads TRITON_INTERPRET when a kernel is defined, so it is set here, before any
# test module imports a kernel module (tests/test_kernels.py, or gptlab.fast choosing its kernels
# in an earlier test of the same worker): set later, it would leave some kernels compiled.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

STRICT_DEVICE = array_api_strict.Device("device1")
BACKENDS = ("numpy", "torch", "strict")
AUTOGRAD_BACKENDS = ("numpy", "torch")  # the autograd oracle converts these to torch float64

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@dataclass(frozen=True)
class Backend:
    """One backend at one float dtype: makes arrays like ``self.like`` from NumPy values."""

    name: str
    like: object  # a 0-d float array: namespace, device and float dtype of new arrays
    like_int: object  # a 0-d int64 array on the same device

    def asarray(self, values):
        """NumPy values -> this backend; floats take the backend's float dtype, ints stay int64."""
        values = np.asarray(values)
        if np.issubdtype(values.dtype, np.integer):
            return asarray_like(values, self.like_int)
        if np.issubdtype(values.dtype, np.bool_):
            return asarray_like(values, self.like_int, dtype=array_namespace(self.like).bool)
        return asarray_like(values, self.like)

    def convert(self, tree):
        """An array, a dict of arrays or a Python scalar (left as is) -> this backend."""
        if isinstance(tree, dict):
            return {key: self.convert(value) for key, value in tree.items()}
        if isinstance(tree, (int, float)):
            return tree
        return self.asarray(tree)

    def randn(self, rng: np.random.Generator, *shape):
        return self.asarray(rng.standard_normal(shape))

    def randint(self, rng: np.random.Generator, high: int, *shape):
        return self.asarray(rng.integers(0, high, size=shape, dtype=np.int64))

    @property
    def dtype(self):
        return self.like.dtype

    @property
    def device(self):
        return array_device(self.like)


def get_backend(name: str, dtype: str = "float64", device=None) -> Backend:
    """The Backend ``name`` ('numpy', 'torch', 'strict') at ``dtype`` ('float64' or 'float32')."""
    zeros, zeros_int = np.zeros((), dtype=dtype), np.zeros((), dtype=np.int64)
    if name == "numpy":
        return Backend(name, zeros, zeros_int)
    if name == "torch":
        device = device or "cpu"
        like = torch.zeros((), dtype=getattr(torch, dtype), device=device)
        return Backend(name, like, torch.zeros((), dtype=torch.int64, device=device))
    if name == "strict":
        xs = array_api_strict
        device = device or STRICT_DEVICE
        like = xs.asarray(zeros, device=device)
        return Backend(name, like, xs.asarray(zeros_int, device=device))
    raise ValueError(f"unknown backend {name!r}")


def to_host(tree):
    """Any backend's array (or dict of arrays, or tuple of them) -> NumPy, for comparisons; None
    (the gradient of a bias left out) stays None."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: to_host(value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(to_host(value) for value in tree)
    if isinstance(tree, (int, float)):
        return np.asarray(tree)
    return np.asarray(to_numpy(tree))


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    """Each backend at float64 (numpy, torch CPU, array_api_strict on a second device)."""
    return get_backend(request.param)


@pytest.fixture(params=AUTOGRAD_BACKENDS)
def autograd_backend(request) -> Backend:
    return get_backend(request.param)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(0)


@pytest.fixture
def cuda_backend() -> Backend:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    return get_backend("torch", device="cuda")


def random_attention_mask(rng: np.random.Generator, shape: tuple, keep: float = 0.5) -> np.ndarray:
    """A random boolean attention mask (..., Tq, Tk), True = may attend, in which query i always
    keeps key i + Tk - Tq (its own position when the queries are the last Tq of the Tk positions;
    key 0 for the first Tq - Tk queries when Tq > Tk), so that no row is empty, with or without
    ``causal=True``."""
    mask = rng.random(shape) < keep
    Tq, Tk = shape[-2:]
    rows = np.arange(Tq)
    mask[..., rows, np.maximum(rows + Tk - Tq, 0)] = True
    return mask
