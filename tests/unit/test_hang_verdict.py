"""The hang detector's decision, as a table (no processes, no clock)."""

from __future__ import annotations

import pytest

from elaswave.errors import EXIT_STATE_LOST
from elaswave.planning.verdicts import hang_verdict, respawn_verdict, silence

BEAT = 0.2


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
        (0.1, "compute", 1.95, 2.0, None),  # just under the limit
        (1.0, "compute", 1.5, 2.0, None),  # beats late but compute time alone is under it
        (2.0, "compute", 0.0, 2.0, None),  # exactly at the limit is not past it
    ],
)
def test_hang_verdict(
    silent: float, phase: str, phase_age: float, limit: float, verdict: str | None
) -> None:
    reason = hang_verdict(silent, phase, phase_age, limit_s=limit, beat_s=BEAT)
    if verdict is None:
        assert reason is None
    else:
        assert reason is not None and verdict in reason


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
        silence(now, last_beat, resumed), "compute", 0.0, limit_s=10.0, beat_s=BEAT
    )
    assert (verdict is not None) is hung
