"""Training a model, and what a run needs around the loop. Book: chapters 10-16.

    train.py        the loop (``train(TrainConfig(...))``): batch, loss and gradients, clip,
                    update, evaluate, save; each concern below is one call away
    config.py       ``TrainConfig``: a run's settings, each the help of its command-line option
    start.py        before the run: the checks, the claim on its directory, its CPU threads
    steps.py        one step's loss and gradients: plain, fused or autograd; one process or a mode
    resume.py       what a resumed run must match and what it may change
    log.py          the loss log (csv or jsonl), read back and plotted
    optim.py        AdamW and SGD: the update equations, for dicts of arrays and for torch;
                    FusedAdamW, AdamW as one Triton launch over flat buffers
    schedule.py     learning-rate schedules, the global gradient norm and clipping
    data.py         the corpus, the train/validation split, random (B, T) batches, the tokenizer
    checkpoint.py   safetensors + JSON files: one file, or a run directory with exact resume
    sample.py       generation: the KV cache, temperature, top-k, top-p
    decode.py       generation in steps of one fixed shape, replayed as a CUDA graph on a GPU
    metrics.py      losses per split, perplexity, bits per character, calibration
    scaling.py      parameter and FLOP counts, GPT-3's sizes, scaling laws, memory per rank
    parallel/       the same step on many processes (launch, DDP, ZeRO, tensor, pipeline)

May import: the model and everything below it, the fused path (``gptlab.fast``, and through it
``gptlab.kernels``: optim.py imports the AdamW kernel when FusedAdamW runs), the reference
model (``gptlab.reference``) and ``gptlab.tokenizers``. The applications (alignment, course,
data_pipeline, the command line) import this room, never the other way.
"""
