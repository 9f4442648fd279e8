"""The daemon's hang detector: a worker whose heartbeats stop, or whose compute phase outlasts the
hang timeout, is killed.

Killing it turns a hang into a crash: its peers' collectives fail at once instead of waiting for a
transport timeout, and the usual in-place recovery follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from elaswave.daemon.workers import WorkerProc
from elaswave.planning.hanglimits import hang_limits
from elaswave.planning.verdicts import hang_verdict, silence

DAEMON_STALL_BEATS = 2  # the hang detector's loop running this many beats late = the daemon paused


async def detect_hangs(
    workers: dict[str, WorkerProc],
    *,
    hang: float,
    heartbeat: float,
    rank_of: Callable[[str], int | None],
    emit: Callable[..., Any],
    host_id: str,
) -> None:
    """Watch ``workers`` (this host's, as they come and go) every half ``heartbeat``; kill the
    ones that hang for ``hang`` seconds. ``rank_of`` gives a worker's rank in the current plan,
    ``emit`` records an event."""
    limits = hang_limits(hang, compute=(), evals=(), beat_s=heartbeat)
    tick = resumed = time.monotonic()
    while True:
        await asyncio.sleep(heartbeat / 2)
        now = time.monotonic()
        if now - tick > DAEMON_STALL_BEATS * heartbeat:
            # This loop did not run: the daemon itself was paused (a stop signal, swapping, a
            # throttled container). Silence it did not listen to is not the workers' doing.
            resumed = now
            emit("daemon_paused", host=host_id, seconds=round(now - tick, 3))
        tick = now
        for w in list(workers.values()):
            if w.last_beat is None or w.proc.returncode is not None or w.stopping or w.done:
                continue
            reason = hang_verdict(
                silence(now, w.last_beat, resumed),
                w.phase,
                w.phase_age,
                limits=limits,
                beat_s=heartbeat,
            )
            if reason is None:
                continue
            w.kill_reason = reason
            emit(
                "hang_detected",
                host=host_id,
                worker=w.worker_id,
                rank=rank_of(w.worker_id),
                reason=reason,
            )
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
            w.last_beat = None
