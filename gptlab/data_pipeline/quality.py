"""The quality filter: a logistic-regression classifier on hashed n-gram features, trained by
hand-written gradient descent, and the Pareto sampling rule of Brown et al. (2020, Appendix A).

Features (the hashing trick): each word n-gram of the normalised text adds 1 to bucket
stable_hash(n-gram) mod D of a D-dimensional count vector, which is then scaled to unit length.
GPT-3 used Spark's tokenizer and HashingTF for the same job.

The classifier and its gradient, for features X (N, D), labels y in {0, 1}:

    z = X @ w + b                 (linear.py)
    loss = mean_n [softplus(z_n) - y_n z_n] + (l2 / 2) |w|^2       (logistic.py)
    dz = (p - y) / N,   dw = X^T dz + l2 w,   db = sum_n dz_n

Sampling: a document with score s = sigmoid(z) is kept when ``rng.pareto(alpha) > 1 - s``.
``pareto(alpha)`` draws X with P(X > t) = (1 + t)^(-alpha) for t >= 0, so

    P(keep | s) = (2 - s)^(-alpha)     (s = 1: always; s = 0: 2^(-alpha); alpha = 9 in GPT-3)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..backend import array_namespace
from ..layers.linear import linear_backward, linear_forward
from ..layers.logistic import logistic_backward, logistic_forward
from .documents import normalize, require_positive_int, stable_hash

GPT3_PARETO_ALPHA = 9.0


def hashed_features(texts: Iterable[str], n_features: int = 4096,
                    ngrams: Sequence[int] = (1, 2)) -> np.ndarray:
    """(N, n_features) float64: per text, the counts of its word n-grams (for each n in
    ``ngrams``) in the buckets stable_hash(n-gram) mod n_features, scaled to unit L2 norm."""
    require_positive_int("n_features", n_features)
    if not ngrams or not all(isinstance(n, int) and n >= 1 for n in ngrams):
        raise ValueError(f"ngrams must be positive n-gram lengths such as (1, 2), got {ngrams!r}")
    rows = []
    for text in texts:
        row = np.zeros(n_features)  # (D,)
        for n in ngrams:
            grams = _ngram_list(text, n)
            np.add.at(row, [stable_hash(g) % n_features for g in grams], 1.0)
        norm = np.sqrt(row @ row)
        rows.append(row / norm if norm > 0 else row)
    return np.stack(rows) if rows else np.zeros((0, n_features))


def _ngram_list(text: str, n: int) -> list[str]:
    """Every word n-gram of the normalised text, repeats kept (``shingles`` gives the set)."""
    words = normalize(text).split()
    return [" ".join(words[i : i + n]) for i in range(len(words) - n + 1)]


def classifier_forward(x, w, b, labels, *, l2: float = 0.0):
    """x (N, D), w (D, 1), b (1,), labels (N, 1) in {0, 1} -> (loss (), cache): the mean logistic
    loss of z = x @ w + b plus (l2 / 2) |w|^2."""
    xp = array_namespace(x, w, b)
    z, linear_cache = linear_forward(x, w, b)  # (N, 1)
    loss, logistic_cache = logistic_forward(z, labels)  # ()
    return loss + 0.5 * l2 * xp.sum(w * w), (linear_cache, logistic_cache, w, l2)


def classifier_backward(dloss, cache):
    """dloss (scalar) -> (dx (N, D), dw (D, 1), db (1,))."""
    linear_cache, logistic_cache, w, l2 = cache
    # loss, logistic_cache = logistic_forward(z, labels)
    (dz,) = logistic_backward(dloss, logistic_cache)  # (N, 1)
    # z, linear_cache = linear_forward(x, w, b)
    dx, dw, db = linear_backward(dz, linear_cache)
    # + 0.5 * l2 * xp.sum(w * w)
    return dx, dw + dloss * l2 * w, db


@dataclass
class QualityClassifier:
    """A trained classifier: w (D, 1), b (1,), and the features it reads."""

    w: np.ndarray
    b: np.ndarray
    ngrams: tuple[int, ...] = (1, 2)

    def logits(self, texts: Iterable[str]) -> np.ndarray:
        x = hashed_features(texts, self.w.shape[0], self.ngrams)  # (N, D)
        return linear_forward(x, self.w, self.b)[0][:, 0]  # (N,)

    def scores(self, texts: Iterable[str]) -> np.ndarray:
        """(N,) the classifier's probability that each text is of the positive ("high quality")
        class."""
        return 1.0 / (1.0 + np.exp(-self.logits(texts)))


def train_quality_classifier(texts: Sequence[str], labels: Sequence[int], *,
                             n_features: int = 4096, ngrams: Sequence[int] = (1, 2),
                             steps: int = 200, lr: float = 2.0, l2: float = 1e-4,
                             ) -> tuple[QualityClassifier, list[float]]:  # fmt: skip
    """Full-batch gradient descent from w = 0, b = 0 on ``classifier_forward``:
    -> (the classifier, the loss before each step)."""
    labels = np.asarray(labels)
    if labels.shape != (len(texts),):
        raise ValueError(f"labels has shape {labels.shape}, expected one label per text "
                         f"({len(texts)},)")  # fmt: skip
    x = hashed_features(texts, n_features, ngrams)  # (N, D)
    y = labels.astype(np.int64)[:, None]  # (N, 1)
    w, b = np.zeros((n_features, 1)), np.zeros(1)  # (D, 1), (1,)
    losses = []
    for _ in range(steps):
        loss, cache = classifier_forward(x, w, b, y, l2=l2)
        _, dw, db = classifier_backward(1.0, cache)
        w, b = w - lr * dw, b - lr * db
        losses.append(float(loss))
    return QualityClassifier(w, b, tuple(ngrams)), losses


def pareto_keep(scores, alpha: float = GPT3_PARETO_ALPHA, rng: np.random.Generator | None = None,
                seed: int = 0) -> np.ndarray:
    """(N,) bool: keep document n when ``rng.pareto(alpha) > 1 - scores[n]`` (Brown et al. 2020,
    Appendix A). ``rng`` defaults to ``np.random.default_rng(seed)``."""
    scores = np.asarray(scores, dtype=np.float64)
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha!r}")
    if scores.size and not (np.all(scores >= 0.0) and np.all(scores <= 1.0)):
        raise ValueError("scores must be probabilities in [0, 1]")
    rng = np.random.default_rng(seed) if rng is None else rng
    return rng.pareto(alpha, size=scores.shape) > 1.0 - scores


def keep_probability(scores, alpha: float = GPT3_PARETO_ALPHA):
    """P(pareto(alpha) > 1 - s) = (2 - s)^(-alpha)."""
    return (2.0 - np.asarray(scores, dtype=np.float64)) ** -alpha
