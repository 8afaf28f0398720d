"""ZeRO 1, 2, 3 on 2 and 4 processes: equal to one process after 20 updates (float64 to 1e-12,
float32 to test_parallel_ddp.py's derived bound, and with gradient accumulation), and the bytes
each rank holds equal the ZeRO paper's count (Rajbhandari et al. 2020, section 5.1) exactly
when every tensor splits evenly."""

from __future__ import annotations

import pytest
import torch
from test_parallel_ddp import check_equal_to_one_process, reference, run_cases  # noqa: F401

from gptlab.config import GPTConfig
from gptlab.model import count_params, init_params
from gptlab.training.optim import AdamW
from gptlab.training.parallel import mode_class
from gptlab.training.parallel.launch import launch
from gptlab.training.parallel.zero import from_rank_major, rank_major

CASES = [(mode, dtype, 1) for mode in ("zero1", "zero2", "zero3")
         for dtype in ("float64", "float32")] + [("zero2", "float64", 2), ("zero3", "float64", 2),
                                                 ("zero3", "llama", 1)]
# every first dimension divides by 2 and 4, so the shards have no padding
EVEN = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=8)
STAGES = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}


def memory_after_one_update(mode_name: str) -> dict:
    """The bytes one rank holds after an update of EVEN in float32 (``mode.memory``)."""
    mode = mode_class(mode_name)(EVEN, init_params(EVEN, seed=0, backend="torch"))
    optimizer = AdamW(mode.params)
    idx = torch.arange(4 * 8).reshape(4, 8) % EVEN.vocab_size  # (B, T), B divides by 4
    _, grads = mode.loss_and_grads(idx, torch.roll(idx, -1, dims=1))
    mode.params = optimizer.step(mode.params, grads)
    return mode.memory(optimizer)


def run_zero(cases):
    """On every rank: each case's losses and weights, and each mode's memory after an update."""
    return run_cases(cases), {name: memory_after_one_update(name) for name in STAGES}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_results(request):
    return request.param, launch(run_zero, request.param, CASES, timeout_s=60)


@pytest.mark.roundoff
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-accum{c[2]}")
def test_weights_equal_one_process(world_results, reference, case):  # noqa: F811
    check_equal_to_one_process([results for results, _ in world_results[1]], reference, case)


@pytest.mark.parametrize("mode_name", list(STAGES))
def test_memory_per_rank_is_the_papers_count(world_results, mode_name):
    """Ψ parameters of 4 bytes: params 4Ψ (stage 3: 4Ψ/W), grads 4Ψ (stages 2, 3: 4Ψ/W),
    AdamW's m and v 8Ψ (stages 1-3: 8Ψ/W)."""
    world_size, per_rank = world_results
    psi, stage = count_params(EVEN), STAGES[mode_name]
    expected = {"params": 4 * psi / (world_size if stage >= 3 else 1),
                "grads": 4 * psi / (world_size if stage >= 2 else 1),
                "optimizer": 8 * psi / (world_size if stage >= 1 else 1)}
    expected["total"] = sum(expected.values())
    for rank, (_, memory) in enumerate(per_rank):
        assert memory[mode_name] == expected, f"rank {rank} of {world_size}"


def test_rank_major_round_trip():
    """A bucket laid out rank by rank gives back the tensors, padding rows dropped."""
    tensors = [torch.arange(13 * 3.0).reshape(13, 3), torch.arange(5.0), torch.ones(4, 2, 2)]
    buffer = rank_major(tensors, 4)  # (4, S)
    assert buffer.shape == (4, 4 * 3 + 2 + 1 * 4)
    assert torch.equal(buffer[1, :12], torch.arange(12, 24.0))  # rows 4-7 of the first tensor
    for got, want in zip(from_rank_major(buffer, [tuple(t.shape) for t in tensors]), tensors):
        assert torch.equal(got, want)
