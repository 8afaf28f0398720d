"""Knowledge distillation: a small student taught by the chapter-11 model, against the same student
trained on the labels alone, at equal compute.

    python benchmarks/bench_distill.py [--iters 500] [--seeds 1337 1 2] [--jobs 2] [--data PATH]

The teacher is chapter 11's model: ``TrainConfig``'s defaults (4 layers, 4 heads, width 128,
context 64, batch 12, AdamW, lr 3e-3 with 20 warmup updates and cosine decay to 3e-4), 500
updates in float64 on the embedded corpus, seed 1337.

Every student has 2 layers, 2 heads, width 64 and the teacher's context and vocabulary, and
trains with the teacher's recipe for ``--iters`` updates, in float32, with the hand-written
backward on torch (one thread); the teacher runs in float32 for them too (its float64 weights
rounded). For a seed, every contender starts from the same initial
weights and sees the same batches in the same order (the seed fixes both): the same updates,
batch and tokens, so the same student compute; only the loss differs. The distilled students
also run the teacher's forward on every batch (about 1.5 times the student's own step here):
compute for the teacher is not counted, as in Hinton et al.

- labels only: ``gptlab.training.train`` (cross-entropy with the next character);
- distilled: ``gptlab.alignment.distill`` with alpha tau^2 KL(teacher || student) + (1 - alpha) CE at
  the (tau, alpha) settings of ``--settings``.

Scores: the final student's cross-entropy on the whole validation split
(``gptlab.training.metrics.split_loss``), and its agreement with the teacher on the first 256 windows
of that split (``gptlab.alignment.distill.agreement``: top-1 match and KL(teacher || student) at
temperature 1, 16,384 predictions); mean,
standard deviation and range over the seeds, and the paired difference to the labels-only
student of the same seed. Writes ``benchmarks/results/distill.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.backend import to_numpy
from gptlab.training.data import load_text, split_train_val
from gptlab.alignment.distill import agreement, distill
from gptlab.training.metrics import split_loss
from gptlab.model import count_params
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

ROOT = Path(__file__).resolve().parent.parent
TEACHER = dict(lr_decay_iters=500, eval_iters=10, dtype="float64", checkpoint_interval=0,
               threads=1)  # chapter 11's run, with max_iters=500
STUDENT = dict(n_layer=2, n_head=2, n_embd=64, eval_iters=2, dtype="float32",
               checkpoint_interval=0, threads=1)  # fmt: skip
AGREEMENT_WINDOWS = 256  # the first windows of the validation split, 16,384 predictions


def label(setting) -> str:
    """The name of a contender: None is labels only, (tau, alpha) a distilled student."""
    if setting is None:
        return "labels only"
    return f"distilled, tau {setting[0]:g}, alpha {setting[1]:g}"


def train_teacher(data: str | None, iters: int, out_dir: str):
    """Chapter 11's model (iters=500), trained in float64: (params cast to float32 NumPy, model
    config, tokenizer, float64 validation loss, seconds)."""
    start = time.perf_counter()
    cfg = TrainConfig(**TEACHER, max_iters=iters, eval_interval=iters, data=data, out_dir=out_dir)
    result = train(cfg, progress=False)
    seconds = time.perf_counter() - start
    params = {name: to_numpy(w).astype(np.float32) for name, w in result.params.items()}
    ids = np.asarray(result.tokenizer.encode(load_text(data)), dtype=np.int64)
    _, val_ids = split_train_val(ids, result.model_config.block_size)
    val = split_loss(result.params, result.model_config, val_ids, result.model_config.block_size)
    return params, result.model_config, result.tokenizer, val, seconds


def run_student(data, seed, iters, setting, teacher, out_dir) -> dict:
    """One student (``setting`` None: labels only; else (tau, alpha)), scored on validation."""
    teacher_params, teacher_cfg, tokenizer = teacher
    torch.set_num_threads(1)
    cfg = TrainConfig(**STUDENT, data=data, seed=seed, max_iters=iters, lr_decay_iters=iters,
                      eval_interval=iters, out_dir=out_dir)  # fmt: skip
    start = time.perf_counter()
    if setting is None:
        result = train(cfg, progress=False)
    else:
        result = distill(cfg, teacher_params, teacher_cfg, tokenizer, tau=setting[0],
                         alpha=setting[1], progress=False)  # fmt: skip
    seconds = time.perf_counter() - start
    ids = np.asarray(tokenizer.encode(load_text(data)), dtype=np.int64)
    _, val_ids = split_train_val(ids, cfg.block_size)
    val = split_loss(result.params, result.model_config, val_ids, cfg.block_size)
    agree = agreement(result.params, result.model_config, teacher_params, teacher_cfg,
                      val_ids[: AGREEMENT_WINDOWS * cfg.block_size + 1], cfg.block_size)
    return {"seed": seed, "setting": setting, "label": label(setting), "val_loss": val,
            "top1_agreement": agree["top1"], "kl_to_teacher": agree["kl"], "seconds": seconds,
            "params": count_params(result.model_config)}  # fmt: skip


def spread(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1
            else 0.0, "min": min(values), "max": max(values)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    info = machine_info(args.note, torch=torch.__version__)
    data = None if args.data is None else str(args.data)
    settings = [None, *[tuple(s) for s in args.settings]]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        teacher_params, teacher_cfg, tokenizer, teacher_val, teacher_seconds = train_teacher(
            data, args.teacher_iters, os.path.join(tmp, "teacher"))
        teacher = (teacher_params, teacher_cfg, tokenizer)
        jobs = [(data, seed, args.iters, setting, teacher, os.path.join(tmp, f"{seed}-{i}"))
                for seed in args.seeds for i, setting in enumerate(settings)]  # fmt: skip
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter per job
        with ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as pool:
            runs = list(pool.map(run_student, *zip(*jobs)))
    minutes = (time.perf_counter() - start) / 60
    info["load_average_1min_at_end"] = os.getloadavg()[0]
    baseline = {r["seed"]: r["val_loss"] for r in runs if r["setting"] is None}
    contenders = []
    for setting in settings:
        mine = [r for r in runs if r["setting"] == setting]
        contenders.append({
            "label": label(setting), "setting": setting,
            "val_loss": spread([r["val_loss"] for r in mine]),
            "minus_labels_only": spread([r["val_loss"] - baseline[r["seed"]] for r in mine]),
            "top1_agreement": spread([r["top1_agreement"] for r in mine]),
            "kl_to_teacher": spread([r["kl_to_teacher"] for r in mine]),
            "seconds": statistics.median(r["seconds"] for r in mine),
        })  # fmt: skip
    return {"machine": info, "minutes": minutes, "seeds": args.seeds, "iters": args.iters,
            "jobs": args.jobs, "data": data or "embedded corpus",
            "teacher": {"params": count_params(teacher_cfg), "val_loss": teacher_val,
                        "iters": args.teacher_iters,
                        "seconds": teacher_seconds, "vocab_size": teacher_cfg.vocab_size},
            "student_params": runs[0]["params"], "contenders": contenders, "runs": runs}


def _pm(s: dict, digits: int = 4) -> str:
    """mean ± std (min - max) of a ``spread``."""
    mean, std, low, high = (f"{s[k]:.{digits}f}" for k in ("mean", "std", "min", "max"))
    return f"{mean} ± {std} ({low} - {high})"


def markdown(res: dict) -> str:
    m, t = res["machine"], res["teacher"]
    seeds = ", ".join(str(s) for s in res["seeds"])
    lines = [
        "# Knowledge distillation: a student of the chapter-11 model vs labels only", "",
        f"Generated by `python benchmarks/bench_distill.py` on {m['date']} in "
        f"{res['minutes']:.1f} minutes. Data: {res['data']}, vocabulary {t['vocab_size']} "
        "characters, the last 10% for validation (every token of it scored once).", "",
        f"Teacher: chapter 11's model ({t['params']:,} parameters: 4 layers, 4 heads, width 128, "
        f"context 64), {t['iters']} updates of batch 12 in float64, seed 1337; validation loss "
        f"{t['val_loss']:.4f} nats per character.", "",
        f"Students ({res['student_params']:,} parameters: 2 layers, 2 heads, width 64, context "
        f"64): {res['iters']} updates of batch 12 with the teacher's recipe, float32 (the "
        "teacher's forward too), the hand-written backward on torch. For a seed, every student "
        "starts from the same weights and sees the same batches: equal updates, batch and "
        "tokens. The distilled students also run the teacher's forward on each batch (not "
        "counted). Seeds "
        f"{seeds}: mean ± standard deviation (min - max); 'vs labels only' is the paired "
        "difference to the labels-only student of the same seed (negative: better). Agreement: "
        "top-1 match and KL(teacher ‖ student) at temperature 1 on the first "
        f"{AGREEMENT_WINDOWS} validation windows ({AGREEMENT_WINDOWS * 64:,} predictions).", "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable); {res['jobs']} "
        f"students trained at once, torch 1 thread each; {m['platform']}; Python "
        f"{m['python']}, NumPy {m['numpy']}, torch {m['torch']}. Load average (1 min): "
        f"{m['load_average_1min_at_start']:.2f} at start, {m['load_average_1min_at_end']:.2f} "
        f"at end. {('Note: ' + m['note']) if m['note'] else ''}".rstrip(), "",
        "| student | val loss | vs labels only | top-1 agreement with the teacher | "
        "KL(teacher ‖ student) | seconds per run (median) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for c in res["contenders"]:
        lines.append(f"| {c['label']} | {_pm(c['val_loss'])} | {_pm(c['minus_labels_only'])} | "
                     f"{_pm(c['top1_agreement'], 3)} | {_pm(c['kl_to_teacher'])} | "
                     f"{c['seconds']:.0f} |")
    lines += ["", "Validation loss per seed:", "",
              "| student | " + " | ".join(f"seed {s}" for s in res["seeds"]) + " |",
              "|---|" + "---:|" * len(res["seeds"])]
    for c in res["contenders"]:
        per_seed = {r["seed"]: r["val_loss"] for r in res["runs"] if r["label"] == c["label"]}
        lines.append(f"| {c['label']} | " + " | ".join(f"{per_seed[s]:.4f}" for s in res["seeds"])
                     + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=500, help="updates per student")
    parser.add_argument("--teacher-iters", type=int, default=500,
                        help="updates of the teacher (chapter 11's: 500)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1, 2])
    parser.add_argument("--settings", type=float, nargs=2, action="append",
                        metavar=("TAU", "ALPHA"),
                        help="a distillation setting (repeat the option for several); default: "
                             "tau 2 alpha 0.5 and tau 1 alpha 1")
    parser.add_argument("--data", type=Path, default=None,
                        help="a UTF-8 text file; default: the embedded corpus")
    parser.add_argument("--jobs", type=int, default=2, help="students trained at once")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="reload results/distill.json and rewrite the Markdown only")
    args = parser.parse_args()
    args.settings = args.settings or [(2.0, 0.5), (1.0, 1.0)]
    report("distill", args, run, markdown)


if __name__ == "__main__":
    main()
