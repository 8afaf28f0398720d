"""Mixed precision and activation recomputation on the fused hand-written path: step time,
the recipe's loss curve, and the memory/time trade of recomputation over depth.

    python benchmarks/bench_precision.py [--quick] [--rounds 20] [--sizes recipe gpt2_width]
                                         [--iters 200] [--run-rounds 2] [--depths 2 4 8]
                                         [--note "..."]

Three parts, all on the CPU:
1. Step time: one training step through ``gptlab.fast.FastStep(cfg, precision)`` (training's
   default fused path) in float32, bfloat16 and float16 (dynamic loss scaling), mixed precision
   from float32 master weights (the compute copies and the float32 gradients included), at
   ``bench_step.py``'s sizes (the recipe, 1 thread; GPT-2 small's width, 2 threads).
   Interleaved rounds after a warm-up; the median step time, the median and quartiles of the
   per-round ratio to float32, peak bytes (``bench_memory.peak_bytes``), and the machine's
   matmul rate per dtype (a square ``mm`` of ``--peak-n``, ``bench_step.matmul_peak``).
2. The recipe's loss curve: nanoGPT's CPU recipe (``bench_shakespeare.recipe``: 4 layers,
   width 128, T 64, B 12, lr 1e-3, no biases, exact GELU) trained ``--iters`` updates with
   ``gptlab.training.train.train`` on the embedded corpus, 1 thread, seed 1337, in each precision: the
   validation loss every ``--iters // 5`` updates (10 batches, float32 forward on the master
   weights), the final weights' loss on the whole validation split, float16's skipped steps and
   its final loss scale, and the CPU and wall time of each run; ``--run-rounds`` rounds of the
   three runs interleaved, the median and range of the paired ratio to float32 (the issue's
   goal: bfloat16's run at most 0.5x of float32's CPU time).
3. Recomputation over depth: ``fast_loss_and_grads`` (float32) with ``recompute=False`` and
   ``True`` at the recipe's width for ``--depths`` layers, 1 thread: median step time, the
   median and quartiles of the paired time ratio recompute / plain, peak bytes and their ratio.

Writes ``benchmarks/results/precision.json`` and ``.md`` (``precision_quick.*`` with
``--quick``: 3 rounds, the recipe size only, 30 updates, depths 2 and 4; under two minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_memory import paired_times, peak_bytes  # benchmarks/bench_memory.py
from bench_shakespeare import recipe, validation_ids
from bench_step import SIZES, matmul_peak, model_flops, ratio_quartiles, size_inputs, spread
from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.training.checkpoint import read_state
from gptlab.fast import PRECISIONS, FastStep, fast_loss_and_grads
from gptlab.training.metrics import split_loss
from gptlab.training.train import train

BASELINE = "float32"
SEED = 1337
MiB = 2**20


def load() -> float:
    """The 1-minute load average now."""
    return os.getloadavg()[0]


def warm(steps: dict) -> dict:
    """Run each step once (warm-up); name -> its first result."""
    return {name: step() for name, step in steps.items()}


def timed_rows(steps: dict, baseline, rounds: int) -> dict:
    """name -> median seconds, the quartiles of the paired ratio to ``baseline``, peak bytes,
    per-round seconds; the steps interleaved ``rounds`` times after a warm-up."""
    seconds = paired_times(steps, rounds, "cpu")
    peaks = {name: peak_bytes(step, "cpu") for name, step in steps.items()}
    return {name: {"median_s": statistics.median(s),
                   "ratio_quartiles": ratio_quartiles(s, seconds[baseline]),
                   "peak_bytes": peaks[name], "seconds": s}
            for name, s in seconds.items()}  # fmt: skip


def step_times(name: str, args) -> dict:
    """Part 1 at one of bench_step's sizes: FastStep in each precision, and the matmul rates.
    A precision whose step would take over ``args.max_step_s`` at its measured matmul rate (the
    model's FLOPs / the rate) is skipped with that estimate as the reason."""
    size = SIZES[name]
    torch.set_num_threads(size["threads"])
    params, idx, targets, cfg = size_inputs(size, "cpu")
    rates = {p: matmul_peak(args.peak_n, "cpu", dtype=getattr(torch, p)) for p in PRECISIONS}
    fast_steps = {p: FastStep(cfg, p) for p in PRECISIONS}
    steps = {p: functools.partial(step, params, idx, targets) for p, step in fast_steps.items()}
    flops = model_flops(steps[BASELINE])
    skipped = {p: f"one step would take about {flops / rate:,.0f} s at the {rate / 1e9:.1f} "
                  f"GFLOP/s its matmul runs at here (over --max-step-s {args.max_step_s:g})"
               for p, rate in rates.items() if flops / rate > args.max_step_s}  # fmt: skip
    steps = {p: step for p, step in steps.items() if p not in skipped}
    losses = {p: loss for p, (loss, _) in warm(steps).items()}
    load_before = load()
    rows = timed_rows(steps, BASELINE, args.rounds)
    for p, row in rows.items():
        print(f"{name}: {p:9s} {1000 * row['median_s']:8.1f} ms  "
              f"x{row['ratio_quartiles'][1]:.3f} float32", flush=True)
    print(f"{name}: matmul GFLOP/s", {p: round(r / 1e9) for p, r in rates.items()},
          "skipped", skipped, flush=True)
    scaler = fast_steps["float16"].scaler
    return {"size": name, **size, "vocab": cfg.vocab_size, "model_flops_per_step": flops,
            "warm_up_loss": losses, "rows": rows, "skipped": skipped,
            "matmul_flops_per_s": rates, "float16_steps_skipped": scaler.skipped,
            "load_average_1min": [load_before, load()]}  # fmt: skip


def recipe_config(precision: str, iters: int, out_dir: Path):
    """bench_shakespeare's recipe on the embedded corpus at ``precision``, 1 thread."""
    cfg = recipe(None, "torch", out_dir, eval_iters=10, chunk=iters, seed=SEED)
    return dataclasses.replace(cfg, precision=precision, threads=1,
                               eval_interval=max(1, iters // 5), out_dir=str(out_dir / precision))


def recipe_run(precision: str, iters: int, out_dir: Path) -> dict:
    """One training run: CPU and wall seconds, the loss curve, the final whole-split val loss."""
    cfg = recipe_config(precision, iters, out_dir)
    cpu, wall = time.process_time(), time.perf_counter()
    result = train(cfg, progress=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    val_ids = validation_ids(result.tokenizer, None)
    return {"cpu_s": cpu, "wall_s": wall, "history": result.history,
            "val_split": split_loss(result.params, result.model_config, val_ids, cfg.block_size),
            "loss_scaler": read_state(result.out_dir)["loss_scaler"]}


def recipe_runs(args) -> dict:
    """Part 2: the recipe in each precision, ``--run-rounds`` rounds interleaved."""
    rounds = {p: [] for p in PRECISIONS}
    load_before = load()
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.run_rounds):
            for p in PRECISIONS:
                rounds[p].append(recipe_run(p, args.iters, Path(tmp) / f"round{r}"))
                print(f"recipe round {r}: {p:9s} CPU {rounds[p][-1]['cpu_s']:6.1f} s, val "
                      f"{rounds[p][-1]['val_split']:.4f}", flush=True)
    rows = {}
    for p, runs in rounds.items():
        cpu = [run["cpu_s"] for run in runs]
        ratios = [c / base["cpu_s"] for c, base in zip(cpu, rounds[BASELINE])]
        rows[p] = {**runs[0], "cpu_s": cpu, "wall_s": [run["wall_s"] for run in runs],
                   "cpu_ratio_median": statistics.median(ratios),
                   "cpu_ratio_range": [min(ratios), max(ratios)],
                   "same_loss_every_round": all(run["val_split"] == runs[0]["val_split"]
                                                for run in runs)}  # fmt: skip
    settings = dataclasses.asdict(recipe_config(BASELINE, args.iters, Path("runs")))
    return {"iters": args.iters, "rounds": args.run_rounds, "rows": rows,
            "settings": {k: settings[k] for k in ("n_layer", "n_head", "n_embd", "block_size",
                                                  "batch_size", "lr", "min_lr", "warmup_iters",
                                                  "lr_decay_iters", "eval_interval",
                                                  "eval_iters", "seed", "threads")},
            "load_average_1min": [load_before, load()]}  # fmt: skip


def recompute_depth(args) -> list[dict]:
    """Part 3: recompute=False / True at the recipe's width for each depth, 1 thread."""
    torch.set_num_threads(1)
    out = []
    for n_layer in args.depths:
        size = {**SIZES["recipe"], "n_layer": n_layer}
        inputs = size_inputs(size, "cpu")
        steps = {str(r): functools.partial(fast_loss_and_grads, *inputs, recompute=r)
                 for r in (False, True)}  # fmt: skip
        warm(steps)
        load_before = load()
        rows = timed_rows(steps, "False", args.rounds)
        recomputed, plain = rows["True"], rows["False"]
        out.append({"n_layer": n_layer, "plain": plain, "recompute": recomputed,
                    "peak_ratio": recomputed["peak_bytes"] / plain["peak_bytes"],
                    "load_average_1min": [load_before, load()]})  # fmt: skip
        print(f"recompute {n_layer} layers: time x{recomputed['ratio_quartiles'][1]:.3f}, "
              f"peak x{out[-1]['peak_ratio']:.3f}", flush=True)
    return out


def run(args) -> dict:
    machine = machine_info(args.note, torch=torch.__version__, device="cpu")
    cpuinfo = Path("/proc/cpuinfo")
    machine["bf16_instructions"] = cpuinfo.exists() and "avx512_bf16" in cpuinfo.read_text()
    res = {"machine": machine,
           "settings": {"rounds": args.rounds, "peak_n": args.peak_n, "quick": args.quick},
           "steps": [step_times(name, args) for name in args.sizes],
           "recipe": recipe_runs(args),
           "recompute": recompute_depth(args)}  # fmt: skip
    machine["load_average_1min_at_end"] = load()
    return res


def _loads(section: dict) -> str:
    a, b = section["load_average_1min"]
    return f"load {a:.1f} -> {b:.1f}"


def _range(values) -> str:
    return f"{min(values):.3f}-{max(values):.3f}"


def markdown(res: dict) -> str:
    m, s, rec = res["machine"], res["settings"], res["recipe"]
    lines = [
        "# Mixed precision and recomputation on the fused hand-written path", "",
        f"Measured {m['date']} on {m['cpu']} ({m['cores_usable']} usable cores, bfloat16 "
        f"instructions (avx512_bf16): {m['bf16_instructions']}, torch {m['torch']}, CPU); load "
        f"average {m['load_average_1min_at_start']:.1f} at start and "
        f"{m['load_average_1min_at_end']:.1f} at end. The machine is shared with other work "
        "and loaded: the times are noisy, which is why every contender runs interleaved with "
        "its baseline and the ratios are medians of paired rounds; the memory and the losses "
        f"do not depend on the load. {m['note']}", "",
        "## 1. One training step: float32, bfloat16, float16", "",
        "`gptlab.fast.FastStep(cfg, precision)`: float32 master weights, bfloat16 or float16 "
        "compute copies, float32 gradients (float16 with dynamic loss scaling); the model of "
        "`bench_step.py` (no biases, exact GELU). "
        f"{s['rounds']} interleaved rounds after a warm-up; time = median per step; ratio = "
        "median over rounds of the paired ratio to float32 (quartiles in brackets); peak = the "
        "most bytes torch held at once during one step (profiler allocation records). Matmul "
        f"rate: a {s['peak_n']}² `mm` at the size's threads, median of 5.", "",
    ]
    for r in res["steps"]:
        flops = r["matmul_flops_per_s"]
        lines += [
            f"### {r['size']}: {r['n_layer']} layers, width {r['n_embd']}, {r['n_head']} heads, "
            f"T {r['block_size']}, B {r['batch']}, V {r['vocab']}, {r['threads']} thread(s), "
            f"{_loads(r)}", "",
            f"Model FLOPs per step {r['model_flops_per_step'] / 1e9:.3f} G (FlopCounterMode).",
            "",
            "| precision | ms / step | / float32 | model GFLOP/s | peak MiB | peak / float32 | "
            "matmul GFLOP/s | matmul / float32 | warm-up loss |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p, row in r["rows"].items():
            lines.append(
                f"| {p} | {1000 * row['median_s']:,.1f} | {spread(row['ratio_quartiles'])} | "
                f"{r['model_flops_per_step'] / row['median_s'] / 1e9:,.1f} | "
                f"{row['peak_bytes'] / MiB:,.1f} | "
                f"{row['peak_bytes'] / r['rows'][BASELINE]['peak_bytes']:.3f} | "
                f"{flops[p] / 1e9:,.1f} | {flops[p] / flops[BASELINE]:.2f} | "
                f"{r['warm_up_loss'][p]:.4f} |")  # fmt: skip
        lines += [f"| {p} (skipped) | - | - | - | - | - | {flops[p] / 1e9:,.1f} | "
                  f"{flops[p] / flops[BASELINE]:.2f} | - |" for p in r["skipped"]]
        lines += [""] + [f"- skipped {p}: {why}." for p, why in r["skipped"].items()]
        if "float16" in r["rows"]:
            lines.append(f"- float16 steps skipped for overflow (the loss scaler starts at "
                         f"2^16): {r['float16_steps_skipped']}.")
        lines.append("")
    st = rec["settings"]
    evals = [h["step"] for h in rec["rows"][BASELINE]["history"]]
    lines += [
        f"## 2. The recipe's loss curve: {rec['iters']} updates, {_loads(rec)}", "",
        f"nanoGPT's CPU recipe ({st['n_layer']} layers, {st['n_head']} heads, width "
        f"{st['n_embd']}, T {st['block_size']}, B {st['batch_size']}, lr {st['lr']} with "
        f"{st['warmup_iters']} warmup updates and a cosine to {st['min_lr']} at "
        f"{st['lr_decay_iters']}, seed {st['seed']}, {st['threads']} thread) trained with "
        "`gptlab.training.train.train` on the embedded corpus in each precision. Validation loss: "
        f"{st['eval_iters']} batches at each evaluation (float32 forward on the master weights), "
        "and the final weights on the whole validation split. CPU time of the whole run "
        f"(evaluations included); {rec['rounds']} round(s) of the three runs interleaved, the "
        "ratio = median of the paired ratio to float32 (range in brackets).", "",
        "| precision | " + " | ".join(f"val @ {step}" for step in evals)
        + " | final val, whole split | CPU s | CPU / float32 | wall s | loss scaler |",
        "|---|" + "---:|" * (len(evals) + 5),
    ]
    for p, row in rec["rows"].items():
        scaler = row["loss_scaler"]
        scaler_text = ("-" if scaler is None else
                       f"scale {scaler['scale']:g}, {scaler['skipped']} skipped")
        lines.append(
            f"| {p} | " + " | ".join(f"{h['val_loss']:.4f}" for h in row["history"])
            + f" | {row['val_split']:.4f} | {statistics.median(row['cpu_s']):.1f} | "
            f"{row['cpu_ratio_median']:.3f} ({_range(row['cpu_ratio_range'])}) | "
            f"{statistics.median(row['wall_s']):.1f} | {scaler_text} |")  # fmt: skip
    same = all(row["same_loss_every_round"] for row in rec["rows"].values())
    lines += ["", f"Same final loss in every round (the runs are deterministic): {same}.", "",
              "## 3. Recomputation over depth (float32, the recipe's width, 1 thread)", "",
              "`fast_loss_and_grads(..., recompute=True)` keeps each block's input only and runs "
              "the block's forward again in the backward. Ratio = recompute / plain, paired per "
              "round (quartiles in brackets).", "",
              "| layers | plain ms | recompute ms | time ratio | plain peak MiB | "
              "recompute peak MiB | peak ratio | load |",
              "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in res["recompute"]:
        plain, again = r["plain"], r["recompute"]
        lines.append(
            f"| {r['n_layer']} | {1000 * plain['median_s']:,.1f} | "
            f"{1000 * again['median_s']:,.1f} | {spread(again['ratio_quartiles'])} | "
            f"{plain['peak_bytes'] / MiB:,.1f} | {again['peak_bytes'] / MiB:,.1f} | "
            f"{r['peak_ratio']:.3f} | {_loads(r)} |")  # fmt: skip
    return "\n".join(lines + [""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="3 rounds, the recipe size only, 30 updates, depths 2 and 4")
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of steps")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--iters", type=int, default=200, help="updates of each recipe run")
    parser.add_argument("--run-rounds", type=int, default=2,
                        help="rounds of the three recipe runs, interleaved")
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--peak-n", type=int, default=1024,
                        help="side of the square mm that measures each dtype's matmul rate")
    parser.add_argument("--max-step-s", type=float, default=10.0,
                        help="skip a precision whose step would take longer at its matmul rate")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the .md from the existing results .json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sizes, args.iters, args.run_rounds = 3, ["recipe"], 30, 1
        args.depths = [2, 4]
    report("precision" + ("_quick" if args.quick else ""), args, run, markdown)


if __name__ == "__main__":
    main()
