"""What ``launch`` shows while its job runs: a live progress display on a terminal, plain lines
elsewhere (logs, CI, pipes), and one line per incident as it happens.

The numbers come from etcd (the job's progress record, plan and incident list: the same on
every host of the job), read by a thread of the launching process over one connection. An
incident's line says what failed and how it was detected, and the new layout (the plan's
reason); once the first step under its plan is committed, a second line gives its MTTR from
this host's run directory (the report's own replay), or, when the fault was on another host,
the time from the plan to that commit. What a line says is a pure function of the status
document; the thread only polls and prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

__all__ = [
    "LiveProgress", "Snapshot", "clock", "eta_seconds", "incident_lines", "plain_line",
    "sparsity_text",
]  # fmt: skip

POLL_S = 0.5
REPORT_WAIT_S = 5.0  # how long a recovery's line waits for this host's records of it


@dataclass(frozen=True)
class Snapshot:
    """The job's progress as one status document tells it."""

    step: int
    total: int
    loss: float | None
    samples_per_s: float
    world: int
    epoch: int
    done: bool
    sparsity: float | None = None  # train.prune: the share of zero groups (None: not yet)

    @classmethod
    def of(cls, status: dict[str, Any], total: int) -> Snapshot:
        prog = status.get("progress") or {}
        loss = prog.get("loss")
        sparsity = prog.get("sparsity")
        return cls(
            step=int(prog.get("step", 0)),
            total=int(prog.get("total_steps", total)),
            loss=float(loss) if isinstance(loss, int | float) else None,
            samples_per_s=float(prog.get("samples_per_s", 0.0) or 0.0),
            world=int(status.get("world_size", 0)),
            epoch=int(status.get("epoch", 0)),
            done=bool(status.get("done")),
            sparsity=float(sparsity) if isinstance(sparsity, int | float) else None,
        )


def clock(seconds: float | None) -> str:
    """``1:02:03``, ``2:03``; ``–`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "–"
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


def eta_seconds(first: tuple[float, int] | None, now: float, step: int, total: int) -> float | None:
    """Seconds left at the pace since ``first`` = (time, step) was seen; None until a step
    has passed since then."""
    if first is None or step <= first[1] or now <= first[0]:
        return None
    pace = (now - first[0]) / (step - first[1])
    return max(total - step, 0) * pace


def sparsity_text(sparsity: float | None, target: float) -> str:
    """A pruning job's group sparsity beside its target: ``0.31/0.50`` (``–/0.50`` before it
    prunes)."""
    reached = f"{sparsity:.2f}" if sparsity is not None else "–"
    return f"{reached}/{target:.2f}"


def plain_line(
    snap: Snapshot, elapsed: float, eta: float | None, *, target: float | None = None
) -> str:
    """The progress as one line (not on a terminal); ``target``: a pruning job's target
    sparsity, shown with the sparsity reached."""
    loss = f"{snap.loss:.4f}" if snap.loss is not None else "–"
    sparsity = f"sparsity {sparsity_text(snap.sparsity, target)}  " if target is not None else ""
    return (
        f"step {snap.step}/{snap.total}  loss {loss}  {sparsity}{snap.samples_per_s:.1f} "
        f"samples/s  world {snap.world}  epoch {snap.epoch}  elapsed {clock(elapsed)}  "
        f"eta {clock(eta)}"
    )


def incident_lines(seen: set[int], incidents: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """The plans after the first one not yet shown (their epochs are added to ``seen``):
    (epoch, line). A plan that answered a loss is an incident; others (a host joined, a
    re-share) are plan changes."""
    out = []
    for inc in incidents:
        epoch = int(inc.get("epoch", 0))
        if epoch in seen:
            continue
        seen.add(epoch)
        if epoch <= 1:
            continue  # the start
        what = "incident" if inc.get("fault") else "plan"
        out.append((epoch, f"{what}: {inc.get('reason', '')}"))
    return out


def recovered_line(epoch: int, step: int, mttr: float | None, since_plan: float | None) -> str:
    """The line once the first step under an incident's plan is committed."""
    if mttr is not None:
        took = f"MTTR {mttr * 1000:.0f} ms"
    else:
        took = f"{since_plan * 1000:.0f} ms after the plan" if since_plan is not None else ""
    return f"recovered: epoch {epoch}, step {step} committed; {took}".rstrip("; ")


class LiveProgress:
    """The display of one ``launch``: ``attach`` once etcd is known starts it, ``stop`` ends
    it with a last update."""

    def __init__(
        self,
        job_id: str,
        total_steps: int,
        run_dir: Path,
        console: Console,
        *,
        interactive: bool,
        every: float,
        target: float | None = None,
    ) -> None:
        self.job_id = job_id
        self.target = target  # train.prune's target sparsity (None: the job does not prune)
        self.total = total_steps
        self.run_dir = run_dir
        self.console = console
        self.interactive = interactive
        self.every = every
        self.started = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._seen: set[int] = set()
        # incident epoch -> (plan time, when its first commit was seen), until recovered
        self._pending: dict[int, tuple[float, float | None]] = {}
        self._first: tuple[float, int] | None = None
        self._last_line = 0.0
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._lock = threading.Lock()  # the thread's updates against stop()'s last one
        self._closed = False
        self._last: Snapshot | None = None

    def attach(self, endpoints: list[str], security: Any) -> Any:
        """Start reading the job from etcd; returns the call that stops the reading (before
        the etcd it reads from goes away)."""
        self._thread = threading.Thread(
            target=self._run, args=(endpoints, security), name="progress", daemon=True
        )
        self._thread.start()
        return self._halt

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def stop(self, code: int | None = None) -> None:
        """End the display; a job that finished (``code`` 0) gets its last line from this host's
        records (the job's keys are gone from etcd by now), else the last one read."""
        self._halt()
        with self._lock:
            self._closed = True
            for epoch in sorted(self._pending):  # recovered since the last read, or never
                inc = self._reported(epoch)
                if inc is not None:
                    self._emit_recovered(epoch, inc)
            last = self._last
            if code == 0 and last is not None:
                last = self._final(last)
            if last is not None:
                now = time.time()
                if self.interactive:
                    self._update_bar(last, 0.0 if code == 0 else None)
                else:
                    eta = eta_seconds(self._first, now, last.step, last.total)
                    self._emit(plain_line(last, now - self.started, eta, target=self.target))
            if self._progress is not None:
                self._progress.stop()

    def _final(self, last: Snapshot) -> Snapshot:
        """The finished job's last step, from this host's metrics.jsonl when it has it."""
        from elaswave.events import METRICS_FILE, read_jsonl

        with contextlib.suppress(Exception):
            rows = [m for m in read_jsonl(self.run_dir / METRICS_FILE) if "kind" not in m]
            if rows:
                m = rows[-1]
                sparsity = m.get("sparsity")
                return Snapshot(
                    step=int(m["step"]), total=last.total, loss=float(m["loss"]),
                    samples_per_s=last.samples_per_s, world=int(m["world_size"]),
                    epoch=int(m["epoch"]), done=True,
                    sparsity=float(sparsity) if sparsity is not None else None,
                )  # fmt: skip
        return last

    # ---- the thread ------------------------------------------------------------------------------
    def _run(self, endpoints: list[str], security: Any) -> None:
        with contextlib.suppress(Exception):  # the display never takes the job down
            asyncio.run(self._poll(endpoints, security))

    async def _poll(self, endpoints: list[str], security: Any) -> None:
        from elaswave.cli.jobs import read_status
        from elaswave.daemon.etcd import Etcd
        from elaswave.keys import JobKeys

        db = await Etcd.connect(
            endpoints, prefix=JobKeys(self.job_id).prefix, timeout=5.0, security=security
        )
        try:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):  # an etcd outage: try again next time
                    status = await read_status(db, self.job_id)
                    if status is not None:
                        with self._lock:
                            if not self._closed:
                                self._show(status)
                await asyncio.to_thread(self._stop.wait, POLL_S)
        finally:
            with contextlib.suppress(Exception):
                await db.close()

    def _show(self, status: dict[str, Any]) -> None:
        now = time.time()
        snap = Snapshot.of(status, self.total)
        self._last = snap
        if self._first is None and snap.step > 0:
            self._first = (now, snap.step)
        for epoch, line in incident_lines(self._seen, status.get("incidents") or []):
            self._emit(line)
            if line.startswith("incident"):
                self._pending[epoch] = (self._plan_time(status, epoch), None)
        self._recovered(snap, status)
        eta = eta_seconds(self._first, now, snap.step, snap.total)
        if self.interactive:
            self._update_bar(snap, eta)
        elif now - self._last_line >= self.every:
            self._last_line = now
            self._emit(plain_line(snap, now - self.started, eta, target=self.target))

    def _recovered(self, snap: Snapshot, status: dict[str, Any]) -> None:
        """A line for each incident whose plan has its first committed step now (its MTTR
        once this host's run directory has the commit's record, else, after a few seconds,
        the time from the plan: the fault was on another host)."""
        prog = status.get("progress") or {}
        for epoch in sorted(e for e in self._pending if int(prog.get("epoch", 0)) >= e):
            planned, seen = self._pending[epoch]
            now = time.time()
            if seen is None:
                self._pending[epoch] = (planned, now)
                seen = now
            inc = self._reported(epoch)
            if inc is None and now - seen < REPORT_WAIT_S:
                continue
            del self._pending[epoch]
            if inc is not None:
                self._emit_recovered(epoch, inc)
            else:
                since = float(prog.get("time", now)) - planned
                self._emit(recovered_line(epoch, snap.step, None, since))

    def _emit_recovered(self, epoch: int, inc: dict[str, Any]) -> None:
        self._emit(recovered_line(epoch, inc["first_commit_step"], inc["mttr_s"], None))

    def _reported(self, epoch: int) -> dict[str, Any] | None:
        """The incident of ``epoch`` with its MTTR, from this host's run directory (None until
        it has the commit's record, or when the incident happened on another host)."""
        from elaswave.report import recovered_incident

        with contextlib.suppress(Exception):
            return recovered_incident(self.run_dir, epoch)
        return None

    @staticmethod
    def _plan_time(status: dict[str, Any], epoch: int) -> float:
        for inc in status.get("incidents") or []:
            if int(inc.get("epoch", 0)) == epoch:
                return float(inc.get("t", time.time()))
        return time.time()

    def _update_bar(self, snap: Snapshot, eta: float | None) -> None:
        fields: dict[str, Any] = {  # rich's task fields take any values
            "loss": f"{snap.loss:.4f}" if snap.loss is not None else "–",
            "rate": f"{snap.samples_per_s:.1f}",
            "world": snap.world,
            "epoch": snap.epoch,
            "eta": clock(eta),
            "sparsity": (
                f"  sparsity {sparsity_text(snap.sparsity, self.target)}"
                if self.target is not None
                else ""
            ),
        }
        if self._progress is None:
            self._progress = Progress(
                TextColumn("[bold]step {task.completed:.0f}/{task.total:.0f}"),
                BarColumn(),
                TextColumn(
                    "loss {task.fields[loss]}{task.fields[sparsity]}  {task.fields[rate]} samples/s"
                ),
                TextColumn("world {task.fields[world]}  epoch {task.fields[epoch]}"),
                TimeElapsedColumn(),
                TextColumn("eta {task.fields[eta]}"),
                console=self.console,
                refresh_per_second=4,
            )
            self._progress.start()
            self._task = self._progress.add_task("train", total=snap.total, **fields)
        assert self._task is not None
        self._progress.update(self._task, completed=snap.step, total=snap.total, **fields)

    def _emit(self, line: str) -> None:
        target = self._progress.console if self._progress is not None else self.console
        target.print(line, highlight=False, soft_wrap=True)
