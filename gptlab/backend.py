"""The one module that knows about NumPy and torch.

Every formula in ``gptlab.layers`` is written once against the Python array API standard
(``xp = array_namespace(x)``), so it runs on NumPy arrays, torch tensors (CPU or CUDA) and
``array_api_strict`` arrays. What the standard lacks lives here, each with NumPy and torch fast
paths and a portable fallback:

- ``take_rows`` / ``scatter_add_rows``: the embedding lookup and its backward;
- ``one_hot`` and ``take_along_last``: picking the target logit in cross-entropy;
- ``erf``: the exact GELU;
- ``uniform``: seeded random numbers (dropout masks) made on the array's own device;
- ``to_numpy`` / ``asarray_like`` / ``convert``: moving arrays between backends.
"""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace, is_numpy_array, is_torch_array
from array_api_compat import device as array_device

__all__ = [
    "array_namespace",
    "array_device",
    "is_floating",
    "is_integer",
    "backend_name",
    "take_rows",
    "scatter_add_rows",
    "one_hot",
    "take_along_last",
    "erf",
    "uniform",
    "to_numpy",
    "asarray_like",
    "convert",
    "resolve_dtype",
]


def _torch():
    import torch

    return torch


def backend_name(x) -> str:
    """'numpy', 'torch' or the module name of another array API library."""
    if is_numpy_array(x):
        return "numpy"
    if is_torch_array(x):
        return "torch"
    return type(x).__module__.split(".")[0]


def is_floating(x) -> bool:
    xp = array_namespace(x)
    return xp.isdtype(x.dtype, "real floating")


def is_integer(x) -> bool:
    xp = array_namespace(x)
    return xp.isdtype(x.dtype, "integral")


def take_rows(w, idx):
    """Rows of ``w`` (V, C) picked by integer ids ``idx`` (...) -> (..., C)."""
    xp = array_namespace(w)
    flat = xp.astype(xp.reshape(idx, (-1,)), xp.int64)  # (N,) any integer dtype -> int64
    rows = xp.take(w, flat, axis=0)  # (N, C)
    return xp.reshape(rows, (*idx.shape, w.shape[-1]))  # (..., C)


def scatter_add_rows(num_rows: int, idx, src):
    """A (num_rows, C) array whose row v is the sum of the rows of ``src`` where ``idx == v``.

    ``idx`` (...) holds integer ids, ``src`` (..., C) the values. Repeated ids accumulate: this is
    the backward of ``take_rows``. Fast paths: ``np.add.at`` and ``Tensor.index_add_``; the
    portable path is the one-hot matrix product ``one_hot(idx)^T @ src``.
    """
    C = src.shape[-1]
    if is_numpy_array(src):
        out = np.zeros((num_rows, C), dtype=src.dtype)  # (V, C)
        np.add.at(out, np.reshape(idx, (-1,)), np.reshape(src, (-1, C)))
        return out
    if is_torch_array(src):
        torch = _torch()
        out = torch.zeros((num_rows, C), dtype=src.dtype, device=src.device)  # (V, C)
        return out.index_add_(0, idx.reshape(-1).long(), src.reshape(-1, C))
    xp = array_namespace(src)
    onehot = one_hot(xp.reshape(idx, (-1,)), num_rows, dtype=src.dtype)  # (N, V)
    return onehot.mT @ xp.reshape(src, (-1, C))  # (V, C)


def one_hot(idx, num_classes: int, dtype):
    """One-hot rows: ``idx`` (...) integer ids -> (..., num_classes) of ``dtype``."""
    xp = array_namespace(idx)
    classes = xp.arange(num_classes, dtype=idx.dtype, device=array_device(idx))  # (V,)
    return xp.astype(idx[..., None] == classes, dtype)  # (..., V)


def take_along_last(x, idx):
    """``x[..., idx[...]]`` element-wise: x (..., V), idx (...) -> (...)."""
    if is_numpy_array(x):
        return np.take_along_axis(x, idx[..., None], axis=-1)[..., 0]
    if is_torch_array(x):
        return x.gather(-1, idx[..., None].long())[..., 0]
    xp = array_namespace(x)
    return xp.sum(x * one_hot(idx, x.shape[-1], dtype=x.dtype), axis=-1)


def erf(x):
    """The error function, element-wise (the array API standard has none)."""
    if is_torch_array(x):
        return _torch().special.erf(x)
    torch = _torch()
    host = torch.from_numpy(np.ascontiguousarray(to_numpy(x)))
    return asarray_like(torch.special.erf(host).numpy(), x)


def uniform(shape: tuple[int, ...], seed: int, like):
    """Uniform [0, 1) numbers of ``like``'s dtype, namespace and device, fixed by ``seed``.

    The numbers are drawn in float32 by a ``torch.Generator`` and then cast, so they depend on
    ``seed``, ``shape`` and the device type only: NumPy arrays, ``array_api_strict`` arrays and
    CPU tensors of any float dtype get the very same numbers (a dropout mask checked in float64
    on NumPy is the mask of a float32 torch run). Tensors draw on their own device, no host
    round trip; CUDA's generator is another stream than the CPU's, so its masks differ.
    """
    torch = _torch()
    device = like.device if is_torch_array(like) else "cpu"
    generator = torch.Generator(device=device).manual_seed(int(seed))
    values = torch.rand(shape, generator=generator, dtype=torch.float32, device=device)  # [0, 1)
    if not is_torch_array(like):
        return asarray_like(values.numpy(), like)
    values = values.to(like.dtype)
    if torch.finfo(like.dtype).bits < 32:  # rounding to a narrower float can reach 1.0
        values = values.clamp(max=1.0 - torch.finfo(like.dtype).eps / 2)
    return values


def to_numpy(x) -> np.ndarray:
    """A NumPy array of any supported array: NumPy input is returned as it is (no copy); torch
    tensors are detached and moved to the CPU."""
    if is_numpy_array(x):
        return x
    if is_torch_array(x):
        return x.detach().cpu().numpy()
    xp = array_namespace(x)
    if hasattr(xp, "Device") and array_device(x) != xp.Device():  # array_api_strict
        x = xp.asarray(x, device=xp.Device(), copy=True)
    return np.asarray(x)


def asarray_like(values, like, dtype=None):
    """``values`` as an array of ``like``'s namespace and device (and dtype unless given)."""
    xp = array_namespace(like)
    dtype = like.dtype if dtype is None else dtype
    if is_torch_array(like):
        torch = _torch()
        return torch.as_tensor(np.asarray(values), device=like.device).to(dtype)
    if is_numpy_array(like):
        return np.asarray(values, dtype=dtype)
    host = xp.asarray(np.asarray(values), device=xp.Device())
    return xp.asarray(xp.astype(host, dtype), device=array_device(like), copy=True)


def resolve_dtype(backend: str, dtype):
    """A dtype object for ``backend`` from a name ('float32', 'float64', 'int64', ...) or a dtype."""
    if not isinstance(dtype, str):
        return dtype
    if backend == "torch":
        torch = _torch()
        return getattr(torch, dtype)
    return np.dtype(dtype)


def convert(x, backend: str, dtype=None, device=None):
    """``x`` (any supported array or NumPy-convertible value) on ``backend`` ('numpy'|'torch').

    Floating arrays take ``dtype`` when it is given; integer arrays keep their integer type.
    """
    host = np.asarray(to_numpy(x) if not isinstance(x, (list, tuple, int, float)) else x)
    if dtype is not None and np.issubdtype(host.dtype, np.floating):
        target = resolve_dtype(backend, dtype)
    else:
        target = None
    if backend == "numpy":
        return host.astype(target) if target is not None else host.copy()
    if backend == "torch":
        torch = _torch()
        out = torch.as_tensor(np.ascontiguousarray(host), device=device)
        return out.to(target) if target is not None else out.clone()
    raise ValueError(f"unknown backend {backend!r}: expected 'numpy' or 'torch'")



def make_generator(seed: int, like):
    """A seeded random generator for ``like``'s backend and device.

    torch: a ``torch.Generator`` on the tensor's device; everything else: NumPy's PCG64. The same
    seed gives the same stream, so sampling is reproducible within a backend.
    """
    if is_torch_array(like):
        torch = _torch()
        return torch.Generator(device=like.device).manual_seed(int(seed))
    return np.random.default_rng(int(seed))


def sample_categorical(probs, generator):
    """One token id per row drawn from ``probs`` (..., V) -> ids (...), integer, same device.

    ``generator`` comes from ``make_generator``. torch: ``torch.multinomial`` on the device.
    NumPy (and the portable path, through the host): the inverse CDF, the first id whose
    cumulative probability exceeds u ~ U[0, total), which never picks a zero-probability id.
    """
    V = probs.shape[-1]
    if is_torch_array(probs):
        torch = _torch()
        flat = probs.reshape(-1, V)  # (N, V)
        ids = torch.multinomial(flat, 1, generator=generator)  # (N, 1)
        return ids.reshape(probs.shape[:-1])  # (...)
    host = to_numpy(probs)
    cdf = np.cumsum(host, axis=-1)  # (..., V)
    u = generator.random((*host.shape[:-1], 1)) * cdf[..., -1:]  # (..., 1)
    ids = np.sum(cdf <= u, axis=-1)  # (...)
    if is_numpy_array(probs):
        return ids
    return asarray_like(ids, probs, dtype=array_namespace(probs).int64)


__all__ += ["make_generator", "sample_categorical"]


def capture_cuda_graph(fn, warmups: int = 2):
    """``fn()`` recorded as a ``torch.cuda.CUDAGraph`` -> (graph, what fn returned while it was
    captured: the graph's output, rewritten by every ``graph.replay()``). Warm-up calls on a side
    stream come first: they compile Triton's kernels and settle the allocator, which a capture
    may not do. fn must keep its tensors at fixed addresses and read nothing back to the host."""
    torch = _torch()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmups):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


__all__ += ["capture_cuda_graph"]
