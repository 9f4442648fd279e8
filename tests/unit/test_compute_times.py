"""The daemon keeps each worker's newest compute times per plan epoch, reported one step at a
time or in batches."""

from __future__ import annotations

import pytest

from elaswave import wire
from elaswave.daemon.compute import ComputeTimes
from elaswave.planning.verdicts import WINDOW


@pytest.mark.parametrize(
    ("reports", "expected"),
    [
        ([(1, 0.1)], (1, [0.1])),
        ([(1, [0.1, 0.2]), (1, 0.3)], (1, [0.1, 0.2, 0.3])),  # a batch, then one step
        ([(1, [0.1, 0.2]), (2, [0.5])], (2, [0.5])),  # another plan: the old speeds go
        (
            [(3, [0.01 * i for i in range(WINDOW + 3)])],
            (3, [0.01 * i for i in range(3, WINDOW + 3)]),
        ),
    ],
)
def test_measured_keeps_the_newest_window_of_the_current_epoch(
    reports: list[tuple[int, float | list[float]]], expected: tuple[int, list[float]]
) -> None:
    times = ComputeTimes()
    for epoch, per_mb in reports:
        got = per_mb if isinstance(per_mb, list) else [per_mb]
        times.measured("w0", wire.Compute(step=1, epoch=epoch, per_mb=got))
    assert times.per_mb["w0"] == expected
