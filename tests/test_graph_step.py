"""GraphStep (gptlab.fast): FlatStep's forward and backward as one replayed CUDA graph.

On a machine without CUDA the same body runs eagerly through GraphStep's buffers: these tests
check that it gives FlatStep's losses and gradients step after step (with the fused AdamW writing
the weights in between, as in training), that the body reads nothing back to the host (what a
graph cannot hold), and the refusals. The Triton kernels run under the interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py). On CUDA the last tests capture a real graph.
Tolerances: the two steps run the same operations on the same numbers, so their losses and
gradients can differ only where a sum is taken in another order: the bound SAME_OPERATIONS
(tests/bounds.py), relative to their size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from bounds import assert_relative, roundoff

from conftest import requires_cuda

triton = pytest.importorskip("triton", reason="Triton does not import on this machine")

from gptlab import GPTConfig, init_params  # noqa: E402
from gptlab.fast import FlatParams, FlatStep, GraphStep  # noqa: E402
from gptlab.training.config import TrainConfig  # noqa: E402
from gptlab.training.data import embedded_corpus  # noqa: E402
from gptlab.training.decode import HostReads  # noqa: E402
from gptlab.training.optim import FusedAdamW, matrices_only  # noqa: E402
from gptlab.training.train import train  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=23, block_size=16, bias=False,
                gelu="erf")  # fmt: skip
BODIES = {"triton": {"kernels": "triton"},
          "triton, flash + chunked": {"kernels": "triton", "attention": "flash",
                                      "classifier": "chunked"},
          "torch ops": {"kernels": "torch"}}  # fmt: skip


def flat_params(precision: str, device: str = DEVICE) -> FlatParams:
    params = init_params(CFG, seed=0, backend="torch", device=device)
    return FlatParams(params, precision, decayed=matrices_only)


def batches(n: int, B: int = 2, T: int = 16, seed: int = 0, device: str = DEVICE):
    rng = np.random.default_rng(seed)
    return [tuple(torch.tensor(rng.integers(0, CFG.vocab_size, (B, T)), device=device)
                  for _ in "xy") for _ in range(n)]  # fmt: skip


SAME_OPERATIONS = roundoff("float32", 8, why="the same operations on the same numbers: at most "
                           "a short sum in another order")


def run(step_class, precision: str, options: dict, device: str = DEVICE):
    """Three steps, each followed by a fused AdamW update: [(loss, flat gradient copy)]."""
    flat = flat_params(precision, device)
    step, optimizer = step_class(CFG, precision, **options), FusedAdamW(flat)
    history = []
    for x, y in batches(3, device=device):
        loss, grads = step(flat, x, y)
        history.append((loss, flat.grad.clone()))
        optimizer.step(flat, grads, lr=1e-2)
    return history


@pytest.mark.roundoff
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("options", BODIES.values(), ids=BODIES)
def test_graph_step_gives_flat_steps_losses_and_gradients(precision, options):
    want, got = run(FlatStep, precision, options), run(GraphStep, precision, options)
    for (loss, grad), (want_loss, want_grad) in zip(got, want, strict=True):
        assert_relative(loss, want_loss, SAME_OPERATIONS, "graph vs flat step, losses")
        assert_relative(grad, want_grad, SAME_OPERATIONS, "graph vs flat step, gradients")


@pytest.mark.parametrize("options", [BODIES["triton"], BODIES["triton, flash + chunked"],
                                     BODIES["torch ops"]], ids=list(BODIES))  # fmt: skip
def test_the_body_reads_nothing_back_to_the_host(options):
    flat = flat_params("float32")
    step = GraphStep(CFG, "float32", **options)
    x, y = batches(1)[0]
    step(flat, x, y)  # builds the buffers and the body
    with HostReads() as reads:
        step.body()
    assert reads.ops == []


def test_a_new_batch_shape_or_new_parameters_build_new_buffers():
    step = GraphStep(CFG, "float32", kernels="triton")
    flat = flat_params("float32")
    (x, y), (x_short, y_short) = batches(1)[0], batches(1, T=8, seed=1)[0]
    first, _ = step(flat, x, y)
    buffers = step.idx
    step(flat, x_short, y_short)
    assert step.idx is not buffers and tuple(step.idx.shape) == (2, 8)
    again, _ = step(flat_params("float32"), x, y)  # other FlatParams, the same values
    assert_relative(again, first, SAME_OPERATIONS, "graph step on other buffers, loss")


def test_refusals_name_the_problem():
    with pytest.raises(ValueError, match="float16's loss scale"):
        GraphStep(CFG, "float16", kernels="triton")
    with pytest.raises(ValueError, match="attention='flash' runs a layer that checks its inputs"):
        GraphStep(CFG, "float32", kernels="torch", attention="flash")
    step = GraphStep(CFG, "bfloat16", kernels="triton")
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="GraphStep runs on FlatParams of precision='bfloat16'"):
        step(flat_params("float32"), x, y)
    with pytest.raises(ValueError, match="targets holds token id .* outside the vocabulary"):
        step(flat_params("bfloat16"), x, y + CFG.vocab_size)  # checked before the body


RUN = dict(n_layer=1, n_head=2, n_embd=16, block_size=8, batch_size=2, eval_iters=1,
           warmup_iters=1, lr=1e-2, grad_clip=0.5, fused=True, kernels="triton", threads=1,
           max_iters=3, eval_interval=1)  # fmt: skip


@pytest.mark.roundoff
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_a_run_with_cuda_graph_has_the_losses_of_one_without(tmp_path, precision):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(embedded_corpus()[:5_000], encoding="utf-8")
    histories = {}
    for graph in (False, True):
        cfg = TrainConfig(**RUN, data=str(corpus), precision=precision, device=DEVICE,
                          cuda_graph=graph, out_dir=str(tmp_path / str(graph)))  # fmt: skip
        histories[graph] = train(cfg, progress=False).history
    got, want = histories[True], histories[False]
    assert [row["step"] for row in got] == [row["step"] for row in want] == [0, 1, 2, 3]
    for row, want_row in zip(got, want, strict=True):
        for split in ("train_loss", "val_loss"):
            assert_relative(row[split], want_row[split], SAME_OPERATIONS,
                            "graph vs flat run, losses", split)


@pytest.mark.parametrize("change, match", [
    ({"kernels": "torch"}, "cuda_graph=True replays the step of the fused AdamW"),
    ({"optimizer": "sgd"}, "cuda_graph=True replays the step of the fused AdamW"),
    ({"precision": "float16"}, "float16's changing loss scale"),
])  # fmt: skip
def test_a_run_config_refuses_what_a_graph_cannot_replay(change, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**{**RUN, "device": DEVICE, "cuda_graph": True, **change})


@requires_cuda
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_captured_graph_gives_flat_steps_losses_and_gradients(precision):
    want = run(FlatStep, precision, BODIES["triton"], "cuda")
    got = run(GraphStep, precision, BODIES["triton"], "cuda")
    for (loss, grad), (want_loss, want_grad) in zip(got, want, strict=True):
        assert_relative(loss, want_loss, SAME_OPERATIONS, "graph vs flat step, losses")
        assert_relative(grad, want_grad, SAME_OPERATIONS, "graph vs flat step, gradients")
