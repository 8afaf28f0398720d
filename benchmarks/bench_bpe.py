"""Byte-level BPE: gptlab.tokenizers.bpe against Hugging Face ``tokenizers`` on the embedded corpus.

    python benchmarks/bench_bpe.py [--repeats 5] [--note "2 cores, shared"]

For each vocabulary size: training time, wall and CPU (ours, Hugging Face with its default
thread pool, and Hugging Face with ``RAYON_NUM_THREADS=1`` in a subprocess), the throughput of
encoding the whole corpus as one string with a fresh tokenizer (cold cache), bytes per token,
and whether the merge lists and the ids are identical. The contenders run side by side in
every repetition, and the tables report medians over the repetitions (ratios: the median of
the per-repetition ratios). Writes ``benchmarks/results/bpe.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import regex
import tokenizers
from tokenizers import models, pre_tokenizers, trainers

from machine import machine_info  # benchmarks/machine.py (the script's own folder)
from gptlab.tokenizers.bpe import ENDOFTEXT, GPT2_PATTERN, ByteBPETokenizer, count_words
from gptlab.training.data import embedded_corpus

VOCAB_SIZES = (512, 2048)
RESULTS = Path(__file__).resolve().parent / "results"


def timed(fn, *args):
    """(wall seconds, CPU seconds of this process, all threads, result) of ``fn(*args)``."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu, result


def train_ours(text: str, vocab_size: int) -> ByteBPETokenizer:
    return ByteBPETokenizer.train(text, vocab_size, special_tokens=(ENDOFTEXT,))


def train_hf(text: str, vocab_size: int) -> tokenizers.Tokenizer:
    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[ENDOFTEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([text], trainer=trainer)
    return hf


def train_hf_single_thread() -> dict[int, tuple[float, float]]:
    """{vocab: (wall, CPU seconds)} of Hugging Face training with one Rayon thread: the variable
    must be set before its thread pool starts, so this runs in a fresh interpreter."""
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, __file__, "--hf-train-only"], env=env,
                         check=True, capture_output=True, text=True).stdout
    return {int(v): tuple(times) for v, times in json.loads(out).items()}


def encode_ours(tok: ByteBPETokenizer, text: str) -> tuple[float, float, list[int]]:
    fresh = ByteBPETokenizer.from_dict(tok.to_dict())  # an empty cache
    return timed(fresh.encode, text)


def encode_hf(hf: tokenizers.Tokenizer, text: str) -> tuple[float, float, list[int]]:
    fresh = tokenizers.Tokenizer.from_str(hf.to_str())  # an empty cache
    wall, cpu, encoding = timed(fresh.encode, text)
    return wall, cpu, encoding.ids


def hf_merges(hf: tokenizers.Tokenizer) -> list[tuple[str, str]]:
    return [tuple(merge) for merge in json.loads(hf.to_str())["model"]["merges"]]


def median_ratio(numerators: list[float], denominators: list[float]) -> float:
    """The median of the per-repetition ratios."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def run(repeats: int, note: str) -> dict:
    machine = machine_info(note, regex=regex.__version__, tokenizers=tokenizers.__version__)
    text = embedded_corpus()
    n_bytes = len(text.encode("utf-8"))
    words = count_words(text, GPT2_PATTERN, [ENDOFTEXT])
    runs = {v: {} for v in VOCAB_SIZES}  # vocab -> measure -> one value per repetition
    checks = {}
    for rep in range(repeats):
        single_thread = train_hf_single_thread()
        for v in VOCAB_SIZES:
            wall_ours, cpu_ours, ours = timed(train_ours, text, v)
            wall_hf, cpu_hf, hf = timed(train_hf, text, v)
            enc_ours, enc_cpu_ours, ids_ours = encode_ours(ours, text)
            enc_hf, enc_cpu_hf, ids_hf = encode_hf(hf, text)
            measures = {"ours_train_s": wall_ours, "hf_train_s": wall_hf,
                        "hf_1thread_train_s": single_thread[v][0],
                        "ours_train_cpu_s": cpu_ours, "hf_train_cpu_s": cpu_hf,
                        "hf_1thread_train_cpu_s": single_thread[v][1],
                        "ours_encode_s": enc_ours, "hf_encode_s": enc_hf,
                        "ours_encode_cpu_s": enc_cpu_ours, "hf_encode_cpu_s": enc_cpu_hf}
            for key, value in measures.items():
                runs[v].setdefault(key, []).append(value)
            checks[v] = {"merges_identical": ours.merges == hf_merges(hf),
                         "ids_identical": ids_ours == ids_hf, "n_merges": len(ours.merges),
                         "ours_bytes_per_token": n_bytes / len(ids_ours),
                         "hf_bytes_per_token": n_bytes / len(ids_hf)}
        print(f"repetition {rep + 1}/{repeats} done", file=sys.stderr)
    summary = {}
    for v, r in runs.items():
        summary[v] = {
            **{f"{key}_median": statistics.median(values) for key, values in r.items()},
            "train_ratio_ours_over_hf": median_ratio(r["ours_train_s"], r["hf_train_s"]),
            "train_ratio_ours_over_hf_1thread": median_ratio(r["ours_train_s"],
                                                             r["hf_1thread_train_s"]),
            "train_cpu_ratio_ours_over_hf_1thread": median_ratio(r["ours_train_cpu_s"],
                                                                 r["hf_1thread_train_cpu_s"]),
            **{f"{key[:-2]}_MB_per_s": n_bytes / 1e6 / statistics.median(r[key])
               for key in ("ours_encode_s", "hf_encode_s", "ours_encode_cpu_s", "hf_encode_cpu_s")},
            **checks[v],
        }
    machine["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    corpus = {"name": "embedded (pydoc_data.topics)", "chars": len(text), "bytes": n_bytes,
              "pretokens": words.total(), "distinct_pretokens": len(words)}
    return {"benchmark": "bpe", "corpus": corpus,
            "repeats": repeats, "machine": machine, "summary": summary, "runs": runs}


def markdown(result: dict) -> str:
    m, s, c = result["machine"], result["summary"], result["corpus"]
    lines = [
        "# Byte-level BPE: gptlab.tokenizers.bpe vs Hugging Face tokenizers",
        "",
        f"Generated by `python benchmarks/bench_bpe.py` on {m['date']}. Corpus: "
        f"{c['name']}, {c['bytes']:,} bytes. "
        f"Medians of {result['repeats']} repetitions; the contenders run side by side in each, "
        "and a ratio is the median of the per-repetition ratios. Wall time is what a user "
        "waits; CPU time (this process, all its threads) is steadier when the machine is busy.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), {m['platform']}; "
        f"Python {m['python']}, NumPy {m['numpy']}, regex {m['regex']}, "
        f"tokenizers {m['tokenizers']}. Load average (1 min): "
        f"{m['load_average_1min_at_start']:.2f} at start, "
        f"{m['load_average_1min_at_end']:.2f} at end."
        + (f" Note: {m['note']}" if m["note"] else ""),
        "",
        "## Training",
        "",
        "HF: Hugging Face `BpeTrainer` with its default thread pool; HF 1 thread: the same with "
        "`RAYON_NUM_THREADS=1`, in a subprocess.",
        "",
        "| vocab | ours (s) | HF (s) | HF 1 thread (s) | ours / HF | ours / HF 1 thread "
        "| ours CPU (s) | HF 1 thread CPU (s) | CPU ratio | merges identical |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for v, r in s.items():
        lines.append(f"| {v} | {r['ours_train_s_median']:.3f} | {r['hf_train_s_median']:.3f} "
                     f"| {r['hf_1thread_train_s_median']:.3f} "
                     f"| {r['train_ratio_ours_over_hf']:.2f}x "
                     f"| {r['train_ratio_ours_over_hf_1thread']:.2f}x "
                     f"| {r['ours_train_cpu_s_median']:.3f} "
                     f"| {r['hf_1thread_train_cpu_s_median']:.3f} "
                     f"| {r['train_cpu_ratio_ours_over_hf_1thread']:.2f}x "
                     f"| {'yes' if r['merges_identical'] else 'NO'} ({r['n_merges']} merges) |")
    lines += [
        "",
        "## Encoding",
        "",
        "The whole corpus as one string, `encode(text)` on a fresh tokenizer (cold cache); "
        "MB/s = corpus bytes / median time, by wall clock and by CPU time. Both tokenizers "
        "cache the merges of each distinct pre-token, and this corpus repeats itself "
        f"({c['distinct_pretokens']:,} distinct pre-tokens among {c['pretokens']:,}); "
        "Hugging Face's `encode` also tracks character offsets and alignments, which ours does "
        "not.",
        "",
        "| vocab | ours (MB/s) | HF (MB/s) | ours CPU (MB/s) | HF CPU (MB/s) "
        "| ours bytes/token | HF bytes/token | ids identical |",
        "|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for v, r in s.items():
        lines.append(f"| {v} | {r['ours_encode_MB_per_s']:.2f} | {r['hf_encode_MB_per_s']:.2f} "
                     f"| {r['ours_encode_cpu_MB_per_s']:.2f} | {r['hf_encode_cpu_MB_per_s']:.2f} "
                     f"| {r['ours_bytes_per_token']:.3f} | {r['hf_bytes_per_token']:.3f} "
                     f"| {'yes' if r['ids_identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="", help="e.g. that the machine was shared")
    parser.add_argument("--hf-train-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_train_only:  # the single-thread subprocess: print {vocab: [wall, cpu]}
        text = embedded_corpus()
        train_hf("warm up the pre-tokenizer and the thread pool", 300)
        print(json.dumps({v: timed(train_hf, text, v)[:2] for v in VOCAB_SIZES}))
        return
    result = run(args.repeats, args.note)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bpe.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (RESULTS / "bpe.md").write_text(markdown(result), encoding="utf-8")
    print(markdown(result))


if __name__ == "__main__":
    main()
