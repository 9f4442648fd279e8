"""The job's event stream on this host: ``logging.tensorboard`` and ``logging.wandb``.

One stream per job, not per rank: a step enters it where its ``metrics.jsonl`` line is written,
on the host whose write moved the job's progress record in etcd to that step
(:mod:`~elaswave.daemon.records`), so across faults, leader changes and rank 0 moving between
hosts every committed step is in it once. What goes in at which step is decided by the pure
functions of :mod:`~elaswave.daemon.streamplan`; this module applies them:

- on the daemon's event loop, right after the ``metrics.jsonl`` line (so that a host killed
  between the two loses no more than it loses of ``metrics.jsonl``): the step's scalars, an
  evaluation, a rollback's restart marker, appended to this host's event file (a few hundred
  bytes and a flush, as the line itself);
- on the stream's own thread, in the order the records landed: an incident's marker, whose MTTR
  comes from the report's replay of this host's run directory (too slow for the loop), and the
  W&B run, whose client may block.

A sink that fails (a full disk, W&B's service gone) says so in one line and in ``daemon.log``
and takes nothing more; training never waits for the stream.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from elaswave.config import JobConfig
from elaswave.daemon.sinks import TensorBoardFiles, WandbRun, load_packages
from elaswave.daemon.streamplan import (
    Entry,
    PlanNote,
    eval_entry,
    incident_entry,
    incidents_between,
    recovery,
    rollback_entry,
    step_entries,
    wandb_run_id,
)
from elaswave.planning.plan import Plan

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 30.0  # how long the daemon's exit waits for the stream (W&B may upload)

Lookup = Callable[[Path, int], "dict[str, Any] | None"]


def _report_lookup(run_dir: Path, epoch: int) -> dict[str, Any] | None:
    from elaswave.report import recovered_incident

    return recovered_incident(run_dir, epoch)


class JobStream:
    """This host's part of the job's stream. Built before the daemon's event loop runs (it
    imports the sinks' packages); ``start`` once the job's start time is known; ``plan``,
    ``landed``, ``evaluated`` and ``rolled_back`` from the event loop; ``close`` at the end."""

    def __init__(
        self, cfg: JobConfig, *, host_id: str, run_dir: Path, lookup: Lookup = _report_lookup
    ) -> None:
        load_packages(cfg.logging)  # before the event loop: an import there could stall it
        self.cfg = cfg
        self.host_id = host_id
        self.run_dir = run_dir
        self.lookup = lookup
        self.notes: dict[int, PlanNote] = {}  # the plans this daemon adopted (the loop's)
        self.tb: TensorBoardFiles | None = None
        self.wandb: WandbRun | None = None
        self.failed: dict[str, str] = {}  # stream -> why it stopped taking entries
        self._lock = threading.Lock()  # the event files: the loop's steps, the thread's markers
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    @property
    def _wandb_wanted(self) -> bool:
        return "wandb" in self.cfg.logging.streams and "wandb" not in self.failed

    # ---- the event loop's side --------------------------------------------------------------
    def start(self, started: float) -> None:
        """The job's start (the same on every host of the job) names the files and the run."""
        cfg = self.cfg
        if cfg.logging.tensorboard is not None:
            directory = Path(cfg.logging.tensorboard) / cfg.job_id
            self.tb = self._guard(
                "tensorboard",
                lambda: TensorBoardFiles(directory, host=self.host_id, started=started),
            )
        self._thread = threading.Thread(
            target=self._run, args=(started,), name="stream", daemon=True
        )
        self._thread.start()

    def plan(self, plan: Plan) -> None:
        """A plan this daemon adopted (before any step recorded under it reaches the stream)."""
        self.notes[plan.epoch] = PlanNote.of(plan)

    def landed(
        self,
        record: dict[str, Any],
        progress: dict[str, Any],
        *,
        before: dict[str, Any] | None,
        revision: int | None,
        continues: bool,
    ) -> None:
        """This host recorded a step: ``before`` is the progress record its write replaced
        (None: the job's first), ``revision`` the write's (None: written locally, etcd gone),
        ``continues``: the record before it was this host's too."""
        try:
            prior = before.get("epoch") if before is not None else None
            due = incidents_between(
                self.notes, int(prior) if prior is not None else None, int(record["epoch"])
            )
            entries = step_entries(record, progress, first=before is None, recoveries=[])
        except (KeyError, TypeError, ValueError):  # a malformed record: not the loop's problem
            log.exception("the job's stream skipped a record: %r", record)
            return
        self._record(entries, due, revision, continues=continues)

    def adopted(self, record: dict[str, Any], progress: dict[str, Any], *, revision: int) -> None:
        """A step whose writer left the plan right after moving the progress record to it (its
        host died): this host writes it again, from that record (``revision``: its write's).
        The writer may have put the step into its own file before it died, or not: a restart
        marker at the step first (readers drop what they hold from it on), then the step and
        the incidents the writer would have marked with it, in a file keyed right after that
        write (the writer's file may be keyed at the write itself, where it took the stream over
        at this step: a tie the hosts' names would break), which this host's next records
        continue. What the writer put into the stream after the step (an evaluation made after
        it) goes with its host."""
        try:
            step, t, epoch = int(record["step"]), float(record["time"]), int(record["epoch"])
            # the epoch of the record it followed (a record without one: nothing to mark)
            prior = progress.get("prior_epoch", epoch)
            due = incidents_between(self.notes, int(prior) if prior is not None else None, epoch)
            entries = step_entries(record, progress, first=False, recoveries=[])
        except (KeyError, TypeError, ValueError):
            log.exception("the job's stream skipped a record: %r", record)
            return
        entries.insert(0, Entry(step, t, restart=True))
        self._record(entries, due, revision + 1, continues=False)

    def _record(
        self, entries: list[Entry], due: list[PlanNote], revision: int | None, *, continues: bool
    ) -> None:
        """A recorded step's entries into this host's event file; onto the stream's thread the
        incidents it answers (``due``) and the W&B row."""
        self._write_events(entries, revision, continues)
        if due or self._wandb_wanted:
            self._queue.put(("step", (entries, due, entries[-1].step, entries[-1].wall_time)))

    def evaluated(self, record: dict[str, Any], *, revision: int | None, continues: bool) -> None:
        try:
            entries = eval_entry(record)
        except (KeyError, TypeError, ValueError):
            log.exception("the job's stream skipped an evaluation: %r", record)
            return
        self._write_events(entries, revision, continues)
        if entries and self._wandb_wanted:
            self._queue.put(("step", (entries, [], entries[-1].step, entries[-1].wall_time)))

    def rolled_back(self, step: int, *, found_at: int | None, revision: int | None) -> None:
        """The job rolled back to ``step`` (corruption found after ``found_at``): the stream goes
        on from there, in a file of its own (a W&B run cannot go back: it keeps the first
        values of the redone steps, and has no row for the rollback)."""
        self._write_events(rollback_entry(step, time.time(), found_at), revision, False)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued, close the sinks (bounded: a stuck sink does not hold the
        daemon's exit)."""
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the job's stream did not finish within %.0f s", timeout)
        if self.tb is not None:
            with self._lock:
                self.tb.close()

    def _write_events(self, entries: list[Entry], revision: int | None, continues: bool) -> None:
        tb = self.tb
        if tb is None or "tensorboard" in self.failed:
            return
        with self._lock:
            self._guard("tensorboard", lambda: tb.write(entries, key=revision, continues=continues))

    # ---- the thread -------------------------------------------------------------------------
    def _run(self, started: float) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            try:
                entries, due, step, t = item[1]
                self._step(started, entries, due, step=step, t=t)
            except Exception:  # noqa: BLE001 - the stream never takes the daemon down
                log.exception("the job's stream dropped an entry")
        if self.wandb is not None:
            self._guard("wandb", self.wandb.close)

    def _step(
        self, started: float, entries: list[Entry], due: list[PlanNote], *, step: int, t: float
    ) -> None:
        """A step's incident marker (with the report's MTTR) into the event file, and the
        whole step into the W&B run."""
        recoveries = [recovery(note, t, self._reported(note.epoch)) for note in due]
        marker = incident_entry(step, t, recoveries)
        tb = self.tb
        if marker is not None and tb is not None and "tensorboard" not in self.failed:
            with self._lock:  # into this host's newest file, after the step's scalars
                self._guard("tensorboard", lambda: tb.write([marker], key=None, continues=True))
        if self._wandb_wanted:
            wandb = self.wandb or self._open_wandb(started)
            rows = [*entries, *([marker] if marker is not None else [])]
            if wandb is not None:
                self._guard("wandb", lambda: wandb.write(rows))

    def _open_wandb(self, started: float) -> WandbRun | None:
        """The job's W&B run, joined at this host's first row: a host that records no step
        never opens it."""
        cfg, wb = self.cfg, self.cfg.logging.wandb
        assert wb is not None
        self.wandb = self._guard(
            "wandb",
            lambda: WandbRun(
                wb, run_id=wandb_run_id(cfg.job_id, started), name=cfg.job_id,
                directory=self.run_dir, config=cfg.to_dict(),
            ),
        )  # fmt: skip
        return self.wandb

    def _reported(self, epoch: int) -> dict[str, Any] | None:
        try:
            return self.lookup(self.run_dir, epoch)
        except Exception:  # noqa: BLE001 - an unreadable run directory: the plan's MTTR
            log.warning("no report of the incident of epoch %d", epoch, exc_info=True)
            return None

    # ---- failures ---------------------------------------------------------------------------
    def _guard(self, name: str, call: Callable[[], Any]) -> Any:
        """``call()``; an error stops the stream ``name`` with one line (None then)."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - one line for the user, training goes on
            if name not in self.failed:
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                log.error("logging.%s stopped: %s", name, self.failed[name], exc_info=exc)
                print(
                    f"elaswave: logging.{name} stopped ({self.failed[name]}); training goes on",
                    file=sys.stderr,
                    flush=True,
                )
            return None
