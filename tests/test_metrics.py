"""Perplexity, bits and calibration, on cases whose answer can be worked out by hand."""

import io
import math

import matplotlib
import numpy as np
import pytest

from gptlab import GPTConfig, gpt_forward, init_params
from gptlab.backend import convert
from gptlab.training.metrics import (
    bits_per_character,
    bits_per_token,
    evaluate_loss,
    expected_calibration_error,
    perplexity,
    reliability_diagram,
    split_loss,
)

matplotlib.use("Agg")

CFG = GPTConfig(n_layer=2, n_head=2, n_embd=8, vocab_size=11, block_size=8)


def test_perplexity_and_bits_by_hand():
    assert perplexity(math.log(11)) == pytest.approx(11.0, rel=1e-15)
    assert perplexity(0.0) == 1.0
    assert bits_per_token(math.log(2.0)) == pytest.approx(1.0, rel=1e-15)
    # a character tokenizer: one token per character, so bits per character = loss / ln 2
    mean_loss, n_chars = 1.88, 1000
    assert bits_per_character(mean_loss * n_chars, n_chars) == pytest.approx(
        bits_per_token(mean_loss), rel=1e-15)  # fmt: skip
    with pytest.raises(ValueError, match="n_characters"):
        bits_per_character(1.0, 0)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_uniform_predictions_have_perplexity_V(backend):
    params = init_params(CFG, backend=backend, dtype="float64")
    params["wte.weight"] = params["wte.weight"] * 0.0  # the tied head gives logits 0: uniform
    data = np.random.default_rng(0).integers(0, CFG.vocab_size, size=200)
    loss = evaluate_loss(params, CFG, data, batch_size=4, block_size=8, n_batches=3, seed=0)
    assert loss == pytest.approx(math.log(CFG.vocab_size), rel=1e-14)
    assert perplexity(loss) == pytest.approx(CFG.vocab_size, rel=1e-13)


def test_evaluate_loss_is_seeded_and_the_same_on_every_backend():
    data = np.random.default_rng(1).integers(0, CFG.vocab_size, size=300)
    losses = {}
    for backend in ("numpy", "torch"):
        params = init_params(CFG, seed=3, backend=backend, dtype="float64")
        losses[backend] = evaluate_loss(params, CFG, convert(data, backend), 4, 6, 2, seed=7)
    assert isinstance(losses["numpy"], float)
    assert losses["torch"] == pytest.approx(losses["numpy"], abs=1e-12)
    params = init_params(CFG, seed=3, dtype="float64")
    assert evaluate_loss(params, CFG, data, 4, 6, 2, seed=7) == losses["numpy"]
    assert evaluate_loss(params, CFG, data, 4, 6, 2, seed=8) != losses["numpy"]


def test_evaluate_loss_of_the_only_window_equals_the_forward_loss():
    # block_size + 1 tokens hold exactly one window: inputs data[:-1], targets data[1:]
    params = init_params(CFG, seed=2, dtype="float64")
    data = np.random.default_rng(2).integers(0, CFG.vocab_size, size=CFG.block_size + 1)
    _, expected, _ = gpt_forward(params, data[None, :-1], CFG, data[None, 1:])
    loss = evaluate_loss(params, CFG, data, 5, CFG.block_size, 4, seed=0)
    assert loss == pytest.approx(float(expected), rel=1e-14)


@pytest.mark.parametrize(
    "data_size, kwargs, match",
    [
        (8, {}, "at least"),
        (100, dict(block_size=9), "block_size"),
        (100, dict(batch_size=0), "positive"),
        (100, dict(n_batches=0), "positive"),
    ],
)
def test_evaluate_loss_bad_inputs(data_size, kwargs, match):
    params = init_params(CFG, dtype="float64")
    args = {"batch_size": 2, "block_size": 8, "n_batches": 1, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=match):
        evaluate_loss(params, CFG, np.zeros(data_size, dtype=np.int64), **args)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_split_loss_predicts_every_token_of_whole_windows_once(backend):
    """Three windows of 8 plus 5 left-over tokens: the mean over the 24 predictions of the
    windows, whatever the batch size; the left-over tokens change nothing."""
    params = init_params(CFG, seed=3, backend=backend, dtype="float64")
    T, W = CFG.block_size, 3
    data = np.random.default_rng(3).integers(0, CFG.vocab_size, size=W * T + 1 + 5)
    windows = data[: W * T].reshape(W, T)  # (W, T)
    targets = data[1 : W * T + 1].reshape(W, T)  # (W, T)
    _, expected, _ = gpt_forward(params, convert(windows, backend), CFG, convert(targets, backend))
    for batch_size in (1, 2, 64):
        loss = split_loss(params, CFG, convert(data, backend), T, batch_size=batch_size)
        assert loss == pytest.approx(float(expected), rel=1e-13)
    changed = data.copy()
    changed[W * T + 1 :] = (changed[W * T + 1 :] + 1) % CFG.vocab_size
    assert split_loss(params, CFG, changed, T) == pytest.approx(float(expected), rel=1e-13)


@pytest.mark.parametrize("data_size, kwargs, match", [
    (8, {}, "at least"), (100, dict(block_size=0), "block_size"),
    (100, dict(batch_size=0), "positive")])  # fmt: skip
def test_split_loss_bad_inputs(data_size, kwargs, match):
    params = init_params(CFG, dtype="float64")
    with pytest.raises(ValueError, match=match):
        split_loss(params, CFG, np.zeros(data_size, dtype=np.int64), **{"block_size": 8, **kwargs})


def binary_probs(confidences, correct):
    """Two-class predictions: class 0 with the given confidence; the target is 0 when correct."""
    confidences = np.asarray(confidences, dtype=np.float64)  # (N,)
    probs = np.stack([confidences, 1.0 - confidences], axis=-1)  # (N, 2)
    targets = np.where(np.asarray(correct), 0, 1)  # (N,)
    return probs, targets


def test_ece_hand_example_overconfident():
    # 4 predictions at confidence 0.9 of which 2 are right, 2 at 0.6 of which 1 is right:
    # ECE = 4/6 |0.5 - 0.9| + 2/6 |0.5 - 0.6| = 0.26667 + 0.03333 = 0.3
    probs, targets = binary_probs([0.9] * 4 + [0.6] * 2, [1, 1, 0, 0, 1, 0])
    ece, bins = expected_calibration_error(probs, targets, n_bins=10)
    assert ece == pytest.approx(0.3, abs=1e-12)
    assert bins.count.tolist() == [0, 0, 0, 0, 0, 2, 0, 0, 4, 0]  # (0.5, 0.6] and (0.8, 0.9]
    np.testing.assert_allclose(bins.confidence[[5, 8]], [0.6, 0.9])
    np.testing.assert_allclose(bins.accuracy[[5, 8]], [0.5, 0.5])
    assert np.isnan(bins.accuracy[0]) and bins.edges.shape == (11,)


def test_ece_of_exactly_calibrated_predictions_is_zero():
    # 7 of 10 right at confidence 0.7 and 9 of 10 right at 0.9
    probs, targets = binary_probs([0.7] * 10 + [0.9] * 10, [1] * 7 + [0] * 3 + [1] * 9 + [0])
    ece, _ = expected_calibration_error(probs, targets)
    assert ece == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_ece_calibrated_sampling_small_overconfident_large(backend):
    rng = np.random.default_rng(0)
    confidences = rng.uniform(0.5, 1.0, size=100_000)  # (N,)
    correct = rng.random(100_000) < confidences  # right with exactly the stated probability
    probs, targets = binary_probs(confidences, correct)
    ece, _ = expected_calibration_error(convert(probs, backend), convert(targets, backend))
    assert ece < 0.01
    sharpened, _ = binary_probs(np.sqrt(confidences), correct)  # claims more than it knows
    ece_over, _ = expected_calibration_error(convert(sharpened, backend), convert(targets, backend))
    assert ece_over > 0.05


def test_ece_bad_inputs():
    probs, targets = binary_probs([0.9, 0.6], [1, 0])
    with pytest.raises(ValueError, match="targets"):
        expected_calibration_error(probs, targets[:1])
    with pytest.raises(ValueError, match="n_bins"):
        expected_calibration_error(probs, targets, n_bins=0)
    with pytest.raises(TypeError, match="targets"):
        expected_calibration_error(probs, targets.astype(np.float64))


def test_reliability_diagram_draws_with_agg():
    import matplotlib.pyplot as plt

    probs, targets = binary_probs([0.9] * 4 + [0.6] * 2, [1, 1, 0, 0, 1, 0])
    _, bins = expected_calibration_error(probs, targets, n_bins=10)
    ax = reliability_diagram(bins)
    assert len(ax.patches) == 4  # accuracy and gap bars for the two non-empty bins
    assert ax.get_xlabel() == "confidence"
    ax.figure.savefig(io.BytesIO(), format="png")
    plt.close(ax.figure)


def test_split_loss_of_a_model_with_experts_is_its_cross_entropy_alone():
    from gptlab import gpt_forward, init_params
    from gptlab.training.metrics import split_loss

    cfg = GPTConfig(n_layer=1, n_head=2, n_embd=8, vocab_size=11, block_size=4, mlp="moe",
                    n_expert=3, aux_loss_weight=0.5)
    params = init_params(cfg, seed=0, dtype="float64")
    ids = np.random.default_rng(0).integers(0, 11, size=4 * 3 + 1)
    x, y = ids[:-1].reshape(3, 4), ids[1:].reshape(3, 4)
    _, loss, cache = gpt_forward(params, x, cfg, y)
    assert cache["aux_loss"] > 0.1  # the term is there in training
    assert split_loss(params, cfg, ids, block_size=4) == pytest.approx(float(loss - cache["aux_loss"]), rel=1e-12)
