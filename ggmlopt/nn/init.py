"""Initialisations: functions init(weight, bias, rng) that fill float32 arrays in place."""
from __future__ import annotations

import math

import numpy as np

__all__ = ["kaiming_uniform"]


def kaiming_uniform(weight: np.ndarray, bias, rng: np.random.Generator) -> None:
    """torch.nn.Linear's default: weight and bias ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    fan_in = weight.shape[0] (weight is (in_features, out_features)).  Fills the
    arrays in place."""
    fan_in = weight.shape[0]
    bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    weight[...] = rng.uniform(-bound, bound, size=weight.shape)
    if bias is not None:
        bias[...] = rng.uniform(-bound, bound, size=bias.shape)
