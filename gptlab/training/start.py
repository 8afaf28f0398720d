"""How a run starts and stops: the checks before any process starts, the claim on its
directory, the launch of its ranks, its CPU threads, and the signals (Ctrl-C, SIGTERM) that stop
it after a step. Book: chapters 11 and 15.
"""

from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path


from ..config import check_device
from .checkpoint import claim_run_dir
from .config import TrainConfig
from .parallel import mode_class
from .parallel.launch import under_launcher
from .parallel.pipeline import check_pipeline_config
from .parallel.tensor import check_tensor_config


CLAIMED_ENV = "GPTLAB_RUN_DIR_CLAIMED"  # set by the launching process that holds the lock


def claim_out_dir(cfg: TrainConfig, overwrite: bool):
    """The claim on ``cfg.out_dir`` this process takes: the launching process (or one process)
    takes it for the whole run and tells its ranks so; under torchrun rank 0 takes it."""
    out_dir = str(Path(cfg.out_dir).resolve())
    if under_launcher() and (os.environ["RANK"] != "0" or os.environ.get(CLAIMED_ENV) == out_dir):
        return nullcontext()
    held = claim_run_dir(out_dir, resume=cfg.resume, overwrite=overwrite)
    if cfg.parallel == "none" or under_launcher():
        return held
    return _telling_ranks(held, out_dir)


@contextmanager
def _telling_ranks(held, out_dir: str):
    """The claim ``held``, with CLAIMED_ENV set for the ranks that launch starts meanwhile."""
    with held:
        before = os.environ.get(CLAIMED_ENV)
        os.environ[CLAIMED_ENV] = out_dir
        try:
            yield
        finally:
            if before is None:
                del os.environ[CLAIMED_ENV]
            else:
                os.environ[CLAIMED_ENV] = before


@contextmanager
def torch_threads(threads: int | None):
    """torch on ``threads`` CPU threads inside the block (None: as it is), as before after it."""
    if threads is None:
        yield
        return
    import torch

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(threads_before)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Inside the ``with`` block, SIGINT (Ctrl-C) and SIGTERM do not end the process: they are
    noted, and the training loop asks ``received()`` after each step, saves and stops. Outside
    the main thread (where Python delivers no signals) it notes nothing."""

    def __init__(self):
        self.signal_number = 0  # the last signal noted (0: none)
        self.handlers = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self.handlers = {number: signal.signal(number, self._note) for number in STOP_SIGNALS}
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self.handlers.items():
            signal.signal(number, handler)

    def _note(self, number: int, frame) -> None:
        self.signal_number = number

    def received(self, across_ranks: bool = False, device=None) -> int:
        """The signal that asks the run to stop (0: none); ``across_ranks``: one that came to
        any rank of the process group (a collective, so that all ranks save the same step)."""
        if not across_ranks:
            return self.signal_number
        import torch
        import torch.distributed as dist

        number = torch.tensor([self.signal_number], device=device or "cpu")
        dist.all_reduce(number, op=dist.ReduceOp.MAX)  # a signal noted meanwhile counts next step
        return int(number.item())


def check_start(cfg: TrainConfig, world_size: int) -> None:
    """What ``cfg`` asks of this machine and of ``world_size`` ranks, checked before any process
    starts (ValueError naming the option): the device, and a parallel mode that can split this
    model and batch over the ranks."""
    check_device(cfg.device, ranks=world_size if cfg.parallel != "none" else 1)
    if cfg.parallel == "none":
        return
    mode_class(cfg.parallel)  # a mode this gptlab lacks
    model_cfg = cfg.model_config(vocab_size=world_size)  # the tokenizer comes later: any size
    try:
        if cfg.parallel == "tensor":
            check_tensor_config(model_cfg, world_size)
        elif cfg.parallel == "pipeline":
            check_pipeline_config(model_cfg, world_size, batch_size=cfg.batch_size)
    except ValueError as err:
        raise ValueError(f"--parallel {cfg.parallel} on {world_size} ranks (--nproc): "
                         f"{err}") from None


__all__ = ["CLAIMED_ENV", "StopSignals", "check_start", "claim_out_dir", "torch_threads"]
