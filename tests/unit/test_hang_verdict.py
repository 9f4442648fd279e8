"""The hang detector's decision, as a table (no processes, no clock)."""

from __future__ import annotations

import pytest

from elaswave.errors import EXIT_STATE_LOST
from elaswave.planning.hanglimits import HangLimits
from elaswave.planning.verdicts import (
    hang_verdict,
    replacement_verdict,
    respawn_verdict,
    silence,
)

BEAT = 0.2


def fixed(limit: float) -> HangLimits:
    """``--hang-timeout N``: one bound for everything."""
    return HangLimits(silence_s=limit, compute_s=limit, eval_s=limit)


@pytest.mark.parametrize(
    ("silent", "phase", "phase_age", "limit", "verdict"),
    [
        (0.1, "compute", 0.5, 2.0, None),  # healthy, mid-step
        (2.5, "compute", 0.0, 2.0, "heartbeat"),  # frozen (SIGSTOP): beats stopped
        (2.5, "collective", 0.0, 2.0, "heartbeat"),  # frozen while waiting is still frozen
        (1.9, "compute", 1.0, 2.0, None),  # frozen for less than the limit: not yet
        (0.1, "collective", 30.0, 2.0, None),  # blocked on a hung peer: not its fault
        (0.1, "idle", 30.0, 2.0, None),  # waiting for a plan
        (0.1, "compute", 2.5, 2.0, "computing"),  # alive, one compute phase past the limit
        (0.1, "eval", 2.5, 2.0, "evaluating"),  # a fixed limit bounds an evaluation alike
        (0.1, "compute", 1.95, 2.0, None),  # just under the limit
        (1.0, "compute", 1.5, 2.0, None),  # beats late but compute time alone is under it
        (2.0, "compute", 0.0, 2.0, None),  # exactly at the limit is not past it
    ],
)
def test_hang_verdict(
    silent: float, phase: str, phase_age: float, limit: float, verdict: str | None
) -> None:
    reason = hang_verdict(silent, phase, phase_age, limits=fixed(limit), beat_s=BEAT)
    if verdict is None:
        assert reason is None
    else:
        assert reason is not None and verdict in reason
        assert reason.endswith(f"(limit {limit:g} s)")


AUTO = HangLimits(
    silence_s=1.0, compute_s=10.0, eval_s=300.0, silence_how="auto: floor",
    compute_how="auto: floor, 4 × p99 of 40 compute phases is 0.4 s",
    eval_how="auto: no evaluation seen",
)  # fmt: skip


@pytest.mark.parametrize(
    ("silent", "phase", "phase_age", "reason"),
    [
        (0.9, "compute", 0.5, None),  # beats a little late: under the silence bound
        (1.1, "collective", 0.0, "no heartbeat for 1.1 s (limit 1 s; auto: floor)"),
        (1.1, "compute", 0.0, "no heartbeat for 1.1 s (limit 1 s; auto: floor)"),
        (0.1, "compute", 9.9, None),  # a long phase, under the compute bound
        (
            0.1, "compute", 10.5,
            "stuck computing for 10.5 s (limit 10 s; auto: floor, 4 × p99 of 40 compute "
            "phases is 0.4 s)",
        ),
        (0.1, "eval", 200.0, None),  # an evaluation has its own, wider bound
        (0.1, "eval", 301.0, "stuck evaluating for 301.0 s (limit 300 s; auto: no evaluation"),
        (0.5, "compute", 10.5, None),  # phase times are judged only on fresh beats
        (0.1, "idle", 1000.0, None),
    ],
)  # fmt: skip
def test_hang_verdict_under_auto_bounds_each_phase_on_its_own(
    silent: float, phase: str, phase_age: float, reason: str | None
) -> None:
    """Silence, a compute phase and an evaluation each against its own bound; the reason names
    the bound and how it was derived (the report's incident shows it)."""
    got = hang_verdict(silent, phase, phase_age, limits=AUTO, beat_s=BEAT)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason)


@pytest.mark.parametrize(
    ("silent", "still", "phase", "reason"),
    [
        (1.1, 1.1, "compute", "no heartbeat for 1.1 s (limit 1 s; auto: floor)"),  # frozen
        (1.1, None, "idle", "no heartbeat for 1.1 s (limit 1 s"),  # CPU time unreadable
        (1.1, 0.05, "idle", None),  # silent but using CPU: an import, a collection
        (9.9, 0.05, "compute", None),  # ... judged like a compute phase
        (10.5, 0.05, "idle", "no heartbeat for 10.5 s while using CPU (limit 10 s; auto: floor"),
        (5.0, 1.2, "idle", "no heartbeat for 5.0 s (limit 1 s"),  # busy, then frozen
        (0.5, 3.0, "compute", None),  # a fresh beat counts whatever the CPU did
    ],
)  # fmt: skip
def test_a_silent_worker_using_cpu_is_busy_not_frozen(
    silent: float, still: float | None, phase: str, reason: str | None
) -> None:
    """A main thread that holds the interpreter in one long call (compiling an import, a
    garbage collection) starves the heartbeat thread while its CPU time grows: it is judged
    by the compute bound, not killed as frozen after a second's silence."""
    got = hang_verdict(silent, phase, 0.0, limits=AUTO, beat_s=BEAT, still_s=still)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason)


@pytest.mark.parametrize(
    ("exit_code", "used", "limit", "unrecoverable", "respawn"),
    [
        (-9, 0, 2, None, True),  # a crash, restarts left
        (-9, 2, 2, None, False),  # none left
        (1, 0, 2, None, True),
        (EXIT_STATE_LOST, 0, 100, None, False),  # it gave up: state is lost
        (-9, 0, 100, "both copies of layer 3 are gone", False),  # a peer reported the loss
    ],
)
def test_respawn_verdict(
    exit_code: int, used: int, limit: int, unrecoverable: str | None, respawn: bool
) -> None:
    """A worker is never respawned after the job's state is lost: a fresh one would start the
    job over from step 0 without a word (found by the pipeline chaos soak)."""
    assert respawn_verdict(exit_code, used, limit, unrecoverable=unrecoverable) is respawn


@pytest.mark.parametrize(
    ("now", "last_beat", "resumed", "silent", "hung"),
    [
        (100.0, 99.8, 0.0, 0.2, False),  # beats arrive: no pause of the daemon's own
        (100.0, 80.0, 0.0, 20.0, True),  # a worker frozen for 20 s while the daemon listened
        (100.0, 80.0, 99.9, 0.1, False),  # the daemon itself was stopped until 99.9
        (110.0, 80.0, 99.9, 10.1, True),  # ... but silence after it resumed counts in full
        (100.0, 99.95, 99.9, 0.05, False),  # a beat read after the resume counts
    ],
)
def test_silence_excludes_the_daemons_own_pause(
    now: float, last_beat: float, resumed: float, silent: float, hung: bool
) -> None:
    """A daemon paused for longer than the hang timeout (SIGSTOP, swapping) must not judge the
    workers it did not listen to as hung: only silence after its resume counts."""
    assert silence(now, last_beat, resumed) == pytest.approx(silent)
    verdict = hang_verdict(
        silence(now, last_beat, resumed), "compute", 0.0, limits=fixed(10.0), beat_s=BEAT
    )
    assert (verdict is not None) is hung


@pytest.mark.parametrize(
    ("exit_code", "used", "limit", "unrecoverable", "waiting", "verdict"),
    [
        (-9, 0, 2, None, True, "spare"),  # a spare waits: it takes the place
        (-9, 0, 2, None, False, "respawn"),  # none waits: a new worker, as without spares
        (-9, 2, 2, None, True, None),  # a spare counts against the budget: none left
        (1, 1, 2, None, True, "spare"),
        (EXIT_STATE_LOST, 0, 100, None, True, None),  # state is lost: nobody replaces it
        (-9, 0, 100, "both copies of layer 3 are gone", True, None),
        (-9, 0, 0, None, True, None),  # --spares without --max-restarts: spares stay idle
    ],
)
def test_replacement_verdict(
    exit_code: int,
    used: int,
    limit: int,
    unrecoverable: str | None,
    waiting: bool,
    verdict: str | None,
) -> None:
    """A waiting warm spare is used instead of a respawn, within the same restart budget."""
    got = replacement_verdict(
        exit_code, used, limit, unrecoverable=unrecoverable, spare_waiting=waiting
    )
    assert got == verdict
