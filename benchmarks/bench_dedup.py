"""Near-deduplication with MinHash and LSH: precision, recall and throughput on a generated corpus
with planted near-duplicates, over several (bands, rows) settings.

    python benchmarks/bench_dedup.py [--documents 3000] [--repeats 3] [--note "2 cores, shared"]

The corpus: ``--documents`` synthetic documents of 150 words drawn (Zipf-like) from the
embedded corpus's vocabulary, plus 4 copies of each of 10% of them with 2%, 5%, 10% and 20% of
their words edited (``gptlab.data_pipeline.plant_near_duplicates``). Word 3-gram shingles,
MinHash signatures of 128 values; for each banding: the LSH candidate pairs, their recall of the
planted pairs whose exact Jaccard reaches the threshold (measured, and predicted by the S-curve
1 - (1 - s^r)^b averaged over those pairs), then the candidates whose exact Jaccard reaches the
threshold (as Spark's similarity join does), with pair-level precision and recall against
(a) the planted pairs at or above the threshold and (b) all planted pairs. (10, 1) is GPT-3's
setting: Spark's MinHashLSH with 10 hash tables of one MinHash each. Timings are medians of
``--repeats``. Writes ``benchmarks/results/dedup.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.data_pipeline import (
    MinHasher,
    candidate_pairs,
    candidate_probability,
    embedded_documents,
    jaccard,
    normalize,
    plant_near_duplicates,
    precision_recall,
    shingles,
    synthetic_documents,
)

SETTINGS = ((10, 1), (16, 8), (32, 4), (64, 2), (20, 5))  # (bands, rows); b * r <= 128
EDIT_FRACTIONS = (0.02, 0.05, 0.1, 0.2)
NUM_PERM, SHINGLE_N, THRESHOLD, WORDS = 128, 3, 0.5, 150


def timed(fn, *args):
    """(wall seconds, CPU seconds, result) of ``fn(*args)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def signatures_of(documents: list[str]):
    sets = [shingles(d, SHINGLE_N) for d in documents]
    return sets, MinHasher(NUM_PERM, seed=0).signatures(sets)


def run(args) -> dict:
    machine = machine_info(args.note)
    vocabulary = sorted(set(normalize(" ".join(embedded_documents())).split()))
    base = synthetic_documents(args.documents, WORDS, vocabulary, seed=0)
    corpus = plant_near_duplicates(base, args.documents // 10, len(EDIT_FRACTIONS),
                                   EDIT_FRACTIONS, vocabulary, seed=1)  # fmt: skip
    docs, cluster = corpus.documents, corpus.cluster
    n_bytes = sum(len(d.encode("utf-8")) for d in docs)
    sign = [timed(signatures_of, docs) for _ in range(args.repeats)]
    sets, sigs = sign[0][2]
    true = {(i, j) for c in np.unique(cluster) for i, j in _pairs(np.flatnonzero(cluster == c))}
    true_j = {pair: jaccard(sets[pair[0]], sets[pair[1]]) for pair in true}
    above = {pair for pair, s in true_j.items() if s >= THRESHOLD}
    rows = []
    for bands, r in SETTINGS:
        lsh = [timed(candidate_pairs, sigs[:, : bands * r], bands, r) for _ in range(args.repeats)]
        candidates = lsh[0][2]
        wall_v, cpu_v, found = timed(_verify, candidates, sets)
        predicted = float(np.mean([candidate_probability(true_j[p], bands, r) for p in above]))
        precision, recall_all = precision_recall(found, cluster)
        rows.append({
            "bands": bands, "rows": r,
            "s_curve_midpoint": (1 / bands) ** (1 / r),
            "candidates": len(candidates),
            "candidate_recall_above_threshold": len(candidates & above) / len(above),
            "candidate_recall_predicted": predicted,
            "found": len(found),
            "precision": precision,
            "recall_above_threshold": len(found & above) / len(above),
            "recall_all_planted": recall_all,
            "lsh_s": statistics.median(t[0] for t in lsh),
            "lsh_cpu_s": statistics.median(t[1] for t in lsh),
            "verify_s": wall_v, "verify_cpu_s": cpu_v,
        })  # fmt: skip
        print(f"bands {bands} rows {r} done", flush=True)
    by_edit = {}  # edit fraction -> mean exact Jaccard of the pairs (original, its copy)
    for f in EDIT_FRACTIONS:
        pairs = [p for p in true if sorted(corpus.edits[list(p)]) == [0, round(f * WORDS)]]
        by_edit[f] = float(np.mean([true_j[p] for p in pairs]))
    machine["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {
        "benchmark": "dedup", "machine": machine, "repeats": args.repeats,
        "corpus": {"documents": len(docs), "originals": args.documents, "bytes": n_bytes,
                   "planted_copies": int(np.sum(corpus.edits > 0)),
                   "planted_pairs": len(true), "planted_pairs_above_threshold": len(above),
                   "words_per_document": WORDS, "edit_fractions": list(EDIT_FRACTIONS),
                   "mean_jaccard_original_copy_by_edit_fraction": by_edit},
        "settings": {"num_perm": NUM_PERM, "shingles": f"word {SHINGLE_N}-grams",
                     "threshold": THRESHOLD},
        "signatures": {"s": statistics.median(t[0] for t in sign),
                       "cpu_s": statistics.median(t[1] for t in sign)},
        "rows": rows,
    }  # fmt: skip


def _pairs(ids):
    return [(int(a), int(b)) for k, a in enumerate(ids) for b in ids[k + 1 :]]


def _verify(candidates, sets) -> set:
    """The candidate pairs whose exact Jaccard reaches the threshold."""
    return {(i, j) for i, j in candidates if jaccard(sets[i], sets[j]) >= THRESHOLD}


def markdown(res: dict) -> str:
    m, c, s, sig = res["machine"], res["corpus"], res["settings"], res["signatures"]
    edits = ", ".join(f"{f:.0%} edits: {j:.2f}" for f, j in
                      c["mean_jaccard_original_copy_by_edit_fraction"].items())  # fmt: skip
    lines = [
        "# Near-deduplication: MinHash + LSH on planted near-duplicates",
        "",
        f"Generated by `python benchmarks/bench_dedup.py` on {m['date']}. Corpus: "
        f"{c['documents']:,} documents ({c['bytes']:,} bytes): {c['originals']:,} synthetic "
        f"documents of {c['words_per_document']} words and {c['planted_copies']:,} planted copies "
        f"(edit fractions {c['edit_fractions']}), {c['planted_pairs']:,} planted pairs, "
        f"{c['planted_pairs_above_threshold']:,} of them with exact Jaccard >= {s['threshold']}. "
        f"Mean Jaccard of original and copy: {edits}. Shingles: {s['shingles']}; signatures of "
        f"{s['num_perm']} MinHash values; a found pair is an LSH candidate whose exact Jaccard "
        f">= {s['threshold']}.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['platform']}; "
        f"Python {m['python']}, NumPy {m['numpy']}. Load average (1 min): "
        f"{m['load_average_1min_at_start']:.2f} at start, {m['load_average_1min_at_end']:.2f} "
        f"at end." + (f" Note: {m['note']}" if m["note"] else ""),
        "",
        f"Shingling and signatures: {sig['s']:.2f} s wall, {sig['cpu_s']:.2f} s CPU "
        f"({c['documents'] / sig['cpu_s']:,.0f} documents/s, "
        f"{c['bytes'] / 1e6 / sig['cpu_s']:.2f} MB/s of CPU time); median of {res['repeats']}.",
        "",
        "| bands b | rows r | S-curve midpoint (1/b)^(1/r) | candidates | candidate recall (J >= "
        "threshold): measured / S-curve | found | precision | recall (J >= threshold) "
        "| recall (all planted) | LSH CPU (s) | verify CPU (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["rows"]:
        lines.append(f"| {r['bands']} | {r['rows']} | {r['s_curve_midpoint']:.3f} "
                     f"| {r['candidates']:,} | {r['candidate_recall_above_threshold']:.4f} / "
                     f"{r['candidate_recall_predicted']:.4f} | {r['found']:,} "
                     f"| {r['precision']:.4f} | {r['recall_above_threshold']:.4f} "
                     f"| {r['recall_all_planted']:.4f} | {r['lsh_cpu_s']:.2f} "
                     f"| {r['verify_cpu_s']:.2f} |")  # fmt: skip
    lines += ["", "(10, 1) is GPT-3's setting (Spark's MinHashLSH, 10 hash tables of one MinHash "
              "each): its S-curve is low and flat, so it passes the most candidates on to the "
              "exact verification, which does the filtering. Recall of all planted pairs stays "
              "near the fraction of them at or above the threshold: the copies with 20% of "
              "their words edited, and pairs of two edited copies, mostly fall below it."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="e.g. that the machine was shared")
    parser.add_argument("--markdown-only", action="store_true", help="reload results/dedup.json")
    parser.add_argument("--no-write", action="store_true")
    report("dedup", parser.parse_args(), run, markdown)


if __name__ == "__main__":
    main()
