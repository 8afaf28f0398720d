"""The training loop: data -> batches -> loss and gradients -> clipping -> AdamW, with evaluation,
logging, checkpoints and exact resume.

One update, number t = 1, 2, ..., max_iters:

    x, y  = get_batch(train, batch_size, block_size, rng)       (B, T) windows, y shifted by one
    loss, g = forward + backward (dropout seeded by (seed, t - 1))
    ‖g‖ = clip_grad_norm(g, grad_clip)                          GPT-3 clips at 1.0
    θ = AdamW(θ, g, η_t)                                        η_t from the lr schedule

Three ways to get the gradients (``TrainConfig.backend``): "numpy" and "torch" run the
hand-written backward (``gptlab.loss_and_grads``); "autograd" runs the independent torch
reference model (``gptlab.reference.torch_gpt``) and ``loss.backward()``. With ``fused`` (the
default: measured faster, benchmarks/results/step.md) a one-process torch run of a GPT-2 model
without dropout takes the fused eager path ``gptlab.fast``, and any other run the plain one.
The fused path's options: ``recompute``, ``attention="flash"``, ``classifier="chunked"``,
``precision="bfloat16"`` or ``"float16"`` from float32 master weights (a float16 step whose
scaled gradients overflow is skipped; the loss scale and its counts are checkpointed, so a
resumed run goes on with the same scale).
With ``kernels`` resolving to "triton" (on CUDA by default) and AdamW, the update is
``FusedAdamW``: one Triton kernel over flat buffers (``gptlab.fast.FlatParams``) that reads the
gradients where the backward left them, applies the clip factor and float16's loss scale as it
reads them, and writes the compute copies in the same pass; its checkpoints are AdamW's, so a run
resumes with either.
Everything random is a function of ``seed`` (batches from a saved ``numpy.random.Generator``,
dropout from (seed, step), evaluation batches fixed per split), so a run stopped at a checkpoint
and resumed ends with the same weights as a run that never stopped.

The loop drives a parallel mode (``training/parallel/``; one process is a mode of one rank):
``loss, g = mode.loss_and_grads(x, y)`` on the global batch, the norm from ``mode.grad_norm``
and ``mode.params = AdamW(mode.params, g)``. ``parallel="ddp"`` or ``"zero1"``-``"zero3"`` with
``nproc`` processes (or under torchrun) trains the same model on many ranks; every rank draws the
same global batch and takes its share. Checkpoints of parallel runs are sharded, and any run
resumes from any checkpoint, whatever the mode and world size that wrote it.

Each concern of a run is one call away, in its own module of ``gptlab/training/``:

    config.py      TrainConfig: the settings and their checks
    start.py       checks before any process starts, the claim on out_dir, threads
    parallel/      the launch of the ranks and the parallel modes
    data.py        the corpus, the split, the batches, the tokenizer of the run
    steps.py       the loss and gradients: plain, fused or autograd, one process or a mode
    optim.py       AdamW or SGD; schedule.py the learning rate and clipping
    metrics.py     the evaluation's losses; log.py the loss log
    resume.py      what a resumed run must match; checkpoint.py the files

Book: chapter 11, "Training".
"""

from __future__ import annotations

import hashlib
import math
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from ..config import GPTConfig
from ..fast import FlatParams, LossScaler
from ..model import init_params
from ..tokenizers.char import Tokenizer
from .checkpoint import STATE_FILE, read_state, save_run_checkpoint
from .config import TrainConfig
from .data import EMBEDDED, encode_corpus, get_batch, load_text, make_tokenizer, split_train_val
from .log import write_log
from .metrics import batch_losses
from .optim import decay_filter_of, make_optimizer
from .parallel.base import clipped_grads, rank_and_world
from .parallel.checkpoint import load_run, save_sharded, shard_optimizer_state
from .parallel.launch import RunInterrupted, init_process_group, launch, under_launcher
from .resume import resumed_config
from .schedule import make_schedule
from .start import StopSignals, check_start, claim_out_dir, torch_threads
from .steps import dropout_seed, flat_train_loss, loss_functions, make_mode


class TrainingDiverged(RuntimeError):
    """The loss (or the gradient norm) stopped being finite; the last checkpoint is untouched."""


@dataclass
class TrainResult:
    history: list[dict]  # one row per evaluation: step, lr, train_loss, val_loss
    params: dict
    tokenizer: Tokenizer
    model_config: GPTConfig
    out_dir: Path
    log_path: Path
    checkpoint_path: Path  # the state.json of the last checkpoint


def train(cfg: TrainConfig, progress: bool = True, *,
          overwrite: bool = False) -> TrainResult | None:
    """Train (or, with ``cfg.resume``, continue) a GPT as ``cfg`` says; see the module docstring.
    With ``cfg.threads``, torch runs on that many CPU threads, and on its previous count after.

    The run holds ``cfg.out_dir`` (``gptlab.training.checkpoint.claim_run_dir``): another run there
    at the same time is refused, naming its pid, and so is a directory that already holds a run,
    unless ``cfg.resume`` continues it or ``overwrite`` replaces it (its checkpoint stays until
    the new run's first checkpoint is complete).

    A parallel run (``cfg.parallel``) starts ``cfg.nproc`` processes with torch's elastic
    launcher (one thread each unless ``cfg.threads``) and returns rank 0's result. Under
    torchrun (or inside such a process) this process is one rank: it opens the process group
    and returns its result on rank 0, None on the others. Rank 0 alone writes the log and shows
    progress; every rank writes its shard of the checkpoints (``training/parallel/checkpoint.py``).

    Raises TrainingDiverged when the loss or gradient norm is not finite, before the update is
    applied, so the last checkpoint on disk stays the last good one. SIGINT (Ctrl-C) and
    SIGTERM stop the run after the step in progress, with a checkpoint of that step: it raises
    RunInterrupted (a KeyboardInterrupt) saying where the checkpoint is.
    """
    check_start(cfg, int(os.environ["WORLD_SIZE"]) if under_launcher() else cfg.nproc)
    with claim_out_dir(cfg, overwrite):
        if cfg.parallel != "none" and not under_launcher():
            _check_before_launch(cfg)
            try:
                return launch(_train_rank, cfg.nproc, asdict(cfg), progress,
                              threads=cfg.threads or 1, device=cfg.device)[0]
            except RunInterrupted as err:
                raise _interrupted(err.signal_number, Path(cfg.out_dir)) from None
        with torch_threads(cfg.threads), StopSignals() as stop:
            return _train(cfg, progress, stop)


def _check_before_launch(cfg: TrainConfig) -> None:
    """What every rank would refuse, refused once before any rank starts: the corpus, and a
    checkpoint to resume that is damaged or of another model or other data (reported here,
    with any changed settings, so that the ranks need not)."""
    text, source, data_sha256 = _corpus(cfg)
    if cfg.resume:
        resumed_config(cfg, load_run(cfg.out_dir), Path(cfg.out_dir), data_sha256, source,
                       report=True)


def _train_rank(settings: dict, progress: bool):
    """One rank of ``train``'s launch (a module-level function: the launcher pickles it); the
    launching process checked and reported what the ranks share."""
    cfg = TrainConfig(**settings)
    with torch_threads(cfg.threads), StopSignals() as stop:
        return _train(cfg, progress, stop, report=False)


def _corpus(cfg: TrainConfig) -> tuple[str, str, str]:
    """(text, its name for messages, its sha256): the corpus of the run."""
    text = load_text(cfg.data)
    source = EMBEDDED if cfg.data is None else str(cfg.data)
    return text, source, hashlib.sha256(text.encode("utf-8")).hexdigest()


def _interrupted(signal_number: int, out_dir: Path) -> RunInterrupted:
    """The RunInterrupted of a run that a signal stopped, naming its last checkpoint."""
    kept = (f"the checkpoint of step {read_state(out_dir)['step']} is in {out_dir}; continue "
            "with --resume" if (out_dir / STATE_FILE).is_file() else "no checkpoint was written")
    return RunInterrupted(signal_number, f"stopped by {signal.Signals(signal_number).name}: "
                                         f"{kept}")


def _train(cfg: TrainConfig, progress: bool, stop: StopSignals,
           report: bool = True) -> TrainResult | None:
    """The run of ``train``, on the threads torch has now, until it ends or ``stop`` notes a
    signal; ``report``: print what a resumed run changes (rank 0)."""
    if cfg.parallel != "none":
        init_process_group(device=cfg.device)
    rank, world_size = rank_and_world()
    lead = rank == 0  # the rank that writes the log and shows progress
    out_dir = Path(cfg.out_dir)
    log_path = out_dir / f"log.{cfg.log_format}"
    text, source, data_sha256 = _corpus(cfg)
    device = cfg.device if cfg.array_backend == "torch" else None
    rng = np.random.default_rng(cfg.seed)  # batch offsets; its state is checkpointed

    if cfg.resume:
        ckpt = load_run(out_dir, backend=cfg.array_backend, dtype=cfg.dtype, device=device)
        tokenizer, params, step = ckpt.tokenizer, ckpt.params, ckpt.step
        cfg = resumed_config(cfg, ckpt, out_dir, data_sha256, source, report=lead and report)
        model_cfg = cfg.model_config(tokenizer.vocab_size)
        rng.bit_generator.state = ckpt.state["batch_rng_state"]
        history = ckpt.state["history"]
        checkpoint_path = out_dir / STATE_FILE
    else:  # the directory's old checkpoint, if any (--overwrite), stays until a new one is in
        tokenizer = make_tokenizer(cfg, text)
        model_cfg = cfg.model_config(tokenizer.vocab_size)
        params = init_params(model_cfg, seed=cfg.seed, backend=cfg.array_backend,
                             dtype=cfg.dtype, device=device)
        step, history, checkpoint_path = 0, [], None
        if lead:
            out_dir.mkdir(parents=True, exist_ok=True)

    scaler = None  # float16's loss scale; its state goes into the checkpoints
    if cfg.precision == "float16":
        scaler = LossScaler(growth_interval=cfg.loss_scale_interval)
        if cfg.resume and ckpt.state.get("loss_scaler") is not None:
            scaler.load_state_dict(ckpt.state["loss_scaler"])
    train_loss, eval_loss = loss_functions(cfg, model_cfg, scaler)
    if cfg.fused_optimizer:  # masters, compute copies, gradients: one flat buffer each
        params = FlatParams(params, cfg.precision, decayed=decay_filter_of(cfg))
        train_loss = flat_train_loss(cfg, model_cfg, scaler)
    mode = make_mode(cfg, model_cfg, params, train_loss)
    optimizer = make_optimizer(cfg, mode.params)  # (FusedAdamW over FlatParams)
    if cfg.resume:  # moments saved whole, cut to this mode's layout
        optimizer.load_state_dict(shard_optimizer_state(mode, ckpt.optimizer_state))
        del ckpt  # the loaded arrays: the run holds what it needs of them now

    ids = encode_corpus(tokenizer, text, source)  # (N,)
    train_ids, val_ids = split_train_val(ids, cfg.block_size, cfg.val_fraction, source)
    lr_at = make_schedule(cfg.lr_schedule, lr=cfg.lr, min_lr=cfg.min_lr,
                          warmup_iters=cfg.warmup_iters,
                          decay_iters=cfg.lr_decay_iters or cfg.max_iters)

    def evaluate(step: int) -> dict:
        # every rank evaluates the same batches on the same (whole) weights
        row = {"step": step, "lr": lr_at(step),
               **batch_losses(eval_loss, mode.full_params(), {"train": train_ids, "val": val_ids},
                              cfg.batch_size, cfg.block_size, cfg.eval_iters, cfg.seed,
                              cfg.array_backend, device)}  # fmt: skip
        history.append(row)
        if lead:
            write_log(log_path, cfg.log_format, [row], append=True)
        return row

    def save(step: int) -> Path:
        extra = {"train_config": asdict(cfg), "batch_rng_state": rng.bit_generator.state,
                 "history": history, "data_source": source, "data_sha256": data_sha256,
                 "loss_scaler": None if scaler is None else scaler.state_dict()}
        if cfg.parallel != "none":
            return save_sharded(out_dir, step=step, mode=mode, optimizer=optimizer,
                                tokenizer=tokenizer, model_config=model_cfg, extra=extra)
        return save_run_checkpoint(out_dir, step=step, params=mode.params, optimizer=optimizer,
                                   tokenizer=tokenizer, model_config=model_cfg, extra=extra)

    if lead:
        write_log(log_path, cfg.log_format, history, append=False)  # drops rows past the ckpt
    if step == 0:
        evaluate(0)
    bar = tqdm(total=cfg.max_iters, initial=step, disable=not (progress and lead), desc="train",
               unit="step")
    while step < cfg.max_iters:
        lr = lr_at(step + 1)
        # a batch of (B, T) windows, the targets shifted by one
        x, y = get_batch(train_ids, cfg.batch_size, cfg.block_size, rng, cfg.array_backend, device)
        # the loss and the gradients, clipped to a global norm of at most grad_clip
        seed = {"dropout_seed": dropout_seed(cfg.seed, step)} if cfg.dropout > 0.0 else {}
        loss, grads, norm = clipped_grads(mode, x, y, cfg.grad_clip, **seed)
        # grads None: float16's scaled gradients overflowed, so no update (the scaler halved
        # the scale); the step still counts, and evaluates and checkpoints on schedule
        if grads is not None and not (math.isfinite(loss) and math.isfinite(norm)):
            bar.close()
            kept = (f"the checkpoint of step {read_state(out_dir)['step']} in {out_dir} is "
                    "untouched" if checkpoint_path else "no checkpoint had been written yet")
            raise TrainingDiverged(
                f"training diverged at step {step + 1}: loss {loss}, gradient norm {norm} "
                f"(lr {lr:.3g}). Stopped before this update; {kept}. Try a lower lr, a longer "
                "warmup or gradient clipping."
            )
        if grads is not None:  # the update
            mode.params = optimizer.step(mode.params, grads, lr=lr)
        step += 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", refresh=False)
        if step % cfg.eval_interval == 0 or step == cfg.max_iters:  # evaluate
            row = evaluate(step)
            if progress and lead:
                bar.write(f"step {step}: train {row['train_loss']:.4f}, val {row['val_loss']:.4f}")
        interval = cfg.checkpoint_interval
        stop_signal = stop.received(cfg.parallel != "none", device)  # Ctrl-C, SIGTERM; 0: none
        if (interval > 0 and step % interval == 0) or step == cfg.max_iters or stop_signal:  # save
            checkpoint_path = save(step)
        if stop_signal:
            bar.close()
            raise _interrupted(stop_signal, out_dir)
    bar.close()
    params = mode.full_params()  # a collective in ZeRO 3: every rank takes part
    if not lead:
        return None
    return TrainResult(history, params, tokenizer, model_cfg, out_dir, log_path, checkpoint_path)


__all__ = ["TrainResult", "TrainingDiverged", "train"]
