"""Deduplication: exact (hashes of normalised documents) and near (MinHash signatures with
locality-sensitive hashing), and how to measure it (precision and recall against known pairs).

Jaccard similarity of two shingle sets, and MinHash's estimate of it with k hash functions:

    J(A, B) = |A & B| / |A | B|
    P[min h(A) = min h(B)] = J(A, B)       for a random permutation h of the shingles
    J_hat = (1/k) sum_i [sig_i(A) = sig_i(B)],   E J_hat = J,  Var J_hat = J (1 - J) / k

Here h_i(x) = (a_i x + b_i) mod p with p = 2^31 - 1, a_i in [1, p), b_i in [0, p): a random
member of a universal family standing in for a random permutation, on 31-bit shingle hashes.

LSH banding cuts a signature of k = b * r values into b bands of r rows; two documents become
candidates when all r rows of at least one band agree, which for Jaccard s happens with
probability

    P(candidate | s) = 1 - (1 - s^r)^b        (the S-curve; steepest near s = (1/b)^(1/r))

Brown et al. (2020, Appendix A) used Spark's MinHashLSH with 10 hashes: Spark's tables hold one
MinHash each, OR-ed together, so that is b = 10 bands of r = 1 row, and its similarity join then
measures the distance of every candidate pair exactly.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Iterable, Sequence

import numpy as np

from .documents import normalize, require_positive_int, stable_hash

PRIME = (1 << 31) - 1  # the Mersenne prime 2^31 - 1: a * x + b < 2^62 fits in int64


def shingles(text: str, n: int = 5, unit: str = "word") -> set[str]:
    """The set of n-grams of the normalised text: ``unit="word"`` n consecutive words (joined by
    one space), ``"char"`` n consecutive characters. A text shorter than n is one shingle."""
    if unit not in ("word", "char"):
        raise ValueError(f"unit must be 'word' or 'char', got {unit!r}")
    require_positive_int("n", n)
    text = normalize(text)
    if unit == "char":
        return {text[i : i + n] for i in range(max(len(text) - n + 1, 1))}
    words = text.split()
    return {" ".join(words[i : i + n]) for i in range(max(len(words) - n + 1, 1))}


def jaccard(a: set, b: set) -> float:
    """|a & b| / |a | b| (1.0 for two empty sets: they are equal)."""
    union = len(a | b)
    return len(a & b) / union if union else 1.0


class MinHasher:
    """k = ``num_perm`` hash functions h_i(x) = (a_i x + b_i) mod p, drawn with ``seed``."""

    def __init__(self, num_perm: int = 128, seed: int = 0):
        require_positive_int("num_perm", num_perm)
        rng = np.random.default_rng(seed)
        self.num_perm = num_perm
        self.a = rng.integers(1, PRIME, size=num_perm, dtype=np.int64)  # (k,)
        self.b = rng.integers(0, PRIME, size=num_perm, dtype=np.int64)  # (k,)

    def signature(self, shingle_set: Iterable[str]) -> np.ndarray:
        """(k,) int64: min over the shingles x of h_i(x); p for every i when the set is empty."""
        x = np.fromiter((stable_hash(s) % PRIME for s in shingle_set), dtype=np.int64)  # (n,)
        if len(x) == 0:
            return np.full(self.num_perm, PRIME, dtype=np.int64)  # (k,)
        hashed = (self.a[:, None] * x[None, :] + self.b[:, None]) % PRIME  # (k, n)
        return np.min(hashed, axis=1)  # (k,)

    def signatures(self, shingle_sets: Iterable[Iterable[str]]) -> np.ndarray:
        """(N, k) int64: one signature per set."""
        rows = [self.signature(s) for s in shingle_sets]
        return np.stack(rows) if rows else np.zeros((0, self.num_perm), dtype=np.int64)


def estimate_jaccard(sig_a: np.ndarray, sig_b: np.ndarray) -> float:
    """J_hat: the fraction of the k signature values that agree."""
    if sig_a.shape != sig_b.shape:
        raise ValueError(f"signatures of shapes {sig_a.shape} and {sig_b.shape} do not compare")
    return float(np.mean(sig_a == sig_b))


def candidate_probability(s, bands: int, rows: int):
    """The S-curve 1 - (1 - s^r)^b: the chance that a pair of Jaccard s shares a band."""
    return 1.0 - (1.0 - np.asarray(s, dtype=np.float64) ** rows) ** bands


def _check_banding(num_perm: int, bands: int, rows: int) -> None:
    require_positive_int("bands", bands)
    require_positive_int("rows", rows)
    if bands * rows > num_perm:
        raise ValueError(f"bands * rows = {bands} * {rows} = {bands * rows} exceeds the "
                         f"signature length {num_perm}")  # fmt: skip


def band_keys(signature: np.ndarray, bands: int, rows: int) -> list[tuple[int, bytes]]:
    """The b bucket keys of a signature: (band, the bytes of its r rows)."""
    _check_banding(len(signature), bands, rows)
    return [(i, signature[i * rows : (i + 1) * rows].tobytes()) for i in range(bands)]


def candidate_pairs(signatures: np.ndarray, bands: int, rows: int) -> set[tuple[int, int]]:
    """The pairs (i, j), i < j, of rows of ``signatures`` (N, k) that share at least one band."""
    buckets = defaultdict(list)  # (band, key) -> document indices
    for i, sig in enumerate(signatures):
        for key in band_keys(sig, bands, rows):
            buckets[key].append(i)
    return {pair for ids in buckets.values() for pair in itertools.combinations(ids, 2)}


class NearDuplicateIndex:
    """Online near-deduplication: ``add(sig)`` returns the index of an earlier kept document
    whose estimated Jaccard with ``sig`` is at least ``threshold`` among those sharing a band
    (then the new one is a near-duplicate and is not stored), or None (then it is kept and
    indexed). Memory: k integers per kept document, no text."""

    def __init__(self, num_perm: int, bands: int, rows: int, threshold: float):
        _check_banding(num_perm, bands, rows)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        self.bands, self.rows, self.threshold = bands, rows, threshold
        self.buckets = defaultdict(list)  # (band, key) -> indices into self.kept
        self.kept: list[np.ndarray] = []  # the signatures of the kept documents

    def add(self, signature: np.ndarray) -> int | None:
        keys = band_keys(signature, self.bands, self.rows)
        seen = set()
        for key in keys:
            for j in self.buckets.get(key, ()):
                if j not in seen and estimate_jaccard(signature, self.kept[j]) >= self.threshold:
                    return j
                seen.add(j)
        for key in keys:
            self.buckets[key].append(len(self.kept))
        self.kept.append(signature)
        return None


def exact_duplicates(documents: Iterable[str]) -> list[int | None]:
    """For each document, the index of the first earlier one with the same normalised text, or
    None. Texts are compared by their 64-bit ``stable_hash``: among a billion distinct documents
    two share a hash with probability about 10^18 / 2^65, under 3%."""
    first: dict[int, int] = {}  # hash -> index of its first document
    matches = []
    for i, doc in enumerate(documents):
        key = stable_hash(normalize(doc))
        matches.append(first.get(key))
        first.setdefault(key, i)
    return matches


def true_pairs(cluster: Sequence[int]) -> int:
    """How many pairs of documents share a cluster label: sum over clusters of m (m - 1) / 2."""
    _, counts = np.unique(np.asarray(cluster), return_counts=True)
    return int(np.sum(counts * (counts - 1) // 2))


def precision_recall(pairs: Iterable[tuple[int, int]],
                     cluster: Sequence[int]) -> tuple[float, float]:
    """Pair-level (precision, recall) of predicted duplicate ``pairs`` against the ground truth
    ``cluster`` (documents i, j are duplicates iff cluster[i] == cluster[j]). Precision of no
    pairs is 1.0, recall with no true pairs is 1.0."""
    pairs = list(pairs)
    hits = sum(cluster[i] == cluster[j] for i, j in pairs)
    n_true = true_pairs(cluster)
    return (hits / len(pairs) if pairs else 1.0), (hits / n_true if n_true else 1.0)


def match_precision_recall(matches: Sequence[int | None],
                           cluster: Sequence[int]) -> tuple[float, float]:
    """(precision, recall) of a deduplication that drops document i as a copy of document
    ``matches[i]`` (None: kept). A drop is right when the two share a cluster label; a perfect
    deduplication keeps one document per cluster, so it makes N - (number of clusters) drops."""
    drops = [(i, j) for i, j in enumerate(matches) if j is not None]
    right = sum(cluster[i] == cluster[j] for i, j in drops)
    should = len(cluster) - len(np.unique(np.asarray(cluster)))
    return (right / len(drops) if drops else 1.0), (right / should if should else 1.0)
