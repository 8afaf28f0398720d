"""GPT-2 124M on one GPU: the hand-written backward as Triton kernels against torch's paths and
nanoGPT's own model, and the flash kernel alone against F.scaled_dot_product_attention.

    python benchmarks/bench_gpu.py [--nanogpt DIR] [--batch 8] [--rounds 10] [--note "..."]

Needs a CUDA device: without one it says so and exits 0, measuring nothing.

1. One training step (forward + backward, every parameter's gradient) of GPT-2 124M: 12 layers,
   width 768, 12 heads, vocabulary 50,304, context 1024, no biases, the exact GELU; ``--batch``
   sequences of random ids. Contenders, each in bfloat16 (float32 master weights; nanoGPT: bf16
   autocast) and in float32 (TF32 matmuls on for everyone):
   - gptlab Triton: ``FastStep(kernels="triton")``, the kernels of ``gptlab/kernels``;
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

Writes ``benchmarks/results/gpu.json`` and ``gpu.md`` with the machine and versions.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from bench_memory import paired_times, peak_bytes  # benchmarks/bench_memory.py
from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)
from gptlab.config import GPTConfig
from gptlab.fast import FastStep
from gptlab.model import init_params, loss_and_grads
from gptlab.reference.torch_gpt import reference_forward

GPT2 = dict(n_layer=12, n_head=12, n_embd=768, vocab_size=50304, block_size=1024, bias=False,
            gelu="erf")  # fmt: skip
ATTENTION_T = (1024, 2048, 4096, 8192, 16384)
GiB = 2**30


def matmul_peak_tflops(n: int = 8192, repeats: int = 5) -> float:
    """The bf16 matmul rate this GPU reaches: the best of a few (n, n) @ (n, n) products."""
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seconds = paired_times({"mm": lambda: a @ b}, repeats + 1, "cuda")["mm"][1:]
    return 2 * n**3 / min(seconds) / 1e12


def flops_per_token(cfg: GPTConfig, n_params: int) -> float:
    """nanoGPT's estimate (PaLM's appendix B): 6 N + 12 L T C, forward and backward."""
    return 6 * n_params + 12 * cfg.n_layer * cfg.block_size * cfg.n_embd


def gptlab_steps(cfg, params, idx, targets, precision: str) -> dict:
    """name -> a function running one forward + backward of a gptlab path."""
    steps = {f"gptlab {kernels}": FastStep(cfg, precision, kernels=kernels)
             for kernels in ("triton", "torch")}  # fmt: skip
    steps = {name: (lambda step=step: step(params, idx, targets)) for name, step in steps.items()}
    if precision == "float32":
        leaves = {name: p.detach().requires_grad_() for name, p in params.items()}
        steps["gptlab readable"] = lambda: loss_and_grads(params, idx, targets, cfg)
        steps["autograd over gptlab.reference"] = lambda: torch.autograd.grad(
            reference_forward(leaves, idx, cfg, targets)[1], list(leaves.values()))
    return steps


def nanogpt_steps(checkout: Path | None, idx, targets, precision: str) -> dict:
    """nanoGPT's model.py, eager and compiled, as its train.py runs it (bf16: autocast)."""
    if checkout is None:
        return {}
    sys.path.insert(0, str(checkout))
    nano = importlib.import_module("model")
    config = nano.GPTConfig(**{k: GPT2[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size",
                                                    "block_size", "bias")}, dropout=0.0)
    model = nano.GPT(config).cuda()
    compiled = torch.compile(model)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "bfloat16")

    def step(module):
        module.zero_grad(set_to_none=True)
        with autocast:
            _, loss = module(idx, targets)
        loss.backward()

    return {"nanoGPT eager": lambda: step(model), "nanoGPT compiled": lambda: step(compiled)}


def run_steps(args, cfg, peak: float) -> list[dict]:
    params = init_params(cfg, seed=0, backend="torch", dtype="float32", device="cuda")
    n_params = sum(p.numel() for name, p in params.items() if name != "wpe.weight")
    gen = torch.Generator(device="cpu").manual_seed(0)
    idx, targets = (torch.randint(0, cfg.vocab_size, (args.batch, cfg.block_size),
                                  generator=gen).cuda() for _ in range(2))  # fmt: skip
    tokens = args.batch * cfg.block_size
    rows = []
    for precision in ("bfloat16", "float32"):
        steps = {**gptlab_steps(cfg, params, idx, targets, precision),
                 **nanogpt_steps(args.nanogpt, idx, targets, precision)}  # fmt: skip
        paired_times(steps, 2, "cuda")  # warm-up: Triton's and torch.compile's compiles first
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


def run_attention() -> list[dict]:
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
        paired_times(steps, 1, "cuda")  # warm-up
        memory = {name: peak_bytes(step, "cuda") for name, step in steps.items()}
        seconds = paired_times(steps, 10, "cuda")
        for name, times in seconds.items():
            rows.append({"T": T, "contender": name, "ms": 1e3 * statistics.median(times),
                         "peak_gib": memory[name] / GiB})
    return rows


def run(args) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    import triton

    cfg = GPTConfig(**GPT2)
    peak = matmul_peak_tflops()
    print(f"bf16 matmul peak measured: {peak:.0f} TFLOP/s", flush=True)
    return {"machine": machine_info(args.note, torch=torch.__version__, triton=triton.__version__,
                                    cuda=torch.version.cuda, gpu=torch.cuda.get_device_name()),
            "batch": args.batch, "rounds": args.rounds, "bf16_peak_tflops": peak,
            "step": run_steps(args, cfg, peak), "attention": run_attention()}


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# GPT-2 124M on {m['gpu']}", "",
             f"{m['date']}; torch {m['torch']}, Triton {m['triton']}, CUDA {m['cuda']}. "
             f"Batch {res['batch']} x 1024 tokens, median of {res['rounds']} interleaved rounds; "
             f"MFU against the bf16 matmul peak measured in this run, "
             f"{res['bf16_peak_tflops']:.0f} TFLOP/s. {m['note']}", "",
             "| precision | contender | ms / step | tokens/s | model TFLOP/s | MFU | peak GiB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in res["step"]:
        lines.append(f"| {r['precision']} | {r['contender']} | {r['ms']:.1f} | "
                     f"{r['tokens_per_s']:,.0f} | {r['tflops']:.0f} | {100 * r['mfu']:.0f}% | "
                     f"{r['peak_gib']:.1f} |")
    lines += ["", "Causal attention alone, forward + backward, 12 heads of 64, bf16, "
              "16,384 tokens per call:", "",
              "| T | contender | ms | peak GiB |", "|---:|---|---:|---:|"]
    for r in res["attention"]:
        lines.append(f"| {r['T']} | {r['contender']} | {r['ms']:.2f} | {r['peak_gib']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, default=None,
                        help="a nanoGPT checkout whose model.py joins the contenders")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--note", default="")
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
