"""Tensor parallelism: the conjugate operators f and g and the parallel layers checked as plain
functions at world size 1 (finite differences, autograd, equal to the unsplit layers), then across
2 ranks against the single-process layers, then the whole mode: 20 AdamW updates at world sizes
2 and 4 equal to one process (float64 to 1e-12, float32 to 1e-6), and the errors.

The multi-process tests spawn gloo ranks on 127.0.0.1 through ``parallel_ranks.run_ranks``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from gptlab.config import GPTConfig
from gptlab.gradcheck import check_layer
from gptlab.layers.attention import attention_backward, attention_forward
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.embedding import embedding_backward, embedding_forward
from gptlab.layers.mlp import mlp_backward, mlp_forward
from gptlab.model import init_params, loss_and_grads
from gptlab.training.parallel.demo import batch
from gptlab.training.parallel.tensor import (
    TensorParallel,
    check_tensor_config,
    f_backward,
    f_forward,
    g_backward,
    g_forward,
    parallel_attention_backward,
    parallel_attention_forward,
    parallel_mlp_backward,
    parallel_mlp_forward,
    shard_param,
    unshard_param,
    vocab_cross_entropy_backward,
    vocab_cross_entropy_forward,
    vocab_embedding_backward,
    vocab_embedding_forward,
)
from parallel_ranks import assert_equal_to_one_process, run_ranks, train_in_both_dtypes

B, T, C, NH, V = 2, 3, 8, 4, 12
ORACLES = ("finite_differences", "autograd")


def _inputs(seed: int = 0) -> dict:
    """Seeded float64 NumPy inputs of the layers (full, unsplit weights)."""
    rng = np.random.default_rng(seed)
    return dict(
        x=rng.normal(size=(B, T, C)), w_attn=rng.normal(size=(C, 3 * C)) * 0.3,
        b_attn=rng.normal(size=(3 * C,)), w_proj=rng.normal(size=(C, C)) * 0.3,
        b_proj=rng.normal(size=(C,)), w_fc=rng.normal(size=(C, 4 * C)) * 0.3,
        b_fc=rng.normal(size=(4 * C,)), w_out=rng.normal(size=(4 * C, C)) * 0.3,
        wte=rng.normal(size=(V, C)), logits=rng.normal(size=(B, T, V)),
        idx=rng.integers(0, V, size=(B, T)), targets=rng.integers(0, V, size=(B, T)),
        dy=rng.normal(size=(B, T, C)),
    )  # fmt: skip


# --- world size 1: the plain functions ---------------------------------------------------------


@pytest.mark.parametrize("oracle", ORACLES)
@pytest.mark.parametrize("op", ["f", "g"])
def test_conjugate_operators_at_world_size_one(op, oracle):
    """With one rank f and g are the identity both ways: their backward passes dy through."""
    forward, backward = {"f": (f_forward, f_backward), "g": (g_forward, g_backward)}[op]
    x = _inputs()["x"]
    result = check_layer(forward, backward, x, oracle=oracle)
    result.assert_ok()
    y, cache = forward(x)
    assert y is x and backward(x, cache)[0] is x


@pytest.mark.parametrize("oracle", ORACLES)
def test_parallel_layers_at_world_size_one(oracle):
    a = _inputs()
    cases = [
        (parallel_attention_forward, parallel_attention_backward,
         (a["x"], a["w_attn"], a["b_attn"], a["w_proj"], a["b_proj"]), dict(n_head=NH)),
        (parallel_mlp_forward, parallel_mlp_backward,
         (a["x"], a["w_fc"], a["b_fc"], a["w_out"], a["b_proj"]), {}),
        (vocab_embedding_forward, vocab_embedding_backward, (a["idx"], a["wte"]),
         dict(vocab_start=0)),
        (vocab_cross_entropy_forward, vocab_cross_entropy_backward,
         (a["logits"], a["targets"]), dict(vocab_start=0)),
    ]  # fmt: skip
    for forward, backward, args, hyperparams in cases:
        check_layer(forward, backward, *args, oracle=oracle, **hyperparams).assert_ok()


def test_parallel_layers_at_world_size_one_equal_the_layers():
    a = _inputs()
    pairs = [
        (parallel_attention_forward(a["x"], a["w_attn"], a["b_attn"], a["w_proj"], a["b_proj"],
                                    n_head=NH),
         attention_forward(a["x"], a["w_attn"], a["b_attn"], a["w_proj"], a["b_proj"], n_head=NH),
         parallel_attention_backward, attention_backward, a["dy"]),
        (parallel_mlp_forward(a["x"], a["w_fc"], a["b_fc"], a["w_out"], a["b_proj"]),
         mlp_forward(a["x"], a["w_fc"], a["b_fc"], a["w_out"], a["b_proj"]),
         parallel_mlp_backward, mlp_backward, a["dy"]),
        (vocab_embedding_forward(a["idx"], a["wte"], vocab_start=0),
         embedding_forward(a["idx"], a["wte"]), vocab_embedding_backward, embedding_backward,
         a["dy"]),
        (vocab_cross_entropy_forward(a["logits"], a["targets"], vocab_start=0),
         cross_entropy_forward(a["logits"], a["targets"]), vocab_cross_entropy_backward,
         cross_entropy_backward, 1.0),
    ]  # fmt: skip
    for (y, cache), (y_ref, cache_ref), backward, backward_ref, dy in pairs:
        np.testing.assert_allclose(y, y_ref, rtol=0, atol=1e-14)
        for g, g_ref in zip(backward(dy, cache), backward_ref(dy, cache_ref)):
            np.testing.assert_allclose(g, g_ref, rtol=0, atol=1e-13)


# --- two ranks: the parallel layers against the single-process layers ---------------------------

LAYER_NAMES = {"w_attn": "attn.c_attn.weight", "b_attn": "attn.c_attn.bias",
               "w_proj": "attn.c_proj.weight", "w_fc": "mlp.c_fc.weight",
               "b_fc": "mlp.c_fc.bias", "w_out": "mlp.c_proj.weight", "wte": "wte.weight",
               "logits": "lm_head.weight"}  # the shard rule of each input  # fmt: skip


def _layers_on_a_rank():
    """Every parallel layer's output and gradients on this rank, its inputs split as the mode
    splits the parameters (logits by vocabulary columns, like the head's)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    a = {name: torch.from_numpy(value) for name, value in _inputs().items()}
    s = {name: shard_param(LAYER_NAMES[name], a[name], rank, world_size) if name in LAYER_NAMES
         else a[name] for name in a}  # fmt: skip
    start = rank * V // world_size
    runs = {
        "attention": (parallel_attention_forward, parallel_attention_backward,
                      (s["x"], s["w_attn"], s["b_attn"], s["w_proj"], s["b_proj"]),
                      dict(n_head=NH // world_size), s["dy"]),
        "mlp": (parallel_mlp_forward, parallel_mlp_backward,
                (s["x"], s["w_fc"], s["b_fc"], s["w_out"], s["b_proj"]), {}, s["dy"]),
        "embedding": (vocab_embedding_forward, vocab_embedding_backward, (s["idx"], s["wte"]),
                      dict(vocab_start=start), s["dy"]),
        "cross_entropy": (vocab_cross_entropy_forward, vocab_cross_entropy_backward,
                          (s["logits"], s["targets"]), dict(vocab_start=start), 1.0),
    }  # fmt: skip
    out = {}
    for name, (forward, backward, args, hyperparams, dy) in runs.items():
        y, cache = forward(*args, **hyperparams)
        out[name] = (y, backward(dy, cache))
    return out


def test_parallel_layers_across_two_ranks_equal_the_layers():
    """f's all-reduce backward and g's all-reduce forward make the split layers exact: outputs
    and input gradients equal on both ranks, the weight gradients' shards put together equal."""
    a = _inputs()
    reference = {
        "attention": (attention_forward, attention_backward,
                      ("x", "w_attn", "b_attn", "w_proj", "b_proj"), dict(n_head=NH), a["dy"]),
        "mlp": (mlp_forward, mlp_backward, ("x", "w_fc", "b_fc", "w_out", "b_proj"), {}, a["dy"]),
        "embedding": (embedding_forward, embedding_backward, ("idx", "wte"), {}, a["dy"]),
        "cross_entropy": (cross_entropy_forward, cross_entropy_backward, ("logits", "targets"),
                          {}, 1.0),
    }  # fmt: skip
    ranks = run_ranks(_layers_on_a_rank, 2)
    for name, (forward, backward, inputs, hyperparams, dy) in reference.items():
        y_ref, cache = forward(*(a[i] for i in inputs), **hyperparams)
        grads_ref = backward(dy, cache)
        float_inputs = [i for i in inputs if i not in ("idx", "targets")]
        for rank in ranks:
            np.testing.assert_allclose(rank[name][0].numpy(), y_ref, rtol=0, atol=1e-13)
        for i, g_ref in zip(float_inputs, grads_ref):
            pieces = [rank[name][1][float_inputs.index(i)] for rank in ranks]
            g = unshard_param(LAYER_NAMES[i], pieces) if i in LAYER_NAMES else pieces[0]
            np.testing.assert_allclose(g.numpy(), g_ref, rtol=0, atol=1e-13, err_msg=f"{name} d{i}")


# --- the mode: equality after 20 updates --------------------------------------------------------

CFG = GPTConfig(n_layer=2, n_head=4, n_embd=8, vocab_size=16, block_size=4)
RUN = (CFG, 20, 4, 4)  # the config, 20 updates, batches of (4, 4) tokens


@pytest.mark.roundoff
@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_training_equals_one_process(world_size):
    ranks = run_ranks(train_in_both_dtypes, world_size, "tensor", RUN, {}, timeout=240)
    assert_equal_to_one_process(ranks, *RUN)


def test_grad_norm_at_world_size_one_is_the_model_gradient_norm():
    params = init_params(CFG, seed=0, backend="torch", dtype="float64")
    _, grads = loss_and_grads(params, *batch(CFG, 4, 4), CFG)
    model = TensorParallel(CFG, params)
    _, mode_grads = model.loss_and_grads(*batch(CFG, 4, 4))
    want = float(torch.sqrt(sum(torch.sum(g * g) for g in grads.values())))
    assert abs(model.grad_norm(mode_grads) - want) < 1e-12


# --- sharding ----------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None, derandomize=True)
@given(world_size=st.sampled_from([1, 2, 4]), seed=st.integers(0, 100))
def test_shards_put_together_give_the_parameter_back(world_size, seed):
    params = init_params(CFG, seed=seed)
    for name, value in params.items():
        pieces = [shard_param(name, value, rank, world_size) for rank in range(world_size)]
        np.testing.assert_array_equal(unshard_param(name, pieces), value)


def test_each_rank_owns_whole_heads():
    """The q, k and v columns of rank r are those of heads r*NH/W .. (r+1)*NH/W - 1."""
    w = np.arange(C * 3 * C, dtype=np.float64).reshape(C, 3 * C)
    hs = C // NH
    part = shard_param("h.0.attn.c_attn.weight", w, 1, 2)  # heads 2 and 3
    for j in range(3):  # q, k, v
        np.testing.assert_array_equal(part[:, j * C // 2 : (j + 1) * C // 2],
                                      w[:, j * C + 2 * hs : j * C + 4 * hs])  # fmt: skip


# --- errors ------------------------------------------------------------------------------------


def test_n_head_not_divisible_by_the_world_size_is_refused():
    with pytest.raises(ValueError, match=r"n_head \(3\) must be divisible by the world size \(2\)"):
        check_tensor_config(GPTConfig(n_layer=1, n_head=3, n_embd=6, vocab_size=16), 2)


ODD_VOCAB = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=103, block_size=4)


@pytest.mark.roundoff
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_a_vocabulary_the_ranks_do_not_divide_is_padded_and_trains_as_one_process(tie):
    """V = 103 on 2 ranks: 52 rows each, the last one padding that never gets probability."""
    cfg = GPTConfig(**{**ODD_VOCAB.to_dict(), "tie_embeddings": tie})
    run = (cfg, 3, 4, 4)
    check_tensor_config(cfg, 2)  # any vocabulary is accepted
    ranks = run_ranks(train_in_both_dtypes, 2, "tensor", run, {}, timeout=120)
    assert_equal_to_one_process(ranks, *run)
    assert ranks[0]["float64"][1]["wte.weight"].shape == (103, 8)  # the padding left out again


@pytest.mark.parametrize("fields", [dict(ln_order="post"), dict(mlp="swiglu"),
                                    dict(position="sinusoidal"), dict(dropout=0.1)])
def test_other_blocks_are_refused(fields):
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, **fields)
    with pytest.raises(ValueError, match="tensor parallel supports"):
        check_tensor_config(cfg, 1)


def test_ids_outside_the_vocabulary_are_refused():
    model = TensorParallel(CFG, init_params(CFG, backend="torch", dtype="float64"))
    idx = torch.full((1, 2), 16)
    with pytest.raises(ValueError, match="idx holds token id 16"):
        model.loss_and_grads(idx, torch.zeros((1, 2), dtype=torch.int64))


@pytest.mark.parametrize("fields", [dict(tie_embeddings=False), dict(bias=False)])
def test_untied_head_and_no_biases_at_world_size_one(fields):
    """An untied lm_head is column-parallel like the tied head; without biases nothing is added."""
    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=16, block_size=4, **fields)
    params = init_params(cfg, seed=1, backend="torch", dtype="float64")
    loss, grads = loss_and_grads(params, *batch(cfg, 2, 4), cfg)
    mode_loss, mode_grads = TensorParallel(cfg, params).loss_and_grads(*batch(cfg, 2, 4))
    assert abs(mode_loss - loss) < 1e-12 and set(mode_grads) == set(grads)
    for name, g in grads.items():
        torch.testing.assert_close(mode_grads[name], g, rtol=0, atol=1e-12)
