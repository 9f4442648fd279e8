"""The hang detector's decision, as a table (no processes, no clock)."""

from __future__ import annotations

import pytest

from elaswave.daemon.supervisor import hang_verdict


@pytest.mark.parametrize(
    ("silent", "phase", "phase_age", "limit", "hung"),
    [
        (0.1, "compute", 0.5, 2.0, False),  # healthy, mid-step
        (2.5, "compute", 0.0, 2.0, True),  # frozen (SIGSTOP): beats stopped
        (2.5, "collective", 0.0, 2.0, True),  # frozen while waiting is still frozen
        (0.1, "collective", 30.0, 2.0, False),  # blocked on a hung peer: not its fault
        (0.1, "idle", 30.0, 2.0, False),  # waiting for a plan
        (0.1, "compute", 1.95, 2.0, True),  # computing one phase past the limit
        (1.0, "compute", 0.9, 2.0, False),  # just under the limit, all told
        (2.0, "compute", 0.0, 2.0, False),  # exactly at the limit is not past it
    ],
)
def test_hang_verdict(
    silent: float, phase: str, phase_age: float, limit: float, hung: bool
) -> None:
    reason = hang_verdict(silent, phase, phase_age, limit)
    assert (reason is not None) == hung
    if reason is not None:
        assert "heartbeat" in reason or "computing" in reason
