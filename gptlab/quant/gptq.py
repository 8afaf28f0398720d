"""GPTQ (Frantar, Ashkboos, Hoefler and Alistarh, 2022): quantization that sees the inputs.

Round to nearest (``gptlab.quant.rtn``) makes each weight as close as it can be; GPTQ makes the
layer's OUTPUT on calibration inputs X (N, in) as close as it can be. For y = x @ w, the
squared output error of a quantized w_hat is, column by column,

    ||X w - X w_hat||^2 = sum over output columns c of  (w_c - w_hat_c)^T (H / 2) (w_c - w_hat_c),
    H = 2 X^T X   (in, in), the same Hessian for every column.

GPTQ quantizes the input rows of w (the paper's columns: its W is (out, in)) one at a time, in
order, and after each one moves the rows not yet quantized to make up for its rounding error:
the Optimal Brain Quantizer update of Frantar and Alistarh (2022), with the inverse Hessian of the
remaining rows read off the upper Cholesky factor U of H^-1 (H^-1 = U^T U):

    q_i   = round_to_grid(w_i)                       (row i, one code per output column)
    err_i = (w_i - w_hat_i) / U_ii
    w_j  -= U_ij * err_i          for every row j > i

Lazy batch updates (the paper's Algorithm 1): inside a block of ``block_size`` rows the update
goes to the block only, and the rows after the block get the whole block's share at once,
W[i2:] -= U[i1:i2, i2:]^T @ Err: the same numbers, fewer and larger matrix products. A block
never crosses a group boundary, so each group's grid (``group_size``) is computed from its
weights with every earlier update applied; per channel the grid comes from w before the loop.

Dampening: H + damp * mean(diag H) * I (the paper's 1%), so that H^-1 exists. An input that is
always 0 (H_ii = 0) gets H_ii = 1 and its row of w is set to 0: it never reaches the output.

With H diagonal (uncorrelated inputs, X^T X a multiple of I) U is diagonal, nothing is moved,
and GPTQ is round to nearest. Everything runs in float64; the result is a ``QuantizedTensor``
whose scales have w's dtype.

Book: chapter 19, "Quantization", "GPTQ".
"""

from __future__ import annotations

from ..backend import array_device, array_namespace
from ..checks import require_float
from .rtn import QuantizedTensor, check_settings, grid, round_to_grid


def hessian(X, n_in: int):
    """H = 2 X^T X (in, in) in float64 from calibration inputs X (..., in)."""
    xp = array_namespace(X)
    X2 = xp.reshape(xp.astype(X, xp.float64), (-1, n_in))  # (N, in)
    return 2.0 * (X2.mT @ X2)  # (in, in)


def gptq_quantize(w, X, *, bits: int = 4, scheme: str = "symmetric",
                  group_size: int | None = None, block_size: int = 128,
                  damp: float = 0.01) -> QuantizedTensor:
    """w (in, out), calibration inputs X (..., in) of the layer y = x @ w -> QuantizedTensor."""
    xp = array_namespace(w, X)
    check_settings(w, bits, scheme, group_size, 1.0, 0)
    require_float("X", X)
    n_in, n_out = w.shape
    if len(X.shape) < 1 or X.shape[-1] != n_in:
        raise ValueError(f"X has shape {tuple(X.shape)}, expected (..., {n_in}) to match w "
                         f"{tuple(w.shape)}")  # fmt: skip
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not (isinstance(damp, (int, float)) and damp >= 0.0):
        raise ValueError(f"damp must be a number >= 0, got {damp!r}")
    H = hessian(X, n_in)  # (in, in)
    dead = xp.linalg.diagonal(H) == 0.0  # (in,) inputs that are always 0
    eye = xp.eye(n_in, dtype=xp.float64, device=array_device(w))  # (in, in)
    H = H + eye * xp.astype(dead, xp.float64)  # (in, in)
    H = H + damp * float(xp.mean(xp.linalg.diagonal(H))) * eye  # (in, in)
    U = xp.linalg.cholesky(xp.linalg.inv(H), upper=True)  # (in, in) H^-1 = U^T U
    W = xp.where(dead[:, None], 0.0, xp.astype(w, xp.float64))  # (in, out) updated in place
    codes = xp.zeros_like(W)  # (in, out)
    gs = n_in if group_size is None else group_size
    scales, zeros = [], []
    i1 = 0
    while i1 < n_in:
        i2 = min(i1 + block_size, n_in, (i1 // gs + 1) * gs)  # the block stays in one group
        err = xp.zeros((i2 - i1, n_out), dtype=xp.float64, device=array_device(w))  # (b, out)
        for i in range(i1, i2):
            if i % gs == 0:
                scale, zero = grid(W[i : i + gs, :], bits=bits, scheme=scheme)  # (1, out)
                scales.append(scale)
                zeros.append(zero)
            code = round_to_grid(W[i : i + 1, :], scale, zero, bits=bits, scheme=scheme)  # (1, out)
            codes[i : i + 1, :] = code
            err_i = (W[i : i + 1, :] - (code - zero) * scale) / U[i, i]  # (1, out)
            W[i + 1 : i2, :] -= U[i, i + 1 : i2][:, None] * err_i  # (i2 - i - 1, out)
            err[i - i1 : i - i1 + 1, :] = err_i
        W[i2:, :] -= U[i1:i2, i2:].mT @ err  # (in - i2, out) the block's lazy update
        i1 = i2
    scale = xp.astype(xp.concat(scales, axis=0), w.dtype)  # (G, out)
    zero = xp.concat(zeros, axis=0)  # (G, out)
    return QuantizedTensor.from_codes(codes, scale, zero, bits=bits, scheme=scheme,
                                      group_size=group_size, axis=0, shape=tuple(w.shape),
                                      dtype=w.dtype)  # fmt: skip
