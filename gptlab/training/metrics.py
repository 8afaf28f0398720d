"""How good is a language model? Loss, perplexity, bits, and calibration.

    loss            L = -(1/N) sum_n ln p(x_n | x_<n)            nats per token
    perplexity      PPL = exp(L)                                 a uniform guess over V tokens has V
    bits per token  L / ln 2
    bits per char   (total nats) / (n_characters ln 2)           for a character tokenizer one
                                                                 token is one character, so this
                                                                 is simply L / ln 2
    ECE             sum_b |B_b|/N |acc(B_b) - conf(B_b)|         Guo et al. 2017, "On Calibration
                                                                 of Modern Neural Networks"

Book: Part III, "Training and generation" (chapters 11 and 12); bits per character, chapter 13.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..backend import array_namespace, asarray_like, to_numpy
from ..checks import require_float, require_int
from ..config import GPTConfig
from ..model import gpt_forward
from .data import get_batch


def perplexity(mean_loss_nats: float) -> float:
    """exp(mean cross-entropy in nats): the effective number of equally likely choices."""
    return math.exp(float(mean_loss_nats))


def bits_per_token(mean_loss_nats: float) -> float:
    """The mean cross-entropy in bits: L / ln 2."""
    return float(mean_loss_nats) / math.log(2.0)


def bits_per_character(total_nats: float, n_characters: int) -> float:
    """Total cross-entropy of a text in nats -> bits per character of that text.

    For a character-level tokenizer (one token per character) this equals
    ``bits_per_token(mean loss)``; for BPE, total_nats = mean loss * n_tokens and the bits are
    shared over the characters the tokens spell.
    """
    if n_characters < 1:
        raise ValueError(f"n_characters must be positive, got {n_characters!r}")
    return float(total_nats) / (n_characters * math.log(2.0))


def _windows_loss(params: dict, cfg: GPTConfig, data: np.ndarray, starts: np.ndarray,
                  block_size: int) -> float:
    """Mean loss of the windows data[s : s + T] (targets data[s + 1 : s + T + 1]), starts (B,)."""
    wte = params["wte.weight"]
    xp = array_namespace(wte)
    offsets = np.arange(block_size)  # (T,)
    windows = data[starts[:, None] + offsets[None, :]]  # (B, T)
    targets = data[starts[:, None] + offsets[None, :] + 1]  # (B, T)
    x = asarray_like(windows, wte, dtype=xp.int64)  # (B, T)
    y = asarray_like(targets, wte, dtype=xp.int64)  # (B, T)
    _, loss, cache = gpt_forward(params, x, cfg, y)  # ()
    # the cross-entropy alone: a model with experts adds its load-balancing loss to the loss it
    # trains on, not to the score it is measured by
    return float(loss - cache["aux_loss"]) if "aux_loss" in cache else float(loss)


def _checked_ids(data_ids, cfg: GPTConfig, block_size: int, batch_size: int) -> np.ndarray:
    """The token ids as a 1-D NumPy int array long enough for one window, or a clear error."""
    data = np.asarray(data_ids if isinstance(data_ids, (list, tuple)) else to_numpy(data_ids))
    require_int("data_ids", data)
    if data.ndim != 1:
        raise ValueError(f"data_ids must be 1-D, got shape {data.shape}")
    if not 1 <= block_size <= cfg.block_size:
        raise ValueError(f"block_size must be in [1, {cfg.block_size}], got {block_size!r}")
    if data.size < block_size + 1:
        raise ValueError(f"data_ids has {data.size} tokens, need at least block_size + 1 = "
                         f"{block_size + 1}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    return data


def evaluate_loss(params: dict, cfg: GPTConfig, data_ids, batch_size: int, block_size: int,
                  n_batches: int, seed: int) -> float:
    """Mean next-token cross-entropy (nats) over ``n_batches`` seeded random windows.

    data_ids (N,) integer token ids (any backend). Every batch takes ``batch_size`` windows of
    ``block_size`` tokens starting at uniform random offsets (NumPy's PCG64 seeded by ``seed``,
    so the windows are the same on every backend); the targets are the same windows shifted by
    one. All batches have the same size, so the mean of the batch losses is the mean over all
    batch_size * block_size * n_batches predictions. Evaluation mode (no dropout).
    """
    data = _checked_ids(data_ids, cfg, block_size, batch_size)
    if n_batches < 1:
        raise ValueError(f"n_batches must be positive, got {n_batches}")
    rng = np.random.default_rng(int(seed))
    losses = [_windows_loss(params, cfg, data, rng.integers(0, data.size - block_size,
                                                            size=batch_size), block_size)
              for _ in range(n_batches)]  # fmt: skip
    return sum(losses) / n_batches


def batch_losses(loss, params: dict, splits: dict, batch_size: int, block_size: int,
                 n_batches: int, seed: int, backend: str = "numpy", device=None) -> dict:
    """{"<split>_loss": the mean of ``loss(params, x, y)`` over ``n_batches`` random batches}
    for each split (name -> ids (N,)), the training loop's evaluation. Split number i (1, 2, ...)
    draws its batches from the generator seeded [seed, i]: the same batches every time."""
    row = {}
    for index, (split, data) in enumerate(splits.items(), start=1):
        rng = np.random.default_rng([seed, index])
        losses = [loss(params, *get_batch(data, batch_size, block_size, rng, backend, device))
                  for _ in range(n_batches)]  # fmt: skip
        row[f"{split}_loss"] = sum(losses) / len(losses)
    return row


def split_loss(params: dict, cfg: GPTConfig, data_ids, block_size: int,
               batch_size: int = 64) -> float:
    """Mean next-token cross-entropy (nats) over a whole split, with no sampling noise.

    data_ids (N,) is cut into the W = (N - 1) // block_size consecutive windows
    [0, T), [T, 2T), ...; every one of their W * T tokens is predicted once (the last
    (N - 1) % T tokens are left out, fewer than one window). As in training, the token at
    position t of a window sees the t tokens before it in that window. The windows go through
    the model ``batch_size`` at a time; the result is the mean over all W * T predictions.
    """
    data = _checked_ids(data_ids, cfg, block_size, batch_size)
    starts = np.arange((data.size - 1) // block_size) * block_size  # (W,)
    total = 0.0
    for first in range(0, starts.size, batch_size):
        batch = starts[first : first + batch_size]  # (B,) the last batch may be smaller
        total += _windows_loss(params, cfg, data, batch, block_size) * batch.size
    return total / starts.size


@dataclass
class CalibrationBins:
    """Equal-width confidence bins (edges[b], edges[b+1]] of a reliability diagram.

    edges (n_bins + 1,); count, confidence (mean max-probability) and accuracy (fraction of
    correct argmax predictions) (n_bins,), NaN for empty bins.
    """

    edges: np.ndarray
    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray


def expected_calibration_error(probs, targets, n_bins: int = 15):
    """probs (N, V), targets (N,) -> (ece as a float, CalibrationBins).

    Confidence is the largest probability, a prediction is correct when its argmax is the
    target; bin b holds the confidences in (b/n_bins, (b+1)/n_bins] and
    ECE = sum_b |B_b|/N |acc(B_b) - conf(B_b)|.
    """
    xp = array_namespace(probs)
    require_float("probs", probs)
    require_int("targets", targets)
    if len(probs.shape) != 2 or tuple(targets.shape) != (probs.shape[0],) or probs.shape[0] == 0:
        raise ValueError(f"expected probs (N, V) and targets (N,) with N >= 1, got "
                         f"{tuple(probs.shape)} and {tuple(targets.shape)}")
    if not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be a positive integer, got {n_bins!r}")
    confidence = to_numpy(xp.max(probs, axis=-1))  # (N,)
    correct = to_numpy(xp.argmax(probs, axis=-1) == targets).astype(np.float64)  # (N,)
    bin_of = np.clip(np.ceil(confidence * n_bins).astype(np.int64) - 1, 0, n_bins - 1)  # (N,)
    count = np.bincount(bin_of, minlength=n_bins)  # (n_bins,)
    with np.errstate(invalid="ignore"):  # empty bins: 0 / 0 = NaN
        mean_conf = np.bincount(bin_of, weights=confidence, minlength=n_bins) / count  # (n_bins,)
        mean_acc = np.bincount(bin_of, weights=correct, minlength=n_bins) / count  # (n_bins,)
    used = count > 0
    N = confidence.shape[0]
    ece = float(np.sum(count[used] / N * np.abs(mean_acc[used] - mean_conf[used])))
    edges = np.linspace(0.0, 1.0, n_bins + 1)  # (n_bins + 1,)
    return ece, CalibrationBins(edges, count, mean_conf, mean_acc)


def reliability_diagram(bins: CalibrationBins, ax=None):
    """Accuracy per confidence bin as bars against the diagonal of perfect calibration.

    The gap between a bar's top and the diagonal is that bin's |acc - conf|. Returns the axes.
    """
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(4, 4))
    left, width = bins.edges[:-1], np.diff(bins.edges)  # (n_bins,)
    used = bins.count > 0
    ax.bar(left[used], bins.accuracy[used], width=width[used], align="edge",
           edgecolor="black", label="accuracy")  # fmt: skip
    ax.bar(left[used], bins.confidence[used] - bins.accuracy[used], bottom=bins.accuracy[used],
           width=width[used], align="edge", color="red", alpha=0.3, label="gap")  # fmt: skip
    ax.plot([0.0, 1.0], [0.0, 1.0], "k--", label="perfect calibration")
    ax.set(xlim=(0.0, 1.0), ylim=(0.0, 1.0), xlabel="confidence", ylabel="accuracy")
    ax.legend(loc="upper left")
    return ax


__all__ = [
    "perplexity", "bits_per_token", "bits_per_character", "evaluate_loss", "split_loss",
    "batch_losses",
    "CalibrationBins", "expected_calibration_error", "reliability_diagram",
]  # fmt: skip
