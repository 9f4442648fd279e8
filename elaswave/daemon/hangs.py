"""The daemon's hang detector: a worker whose heartbeats stop, or whose compute phase or
evaluation outlasts its bound, is killed, its stacks taken first.

Killing it turns a hang into a crash: its peers' collectives fail at once instead of waiting for a
transport timeout, and the usual in-place recovery follows. Just before the kill the worker
writes every thread's Python stack (:mod:`~elaswave.daemon.stacks`): the ``hang_stacks`` event
and the run directory's ``stacks/`` keep them for the report.

The bounds are ``timeouts.hang`` seconds, or with ``auto`` derived from the phase times this
host's workers' heartbeats showed (:mod:`~elaswave.planning.hanglimits`); the detector shares
them under ``hang/<host>`` for ``status``.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from elaswave.daemon.jobstore import JobStore
from elaswave.daemon.stacks import keep, kill_with_stacks
from elaswave.daemon.workers import WorkerProc
from elaswave.planning.hanglimits import WINDOW, HangLimits, hang_limits
from elaswave.planning.verdicts import hang_verdict, silence
from elaswave.wire_etcd import HangBounds

log = logging.getLogger(__name__)

DAEMON_STALL_BEATS = 2  # the hang detector's loop running this many beats late = the daemon paused
SHARE_S = 1.0  # how often the detector looks whether its bounds changed for ``status``
REFRESH_S = 30.0  # a description that changed with the same bounds is shared this often
EVENT_STACKS = 32_000  # characters of stacks an event carries (the file keeps them all)


class HangDetector:
    """One host's hang detector: the phase times it learned, the bounds they give, the loop
    that judges and kills (:meth:`watch`) and the one that shares the bounds (:meth:`share`)."""

    def __init__(
        self,
        *,
        setting: float | str,
        heartbeat: float,
        run_dir: Path,
        host_id: str,
        emit: Callable[..., Any],
    ) -> None:
        self.setting = setting  # ``timeouts.hang``: seconds, or "auto"
        self.heartbeat = heartbeat
        self.run_dir = run_dir
        self.host_id = host_id
        self.emit = emit
        self.compute: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.evals: collections.deque[float] = collections.deque(maxlen=WINDOW)
        self.limits = self._limits()
        self._kills: set[asyncio.Task[None]] = set()

    def _limits(self) -> HangLimits:
        return hang_limits(
            self.setting, compute=self.compute, evals=self.evals, beat_s=self.heartbeat
        )

    def learn(self, workers: Iterable[WorkerProc]) -> None:
        """Take the compute phases and evaluations ``workers`` ended since the last call."""
        learned = False
        for w in workers:
            for phase, seconds in w.ended:
                (self.compute if phase == "compute" else self.evals).append(seconds)
                learned = True
            w.ended.clear()
        if learned:
            self.limits = self._limits()

    async def watch(
        self, workers: Mapping[str, WorkerProc], *, rank_of: Callable[[str], int | None]
    ) -> None:
        """Judge ``workers`` (this host's, as they come and go) every half heartbeat; kill the
        hung ones. ``rank_of`` gives a worker's rank in the current plan."""
        beat = self.heartbeat
        tick = resumed = time.monotonic()
        while True:
            await asyncio.sleep(beat / 2)
            now = time.monotonic()
            if now - tick > DAEMON_STALL_BEATS * beat:
                # This loop did not run: the daemon itself was paused (a stop signal, swapping,
                # a throttled container). Silence it did not listen to is not the workers' doing.
                resumed = now
                self.emit("daemon_paused", host=self.host_id, seconds=round(now - tick, 3))
            tick = now
            live = list(workers.values())
            self.learn(live)
            for w in live:
                if (
                    w.last_beat is None or w.proc.returncode is not None or w.stopping or w.done
                    or w.kill_reason is not None
                ):  # fmt: skip
                    continue
                silent = silence(now, w.last_beat, resumed)
                # Late beats: is the process frozen, or busy in one long call? Its CPU time says.
                still = w.still(now) if silent > beat else None
                if still is not None:
                    still = min(still, now - resumed)
                reason = hang_verdict(
                    silent, w.phase, w.phase_age, limits=self.limits, beat_s=beat, still_s=still
                )
                if reason is not None:
                    self._kill(w, reason, rank_of(w.worker_id))

    def _kill(self, w: WorkerProc, reason: str, rank: int | None) -> None:
        """Record the verdict now, then take the stacks and kill, beside this loop."""
        w.kill_reason = reason
        self.emit(
            "hang_detected", host=self.host_id, worker=w.worker_id, rank=rank, reason=reason,
            phase=w.phase,
        )  # fmt: skip
        task = asyncio.create_task(self._kill_with_stacks(w, rank), name=f"kill {w.worker_id}")
        self._kills.add(task)
        task.add_done_callback(self._kills.discard)

    async def _kill_with_stacks(self, w: WorkerProc, rank: int | None) -> None:
        found, started = time.time(), time.monotonic()
        await kill_with_stacks(w)
        kept = keep(w, self.run_dir, found)
        if kept is None:
            log.warning("%s wrote no stacks before it was killed", w.worker_id)
        path, stacks = kept if kept is not None else (None, None)
        if stacks is not None and len(stacks) > EVENT_STACKS:
            stacks = stacks[:EVENT_STACKS] + f"\n… (the rest is in {path})\n"
        self.emit(
            "hang_stacks", host=self.host_id, worker=w.worker_id, rank=rank, path=path,
            stacks=stacks, seconds=round(time.monotonic() - started, 4),
        )  # fmt: skip

    async def share(self, store: JobStore, *, lease: Callable[[], Any]) -> None:
        """Keep ``hang/<host>`` on the bounds in force (``status`` shows them): written when a
        bound changes or the host's lease does (the key went with the old one), and every
        ``REFRESH_S`` while only how they were derived changed (their counts move with every
        beat early on). A write that fails is tried at the next look."""
        shared: tuple[HangBounds, Any] | None = None  # what was written, under which lease
        at = 0.0
        while True:
            lim, held = self.limits, lease()
            bounds = HangBounds(
                silence_s=round(lim.silence_s, 3), compute_s=_rounded(lim.compute_s),
                eval_s=_rounded(lim.eval_s), how=lim.describe(),
            )  # fmt: skip
            due = (
                shared is None
                or shared[1] is not held
                or _values(shared[0]) != _values(bounds)
                or (bounds.how != shared[0].how and time.monotonic() - at >= REFRESH_S)
            )
            if due:
                with contextlib.suppress(Exception):
                    await store.share_hang_bounds(self.host_id, bounds, lease=held)
                    shared, at = (bounds, held), time.monotonic()
            await asyncio.sleep(SHARE_S)


def _values(b: HangBounds) -> tuple[float, float, float]:
    return b.silence_s, b.compute_s, b.eval_s


def _rounded(seconds: float) -> float:
    """A bound to two significant digits: a p99 that moves a little is not news."""
    return float(f"{seconds:.2g}")
