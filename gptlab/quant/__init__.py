"""Quantization: weights stored in fewer bits, and training that expects it. Book: chapter 19.

    rtn.py     one tensor: round to nearest on a grid per group (symmetric or asymmetric),
               int4 packing, a quantized linear layer, fake quantization for QAT
    gptq.py    GPTQ: round one column at a time and push the error onto the columns not yet done
    model.py   a whole model's parameters: which matrices, RTN or GPTQ, fake-quantized params

May import: the model and what it stands on (``gptlab.model``, ``gptlab.layers``,
``gptlab.backend``, ``gptlab.checks``); never training or the applications.
"""
