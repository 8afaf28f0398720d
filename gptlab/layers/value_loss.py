"""The value head's loss in PPO: a squared error between the predicted values and the returns
the rollout measured (Schulman et al. 2017, eq. 9, the L^VF term).

    loss = 0.5 * mean((values - returns)^2)                ()
    dvalues = dloss * (values - returns) / n,   dreturns = -dvalues

The returns (``gptlab.alignment.rlhf.gae``: advantages + the old values) are targets: in training
their gradient is computed, as for any float input, and not used.

Book: chapter 22, "RLHF with PPO".
"""

from __future__ import annotations

import math

from ..backend import array_namespace
from ..checks import require_float, require_same_dtype, require_shape


def value_loss_forward(values, returns):
    """values (...), returns (...) of the same shape -> (loss (), cache)."""
    xp = array_namespace(values, returns)
    require_float("values", values)
    require_float("returns", returns)
    require_shape("returns", returns, tuple(values.shape))
    require_same_dtype("values", values, "returns", returns)
    if math.prod(values.shape) == 0:
        raise ValueError("values holds no entries: expected at least one")
    error = values - returns  # (...)
    loss = 0.5 * xp.mean(error * error)  # ()
    return loss, error


def value_loss_backward(dloss, cache):
    """dloss -> (dvalues (...), dreturns (...))."""
    error = cache
    # loss = 0.5 * mean(error * error), error = values - returns
    dvalues = dloss * error / math.prod(error.shape)  # (...)
    return dvalues, -dvalues
