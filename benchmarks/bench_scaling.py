"""A scaling-law sweep: validation loss against parameters at a fixed token budget.

    python benchmarks/bench_scaling.py [--iters 400] [--seeds 1337 1] [--jobs 2] [--data PATH]

Six character-level GPT-2 models (``SIZES``: 1 to 6 blocks, width 16 to 128, head size 16,
context 64) are trained by ``gptlab.training.train`` with the hand-written backward (``backend="torch"``,
float32, one thread per process) on the same token budget: ``--iters`` updates of 12 sequences
of 64 characters (400 x 768 = 307,200 tokens, under one pass over the embedded corpus's
training part), TrainConfig's recipe otherwise (AdamW, lr 3e-3, cosine to 3e-4 after 20 warmup
updates, weight decay 0.1, clipping at 1.0). Each final model is scored on the whole validation
split (``gptlab.training.metrics.split_loss``: every token of the last 10% predicted once).

Then ``gptlab.training.scaling.fit_power_law`` fits L(N) = (N_c / N)^alpha to the mean loss over seeds
against the non-embedding parameters N (Kaplan et al. 2020 find alpha_N = 0.076 for models
trained to convergence on WebText2 tokens), and the same with an irreducible term E; and the
training compute 6 N D of each run is set beside Chinchilla's compute-optimal split (Hoffmann et
al. 2022, D = 20 N), which is evaluated for GPT-3 too.

One process per (size, seed), ``--jobs`` at once. Writes ``benchmarks/results/scaling.json``
and ``.md``. About five minutes on two shared cores.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.training.data import load_text, split_train_val
from gptlab.training.metrics import split_loss
from gptlab.model import count_params
from gptlab.training.scaling import (
    GPT3_TRAIN_TOKENS,
    KAPLAN_ALPHA_N,
    architecture_params,
    chinchilla_optimal,
    fit_power_law,
    non_embedding_params,
    training_flops,
)
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

SIZES = ((1, 1, 16), (2, 2, 32), (2, 3, 48), (3, 4, 64), (4, 6, 96), (6, 8, 128))  # L, NH, C
BLOCK_SIZE, BATCH_SIZE = 64, 12


def sweep_config(n_layer: int, n_head: int, n_embd: int, *, iters: int, seed: int, out_dir: str,
                 data: str | None = None) -> TrainConfig:
    """The sweep's recipe for one size (the chapter reruns two of them with it)."""
    return TrainConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=BLOCK_SIZE,
                       batch_size=BATCH_SIZE, backend="torch", dtype="float32", threads=1,
                       data=data, max_iters=iters, eval_interval=iters, eval_iters=1,
                       checkpoint_interval=0, out_dir=out_dir, seed=seed)  # fmt: skip


def run_one(size: tuple, seed: int, iters: int, data: str | None) -> dict:
    """Train one size with one seed; its sizes, tokens, compute, wall time and validation loss."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = sweep_config(*size, iters=iters, seed=seed, out_dir=out_dir, data=data)
        wall = time.perf_counter()
        result = train(cfg, progress=False)
        wall = time.perf_counter() - wall
    model_cfg = result.model_config
    ids = np.asarray(result.tokenizer.encode(load_text(data)), dtype=np.int64)
    _, val_ids = split_train_val(ids, BLOCK_SIZE, cfg.val_fraction)
    n = non_embedding_params(model_cfg)
    tokens = iters * BATCH_SIZE * BLOCK_SIZE
    print(f"L={size[0]} C={size[2]} seed {seed}: {wall:.1f} s", flush=True)
    return {"n_layer": size[0], "n_head": size[1], "n_embd": size[2], "seed": seed,
            "params": count_params(model_cfg), "non_embedding_params": n, "tokens": tokens,
            "train_flops": training_flops(n, tokens), "wall_s": round(wall, 2),
            "val_loss": split_loss(result.params, model_cfg, val_ids, BLOCK_SIZE)}


def run(args) -> dict:
    machine = machine_info(f"{args.jobs} processes at once, one thread each",
                           torch=torch.__version__)
    jobs = [(size, seed) for size in SIZES for seed in args.seeds]
    with ProcessPoolExecutor(max_workers=args.jobs) as pool:
        runs = list(pool.map(run_one, *zip(*jobs), [args.iters] * len(jobs),
                             [args.data] * len(jobs)))
    n = [run["non_embedding_params"] for run in runs if run["seed"] == args.seeds[0]]
    loss = [float(np.mean([r["val_loss"] for r in runs if r["n_embd"] == size[2]]))
            for size in SIZES]
    gpt3_params = architecture_params(96, 12288)
    gpt3_flops = training_flops(gpt3_params, GPT3_TRAIN_TOKENS)
    machine["load_average_1min_at_end"] = os.getloadavg()[0]
    return {"machine": machine,
            "settings": {"iters": args.iters, "batch_size": BATCH_SIZE, "block_size": BLOCK_SIZE,
                         "seeds": args.seeds, "data": args.data or "embedded corpus"},
            "runs": runs, "non_embedding_params": n, "mean_val_loss": loss,
            "fit": fit_power_law(n, loss), "fit_irreducible": fit_power_law(n, loss,
                                                                            irreducible=True),
            "kaplan_alpha_n": KAPLAN_ALPHA_N,
            "gpt3": {"params": gpt3_params, "tokens": GPT3_TRAIN_TOKENS, "flops": gpt3_flops,
                     "chinchilla_tokens_for_its_params": 20 * gpt3_params,
                     "chinchilla_optimal_for_its_flops": chinchilla_optimal(gpt3_flops)}}


def _load(value) -> str:
    return "not recorded" if value is None else f"{value:.1f}"


def markdown(res: dict) -> str:
    fit, fit_e, gpt3 = res["fit"], res["fit_irreducible"], res["gpt3"]
    s = res["settings"]
    tokens = s["iters"] * s["batch_size"] * s["block_size"]
    lines = [f"# Scaling sweep: loss against parameters at {tokens:,} tokens", "",
             f"Character-level GPT-2 models on the {s['data']}, {s['iters']} updates of "
             f"{s['batch_size']} x {s['block_size']} tokens, seeds {s['seeds']}; validation loss "
             "(nats per character) on the whole validation split.", "",
             "| layers | heads | width | params | non-embedding N | 6ND (FLOPs) | val loss (mean) "
             "| per seed |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, n in enumerate(res["non_embedding_params"]):
        rows = [r for r in res["runs"] if r["non_embedding_params"] == n]
        per_seed = ", ".join(f"{r['val_loss']:.3f}" for r in rows)
        lines.append(f"| {rows[0]['n_layer']} | {rows[0]['n_head']} | {rows[0]['n_embd']} | "
                     f"{rows[0]['params']:,} | {n:,} | {rows[0]['train_flops']:.2e} | "
                     f"{res['mean_val_loss'][i]:.3f} | {per_seed} |")
    optimal = gpt3["chinchilla_optimal_for_its_flops"]
    lines += ["",
              f"Fit L(N) = (N_c / N)^alpha: alpha = {fit['alpha']:.3f}, N_c = {fit['n_c']:.3g}, "
              f"rms error of log L {fit['rmse']:.4f}. With an irreducible term, "
              f"L(N) = E + (N_c / N)^alpha: E = {fit_e['e']:.3f}, alpha = {fit_e['alpha']:.3f}, "
              f"N_c = {fit_e['n_c']:.3g}, rms error {fit_e['rmse']:.4f}. Kaplan et al. (2020): "
              f"alpha_N = {res['kaplan_alpha_n']} (BPE tokens of WebText2, models trained to "
              "convergence). The better fit (smaller error, one parameter more): "
              + ("with the irreducible term." if fit_e["rmse"] < fit["rmse"] else
                 "the pure power law."), "",
              f"Chinchilla's rule (D = 20 N) against GPT-3: {gpt3['params'] / 1e9:.1f}B "
              f"parameters would want {gpt3['chinchilla_tokens_for_its_params'] / 1e12:.2f}T "
              f"tokens (it saw {gpt3['tokens'] / 1e9:.0f}B); its {gpt3['flops']:.3g} FLOPs "
              f"would be spent best on {optimal['n_params'] / 1e9:.0f}B parameters and "
              f"{optimal['n_tokens'] / 1e12:.2f}T tokens.", "",
              "Each run: 6ND with N non-embedding; D/N ranges from "
              f"{min(r['tokens'] / r['non_embedding_params'] for r in res['runs']):.2g} to "
              f"{max(r['tokens'] / r['non_embedding_params'] for r in res['runs']):.2g} tokens "
              "per parameter.", "",
              f"Machine: {res['machine']['cpu']}, {res['machine']['cores']} cores, load "
              f"{_load(res['machine']['load_average_1min_at_start'])} at start and "
              f"{_load(res['machine']['load_average_1min_at_end'])} at the end (other jobs "
              f"shared the cores), {res['machine']['note']}; "
              f"torch {res['machine']['torch']}, {res['machine']['date']}. Wall time per run: "
              + ", ".join(f"{r['wall_s']:.0f} s" for r in res["runs"]) + ".", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--data", default=None)
    parser.add_argument("--markdown-only", action="store_true",
                        help="reload results/scaling.json and rewrite the table only")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    report("scaling", args, run, markdown)


if __name__ == "__main__":
    main()
