"""One training step (forward + backward): the hand-written backward against autograd and
idiomatic torch, time, peak memory and achieved FLOP/s.

    python benchmarks/bench_step.py [--quick] [--rounds 30] [--sizes recipe gpt2_width]
                                    [--no-compile] [--device cpu] [--note "..."]

Contenders, every one computing the loss and the gradient of every parameter of the same model
(the same params dict, float32, no dropout, no biases, the exact GELU, as nanoGPT's recipe):
- hand-written: ``gptlab.model.loss_and_grads`` on torch tensors (the book's layer functions);
- hand-written fused: ``gptlab.fast.fast_loss_and_grads`` (training's default path), called
  without ``buffers``, so its gradients are allocated inside the step as every other
  contender's (peak memory like for like);
- autograd: ``gptlab.reference.torch_gpt.reference_forward`` (torch ops, attention written out
  with ``masked_fill``) differentiated by ``torch.autograd.grad``;
- idiomatic torch: ``idiomatic_loss`` below, the model as one would write it in torch
  (``F.scaled_dot_product_attention``, ``F.layer_norm``, ``F.gelu``, ``F.linear``,
  ``F.cross_entropy``) differentiated by autograd;
- each of the first three again under ``torch.compile`` ("... compiled"; on CPU inductor needs
  a C compiler: without one, or when compilation fails, those contenders are skipped with the
  reason printed; ``--no-compile`` skips them on purpose).

Two sizes: ``recipe``, nanoGPT's CPU recipe for shakespeare_char (4 layers, 4 heads, width
128, context 64, batch 12, 65 characters), one torch thread; ``gpt2_width``, GPT-2 small's
width (768, 12 heads) at context 256, batch 4, 2 layers, the same 65-character vocabulary, two
threads.

Time: after a warm-up step each, the contenders run interleaved, one step each per round
(``--rounds``); reported are the median step time and the median over rounds of the paired
ratio contender / autograd (same round), and for the compiled hand-written paths the ratio to
autograd compiled (like for like). Peak memory: one step under ``torch.profiler`` with
``profile_memory=True`` on CPU, ``torch.cuda.max_memory_allocated`` on CUDA (``peak_bytes`` of
``bench_memory.py``), never RSS. FLOP/s: the model's FLOPs per step counted by
``torch.utils.flop_counter.FlopCounterMode`` over the autograd step (matmuls and attention,
forward and backward), divided by each contender's median time and by the machine's float32
matmul peak, measured here with the size's threads (a square ``mm`` of ``--peak-n``, median of
a few). Writes ``benchmarks/results/step.json`` and ``.md`` (``step_quick.*`` with ``--quick``,
``step_cuda.*`` with ``--device cuda``).
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from bench_memory import median_times, paired_times, peak_bytes  # benchmarks/bench_memory.py
from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.config import GPTConfig
from gptlab.fast import fast_loss_and_grads
from gptlab.model import gpt_backward, gpt_forward, init_params, loss_and_grads
from gptlab.reference.torch_gpt import reference_forward

VOCAB = 65  # tinyshakespeare's characters
SIZES = {
    "recipe": {"n_layer": 4, "n_head": 4, "n_embd": 128, "block_size": 64, "batch": 12,
               "threads": 1},
    "gpt2_width": {"n_layer": 2, "n_head": 12, "n_embd": 768, "block_size": 256, "batch": 4,
                   "threads": 2},
}  # fmt: skip
BASELINE, COMPILED_BASELINE = "autograd", "autograd compiled"
MiB = 2**20


def idiomatic_loss(params: dict, idx, targets, cfg: GPTConfig):
    """The same GPT as one writes it in torch: idx, targets (B, T) -> loss ()."""
    B, T = idx.shape
    C, NH = cfg.n_embd, cfg.n_head
    eps = cfg.layer_norm_epsilon
    x = F.embedding(idx, params["wte.weight"]) + params["wpe.weight"][:T]  # (B, T, C)
    for layer in range(cfg.n_layer):
        p = f"h.{layer}."
        h = F.layer_norm(x, (C,), params[p + "ln_1.weight"], None, eps)  # (B, T, C)
        q, k, v = (h @ params[p + "attn.c_attn.weight"]).split(C, dim=-1)  # (B, T, C) each
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))  # (B, NH, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, NH, T, hs)
        x = x + y.transpose(1, 2).reshape(B, T, C) @ params[p + "attn.c_proj.weight"]
        h = F.layer_norm(x, (C,), params[p + "ln_2.weight"], None, eps)  # (B, T, C)
        x = x + F.gelu(h @ params[p + "mlp.c_fc.weight"]) @ params[p + "mlp.c_proj.weight"]
    x = F.layer_norm(x, (C,), params["ln_f.weight"], None, eps)  # (B, T, C)
    logits = F.linear(x, params["wte.weight"])  # (B, T, V) the head tied to wte
    return F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))


def autograd_step(loss_fn):
    """loss_fn(params, idx, targets, cfg) -> loss ()  ==>  a step returning (loss, grads)."""

    def step(params, idx, targets, cfg):
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        loss = loss_fn(leaves, idx, targets, cfg)
        return loss.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))

    return step


def hand_written_step(params, idx, targets, cfg):
    """The hand-written forward and backward, the loss kept a tensor (no sync, compilable)."""
    _, loss, cache = gpt_forward(params, idx, cfg, targets)
    return loss, gpt_backward(cache)


def contenders(compile_reason: str | None) -> dict:
    """name -> step(params, idx, targets, cfg) -> (loss, grads); skipped ones printed."""
    steps = {
        "hand-written": loss_and_grads,
        BASELINE: autograd_step(lambda p, i, t, c: reference_forward(p, i, c, t)[1]),
        "idiomatic torch": autograd_step(idiomatic_loss),
        "hand-written fused": fast_loss_and_grads,
    }
    if compile_reason is not None:
        print(f"skipped the compiled contenders: {compile_reason}")
        return steps
    eager = {"hand-written compiled": hand_written_step, COMPILED_BASELINE: steps[BASELINE],
             "hand-written fused compiled": fast_loss_and_grads}
    return steps | {name: torch.compile(step) for name, step in eager.items()}


def compile_unavailable(device: str, no_compile: bool) -> str | None:
    """Why torch.compile cannot run here, or None."""
    if no_compile:
        return "--no-compile"
    if device == "cpu" and not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"),
                                                             "g++", "c++", "clang++")):
        return "no C++ compiler on PATH (inductor compiles CPU kernels with one)"
    return None


def matmul_peak(n: int, device: str, repeats: int = 5, dtype=torch.float32) -> float:
    """The machine's matmul rate in ``dtype`` in FLOP/s: the median time of an (n, n) @ (n, n)."""
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))

    def mm():
        return a @ b

    return 2 * n**3 / median_times({"mm": mm}, repeats, device)["mm"]


def model_flops(step) -> int:
    """FLOPs of ``step()`` as torch.utils.flop_counter counts them (matmuls, attention)."""
    with FlopCounterMode(display=False) as counter:
        step()
    return counter.get_total_flops()


def ratio_quartiles(a: list, b: list) -> tuple[float, float, float]:
    """Quartiles (25%, median, 75%) of the per-round ratios a[i] / b[i]."""
    return tuple(statistics.quantiles([x / y for x, y in zip(a, b)], n=4, method="inclusive"))


def size_inputs(size: dict, device: str) -> tuple:
    """(params, idx, targets, cfg) of one of SIZES: float32 weights, a random batch, seed 1337."""
    cfg = GPTConfig(n_layer=size["n_layer"], n_head=size["n_head"], n_embd=size["n_embd"],
                    vocab_size=VOCAB, block_size=size["block_size"], gelu="erf", bias=False)
    params = init_params(cfg, seed=1337, backend="torch", dtype="float32", device=device)
    gen = torch.Generator().manual_seed(1337)
    idx, targets = (torch.randint(0, VOCAB, (size["batch"], size["block_size"]),
                                  generator=gen).to(device) for _ in range(2))
    return params, idx, targets, cfg


def measure_size(name: str, size: dict, args) -> dict:
    """Time, ratios, peak memory and FLOP/s of every contender at one size."""
    torch.set_num_threads(size["threads"])
    inputs = size_inputs(size, args.device)
    idx = inputs[1]
    steps, skipped, losses = {}, {}, {}
    for contender, step in contenders(compile_unavailable(args.device, args.no_compile)).items():
        try:
            start = time.perf_counter()
            losses[contender] = float(step(*inputs)[0])  # warm-up; compiles the compiled ones
            print(f"{name}: {contender} warm-up {time.perf_counter() - start:.1f} s", flush=True)
            steps[contender] = functools.partial(step, *inputs)
        except Exception as e:  # noqa: BLE001 (a failed compilation skips the contender)
            skipped[contender] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"skipped {contender}: {skipped[contender]}", flush=True)
    flops = model_flops(steps[BASELINE])
    peak = matmul_peak(args.peak_n, args.device)
    seconds = paired_times(steps, args.rounds, args.device)
    peaks = {c: peak_bytes(step, args.device) for c, step in steps.items()}
    rows = {}
    for c, s in seconds.items():
        t = statistics.median(s)
        like = COMPILED_BASELINE if "compiled" in c and COMPILED_BASELINE in seconds else BASELINE
        rows[c] = {"median_s": t, "ratio_to_autograd": ratio_quartiles(s, seconds[BASELINE])[1],
                   "like_for_like": like,
                   "ratio_like_for_like": ratio_quartiles(s, seconds[like])[1],
                   "peak_bytes": peaks.get(c), "flops_per_s": flops / t,
                   "tokens_per_s": idx.numel() / t, "seconds": s}  # fmt: skip
        print(f"{name}: {c:28s} {1000 * t:8.1f} ms  x{rows[c]['ratio_to_autograd']:.3f} autograd"
              f"  {flops / t / peak:.1%} of peak", flush=True)
    return {"size": name, **size, "vocab": VOCAB, "model_flops_per_step": flops, "losses": losses,
            "matmul_peak_flops_per_s": peak, "contenders": rows, "skipped": skipped}


def run(args) -> dict:
    machine = machine_info(args.note, torch=torch.__version__, device=args.device)
    if args.device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    rows = [measure_size(name, SIZES[name], args) for name in args.sizes]
    machine["load_average_1min_at_end"] = os.getloadavg()[0]
    return {"machine": machine, "settings": {"rounds": args.rounds, "peak_n": args.peak_n,
                                             "dtype": "float32"}, "sizes": rows}


def spread(quartiles) -> str:
    """'median (25%-75%)'."""
    return f"{quartiles[1]:.3f} ({quartiles[0]:.2f}-{quartiles[2]:.2f})"


def markdown(res: dict) -> str:
    m, s = res["machine"], res["settings"]
    where = m.get("gpu", m["cpu"])
    lines = [
        "# One training step: hand-written backward, autograd, idiomatic torch", "",
        f"Measured {m['date']} on {where} ({m['cores_usable']} usable cores, torch {m['torch']}, "
        f"device {m['device']}); load average {m['load_average_1min_at_start']:.1f} at start and "
        f"{m['load_average_1min_at_end']:.1f} at end. {m['note']}", "",
        f"float32; {s['rounds']} interleaved rounds of one step per contender after a warm-up; "
        "time = median per step; ratio = median over rounds of the paired ratio (same round) to "
        "autograd eager, and to the like-for-like contender (autograd compiled for compiled "
        "paths), with the quartiles of the per-round ratios in brackets. Peak = the most bytes "
        "torch held at once during one step (CPU: profiler "
        "allocation records). FLOP/s = the model's FLOPs "
        "per step (FlopCounterMode over the autograd step) / time; % of the float32 matmul peak "
        f"measured here ({s['peak_n']}² mm).", "",
    ]
    for r in res["sizes"]:
        lines += [
            f"## {r['size']}: {r['n_layer']} layers, width {r['n_embd']}, {r['n_head']} heads, "
            f"T {r['block_size']}, B {r['batch']}, V {r['vocab']}, {r['threads']} thread(s)", "",
            f"Model FLOPs per step {r['model_flops_per_step'] / 1e9:.3f} G; matmul peak "
            f"{r['matmul_peak_flops_per_s'] / 1e9:.0f} GFLOP/s. Loss of the warm-up step (the "
            "same model and batch for all): "
            + ", ".join(f"{c} {loss:.6f}" for c, loss in r["losses"].items()) + ".", "",
            "| contender | ms / step | / autograd | / like for like | peak MiB | peak / autograd | "
            "GFLOP/s | % of peak | tokens/s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rounds = {c: row["seconds"] for c, row in r["contenders"].items()}
        for c, row in r["contenders"].items():
            to_autograd = ratio_quartiles(rounds[c], rounds[BASELINE])
            to_like = ratio_quartiles(rounds[c], rounds[row["like_for_like"]])
            lines.append(
                f"| {c} | {1000 * row['median_s']:,.1f} | {spread(to_autograd)} | "
                f"{spread(to_like)} {row['like_for_like']} | "
                f"{row['peak_bytes'] / MiB:,.1f} | "
                f"{row['peak_bytes'] / r['contenders'][BASELINE]['peak_bytes']:.3f} | "
                f"{row['flops_per_s'] / 1e9:,.1f} | "
                f"{row['flops_per_s'] / r['matmul_peak_flops_per_s']:.1%} | "
                f"{row['tokens_per_s']:,.0f} |")  # fmt: skip
        lines += [f"- skipped {c}: {why}" for c, why in r["skipped"].items()] + [""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 3 rounds, the recipe size only, a small peak mm")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--peak-n", type=int, default=None,
                        help="side of the peak's matmul (default 2048 on CPU, 8192 on CUDA)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the .md from the existing results .json")
    args = parser.parse_args()
    if args.peak_n is None:
        args.peak_n = 8192 if args.device == "cuda" else 2048
    if args.quick:
        args.rounds, args.sizes, args.peak_n = 3, ["recipe"], args.peak_n // 2
    name = "step" + ("_quick" if args.quick else "") + ("_cuda" if args.device == "cuda" else "")
    report(name, args, run, markdown)


if __name__ == "__main__":
    main()
