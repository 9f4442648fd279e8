"""The hang detector's bounds, as tables (no processes, no clock): ``timeouts.hang`` as a number
is one bound for everything; ``auto`` bounds silence by the heartbeat, a compute phase by the
job's own phase times (wide while the first steps run) and an evaluation wider still."""

from __future__ import annotations

import pytest

from elaswave.planning.hanglimits import (
    COMPUTE_FLOOR_S,
    MIN_PHASES,
    WARMUP_S,
    WINDOW,
    hang_limits,
    percentile,
    phase_ended,
)
from elaswave.planning.verdicts import hang_verdict

BEAT = 0.2


def test_a_number_is_one_bound_for_everything() -> None:
    lim = hang_limits(1.5, compute=[30.0] * 100, evals=[100.0], beat_s=BEAT)
    assert (lim.silence_s, lim.compute_s, lim.eval_s) == (1.5, 1.5, 1.5)
    assert lim.describe() == "1.5 s (fixed)"


@pytest.mark.parametrize(
    ("compute", "evals", "beat", "silence", "bound", "evaluating", "how"),
    [
        # nothing seen yet: the first steps get minutes, whatever their length
        ([], [], BEAT, 1.0, WARMUP_S, WARMUP_S, "first steps, 0 of 20 compute phases seen"),
        ([0.05] * (MIN_PHASES - 1), [], BEAT, 1.0, WARMUP_S, WARMUP_S, "19 of 20"),
        # 0.1 s steps: the floor
        ([0.08] * MIN_PHASES, [], BEAT, 1.0, COMPUTE_FLOOR_S, WARMUP_S,
         "floor, 4 × p99 of 20 compute phases is 0.32 s"),
        # 30 s steps: four times their p99, never the floor
        ([30.0] * 50, [], BEAT, 1.0, 120.0, WARMUP_S, "4 × p99 of 50 compute phases"),
        # one slow phase in a hundred is above the p99 (the floor holds); two are the p99
        ([1.0] * 99 + [5.0], [], BEAT, 1.0, COMPUTE_FLOOR_S, WARMUP_S, "floor"),
        ([1.0] * 98 + [5.0] * 2, [], BEAT, 1.0, 20.0, WARMUP_S, "4 × p99 of 100"),
        # only the newest WINDOW phases count: the job sped up
        ([30.0] * 100 + [0.5] * WINDOW, [], BEAT, 1.0, COMPUTE_FLOOR_S, WARMUP_S, "of 200 compute"),
        # a slow heartbeat stretches the silence bound: five beats
        ([], [], 0.5, 2.5, WARMUP_S, WARMUP_S, "first steps"),
        # evaluations: wide, and wider than four times the longest seen
        ([], [20.0], BEAT, 1.0, WARMUP_S, WARMUP_S, "first steps"),
        ([], [20.0, 100.0], BEAT, 1.0, WARMUP_S, 400.0, "first steps"),
    ],
)  # fmt: skip
def test_auto_bounds(
    compute: list[float],
    evals: list[float],
    beat: float,
    silence: float,
    bound: float,
    evaluating: float,
    how: str,
) -> None:
    lim = hang_limits("auto", compute=compute, evals=evals, beat_s=beat)
    assert lim.silence_s == pytest.approx(silence)
    assert lim.compute_s == pytest.approx(bound)
    assert lim.eval_s == pytest.approx(evaluating)
    assert lim.compute_how.startswith("auto: ") and how in lim.compute_how, lim.compute_how
    assert "auto" in lim.describe()


def test_auto_catches_a_frozen_worker_of_a_fast_job_within_two_seconds() -> None:
    """0.1 s steps: a frozen worker (no heartbeat) is hung after a second, never sooner than
    five beats; a worker of a 30 s-step job computing for 100 s is not."""
    fast = hang_limits("auto", compute=[0.08] * 100, evals=[], beat_s=BEAT)
    assert hang_verdict(1.05, "compute", 0.0, limits=fast, beat_s=BEAT) is not None
    assert hang_verdict(0.95, "compute", 0.0, limits=fast, beat_s=BEAT) is None
    slow = hang_limits("auto", compute=[30.0] * 5, evals=[], beat_s=BEAT)  # still warming up
    assert hang_verdict(0.1, "compute", 100.0, limits=slow, beat_s=BEAT) is None
    slow = hang_limits("auto", compute=[30.0] * 100, evals=[], beat_s=BEAT)
    assert hang_verdict(0.1, "compute", 100.0, limits=slow, beat_s=BEAT) is None
    assert hang_verdict(0.1, "compute", 121.0, limits=slow, beat_s=BEAT) is not None


def test_the_evaluation_bound_says_how_it_was_derived() -> None:
    assert "no evaluation seen" in hang_limits("auto", compute=[], evals=[], beat_s=BEAT).eval_how
    lim = hang_limits("auto", compute=[], evals=[12.0], beat_s=BEAT)
    assert lim.eval_how == "auto: floor, the longest of 1 evaluations took 12 s"
    lim = hang_limits("auto", compute=[], evals=[100.0], beat_s=BEAT)
    assert lim.eval_how == "auto: 4 × the longest of 1 evaluations"


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([3.0], 0.99, 3.0),
        ([1.0, 2.0, 3.0, 4.0], 0.5, 2.0),
        ([float(i) for i in range(1, 101)], 0.99, 99.0),
        ([float(i) for i in range(1, 201)], 0.99, 198.0),
        ([5.0, 1.0, 3.0], 1.0, 5.0),
    ],
)
def test_percentile_is_the_nearest_rank(values: list[float], q: float, expected: float) -> None:
    assert percentile(values, q) == expected


@pytest.mark.parametrize(
    ("before", "now", "ended"),
    [
        (("idle", 0.0), ("compute", 0.1), None),  # a phase began
        (("compute", 0.1), ("compute", 0.3), None),  # the same phase, older
        (("compute", 0.3), ("collective", 0.05), ("compute", 0.3)),  # it ended
        (("compute", 0.3), ("compute", 0.05), ("compute", 0.3)),  # ... and another began
        (("eval", 12.0), ("idle", 0.0), ("eval", 12.0)),
        (("collective", 5.0), ("compute", 0.1), None),  # waits on peers are not phase times
        (("idle", 5.0), ("idle", 0.1), None),
    ],
)
def test_phase_ended(
    before: tuple[str, float], now: tuple[str, float], ended: tuple[str, float] | None
) -> None:
    assert phase_ended(before, now) == ended
