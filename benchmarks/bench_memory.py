"""Peak memory and time of attention over T and of the classifier over the vocabulary size:
flash attention and the chunked classifier against the plain layers and torch's own.

    python benchmarks/bench_memory.py [--T 256 512 1024 2048 4096] [--vocab 1024 8192 32768 50257]
                                      [--repeats 3] [--threads 1] [--device cpu] [--note "..."]

Attention (float32, B = 1, 4 heads of size 64, causal, as in GPT): one forward + backward of
- flash: ``gptlab.layers.flash_attention`` (tiles of 128 x 128, hand-written backward);
- sdpa: ``gptlab.layers.sdpa`` (the (T, T) weights kept for the backward);
- torch: ``torch.nn.functional.scaled_dot_product_attention`` with torch autograd.
Classifier (float32, N = 4096 tokens, width 128 as nanoGPT's CPU recipe, the head tied to wte
(V, C)); the (N, V) logits alone are N V 4 bytes (785 MiB at GPT-2's 50,257):
- chunked: ``gptlab.layers.chunked_classifier`` (chunks of 128 tokens);
- plain: ``linear`` (x @ wte^T) + ``cross_entropy``, forward and backward, the (N, V) logits whole;
- torch: ``F.linear`` + ``F.cross_entropy`` with torch autograd.

Memory is measured, not estimated: the peak of the bytes allocated by torch during one forward
+ backward (inputs made before, so not counted; the gradients returned are). On CUDA that is
``torch.cuda.max_memory_allocated`` above the bytes allocated before; on CPU torch keeps no such
counter, so the step runs once under ``torch.profiler`` with ``profile_memory=True`` and the
peak is the maximum over time of the running sum of every allocation and free it recorded
(never the process's RSS). Allocation sizes do not depend on timing, so these numbers repeat
exactly on any machine with the same library versions.

Time: the contenders run interleaved, ``--repeats`` rounds of one step each after a warm-up
step, without the profiler; the median wall time per step is reported. The machine load at start
and end is recorded: on a shared machine the times are noisy, the memory is not. One thread by
default: on a machine whose cores are all busy, two torch threads made the tiled loops (many
small operations, each waiting for both threads) 10-60x slower here, which measures the
oversubscription, not the layers. Writes
``benchmarks/results/memory.json`` and ``.md`` (``memory_cuda.*`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np
import torch

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.layers.chunked_classifier import chunked_classifier_backward, chunked_classifier_forward
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.flash_attention import flash_attention_backward, flash_attention_forward
from gptlab.layers.linear import linear_backward, linear_forward
from gptlab.layers.sdpa import sdpa_backward, sdpa_forward

N_HEAD, HEAD_SIZE, BLOCK = 4, 64, 128
TOKENS, N_EMBD, CHUNK = 4096, 128, 128
MiB = 2**20


def peak_bytes(step, device: str) -> int:
    """The peak of torch's allocated bytes during ``step()``, above what was allocated before."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:  # fmt: skip
        step()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    changes = sorted((e["args"]["Ev Idx"], e["args"]["Bytes"]) for e in events
                     if e.get("name") == "[memory]")  # fmt: skip
    return int(max(np.cumsum([0] + [nbytes for _, nbytes in changes])))


def paired_times(steps: dict, rounds: int, device: str) -> dict:
    """name -> per-round wall seconds, the contenders interleaved (one step each per round)."""
    seconds = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            if device == "cuda":
                torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - start)
    return seconds


def median_times(steps: dict, repeats: int, device: str) -> dict:
    """Median wall seconds per step of each contender, the contenders interleaved per round."""
    for step in steps.values():  # warm-up
        step()
    seconds = paired_times(steps, repeats, device)
    return {name: statistics.median(s) for name, s in seconds.items()}


def attention_steps(T: int, device: str) -> dict:
    """name -> a function that runs one causal forward + backward at length T."""
    gen = torch.Generator(device="cpu").manual_seed(T)
    q, k, v, dout = (torch.randn((1, N_HEAD, T, HEAD_SIZE), generator=gen).to(device)
                     for _ in range(4))  # fmt: skip

    def flash():
        out, cache = flash_attention_forward(q, k, v, causal=True, block_q=BLOCK, block_k=BLOCK)
        return flash_attention_backward(dout, cache)

    def sdpa():
        out, cache = sdpa_forward(q, k, v, causal=True)
        return sdpa_backward(dout, cache)

    def torch_sdpa():
        leaves = [a.detach().requires_grad_() for a in (q, k, v)]
        out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True)
        return torch.autograd.grad(out, leaves, dout)

    return {"flash": flash, "sdpa": sdpa, "torch": torch_sdpa}


def classifier_steps(V: int, device: str) -> dict:
    """name -> a function that runs the tied head + cross-entropy forward and backward."""
    gen = torch.Generator(device="cpu").manual_seed(V)
    x = torch.randn((TOKENS, N_EMBD), generator=gen).to(device)
    wte = (0.02 * torch.randn((V, N_EMBD), generator=gen)).to(device)
    targets = torch.randint(0, V, (TOKENS,), generator=gen).to(device)

    def chunked():
        loss, cache = chunked_classifier_forward(x, wte, targets, chunk_size=CHUNK)
        return chunked_classifier_backward(1.0, cache)

    def plain():
        logits, head_cache = linear_forward(x, wte.mT)
        loss, ce_cache = cross_entropy_forward(logits, targets)
        (dlogits,) = cross_entropy_backward(1.0, ce_cache)
        return linear_backward(dlogits, head_cache)

    def torch_ce():
        leaves = [a.detach().requires_grad_() for a in (x, wte)]
        loss = torch.nn.functional.cross_entropy(torch.nn.functional.linear(*leaves), targets)
        return torch.autograd.grad(loss, leaves)

    return {"chunked": chunked, "plain": plain, "torch": torch_ce}


def measure(make_steps, sizes, args, one_array) -> list[dict]:
    """One row per size: peak bytes and median seconds of each contender, and the bytes of the
    one quadratic array the plain layer keeps (``one_array(size)``), for scale."""
    rows = []
    for size in sizes:
        steps = make_steps(size, args.device)
        peaks = {name: peak_bytes(step, args.device) for name, step in steps.items()}
        times = median_times(steps, args.repeats, args.device)
        rows.append({"size": size, "one_array_bytes": one_array(size), "peak_bytes": peaks,
                     "seconds": times})  # fmt: skip
        print(size, {n: round(b / MiB, 1) for n, b in peaks.items()},
              {n: round(s, 4) for n, s in times.items()}, flush=True)
    return rows


def run(args) -> dict:
    torch.set_num_threads(args.threads)
    machine = machine_info(args.note, torch=torch.__version__, threads=str(args.threads),
                           device=args.device)  # fmt: skip
    results = {
        "machine": machine,
        "settings": {"attention": {"batch": 1, "n_head": N_HEAD, "head_size": HEAD_SIZE,
                                   "causal": True, "block": BLOCK, "dtype": "float32"},
                     "classifier": {"tokens": TOKENS, "n_embd": N_EMBD, "chunk": CHUNK,
                                    "dtype": "float32"},
                     "repeats": args.repeats},  # fmt: skip
        "attention": measure(attention_steps, args.T, args, lambda T: 4 * N_HEAD * T * T),
        "classifier": measure(classifier_steps, args.vocab, args, lambda V: 4 * TOKENS * V),
    }
    results["machine"]["load_average_1min_at_end"] = os.getloadavg()[0]
    return results


def _table(rows, names, ratio, size_label, one_array) -> list[str]:
    a, b = ratio
    head = (f"| {size_label} | {one_array} MiB | " + " | ".join(f"{n} peak MiB" for n in names)
            + f" | {a}/{b} peak | " + " | ".join(f"{n} ms" for n in names) + " |")  # fmt: skip
    lines = [head, "|" + "---|" * (3 + 2 * len(names))]
    for r in rows:
        peaks, secs = r["peak_bytes"], r["seconds"]
        lines.append(f"| {r['size']:,} | {r['one_array_bytes'] / MiB:,.1f} | "
                     + " | ".join(f"{peaks[n] / MiB:,.1f}" for n in names)
                     + f" | {peaks[a] / peaks[b]:.3f} | "
                     + " | ".join(f"{1000 * secs[n]:,.0f}" for n in names) + " |")  # fmt: skip
    return lines


def markdown(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    att, cls = s["attention"], s["classifier"]
    lines = [
        "# Peak memory and time: flash attention and the chunked classifier", "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores_usable']} usable cores, torch "
        f"{m['torch']}, {m['threads']} threads, device {m['device']}); load average "
        f"{m['load_average_1min_at_start']:.1f} at start and {m['load_average_1min_at_end']:.1f} "
        f"at end. {m['note']}", "",
        "Peak = the most bytes torch held allocated at once during one forward + backward, above "
        "the inputs (CPU: summed from torch.profiler's allocation records; CUDA: "
        "torch.cuda.max_memory_allocated). Times are medians of "
        f"{s['repeats']} interleaved steps: noisy on a shared machine; the memory is not.", "",
        f"## Attention over T (B = 1, {att['n_head']} heads of size {att['head_size']}, causal, "
        f"{att['dtype']}, flash tiles {att['block']} x {att['block']})", "",
        *_table(res["attention"], ["flash", "sdpa", "torch"], ("flash", "sdpa"), "T",
               "weights (1, NH, T, T)"), "",
        "flash: gptlab.layers.flash_attention; sdpa: gptlab.layers.sdpa (the (T, T) weights kept); "
        "torch: F.scaled_dot_product_attention + autograd.", "",
        f"## Classifier over the vocabulary (N = {cls['tokens']:,} tokens, C = {cls['n_embd']}, "
        f"tied head, {cls['dtype']}, chunks of {cls['chunk']} tokens)", "",
        *_table(res["classifier"], ["chunked", "plain", "torch"], ("chunked", "plain"), "V",
               "logits (N, V)"), "",
        "chunked: gptlab.layers.chunked_classifier; plain: linear + cross_entropy layers; torch: "
        "F.linear + F.cross_entropy + autograd.", "",
    ]  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--vocab", type=int, nargs="+", default=[1024, 8192, 32768, 50257])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--note", default="", help="e.g. that the machine was shared")
    parser.add_argument("--markdown-only", action="store_true", help="reload results/memory.json")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    report("memory" if args.device == "cpu" else f"memory_{args.device}", args, run, markdown)


if __name__ == "__main__":
    main()
