"""The training loop: exact resume after SIGKILL, divergence, the CLI, backend parity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib
import numpy as np
import pytest

from gptlab.backend import to_numpy
from gptlab.tokenizers.bpe import ByteBPETokenizer
from gptlab.training.checkpoint import STATE_FILE, load_run_checkpoint
from gptlab.cli import build_parser
from gptlab.training.data import embedded_corpus
from gptlab.training.config import TrainConfig
from gptlab.training.train import TrainingDiverged, train
from gptlab.training.log import plot_losses, read_log

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent
TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, eval_iters=2,
            warmup_iters=2)


@pytest.fixture
def corpus(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(embedded_corpus()[:20_000], encoding="utf-8")
    return path


def _cli_args(sep: str = "_", **values) -> list[str]:
    """The ``train`` arguments that set ``values``: ``--field_name value`` (with sep="-", the
    ``--field-name`` that --help lists), --x or --no-x for booleans, 'none' for None."""
    args = []
    for name, value in values.items():
        flag = "--" + name.replace("_", sep)
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, tuple):
            args += [flag, *map(str, value)]
        else:
            args += [flag, "none" if value is None else str(value)]
    return args


def _gptlab(*args, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "gptlab", *args], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return out


def _state_step(out_dir: Path) -> int:
    try:
        return json.loads((out_dir / STATE_FILE).read_text())["step"]
    except (OSError, ValueError):  # not written yet
        return 0


def test_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path, corpus):
    config = dict(TINY, data=corpus, max_iters=60, checkpoint_interval=5, eval_interval=20,
                  dropout=0.1, quiet=True)
    straight = _gptlab("train", *_cli_args(**config, out_dir=tmp_path / "straight"))

    killed_dir = tmp_path / "killed"
    proc = _gptlab("train", *_cli_args(**config, out_dir=killed_dir))
    while _state_step(killed_dir) < 10 and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    killed_at = _state_step(killed_dir)
    assert 10 <= killed_at < 60

    _finish(_gptlab("train", *_cli_args(**config, out_dir=killed_dir, resume=True)))
    _finish(straight)
    a, b = load_run_checkpoint(killed_dir), load_run_checkpoint(tmp_path / "straight")
    assert a.step == b.step == 60
    diff = max(float(np.max(np.abs(a.params[n] - b.params[n]))) for n in a.params)
    assert diff <= 1e-6
    assert a.state["history"] == b.state["history"]
    assert (killed_dir / "log.csv").read_text() == (tmp_path / "straight" / "log.csv").read_text()


def test_divergence_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    run_dir = tmp_path / "run"  # not tmp_path, which holds the corpus: one run per directory
    cfg = TrainConfig(**TINY, data=str(corpus), max_iters=4, checkpoint_interval=2,
                      eval_interval=100, out_dir=str(run_dir))
    good = train(cfg, progress=False)
    assert load_run_checkpoint(run_dir).step == 4
    state_before = (run_dir / STATE_FILE).read_bytes()
    huge = TrainConfig(**{**asdict(cfg), "lr": 1e30, "lr_schedule": "constant", "max_iters": 8,
                          "resume": True})
    expected = r"diverged at step \d.*checkpoint of step 4 .* is untouched"
    with pytest.raises(TrainingDiverged, match=expected):
        train(huge, progress=False)
    assert (run_dir / STATE_FILE).read_bytes() == state_before
    ckpt = load_run_checkpoint(run_dir)
    assert ckpt.step == 4
    for name, value in good.params.items():
        np.testing.assert_array_equal(ckpt.params[name], to_numpy(value))


def test_cli_train_writes_logs_and_checkpoint_then_samples(tmp_path, corpus):
    out_dir = tmp_path / "run"
    out = _finish(_gptlab("train", *_cli_args(**TINY, data=corpus, max_iters=6, eval_interval=3,
                                              log_format="jsonl", out_dir=out_dir)))
    assert "step 6: train loss" in out
    rows = read_log(out_dir / "log.jsonl")
    assert [row["step"] for row in rows] == [0, 3, 6]
    assert all(np.isfinite(row["train_loss"]) and np.isfinite(row["val_loss"]) for row in rows)
    ax = plot_losses(out_dir / "log.jsonl")
    assert len(ax.lines) == 2 and list(ax.lines[1].get_xdata()) == [0, 3, 6]
    assert load_run_checkpoint(out_dir).step == 6

    sample = _finish(_gptlab("sample", "--checkpoint", str(out_dir), "--prompt", "def",
                             "--max-new-tokens", "12", "--top-k", "5", "--seed", "3"))
    assert sample.startswith("def") and len(sample.rstrip("\n")) >= 3


def test_cli_trains_a_bpe_tokenizer_saves_it_and_samples_with_it(tmp_path, corpus):
    out_dir = tmp_path / "bpe"
    _finish(_gptlab("train", "--tokenizer", "bpe", "--vocab-size", "300", "--data", str(corpus),
                    "--max-iters", "4", "--eval-interval", "2", "--out-dir", str(out_dir),
                    *_cli_args(**{k: v for k, v in TINY.items()})))
    ckpt = load_run_checkpoint(out_dir)
    assert isinstance(ckpt.tokenizer, ByteBPETokenizer) and ckpt.tokenizer.vocab_size == 300
    assert ckpt.model_config.vocab_size == 300
    text = corpus.read_text(encoding="utf-8")
    train_part = text[: int(len(text) * 0.9)]  # the merges never see the validation text
    expected = ByteBPETokenizer.train(train_part, 300)
    assert ckpt.tokenizer.to_dict() == expected.to_dict()
    sample = _finish(_gptlab("sample", "--checkpoint", str(out_dir), "--prompt", "class",
                             "--max-new-tokens", "5", "--seed", "1"))
    assert sample.startswith("class")

    reuse = TrainConfig(**TINY, data=str(corpus), max_iters=3, eval_interval=3,
                        tokenizer_path=str(out_dir / "tokenizer.json"), out_dir=str(tmp_path / "r"))
    assert train(reuse, progress=False).tokenizer.to_dict() == ckpt.tokenizer.to_dict()


def test_cli_reports_bad_data_without_traceback(tmp_path):
    proc = _gptlab("train", "--data", str(tmp_path / "missing.txt"), "--out_dir", str(tmp_path))
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "missing.txt" in err and "Traceback" not in err


def test_cli_has_an_option_for_every_config_field():
    defaults = build_parser().parse_args(["train"])
    assert TrainConfig(**{k: v for k, v in vars(defaults).items()
                          if k not in ("command", "quiet", "overwrite")}) == TrainConfig()
    args = build_parser().parse_args(["train", "--betas", "0.8", "0.9", "--lr_decay_iters", "none",
                                      "--data", "x.txt", "--resume", "--max_iters", "7"])
    assert args.betas == [0.8, 0.9] and args.lr_decay_iters is None
    assert args.data == "x.txt" and args.resume is True and args.max_iters == 7


LLAMA = dict(position="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=24, n_kv_head=1,
             bias=False, tie_embeddings=False)
MOE = dict(mlp="moe", n_expert=3, expert_top_k=1, capacity_factor=1.5, aux_loss_weight=0.1,
           mlp_hidden=24)


@pytest.mark.parametrize("arch", [{}, {"bias": False, "gelu": "erf"}, LLAMA, MOE],
                         ids=["gpt2", "nanogpt", "llama", "moe"])
@pytest.mark.parametrize("other", ["numpy", "autograd"])
def test_backends_give_the_same_losses(tmp_path, corpus, other, arch):
    """numpy (hand-written), torch (hand-written) and torch autograd agree in float64, with
    GPT-2's blocks, nanoGPT's (no biases, exact GELU), LLaMA's (RMSNorm, SwiGLU, RoPE,
    multi-query attention, untied head) and experts (top-1 of 3, capacity, aux loss)."""
    base = dict(TINY, **arch, data=str(corpus), dtype="float64", max_iters=3, eval_interval=1)
    runs = [train(TrainConfig(**base, backend=b, out_dir=str(tmp_path / b)), progress=False)
            for b in ("torch", other)]
    (a, b) = ([[row[k] for k in ("train_loss", "val_loss")] for row in r.history] for r in runs)
    np.testing.assert_allclose(a, b, rtol=1e-10)
    for name, value in runs[0].params.items():
        np.testing.assert_allclose(to_numpy(runs[1].params[name]), to_numpy(value), atol=1e-10)


def test_cli_trains_a_llama_style_model_and_resumes_exactly(tmp_path, corpus):
    """The LLaMA-style options on the command line; a run stopped at step 4 and resumed to step
    8 ends where a run that never stopped does (the cosine pinned to step 8 for both)."""
    config = dict(TINY, **LLAMA, data=corpus, eval_interval=4, lr_decay_iters=8, dropout=0.1)
    args = _cli_args("-", **config, quiet=True)
    straight = _gptlab("train", *args, "--max-iters", "8", "--out-dir", str(tmp_path / "s"))
    stopped = tmp_path / "stopped"
    _finish(_gptlab("train", *args, "--max-iters", "4", "--out-dir", str(stopped)))
    assert load_run_checkpoint(stopped).step == 4
    _finish(_gptlab("train", *args, "--max-iters", "8", "--out-dir", str(stopped), "--resume"))
    _finish(straight)
    a, b = load_run_checkpoint(stopped), load_run_checkpoint(tmp_path / "s")
    assert a.step == b.step == 8 and a.model_config == b.model_config
    assert a.model_config == TrainConfig(**{**config, "data": str(corpus)}).model_config(
        a.tokenizer.vocab_size)  # fmt: skip
    assert a.state["model_config"]["position"] == "rope" and "lm_head.weight" in a.params
    assert max(float(np.max(np.abs(a.params[n] - b.params[n]))) for n in a.params) <= 1e-6
    assert a.state["history"] == b.state["history"]
    sample = _finish(_gptlab("sample", "--checkpoint", str(stopped), "--prompt", "def",
                             "--max-new-tokens", "6", "--seed", "2"))
    assert sample.startswith("def")


def test_a_resumed_float16_run_goes_on_with_the_same_loss_scale(tmp_path, corpus):
    """float16 on the fused path, the scale doubling after every 2 good steps: a run stopped at
    step 4 and resumed to 8 has the scale, the counts and the weights of a run that never
    stopped (a scale restarted at its initial value would scale the gradients differently)."""
    config = dict(TINY, data=str(corpus), fused=True, precision="float16", loss_scale_interval=2,
                  eval_interval=4, lr_decay_iters=8, threads=1)  # fmt: skip
    straight = train(TrainConfig(**config, max_iters=8, out_dir=str(tmp_path / "s")),
                     progress=False)  # fmt: skip
    stopped = tmp_path / "stopped"
    train(TrainConfig(**config, max_iters=4, out_dir=str(stopped)), progress=False)
    halfway = load_run_checkpoint(stopped).state["loss_scaler"]
    assert halfway["growths"] + halfway["skipped"] > 0  # not the initial state
    resumed = train(TrainConfig(**config, max_iters=8, out_dir=str(stopped), resume=True),
                    progress=False)  # fmt: skip
    a, b = load_run_checkpoint(stopped), load_run_checkpoint(tmp_path / "s")
    assert a.state["loss_scaler"] == b.state["loss_scaler"]
    assert a.state["loss_scaler"]["growths"] + a.state["loss_scaler"]["skipped"] > (
        halfway["growths"] + halfway["skipped"])  # the schedule moved on after the resume
    assert resumed.history == straight.history
    for name, value in straight.params.items():
        assert np.array_equal(to_numpy(resumed.params[name]), to_numpy(value)), name
