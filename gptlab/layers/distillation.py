"""Knowledge distillation loss (Hinton, Vinyals and Dean, 2015), averaged over all positions.

A student with logits s learns from a teacher with logits t, both softened by a temperature tau,
and from the labels y:

    p = softmax(s / tau)            the student's softened distribution
    q = softmax(t / tau)            the teacher's soft targets
    KL_n = sum_v q_nv (log q_nv - log p_nv)
    loss = alpha * tau^2 * (1/N) sum_n KL_n + (1 - alpha) * CE(s, y)         (N = B*T)

The hard-label term is plain cross-entropy at temperature 1 (cross_entropy.py). The soft term
differs from the paper's cross-entropy with the soft targets, -sum_v q log p, by the teacher's
entropy, a constant for the student, so both give the student the same gradient:

    dKL_n/ds_n = (p_n - q_n) / tau                  (the softmax cross-entropy rule, chapter 6,
                                                     with the chain rule through s / tau)

which shrinks as 1/tau^2 when tau is large (Hinton et al., section 2.1: with zero-mean logits,
(p - q) / tau -> (s - t) / (V tau^2)); the factor tau^2 keeps the soft term's gradient the same
size at every temperature. The teacher gets a gradient too (the loss is a function of t); with
r = log q - log p and the softmax Jacobian diag(q) - q q^T,

    dKL_n/dt_n = q_n * (r_n - KL_n) / tau.

Book: chapter 21, "Distillation".
"""

from __future__ import annotations

import math
from numbers import Real

from ..backend import array_namespace
from ..checks import require_float, require_int, require_same_dtype
from .cross_entropy import cross_entropy_backward, cross_entropy_forward
from .softmax import log_softmax


def require_distillation_inputs(student_logits, teacher_logits, targets, tau, alpha) -> None:
    """The checks of distillation_forward: clear TypeError / ValueError naming the argument."""
    require_float("student_logits", student_logits)
    require_float("teacher_logits", teacher_logits)
    require_same_dtype("student_logits", student_logits, "teacher_logits", teacher_logits)
    if tuple(student_logits.shape) != tuple(teacher_logits.shape):
        raise ValueError(f"student_logits has shape {tuple(student_logits.shape)} but "
                         f"teacher_logits has shape {tuple(teacher_logits.shape)}: expected the "
                         "same (..., V)")  # fmt: skip
    if len(student_logits.shape) == 0:
        raise ValueError("student_logits must have a vocabulary axis (..., V), got a scalar")
    if not (isinstance(tau, Real) and math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau (the temperature) must be a finite number > 0, got {tau!r}")
    if not (isinstance(alpha, Real) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha (the weight of the soft term) must be in [0, 1], got {alpha!r}")
    if targets is None and alpha != 1.0:
        raise ValueError(f"targets are needed for the hard-label term (1 - alpha = {1 - alpha:g});"
                         " pass targets, or alpha=1.0 for the soft term alone")
    if targets is not None:
        require_int("targets", targets)


def distillation_forward(student_logits, teacher_logits, targets=None, *, tau: float = 2.0,
                         alpha: float = 0.5):
    """student_logits, teacher_logits (..., V), targets (...) ids or None (only with alpha=1)
    -> (loss (), cache). The mean over positions of alpha tau^2 KL(q || p) + (1 - alpha) CE."""
    xp = array_namespace(student_logits, teacher_logits)
    require_distillation_inputs(student_logits, teacher_logits, targets, tau, alpha)
    tau, alpha = float(tau), float(alpha)  # Python floats: NumPy scalars do not mix with arrays
    log_p = log_softmax(student_logits / tau)  # (..., V)
    log_q = log_softmax(teacher_logits / tau)  # (..., V)
    q = xp.exp(log_q)  # (..., V)
    log_ratio = log_q - log_p  # (..., V)
    kl = xp.sum(q * log_ratio, axis=-1)  # (...)
    N = math.prod(kl.shape)
    loss = (alpha * tau * tau / N) * xp.sum(kl)  # ()
    ce_cache = None
    if targets is not None:
        ce, ce_cache = cross_entropy_forward(student_logits, targets)  # ()
        loss = loss + (1.0 - alpha) * ce  # ()
    return loss, (xp.exp(log_p), q, log_ratio, kl, ce_cache, tau, alpha)


def distillation_backward(dloss, cache):
    """dloss (scalar, usually 1.0) -> (dstudent_logits (..., V), dteacher_logits (..., V))."""
    p, q, log_ratio, kl, ce_cache, tau, alpha = cache
    N = math.prod(kl.shape)
    scale = alpha * tau * dloss / N  # alpha tau^2 / N times the 1 / tau of both rules below
    # KL = sum_v q (log q - log p), p = softmax(s / tau): the softmax cross-entropy rule
    dstudent_logits = scale * (p - q)  # (..., V)
    # KL as a function of t through q = softmax(t / tau): q * (r - sum_v q r) / tau
    dteacher_logits = scale * q * (log_ratio - kl[..., None])  # (..., V)
    # loss = ... + (1 - alpha) * cross_entropy(s, y)
    if ce_cache is not None:
        (dce,) = cross_entropy_backward((1.0 - alpha) * dloss, ce_cache)  # (..., V)
        dstudent_logits = dstudent_logits + dce  # (..., V)
    return dstudent_logits, dteacher_logits
