"""The clock behind every compute time the runtime reports: a rank's busy seconds per
micro-batch (the straggler detector's input) and its layers' seconds (``layer_costs: online``).

On the CPU, busy time is wall-clock time minus the time the thread sat runnable waiting for a
core (on a shared host that is the neighbours' work, not this rank's). A device backend replaces
the clock with :func:`set_clock` (e.g. one that reads device events); nothing else in the
runtime reads a clock for these measurements.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = [
    "Clock",
    "DeviceClock",
    "busy_mark",
    "busy_since",
    "clock",
    "cpu_wait_seconds",
    "set_clock",
]


def cpu_wait_seconds() -> float:
    """Seconds this thread has spent runnable but waiting for a CPU (Linux schedstat; 0 where
    the kernel does not report it)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


class Clock:
    """Wall-clock seconds, and the seconds of it this thread waited for a CPU."""

    def now(self) -> float:
        return time.perf_counter()

    def waited(self) -> float:
        return cpu_wait_seconds()


class DeviceClock(Clock):
    """On an accelerator, work is queued and runs later: each reading first waits for the
    compute stream to finish what was queued, so that an interval times the work, not its
    launch."""

    def __init__(self, device: Any) -> None:
        self.device = device

    def now(self) -> float:
        from elaswave.runtime.device import synchronize

        synchronize(self.device)
        return time.perf_counter()

    def waited(self) -> float:
        return 0.0  # the device computes while this thread waits for a core: not subtracted


_clock = Clock()


def clock() -> Clock:
    return _clock


def set_clock(new: Clock) -> Clock:
    """Use ``new`` from now on; returns the previous clock."""
    global _clock
    old, _clock = _clock, new
    return old


def busy_mark() -> tuple[float, float]:
    """A start mark for :func:`busy_since`."""
    return _clock.now(), _clock.waited()


def busy_since(mark: tuple[float, float]) -> float:
    """Busy seconds since ``mark``: elapsed time without the time spent waiting for a CPU."""
    start, waited = mark
    return _clock.now() - start - (_clock.waited() - waited)
