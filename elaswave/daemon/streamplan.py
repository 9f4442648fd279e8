"""What the job's event stream holds at which step: pure decisions, no I/O.

The stream (TensorBoard event files, a W&B run: :mod:`~elaswave.daemon.streams`) is written by
whichever host records a step (:mod:`~elaswave.daemon.records`: the host whose write moves the
job's progress record in etcd). Each time it does, it knows the record and the progress record
its write replaced; from these two and the plans its daemon adopted, this module decides:

- **a committed step** → the training scalars at its step (:func:`step_scalars`): loss, learning
  rate, gradient norm (where measured), samples/s, world size, epoch, seconds per step;
- **incidents** → the plans between the replaced record's epoch and the new one that answered a
  loss (a worker departed or was evicted: :func:`~elaswave.daemon.metrics.answers_loss`, the
  Prometheus counter's test, its kind from the same :func:`~elaswave.daemon.metrics.incident_kind`)
  are marked at the first step recorded under them (:func:`incidents_between`): exactly once,
  since each step is recorded once and each plan lies between exactly one pair of consecutive
  records. The MTTR is the report's (fault → that commit, with its phases) where this host's run
  directory holds the incident, else the time from the plan to the commit (:func:`recovery`);
- **a held-out evaluation** → ``eval/loss`` at its step;
- **a rollback** (silent corruption) and **the first record of a job** → a restart marker
  (TensorBoard's ``SessionLog.START``) at the first step that will be written again: readers
  drop what they hold from that step on, so redone steps replace the first ones; a rollback is
  an incident too, marked there (:func:`rollback_entry`).

Event files: one per run of consecutive records by one host, named so that the readers' order
(lexicographic; TensorBoard reads the files of a run in name order) is the stream's order: the
job's start, then the etcd revision of the write that opened the file (:func:`event_file_name`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from elaswave.daemon.metrics import answers_loss, incident_kind
from elaswave.planning.plan import Plan

__all__ = [
    "Entry",
    "PlanNote",
    "Recovery",
    "event_file_name",
    "eval_entry",
    "incident_entry",
    "incident_line",
    "incidents_between",
    "recovery",
    "rollback_entry",
    "step_entries",
    "step_scalars",
    "wandb_rows",
    "wandb_run_id",
]

# (tag, key of the step's record or of its progress record) of every training scalar
STEP_SCALARS = (
    ("train/loss", "loss"),
    ("train/learning_rate", "lr"),
    ("train/grad_norm", "grad_norm"),
    ("train/sparsity", "sparsity"),
    ("train/samples_per_s", "samples_per_s"),
    ("train/world_size", "world_size"),
    ("train/epoch", "epoch"),
    ("train/step_seconds", "step_seconds"),
)
EVAL_LOSS = "eval/loss"
INCIDENT_TEXT = "incidents"
INCIDENT_MTTR = "incidents/mttr_s"
INCIDENT_WORLD = "incidents/world_size"
INCIDENT_COUNT = "incidents/count"


@dataclass(frozen=True)
class Entry:
    """What the stream holds at one step: scalars and texts (by tag), or a restart marker."""

    step: int
    wall_time: float
    scalars: tuple[tuple[str, float], ...] = ()
    texts: tuple[tuple[str, str], ...] = ()
    restart: bool = False  # readers drop what they hold from ``step`` on


@dataclass(frozen=True)
class PlanNote:
    """What the stream needs of a plan its daemon adopted."""

    epoch: int
    created: float
    reason: str
    world: int
    loss: bool  # it answered a loss: an incident
    kind: str  # crash | hang | host | straggler | other

    @classmethod
    def of(cls, plan: Plan) -> PlanNote:
        return cls(
            epoch=plan.epoch, created=plan.created, reason=plan.reason, world=plan.world_size,
            loss=answers_loss(plan), kind=incident_kind(plan.reason),
        )  # fmt: skip


@dataclass(frozen=True)
class Recovery:
    """An incident and what it took, as the stream tells it at its step."""

    note: PlanNote
    mttr_s: float | None
    since: str  # "fault": the report's MTTR; "plan": from the plan (the fault was elsewhere)
    phases: dict[str, float | None] = field(default_factory=dict)
    fault: str | None = None  # the report's fault kind (kill, hang, ...), where it has one


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def step_scalars(record: Mapping[str, Any], progress: Mapping[str, Any]) -> tuple[Any, ...]:
    """The training scalars of a committed step, in ``STEP_SCALARS`` order; a value the record
    does not have (the gradient norm where nothing measured it) is left out. NaN and inf stay:
    a diverging loss is what the curve must show."""
    out = []
    for tag, key in STEP_SCALARS:
        value = _number(record.get(key, progress.get(key)))
        if value is not None:
            out.append((tag, value))
    return tuple(out)


def incidents_between(
    notes: Mapping[int, PlanNote], before_epoch: int | None, epoch: int
) -> list[PlanNote]:
    """The incidents to mark with a record of ``epoch`` whose predecessor was recorded under
    ``before_epoch`` (None: no predecessor, the job's first record): the plans in between
    that answered a loss, in epoch order."""
    low = before_epoch if before_epoch is not None else 0
    return [notes[e] for e in sorted(notes) if low < e <= epoch and notes[e].loss]


def recovery(note: PlanNote, commit_time: float, reported: Mapping[str, Any] | None) -> Recovery:
    """An incident's MTTR: the report's (fault → the first commit under its plan) when this
    host's run directory has the incident, else the time from the plan to that commit."""
    if reported is not None and reported.get("mttr_s") is not None:
        phases = {
            k: reported.get(k) for k in ("detection_s", "plan_s", "comm_s", "state_s", "redo_s")
        }
        fault = reported.get("kind")
        return Recovery(note, float(reported["mttr_s"]), "fault", phases, fault)
    since_plan = max(commit_time - note.created, 0.0) if note.created else None
    return Recovery(note, since_plan, "plan")


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1000:.0f} ms"


def incident_line(rec: Recovery) -> str:
    """One incident as text: its kind, the plan's reason (what failed, the new layout) and
    what it took."""
    note = rec.note
    kind = note.kind if rec.fault in (None, note.kind) else f"{note.kind} ({rec.fault})"
    took = f"MTTR {_ms(rec.mttr_s)}"
    if rec.since == "fault":
        parts = ", ".join(
            f"{name.removesuffix('_s')} {_ms(v)}" for name, v in rec.phases.items() if v is not None
        )
        took += f" from the fault ({parts})" if parts else " from the fault"
    elif rec.mttr_s is not None:
        took += " from the plan (the fault was recorded on another host)"
    return f"**{kind}**, epoch {note.epoch}: {note.reason}; world {note.world}; {took}"


def incident_entry(step: int, wall_time: float, recoveries: list[Recovery]) -> Entry | None:
    """The incident marker at ``step``: how many incidents its commit answered, the longest
    MTTR among them, the world size of the newest plan, and one line of text each."""
    if not recoveries:
        return None
    scalars: list[tuple[str, float]] = [(INCIDENT_COUNT, float(len(recoveries)))]
    mttrs = [r.mttr_s for r in recoveries if r.mttr_s is not None]
    if mttrs:
        scalars.append((INCIDENT_MTTR, max(mttrs)))
    scalars.append((INCIDENT_WORLD, float(recoveries[-1].note.world)))
    text = "\n\n".join(incident_line(r) for r in recoveries)
    return Entry(step, wall_time, tuple(scalars), ((INCIDENT_TEXT, text),))


def step_entries(
    record: Mapping[str, Any],
    progress: Mapping[str, Any],
    *,
    first: bool,
    recoveries: list[Recovery],
) -> list[Entry]:
    """Everything the stream holds for one recorded step. ``first``: the job's first record
    (nothing came before it in etcd): a restart marker first, so that a reader drops what an
    earlier launch of the same job left in the directory from this step on."""
    step, t = int(record["step"]), float(record["time"])
    out = [Entry(step, t, restart=True)] if first else []
    out.append(Entry(step, t, step_scalars(record, progress)))
    marker = incident_entry(step, t, recoveries)
    if marker is not None:
        out.append(marker)
    return out


def eval_entry(record: Mapping[str, Any]) -> list[Entry]:
    """A held-out evaluation at the step it was made after (or a script's ``job.log``
    metrics, each under ``script/NAME``)."""
    if record.get("kind") == "log":
        values = tuple(
            (f"script/{k}", float(v))
            for k, v in record.items()
            if k not in ("kind", "step", "time") and _number(v) is not None
        )
        return [Entry(int(record["step"]), float(record["time"]), values)] if values else []
    loss = _number(record.get("eval_loss"))
    if loss is None:
        return []
    return [Entry(int(record["step"]), float(record["time"]), ((EVAL_LOSS, loss),))]


def rollback_entry(step: int, wall_time: float, found_at: int | None = None) -> list[Entry]:
    """The job rolled back to ``step`` (silent corruption found by the check after step
    ``found_at``): the steps after it will be written again, and the incident is marked where
    they start (its MTTR is the report's: the time until the detecting step is committed
    again)."""
    out = [Entry(step + 1, wall_time, restart=True)]
    if found_at is not None and found_at > step:
        text = (
            f"**corrupt**: silent corruption found by the check after step {found_at}; rolled "
            f"back to the known-good step {step}, steps {step + 1}–{found_at} redone"
        )
        scalars = ((INCIDENT_COUNT, 1.0),)
        out.append(Entry(step + 1, wall_time, scalars, ((INCIDENT_TEXT, text),)))
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def event_file_name(started: float, key: int, host: str) -> str:
    """The name of an event file: TensorBoard's prefix, then the job's start (seconds, so that
    a later launch of the same job in the same directory sorts after it), then ``key`` (the etcd
    revision of the write that opened the file: the stream's order within the job), then the
    host that wrote it."""
    return f"events.out.tfevents.{int(started):010d}.{key:012d}.{_UNSAFE.sub('_', host)}.elaswave"


def wandb_run_id(job_id: str, started: float) -> str:
    """One W&B run per launch of a job (every host logs into it)."""
    return _UNSAFE.sub("_", f"{job_id}-{int(started)}").replace(".", "_")


def wandb_rows(entries: list[Entry]) -> list[tuple[int, dict[str, Any]]]:
    """(step, values) to log, one row per step in order: W&B keeps a step's first values and
    cannot go back, so a restart marker has no row."""
    rows: list[tuple[int, dict[str, Any]]] = []
    for e in entries:
        if e.restart:
            continue
        values: dict[str, Any] = {tag: v for tag, v in e.scalars}
        values.update({tag: text for tag, text in e.texts})
        if rows and rows[-1][0] == e.step:
            rows[-1][1].update(values)
        else:
            rows.append((e.step, values))
    return rows
