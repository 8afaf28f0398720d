"""Learning from preferences on the toy task: reward model, RLHF with PPO, DPO (chapter 22).

    python benchmarks/bench_preferences.py [--seeds 0 1] [--ppo-betas 0.02 0.1] [--dpo-betas 0.1 0.5]

For every seed, with ``gptlab.alignment.rlhf`` (NumPy, float64, the hand-written backward, one thread):

1. a char-level policy (2 layers, 2 heads, width 32, context 24) pretrained on the embedded
   corpus (``--pretrain`` updates); it is also the frozen reference;
2. two completions (16 characters after an 8-character prompt) of ``--prompts`` training
   prompts, labelled by the programmatic preference (the share of the letter "e"), ties
   dropped; 80% of the pairs train the reward model, 20% are held out;
3. the reward model (the policy plus a scalar head) fitted with the Bradley-Terry loss:
   accuracy on the held-out pairs;
4. PPO against the reward model, for each KL coefficient of ``--ppo-betas``;
5. DPO on the reward model's training pairs, for each beta of ``--dpo-betas``.

Every policy is evaluated on the same 128 held-out prompts (one sampled completion each, the
same generator seed each time): the programmatic score, the reward model's reward, and the KL
to the reference (the exact per-token KL summed over the completion, averaged). "Samples" counts
the completions a method learned from: PPO draws a fresh batch per iteration; DPO reuses the
two completions of each labelled pair (counted once per pair, however many epochs).
Writes ``benchmarks/results/preferences.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before NumPy loads its BLAS
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

from machine import machine_info, report  # noqa: E402  benchmarks/machine.py
from gptlab.alignment import rlhf  # noqa: E402
from gptlab.training.data import embedded_corpus  # noqa: E402


def _eval_row(eval_result: dict, samples: int) -> dict:
    return {"samples": samples, **{k: v for k, v in eval_result.items() if k != "samples"}}


def run_seed(seed: int, args) -> dict:
    task = rlhf.ToyTask.from_text(embedded_corpus(), preferred="e")
    cfg = rlhf.policy_config(task)
    timings, out = {}, {"seed": seed}
    t0 = time.perf_counter()
    policy, losses = rlhf.pretrain_policy(task, cfg, steps=args.pretrain, batch_size=32, lr=3e-3,
                                          seed=seed)  # fmt: skip
    timings["pretrain"] = time.perf_counter() - t0
    out["pretrain_loss_last20"] = float(np.mean(losses[-20:]))
    pairs = rlhf.make_preference_pairs(policy, cfg, task, args.prompts, seed=seed + 1)
    train, held = pairs.split(int(0.8 * len(pairs)))
    out.update(prompts=args.prompts, pairs=len(pairs), train_pairs=len(train), held_pairs=len(held))
    t0 = time.perf_counter()
    rm, rm_log = rlhf.train_reward_model(rlhf.init_reward_model(policy, cfg), cfg, train,
                                         steps=args.rm_steps, batch_size=32, lr=1e-3, seed=seed)  # fmt: skip
    timings["reward_model"] = time.perf_counter() - t0
    out["rm_train_accuracy"] = rlhf.reward_accuracy(rm, cfg, train)
    out["rm_held_accuracy"] = rlhf.reward_accuracy(rm, cfg, held)
    out["rm_final_loss_last20"] = float(np.mean([r["loss"] for r in rm_log[-20:]]))

    def reward_fn(seqs):
        return rlhf.rewards_of(rm, cfg, seqs)

    prompts = task.prompts(128, np.random.default_rng(10_000 + seed), "eval")
    runs = []
    for beta in args.ppo_betas:
        t0 = time.perf_counter()
        params, log = rlhf.train_ppo(policy, policy, reward_fn, cfg, task,
                                     iterations=args.ppo_iterations, batch_size=32, beta=beta,
                                     lr=1e-3, seed=seed, eval_prompts=prompts, eval_every=10)  # fmt: skip
        curve = [_eval_row(row["eval"], row["samples"]) for row in log if "eval" in row]
        runs.append({"method": "PPO", "beta": beta, "curve": curve,
                     "seconds": time.perf_counter() - t0,
                     "examples": task.decode(log[-1]["eval"]["samples"][:4])})  # fmt: skip
    for beta in args.dpo_betas:
        t0 = time.perf_counter()
        params, log = rlhf.train_dpo(policy, policy, reward_fn, cfg, task, train,
                                     steps=args.dpo_steps, batch_size=16, beta=beta, lr=1e-3,
                                     seed=seed, eval_prompts=prompts, eval_every=25)  # fmt: skip
        curve = [_eval_row(row["eval"], 2 * min(len(train), 16 * row["step"]))
                 for row in log if "eval" in row]  # fmt: skip
        runs.append({"method": "DPO", "beta": beta, "curve": curve,
                     "seconds": time.perf_counter() - t0,
                     "examples": task.decode(log[-1]["eval"]["samples"][:4])})  # fmt: skip
    reference = rlhf.evaluate_policy(policy, policy, reward_fn, cfg, task, prompts, seed=seed + 1)
    out.update(reference=_eval_row(reference, 0), reference_examples=task.decode(
        reference["samples"][:4]), runs=runs, timings=timings)  # fmt: skip
    return out


def run(args) -> dict:
    start = time.perf_counter()
    info = machine_info(args.note)
    seeds = [run_seed(seed, args) for seed in args.seeds]
    info["load_average_1min_at_end"] = os.getloadavg()[0]
    return {"machine": info, "settings": vars(args) | {"note": args.note}, "seeds": seeds,
            "minutes": (time.perf_counter() - start) / 60}  # fmt: skip


def _final(run_: dict) -> dict:
    return run_["curve"][-1]


def markdown(res: dict) -> str:
    s, m = res["settings"], res["machine"]
    seeds = res["seeds"]
    lines = [
        "# Learning from preferences: reward model, PPO, DPO (toy task)", "",
        f"Generated by `python benchmarks/bench_preferences.py` on {m['date']} in "
        f"{res['minutes']:.1f} minutes. Seeds {', '.join(str(x['seed']) for x in seeds)}.", "",
        "Task: continue an 8-character prompt of the embedded corpus by 16 characters; the "
        "programmatic preference is the share of the letter \"e\" in the completion. Policy: "
        "2 layers, 2 heads, width 32, context 24, character vocabulary, pretrained for "
        f"{s['pretrain']} updates (batch 32, lr 3e-3); it is also the frozen reference. "
        f"Pairs: two completions of each of {s['prompts']} training prompts, ties dropped, 80% "
        f"train / 20% held out. Reward model: the policy plus a scalar head, {s['rm_steps']} "
        "Bradley-Terry updates (batch 32, lr 1e-3). PPO: "
        f"{s['ppo_iterations']} iterations of 32 fresh completions, token rewards "
        "-beta (log pi_old - log pi_ref) plus the reward model's score at the last token, GAE "
        "(gamma 1, lambda 0.95, advantages whitened), 4 epochs of minibatches of 16, clip 0.2, "
        "value head on the policy's trunk (coefficient 0.5), lr 1e-3. DPO: "
        f"{s['dpo_steps']} updates of 16 pairs drawn from the reward model's training pairs, "
        "lr 1e-3. NumPy float64, the hand-written backward everywhere.", "",
        "Evaluation: 128 held-out prompts, one sampled completion each; score = share of \"e\" "
        "(the programmatic preference), reward = the reward model's, KL = exact per-token "
        "KL(pi || pi_ref) summed over the 16 positions (nats per completion). Samples: "
        "completions the method learned from (PPO: drawn on-policy; DPO: the labelled pairs' "
        "completions, each counted once).", "",
        f"Machine: {m['cpu']}, {m['cores']} cores, NumPy {m['numpy']}, one thread; load average "
        f"{m['load_average_1min_at_start']:.2f} at start, {m['load_average_1min_at_end']:.2f} at "
        f"end. Note: {m['note']}", "",
        "## Reward model", "",
        "| seed | pairs (train / held out) | pretrain loss | RM train accuracy | RM held-out accuracy |",
        "|---:|---:|---:|---:|---:|",
    ]
    for x in seeds:
        lines.append(f"| {x['seed']} | {x['train_pairs']} / {x['held_pairs']} | "
                     f"{x['pretrain_loss_last20']:.3f} | {x['rm_train_accuracy']:.3f} | "
                     f"{x['rm_held_accuracy']:.3f} |")  # fmt: skip
    lines += ["", "## Final policies (mean over seeds)", "",
              "| method | beta | samples | score (share of e) | RM reward | KL (nats) | seconds |",
              "|---|---:|---:|---:|---:|---:|---:|"]  # fmt: skip
    ref = [x["reference"] for x in seeds]
    lines.append(f"| reference | - | 0 | {np.mean([r['score'] for r in ref]):.3f} | "
                 f"{np.mean([r['reward'] for r in ref]):.3f} | 0 | - |")  # fmt: skip
    for i, first in enumerate(seeds[0]["runs"]):
        finals = [_final(x["runs"][i]) for x in seeds]
        secs = np.mean([x["runs"][i]["seconds"] for x in seeds])
        lines.append(f"| {first['method']} | {first['beta']} | {finals[0]['samples']} | "
                     f"{np.mean([f['score'] for f in finals]):.3f} | "
                     f"{np.mean([f['reward'] for f in finals]):.3f} | "
                     f"{np.mean([f['kl'] for f in finals]):.2f} | {secs:.0f} |")  # fmt: skip
    lines += ["", f"## Curves (seed {seeds[0]['seed']})", "",
              "| method | beta | samples | score | RM reward | KL |", "|---|---:|---:|---:|---:|---:|"]
    for r in seeds[0]["runs"]:
        for point in r["curve"]:
            lines.append(f"| {r['method']} | {r['beta']} | {point['samples']} | "
                         f"{point['score']:.3f} | {point['reward']:.3f} | {point['kl']:.2f} |")
    lines += ["", f"## Samples (seed {seeds[0]['seed']}, the first 4 evaluation prompts)", ""]
    lines += [f"- reference: `{p!r}` -> `{c!r}`" for p, c in seeds[0]["reference_examples"]]
    for r in seeds[0]["runs"]:
        lines += [f"- {r['method']} beta {r['beta']}: `{p!r}` -> `{c!r}`" for p, c in r["examples"]]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--pretrain", type=int, default=1000)
    parser.add_argument("--prompts", type=int, default=1500)
    parser.add_argument("--rm-steps", type=int, default=300)
    parser.add_argument("--ppo-iterations", type=int, default=60)
    parser.add_argument("--dpo-steps", type=int, default=200)
    parser.add_argument("--ppo-betas", type=float, nargs="+", default=[0.02, 0.1])
    parser.add_argument("--dpo-betas", type=float, nargs="+", default=[0.1, 0.5])
    parser.add_argument("--note", default="shared 2-core machine: other jobs were running")
    parser.add_argument("--markdown-only", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    report("preferences", parser.parse_args(), run, markdown)


if __name__ == "__main__":
    main()
