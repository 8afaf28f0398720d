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
integration is ``gptlab.autograd``, the fused path ``gptlab.fast``. The public API (these
names and the module paths that stay) is declared in docs/API.md.
"""

import importlib
import importlib.machinery
import sys
import types
import warnings

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


# old module -> its home(s) since the rooms (docs/API.md, "Moved modules"); a package's
# submodules follow it (gptlab.parallel.ddp -> gptlab.training.parallel.ddp)
_MOVED = {
    "bpe": ("tokenizers.bpe",), "tokenizer": ("tokenizers.char",),
    "tokenizer_base": ("tokenizers.base",),
    "checkpoint": ("training.checkpoint",), "data": ("training.data",),
    "metrics": ("training.metrics",), "optim": ("training.optim",),
    "parallel": ("training.parallel",), "sample": ("training.sample",),
    "scaling": ("training.scaling",), "schedule": ("training.schedule",),
    "train": ("training.train", "training.log"),
    "gptq": ("quant.gptq",), "quant_model": ("quant.model",),
    "distill": ("alignment.distill",), "rlhf": ("alignment.rlhf",),
    "errata": ("course.errata",), "grading": ("course.grading",), "source": ("course.source",),
}  # fmt: skip
_REMOVED_IN = "0.3"


class _MovedModules:
    """The import hook (a finder and its loader) that keeps the old paths of ``_MOVED`` working
    for one release: ``import gptlab.bpe`` warns (DeprecationWarning, naming the new path) and
    gives the module ``gptlab.tokenizers.bpe`` itself; an old module split in two (``train``)
    gives a module holding the public names of both."""

    @staticmethod
    def new_paths(fullname: str) -> list[str]:
        """"gptlab.parallel.ddp" -> ["gptlab.training.parallel.ddp"]; [] if it did not move."""
        package, _, old = fullname.partition(".")
        head, dot, rest = old.partition(".")
        if package != __name__ or head not in _MOVED:
            return []
        return [f"{__name__}.{home}{dot}{rest}" for home in _MOVED[head]]

    def find_spec(self, fullname, path=None, target=None):
        if not self.new_paths(fullname):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = self.new_paths(spec.name)
        warnings.warn(f"{spec.name} moved to {' and '.join(new)}; the old path works until "
                      f"gptlab {_REMOVED_IN} (docs/API.md)", DeprecationWarning, stacklevel=2)
        homes = [importlib.import_module(name) for name in new]
        if len(homes) == 1:
            return homes[0]
        module = types.ModuleType(spec.name, homes[0].__doc__)
        for home in reversed(homes):  # the first home wins a name both hold
            module.__dict__.update((k, v) for k, v in vars(home).items() if not k.startswith("_"))
        return module

    def exec_module(self, module):
        pass  # the module is the new one, already run


# first, ahead of the path finder, which would load gptlab.parallel.ddp a second time
sys.meta_path.insert(0, _MovedModules())


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
