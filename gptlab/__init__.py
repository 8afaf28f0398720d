"""gptlab: a GPT with every backward pass written by hand, on NumPy and torch from one source.

The names most readers need are here; each lives in its own module:

- the model (``gptlab.model``): ``GPTConfig``, ``init_params``, ``gpt_forward``, ``gpt_backward``;
- gradient checking (``gptlab.gradcheck``): ``check_layer``, ``check_model``;
- generation (``gptlab.training.sample``): ``generate``;
- Hugging Face interop (``gptlab.interop``): ``from_hf``, ``to_hf`` (GPT-2) and
  ``from_hf_llama``, ``to_hf_llama`` (LLaMA-style configs);
- the package's own code, for the chapters (``gptlab.course.source``): ``show_source``.

The rest is in rooms by concern (a picture with the arrows allowed between them: the section
"Rooms" of docs/CONVENTIONS.md): ``layers/``, ``kernels/``, ``tokenizers/``, ``training/``
(with ``parallel/``), ``quant/``, ``alignment/``, ``data_pipeline/``, ``course/``; torch
integration is ``gptlab.autograd``, the fused path ``gptlab.fast``.
"""

import importlib

# name -> the module that defines it; imported on first use (PEP 562), so that ``import gptlab``
# and ``python -m gptlab --help`` do not load torch
_HOMES = {
    "GPTConfig": "config",
    "check_layer": "gradcheck", "check_model": "gradcheck",
    "from_hf": "interop", "from_hf_llama": "interop", "to_hf": "interop", "to_hf_llama": "interop",
    "count_params": "model", "gpt_backward": "model", "gpt_forward": "model",
    "init_params": "model", "loss_and_grads": "model", "param_shapes": "model",
    "generate": "training.sample",
    "show_source": "course.source",
}  # fmt: skip


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'gptlab' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


__version__ = "0.1.0"

__all__ = [
    "GPTConfig",
    "check_layer",
    "check_model",
    "count_params",
    "from_hf",
    "from_hf_llama",
    "generate",
    "gpt_backward",
    "gpt_forward",
    "init_params",
    "loss_and_grads",
    "param_shapes",
    "show_source",
    "to_hf",
    "to_hf_llama",
]
