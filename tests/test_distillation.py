"""Knowledge distillation (issue 15): the loss's properties and errors, an independent torch
formulation, the high-temperature limit, and the training loop ``gptlab.alignment.distill``. The gradient
checks of the loss are rows of the CASES table in test_layers.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import to_host
from gptlab.backend import convert
from gptlab.training.data import embedded_corpus
from gptlab.alignment.distill import agreement, distill
from gptlab.layers.cross_entropy import cross_entropy_backward, cross_entropy_forward
from gptlab.layers.distillation import distillation_backward, distillation_forward
from gptlab.tokenizers.char import CharTokenizer
from gptlab.training.config import TrainConfig
from gptlab.training.train import train

B, T, V = 2, 3, 5


def _logits_and_targets(backend, seed=0, scale=2.0):
    rng = np.random.default_rng(seed)
    s, t = (backend.asarray(scale * rng.standard_normal((B, T, V))) for _ in range(2))
    return s, t, backend.asarray(rng.integers(0, V, size=(B, T), dtype=np.int64))


# --------------------------------------------------------------------------------------------
# Properties of the loss


def test_alpha_zero_is_cross_entropy(backend):
    s, t, y = _logits_and_targets(backend)
    loss, cache = distillation_forward(s, t, y, tau=3.0, alpha=0.0)
    ce, ce_cache = cross_entropy_forward(s, y)
    assert float(loss) == pytest.approx(float(ce), rel=1e-14)
    ds, dt = distillation_backward(1.0, cache)
    (dce,) = cross_entropy_backward(1.0, ce_cache)
    np.testing.assert_allclose(to_host(ds), to_host(dce), rtol=0, atol=1e-15)
    assert np.all(to_host(dt) == 0.0)


def test_no_kl_when_the_student_is_the_teacher(backend):
    s, _, y = _logits_and_targets(backend)
    loss, cache = distillation_forward(s, s, tau=2.0, alpha=1.0)
    assert abs(float(loss)) < 1e-14
    ds, dt = distillation_backward(1.0, cache)
    assert np.abs(to_host(ds)).max() < 1e-15 and np.abs(to_host(dt)).max() < 1e-15
    # with labels, only the hard term is left: (1 - alpha) CE
    loss, _ = distillation_forward(s, s, y, tau=2.0, alpha=0.25)
    assert float(loss) == pytest.approx(0.75 * float(cross_entropy_forward(s, y)[0]), rel=1e-13)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), tau=st.floats(0.2, 8.0), c=st.floats(0.1, 10.0),
       shift=st.floats(-5.0, 5.0))  # fmt: skip
def test_kl_term_is_nonnegative_scales_as_tau_squared_and_ignores_shifts(seed, tau, c, shift):
    """alpha=1: the loss is tau^2 KL >= 0; KL depends on s / tau and t / tau only, so scaling
    logits and tau together by c multiplies the loss by c^2; adding a constant to a row of
    logits changes no softmax."""
    rng = np.random.default_rng(seed)
    s, t = 2.0 * rng.standard_normal((2, B, T, V))
    loss = float(distillation_forward(s, t, tau=tau, alpha=1.0)[0])
    assert loss >= 0.0
    scaled = float(distillation_forward(c * s, c * t, tau=c * tau, alpha=1.0)[0])
    assert scaled == pytest.approx(c * c * loss, rel=1e-9, abs=1e-12)
    shifted = float(distillation_forward(s + shift, t - shift, tau=tau, alpha=1.0)[0])
    assert shifted == pytest.approx(loss, rel=1e-9, abs=1e-12)


def test_matches_torch_kl_div_and_cross_entropy(backend):
    """An independent formulation: torch.nn.functional's kl_div and cross_entropy, and autograd
    through them, for both logits."""
    tau, alpha = 1.7, 0.6
    s, t, y = _logits_and_targets(backend)
    loss, cache = distillation_forward(s, t, y, tau=tau, alpha=alpha)
    dout = 0.8
    ds, dt = distillation_backward(dout, cache)
    s_ref, t_ref = (torch.tensor(to_host(a), requires_grad=True) for a in (s, t))
    y_ref = torch.tensor(to_host(y))
    F = torch.nn.functional
    kl = F.kl_div(F.log_softmax(s_ref / tau, -1), F.log_softmax(t_ref / tau, -1),
                  reduction="sum", log_target=True) / (B * T)  # fmt: skip
    ce = F.cross_entropy(s_ref.reshape(-1, V), y_ref.reshape(-1))
    want = alpha * tau**2 * kl + (1 - alpha) * ce
    (want * dout).backward()
    assert float(loss) == pytest.approx(float(want.detach()), rel=1e-12)
    np.testing.assert_allclose(to_host(ds), s_ref.grad.numpy(), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(to_host(dt), t_ref.grad.numpy(), rtol=1e-10, atol=1e-14)


def test_high_temperature_gradient_tends_to_the_logit_difference():
    """Hinton et al. section 2.1: for zero-mean logits, dKL/ds -> (s - t) / (V tau^2) as tau
    grows, with an error that falls like 1/tau relative to the limit."""
    rng = np.random.default_rng(0)
    s, t = rng.standard_normal((2, 1, V))
    s, t = s - s.mean(), t - t.mean()
    errors = []
    for tau in (10.0, 100.0, 1000.0):
        _, cache = distillation_forward(s, t, tau=tau, alpha=1.0)
        ds, _ = distillation_backward(1.0, cache)
        limit = tau * tau * (s - t) / (V * tau**2)  # the tau^2 of the loss times the limit
        errors.append(np.linalg.norm(ds - limit) / np.linalg.norm(limit))
    assert errors[0] < 0.1
    for before, after in zip(errors, errors[1:]):
        assert after < 0.2 * before


# --------------------------------------------------------------------------------------------
# Errors


def test_bad_input_raises_clear_errors(backend):
    s, t, y = _logits_and_targets(backend)
    with pytest.raises(ValueError, match="teacher_logits has shape"):
        distillation_forward(s, t[..., :-1], y)
    with pytest.raises(ValueError, match="targets has shape"):
        distillation_forward(s, t, y[:, :-1])
    assert float(distillation_forward(s, t, y, tau=np.float32(2.0), alpha=np.float64(0.5))[0]) > 0
    for tau in (0.0, -1.0, math.inf, math.nan, "2"):
        with pytest.raises(ValueError, match="tau"):
            distillation_forward(s, t, y, tau=tau)
    for alpha in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match=r"alpha .* must be in \[0, 1\]"):
            distillation_forward(s, t, y, alpha=alpha)
    with pytest.raises(ValueError, match="targets are needed"):
        distillation_forward(s, t, alpha=0.5)
    with pytest.raises(TypeError, match="targets must be an integer array"):
        distillation_forward(s, t, s[..., 0])
    with pytest.raises(TypeError, match="teacher_logits must be a floating-point array"):
        distillation_forward(s, y[..., None] + 0 * y[..., None], y)


def test_mixed_dtypes_are_refused():
    s = torch.zeros(B, T, V, dtype=torch.float32)
    with pytest.raises(TypeError, match="student_logits has dtype torch.float32 but"):
        distillation_forward(s, s.double(), alpha=1.0)


# --------------------------------------------------------------------------------------------
# The training loop


TINY = dict(n_layer=1, n_head=2, n_embd=16, block_size=16, batch_size=4, max_iters=30,
            warmup_iters=3, eval_interval=10, eval_iters=2, backend="numpy", dtype="float64",
            checkpoint_interval=0)  # fmt: skip


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A tiny teacher trained on labels: (params, model config, tokenizer, config)."""
    cfg = TrainConfig(**{**TINY, "n_embd": 24, "max_iters": 40},
                      out_dir=str(tmp_path_factory.mktemp("teacher")))
    result = train(cfg, progress=False)
    return result.params, result.model_config, result.tokenizer


def test_alpha_zero_trains_exactly_the_labels_only_run(teacher, tmp_path):
    params, teacher_cfg, tokenizer = teacher
    cfg = TrainConfig(**TINY, out_dir=str(tmp_path), seed=5)
    labels_only = train(cfg, progress=False)
    distilled = distill(cfg, params, teacher_cfg, tokenizer, tau=2.0, alpha=0.0, progress=False)
    for name, w in labels_only.params.items():
        np.testing.assert_allclose(distilled.params[name], w, rtol=0, atol=1e-14, err_msg=name)


def test_distillation_lowers_its_loss_and_is_deterministic(teacher, tmp_path):
    params, teacher_cfg, tokenizer = teacher
    cfg = TrainConfig(**TINY, out_dir=str(tmp_path), seed=3)
    runs = [distill(cfg, params, teacher_cfg, tokenizer, tau=2.0, alpha=0.8, progress=False)
            for _ in range(2)]  # fmt: skip
    history = runs[0].history
    assert [row["step"] for row in history] == [0, 10, 20, 30]
    assert history[-1]["loss"] < 0.8 * history[1]["loss"]
    assert history[-1]["val_loss"] < history[0]["val_loss"] - 0.3
    for name, w in runs[0].params.items():
        assert np.array_equal(runs[1].params[name], w), name
    assert runs[0].history == runs[1].history


def test_torch_student_of_a_numpy_teacher_in_float32(teacher, tmp_path):
    params, teacher_cfg, tokenizer = teacher
    cfg = TrainConfig(**{**TINY, "backend": "torch", "dtype": "float32", "max_iters": 10},
                      out_dir=str(tmp_path))
    result = distill(cfg, params, teacher_cfg, tokenizer, tau=4.0, alpha=1.0, progress=False)
    assert result.params["wte.weight"].dtype == torch.float32
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"]


def test_agreement_of_the_teacher_with_itself_and_a_student(teacher, tmp_path):
    params, teacher_cfg, tokenizer = teacher
    ids = np.asarray(tokenizer.encode(embedded_corpus()[:3000]), dtype=np.int64)
    same = agreement(params, teacher_cfg, params, teacher_cfg, ids, 16)
    assert same["top1"] == 1.0 and abs(same["kl"]) < 1e-12
    torch_copy = {name: convert(w, "torch") for name, w in params.items()}
    fresh = distill(TrainConfig(**{**TINY, "max_iters": 5}, out_dir=str(tmp_path)), params,
                    teacher_cfg, tokenizer, progress=False)  # fmt: skip
    other = agreement(fresh.params, fresh.model_config, torch_copy, teacher_cfg, ids, 16)
    assert 0.0 <= other["top1"] < 1.0 and other["kl"] > 0.1


def test_distill_refuses_what_it_cannot_do(teacher, tmp_path):
    params, teacher_cfg, tokenizer = teacher
    with pytest.raises(ValueError, match="backend must be 'numpy' or 'torch'"):
        distill(TrainConfig(**{**TINY, "backend": "autograd"}), params, teacher_cfg, tokenizer)
    with pytest.raises(ValueError, match="longer than the teacher's context"):
        distill(TrainConfig(**{**TINY, "block_size": 32}), params, teacher_cfg, tokenizer)
    with pytest.raises(ValueError, match="vocabulary"):
        distill(TrainConfig(**TINY), params, teacher_cfg, CharTokenizer.from_text("abc"))
