"""gptlab: a GPT with every backward pass written by hand, on NumPy and torch from one source.

The names most readers need are here; each lives in its own module:

- the model (``gptlab.model``): ``GPTConfig``, ``init_params``, ``gpt_forward``, ``gpt_backward``;
- gradient checking (``gptlab.gradcheck``): ``check_layer``, ``check_model``;
- generation (``gptlab.sample``): ``generate``;
- Hugging Face interop (``gptlab.interop``): ``from_hf``, ``to_hf`` (GPT-2) and
  ``from_hf_llama``, ``to_hf_llama`` (LLaMA-style configs);
- the package's own code, for the chapters (``gptlab.source``): ``show_source``.

The layers are in ``gptlab.layers``, torch integration in ``gptlab.autograd``, training in
``gptlab.train``.
"""

from .config import GPTConfig
from .gradcheck import check_layer, check_model
from .interop import from_hf, from_hf_llama, to_hf, to_hf_llama
from .model import (
    count_params,
    gpt_backward,
    gpt_forward,
    init_params,
    loss_and_grads,
    param_shapes,
)
from .sample import generate
from .source import show_source

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
