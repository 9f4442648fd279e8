"""The convergence benchmark's arithmetic (bench/convergence.py): where the faults fall, the
per-step deviation from a fault-free curve, and the running mean its plot draws."""

from __future__ import annotations

import pytest

from bench import SCENARIOS, convergence


def test_the_scenario_is_listed() -> None:
    assert SCENARIOS["convergence"] is convergence


@pytest.mark.parametrize(("steps", "faults"), [(1000, (200, 500)), (40, (8, 20)), (5, (2, 3))])
def test_the_faults_fall_at_a_fifth_and_a_half_of_the_run(
    steps: int, faults: tuple[int, int]
) -> None:
    assert convergence.fault_steps(steps) == faults


def test_the_deviation_counts_the_steps_from_the_first_fault_on() -> None:
    ref = [4.0, 4.0, 2.0, 2.0, 1.0]
    loss = [9.0, 4.0, 2.2, 1.8, 1.0]  # step 1 differs, before the fault: not counted
    d = convergence.deviation(loss, ref, since=3)
    assert d["max"] == pytest.approx(0.1)
    assert d["mean"] == pytest.approx((0.1 + 0.1 + 0.0) / 3)
    assert d["late_mean"] == d["mean"]  # fewer than LAST steps: all of them
    assert convergence.deviation(ref, ref, since=1) == {"mean": 0.0, "max": 0.0, "late_mean": 0.0}


def test_the_running_mean_widens_to_its_width_then_slides() -> None:
    assert convergence._running_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
