"""GPT-2 124M on one GPU: the hand-written backward as Triton kernels against torch's paths and
nanoGPT's own model, and the flash kernel alone against F.scaled_dot_product_attention.

    python benchmarks/bench_gpu.py [--nanogpt DIR] [--batch 8] [--rounds 10] [--note "..."]

Needs a CUDA device: without one it says so and exits 0, measuring nothing.

1. One training step (forward + backward, every parameter's gradient) of GPT-2 124M: 12 layers,
   width 768, 12 heads, vocabulary 50,304, context 1024, no biases, the exact GELU; ``--batch``
   sequences of random ids. Contenders, each in bfloat16 (float32 master weights; nanoGPT: bf16
   autocast) and in float32 (TF32 matmuls on for everyone):
   - gptlab Triton: ``FastStep(kernels="triton")``, the kernels of ``gptlab/kernels``;
   - gptlab Triton, CUDA graph: ``GraphStep`` over ``FlatParams``, the same step replayed as
     one CUDA graph;
   - gptlab torch ops: ``FastStep(kernels="torch")``, the fused path of chapter 14;
   - gptlab readable (float32 only): ``gptlab.model.loss_and_grads``, the layer functions;
   - autograd (float32 only): ``gptlab.reference`` differentiated by ``torch.autograd.grad``;
   - nanoGPT eager and nanoGPT compiled: ``model.py`` of the checkout ``--nanogpt DIR``
     (skipped without it), ``loss.backward()``, the second under ``torch.compile``.
   Time: a warm-up, then the contenders interleaved one step per round, ``--rounds``; the median
   per contender. MFU: nanoGPT's count of the model's FLOPs per token (6 N + 12 L T C, N the
   parameters without the position table) times the tokens, over the step time, over the bf16
   matmul peak measured in the same run (the median of a few 8192^3 ``mm``). Peak memory:
   ``torch.cuda.max_memory_allocated`` during one step, above what was allocated before.
2. Causal attention alone, forward + backward, 12 heads of 64, bf16, T = 1k to 16k (batch
   16k / T): the flash kernel against ``F.scaled_dot_product_attention`` (cuDNN's or
   FlashAttention's kernel) with autograd, ms and peak memory.
3. The char recipe end to end, each run its own process, wall time and final validation loss:
   6 layers, 6 heads, width 384, context 256, batch 64, 300 updates (learning rate 1e-3, 100
   warmup steps, cosine to 1e-4, betas 0.9/0.99), no biases, exact GELU, no dropout (the fused
   path has none), on the text ``--data`` (tinyshakespeare), one evaluation of 200 batches per
   split at the start and at the end: ``python -m gptlab train --device cuda`` with the Triton
   kernels, the torch ops and in float32, against nanoGPT's own ``prepare.py`` and ``train.py``
   (its ``train_shakespeare_char`` config with the same overrides, compiled as it defaults to,
   and eager), run in a scratch copy of ``--nanogpt DIR``.

4. Generation, GPT-2 124M as released (biases, tanh GELU, vocabulary 50,257) with random
   weights, greedy, batch 1, an 8-token prompt and 256 new tokens, in float32 and bfloat16:
   ``generate`` with its KV cache, the ``StaticDecoder`` eager and as a CUDA graph, against
   Hugging Face's ``GPT2LMHeadModel.generate`` on the same weights (``gptlab.interop.to_hf``;
   skipped when transformers does not import). Tokens per second of the whole call (the prompt
   included), median of ``--generate-rounds`` interleaved rounds after a warm-up, and whether the
   ids equal ``generate``'s.

5. The whole update of the step part's model and batch (``--parts update``): forward, backward,
   the gradients clipped to norm 1, AdamW (lr 6e-4, weight decay 0.1 on the matrices): gptlab
   Triton with torch-ops ``AdamW`` (one update per tensor), with the fused AdamW (``FlatStep``,
   ``FusedAdamW``: one launch), and with the fused AdamW after a CUDA graph (``GraphStep``),
   against nanoGPT eager and compiled with ``torch.optim.AdamW(fused=True)`` and
   ``clip_grad_norm_``, as its train.py steps.

6. Where the GPU's time goes (``--parts profile``): torch's profiler over ``--profile-steps``
   steps of the step part's bfloat16 contenders gptlab Triton (eager and as a CUDA graph) and
   nanoGPT compiled, after a warm-up: the wall time and the GPU's busy time per step (the sum of
   its kernels' times), that time by kind of kernel (matrix products, attention, gptlab's Triton
   kernels, inductor's, torch's own, copies and fills) and the kernels that take the most.

A contender that fails (a kernel that does not compile on this GPU, say) is reported with its
error and left out of the tables, instead of ending the run. ``--parts`` runs a subset.

Writes ``benchmarks/results/gpu.json`` and ``gpu.md`` with the machine and versions.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_memory import paired_times, peak_bytes  # benchmarks/bench_memory.py
from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.config import GPTConfig
from gptlab.fast import FastStep, FlatParams, FlatStep, GraphStep
from gptlab.model import init_params, loss_and_grads
from gptlab.reference.torch_gpt import reference_forward
from gptlab.training.optim import AdamW, FusedAdamW, matrices_only
from gptlab.training.parallel.base import clipped_grads
from gptlab.training.steps import OneProcess

GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, bias=False,
            gelu="erf")  # fmt: skip
ATTENTION_T = (1024, 2048, 4096, 8192, 16384)
GiB = 2**30
PARTS = ("step", "attention", "char", "generate", "update", "profile")
PROFILED = ("gptlab triton", "gptlab triton, CUDA graph", "nanoGPT compiled")  # bfloat16
TOP_KERNELS = 12
GPT2_RELEASED = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50257, block_size=1024)
NEW_TOKENS = 256
CHAR = dict(n_layer=6, n_head=6, n_embd=384, block_size=256, batch_size=64, max_iters=300,
            learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, beta2=0.99, eval_iters=200)
# (who, kernels or compile, precision), in the order they run
CHAR_RUNS = (("gptlab", "triton", "bfloat16"), ("nanoGPT", "compiled", "bfloat16"),
             ("gptlab", "triton, CUDA graph", "bfloat16"),
             ("gptlab", "torch", "bfloat16"), ("nanoGPT", "eager", "bfloat16"),
             ("gptlab", "triton", "float32"), ("nanoGPT", "eager", "float32"))
DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "tinyshakespeare.txt"


def working(steps: dict, failures: list, label: str) -> dict:
    """The contenders of ``steps`` that run once without an error; each failure is printed and
    appended to ``failures`` as (label, name, the error's last line)."""
    kept = {}
    for name, step in steps.items():
        try:
            step()
            kept[name] = step
        except Exception as error:  # noqa: BLE001 (any failure is reported, not hidden)
            traceback.print_exc()
            failures.append({"where": label, "contender": name,
                             "error": f"{type(error).__name__}: {error}".splitlines()[0][:300]})
    return kept


def matmul_peak_tflops(n: int = 8192, repeats: int = 5) -> float:
    """The bf16 matmul rate this GPU reaches: the best of a few (n, n) @ (n, n) products."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = paired_times({"mm": lambda: a @ b}, repeats + 1, "cuda")["mm"][1:]
    return 2 * n**3 / min(seconds) / 1e12


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """nanoGPT's estimate (PaLM's appendix B): 6 N + 12 L T C, forward and backward."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def model_and_batch(cfg: GPTConfig, batch: int):
    """The step, update and profile parts' inputs: float32 parameters on CUDA (seed 0) and a
    batch of random ids and targets (batch, block_size)."""
    params = init_params(cfg, seed=0, backend="torch", dtype="float32", device="cuda")
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx, targets = (torch.randint(0, cfg.vocab_size, (batch, cfg.block_size),
                                  generator=gen).cuda() for _ in range(2))  # fmt: skip
    return params, idx, targets


def gptlab_steps(cfg, params, idx, targets, precision: str) -> dict:
    """name -> a function running one forward + backward of a gptlab path."""
    steps = {f"gptlab {kernels}": FastStep(cfg, precision, kernels=kernels)
             for kernels in ("triton", "torch")}  # fmt: skip
    steps = {name: (lambda step=step: step(params, idx, targets)) for name, step in steps.items()}
    flat, graph = FlatParams(params, precision, decayed=matrices_only), GraphStep(cfg, precision)
    steps["gptlab triton, CUDA graph"] = lambda: graph(flat, idx, targets)
    if precision == "float32":
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        steps["gptlab readable"] = lambda: loss_and_grads(params, idx, targets, cfg)
        steps["autograd over gptlab.reference"] = lambda: torch.autograd.grad(
            reference_forward(leaves, idx, cfg, targets)[1], list(leaves.values()))
    return steps


def nanogpt_model(checkout: Path):
    """nanoGPT's model module from the checkout, and its GPTConfig of the step part's model."""
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    nano = importlib.import_module("model")
    config = nano.GPTConfig(**{k: GPT2[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                    "block_size", "bias")}, dropout=0.0)
    return nano, config


def nanogpt_steps(checkout: Path | None, idx, targets, precision: str) -> dict:
    """nanoGPT's model.py, eager and compiled, as its train.py runs it (bf16: autocast)."""
    if checkout is None:
        return {}
    nano, config = nanogpt_model(checkout)
    model = nano.GPT(config).cuda()
    compiled = torch.compile(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bfloat16")

    def step(module):
        module.zero_grad(set_to_none=True)
        with autocast:
            _, loss = module(idx, targets)
        loss.backward()

    return {"nanoGPT eager": lambda: step(model), "nanoGPT compiled": lambda: step(compiled)}


def run_steps(args, cfg, peak: float, failures: list) -> list[dict]:
    params, idx, targets = model_and_batch(cfg, args.batch)
    n_params = sum(p.numel() for name, p in params.items() if name != "wpe.weight")
    tokens = args.batch * cfg.block_size
    rows = []
    for precision in args.precisions:
        steps = {**gptlab_steps(cfg, params, idx, targets, precision),
                 **nanogpt_steps(args.nanogpt, idx, targets, precision)}  # fmt: skip
        steps = working(steps, failures, precision)  # first calls compile (Triton, torch.compile)
        paired_times(steps, 1, "cuda")  # warm-up
        memory = {name: peak_bytes(step, "cuda") for name, step in steps.items()}
        seconds = paired_times(steps, args.rounds, "cuda")
        for name, times in seconds.items():
            median = statistics.median(times)
            rows.append({"precision": precision, "contender": name, "ms": 1e3 * median,
                         "tokens_per_s": tokens / median,
                         "tflops": flops_per_token(cfg, n_params) * tokens / median / 1e12,
                         "mfu": flops_per_token(cfg, n_params) * tokens / median / 1e12 / peak,
                         "peak_gib": memory[name] / GiB})
        print(f"{precision}: done", flush=True)
    return rows


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel, by its name."""
    low = name.lower()
    if any(word in low for word in ("gemm", "xmma", "cutlass", "cublas", "nvjet")):
        return "matrix products"
    if any(word in low for word in ("flash", "fmha", "sdpa", "attention")):
        return "attention"
    if low.startswith("triton_"):
        return "inductor's Triton kernels"
    if low.startswith("_"):
        return "gptlab's Triton kernels"
    if any(word in low for word in ("memcpy", "memset", "copy", "fill")):
        return "copies and fills"
    return "torch's element-wise and reductions"


def gpu_profile(step, steps: int) -> dict:
    """Wall ms per ``step()`` under the profiler, the GPU's busy ms per step (its kernels' time
    summed), and name -> ms per step of each kernel."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    kernels = {event.key: event.self_device_time_total / 1e3 / steps
               for event in prof.key_averages() if event.self_device_time_total > 0}  # fmt: skip
    return {"wall_ms": 1e3 * wall / steps, "gpu_ms": sum(kernels.values()), "kernels": kernels}


def run_profile(args, cfg, failures: list) -> list[dict]:
    params, idx, targets = model_and_batch(cfg, args.batch)
    steps = {**gptlab_steps(cfg, params, idx, targets, "bfloat16"),
             **nanogpt_steps(args.nanogpt, idx, targets, "bfloat16")}  # fmt: skip
    steps = working({name: steps[name] for name in PROFILED if name in steps}, failures,
                    "profile")  # fmt: skip
    paired_times(steps, 2, "cuda")  # warm-up
    rows = []
    for name, step in steps.items():
        measured = gpu_profile(step, args.profile_steps)
        kinds = {}
        for kernel, ms in measured["kernels"].items():
            kinds[kernel_kind(kernel)] = kinds.get(kernel_kind(kernel), 0.0) + ms
        top = sorted(measured["kernels"].items(), key=lambda item: -item[1])[:TOP_KERNELS]
        rows.append({"contender": name, "wall_ms": measured["wall_ms"],
                     "gpu_ms": measured["gpu_ms"], "kinds": kinds, "top": top})
        print(f"profile {name}: {measured['wall_ms']:.1f} ms wall, {measured['gpu_ms']:.1f} ms "
              "GPU", flush=True)
    return rows


def gptlab_updates(cfg, params, idx, targets, precision: str) -> dict:
    """name -> one whole update of a gptlab run: forward, backward, clip to 1, AdamW."""
    plain = {name: p.clone() for name, p in params.items()}
    eager = FastStep(cfg, precision, kernels="triton")
    plain_mode = OneProcess(plain, lambda p, x, y, seed: eager(p, x, y))
    plain_adamw = AdamW(plain, lr=6e-4)
    updates = {}

    def torch_ops_adamw():
        _, grads, _ = clipped_grads(plain_mode, idx, targets, 1.0)
        plain_mode.params = plain_adamw.step(plain_mode.params, grads)

    updates["gptlab triton + AdamW in torch ops"] = torch_ops_adamw
    for name, step_class in (("gptlab triton + fused AdamW", FlatStep),
                             ("gptlab triton, CUDA graph + fused AdamW", GraphStep)):
        flat = FlatParams(params, precision, decayed=matrices_only)
        step = step_class(cfg, precision, kernels="triton")
        mode = OneProcess(flat, lambda p, x, y, seed, step=step: step(p, x, y))

        def fused_adamw(mode=mode, adamw=FusedAdamW(flat, lr=6e-4)):
            _, grads, _ = clipped_grads(mode, idx, targets, 1.0)
            adamw.step(mode.params, grads)

        updates[name] = fused_adamw
    return updates


def nanogpt_updates(checkout: Path | None, idx, targets, precision: str) -> dict:
    """nanoGPT's train.py step: autocast forward, backward, clip_grad_norm_(1.0), fused AdamW."""
    if checkout is None:
        return {}
    nano, config = nanogpt_model(checkout)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bfloat16")
    updates = {}
    for name, compiled in (("nanoGPT eager", False), ("nanoGPT compiled", True)):
        model = nano.GPT(config).cuda()
        adamw = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), "cuda")  # fused on CUDA
        module = torch.compile(model) if compiled else model

        def update(module=module, model=model, adamw=adamw):
            with autocast:
                _, loss = module(idx, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            adamw.step()
            adamw.zero_grad(set_to_none=True)

        updates[name + " + fused AdamW"] = update
    return updates


def run_updates(args, cfg, failures: list) -> list[dict]:
    params, idx, targets = model_and_batch(cfg, args.batch)
    rows = []
    for precision in args.precisions:
        updates = {**gptlab_updates(cfg, params, idx, targets, precision),
                   **nanogpt_updates(args.nanogpt, idx, targets, precision)}  # fmt: skip
        updates = working(updates, failures, f"update {precision}")
        paired_times(updates, 2, "cuda")  # warm-up (nanoGPT compiled's recompiles included)
        seconds = paired_times(updates, args.rounds, "cuda")
        for name, times in seconds.items():
            median = statistics.median(times)
            rows.append({"precision": precision, "contender": name, "ms": 1e3 * median,
                         "tokens_per_s": args.batch * cfg.block_size / median})
        print(f"update {precision}: done", flush=True)
    return rows


def run_attention(failures: list) -> list[dict]:
    from gptlab.kernels.flash_attention import flash_attention_backward, flash_attention_forward

    rows = []
    for T in ATTENTION_T:
        gen = torch.Generator(device="cpu").manual_seed(T)
        q, k, v, dout = (torch.randn((16384 // T, 12, T, 64), generator=gen).to("cuda",
                         torch.bfloat16) for _ in range(4))  # fmt: skip

        def triton_flash():
            _, cache = flash_attention_forward(q, k, v, causal=True)
            return flash_attention_backward(dout, cache)

        def torch_sdpa():
            leaves = [a.detach().requires_grad_() for a in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, is_causal=True)
            return torch.autograd.grad(out, leaves, dout)

        steps = {"Triton flash": triton_flash, "F.scaled_dot_product_attention": torch_sdpa}
        steps = working(steps, failures, f"attention T={T}")  # first calls compile
        paired_times(steps, 1, "cuda")  # warm-up
        memory = {name: peak_bytes(step, "cuda") for name, step in steps.items()}
        seconds = paired_times(steps, 10, "cuda")
        for name, times in seconds.items():
            rows.append({"T": T, "contender": name, "ms": 1e3 * statistics.median(times),
                         "peak_gib": memory[name] / GiB})
    return rows


def hf_generator(params, cfg: GPTConfig, precision: str, tmp: Path):
    """Hugging Face's GPT2LMHeadModel on ``params`` (written by ``to_hf``), greedy, never
    stopping early: prompt ids -> prompt + new ids. None when transformers does not import."""
    try:
        from transformers import GPT2LMHeadModel
    except ImportError:
        return None
    from gptlab.interop import to_hf

    to_hf({name: p.float() for name, p in params.items()}, cfg, tmp / "hf")
    model = GPT2LMHeadModel.from_pretrained(tmp / "hf", torch_dtype=getattr(torch, precision))
    model = model.cuda().eval()
    model.generation_config.eos_token_id = None  # 256 new tokens, as the others
    model.generation_config.pad_token_id = 0

    def run(prompt: list[int], n: int) -> list[int]:
        with torch.no_grad():
            ids = torch.tensor([prompt], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 do_sample=False)  # fmt: skip
        return out[0].tolist()

    return run


def run_generate(args, failures: list) -> list[dict]:
    """Tokens per second of greedy generation, and whether each contender gives generate's ids."""
    from gptlab.training.decode import StaticDecoder
    from gptlab.training.sample import generate

    cfg = GPTConfig(**GPT2_RELEASED)
    prompt = torch.randint(0, cfg.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            params = init_params(cfg, seed=0, backend="torch", dtype=precision, device="cuda")
            runs = {"gptlab generate (KV cache)":
                        lambda p, n: generate(params, cfg, p, n, greedy=True)}  # fmt: skip
            for graph in (False, True):
                decoder = StaticDecoder(params, cfg, cuda_graph=graph)
                name = f"gptlab StaticDecoder, {'CUDA graph' if graph else 'eager'}"
                runs[name] = lambda p, n, d=decoder: d.generate(p, n, greedy=True)
            hf = hf_generator(params, cfg, precision, Path(tmp) / precision)
            if hf is not None:
                runs["Hugging Face generate"] = hf
            ids = {}
            steps = {name: (lambda name=name, fn=fn: ids.__setitem__(name, fn(prompt, NEW_TOKENS)))
                     for name, fn in runs.items()}  # fmt: skip
            steps = working(steps, failures, f"generate {precision}")  # captures, compiles
            seconds = paired_times(steps, args.generate_rounds, "cuda")
            reference = ids.get("gptlab generate (KV cache)")
            for name, times in seconds.items():
                median = statistics.median(times)
                rows.append({"precision": precision, "contender": name,
                             "tokens_per_s": NEW_TOKENS / median, "ms": 1e3 * median,
                             "same_ids": reference is not None and ids[name] == reference})
            print(f"generate {precision}: done", flush=True)
    return rows


def last_val_loss_gptlab(out_dir: Path) -> float:
    """The validation loss of the last evaluation in a gptlab run's log.csv."""
    with open(out_dir / "log.csv") as f:
        return float(list(csv.DictReader(f))[-1]["val_loss"])


def gptlab_char_command(data: Path, out_dir: Path, precision: str, how: str) -> list[str]:
    """``how``: the kernels ("triton", "torch"), or "triton, CUDA graph" (--cuda-graph)."""
    c = CHAR
    kernels, graph = how.split(", ")[0], how.endswith("CUDA graph")
    return [sys.executable, "-m", "gptlab", "train", "--data", str(data), "--device", "cuda",
            "--n-layer", str(c["n_layer"]), "--n-head", str(c["n_head"]),
            "--n-embd", str(c["n_embd"]), "--block-size", str(c["block_size"]),
            "--batch-size", str(c["batch_size"]), "--max-iters", str(c["max_iters"]),
            "--lr", str(c["learning_rate"]), "--min-lr", str(c["min_lr"]),
            "--warmup-iters", str(c["warmup_iters"]), "--betas", "0.9", str(c["beta2"]),
            "--no-bias", "--gelu", "erf", "--dropout", "0", "--eval-interval", str(c["max_iters"]),
            "--eval-iters", str(c["eval_iters"]), "--checkpoint-interval", "0",
            "--precision", precision, "--kernels", kernels, "--out-dir", str(out_dir), "--quiet",
            *(["--cuda-graph"] if graph else [])]


def nanogpt_char_command(compile_: bool, precision: str) -> list[str]:
    c = CHAR
    return [sys.executable, "train.py", "config/train_shakespeare_char.py",
            f"--batch_size={c['batch_size']}", f"--max_iters={c['max_iters']}",
            f"--lr_decay_iters={c['max_iters']}", f"--eval_interval={c['max_iters']}",
            f"--eval_iters={c['eval_iters']}", "--dropout=0.0", f"--compile={compile_}",
            f"--dtype={precision}", "--device=cuda"]


def run_char(args, failures: list) -> list[dict]:
    """Each run a process from start to exit: wall seconds and the last validation loss."""
    if not args.data.is_file():
        failures.append({"where": "char", "contender": "all", "error": f"no text at {args.data}"})
        return []
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        nano = Path(tmp) / "nanoGPT"
        if args.nanogpt is not None:
            shutil.copytree(args.nanogpt, nano)
            prepared = nano / "data" / "shakespeare_char"
            shutil.copy(args.data, prepared / "input.txt")
            subprocess.run([sys.executable, "prepare.py"], cwd=prepared, check=True,
                           capture_output=True, timeout=300)  # fmt: skip
        runs = {}  # name -> (command, folder); gptlab and nanoGPT alternate
        for who, how, precision in CHAR_RUNS:
            if who == "gptlab":
                out_dir = Path(tmp) / f"{how.replace(', ', '-')}-{precision}".replace(" ", "_")
                runs[f"gptlab {how}, {precision}"] = (
                    gptlab_char_command(args.data, out_dir, precision, how), None)
            elif args.nanogpt is not None:
                runs[f"nanoGPT train.py, {how}, {precision}"] = (
                    nanogpt_char_command(how == "compiled", precision), nano)
        began = time.perf_counter()
        for name, (command, cwd) in runs.items():
            if args.char_budget and time.perf_counter() - began > args.char_budget:
                failures.append({"where": "char", "contender": name,
                                 "error": f"not run: --char-budget {args.char_budget} s spent"})
                continue
            start = time.perf_counter()
            done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
            seconds = time.perf_counter() - start
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
                failures.append({"where": "char", "contender": name,
                                 "error": (done.stderr.strip().splitlines() or ["?"])[-1][:300]})
                continue
            if cwd is None:
                loss = last_val_loss_gptlab(Path(command[command.index("--out-dir") + 1]))
            else:
                loss = float(re.findall(r"val loss ([0-9.]+)", done.stdout)[-1])
            rows.append({"contender": name, "wall_s": seconds, "val_loss": loss})
            print(f"char: {name}: {seconds:.1f} s, val loss {loss:.4f}", flush=True)
    return rows


def run(args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    import triton

    cfg = GPTConfig(**GPT2)
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s", flush=True)
    failures = []
    res = {"machine": machine_info(args.note, torch=torch.__version__, triton=triton.__version__,
                                   cuda=torch.version.cuda, gpu=torch.cuda.get_device_name()),
           "batch": args.batch, "rounds": args.rounds, "bf16_peak_tflops": peak,
           "step": run_steps(args, cfg, peak, failures) if "step" in args.parts else [],
           "attention": run_attention(failures) if "attention" in args.parts else []}
    res["char"] = run_char(args, failures) if "char" in args.parts else []
    res["generate"] = run_generate(args, failures) if "generate" in args.parts else []
    res["update"] = run_updates(args, cfg, failures) if "update" in args.parts else []
    res["profile"] = run_profile(args, cfg, failures) if "profile" in args.parts else []
    res["failures"] = failures
    return res


def goal_lines(res: dict) -> list[str]:
    """The ratios of the issue's goals, from the rows measured side by side in this run."""
    step = {(r["precision"], r["contender"]): r for r in res["step"]}
    attention = {(r["T"], r["contender"]): r["ms"] for r in res["attention"]}
    char = {r["contender"]: r["wall_s"] for r in res.get("char", [])}
    lines = []

    def ratio(label, a, b, goal):
        if a is not None and b is not None:
            lines.append(f"- {label}: {a / b:.2f}x (goal: at most {goal})")

    triton16, nano16 = step.get(("bfloat16", "gptlab triton")), step.get(
        ("bfloat16", "nanoGPT compiled"))
    graph16 = step.get(("bfloat16", "gptlab triton, CUDA graph"))
    if triton16 and nano16:
        ratio("bf16 step time, gptlab Triton / nanoGPT compiled", triton16["ms"], nano16["ms"],
              "1.0x")
    if graph16 and nano16:
        ratio("bf16 step time, gptlab Triton as a CUDA graph / nanoGPT compiled", graph16["ms"],
              nano16["ms"], "1.0x")
        ratio("bf16 peak memory, gptlab Triton / nanoGPT compiled", triton16["peak_gib"],
              nano16["peak_gib"], "1.0x")
    triton32, autograd32 = (step.get(("float32", name)) for name in
                            ("gptlab triton", "autograd over gptlab.reference"))  # fmt: skip
    if triton32 and autograd32:
        ratio("float32 (TF32) step time, gptlab Triton / autograd eager", triton32["ms"],
              autograd32["ms"], "0.9x")
    for T in sorted({T for T, _ in attention}):
        ratio(f"flash kernel / F.scaled_dot_product_attention at T = {T}",
              attention.get((T, "Triton flash")),
              attention.get((T, "F.scaled_dot_product_attention")), "1.3x")
    for gptlab, label in (("triton", "Triton"), ("triton, CUDA graph", "Triton as a CUDA graph")):
        for nano in ("compiled", "eager"):
            ratio(f"char recipe wall time, gptlab {label} bf16 / nanoGPT {nano} bf16",
                  char.get(f"gptlab {gptlab}, bfloat16"),
                  char.get(f"nanoGPT train.py, {nano}, bfloat16"), "1.0x")
    speed = {(r["precision"], r["contender"]): r["tokens_per_s"] for r in res.get("generate", [])}
    for precision in sorted({precision for precision, _ in speed}):
        graph = speed.get((precision, "gptlab StaticDecoder, CUDA graph"))
        hf = speed.get((precision, "Hugging Face generate"))
        if graph is not None:
            lines.append(f"- {precision} generation, the CUDA graph decoder: {graph:,.0f} tokens/s "
                         "(goal: at least 1,000)"
                         + (f", {graph / hf:.2f}x Hugging Face's (goal: at least 1.0x)" if hf
                            else ""))  # fmt: skip
    return ["", "Against the goals (ratios of the figures above):", "", *lines] if lines else []


def profile_lines(rows: list) -> list[str]:
    """The profile part as markdown: GPU time by kind per contender, then each one's top
    kernels."""
    if not rows:
        return []
    kinds = sorted({kind for r in rows for kind in r["kinds"]})
    lines = ["", "Where the GPU's time goes, bfloat16 step, ms per step under torch's profiler:",
             "", "| | " + " | ".join(r["contender"] for r in rows) + " |",
             "|---|" + "---:|" * len(rows)]
    lines += [f"| {label} | " + " | ".join(f"{value(r):.1f}" for r in rows) + " |"
              for label, value in [("wall time", lambda r: r["wall_ms"]),
                                   ("GPU busy (all kernels)", lambda r: r["gpu_ms"])]
              + [(kind, lambda r, kind=kind: r["kinds"].get(kind, 0.0)) for kind in kinds]]
    for r in rows:
        lines += ["", f"The {TOP_KERNELS} longest kernels of {r['contender']}, ms per step:", ""]
        lines += [f"- {ms:.2f} `{name[:90]}`" for name, ms in r["top"]]
    return lines


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# GPT-2 124M on {m['gpu']}", "",
             f"{m['date']}; torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}. "
             f"Batch {res['batch']} x 1024 tokens, median of {res['rounds']} interleaved rounds; "
             f"MFU against the bf16 matmul peak measured in this run, "
             f"{res['bf16_peak_tflops']:.0f} TFLOP/s. {m['note']}"]
    if res["step"]:
        lines += ["", "| precision | contender | ms / step | tokens/s | model TFLOP/s | MFU | "
                  "peak GiB |", "|---|---|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['precision']} | {r['contender']} | {r['ms']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.0f}% | "
                  f"{r['peak_gib']:.1f} |" for r in res["step"]]
    if res["attention"]:
        lines += ["", "Causal attention alone, forward + backward, 12 heads of 64, bf16, "
                  "16,384 tokens per call:", "",
                  "| T | contender | ms | peak GiB |", "|---:|---|---:|---:|"]
        lines += [f"| {r['T']} | {r['contender']} | {r['ms']:.2f} | {r['peak_gib']:.2f} |"
                  for r in res["attention"]]
    if res.get("char"):
        lines += ["", "The char recipe end to end (one process each, wall time from start to exit, "
                  "compiles included), final validation loss over 200 batches. gptlab's float32 "
                  "run multiplies in IEEE float32 (the CLI leaves TF32 off); nanoGPT's train.py "
                  "turns TF32 on:", "",
                  "| run | wall s | val loss |", "|---|---:|---:|"]
        lines += [f"| {r['contender']} | {r['wall_s']:.1f} | {r['val_loss']:.4f} |"
                  for r in res["char"]]
    if res.get("update"):
        lines += ["", "The whole update (forward, backward, clip, AdamW), ms and tokens/s:", "",
                  "| precision | contender | ms / update | tokens/s |", "|---|---|---:|---:|"]
        lines += [f"| {r['precision']} | {r['contender']} | {r['ms']:.1f} | "
                  f"{r['tokens_per_s']:,.0f} |" for r in res["update"]]
    if res.get("generate"):
        lines += ["", f"Greedy generation, GPT-2 124M as released (random weights), batch 1, an "
                  f"8-token prompt and {NEW_TOKENS} new tokens, the whole call timed:", "",
                  "| precision | contender | tokens/s | ms / call | same ids as generate |",
                  "|---|---|---:|---:|---|"]
        lines += [f"| {r['precision']} | {r['contender']} | {r['tokens_per_s']:,.0f} | "
                  f"{r['ms']:.0f} | {'yes' if r['same_ids'] else 'no'} |" for r in res["generate"]]
    lines += profile_lines(res.get("profile", []))
    lines += goal_lines(res)
    if res.get("failures"):
        lines += ["", "Contenders that failed, left out of the tables:", ""]
        lines += [f"- {f['where']}, {f['contender']}: `{f['error']}`" for f in res["failures"]]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, default=None,
                        help="a nanoGPT checkout whose model.py joins the contenders")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--note", default="")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA,
                        help="the text of the char recipe (tinyshakespeare)")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--precisions", nargs="+", choices=("bfloat16", "float32"),
                        default=["bfloat16", "float32"],
                        help="the precisions of the step and generate parts")
    parser.add_argument("--generate-rounds", type=int, default=3,
                        help="timed rounds of the generation part")
    parser.add_argument("--profile-steps", type=int, default=5,
                        help="steps profiled per contender of the profile part")
    parser.add_argument("--char-budget", type=float, default=0,
                        help="seconds after which no further char run starts (0: no limit)")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite gpu.md from gpu.json, measuring nothing")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available() and not args.markdown_only:
        print("bench_gpu: no CUDA device on this machine; nothing measured, nothing written")
        return 0
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        print(f"bench_gpu: --nanogpt {args.nanogpt} has no model.py", file=sys.stderr)
        return 2
    report("gpu", args, run, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
