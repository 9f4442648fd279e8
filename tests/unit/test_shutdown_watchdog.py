"""The daemon's shutdown watchdog: it fires only while a shutdown is still running.

A watchdog left armed after a shutdown that finished must never end the process later (exit 70):
whatever the process does next (the CLI's report, a test harness) goes on.
"""

from __future__ import annotations

import threading
import time

import pytest

from elaswave.daemon.shutdown import shutdown_watchdog


@pytest.mark.parametrize(
    ("block_s", "limit_s", "fires"),
    [
        (0.0, 0.2, False),  # a shutdown that finished: the process goes on
        (0.05, 0.3, False),  # finished within the limit
        (0.6, 0.1, True),  # stuck past the limit: the last resort fires
    ],
)
def test_shutdown_watchdog(block_s: float, limit_s: float, fires: bool) -> None:
    fired = threading.Event()
    with shutdown_watchdog(limit_s, fired.set):
        time.sleep(block_s)
    time.sleep(limit_s + 0.3)  # well past the limit
    assert fired.is_set() is fires
