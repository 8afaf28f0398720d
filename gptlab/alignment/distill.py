"""Knowledge distillation: a student GPT trained on a teacher's softened predictions.

One update, number t = 1, 2, ..., max_iters (the loop of ``gptlab.training.train``, another loss):

    x, y      = get_batch(train, batch_size, block_size, rng)    the windows a labels-only run sees
    t_logits  = teacher(x)                                       (B, T, V), no gradient
    s_logits  = student(x)                                       (B, T, V), cache kept
    loss      = alpha tau^2 KL(softmax(t/tau) || softmax(s/tau)) + (1 - alpha) CE(s, y)
    dlogits   = distillation_backward(1)                         (B, T, V)
    g         = gpt_backward(cache, dlogits)                     every student parameter
    ‖g‖ = clip_grad_norm(g, grad_clip);  θ = AdamW(θ, g, η_t)

The student's ``TrainConfig`` sets everything as for ``train``: its shape, the optimizer and
schedule, the batches (``seed``), the initial weights (``seed``), dropout; so ``alpha=0`` trains
exactly the run ``train(cfg)`` would (same batches, same updates), which makes the labels-only
baseline the same loop with the teacher's term switched off. The run stays in memory: no log
file, no checkpoint.

Book: chapter 21, "Distillation".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from tqdm.auto import tqdm

from ..backend import array_namespace, asarray_like, convert, to_numpy
from ..config import GPTConfig
from ..layers.distillation import distillation_backward, distillation_forward
from ..layers.softmax import log_softmax
from ..model import gpt_backward, gpt_forward, init_params
from ..tokenizers.base import Tokenizer
from ..training.config import TrainConfig
from ..training.data import get_batch, load_text, split_train_val
from ..training.metrics import evaluate_loss
from ..training.optim import make_optimizer
from ..training.schedule import clip_grad_norm, global_norm, make_schedule
from ..training.steps import dropout_seed
from ..training.train import TrainingDiverged


@dataclass
class DistillResult:
    history: list[dict]  # one row per evaluation: step, lr, loss (mean training loss), val_loss
    params: dict
    model_config: GPTConfig


def _check_setup(cfg: TrainConfig, teacher_config: GPTConfig, tokenizer: Tokenizer) -> None:
    if cfg.backend not in ("numpy", "torch"):
        raise ValueError(f"distill runs the hand-written backward: backend must be 'numpy' or "
                         f"'torch', got {cfg.backend!r}")
    if cfg.mlp == "moe":
        raise ValueError("a student with experts is not supported: its load-balancing loss "
                         "would be left out of the gradient")
    if cfg.resume:
        raise ValueError("distill keeps its run in memory and cannot resume: use resume=False")
    if teacher_config.vocab_size != tokenizer.vocab_size:
        raise ValueError(f"the teacher's vocabulary has {teacher_config.vocab_size} tokens, the "
                         f"tokenizer {tokenizer.vocab_size}: the student must share both")
    if cfg.block_size > teacher_config.block_size:
        raise ValueError(f"the student's block_size {cfg.block_size} is longer than the "
                         f"teacher's context ({teacher_config.block_size})")


def distill(cfg: TrainConfig, teacher_params: dict, teacher_config: GPTConfig,
            tokenizer: Tokenizer, *, tau: float = 2.0, alpha: float = 0.5,
            progress: bool = True) -> DistillResult:
    """Train the student ``cfg`` describes on ``cfg.data`` (tokenized by the teacher's
    ``tokenizer``) with the distillation loss of the teacher ``teacher_params``; see the module
    docstring. Every ``cfg.eval_interval`` updates (and after the last) the history gets the mean
    training loss since the previous row and the student's validation cross-entropy on
    ``cfg.eval_iters`` fixed batches (``gptlab.training.metrics.evaluate_loss``, seed ``cfg.seed``).

    Raises TrainingDiverged when the loss or the gradient norm is not finite.
    """
    _check_setup(cfg, teacher_config, tokenizer)
    device = cfg.device if cfg.array_backend == "torch" else None
    ids = np.asarray(tokenizer.encode(load_text(cfg.data)), dtype=np.int64)  # (N,)
    train_ids, val_ids = split_train_val(ids, cfg.block_size, cfg.val_fraction)
    teacher = {name: convert(w, cfg.array_backend, device=device)
               for name, w in teacher_params.items()}  # fmt: skip
    model_cfg = cfg.model_config(tokenizer.vocab_size)
    params = init_params(model_cfg, seed=cfg.seed, backend=cfg.array_backend, dtype=cfg.dtype,
                         device=device)
    optimizer = make_optimizer(cfg, params)
    lr_at = make_schedule(cfg.lr_schedule, lr=cfg.lr, min_lr=cfg.min_lr,
                          warmup_iters=cfg.warmup_iters,
                          decay_iters=cfg.lr_decay_iters or cfg.max_iters)
    rng = np.random.default_rng(cfg.seed)  # the batch offsets of train(cfg)

    def evaluate(step: int, losses: list[float]) -> None:
        val = evaluate_loss(params, model_cfg, val_ids, cfg.batch_size, cfg.block_size,
                            cfg.eval_iters, seed=cfg.seed)
        mean = sum(losses) / len(losses) if losses else math.nan
        history.append({"step": step, "lr": lr_at(step), "loss": mean, "val_loss": val})
        losses.clear()

    history, losses = [], []
    evaluate(0, losses)
    bar = tqdm(total=cfg.max_iters, disable=not progress, desc="distill", unit="step")
    for step in range(cfg.max_iters):
        lr = lr_at(step + 1)
        x, y = get_batch(train_ids, cfg.batch_size, cfg.block_size, rng, cfg.array_backend,
                         device)
        teacher_logits, _, _ = gpt_forward(teacher, x, teacher_config)  # (B, T, V)
        student_logits, _, cache = gpt_forward(params, x, model_cfg,
                                               dropout_seed=dropout_seed(cfg.seed, step))
        xp = array_namespace(student_logits)
        teacher_logits = xp.astype(teacher_logits, student_logits.dtype)  # (B, T, V)
        loss, loss_cache = distillation_forward(student_logits, teacher_logits, y, tau=tau,
                                                alpha=alpha)  # ()
        dlogits, _ = distillation_backward(1.0, loss_cache)  # (B, T, V)
        grads = gpt_backward(cache, dlogits)
        loss = float(loss)
        norm = clip_grad_norm(grads, cfg.grad_clip) if cfg.grad_clip > 0 else global_norm(grads)
        if not (math.isfinite(loss) and math.isfinite(norm)):
            bar.close()
            raise TrainingDiverged(f"distillation diverged at step {step + 1}: loss {loss}, "
                                   f"gradient norm {norm} (lr {lr:.3g})")
        params = optimizer.step(params, grads, lr=lr)
        losses.append(loss)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
        if (step + 1) % cfg.eval_interval == 0 or step + 1 == cfg.max_iters:
            evaluate(step + 1, losses)
    bar.close()
    return DistillResult(history, params, model_cfg)


def agreement(student_params: dict, student_config: GPTConfig, teacher_params: dict,
              teacher_config: GPTConfig, data_ids, block_size: int,
              batch_size: int = 64) -> dict:
    """How closely a student follows its teacher on every token of ``data_ids`` (N,).

    The windows are those of ``gptlab.training.metrics.split_loss`` (consecutive, every token
    predicted once). Returns ``top1``, the fraction of positions where both models' most likely
    next tokens are the same, and ``kl``, the mean KL(teacher || student) at temperature 1, in nats.
    """
    data = np.asarray(to_numpy(data_ids))  # (N,)
    if data.ndim != 1 or data.size < block_size + 1:
        raise ValueError(f"data_ids must be 1-D with at least block_size + 1 = {block_size + 1} "
                         f"tokens, got shape {data.shape}")
    starts = np.arange((data.size - 1) // block_size) * block_size  # (W,)
    matches, kl_sum = 0, 0.0
    for first in range(0, starts.size, batch_size):
        rows = starts[first : first + batch_size, None] + np.arange(block_size)  # (B, T)
        log_q = _log_probs(teacher_params, teacher_config, data[rows])  # (B, T, V)
        log_p = _log_probs(student_params, student_config, data[rows])  # (B, T, V)
        matches += int(np.sum(np.argmax(log_q, -1) == np.argmax(log_p, -1)))
        kl_sum += float(np.sum(np.exp(log_q) * (log_q - log_p)))
    n = starts.size * block_size
    return {"top1": matches / n, "kl": kl_sum / n}


def _log_probs(params: dict, cfg: GPTConfig, windows: np.ndarray) -> np.ndarray:
    """log softmax of the model's logits for windows (B, T) of ids, as float64 NumPy (B, T, V)."""
    wte = params["wte.weight"]
    x = asarray_like(windows, wte, dtype=array_namespace(wte).int64)  # (B, T)
    logits, _, _ = gpt_forward(params, x, cfg)  # (B, T, V)
    return log_softmax(to_numpy(logits).astype(np.float64))  # (B, T, V)


__all__ = ["DistillResult", "distill", "agreement"]
