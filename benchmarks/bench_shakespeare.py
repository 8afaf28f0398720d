"""Character-level Shakespeare with nanoGPT's CPU recipe: hand-written backward, autograd, nanoGPT.

    python benchmarks/bench_shakespeare.py [--data PATH] [--seeds 1337 1 2 3] [--jobs 2]
                                           [--nanogpt DIR]

The quality bar of the training chapter. nanoGPT's README trains a character-level model on
tinyshakespeare on a laptop CPU with 4 layers, 4 heads, width 128, context 64, batch 12, 2000
iterations, learning rate 1e-3 (100 warmup steps, cosine decay to 1e-4), AdamW with beta2 0.99,
weight decay 0.1, gradient clipping at 1.0 and no dropout (its ``train_shakespeare_char`` config
with the README's command-line overrides; nanoGPT's model has no biases and the exact erf GELU),
and reports a validation loss of 1.88 after about three minutes, estimated from 20 random
batches. For every seed this script trains that recipe twice from the same initial weights and
batches: once with the hand-written backward (``backend="torch"``) and once with the
independent torch reference model differentiated by autograd (``backend="autograd"``).

The yardstick is nanoGPT itself, from a checkout the user points to with ``--nanogpt DIR``
(skipped with a message without one): the checkout is copied to a scratch folder, the text
given with ``--data`` is written there as ``data/shakespeare_char/input.txt`` (so its
``prepare.py`` downloads nothing), nanoGPT's own ``prepare.py`` and then ``train.py`` run there
with the README's CPU command (plus ``--dtype=float32``, what the CPU computes in anyway, and a
checkpoint at every evaluation to score the final weights), as one more job beside the seeds,
``--threads`` threads. Its ``train.py`` seeds torch with 1337 whatever ``--seeds`` says, so it
runs once; its CPU time is compared with the mean per seed of gptlab's runs.

The two runs of a seed go side by side: each trains in chunks of ``--chunk`` updates, resuming
from its checkpoint (resume is exact in ``gptlab.training.train``: optimizer moments, batch RNG and
schedule are restored), and the chunks alternate between the backends, so a change of machine
load during the run falls on both. Wall time and CPU time (this process, all threads) of every
chunk are summed; they include the evaluations at every chunk boundary (``--eval-iters`` fixed
batches per split). ``--jobs`` seeds train at once, one process each.

Every final model is scored twice on the validation split (the last 10% of the text):
- the whole split (``gptlab.training.metrics.split_loss``): every token of its 64-character windows
  predicted once, no sampling noise; this is the figure the verdict uses;
- nanoGPT's estimator, the mean over 20 random batches of 12 x 64 characters, drawn
  ``--draws`` times with different seeds: how far one such estimate strays from the whole split.

The text file is a command-line argument (the classic 1,115,394-character tinyshakespeare); the
default is ``../shared/data/tinyshakespeare.txt`` next to the repository, a workplace copy that
the package itself never reads. Writes ``benchmarks/results/shakespeare.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.config import GPTConfig
from gptlab.training.data import load_text, split_train_val
from gptlab.training.metrics import evaluate_loss, split_loss
from gptlab.model import count_params
from gptlab.tokenizers.char import CharTokenizer
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"
PUBLISHED_VAL_LOSS = 1.88  # nanoGPT README, CPU recipe for shakespeare_char
NANOGPT_EVAL_BATCHES = 20  # the README's --eval_iters=20
BACKENDS = ("torch", "autograd")
LABELS = {"torch": "gptlab, hand-written backward", "autograd": "gptlab, torch autograd",
          "nanogpt": "nanoGPT's train.py"}
NANOGPT_CPU_COMMAND = (  # nanoGPT's README, "I only have a macbook" (max_iters set per run)
    "train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False",
    "--eval_iters=20", "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4",
    "--n_head=4", "--n_embd=128", "--dropout=0.0", "--dtype=float32")  # fmt: skip
NANOGPT_LINEAR_WEIGHTS = ("c_attn.weight", "c_proj.weight", "c_fc.weight")  # nn.Linear: (out, in)


def recipe(data: str, backend: str, out_dir: Path, eval_iters: int, chunk: int,
           seed: int) -> TrainConfig:
    """nanoGPT's CPU recipe for shakespeare_char as a TrainConfig (max_iters set per chunk)."""
    return TrainConfig(
        n_layer=4, n_head=4, n_embd=128, block_size=64, dropout=0.0, gelu="none", bias=False,
        backend=backend, dtype="float32", data=data, val_fraction=0.1, batch_size=12,
        max_iters=chunk, optimizer="adamw", lr=1e-3, min_lr=1e-4, lr_schedule="cosine",
        warmup_iters=100, lr_decay_iters=2000, weight_decay=0.1, betas=(0.9, 0.99), eps=1e-8,
        decay_position_embeddings=True,  # nanoGPT decays every parameter with dim >= 2
        grad_clip=1.0, eval_interval=chunk, eval_iters=eval_iters, log_format="csv",
        out_dir=str(out_dir / f"seed{seed}" / backend), checkpoint_interval=0, resume=False,
        seed=seed,
    )  # fmt: skip


def final_scores(params: dict, cfg, val_ids: np.ndarray, draws: int) -> dict:
    """Validation loss of the final weights: the whole split, and ``draws`` independent draws
    of nanoGPT's 20-batch estimate (the draws' seeds are 0 .. draws-1 for every model)."""
    estimates = [evaluate_loss(params, cfg, val_ids, 12, 64, NANOGPT_EVAL_BATCHES, seed=draw)
                 for draw in range(draws)]  # fmt: skip
    quantiles = statistics.quantiles(estimates, n=20)  # 5%, 10%, ..., 95%
    return {
        "val_split": split_loss(params, cfg, val_ids, 64),
        "val_tokens_scored": (len(val_ids) - 1) // 64 * 64,
        "draws": estimates,
        "draws_p5": quantiles[0],
        "draws_p95": quantiles[-1],
        "draws_share_at_or_below_published":
            sum(e <= PUBLISHED_VAL_LOSS for e in estimates) / draws,
    }


def run_seed(data: Path, seed: int, eval_iters: int, chunk: int, max_iters: int, out_dir: Path,
             draws: int, threads: int) -> dict:
    """Both backends for one seed, alternating chunks; their histories, times and scores."""
    torch.set_num_threads(threads)
    times = {b: {"wall_s": 0.0, "cpu_s": 0.0, "chunks": []} for b in BACKENDS}
    results = {}
    for start in range(0, max_iters, chunk):
        stop = min(start + chunk, max_iters)
        for backend in BACKENDS:
            cfg = recipe(str(data), backend, out_dir, eval_iters, chunk, seed)
            cfg.max_iters, cfg.resume = stop, start > 0
            wall, cpu = time.perf_counter(), time.process_time()
            results[backend] = train(cfg, progress=False, overwrite=not cfg.resume)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            times[backend]["wall_s"] += wall
            times[backend]["cpu_s"] += cpu
            times[backend]["chunks"].append({"steps": [start, stop], "wall_s": round(wall, 2),
                                             "cpu_s": round(cpu, 2)})
            row = results[backend].history[-1]
            print(f"seed {seed} {backend:8s} step {stop:5d}: train {row['train_loss']:.4f} val "
                  f"{row['val_loss']:.4f} ({wall:.1f} s wall, {cpu:.1f} s CPU)", flush=True)
    first = results[BACKENDS[0]]
    val_ids = validation_ids(first.tokenizer, data)
    runs = {}
    for backend in BACKENDS:
        runs[backend] = {
            **final_scores(results[backend].params, first.model_config, val_ids, draws),
            "wall_s": round(times[backend]["wall_s"], 2),
            "cpu_s": round(times[backend]["cpu_s"], 2),
            "chunks": times[backend]["chunks"],
            "history": results[backend].history,
        }
    return {"seed": seed, "runs": runs, "vocab_size": first.tokenizer.vocab_size,
            "model_config": first.model_config.to_dict(),
            "parameters": count_params(first.model_config)}


def validation_ids(tokenizer, data: Path) -> np.ndarray:
    """The validation split (the last 10%) of the text as gptlab's training run cuts it."""
    ids = np.asarray(tokenizer.encode(load_text(data)), dtype=np.int64)
    return split_train_val(ids, 64, 0.1)[1]


def nanogpt_params(state_dict: dict) -> dict:
    """nanoGPT's model weights under gptlab's names and (in, out) layout."""
    params = {}
    for name, value in state_dict.items():
        name = name.removeprefix("transformer.")
        if name == "lm_head.weight":
            continue  # tied to wte.weight
        params[name] = value.T.contiguous() if name.endswith(NANOGPT_LINEAR_WEIGHTS) else value
    return params


def run_nanogpt(checkout: Path, data: Path, max_iters: int, eval_interval: int,
                threads: int) -> dict:
    """nanoGPT's own prepare.py and train.py (the README's CPU command) in a scratch copy of
    ``checkout``: its final weights (gptlab's layout), its own last validation estimate, and the
    wall and CPU time of train.py (the child process's user + system time)."""
    with tempfile.TemporaryDirectory(prefix="nanogpt-") as scratch:
        work = Path(scratch) / "nanoGPT"
        shutil.copytree(checkout, work, ignore=shutil.ignore_patterns(".git", "*.bin", "*.pt"))
        prepare_dir = work / "data" / "shakespeare_char"
        shutil.copyfile(data, prepare_dir / "input.txt")  # present: prepare.py downloads nothing
        subprocess.run([sys.executable, "prepare.py"], cwd=prepare_dir, check=True,
                       capture_output=True)  # fmt: skip
        command = [sys.executable, *NANOGPT_CPU_COMMAND, f"--max_iters={max_iters}",
                   f"--lr_decay_iters={max_iters}", f"--eval_interval={eval_interval}",
                   "--always_save_checkpoint=True", "--out_dir=out"]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        wall = time.perf_counter()
        with subprocess.Popen(command, cwd=work, env=env, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as child:  # fmt: skip
            log = child.stdout.read()
            _, status, usage = os.wait4(child.pid, 0)  # wait4: the child's own CPU time
            child.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - wall
        if child.returncode != 0:
            raise RuntimeError(f"nanoGPT's train.py failed (exit {child.returncode}):\n"
                               f"{log[-3000:]}")
        checkpoint = torch.load(work / "out" / "ckpt.pt", map_location="cpu", weights_only=True)
    if checkpoint["iter_num"] != max_iters:
        raise RuntimeError(f"nanoGPT's last checkpoint is from step {checkpoint['iter_num']}, "
                           f"not {max_iters}: pass a --max-iters divisible by --chunk")
    estimates = re.findall(r"step (\d+): train loss ([\d.]+), val loss ([\d.]+)", log)
    cpu = usage.ru_utime + usage.ru_stime
    print(f"nanoGPT  step {max_iters:5d} ({wall:.1f} s wall, {cpu:.1f} s CPU)", flush=True)
    return {"params": nanogpt_params(checkpoint["model"]), "wall_s": round(wall, 2),
            "cpu_s": round(cpu, 2), "seed": 1337,
            "own_estimates": [{"step": int(step), "train_loss": float(train),
                               "val_loss": float(val)} for step, train, val in estimates]}


def nanogpt_checkout(path: Path | None) -> Path | None:
    """``path`` when it holds nanoGPT's train.py and shakespeare_char/prepare.py; else None,
    with the reason printed."""
    if path is None:
        print("skipped nanoGPT's train.py: no checkout given (--nanogpt DIR)")
        return None
    needed = ("train.py", "data/shakespeare_char/prepare.py")
    missing = [f for f in needed if not (path / f).is_file()]
    if missing:
        print(f"skipped nanoGPT's train.py: {path} lacks {', '.join(missing)}")
        return None
    return path


def run(args: argparse.Namespace) -> dict:
    if not args.data.is_file():
        raise SystemExit(f"error: {args.data} not found: pass the tinyshakespeare text with --data")
    checkout = nanogpt_checkout(args.nanogpt)
    machine = machine_info(args.note, torch=torch.__version__, torch_threads=args.threads,
                           jobs=args.jobs)
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter per job, no forked torch
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as pool:
        futures = [pool.submit(run_seed, args.data, seed, args.eval_iters, args.chunk,
                               args.max_iters, args.out_dir, args.draws, args.threads)
                   for seed in args.seeds]  # fmt: skip
        if checkout is not None:
            nanogpt_future = pool.submit(run_nanogpt, checkout.resolve(), args.data.resolve(),
                                         args.max_iters, args.chunk, args.threads)  # fmt: skip
        seeds = [future.result() for future in futures]
        nanogpt = None if checkout is None else nanogpt_future.result()
    machine["load_average_1min_at_end"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    config = asdict(recipe(args.data.name, "torch", args.out_dir, args.eval_iters, args.chunk,
                           args.seeds[0]))  # fmt: skip
    config.update(max_iters=args.max_iters, backend=list(BACKENDS), seed=list(args.seeds),
                  out_dir=str(args.out_dir))  # fmt: skip
    mean_split = {b: statistics.mean(s["runs"][b]["val_split"] for s in seeds) for b in BACKENDS}
    wall = {b: sum(s["runs"][b]["wall_s"] for s in seeds) for b in BACKENDS}
    cpu = {b: sum(s["runs"][b]["cpu_s"] for s in seeds) for b in BACKENDS}
    ratios = {}
    if nanogpt is not None:
        val_ids = validation_ids(CharTokenizer.from_text(load_text(args.data)), args.data)
        model_config = GPTConfig(**seeds[0]["model_config"])
        nanogpt |= final_scores(nanogpt.pop("params"), model_config, val_ids, args.draws)
        for b in BACKENDS:  # gptlab's mean CPU time per seed / nanoGPT's one run
            ratios[f"ratio_cpu_{b}_over_nanogpt"] = cpu[b] / len(seeds) / nanogpt["cpu_s"]
    return {
        "benchmark": "shakespeare_char, nanoGPT CPU recipe",
        "machine": machine,
        "data": {"file": args.data.name, "characters": len(load_text(args.data)),
                 "vocab_size": seeds[0]["vocab_size"]},
        "model": {"parameters": seeds[0]["parameters"], "config": seeds[0]["model_config"]},
        "train_config": config,
        "published_val_loss": PUBLISHED_VAL_LOSS,
        "eval_tokens_per_split": args.eval_iters * 12 * 64,
        "draws": args.draws,
        "seeds": seeds,
        "nanogpt": nanogpt,
        "mean_val_split": mean_split,
        "ratio_wall_torch_over_autograd": wall["torch"] / wall["autograd"],
        "ratio_cpu_torch_over_autograd": cpu["torch"] / cpu["autograd"],
        **ratios,
    }


def score_row(seed: int, label: str, r: dict) -> str:
    """One row of the scores table."""
    return (f"| {seed} | {label} | {r['val_split']:.4f} | {r['draws_p5']:.3f} - "
            f"{r['draws_p95']:.3f} | {r['draws_share_at_or_below_published']:.0%} | "
            f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} |")


def markdown(res: dict) -> str:
    m, cfg, seeds = res["machine"], res["train_config"], res["seeds"]
    published = res["published_val_loss"]
    n_val = seeds[0]["runs"]["torch"]["val_tokens_scored"]
    lines = [
        "# Character-level Shakespeare: hand-written backward, autograd and nanoGPT's train.py",
        "",
        f"Generated by `python benchmarks/bench_shakespeare.py` on {m['date']}. Data: "
        f"`{res['data']['file']}`, {res['data']['characters']:,} characters, vocabulary "
        f"{res['data']['vocab_size']} characters, the last 10% for validation.",
        "",
        f"Recipe (nanoGPT's CPU recipe for `shakespeare_char`): {cfg['n_layer']} layers, "
        f"{cfg['n_head']} heads, width {cfg['n_embd']}, context {cfg['block_size']}, no biases, "
        f"exact (erf) GELU, batch {cfg['batch_size']}, {cfg['max_iters']} iterations, AdamW "
        f"(betas {cfg['betas'][0]}, {cfg['betas'][1]}; weight decay {cfg['weight_decay']} on "
        f"every matrix, the position table included, as nanoGPT), learning rate {cfg['lr']:g} "
        f"with {cfg['warmup_iters']} warmup steps and cosine decay to {cfg['min_lr']:g}, gradient "
        f"clipping at {cfg['grad_clip']}, no dropout, float32; {res['model']['parameters']:,} "
        f"parameters. Seeds {', '.join(str(s) for s in cfg['seed'])}; for each seed both gptlab "
        "runs start from the same weights and see the same batches. The yardstick is nanoGPT "
        "itself: its own `prepare.py` and `train.py` with the README's CPU command (float32, "
        "its own seed 1337, its own initialisation and batches), run from a checkout given with "
        "`--nanogpt`, "
        + ("beside the seeds, and scored by the same function."
           if res.get("nanogpt") else "**not run** (no checkout given)."),
        "",
        f"Scores of the final weights on the validation split: the **whole split** "
        f"({n_val:,} predictions, no sampling noise), and nanoGPT's estimator, the mean over "
        f"{NANOGPT_EVAL_BATCHES} random batches of 12 x 64 characters (15,360 predictions), "
        f"drawn {res['draws']} times: its 5th to 95th percentile, and the share of draws at or "
        f"below the published {published}.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable); {m['jobs']} "
        f"seeds trained at once, torch {m['torch_threads']} thread(s) each; {m['platform']}; "
        f"Python {m['python']}, NumPy {m['numpy']}, torch {m['torch']}. Load average (1 min): "
        f"{m['load_average_1min_at_start']:.2f} at start, {m['load_average_1min_at_end']:.2f} at "
        f"end." + (f" Note: {m['note']}" if m["note"] else ""),
        "",
        f"The two runs of a seed alternate in chunks of {cfg['eval_interval']} updates (each "
        "resumes from its checkpoint; the resume is exact), so both see the same machine load. "
        "Times are the sums over the chunks and include the evaluations at every chunk boundary "
        f"({cfg['eval_iters']} fixed batches per split); CPU time is the process's, all threads.",
        "",
        "| seed | run | val loss, whole split | 20-batch estimate, 5%-95% | draws <= "
        f"{published} | wall time (s) | CPU time (s) |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for seed in seeds:
        lines += [score_row(seed["seed"], LABELS[b], r) for b, r in seed["runs"].items()]
    nanogpt = res.get("nanogpt")
    if nanogpt:
        lines.append(score_row(nanogpt["seed"], LABELS["nanogpt"], nanogpt))
    means = res["mean_val_split"]
    verdict = all(means[b] <= published for b in BACKENDS)
    pooled = {b: [d for s in seeds for d in s["runs"][b]["draws"]] for b in means}
    if nanogpt:
        pooled["nanogpt"] = nanogpt["draws"]
    lines += [
        "",
        "Mean over the seeds of the whole-split validation loss: "
        + ", ".join(f"{LABELS[b]} {means[b]:.4f}" for b in means)
        + (f", {LABELS['nanogpt']} (one run) {nanogpt['val_split']:.4f} (its own last "
           f"{NANOGPT_EVAL_BATCHES}-batch estimate: {nanogpt['own_estimates'][-1]['val_loss']})"
           if nanogpt else "")
        + f". Published figure: {published} (nanoGPT README, one run, {NANOGPT_EVAL_BATCHES} "
        f"random batches). Both gptlab means at or below it: {'yes' if verdict else 'no'}. "
        f"Share of all {NANOGPT_EVAL_BATCHES}-batch estimates (every seed, every draw) at or "
        f"below {published}: "
        + ", ".join(f"{LABELS[b]} {sum(d <= published for d in v) / len(v):.1%}"
                    for b, v in pooled.items()) + ".",
        "",
        f"Ratio hand-written / autograd over all seeds: wall "
        f"{res['ratio_wall_torch_over_autograd']:.2f}x, CPU "
        f"{res['ratio_cpu_torch_over_autograd']:.2f}x "
        "(above 1: the hand-written backward is slower; its eager elementwise temporaries are not "
        "fused)." + (
            " CPU time per run against nanoGPT's train.py: hand-written backward "
            f"{res['ratio_cpu_torch_over_nanogpt']:.2f}x, autograd "
            f"{res['ratio_cpu_autograd_over_nanogpt']:.2f}x (gptlab's mean per seed over "
            "nanoGPT's one run, which trains as a job beside the seeds, not interleaved with "
            "them, evaluates 20 batches per split every chunk and prints every step; its time "
            "includes the interpreter's start and imports, and the one update train.py makes "
            "after its last evaluation, whose weights are scored; its attention is torch's fused "
            "scaled_dot_product_attention)." if nanogpt else ""),
        "",
        f"Validation loss along the way (the {cfg['eval_iters']} fixed batches), seed "
        f"{seeds[0]['seed']}:",
        "",
        "| step | " + " | ".join(LABELS[b] for b in BACKENDS) + " |",
        "|---:|" + "---:|" * len(BACKENDS),
    ]
    histories = [seeds[0]["runs"][b]["history"] for b in BACKENDS]
    for rows in zip(*histories):
        losses = " | ".join(f"{row['val_loss']:.4f}" for row in rows)
        lines.append(f"| {rows[0]['step']} | {losses} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help=f"the tinyshakespeare text (default: {DEFAULT_DATA})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2, 3])
    parser.add_argument("--jobs", type=int, default=2, help="seeds trained at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per job")
    parser.add_argument("--eval-iters", type=int, default=50)
    parser.add_argument("--chunk", type=int, default=250, help="updates per alternating chunk")
    parser.add_argument("--max-iters", type=int, default=2000)
    parser.add_argument("--draws", type=int, default=100,
                        help="independent draws of nanoGPT's 20-batch estimate per model")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_shakespeare")
    parser.add_argument("--nanogpt", type=Path, default=None,
                        help="a nanoGPT checkout (github.com/karpathy/nanoGPT) to run as the "
                             "yardstick; skipped without one")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the .md from the existing results .json, without training")
    args = parser.parse_args()
    report("shakespeare", args, run, markdown)


if __name__ == "__main__":
    main()
