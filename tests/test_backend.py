"""The helpers of ``gptlab.backend`` (what the array API standard lacks), on every backend."""

from __future__ import annotations

import math

import array_api_strict
import numpy as np
import pytest
import torch

from conftest import BACKENDS, STRICT_DEVICE, get_backend, requires_cuda, to_host
from gptlab.backend import (
    array_device,
    array_namespace,
    asarray_like,
    backend_name,
    convert,
    erf,
    is_floating,
    is_integer,
    one_hot,
    scatter_add_rows,
    take_along_last,
    take_rows,
    to_numpy,
    uniform,
)


def test_strict_backend_catches_a_missing_device(backend):
    """The harness itself: on the strict backend a creation call without device= must fail."""
    x = backend.randn(np.random.default_rng(0), 3)
    xp = array_namespace(x)
    if backend.name != "strict":
        assert is_floating(x + xp.zeros(3, dtype=x.dtype))
        return
    assert array_device(x) == STRICT_DEVICE
    with pytest.raises(ValueError, match="device"):
        x + xp.zeros(3, dtype=x.dtype)  # lands on the default device
    assert array_device(x + xp.zeros(3, dtype=x.dtype, device=array_device(x))) == STRICT_DEVICE


def test_backend_name(backend):
    expected = {"numpy": "numpy", "torch": "torch", "strict": "array_api_strict"}[backend.name]
    assert backend_name(backend.like) == expected


def test_take_rows_picks_rows(backend, rng):
    w_np = rng.standard_normal((5, 3))
    idx_np = np.array([[0, 4, 4], [2, 0, 1]])
    rows = take_rows(backend.asarray(w_np), backend.asarray(idx_np))  # (2, 3, 3)
    assert tuple(rows.shape) == (2, 3, 3)
    assert array_device(rows) == backend.device
    np.testing.assert_array_equal(to_host(rows), w_np[idx_np])


def test_scatter_add_rows_accumulates_repeated_ids(backend):
    idx = backend.asarray(np.array([[1, 1, 3], [1, 0, 3]]))  # id 1 three times, id 3 twice
    src_np = np.arange(18, dtype=np.float64).reshape(2, 3, 3)
    out = to_host(scatter_add_rows(5, idx, backend.asarray(src_np)))  # (5, 3)
    expected = np.zeros((5, 3))
    expected[1] = src_np[0, 0] + src_np[0, 1] + src_np[1, 0]
    expected[3] = src_np[0, 2] + src_np[1, 2]
    expected[0] = src_np[1, 1]
    np.testing.assert_array_equal(out, expected)


def test_scatter_add_rows_equals_one_hot_matmul(backend, rng):
    V, C = 6, 4
    idx = backend.randint(rng, V, 3, 5)
    src = backend.randn(rng, 3, 5, C)
    xp = array_namespace(src)
    onehot = one_hot(idx, V, dtype=src.dtype)  # (3, 5, V)
    expected = xp.reshape(onehot, (-1, V)).mT @ xp.reshape(src, (-1, C))  # (V, C)
    out = scatter_add_rows(V, idx, src)
    assert out.dtype == src.dtype and array_device(out) == backend.device
    np.testing.assert_allclose(to_host(out), to_host(expected), rtol=1e-14, atol=1e-14)


def test_scatter_add_rows_is_the_adjoint_of_take_rows(backend, rng):
    """<take_rows(w, idx), g> == <w, scatter_add_rows(V, idx, g)> for every w and g."""
    V, C = 5, 3
    idx = backend.randint(rng, V, 2, 4)
    w, g = backend.randn(rng, V, C), backend.randn(rng, 2, 4, C)
    lhs = np.sum(to_host(take_rows(w, idx)) * to_host(g))
    rhs = np.sum(to_host(w) * to_host(scatter_add_rows(V, idx, g)))
    assert lhs == pytest.approx(rhs, rel=1e-13)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_one_hot(backend, dtype):
    idx = backend.asarray(np.array([[2, 0], [1, 2]]))
    like = get_backend(backend.name, dtype).like
    out = one_hot(idx, 4, dtype=like.dtype)  # (2, 2, 4)
    assert tuple(out.shape) == (2, 2, 4)
    assert out.dtype == like.dtype and array_device(out) == backend.device
    np.testing.assert_array_equal(to_host(out), np.eye(4)[[[2, 0], [1, 2]]])


def test_take_along_last(backend, rng):
    x_np = rng.standard_normal((2, 3, 5))
    idx_np = rng.integers(0, 5, size=(2, 3))
    out = take_along_last(backend.asarray(x_np), backend.asarray(idx_np))  # (2, 3)
    assert tuple(out.shape) == (2, 3) and array_device(out) == backend.device
    expected = np.take_along_axis(x_np, idx_np[..., None], axis=-1)[..., 0]
    np.testing.assert_array_equal(to_host(out), expected)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_erf_matches_math_erf(backend, dtype):
    values = np.concatenate([np.linspace(-4.0, 4.0, 33), [0.0, 1e-8, -1e-8, 10.0, -10.0]])
    b = get_backend(backend.name, dtype)
    x = b.asarray(values)
    out = erf(x)
    assert out.dtype == x.dtype and array_device(out) == b.device
    expected = np.array([math.erf(v) for v in values])
    tol = 1e-15 if dtype == "float64" else 1e-6
    np.testing.assert_allclose(to_host(out), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_uniform_is_seeded_in_range_and_like(backend, dtype):
    b = get_backend(backend.name, dtype)
    u = uniform((4, 50), seed=3, like=b.like)
    assert tuple(u.shape) == (4, 50)
    assert u.dtype == b.dtype and array_device(u) == b.device
    assert backend_name(u) == backend_name(b.like)
    values = to_host(u)
    assert values.min() >= 0.0 and values.max() < 1.0
    np.testing.assert_array_equal(values, to_host(uniform((4, 50), seed=3, like=b.like)))
    assert not np.array_equal(values, to_host(uniform((4, 50), seed=4, like=b.like)))
    assert 0.4 < values.mean() < 0.6  # 200 draws: the mean is 0.5 +- 0.02 (one sigma)


def test_uniform_is_the_same_on_every_cpu_backend_and_dtype():
    """A dropout mask checked in float64 on NumPy is the mask of a float32 torch run."""
    draws = [
        to_host(uniform((3, 7), seed=11, like=get_backend(name, dtype).like)).astype(np.float64)
        for name in BACKENDS
        for dtype in ("float64", "float32")
    ]
    for other in draws[1:]:
        np.testing.assert_array_equal(other, draws[0])


@requires_cuda
def test_uniform_on_cuda_stays_on_the_device(cuda_backend):
    u = uniform((4, 5), seed=0, like=cuda_backend.like)
    assert u.device.type == "cuda" and u.dtype == cuda_backend.dtype


@pytest.mark.parametrize("dtype", ["float64", "float32", "int64", "int32"])
def test_to_numpy_and_asarray_like_round_trip(backend, dtype):
    values = (np.arange(12).reshape(3, 4) * 0.75 - 2).astype(dtype)
    like = backend.like_int if dtype.startswith("int") else backend.like
    x = asarray_like(values, like, dtype=getattr(array_namespace(like), dtype))
    assert array_device(x) == backend.device
    back = to_numpy(x)
    assert isinstance(back, np.ndarray) and back.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(back, values)


def test_asarray_like_takes_likes_dtype(backend):
    x = asarray_like(np.array([1, 2]), backend.like)  # int values, float like
    assert x.dtype == backend.dtype and array_device(x) == backend.device
    idx = asarray_like(np.array([1, 2]), backend.like_int)
    assert is_integer(idx) and to_numpy(idx).dtype == np.int64


@pytest.mark.parametrize("target", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", [None, "float32", "float64"])
def test_convert_round_trips_and_keeps_int_dtypes(backend, target, dtype):
    rng = np.random.default_rng(1)
    x = backend.randn(rng, 2, 3)
    idx = backend.randint(rng, 7, 2, 3)
    xc, idxc = convert(x, target, dtype=dtype), convert(idx, target, dtype=dtype)
    assert backend_name(xc) == target and backend_name(idxc) == target
    assert is_floating(xc) and is_integer(idxc)
    assert to_numpy(idxc).dtype == np.int64  # integer arrays keep their integer type
    want = np.dtype(dtype or "float64")
    assert to_numpy(xc).dtype == want
    np.testing.assert_allclose(to_numpy(xc), to_host(x).astype(want), rtol=0, atol=0)
    np.testing.assert_array_equal(to_numpy(idxc), to_host(idx))
    # and back onto the original backend
    again = asarray_like(to_numpy(xc), backend.like)
    assert array_device(again) == backend.device
    np.testing.assert_allclose(to_host(again), to_host(x).astype(want), rtol=0, atol=0)


def test_convert_copies():
    host = np.zeros(3)
    out = convert(host, "numpy")
    out[0] = 1.0
    assert host[0] == 0.0


def test_convert_int32_stays_int32():
    idx = np.array([1, 2, 3], dtype=np.int32)
    assert convert(idx, "torch", dtype="float32").dtype == torch.int32
    assert convert(idx, "numpy", dtype="float64").dtype == np.int32


def test_convert_rejects_unknown_backend():
    with pytest.raises(ValueError, match="unknown backend 'jax'"):
        convert(np.zeros(2), "jax")


def test_to_numpy_detaches_torch():
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    out = to_numpy(x * 2)
    np.testing.assert_array_equal(out, [2.0, 2.0])


def test_to_numpy_moves_strict_arrays_off_the_second_device():
    x = array_api_strict.asarray(np.arange(3.0), device=STRICT_DEVICE)
    np.testing.assert_array_equal(to_numpy(x), np.arange(3.0))
