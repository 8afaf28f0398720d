"""Documents in: normalisation, a stable hash, the embedded corpus as documents, streaming text
files of any size, and generated corpora with planted near-duplicates (the ground truth that
deduplication is measured against).

A stable hash is one that every run and every machine computes alike: Python's ``hash()`` of a
string is salted per process (PYTHONHASHSEED), so it cannot name a document or a feature
bucket from one run to the next. ``stable_hash`` is the first 8 bytes of BLAKE2b.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..training.data import embedded_corpus

HEADING = re.compile(r"\n(?=[^\n]+\n[*=~-]{3,}\n)")  # a line underlined by *** === ~~~ ---


def stable_hash(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (BLAKE2b, 8 bytes)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def normalize(text: str) -> str:
    """Unicode NFKC, lower case, every run of whitespace one space, no space at either end."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def embedded_documents() -> list[str]:
    """The embedded corpus (``gptlab.training.data.embedded_corpus``) as documents: each
    reference topic cut before every underlined heading, so a document is one section of Python's
    reference."""
    return [section.strip() for section in HEADING.split(embedded_corpus()) if section.strip()]


@dataclass
class PipelineReport:
    """What a pipeline read, skipped, dropped and kept: counts only, no text."""

    files_read: int = 0
    files_unreadable: int = 0
    documents_read: int = 0
    documents_not_utf8: int = 0
    documents_empty: int = 0
    documents_too_long: int = 0
    quality_dropped: int = 0
    exact_duplicates: int = 0
    near_duplicates: int = 0
    kept: int = 0
    unreadable: list[str] = field(default_factory=list)  # "path: reason", one per file

    @property
    def skipped(self) -> int:
        """Documents skipped as bad input (not UTF-8, empty, too long)."""
        return self.documents_not_utf8 + self.documents_empty + self.documents_too_long


def require_positive_int(name: str, value) -> None:
    """ValueError naming ``name`` unless ``value`` is an integer >= 1 (a bool is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def read_documents(paths: Iterable, *, separator: str = "\n\n\n", chunk_bytes: int = 1 << 20,
                   max_document_bytes: int = 1 << 24, report: PipelineReport | None = None,
                   progress: bool = False) -> Iterator[str]:
    """The documents of UTF-8 text files, streamed: each file is read ``chunk_bytes`` at a time
    and cut at ``separator`` (default: two blank lines), so memory holds one chunk plus one
    document, never a whole file.

    Bad input is skipped and counted in ``report``, never raised: a file that cannot be opened
    or read (``files_unreadable``, with the reason in ``report.unreadable``), a document that is
    not UTF-8 or holds NUL bytes (``documents_not_utf8``), one that is only whitespace
    (``documents_empty``), one longer than ``max_document_bytes`` (``documents_too_long``; it is
    skipped as it streams past, without being held). ``progress`` shows a tqdm bar over bytes.
    """
    if not isinstance(separator, str) or not separator:
        raise ValueError(f"separator must be a non-empty string, got {separator!r}")
    require_positive_int("chunk_bytes", chunk_bytes)
    require_positive_int("max_document_bytes", max_document_bytes)
    paths = [Path(p) for p in ([paths] if isinstance(paths, (str, os.PathLike)) else paths)]
    report = PipelineReport() if report is None else report
    sep = separator.encode("utf-8")  # UTF-8 never has these bytes inside another character
    sizes = [p.stat().st_size if p.is_file() else 0 for p in paths]
    with tqdm(total=sum(sizes), unit="B", unit_scale=True, disable=not progress,
              desc="reading") as bar:  # fmt: skip
        for path in paths:
            try:
                with open(path, "rb") as file:
                    report.files_read += 1
                    for raw in _split_stream(file, sep, chunk_bytes, max_document_bytes, report,
                                             bar):  # fmt: skip
                        text = _decode(raw, report)
                        if text is not None:
                            report.documents_read += 1
                            yield text
            except OSError as err:
                report.files_unreadable += 1
                report.unreadable.append(f"{path}: {err.strerror or err}")


def _split_stream(file, sep: bytes, chunk_bytes: int, max_document_bytes: int,
                  report: PipelineReport, bar) -> Iterator[bytes]:
    """The raw documents of a binary stream cut at ``sep``; too-long ones counted and dropped."""
    buffer, overflowing = b"", False  # overflowing: inside a document already too long
    while chunk := file.read(chunk_bytes):
        bar.update(len(chunk))
        *complete, buffer = (buffer + chunk).split(sep)
        for k, raw in enumerate(complete):
            if overflowing and k == 0:  # the end of the too-long document
                overflowing = False
            elif len(raw) > max_document_bytes:
                report.documents_too_long += 1
            else:
                yield raw
        if len(buffer) > max_document_bytes:
            if not overflowing:
                report.documents_too_long += 1
            buffer, overflowing = buffer[-(len(sep) - 1):] if len(sep) > 1 else b"", True
    if buffer and not overflowing:
        yield buffer


def _decode(raw: bytes, report: PipelineReport) -> str | None:
    """UTF-8 text, or None (counted) for bytes that are not UTF-8 text or only whitespace."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is None or "\x00" in text:
        report.documents_not_utf8 += 1
        return None
    if not text.strip():
        report.documents_empty += 1
        return None
    return text


# --------------------------------------------------------------------------------------------
# Generated corpora with known duplicates


@dataclass
class PlantedCorpus:
    """Documents with planted near-duplicates: ``cluster[i]`` is the index, among the documents
    given, of the original that document i is or was made from; ``is_copy[i]`` says whether it is
    a copy, and ``edits[i]`` how many word edits made it (0 for an original and for a copy whose
    formatting alone changed). Documents are shuffled, so a copy may come before its original."""

    documents: list[str]
    cluster: np.ndarray  # (N,) int64
    is_copy: np.ndarray  # (N,) bool
    edits: np.ndarray  # (N,) int64


def synthetic_documents(n_documents: int, words_per_document: int, vocabulary: Sequence[str],
                        seed: int = 0) -> list[str]:
    """``n_documents`` documents of ``words_per_document`` words drawn from ``vocabulary`` with
    Zipf-like frequencies (the k-th word with probability proportional to 1/k), as in text."""
    require_positive_int("n_documents", n_documents)
    require_positive_int("words_per_document", words_per_document)
    if len(vocabulary) < 2:
        raise ValueError(f"vocabulary needs at least 2 words, got {len(vocabulary)}")
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, len(vocabulary) + 1)  # (V,)
    picks = rng.choice(len(vocabulary), size=(n_documents, words_per_document), p=p / p.sum())
    return [" ".join(vocabulary[k] for k in row) for row in picks]


def edit_words(text: str, n_edits: int, vocabulary: Sequence[str], rng: np.random.Generator) -> str:
    """``text`` with ``n_edits`` word edits at distinct positions (each a substitution by a word of
    ``vocabulary``, a deletion or an insertion, equally likely), then with its formatting noised:
    some words capitalised, some spaces doubled or turned into line breaks. With ``n_edits=0`` the
    result normalises to the same text as ``text``."""
    words = text.split()
    if not 0 <= n_edits <= len(words):
        raise ValueError(f"n_edits must be in [0, {len(words)}] (the words of the text), "
                         f"got {n_edits}")  # fmt: skip
    positions = set(rng.choice(len(words), size=n_edits, replace=False).tolist())
    edited = []
    for k, word in enumerate(words):
        if k not in positions:
            edited.append(word)
            continue
        kind = rng.integers(3)  # 0: substitute, 1: delete, 2: insert a word before this one
        if kind == 0:
            edited.append(vocabulary[rng.integers(len(vocabulary))])
        elif kind == 2:
            edited += [vocabulary[rng.integers(len(vocabulary))], word]
    styled = [w.capitalize() if rng.random() < 0.1 else w for w in edited]
    gaps = rng.choice([" ", "  ", "\n"], size=max(len(styled) - 1, 0), p=[0.9, 0.05, 0.05])
    return "".join(w + g for w, g in zip(styled, [*gaps, ""]))


def plant_near_duplicates(documents: Sequence[str], n_originals: int, copies: int,
                          edit_fraction: float | Sequence[float], vocabulary: Sequence[str],
                          seed: int = 0) -> PlantedCorpus:
    """``documents`` plus ``copies`` edited copies of each of ``n_originals`` of them (chosen at
    random): copy c of a document of n words gets round(f * n) word edits (``edit_words``), f the
    ``edit_fraction`` (or the c-th of a list of them). The result is shuffled with ``seed``."""
    require_positive_int("copies", copies)
    if not 0 <= n_originals <= len(documents):
        raise ValueError(f"n_originals must be in [0, {len(documents)}], got {n_originals}")
    fractions = [edit_fraction] * copies if np.ndim(edit_fraction) == 0 else list(edit_fraction)
    if len(fractions) != copies or not all(0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"edit_fraction must be one fraction in [0, 1] or {copies} of them, "
                         f"got {edit_fraction!r}")  # fmt: skip
    rng = np.random.default_rng(seed)
    docs, cluster, edits = list(documents), list(range(len(documents))), [0] * len(documents)
    for i in rng.choice(len(documents), size=n_originals, replace=False).tolist():
        for f in fractions:
            n = round(f * len(documents[i].split()))
            docs.append(edit_words(documents[i], n, vocabulary, rng))
            cluster.append(i)
            edits.append(n)
    order = rng.permutation(len(docs))  # (N,)
    is_copy = np.arange(len(docs)) >= len(documents)  # (N,) before the shuffle
    return PlantedCorpus([docs[k] for k in order], np.asarray(cluster)[order], is_copy[order],
                         np.asarray(edits)[order])  # fmt: skip


class TextFiles:
    """The documents of some text files as an iterable that starts over on every pass (each
    ``iter`` re-reads the files with ``read_documents``), e.g. a source of ``mix_sources``."""

    def __init__(self, paths: Iterable, report: PipelineReport | None = None, **options):
        self.paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
        self.report = PipelineReport() if report is None else report
        self.options = options

    def __iter__(self) -> Iterator[str]:
        return read_documents(self.paths, report=self.report, **self.options)
