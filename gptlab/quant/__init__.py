"""Quantization: weights stored in fewer bits, and training that expects it. Book: chapter 19.

    rtn.py     one tensor: round to nearest on a grid per group (symmetric or asymmetric),
               int4 packing, a quantized linear layer, fake quantization for QAT
    gptq.py    GPTQ: round one column at a time and push the error onto the columns not yet done
    model.py   a whole model's parameters: which matrices, RTN or GPTQ, fake-quantized params

May import: the model and what it stands on (``gptlab.model``, ``gptlab.layers``,
``gptlab.backend``, ``gptlab.checks``); never training or the applications.
"""

import importlib
import warnings


def __getattr__(name: str):
    """The old module ``gptlab.quant`` is this package's ``rtn`` now: its public names still
    resolve here, with a DeprecationWarning, until gptlab 0.3 (docs/API.md)."""
    rtn = importlib.import_module(".rtn", __name__)
    if name.startswith("_") or not hasattr(rtn, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"gptlab.quant.{name} moved to gptlab.quant.rtn.{name}; the old path works until "
                  "gptlab 0.3 (docs/API.md)", DeprecationWarning, stacklevel=2)
    return getattr(rtn, name)
