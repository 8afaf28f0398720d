"""What every kernel's launch wrapper shares: can Triton run here, on these tensors, and the
dtypes the tiles are multiplied in."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch-ops path runs without Triton
    triton = tl = None

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def interpreting() -> bool:
    """True under Triton's interpreter: the kernels run in NumPy on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_unavailable() -> str | None:
    """Why the Triton kernels cannot run on this machine, or None when they can."""
    if triton is None:
        return "Triton does not import (pip install -r requirements.txt)"
    if not (torch.cuda.is_available() or interpreting()):
        return ("there is no CUDA device (Triton's interpreter runs the kernels on CPU tensors "
                "when TRITON_INTERPRET=1 is set before Triton is imported)")
    return None


def check_tensors(**tensors) -> None:
    """TypeError unless every tensor is float32, bfloat16 or float16 and lies where the kernels
    run: on CUDA, or on the CPU under the interpreter."""
    reason = triton_unavailable()
    if reason is not None:
        raise RuntimeError(f"the Triton kernels cannot run: {reason}")
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be a float32, bfloat16 or float16 torch tensor, "
                            f"got {got}")
        if t.device.type != "cuda" and not interpreting():
            raise ValueError(f"{name} is on {t.device}: the Triton kernels run on CUDA tensors "
                             "(CPU tensors only under TRITON_INTERPRET=1)")  # fmt: skip


def dot_dtype(dtype: torch.dtype):
    """The dtype tl.dot multiplies tiles of ``dtype`` in: the dtype itself (tensor cores take
    bf16 and fp16), except bfloat16 under the interpreter, whose NumPy has no bfloat16: there the
    tiles are rounded to bfloat16 and multiplied in float32, the same numbers."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
            torch.float16: tl.float16}[dtype]  # fmt: skip


def input_precision() -> str:
    """float32 tiles: TF32 tensor cores where torch allows them for its matmuls, else IEEE."""
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"


def check_tile(name: str, size, least: int = 1) -> None:
    """ValueError unless ``size`` (rows or columns of a tile) is a power of two (tl.arange needs
    one) and at least ``least`` (16 where tl.dot multiplies the tile: its least on a GPU)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < least or size & (size - 1):
        raise ValueError(f"{name} must be a power of two of at least {least} (the rows or "
                         f"columns of a tile), got {size!r}")


def pow2(n: int, least: int = 16) -> int:
    """The tile width that covers n: a power of two (tl.arange needs one), at least ``least``
    (tl.dot needs 16 on a GPU)."""
    return max(least, triton.next_power_of_2(n))
