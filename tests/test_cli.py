"""The command line: help on every option, choices, the GELU's spellings, every TrainConfig field
reachable and round-tripped, --threads."""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import pytest
import torch

import gptlab.training.steps
from gptlab.cli import TRAIN_GROUPS, build_parser, config_from_args, main
from gptlab.config import GPTConfig
from gptlab.training.data import embedded_corpus
from gptlab.layers.gelu import gelu_forward
from gptlab.training.config import TrainConfig
from test_train import _cli_args

ROOT = Path(__file__).resolve().parent.parent
FIELDS = [field.name for field in fields(TrainConfig)]
# The enumerated fields, written out here so that one losing its choices fails a test.
CHOICES = {"gelu": ("tanh", "erf"), "tokenizer": ("char", "bpe"), "optimizer": ("adamw", "sgd"),
           "lr_schedule": ("cosine", "inverse_sqrt", "constant"), "log_format": ("csv", "jsonl"),
           "backend": ("numpy", "torch", "autograd"), "dtype": ("float32", "float64"),
           "position": ("learned", "sinusoidal", "rope"), "norm": ("layernorm", "rmsnorm"),
           "mlp": ("gelu", "swiglu", "moe"),
           "parallel": ("none", "ddp", "zero1", "zero2", "zero3", "tensor", "pipeline"),
           "attention": ("sdpa", "flash"), "classifier": ("full", "chunked"),
           "precision": ("float32", "bfloat16", "float16"), "kernels": ("auto", "torch", "triton")}
# Two configs that, between them, set every field to something other than its default (no one
# config can: the autograd backend has no dropout, threads is torch's, not numpy's, and LLaMA's
# SwiGLU has no biases, a mixture of experts has).
AUTOGRAD_RUN = dict(
    n_layer=2, n_head=2, n_embd=32, block_size=16, gelu="erf", bias=False, dropout=0.0,
    position="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=48, n_kv_head=1, rope_base=500.0,
    tie_embeddings=False, n_expert=None, expert_top_k=2, capacity_factor=None,
    aux_loss_weight=0.01,
    data="corpus.txt", tokenizer="bpe", vocab_size=300, tokenizer_path="tok/tokenizer.json",
    val_fraction=0.2, batch_size=3, optimizer="sgd", lr=0.05, weight_decay=0.0,
    betas=(0.8, 0.99), eps=1e-6, momentum=0.5, decay_position_embeddings=True, grad_clip=0.5,
    max_iters=7, lr_schedule="inverse_sqrt", warmup_iters=3, min_lr=1e-5, lr_decay_iters=6,
    eval_interval=2, eval_iters=4, log_format="jsonl", out_dir="runs/x", checkpoint_interval=0,
    resume=True, backend="autograd", device="cuda:1", dtype="float64", threads=3, seed=7,
    parallel="none", nproc=1, accum_steps=1, fused=False, recompute=False, attention="sdpa",
    classifier="full", precision="float32", loss_scale_interval=1000, kernels="torch",
    cuda_graph=False,
)
NUMPY_RUN = dict(AUTOGRAD_RUN, backend="numpy", device="cpu", dropout=0.1, threads=None,
                 bias=True, mlp="moe", n_expert=4, expert_top_k=1, capacity_factor=1.5,
                 aux_loss_weight=0.1)
PARALLEL_RUN = dict(AUTOGRAD_RUN, backend="torch", parallel="zero3", nproc=2, accum_steps=3,
                    batch_size=6)  # split over 2 ranks x 3 micro-steps
FAST_RUN = dict(AUTOGRAD_RUN, backend="torch", dtype="float32", position="learned",
                norm="layernorm", mlp="gelu", n_kv_head=None, tie_embeddings=True, fused=True,
                recompute=True, attention="flash", classifier="chunked", precision="float16",
                loss_scale_interval=50)  # the fused path covers GPT-2's models
GRAPH_RUN = dict(FAST_RUN, device="cpu", optimizer="adamw", precision="bfloat16", kernels="triton",
                 cuda_graph=True)  # the fused AdamW's step as a CUDA graph (eager on a CPU)


def subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


def parse_error(argv: list[str], capsys) -> str:
    """argparse's message for ``argv``, which it must refuse (exit status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("command", ["train", "sample", "data"])
def test_every_option_has_a_description_and_its_default(command):
    parser = subcommand(command)
    shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]
    for action in shown:
        if isinstance(action, argparse._HelpAction):
            continue
        description = re.sub(r" \(default: .*\)$", "", action.help)
        assert len(description.split()) >= 3, f"{action.option_strings}: {action.help!r}"
        if not (action.required or isinstance(action, argparse._StoreTrueAction)):
            assert "(default: " in action.help, action.option_strings
    primary = {a.dest for a in shown}
    for hidden in (a for a in parser._actions if a.help == argparse.SUPPRESS):
        # only the fields' own underscore names are unlisted, beside their listed hyphen names
        assert hidden.dest in primary and hidden.option_strings[0] == "--" + hidden.dest


def test_help_groups_the_options_and_prints_choices_and_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option: no wrapped text to match
    grouped = [name for names in TRAIN_GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(FIELDS)  # each field under exactly one heading
    text = subcommand("train").format_help()
    headings = [text.index(f"\n{title}:\n") for title in TRAIN_GROUPS]
    assert headings == sorted(headings)
    enumerated = {f.name: f.metadata["choices"] for f in fields(TrainConfig)
                  if f.metadata["choices"]}
    assert enumerated == CHOICES
    for values in CHOICES.values():
        assert "{" + ",".join(values) + "}" in text
    for default in ("(default: 1337)", "(default: 0.9 0.95)", "(default: --bias)",
                    "(default: --no-resume)", "(default: none)", "(default: tanh)"):
        assert default in text
    assert "--lr LR, --learning-rate LR" in text
    assert "{numpy,torch}" in subcommand("sample").format_help()


def test_the_readme_help_commands_run():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command, expected in (("train", "--max-iters"), ("sample", "--top-k"),
                              ("data", "--threshold")):
        proc = subprocess.run([sys.executable, "-m", "gptlab", command, "--help"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"usage: python -m gptlab {command}") and expected in proc.stdout


@pytest.mark.parametrize("name", list(CHOICES))
def test_an_invalid_choice_is_refused_with_the_valid_ones(name, capsys):
    err = parse_error(["train", "--" + name.replace("_", "-"), "bogus"], capsys)
    assert "invalid choice: 'bogus'" in err
    assert all(repr(value) in err for value in CHOICES[name])


def test_sample_refuses_an_invalid_backend(capsys):
    err = parse_error(["sample", "--checkpoint", "run", "--backend", "jax"], capsys)
    assert "invalid choice: 'jax'" in err and "'numpy'" in err and "'torch'" in err


@pytest.mark.parametrize("spelling, canonical", [("erf", "erf"), ("exact", "erf"),
                                                 ("none", "erf"), ("tanh", "tanh")])
def test_gelu_spellings_parse_to_the_canonical_one(spelling, canonical):
    args = build_parser().parse_args(["train", "--gelu", spelling])
    assert args.gelu == canonical
    cfg = config_from_args(args)
    assert cfg.gelu == canonical and cfg.model_config(vocab_size=5).gelu == canonical
    assert TrainConfig(gelu=spelling).gelu == GPTConfig(gelu=spelling).gelu == canonical
    # what the layers compute for it: x * Phi(x) with the erf, or GPT-2's tanh formula
    x = np.linspace(-4.0, 4.0, 17)
    y, _ = gelu_forward(x, approximate=GPTConfig(gelu=spelling).gelu_approximate)
    exact = [0.5 * v * (1.0 + math.erf(v / math.sqrt(2.0))) for v in x]
    tanh = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    np.testing.assert_allclose(y, exact if canonical == "erf" else tanh, rtol=1e-12, atol=1e-15)
    assert not np.allclose(exact, tanh, rtol=1e-6)  # the two forms are told apart


def test_a_stored_config_with_the_old_spelling_loads():
    stored = {**GPTConfig(n_layer=1, n_head=1, n_embd=4).to_dict(), "gelu": "none"}
    cfg = GPTConfig(**stored)
    assert cfg.gelu == "erf" and cfg == GPTConfig(n_layer=1, n_head=1, n_embd=4, gelu="erf")
    assert TrainConfig(**{**asdict(TrainConfig()), "gelu": "none"}).gelu == "erf"


def test_every_field_has_an_option_and_the_defaults_match():
    assert config_from_args(build_parser().parse_args(["train"])) == TrainConfig()
    changed = {name for run in (AUTOGRAD_RUN, NUMPY_RUN, PARALLEL_RUN, FAST_RUN, GRAPH_RUN)
               for name, value in run.items()
               if value != getattr(TrainConfig(), name)}
    assert changed == set(FIELDS) == set(AUTOGRAD_RUN)


@pytest.mark.parametrize("sep", ["-", "_"], ids=["hyphens", "underscores"])
@pytest.mark.parametrize("values", [AUTOGRAD_RUN, NUMPY_RUN, PARALLEL_RUN, FAST_RUN, GRAPH_RUN],
                         ids=["autograd", "numpy", "parallel", "fast", "graph"])
def test_config_to_argv_to_config_round_trips(values, sep):
    cfg = TrainConfig(**values)
    argv = ["train", *_cli_args(sep, **asdict(cfg))]
    assert config_from_args(build_parser().parse_args(argv)) == cfg


def test_short_and_optional_spellings():
    args = build_parser().parse_args(["train", "--learning-rate", "0.01", "--lr-decay-iters",
                                      "none", "--threads", "None"])
    assert args.lr == 0.01 and args.lr_decay_iters is None and args.threads is None
    args = build_parser().parse_args(["sample", "--checkpoint", "run", "--top-k", "none",
                                      "--top-p", "0.9"])
    assert args.top_k is None and args.top_p == 0.9 and args.prompt == "\n"


@pytest.mark.parametrize("values, message", [
    (dict(threads=0), r"TrainConfig.threads must be None or >= 1, got 0"),
    (dict(threads=2, backend="numpy"), r"threads sets torch's thread count.*OMP_NUM_THREADS"),
    (dict(backend="jax"), r"TrainConfig.backend must be one of \('numpy', 'torch', 'autograd'\)"),
    (dict(norm="rmsnorm", mlp="swiglu", position="rope"), r"bias=True, but RMSNorm, SwiGLU .*"
                                                          "set bias=False"),
    (dict(mlp="moe"), "mlp='moe' needs n_expert"),
    (dict(n_head=4, n_kv_head=3), r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
])
def test_bad_configs_are_refused(values, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**values)


def test_threads_applies_during_the_run_only(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(embedded_corpus()[:5_000], encoding="utf-8")
    loss_and_grads, seen = gptlab.training.steps.loss_and_grads, []

    def recording_loss_and_grads(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return loss_and_grads(*args, **kwargs)

    monkeypatch.setattr(gptlab.training.steps, "loss_and_grads", recording_loss_and_grads)
    original = torch.get_num_threads()
    torch.set_num_threads(2)  # not the run's count, so that its return shows
    try:
        tiny = dict(n_layer=1, n_head=1, n_embd=8, block_size=8, batch_size=2, eval_iters=1,
                    warmup_iters=1, max_iters=2, eval_interval=2, threads=1,
                    fused=False)  # the plain path: its loss_and_grads is the one recorded
        assert main(["train", *_cli_args("-", **tiny), "--data", str(corpus), "--out-dir",
                     str(tmp_path / "run"), "--quiet"]) == 0
        assert seen == [1, 1]  # one call per update, both on one thread
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(original)
