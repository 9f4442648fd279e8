"""The learning-rate schedule and the clip factor: pure functions, table-tested."""

from __future__ import annotations

import math

import pytest
import torch

from elaswave.runtime.optim import clip_factor, learning_rate

KW = {"lr": 1.0, "total": 10, "min_lr": 0.1}


@pytest.mark.parametrize(
    ("step", "schedule", "warmup", "expected"),
    [
        (1, "constant", 0, 1.0),
        (7, "constant", 0, 1.0),
        (1, "constant", 4, 0.25),  # linear warmup
        (4, "constant", 4, 1.0),
        (5, "constant", 4, 1.0),
        (1, "cosine", 0, 0.1 + 0.45 * (1 + math.cos(math.pi * 0.1))),
        (5, "cosine", 0, 0.55),  # half way: the mean of lr and min_lr
        (10, "cosine", 0, 0.1),  # the last step reaches min_lr
        (12, "cosine", 0, 0.1),  # and stays there (a job extended past total)
        (2, "cosine", 2, 1.0),  # the end of warmup is the peak
        (6, "cosine", 2, 0.55),
    ],
)
def test_learning_rate(step: int, schedule: str, warmup: int, expected: float) -> None:
    got = learning_rate(step, schedule=schedule, warmup=warmup, **KW)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("values", "max_norm", "ties", "expected"),
    [
        ([3.0, 4.0], 0.0, (), 1.0),  # off
        ([3.0, 4.0], 10.0, (), 1.0),  # under the limit: untouched
        ([3.0, 4.0], 1.0, (), 1.0 / (5.0 + 1e-6)),
        # a tied weight's two copies (slices 0:2 and 2:4) count once: norm 5, not 5·√2
        ([3.0, 4.0, 3.0, 4.0], 1.0, ((slice(0, 2), slice(2, 4)),), 1.0 / (5.0 + 1e-6)),
    ],
)
def test_clip_factor(values: list[float], max_norm: float, ties: tuple, expected: float) -> None:
    assert clip_factor(torch.tensor(values), max_norm, ties) == pytest.approx(expected, rel=1e-9)
