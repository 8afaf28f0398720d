"""Weight quantization: round to nearest, packed 4-bit storage, and the straight-through estimator.

A weight matrix w (in, out) (GPT-2's layout, y = x @ w + b) is stored as small integer codes q
and a float scale s per output channel (one per column), or per group of ``group_size``
consecutive input rows of a column. Round to nearest (RTN), with b bits:

    symmetric (absmax):      s = clip * max|w| / qmax,        qmax = 2^(b-1) - 1
                             q = clamp(round(w / s), -qmax, qmax),        w_hat = s * q
    asymmetric (zero point): s = clip * (hi - lo) / (2^b - 1),  z = round(-lo / s)
                             q = clamp(round(w / s) + z, 0, 2^b - 1),     w_hat = s * (q - z)
                             lo = min(min w, 0),  hi = max(max w, 0)

Symmetric codes use the restricted range [-qmax, qmax] (int8: [-127, 127], int4: [-7, 7]), so
that -w quantizes to -q and s = max|w| / (2^(b-1) - 1) as in the usual absmax formula; the code
-2^(b-1) is never used. Asymmetric grids include 0 (as GPTQ's does), so w = 0 is exact; the
zero point z is an integer code in [0, 2^b - 1]. Both are ``q = clamp(round(w / s) + z)`` with
z = 0 for the symmetric grid. Every w inside the grid is off by at most s / 2; with ``clip < 1``
the grid is narrower and the largest weights are clamped. ``round`` is round-half-to-even
(NumPy, torch and the array API agree). A group whose weights are all 0 gets s = 1.

Storage: codes of 5 to 8 bits take one byte each (int8 symmetric, uint8 asymmetric); codes of
2 to 4 bits are packed two per byte (``pack_int4``: the even column in the low nibble, the odd
one in the high nibble; symmetric codes are stored offset by 2^(b-1), so every nibble is
unsigned). Scales keep the weight's dtype, zero points are one uint8 each;
``QuantizedTensor.nbytes`` counts all three.

Quantization-aware training uses ``fake_quant_forward`` (w_hat, in w's dtype) and the clipped
straight-through estimator (Bengio, Leonard and Courville, 2013) for its backward: round() is
treated as the identity and s, z as constants, so the gradient is the derivative of the clamp,

    dw = dw_hat * [lo_code <= round(w / s) + z <= hi_code]

that is, dw_hat passes unchanged wherever the clamp left the code alone, and is 0 where it
clamped. With the absmax/min-max grid of w itself (clip = 1) nothing is clamped, and the
clipped estimator equals the plain one, dw = dw_hat. A rounding function has derivative 0
almost everywhere, so this backward is a definition, not a derivative: it is checked against
torch autograd of the same surrogate, not against finite differences.

GPTQ (Frantar et al. 2022), which picks the codes so that x @ w_hat stays close to x @ w on
calibration inputs, is in ``gptlab.quant.gptq``; whole-model helpers are in ``gptlab.quant.model``.

Book: chapter 19, "Quantization".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..backend import array_device, array_namespace
from ..checks import require_float, require_int
from ..layers.linear import linear_forward

SCHEMES = ("symmetric", "asymmetric")


@dataclass(frozen=True)
class QuantizedTensor:
    """A quantized matrix: integer codes, scales, zero points and how to read them.

    codes: the stored codes of the matrix in (in, out) orientation (w itself for axis=0, w^T
        for axis=1): (in, out) int8 (symmetric) / uint8 (asymmetric) for 5-8 bits, or
        (in, ceil(out / 2)) uint8 holding two codes per byte for 2-4 bits;
    scale: (G, out) float, one per group of ``group_size`` input rows (G = 1 per channel);
    zero_point: (G, out) uint8 for the asymmetric scheme, None for the symmetric one;
    bits, scheme, group_size (None = per channel), axis (w's input axis), shape and dtype of w.
    """

    codes: object
    scale: object
    zero_point: object | None
    bits: int
    scheme: str
    group_size: int | None
    axis: int
    shape: tuple[int, int]
    dtype: object

    @classmethod
    def from_codes(cls, codes, scale, zero, *, bits, scheme, group_size, axis, shape, dtype):
        """Integer-valued float codes (in, out), scale and zero (G, out) -> the stored form:
        int8 / uint8 codes, or two per byte for 2-4 bits (symmetric ones offset by 2^(b-1))."""
        xp = array_namespace(codes)
        if bits <= 4:
            unsigned = codes if scheme == "asymmetric" else codes + 2 ** (bits - 1)  # (in, out)
            stored = pack_int4(xp.astype(unsigned, xp.uint8))  # (in, ceil(out / 2))
        else:
            stored = xp.astype(codes, xp.uint8 if scheme == "asymmetric" else xp.int8)  # (in, out)
        zero_point = None if scheme == "symmetric" else xp.astype(zero, xp.uint8)  # (G, out)
        return cls(stored, scale, zero_point, bits, scheme, group_size, axis, tuple(shape), dtype)

    @property
    def packed(self) -> bool:
        return self.bits <= 4

    @property
    def in_out_shape(self) -> tuple[int, int]:
        """(in, out): ``shape`` with the input axis first."""
        return self.shape if self.axis == 0 else self.shape[::-1]

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: codes + scales + zero points."""
        arrays = [self.codes, self.scale] + ([] if self.zero_point is None else [self.zero_point])
        return sum(array_nbytes(a) for a in arrays)

    def int_codes(self):
        """The codes q (in, out), unpacked: int8 in [-qmax, qmax] or uint8 in [0, 2^b - 1]."""
        if not self.packed:
            return self.codes
        xp = array_namespace(self.codes)
        nibbles = unpack_int4(self.codes, self.in_out_shape[1])  # (in, out) uint8
        if self.scheme == "asymmetric":
            return nibbles
        return xp.astype(nibbles, xp.int8) - 2 ** (self.bits - 1)  # (in, out) int8


def array_nbytes(a) -> int:
    """The bytes an array's elements take (any array API array)."""
    xp = array_namespace(a)
    info = xp.finfo(a.dtype) if xp.isdtype(a.dtype, "real floating") else xp.iinfo(a.dtype)
    return math.prod(a.shape) * info.bits // 8


# --------------------------------------------------------------------------------------------
# The grid: levels, scales, zero points, codes


def code_range(bits: int, scheme: str) -> tuple[int, int]:
    """(lowest, highest) code: (-(2^(b-1) - 1), 2^(b-1) - 1) symmetric, (0, 2^b - 1) asymmetric."""
    if scheme == "symmetric":
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def grid(w, *, bits: int, scheme: str, clip: float = 1.0):
    """The scale and zero point of each column of each group: w (..., n, out) ->
    (scale (..., 1, out), zero (..., 1, out)), both in w's dtype; zero is an integer-valued
    code (0 for the symmetric scheme)."""
    xp = array_namespace(w)
    lowest, highest = code_range(bits, scheme)
    if scheme == "symmetric":
        span = clip * xp.max(xp.abs(w), axis=-2, keepdims=True)  # (..., 1, out)
        scale = xp.where(span > 0, span / highest, 1.0)  # (..., 1, out)
        return scale, xp.zeros_like(scale)
    lo = clip * xp.clip(xp.min(w, axis=-2, keepdims=True), max=0.0)  # (..., 1, out)
    hi = clip * xp.clip(xp.max(w, axis=-2, keepdims=True), min=0.0)  # (..., 1, out)
    scale = xp.where(hi > lo, (hi - lo) / (highest - lowest), 1.0)  # (..., 1, out)
    zero = xp.round(-lo / scale)  # (..., 1, out) in [0, 2^b - 1]
    return scale, zero


def round_to_grid(w, scale, zero, *, bits: int, scheme: str):
    """Codes q = clamp(round(w / s) + z) as integer-valued floats, w's shape."""
    xp = array_namespace(w, scale, zero)
    lowest, highest = code_range(bits, scheme)
    return xp.clip(xp.round(w / scale) + zero, lowest, highest)


def check_settings(w, bits, scheme, group_size, clip, axis) -> None:
    """A clear TypeError / ValueError for a bad matrix or setting, naming it."""
    require_float("w", w)
    if len(w.shape) != 2:
        raise ValueError(f"w must be a matrix (in, out), got shape {tuple(w.shape)}")
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"bits must be an integer from 2 to 8, got {bits!r}")
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be 'symmetric' or 'asymmetric', got {scheme!r}")
    if axis not in (0, 1):
        raise ValueError(f"axis (w's input axis) must be 0 or 1, got {axis!r}")
    if not (isinstance(clip, (int, float)) and 0.0 < clip <= 1.0):
        raise ValueError(f"clip must be in (0, 1], got {clip!r}")
    if group_size is not None:
        n_in = w.shape[axis]
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive integer or None, got {group_size!r}")
        if n_in % group_size != 0:
            raise ValueError(f"group_size {group_size} does not divide the input size {n_in} "
                             f"(axis {axis} of w, shape {tuple(w.shape)})")  # fmt: skip


def _groups(w_io, group_size):
    """(in, out) -> (G, gs, out): groups of ``group_size`` consecutive input rows."""
    xp = array_namespace(w_io)
    n_in, n_out = w_io.shape
    gs = n_in if group_size is None else group_size
    return xp.reshape(w_io, (n_in // gs, gs, n_out))  # (G, gs, out)


def _in_out(w, axis: int):
    """w with its input axis first, (in, out); applied twice, the identity."""
    return w if axis == 0 else w.mT


def _round_groups(w_io, *, bits, scheme, group_size, clip):
    """w_io (in, out) -> (groups (G, gs, out), codes (G, gs, out), scale, zero (G, 1, out))."""
    groups = _groups(w_io, group_size)  # (G, gs, out)
    scale, zero = grid(groups, bits=bits, scheme=scheme, clip=clip)  # (G, 1, out)
    codes = round_to_grid(groups, scale, zero, bits=bits, scheme=scheme)  # (G, gs, out)
    return groups, codes, scale, zero


# --------------------------------------------------------------------------------------------
# Quantize and dequantize


def quantize(w, *, bits: int = 8, scheme: str = "symmetric", group_size: int | None = None,
             axis: int = 0, clip: float = 1.0) -> QuantizedTensor:
    """Round-to-nearest quantization of w (in, out) -> QuantizedTensor.

    ``axis``: w's input axis, along which the scales are shared and the groups run: 0 for our
    (in, out) weights (one scale per output column), 1 for a matrix used as x @ w^T such as the
    tied wte (V, C) (one scale per row). ``group_size``: None for one scale per output channel,
    or the number of consecutive input rows that share one (it must divide the input size).
    ``clip`` in (0, 1] shrinks the grid to that fraction of the largest magnitude.
    """
    check_settings(w, bits, scheme, group_size, clip, axis)
    xp = array_namespace(w)
    w_io = _in_out(w, axis)  # (in, out)
    _, codes, scale, zero = _round_groups(w_io, bits=bits, scheme=scheme, group_size=group_size,
                                          clip=clip)  # fmt: skip
    return QuantizedTensor.from_codes(xp.reshape(codes, w_io.shape), scale[:, 0, :],
                                      zero[:, 0, :], bits=bits, scheme=scheme,
                                      group_size=group_size, axis=axis, shape=tuple(w.shape),
                                      dtype=w.dtype)  # fmt: skip


def dequantize(q: QuantizedTensor):
    """w_hat = s * (q - z), in the original shape and dtype of w."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"q must be a QuantizedTensor, got {type(q).__name__}")
    xp = array_namespace(q.scale)
    codes = xp.astype(q.int_codes(), q.dtype)  # (in, out)
    groups = _groups(codes, q.group_size)  # (G, gs, out)
    zero = 0.0 if q.zero_point is None else xp.astype(q.zero_point, q.dtype)[:, None, :]
    w_hat = (groups - zero) * q.scale[:, None, :]  # (G, gs, out)
    return _in_out(xp.reshape(w_hat, q.in_out_shape), q.axis)  # (shape)


def quantized_linear_forward(x, q: QuantizedTensor, b=None):
    """x (..., in), q a quantized (in, out) weight, b (out,) or None -> y = x @ w_hat + b.

    The weight is dequantized on the fly (clear, not fast): y equals the linear layer run on
    ``dequantize(q)``.
    """
    y, _ = linear_forward(x, dequantize(q), b)  # (..., out)
    return y


# --------------------------------------------------------------------------------------------
# Two 4-bit codes per byte


def pack_int4(codes):
    """codes (..., n) unsigned integers in [0, 15] -> (..., ceil(n / 2)) uint8.

    Byte j holds code 2j in its low nibble and code 2j + 1 in its high nibble; an odd n is
    padded with a zero code.
    """
    xp = array_namespace(codes)
    require_int("codes", codes)
    if len(codes.shape) == 0:
        raise ValueError("codes must have at least one dimension, got a scalar")
    if math.prod(codes.shape) and (int(xp.min(codes)) < 0 or int(xp.max(codes)) > 15):
        raise ValueError(f"codes must lie in [0, 15] to be packed into 4 bits, got values in "
                         f"[{int(xp.min(codes))}, {int(xp.max(codes))}]")  # fmt: skip
    u = xp.astype(codes, xp.uint8)  # (..., n)
    if u.shape[-1] % 2:
        pad = xp.zeros((*u.shape[:-1], 1), dtype=xp.uint8, device=array_device(u))  # (..., 1)
        u = xp.concat([u, pad], axis=-1)  # (..., n + 1)
    pairs = xp.reshape(u, (*u.shape[:-1], u.shape[-1] // 2, 2))  # (..., ceil(n / 2), 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)  # (..., ceil(n / 2))


def unpack_int4(packed, n: int):
    """packed (..., m) uint8 -> codes (..., n) uint8 in [0, 15], the inverse of ``pack_int4``."""
    xp = array_namespace(packed)
    if packed.dtype != xp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}")
    if len(packed.shape) == 0:
        raise ValueError("packed must have at least one dimension, got a scalar")
    m = packed.shape[-1]
    if isinstance(n, bool) or not isinstance(n, int) or not max(2 * m - 1, 0) <= n <= 2 * m:
        raise ValueError(f"{m} packed bytes per row hold {max(2 * m - 1, 0)} or {2 * m} codes, "
                         f"not n={n!r}")  # fmt: skip
    low, high = packed & 15, packed >> 4  # (..., m)
    both = xp.stack([low, high], axis=-1)  # (..., m, 2)
    return xp.reshape(both, (*packed.shape[:-1], 2 * m))[..., :n]  # (..., n)


# --------------------------------------------------------------------------------------------
# The straight-through estimator


def fake_quant_forward(w, *, bits: int, scheme: str = "symmetric", group_size: int | None = None,
                       axis: int = 0, clip: float = 1.0):
    """w (in, out) -> (w_hat (in, out), cache): quantize and dequantize in one step, w's dtype.

    The settings are those of ``quantize``; the scales come from w itself at every call.
    """
    check_settings(w, bits, scheme, group_size, clip, axis)
    xp = array_namespace(w)
    w_io = _in_out(w, axis)  # (in, out)
    groups, codes, scale, zero = _round_groups(w_io, bits=bits, scheme=scheme,
                                               group_size=group_size, clip=clip)  # fmt: skip
    w_hat = xp.reshape((codes - zero) * scale, w_io.shape)  # (in, out)
    unclamped = xp.round(groups / scale) + zero  # (G, gs, out)
    passes = xp.astype(unclamped == codes, w.dtype)  # (G, gs, out) 1 where the clamp did nothing
    return _in_out(w_hat, axis), (_in_out(xp.reshape(passes, w_io.shape), axis),)


def fake_quant_backward(dw_hat, cache):
    """dw_hat (in, out) -> (dw (in, out),): the clipped straight-through estimator."""
    (passes,) = cache
    # w_hat = s * (clamp(round(w / s) + z) - z), round -> identity, s and z held constant
    dw = dw_hat * passes  # (in, out)
    return (dw,)
