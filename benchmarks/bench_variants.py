"""GPT-2 block, LLaMA block and mixtures of experts at equal size and compute; quantization.

    python benchmarks/bench_variants.py [--iters 250] [--seeds 1337 1] [--data PATH]

Four character-level models of 4 layers, 4 heads, width 64 and context 64, trained for the
same number of updates on the same batches (the seed fixes the batch order) by ``gptlab.training.train``
with the hand-written backward (``backend="torch"``, one thread):

- GPT-2 block: LayerNorm, GELU MLP of width 4C, learned positions, head tied to wte, biases.
- LLaMA block: RMSNorm, SwiGLU, rotary positions, grouped-query attention with n_head / 2
  key/value heads, no biases, an untied head (``GPTConfig.llama``'s wiring); the SwiGLU width
  is the one that brings the total parameter count closest to the GPT-2 model's.
- Mixture of experts, 4 and 8 experts, top-2 routing: the GPT-2 block with its MLP replaced by
  experts of width 2C, so a token's two experts have the dense MLP's 4C hidden units: equal
  *active* parameters per token (plus the router), and 2x and 4x the MLP's total parameters.

Parameters are counted two ways: total (``count_params``: every tensor, the tied head once) and
active per token (the total less the experts a token is not sent to). Training FLOPs per token
follow the 6N rule on the active parameters a token is multiplied by (the lookup-only tables,
wpe and an untied wte, left out); attention's scores add the same 6 L T C to every variant.

Each seed runs in its own process (``--jobs`` at once). Within it the four variants train in
alternating chunks of ``--chunk`` updates (each resumes exactly from its checkpoint), so a change
of machine load falls on all of them; tokens/s of a chunk = updates * batch * context / wall
time of the chunk, which includes the resume, one evaluation of ``--eval-iters`` batches per
split and the checkpoint write. Reported: the median over every chunk of every seed, and the
median of the paired ratios to the GPT-2 chunk of the same seed and round.

Memory: the bytes of the parameters, of their gradients and of AdamW's two moments, summed from
the tensors; and the activations a training step keeps for the backward (every tensor in the
forward's cache that is not a parameter, each storage once) for one batch. The transient peak
inside the backward is not measured.

Scores: every final model on the whole validation split (``gptlab.training.metrics.split_loss``: the
last 10% of the text, every token predicted once), cross-entropy only (a mixture's
load-balancing term is left out of the score). Then the trained GPT-2 model of the first seed
is quantized, its block matrices only (embeddings, biases and norms stay float32): 8, 4 and 3
bits, one scale per output channel or per group of 32 inputs, round to nearest or GPTQ
(calibrated on ``--calib`` training windows), each scored on the same split.

The default corpus is the embedded one (``gptlab.training.data``), so the script runs from a fresh clone;
``--data`` trains on a text file instead. Writes ``benchmarks/results/variants.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.training.checkpoint import load_run_checkpoint
from gptlab.training.data import get_batch, load_text, split_train_val
from gptlab.training.metrics import perplexity, split_loss
from gptlab.model import count_params, gpt_backward, gpt_forward, param_shapes
from gptlab.training.optim import AdamW
from gptlab.quant.model import gptq_quantize_params, quantize_params
from gptlab.tokenizers.char import CharTokenizer
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

ROOT = Path(__file__).resolve().parent.parent
N_LAYER, N_HEAD, N_EMBD, BLOCK_SIZE, BATCH_SIZE = 4, 4, 64, 64, 12
GPT2 = dict(norm="layernorm", mlp="gelu", position="learned", bias=True, tie_embeddings=True)
LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
             n_kv_head=N_HEAD // 2)
LABELS = {"gpt2": "GPT-2 block", "llama": "LLaMA block", "moe4": "MoE, 4 experts, top-2",
          "moe8": "MoE, 8 experts, top-2"}
QUANT_BITS, QUANT_GROUPS = (8, 4, 3), (None, 32)


def variants(vocab_size: int) -> dict[str, dict]:
    """Name -> the TrainConfig fields of each variant (see the module docstring)."""
    moe = dict(GPT2, mlp="moe", expert_top_k=2, mlp_hidden=2 * N_EMBD)
    gpt2_params = count_params(model_config(GPT2, vocab_size))
    llama_params = {hidden: count_params(model_config(dict(LLAMA, mlp_hidden=hidden), vocab_size))
                    for hidden in range(1, 8 * N_EMBD)}  # fmt: skip
    hidden = min(llama_params, key=lambda h: abs(llama_params[h] - gpt2_params))
    return {"gpt2": dict(GPT2), "llama": dict(LLAMA, mlp_hidden=hidden),
            "moe4": dict(moe, n_expert=4), "moe8": dict(moe, n_expert=8)}


def train_config(fields: dict, max_iters: int, eval_iters: int, out_dir: str, seed: int,
                 data: str | None = None) -> TrainConfig:
    """The shared recipe (TrainConfig's defaults: AdamW, lr 3e-3, cosine to 3e-4 after 20 warmup
    updates, weight decay 0.1, clipping at 1.0) with one variant's ``fields``."""
    return TrainConfig(n_layer=N_LAYER, n_head=N_HEAD, n_embd=N_EMBD, block_size=BLOCK_SIZE,
                       batch_size=BATCH_SIZE, dropout=0.0, backend="torch", dtype="float32",
                       data=data, max_iters=max_iters, lr_decay_iters=max_iters,
                       eval_interval=max_iters,
                       eval_iters=eval_iters, checkpoint_interval=0, out_dir=out_dir, seed=seed,
                       **fields)  # fmt: skip


def model_config(fields: dict, vocab_size: int):
    """The GPTConfig of a variant."""
    return train_config(fields, 1, 1, "", 0).model_config(vocab_size)


def sizes(cfg) -> dict:
    """Total and active parameters per token, and training FLOPs per token (6N on the active
    parameters a token is multiplied by: lookup-only tables left out)."""
    shapes = param_shapes(cfg)
    total = count_params(cfg)
    experts = sum(math.prod(s) for name, s in shapes.items() if ".mlp.experts." in name)
    idle = experts * (cfg.n_expert - cfg.expert_top_k) // cfg.n_expert if cfg.n_expert else 0
    lookup = math.prod(shapes.get("wpe.weight", (0,)))
    if not cfg.tie_embeddings:
        lookup += math.prod(shapes["wte.weight"])
    active = total - idle
    return {"total_params": total, "active_params": active,
            "train_flops_per_token": 6 * (active - lookup)}


def _tensors(obj):
    """Every torch tensor inside nested dicts, lists and tuples."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)


def memory(params: dict, cfg, x, y) -> dict:
    """Bytes of the parameters, gradients, AdamW moments and the forward's cache for x, y (B, T)."""
    _, _, cache = gpt_forward(params, x, cfg, y)
    weights = {p.untyped_storage().data_ptr() for p in params.values()}
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(cache)
            if t.untyped_storage().data_ptr() not in weights}  # fmt: skip
    grads = gpt_backward(cache)
    return {"params_bytes": sum(p.nbytes for p in params.values()),
            "grads_bytes": sum(g.nbytes for g in grads.values()),
            "adamw_bytes": sum(m.nbytes for m in AdamW(params).state.values()),
            "activations_bytes": sum(kept.values())}


def score(params: dict, cfg, val_ids: np.ndarray) -> float:
    """Cross-entropy on the whole validation split (a mixture's load-balancing term left out)."""
    return split_loss(params, replace(cfg, aux_loss_weight=0.0), val_ids, BLOCK_SIZE)


def run_seed(data: str | None, seed: int, fields: dict, iters: int, chunk: int, eval_iters: int,
             out_dir: Path, threads: int) -> dict:
    """Every variant for one seed, alternating chunks; their times, memory and scores."""
    torch.set_num_threads(threads)
    chunks = {name: [] for name in fields}
    results = {}
    for start in range(0, iters, chunk):
        stop = min(start + chunk, iters)
        for name, variant in fields.items():
            cfg = train_config(variant, iters, eval_iters, str(out_dir / f"seed{seed}" / name),
                               seed, data)  # fmt: skip
            cfg.max_iters, cfg.eval_interval, cfg.resume = stop, chunk, start > 0
            wall = time.perf_counter()
            results[name] = train(cfg, progress=False, overwrite=not cfg.resume)
            wall = time.perf_counter() - wall
            chunks[name].append({"steps": [start, stop], "wall_s": round(wall, 3),
                                 "tokens_per_s": (stop - start) * BATCH_SIZE * BLOCK_SIZE / wall})
        print(f"seed {seed} step {stop}: " + ", ".join(
            f"{name} {chunks[name][-1]['wall_s']:.1f} s" for name in fields), flush=True)
    first = next(iter(results.values()))
    ids = np.asarray(first.tokenizer.encode(load_text(data)), dtype=np.int64)
    train_ids, val_ids = split_train_val(ids, BLOCK_SIZE, 0.1)
    x, y = get_batch(train_ids, BATCH_SIZE, BLOCK_SIZE, np.random.default_rng(seed), "torch")
    return {"seed": seed, "val_tokens_scored": (len(val_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE,
            "runs": {name: {"val_loss": score(r.params, r.model_config, val_ids),
                            "train_wall_s": sum(c["wall_s"] for c in chunks[name]),
                            "chunks": chunks[name], **memory(r.params, r.model_config, x, y)}
                     for name, r in results.items()}}  # fmt: skip


def quantization_table(run_dir: Path, data: str | None, seed: int, n_calib: int) -> list[dict]:
    """The trained GPT-2 model of ``run_dir`` under every bits x grouping x method, scored."""
    ckpt = load_run_checkpoint(run_dir, backend="torch", dtype="float32")
    params, cfg = ckpt.params, ckpt.model_config
    ids = np.asarray(ckpt.tokenizer.encode(load_text(data)), dtype=np.int64)
    train_ids, val_ids = split_train_val(ids, BLOCK_SIZE, 0.1)
    calib, _ = get_batch(train_ids, n_calib, BLOCK_SIZE, np.random.default_rng([seed, 3]), "torch")
    baseline = score(params, cfg, val_ids)
    rows = [{"method": "float32", "bits": 32, "group_size": None, "val_loss": baseline,
             "perplexity": perplexity(baseline), "nbytes": sum(p.nbytes for p in params.values()),
             "bits_per_weight": 32.0}]
    methods = {"RTN": lambda bits, group: quantize_params(params, bits=bits, group_size=group),
               "GPTQ": lambda bits, group: gptq_quantize_params(params, cfg, calib, bits=bits,
                                                                group_size=group)}
    for bits in QUANT_BITS:
        for group in QUANT_GROUPS:
            for method, quantize in methods.items():
                wall = time.perf_counter()
                quantized, report = quantize(bits, group)
                wall = time.perf_counter() - wall
                loss = score(quantized, cfg, val_ids)
                rows.append({"method": method, "bits": bits, "group_size": group,
                             "val_loss": loss, "perplexity": perplexity(loss),
                             "nbytes": report.nbytes_after,
                             "bits_per_weight": report.bits_per_weight, "quantize_s": wall})
                print(f"{method} {bits} bits, group {group}: val {loss:.4f}", flush=True)
    return rows


def summary(seeds: list[dict], name: str) -> dict:
    """Mean and range of the validation loss over the seeds; median tokens/s and its paired ratio
    to the GPT-2 chunk of the same seed and round."""
    losses = [s["runs"][name]["val_loss"] for s in seeds]
    rates = [c["tokens_per_s"] for s in seeds for c in s["runs"][name]["chunks"]]
    ratios = [c["tokens_per_s"] / g["tokens_per_s"] for s in seeds
              for c, g in zip(s["runs"][name]["chunks"], s["runs"]["gpt2"]["chunks"])]
    return {"val_loss_mean": statistics.mean(losses), "val_loss_min": min(losses),
            "val_loss_max": max(losses), "tokens_per_s_median": statistics.median(rates),
            "tokens_per_s_ratio_to_gpt2_median": statistics.median(ratios)}


def run(args: argparse.Namespace) -> dict:
    data = None if args.data is None else str(args.data.resolve())
    text = load_text(data)
    vocab_size = CharTokenizer.from_text(text).vocab_size
    fields = variants(vocab_size)
    machine = machine_info(args.note, torch=torch.__version__, torch_threads=args.threads,
                           jobs=args.jobs)
    wall = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")  # a fresh interpreter per job, no forked torch
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=spawn) as pool:
        futures = [pool.submit(run_seed, data, seed, fields, args.iters, args.chunk,
                               args.eval_iters, args.out_dir, args.threads)
                   for seed in args.seeds]  # fmt: skip
        seeds = [future.result() for future in futures]
    machine["load_average_1min_after_training"] = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    quant = quantization_table(args.out_dir / f"seed{args.seeds[0]}" / "gpt2", data,
                               args.seeds[0], args.calib)
    machine["load_average_1min_at_end"] = os.getloadavg()[0]
    recipe = asdict(train_config({}, args.iters, args.eval_iters, str(args.out_dir), 0, data))
    for name in ("norm", "mlp", "position", "bias", "tie_embeddings", "n_kv_head", "mlp_hidden",
                 "n_expert", "expert_top_k", "seed"):
        recipe.pop(name)
    models = {name: {"fields": f, **sizes(model_config(f, vocab_size))}
              for name, f in fields.items()}
    return {
        "benchmark": "variants: GPT-2 block, LLaMA block, mixtures of experts; quantization",
        "machine": machine,
        "data": {"file": "embedded corpus" if data is None else args.data.name,
                 "characters": len(text), "vocab_size": vocab_size},
        "train_config": {**recipe, "seeds": list(args.seeds), "chunk": args.chunk},
        "attention_flops_per_token": 6 * N_LAYER * BLOCK_SIZE * N_EMBD,
        "models": models,
        "seeds": seeds,
        "summary": {name: summary(seeds, name) for name in fields},
        "quantization": {"model": f"GPT-2 block, seed {args.seeds[0]}", "calib_windows": args.calib,
                         "rows": quant},
        "total_wall_s": time.perf_counter() - wall,
    }


def markdown(res: dict) -> str:
    m, cfg, models, summ = res["machine"], res["train_config"], res["models"], res["summary"]
    seeds = res["seeds"]
    llama, moe = models["llama"]["fields"], models["moe4"]["fields"]
    lines = [
        "# GPT-2 block, LLaMA block and mixtures of experts; quantization",
        "",
        f"Generated by `python benchmarks/bench_variants.py` on {m['date']} in "
        f"{res['total_wall_s'] / 60:.1f} minutes. Data: {res['data']['file']}, "
        f"{res['data']['characters']:,} characters, vocabulary {res['data']['vocab_size']} "
        "characters, the last 10% for validation.",
        "",
        f"Every model: {N_LAYER} layers, {N_HEAD} heads, width {N_EMBD}, context {BLOCK_SIZE}, "
        f"batch {BATCH_SIZE}, {cfg['max_iters']} updates, AdamW (betas {cfg['betas'][0]}, "
        f"{cfg['betas'][1]}, weight decay {cfg['weight_decay']} on the matrices), learning "
        f"rate {cfg['lr']:g} with {cfg['warmup_iters']} warmup updates and cosine decay to "
        f"{cfg['min_lr']:g}, clipping at {cfg['grad_clip']}, no dropout, float32, the "
        "hand-written backward on torch. For a seed, every variant sees the same batches in the "
        f"same order. Seeds {', '.join(str(s) for s in cfg['seeds'])}.",
        "",
        "- **GPT-2 block**: LayerNorm, GELU MLP of width 4C = "
        f"{4 * N_EMBD}, learned positions, head tied to wte, biases.",
        f"- **LLaMA block**: RMSNorm (eps 1e-5, as GPT-2's LayerNorm), SwiGLU of width "
        f"{llama['mlp_hidden']} (the width that brings the total parameters closest to GPT-2's), "
        f"rotary positions, grouped-query attention with {llama['n_kv_head']} key/value heads "
        f"for {N_HEAD} query heads, no biases, untied head.",
        f"- **MoE**: the GPT-2 block with {moe['expert_top_k']} of 4 or 8 GELU experts of width "
        f"{moe['mlp_hidden']} per token, so the same active parameters per token as GPT-2 (plus "
        "the router and one bias) and more in total; the load-balancing loss (weight 0.01) adds "
        "to the training loss, not to the validation score.",
        "",
        "Equal parameters: GPT-2 and LLaMA (total). Equal compute: all four (the active "
        "parameters per token). Training FLOPs per token = 6 x the active parameters a token is "
        "multiplied by (wpe and LLaMA's untied wte are only looked up, so they are left out); "
        f"attention's scores add {res['attention_flops_per_token']:,} to every variant. Memory: "
        "parameters + gradients + AdamW's moments (float32, summed from the tensors), and the "
        f"activations one training step of {BATCH_SIZE} x {BLOCK_SIZE} tokens keeps for the "
        "backward (every non-parameter tensor of the forward's cache, each storage once); the "
        "transient peak inside the backward is not measured.",
        "",
        f"Validation loss: the whole split ({seeds[0]['val_tokens_scored']:,} predictions), "
        f"mean (min - max) over {len(seeds)} seeds. Tokens/s: each seed trains its variants in "
        f"alternating chunks of {cfg['chunk']} updates; a chunk's time includes the resume, "
        "one evaluation and the checkpoint write. Median over every chunk; ratio: median of "
        "the ratios to the GPT-2 chunk of the same seed and round.",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores ({m['cores_usable']} usable), shared with "
        f"other jobs; {m['jobs']} seeds trained at once, torch {m['torch_threads']} thread "
        f"each; {m['platform']}; Python {m['python']}, NumPy {m['numpy']}, torch {m['torch']}. "
        f"Load average (1 min): {m['load_average_1min_at_start']:.2f} at start, "
        f"{m['load_average_1min_after_training']:.2f} after training, "
        f"{m['load_average_1min_at_end']:.2f} at end." + (f" Note: {m['note']}" if m["note"] else ""),
        "",
        "| variant | total params | active params / token | training FLOPs / token | "
        "params + grads + AdamW (KiB) | activations (KiB) | val loss | tokens/s | vs GPT-2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, model in models.items():
        run, s = seeds[0]["runs"][name], summ[name]
        state = run["params_bytes"] + run["grads_bytes"] + run["adamw_bytes"]
        lines.append(
            f"| {LABELS[name]} | {model['total_params']:,} | {model['active_params']:,} | "
            f"{model['train_flops_per_token'] / 1e6:.2f} M | {state / 1024:,.0f} | "
            f"{run['activations_bytes'] / 1024:,.0f} | {s['val_loss_mean']:.4f} "
            f"({s['val_loss_min']:.4f} - {s['val_loss_max']:.4f}) | "
            f"{s['tokens_per_s_median']:,.0f} | {s['tokens_per_s_ratio_to_gpt2_median']:.2f}x |")
    lines += ["", "Validation loss per seed:", "",
              "| variant | " + " | ".join(f"seed {s['seed']}" for s in seeds) + " |",
              "|---|" + "---:|" * len(seeds)]
    lines += [f"| {LABELS[name]} | " + " | ".join(f"{s['runs'][name]['val_loss']:.4f}"
                                                   for s in seeds) + " |" for name in models]
    q = res["quantization"]
    lines += [
        "",
        f"## Quantization of the trained GPT-2 model (seed {cfg['seeds'][0]})",
        "",
        "The four matrices of every block, symmetric codes; embeddings, biases and LayerNorms "
        "stay float32 (bytes are of the whole model: codes, scales and the float tensors). "
        "RTN: round to nearest. GPTQ: block after block, calibrated on "
        f"{q['calib_windows']} training windows of {BLOCK_SIZE} characters. Bits per weight: of "
        "the quantized matrices, their float32 scales included; codes of 2 to 4 bits are stored "
        "two to a byte, so 3-bit codes take the bytes of 4-bit ones. Scored on the same "
        "validation split.",
        "",
        "| method | bits | scales | val loss | perplexity | bytes | bits / weight |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for row in q["rows"]:
        scales = "per channel" if row["group_size"] is None else f"group {row['group_size']}"
        lines.append(f"| {row['method']} | {row['bits']} | "
                     f"{'-' if row['method'] == 'float32' else scales} | {row['val_loss']:.4f} | "
                     f"{row['perplexity']:.3f} | {row['nbytes']:,} | "
                     f"{row['bits_per_weight']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=250, help="updates per model")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1337, 1])
    parser.add_argument("--data", type=Path, default=None,
                        help="a UTF-8 text file to train on (default: the embedded corpus)")
    parser.add_argument("--jobs", type=int, default=2, help="seeds trained at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per job")
    parser.add_argument("--chunk", type=int, default=50, help="updates per alternating chunk")
    parser.add_argument("--eval-iters", type=int, default=2,
                        help="batches per split in each chunk's evaluation")
    parser.add_argument("--calib", type=int, default=32, help="GPTQ's calibration windows")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "bench_variants")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the .md from the existing results .json, without training")
    args = parser.parse_args()
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    report("variants", args, run, markdown)


if __name__ == "__main__":
    main()
