"""Triton kernels: each a forward/backward pair, the GPU twin of a layer in ``gptlab/layers/``.

    flash_attention.py   attention in tiles, online softmax; the backward from L and D
    layernorm.py         row statistics in one pass; dgamma, dbeta reduced in two stages
    bias_gelu.py         gelu(h + b), tanh and erf forms
    classifier.py        the tied head and the cross-entropy, chunks of tokens, vocabulary tiles
    adamw.py             AdamW on float32 master weights, writing the bf16 compute copies;
                         one launch over a model's flat buffers (gptlab.fast.FlatParams)
    reduce.py            the second stage of the column sums (dgamma, dbeta, db)
    launch.py            what the launch wrappers share: where Triton can run, the tiles' dtypes

Every launch wrapper has its twin's signature and return convention, and the twin is its test
oracle. The kernels accumulate in float32 and take float32, bfloat16 or float16 in and out. They
run compiled on CUDA tensors, and on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``
set before Triton is imported), which is how ``make test`` checks them on a machine with no GPU.
``launch.triton_unavailable()`` says why they cannot run here (None when they can); this package
imports Triton only in its kernel modules, so ``import gptlab`` never needs it.

May import: torch, triton, ``gptlab.layers`` and ``gptlab.checks``. Book: chapter 23.
"""
