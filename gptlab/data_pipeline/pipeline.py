"""The stages in GPT-3's order (Brown et al. 2020, Appendix A): quality filtering, then
deduplication, as one stream. Each document passes through once and nothing but hashes and
signatures is remembered, so a corpus larger than memory streams through in bounded memory
(k integers per kept document for near-deduplication, one hash for exact deduplication).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from .dedup import MinHasher, NearDuplicateIndex, shingles
from .documents import PipelineReport, normalize, read_documents, stable_hash
from .quality import GPT3_PARETO_ALPHA, QualityClassifier


@dataclass(frozen=True)
class DedupSettings:
    """Near-deduplication: shingles of ``shingle_n`` ``shingle_unit``s, MinHash signatures of
    ``num_perm`` values, LSH with ``bands`` bands of ``rows`` rows, and a candidate counted as a
    near-duplicate when its estimated Jaccard is at least ``threshold``."""

    shingle_n: int = 3
    shingle_unit: str = "word"
    num_perm: int = 128
    bands: int = 32
    rows: int = 4
    threshold: float = 0.5


def filter_documents(documents: Iterable[str], *, classifier: QualityClassifier | None = None,
                     alpha: float = GPT3_PARETO_ALPHA,
                     dedup: DedupSettings | None = DedupSettings(), seed: int = 0,
                     report: PipelineReport | None = None, progress: bool = False,
                     ) -> Iterator[str]:  # fmt: skip
    """The documents that survive, in order, streamed: with a ``classifier``, those that pass
    Pareto sampling (``rng.pareto(alpha) > 1 - score``, ``rng`` seeded with ``seed``); then those
    whose normalised text was not seen before; then (unless ``dedup`` is None) those with no
    earlier kept near-duplicate. Counts go to ``report``."""
    report = PipelineReport() if report is None else report
    rng = np.random.default_rng(seed)
    seen: set[int] = set()
    hasher = None if dedup is None else MinHasher(dedup.num_perm, seed)
    index = None if dedup is None else NearDuplicateIndex(dedup.num_perm, dedup.bands, dedup.rows,
                                                          dedup.threshold)  # fmt: skip
    for document in tqdm(documents, unit="doc", disable=not progress, desc="filtering"):
        if classifier is not None:
            score = classifier.scores([document])[0]
            if not rng.pareto(alpha) > 1.0 - score:
                report.quality_dropped += 1
                continue
        key = stable_hash(normalize(document))
        if key in seen:
            report.exact_duplicates += 1
            continue
        seen.add(key)
        if index is not None:
            signature = hasher.signature(shingles(document, dedup.shingle_n, dedup.shingle_unit))
            if index.add(signature) is not None:
                report.near_duplicates += 1
                continue
        report.kept += 1
        yield document


def run_pipeline(paths: Iterable, output, *, separator: str = "\n\n\n",
                 chunk_bytes: int = 1 << 20, progress: bool = True, **options) -> PipelineReport:
    """Read ``paths`` (``read_documents``), filter (``filter_documents`` with ``options``) and
    write the kept documents to the file ``output``, joined by ``separator``: the whole pipeline
    in bounded memory. Returns the report; bad input is counted in it, never raised."""
    output = Path(output)
    if output.is_dir():
        raise ValueError(f"output {output} is a folder: expected a file path")
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    report = PipelineReport()
    documents = read_documents(paths, separator=separator, chunk_bytes=chunk_bytes, report=report,
                               progress=progress)  # fmt: skip
    with open(output, "w", encoding="utf-8") as out:
        for k, document in enumerate(filter_documents(documents, report=report, **options)):
            out.write(separator + document if k else document)
    return report
