"""Training on many processes with torch.distributed (gloo on CPU, NCCL on GPU), driven by the
hand-written backward: each mode decides where the collectives go.

    ddp        data parallel, gradients all-reduced in buckets as the backward produces them
    zero1-3    ZeRO: optimizer state, + gradients, + parameters partitioned over the ranks
    tensor     Megatron-LM tensor parallelism          (tensor.py)
    pipeline   blocks in stages, micro-batches         (pipeline.py)

Every mode keeps the contract written down in ``base.ParallelMode``; ``mode_class(name)`` finds
a mode by the name the command line uses (``--parallel NAME``), importing its module only then.
Launching: ``launch.py``. Sharded checkpoints: ``checkpoint.py``. Book: chapter 15.

A room inside ``gptlab.training``: it may import the model and the training modules beside it
(optimizers, clipping, the checkpoint format); the loop (``training/train.py``) drives it.
"""

from __future__ import annotations

import importlib

MODES = {
    "single": ("gptlab.training.parallel.base", "Single"),
    "ddp": ("gptlab.training.parallel.ddp", "DataParallel"),
    "zero1": ("gptlab.training.parallel.zero", "ZeRO1"),
    "zero2": ("gptlab.training.parallel.zero", "ZeRO2"),
    "zero3": ("gptlab.training.parallel.zero", "ZeRO3"),
    "tensor": ("gptlab.training.parallel.tensor", "TensorParallel"),
    "pipeline": ("gptlab.training.parallel.pipeline", "PipelineParallel"),
}


def mode_class(name: str):
    """The class of the parallel mode ``name`` (a key of MODES), imported on first use."""
    if name not in MODES:
        raise ValueError(f"unknown parallel mode {name!r}: choose one of {', '.join(MODES)}")
    module_name, class_name = MODES[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        raise ValueError(f"parallel mode {name!r} is not available in this gptlab: its module "
                         f"{module_name} does not exist yet") from err
    if not hasattr(module, class_name):
        raise ValueError(f"parallel mode {name!r} is not available in this gptlab: "
                         f"{module_name} has no {class_name}")
    return getattr(module, class_name)


__all__ = ["MODES", "mode_class"]
