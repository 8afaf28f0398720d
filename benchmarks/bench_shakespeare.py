"""Character-level Shakespeare with nanoGPT's CPU recipe: the hand-written backward vs autograd.

    python benchmarks/bench_shakespeare.py [--data PATH] [--eval-iters 50] [--threads N] [--note "..."]

The quality bar of the training chapter. nanoGPT's README trains a character-level model on
tinyshakespeare on a laptop CPU with 4 layers, 4 heads, width 128, context 64, batch 12, 2000
iterations, learning rate 1e-3 (100 warmup steps, cosine decay to 1e-4), AdamW with beta2 0.99,
weight decay 0.1, gradient clipping at 1.0 and no dropout, and reports a validation loss of about
1.88 after about three minutes. This script trains that recipe twice from the same initial
weights and batches: once with the hand-written backward (``backend="torch"``) and once with the
independent torch reference model differentiated by autograd (``backend="autograd"``).

The two runs go side by side: each trains in chunks of ``--chunk`` updates, resuming from its
checkpoint (resume is exact in ``gptlab.train``: optimizer moments, batch RNG and schedule are
restored), and the chunks alternate between the backends, so a change of machine load during the
run falls on both. Wall time and CPU time (this process, all threads) of every chunk are summed;
they include the evaluations at every chunk boundary (``--eval-iters`` batches per split).

The text file is a command-line argument (the classic 1,115,394-character tinyshakespeare); the
default is ``../shared/data/tinyshakespeare.txt`` next to the repository, a workplace copy that
the package itself never reads. Writes ``benchmarks/results/shakespeare.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from machine import machine_info  # benchmarks/machine.py (the script's own folder)
from gptlab.checkpoint import load_checkpoint
from gptlab.data import load_text, split_train_val
from gptlab.metrics import evaluate_loss
from gptlab.model import count_params
from gptlab.train import TrainConfig, train

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
PUBLISHED_VAL_LOSS = 1.88  # nanoGPT README, CPU recipe for shakespeare_char
BACKENDS = ("torch", "autograd")
LABELS = {"torch": "hand-written backward (backend torch)",
          "autograd": "torch autograd (backend autograd)"}


def recipe(data: str, backend: str, out_dir: Path, eval_iters: int, chunk: int) -> TrainConfig:
    """nanoGPT's CPU recipe for shakespeare_char as a TrainConfig (max_iters set per chunk)."""
    return TrainConfig(
        n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0,
        backend=backend, dtype="float32", data=data, val_fraction=0.1, batch_size=12,
        max_iters=chunk, optimizer="adamw", lr=1e-3, min_lr=1e-4, lr_schedule="cosine",
        warmup_iters=100, lr_decay_iters=2000, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8,
        decay_position_embeddings=True,  # nanoGPT decays every parameter with dim >= 2
        grad_clip=1.0, eval_interval=chunk, eval_iters=eval_iters, log_format="csv",
        out_dir=str(out_dir / backend), checkpoint_interval=0, resume=False, seed=1337,
    )  # fmt: skip


def final_estimates(params, model_config, tokenizer, data: Path, n_batches: int) -> dict:
    """Train and validation loss of the final weights over ``n_batches`` seeded random batches
    (12 x 64), a larger and independent sample than the fixed evaluation batches of training."""
    ids = np.asarray(tokenizer.encode(load_text(data)), dtype=np.int64)
    train_ids, val_ids = split_train_val(ids, 64, 0.1)
    return {split: evaluate_loss(params, model_config, split_ids, 12, 64, n_batches, seed=0)
            for split, split_ids in (("train", train_ids), ("val", val_ids))}


def run(data: Path, eval_iters: int, chunk: int, max_iters: int, out_dir: Path, note: str,
        final_batches: int) -> dict:
    if not data.is_file():
        raise SystemExit(f"error: {data} not found: pass the tinyshakespeare text with --data")
    machine = machine_info(note, torch=torch.__version__, torch_threads=torch.get_num_threads())
    n_chars = len(data.read_text(encoding="utf-8"))
    times = {b: {"wall_s": 0.0, "cpu_s": 0.0, "chunks": []} for b in BACKENDS}
    results = {}
    for start in range(0, max_iters, chunk):
        stop = min(start + chunk, max_iters)
        for backend in BACKENDS:
            cfg = recipe(str(data), backend, out_dir, eval_iters, chunk)
            cfg.max_iters, cfg.resume = stop, start > 0
            wall, cpu = time.perf_counter(), time.process_time()
            results[backend] = train(cfg, progress=False)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            times[backend]["wall_s"] += wall
            times[backend]["cpu_s"] += cpu
            times[backend]["chunks"].append({"steps": [start, stop], "wall_s": round(wall, 2),
                                             "cpu_s": round(cpu, 2)})
            row = results[backend].history[-1]
            print(f"{backend:8s} step {stop:5d}: train {row['train_loss']:.4f} "
                  f"val {row['val_loss']:.4f}  ({wall:.1f} s wall, {cpu:.1f} s CPU)", flush=True)
    machine["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    first = results[BACKENDS[0]]
    runs = {}
    for backend in BACKENDS:
        history = results[backend].history
        final = final_estimates(results[backend].params, results[backend].model_config,
                                results[backend].tokenizer, data, final_batches)
        runs[backend] = {
            "final_val_loss_large_sample": final["val"],
            "final_train_loss_large_sample": final["train"],
            "final_train_loss": history[-1]["train_loss"],
            "final_val_loss": history[-1]["val_loss"],
            "wall_s": round(times[backend]["wall_s"], 2),
            "cpu_s": round(times[backend]["cpu_s"], 2),
            "chunks": times[backend]["chunks"],
            "history": history,
        }
    config = asdict(recipe(str(data), "torch", out_dir, eval_iters, chunk))
    config.update(max_iters=max_iters, backend=list(BACKENDS), out_dir=str(out_dir))
    config["data"] = data.name
    return {
        "benchmark": "shakespeare_char, nanoGPT CPU recipe",
        "machine": machine,
        "data": {"file": data.name, "characters": n_chars,
                 "vocab_size": first.tokenizer.vocab_size},
        "model": {"parameters": count_params(first.model_config),
                  "config": first.model_config.to_dict()},
        "train_config": config,
        "published_val_loss": PUBLISHED_VAL_LOSS,
        "eval_tokens_per_split": eval_iters * 12 * 64,
        "final_eval_batches": final_batches,
        "runs": runs,
        "ratio_wall_torch_over_autograd": runs["torch"]["wall_s"] / runs["autograd"]["wall_s"],
        "ratio_cpu_torch_over_autograd": runs["torch"]["cpu_s"] / runs["autograd"]["cpu_s"],
    }


def evaluate_only(data: Path, out_dir: Path, final_batches: int) -> dict:
    """The existing results with the final estimate computed from the saved final checkpoints."""
    res = json.loads((RESULTS / "shakespeare.json").read_text())
    for backend, run_ in res["runs"].items():
        ckpt = load_checkpoint(out_dir / backend, backend="torch", dtype="float32")
        if ckpt.step != res["train_config"]["max_iters"] or ckpt.state["history"] != run_["history"]:
            raise SystemExit(f"error: {out_dir / backend} is not the run in the results file")
        final = final_estimates(ckpt.params, ckpt.model_config, ckpt.tokenizer, data, final_batches)
        run_["final_val_loss_large_sample"] = final["val"]
        run_["final_train_loss_large_sample"] = final["train"]
    res["final_eval_batches"] = final_batches
    res["final_estimate_note"] = ("the estimate over the larger sample was added afterwards by "
                                  "--evaluate-only, from the final checkpoints of this run")
    return res


def markdown(res: dict) -> str:
    m, cfg, runs = res["machine"], res["train_config"], res["runs"]
    load = (f"Load average (1 min): {m['load_average_1min_at_start']:.2f} at start, "
            f"{m['load_average_1min_at_end']:.2f} at end.")
    lines = [
        "# Character-level Shakespeare: hand-written backward vs autograd",
        "",
        f"Generated by `python benchmarks/bench_shakespeare.py` on {m['date']}. Data: "
        f"`{res['data']['file']}`, {res['data']['characters']:,} characters, vocabulary "
        f"{res['data']['vocab_size']} characters, last 10% for validation.",
        "",
        f"Recipe (nanoGPT's CPU recipe for `shakespeare_char`): {cfg['n_layer']} layers, "
        f"{cfg['n_head']} heads, width {cfg['n_embd']}, context {cfg['block_size']}, batch "
        f"{cfg['batch_size']}, {cfg['max_iters']} iterations, AdamW (betas {cfg['betas'][0]}, "
        f"{cfg['betas'][1]}; weight decay {cfg['weight_decay']} on every matrix, the position "
        f"table included, as nanoGPT), learning rate {cfg['lr']:g} with {cfg['warmup_iters']} "
        f"warmup steps and cosine decay to {cfg['min_lr']:g}, gradient clipping at "
        f"{cfg['grad_clip']}, no dropout, float32, seed {cfg['seed']}; "
        f"{res['model']['parameters']:,} parameters (with biases; nanoGPT's recipe has none). "
        f"Both runs start from the same weights and see the same batches.",
        "",
        f"Loss estimates: during training, the mean over {cfg['eval_iters']} fixed batches of "
        f"12 x 64 characters per split ({res['eval_tokens_per_split']:,} predictions; nanoGPT's "
        f"recipe uses 20 random batches); for the final weights also over "
        f"{res['final_eval_batches']} seeded random batches "
        f"({res['final_eval_batches'] * 12 * 64:,} predictions), a larger, independent sample"
        + (f" ({res['final_estimate_note']})." if res.get("final_estimate_note") else "."),
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), torch "
        f"{m['torch_threads']} threads; {m['platform']}; Python {m['python']}, NumPy "
        f"{m['numpy']}, torch {m['torch']}. {load}" + (f" Note: {m['note']}" if m["note"] else ""),
        "",
        f"The two runs alternate in chunks of {cfg['eval_interval']} updates (each resumes from "
        "its checkpoint; the resume is exact), so both see the same machine load. Times are the "
        "sums over the chunks and include the evaluations at every chunk boundary; CPU time is "
        "this process's, all threads.",
        "",
        f"| gradients | final train loss | final val loss | val loss, {res['final_eval_batches']} "
        "batches | wall time (s) | CPU time (s) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for backend, run_ in runs.items():
        lines.append(f"| {LABELS[backend]} | {run_['final_train_loss']:.4f} | "
                     f"{run_['final_val_loss']:.4f} | {run_['final_val_loss_large_sample']:.4f} | "
                     f"{run_['wall_s']:.1f} | {run_['cpu_s']:.1f} |")
    verdict = all(max(r["final_val_loss"], r["final_val_loss_large_sample"])
                  <= res["published_val_loss"] for r in runs.values())
    lines += [
        "",
        f"Published figure: validation loss {res['published_val_loss']} (nanoGPT README, about "
        f"three minutes on a laptop CPU, one run, 20 random batches). Both runs at or below it "
        f"on both estimates: {'yes' if verdict else 'no'}.",
        "",
        f"Ratio hand-written / autograd: wall {res['ratio_wall_torch_over_autograd']:.2f}x, CPU "
        f"{res['ratio_cpu_torch_over_autograd']:.2f}x (above 1: the hand-written backward is "
        "slower; its eager elementwise temporaries are not fused).",
        "",
        "Validation loss along the way:",
        "",
        "| step | " + " | ".join(LABELS[b] for b in runs) + " |",
        "|---:|" + "---:|" * len(runs),
    ]
    steps = [row["step"] for row in runs["torch"]["history"]]
    for i, step in enumerate(steps):
        lines.append(f"| {step} | " + " | ".join(f"{r['history'][i]['val_loss']:.4f}"
                                                  for r in runs.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help=f"the tinyshakespeare text (default: {DEFAULT_DATA})")
    parser.add_argument("--eval-iters", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=250, help="updates per alternating chunk")
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_shakespeare")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: torch's own choice)")
    parser.add_argument("--note", default="")
    parser.add_argument("--final-eval-batches", type=int, default=200,
                        help="random batches for the final loss estimate of each run")
    parser.add_argument("--evaluate-only", action="store_true",
                        help="add the final estimate to an existing results file from the final "
                             "checkpoints in --out-dir, without training")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.evaluate_only:
        res = evaluate_only(args.data, args.out_dir, args.final_eval_batches)
    else:
        res = run(args.data, args.eval_iters, args.chunk, args.max_iters, args.out_dir, args.note,
                  args.final_eval_batches)
    text = markdown(res)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "shakespeare.json").write_text(json.dumps(res, indent=1) + "\n")
        (RESULTS / "shakespeare.md").write_text(text)


if __name__ == "__main__":
    main()
