"""Pipeline parallelism: the schedules' properties (every op once, each forward before its
backward, dependencies respected, no deadlock, the bubble and the stored activations), training
at world sizes 2 and 4 under both schedules equal to one process (float64 to 1e-12, float32 to
1e-6), the executor's own measurements, and the errors.

The multi-process tests spawn gloo ranks on 127.0.0.1 through ``parallel_ranks.run_ranks``.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.config import GPTConfig
from gptlab.model import init_params, loss_and_grads
from gptlab.training.parallel.demo import batch
from gptlab.training.parallel.pipeline import (
    SCHEDULES,
    PipelineParallel,
    bubble_fraction,
    check_schedule,
    dependencies,
    idle_fraction,
    peak_activations,
    simulate,
    split_layers,
)
from parallel_ranks import assert_equal_to_one_process, run_ranks, train_in_both_dtypes

sizes = dict(n_stages=st.integers(1, 6), n_micro=st.integers(1, 8))


# --- the schedules -------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(SCHEDULES)), **sizes)
def test_schedules_run_every_op_once_forward_before_backward(name, n_stages, n_micro):
    schedule = SCHEDULES[name](n_stages, n_micro)
    check_schedule(schedule, n_stages, n_micro)  # raises on any violation or a deadlock
    times = simulate(schedule)
    for (stage, micro, op), (start, _) in times.items():
        for need in dependencies(stage, micro, op, n_stages):
            assert times[need][1] <= start, f"{(stage, micro, op)} starts before {need} ends"


@settings(max_examples=25, deadline=None, derandomize=True)
@given(name=st.sampled_from(sorted(SCHEDULES)), t_forward=st.floats(0.5, 2.0),
       t_backward=st.floats(0.5, 3.0), **sizes)  # fmt: skip
def test_bubble_is_the_formula_on_an_ideal_clock(name, n_stages, n_micro, t_forward, t_backward):
    """With equal stages every stage idles (p-1)/(m+p-1) of the step, under either schedule."""
    times = simulate(SCHEDULES[name](n_stages, n_micro), t_forward, t_backward)
    for idle in idle_fraction(times, n_stages):
        assert abs(idle - bubble_fraction(n_stages, n_micro)) < 1e-9


@settings(max_examples=25, deadline=None, derandomize=True)
@given(**sizes)
def test_gpipe_stores_m_activations_and_1f1b_at_most_p(n_stages, n_micro):
    gpipe = SCHEDULES["gpipe"](n_stages, n_micro)
    one_f_one_b = SCHEDULES["1f1b"](n_stages, n_micro)
    assert [peak_activations(ops) for ops in gpipe] == [n_micro] * n_stages
    assert [peak_activations(ops) for ops in one_f_one_b] == [
        min(n_stages - s, n_micro) for s in range(n_stages)]


def test_a_schedule_that_deadlocks_is_refused():
    """Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1 forward, but
    stage 1 will only run backward after forwarding micro-batch 1: each waits for the other."""
    schedule = [[(0, 0, "F"), (0, 0, "B"), (0, 1, "F"), (0, 1, "B")],
                [(1, 0, "F"), (1, 1, "F"), (1, 0, "B"), (1, 1, "B")]]  # fmt: skip
    with pytest.raises(ValueError, match="deadlocks"):
        check_schedule(schedule, 2, 2)


def test_a_backward_before_its_forward_is_refused():
    schedule = [[(0, 0, "B"), (0, 0, "F")]]
    with pytest.raises(ValueError, match="backward of micro-batch 0 before its forward"):
        check_schedule(schedule, 1, 1)


def test_a_missing_op_is_refused():
    with pytest.raises(ValueError, match="stage 0 must run F and B"):
        check_schedule([[(0, 0, "F")]], 1, 1)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(n_layer=st.integers(1, 12), n_stages=st.integers(1, 12))
def test_layers_split_into_consecutive_nearly_equal_stages(n_layer, n_stages):
    if n_stages > n_layer:
        with pytest.raises(ValueError, match=f"more stages \\({n_stages}\\) than layers"):
            split_layers(n_layer, n_stages)
        return
    stages = split_layers(n_layer, n_stages)
    assert [layer for stage in stages for layer in stage] == list(range(n_layer))
    assert max(map(len, stages)) - min(map(len, stages)) <= 1


# --- the mode: equality after 20 updates, and the executor's measurements ----------------------

CFG = GPTConfig(n_layer=4, n_head=2, n_embd=8, vocab_size=16, block_size=4)
RUN = (CFG, 20, 4, 4)  # the config, 20 updates, batches of (4, 4) tokens
N_MICRO = 4


def _train_both_schedules():
    return {name: train_in_both_dtypes("pipeline", RUN,
                                       dict(n_micro=N_MICRO, schedule=name))
            for name in SCHEDULES}  # fmt: skip


@pytest.mark.roundoff
@pytest.mark.parametrize("world_size", [2, 4])
def test_pipeline_training_equals_one_process(world_size):
    ranks = run_ranks(_train_both_schedules, world_size, timeout=300)
    for name in SCHEDULES:
        assert_equal_to_one_process([rank[name] for rank in ranks], *RUN)


UNTIED = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=4,
                   tie_embeddings=False)  # fmt: skip


def _one_step_measured():
    """Each schedule's measurements of one step, and an untied model's loss and gradients."""
    measured = {}
    for schedule in SCHEDULES:
        model = PipelineParallel(CFG, init_params(CFG, backend="torch", dtype="float64"),
                                 n_micro=N_MICRO, schedule=schedule)  # fmt: skip
        model.loss_and_grads(*batch(CFG, 4, 4))
        measured[schedule] = model.last_step
    untied = PipelineParallel(UNTIED, init_params(UNTIED, backend="torch", dtype="float64"))
    loss, grads = untied.loss_and_grads(*batch(UNTIED, 4, 4))
    return measured, (loss, untied.unshard(grads))


@functools.cache
def _two_ranks_one_step():
    """One spawn of ``_one_step_measured`` on 2 ranks, shared by the tests that read it."""
    return run_ranks(_one_step_measured, 2)


def test_the_executor_runs_the_schedule_and_holds_its_activations():
    """The ops ran in the schedule's order, one after another, and the stage held as many
    micro-batches at once as the schedule says (m under GPipe, p - s under 1F1B)."""
    ranks = [measured for measured, _ in _two_ranks_one_step()]
    for schedule, stage, step in [(name, s, r[name]) for name in SCHEDULES
                                  for s, r in enumerate(ranks)]:  # fmt: skip
        expected = SCHEDULES[schedule](2, N_MICRO)
        assert [(micro, op) for micro, op, _, _ in step["timeline"]] == [
            (micro, op) for _, micro, op in expected[stage]]
        ends = [end for _, _, _, end in step["timeline"]]
        starts = [start for _, _, start, _ in step["timeline"]]
        assert all(start >= end for start, end in zip(starts[1:], ends[:-1]))
        assert step["peak_activations"] == peak_activations(expected[stage])
        assert 0.0 <= step["idle"] < 1.0 and step["span"] >= step["busy"]


def test_an_untied_head_on_two_stages_equals_one_process():
    """No wte exchange: lm_head lives on the last stage, wte on the first."""
    loss, grads = loss_and_grads(init_params(UNTIED, backend="torch", dtype="float64"),
                                 *batch(UNTIED, 4, 4), UNTIED)  # fmt: skip
    for _, (rank_loss, rank_grads) in _two_ranks_one_step():
        assert abs(rank_loss - loss) < 1e-12 and set(rank_grads) == set(grads)
        for name, g in grads.items():
            torch.testing.assert_close(rank_grads[name], g, rtol=0, atol=1e-12)


@pytest.mark.parametrize("fields", [{}, dict(tie_embeddings=False), dict(bias=False)])
def test_one_stage_is_the_whole_model(fields):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=4, **fields)
    params = init_params(cfg, backend="torch", dtype="float64")
    loss, grads = loss_and_grads(params, *batch(cfg, 4, 4), cfg)
    model = PipelineParallel(cfg, params, n_micro=2, schedule="gpipe")
    mode_loss, mode_grads = model.loss_and_grads(*batch(cfg, 4, 4))
    assert abs(mode_loss - loss) < 1e-12
    for name, g in grads.items():
        torch.testing.assert_close(mode_grads[name], g, rtol=0, atol=1e-12)
    want = float(torch.sqrt(sum(torch.sum(g * g) for g in grads.values())))
    assert abs(model.grad_norm(mode_grads) - want) < 1e-12


# --- errors ------------------------------------------------------------------------------------


def test_more_stages_than_layers_is_refused():
    with pytest.raises(ValueError, match=r"more stages \(4\) than layers \(2\)"):
        split_layers(2, 4)


def test_a_batch_that_does_not_split_into_micro_batches_is_refused():
    model = PipelineParallel(CFG, init_params(CFG, backend="torch", dtype="float64"), n_micro=3)
    with pytest.raises(ValueError, match=r"batch size \(4\) must be divisible by n_micro \(3\)"):
        model.loss_and_grads(*batch(CFG, 4, 4))


def test_an_unknown_schedule_is_refused():
    params = init_params(CFG, backend="torch", dtype="float64")
    with pytest.raises(ValueError, match="schedule must be one of"):
        PipelineParallel(CFG, params, schedule="zigzag")


@pytest.mark.parametrize("fields", [dict(mlp="moe", n_expert=2), dict(position="sinusoidal"),
                                    dict(dropout=0.1)])  # fmt: skip
def test_other_models_are_refused(fields):
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=16, block_size=4, **fields)
    with pytest.raises(ValueError, match="pipeline parallel supports"):
        PipelineParallel(cfg, init_params(cfg, backend="torch", dtype="float64"))
