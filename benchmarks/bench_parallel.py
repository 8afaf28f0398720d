"""Data parallel and ZeRO on 1, 2 and 4 processes: tokens/s, communication share, memory per rank.

    python benchmarks/bench_parallel.py [--worlds 1 2 4] [--steps 8] [--repeats 3]

Every rank trains the same character-sized GPT (4 layers, width 128, 4 heads, context 64,
vocabulary 65: 0.8 M parameters) with the hand-written backward on one torch thread, on its own
batch of ``--batch`` sequences (the global batch grows with the ranks, as data-parallel training
is scaled). Modes: ``ddp``, ``zero1``, ``zero2``, ``zero3`` (``gptlab.training.parallel``) and torch's own
FSDP2 (``torch.distributed.fsdp.fully_shard``) on the same model through the autograd wrapper
``gptlab.autograd.GPT`` with torch's AdamW, as a yardstick. The wrapper runs the whole model as
one autograd Function, so FSDP2 can only shard it as one unit: it gathers all the parameters
before the forward and again before the backward.

An update: loss and gradients of the global batch, clipping to norm 1, AdamW. Each world size is
one launch (gloo on 127.0.0.1); inside it the modes run in turn, ``--repeats`` rounds of
``--steps`` timed updates after one warm-up, and the median round counts. The time of a round is
the slowest rank's. tokens/s = ranks * batch * context * steps / time.

Communication share: 1 - t_compute / t_step, where t_compute is the same rank's one-process
update on its own batch (``Single`` mode, timed in the same rounds, so under the same load).
It counts what the collectives add to the step, waits and copies included; in ZeRO 3 it also
holds the recomputed block forwards.

Memory per rank: the bytes of the tensors each rank holds between updates, counted from the
tensors (``mode.memory``; FSDP2: the local shards of its parameters, gradients and moments),
set against the ZeRO paper's count (Rajbhandari et al. 2020, section 5.1) for float32 AdamW:
4Ψ of parameters, 4Ψ of gradients and 8Ψ of moments, divided by the world size from stage 1
(moments), 2 (gradients) and 3 (parameters) on. Writes benchmarks/results/parallel.json and .md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from machine import machine_info, report  # benchmarks/machine.py (the script's own folder)

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gptlab.config import GPTConfig  # noqa: E402
from gptlab.model import count_params, init_params  # noqa: E402
from gptlab.training.optim import AdamW  # noqa: E402
from gptlab.training.parallel import mode_class  # noqa: E402
from gptlab.training.parallel.base import Single, clipped_grads, micro_batches, tensor_bytes  # noqa: E402
from gptlab.training.parallel.launch import launch  # noqa: E402
from gptlab.training.scaling import zero_memory_per_rank  # noqa: E402

MODES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp2": 3}  # fsdp2 shards as stage 3


class _Steps:
    """An update of one mode (or of the one-process reference): ``step()``, ``memory()``."""

    def __init__(self, name: str, cfg: GPTConfig, batch):
        params = init_params(cfg, seed=0, backend="torch")
        self.idx, self.targets = batch
        if name == "fsdp2":
            self._fsdp2(cfg, params)
            return
        self.mode = Single(cfg, params) if name == "single" else mode_class(name)(cfg, params)
        self.optimizer = AdamW(self.mode.params, lr=1e-3)

    def _fsdp2(self, cfg, params):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from gptlab.autograd import GPT

        self.model = GPT(cfg, params)
        fully_shard(self.model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
        self.torch_optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, foreach=False)
        rank, world_size = dist.get_rank(), dist.get_world_size()
        (self.local,) = micro_batches(self.idx, self.targets, rank, world_size, 1)

    def step(self) -> None:
        if hasattr(self, "model"):
            _, loss = self.model(*self.local)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.torch_optimizer.step()
            self.grad_bytes = tensor_bytes([p.grad.to_local() for p in self.model.parameters()])
            self.torch_optimizer.zero_grad(set_to_none=True)
            return
        _, grads, _ = clipped_grads(self.mode, self.idx, self.targets, 1.0)
        self.mode.params = self.optimizer.step(self.mode.params, grads)

    def memory(self) -> dict:
        if hasattr(self, "model"):
            state = [t.to_local() for s in self.torch_optimizer.state.values()
                     for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
            counts = {"params": tensor_bytes([p.to_local() for p in self.model.parameters()]),
                      "grads": self.grad_bytes, "optimizer": tensor_bytes(state)}
            return {**counts, "total": sum(counts.values())}
        return self.mode.memory(self.optimizer)


def bench_rank(settings: dict, modes: list, batch: int, steps: int, repeats: int) -> dict:
    """On every rank: per mode the wall time of each round and the memory; the reference's."""
    cfg = GPTConfig(**settings)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, size=(world_size * batch, cfg.block_size + 1))
    global_batch = (torch.as_tensor(ids[:, :-1]), torch.as_tensor(ids[:, 1:]))
    own = micro_batches(*global_batch, rank, world_size, 1)[0]
    runs = {name: _Steps(name, cfg, global_batch) for name in modes}
    runs["single"] = _Steps("single", cfg, own)
    for run in runs.values():
        run.step()  # warm-up
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                run.step()
            times[name].append(time.perf_counter() - start)
    return {"rank": rank, "times": times,
            "memory": {name: runs[name].memory() for name in modes}}


def run(args) -> dict:
    settings = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65)
    n_params = count_params(GPTConfig(**settings))
    rows = []
    for world_size in args.worlds:
        per_rank = launch(bench_rank, world_size, settings, list(MODES), args.batch, args.steps,
                          args.repeats, timeout_s=600)
        for name in (*MODES, "single"):
            rounds = [max(r["times"][name][i] for r in per_rank) for i in range(args.repeats)]
            seconds = statistics.median(rounds)
            row = {"mode": name, "world_size": world_size, "seconds": seconds,
                   "tokens_per_s": world_size * args.batch * settings["block_size"] * args.steps
                   / seconds}
            if name != "single":
                row["memory"] = per_rank[0]["memory"][name]
                row["memory_max_over_ranks"] = max(r["memory"][name]["total"] for r in per_rank)
                if name in STAGES:
                    row["formula"] = zero_memory_per_rank(n_params, world_size, STAGES[name])
            rows.append(row)
        compute = next(r["seconds"] for r in rows
                       if r["mode"] == "single" and r["world_size"] == world_size)
        for row in rows:
            if row["world_size"] == world_size and row["mode"] != "single":
                row["communication_share"] = max(0.0, 1.0 - compute / row["seconds"])
    return {"machine": machine_info(args.note, torch=torch.__version__),
            "settings": {**settings, "batch_per_rank": args.batch, "steps": args.steps,
                         "repeats": args.repeats, "threads_per_rank": 1, "n_params": n_params},
            "rows": rows}


def markdown(res: dict) -> str:
    s, m = res["settings"], res["machine"]
    rows = [r for r in res["rows"] if r["mode"] != "single"]
    base = {r["mode"]: r["tokens_per_s"] for r in rows if r["world_size"] == 1}
    lines = [
        "# Data parallel and ZeRO on 1, 2, 4 processes (CPU, gloo)",
        "",
        f"{m['cpu']}, {m['cores']} cores (load {m['load_average_1min_at_start']} at start), "
        f"torch {m['torch']}, {m['date']}. {m['note']}",
        "",
        f"Model: {s['n_layer']} layers, width {s['n_embd']}, {s['n_head']} heads, context "
        f"{s['block_size']}, vocabulary {s['vocab_size']}: {s['n_params']:,} parameters. "
        f"{s['batch_per_rank']} sequences per rank, one thread per rank, median of "
        f"{s['repeats']} rounds of {s['steps']} updates.",
        "",
        "| mode | ranks | tokens/s | vs 1 rank | communication share | bytes per rank | "
        "ZeRO formula | measured / formula |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        formula = r.get("formula", {}).get("total")
        held = r["memory_max_over_ranks"]
        versus = ("- | -" if formula is None else f"{formula:,.0f} | {held / formula:.3f}")
        lines.append(
            f"| {r['mode']} | {r['world_size']} | {r['tokens_per_s']:,.0f} | "
            f"{r['tokens_per_s'] / base[r['mode']]:.2f}x | {r['communication_share']:.0%} | "
            f"{held:,} | {versus} |")
    lines += ["", "Bytes per rank: parameters + gradients + optimizer moments held between "
              "updates, the largest over the ranks (activations and one block's gathered weights "
              "are transient and not counted). fsdp2 is torch's FSDP2 on the autograd wrapper, "
              "sharded as one unit."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=8, help="timed updates per round")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per mode")
    parser.add_argument("--note", default="")
    parser.add_argument("--no-write", action="store_true", help="print, do not write results")
    parser.add_argument("--markdown-only", action="store_true",
                        help="rewrite the .md from the existing results .json")
    report("parallel", parser.parse_args(), run, markdown)


if __name__ == "__main__":
    main()
