"""What the job's event stream holds at which step (daemon/streamplan.py): pure decisions."""

from __future__ import annotations

import math
from typing import Any

import pytest

from elaswave.daemon.streamplan import (
    INCIDENT_COUNT,
    INCIDENT_MTTR,
    INCIDENT_TEXT,
    INCIDENT_WORLD,
    Entry,
    PlanNote,
    eval_entry,
    event_file_name,
    incident_line,
    incidents_between,
    recovery,
    rollback_entry,
    step_entries,
    step_scalars,
    wandb_rows,
    wandb_run_id,
)
from elaswave.planning.plan import Plan

RECORD = {
    "step": 15, "loss": 2.5, "epoch": 2, "world_size": 3, "samples": 480,
    "step_seconds": 0.12, "lr": 3e-4, "grad_norm": 1.25, "time": 1000.0,
}  # fmt: skip


def _note(epoch: int, loss: bool = True, reason: str = "", world: int = 3) -> PlanNote:
    reason = reason or f"worker h.w{epoch} (rank 1) killed by SIGKILL → epoch {epoch}: dp 4→3"
    kind = "crash" if loss else "other"
    return PlanNote(epoch=epoch, created=990.0, reason=reason, world=world, loss=loss, kind=kind)


@pytest.mark.parametrize(
    ("record", "progress", "expected"),
    [
        (
            RECORD, {"samples_per_s": 250.0},
            [("train/loss", 2.5), ("train/learning_rate", 3e-4), ("train/grad_norm", 1.25),
             ("train/samples_per_s", 250.0), ("train/world_size", 3.0), ("train/epoch", 2.0),
             ("train/step_seconds", 0.12)],
        ),
        # no gradient norm measured (nothing asked for it), no rate yet: left out, not zero
        (
            {"step": 1, "loss": 5.0, "epoch": 1, "world_size": 4, "grad_norm": None, "time": 1.0},
            {},
            [("train/loss", 5.0), ("train/world_size", 4.0), ("train/epoch", 1.0)],
        ),
        # a diverging loss is what the curve must show
        (
            {"step": 2, "loss": math.inf, "epoch": 1, "world_size": 4, "time": 2.0}, {},
            [("train/loss", math.inf), ("train/world_size", 4.0), ("train/epoch", 1.0)],
        ),
    ],
)  # fmt: skip
def test_step_scalars(record: dict, progress: dict, expected: list) -> None:
    assert list(step_scalars(record, progress)) == expected


NOTES = {
    1: _note(1, loss=False, reason="start: 4 workers"),
    2: _note(2),
    3: _note(3, loss=False, reason="re-share by speed"),
    4: _note(4),
    5: _note(5),
}


@pytest.mark.parametrize(
    ("before", "epoch", "expected"),
    [
        (None, 1, []),  # the job's first record: the start is no incident
        (None, 2, [2]),  # workers died before the first commit: marked at the first record
        (1, 1, []),  # no plan in between
        (1, 2, [2]),  # the first record under the plan that answered a crash
        (2, 2, []),  # the next record: already marked
        (2, 3, []),  # a re-share is a plan, not an incident
        (3, 5, [4, 5]),  # a fault during recovery: both at the first commit after them
        (1, 5, [2, 4, 5]),
        (5, 5, []),
    ],
)
def test_incidents_between(before: int | None, epoch: int, expected: list[int]) -> None:
    assert [n.epoch for n in incidents_between(NOTES, before, epoch)] == expected


def test_every_incident_is_marked_once_whoever_records_the_steps() -> None:
    """Walk a job's records (epochs per step) written by alternating hosts: each plan that
    answered a loss is marked once, at the first step recorded under it."""
    epochs = [1, 1, 2, 2, 2, 4, 4, 5, 5]
    marked: list[tuple[int, int]] = []
    before = None
    for step, epoch in enumerate(epochs, 1):
        marked += [(n.epoch, step) for n in incidents_between(NOTES, before, epoch)]
        before = epoch
    assert marked == [(2, 3), (4, 6), (5, 8)]


def test_plan_note_uses_the_metrics_incident_decision() -> None:
    def plan(**kw: Any) -> Plan:
        return Plan(epoch=2, workers=("a", "b"), hosts=("h", "h"), microbatches=(8, 8),
                    store="", created=5.0, **kw)  # fmt: skip

    crash = PlanNote.of(plan(reason="worker h.w3 (rank 2) killed by SIGKILL", departed=("c",)))
    assert (crash.loss, crash.kind, crash.world, crash.created) == (True, "crash", 2, 5.0)
    joined = PlanNote.of(plan(reason="host g joined"))
    assert not joined.loss
    evicted = PlanNote.of(plan(reason="rank 1 slower than 3x the median", evicted=("c",)))
    assert (evicted.loss, evicted.kind) == (True, "straggler")


REPORTED = {
    "kind": "kill", "mttr_s": 0.144, "detection_s": 0.029, "plan_s": 0.009, "comm_s": 0.028,
    "state_s": 0.016, "redo_s": 0.063,
}  # fmt: skip


@pytest.mark.parametrize(
    ("reported", "mttr", "since", "text"),
    [
        (REPORTED, 0.144, "fault",
         "**crash (kill)**, epoch 2: worker h.w2 (rank 1) killed by SIGKILL → epoch 2: dp 4→3; "
         "world 3; MTTR 144 ms from the fault (detection 29 ms, plan 9 ms, comm 28 ms, "
         "state 16 ms, redo 63 ms)"),
        # the fault was on another host: the report here does not have it
        (None, 10.0, "plan",
         "**crash**, epoch 2: worker h.w2 (rank 1) killed by SIGKILL → epoch 2: dp 4→3; "
         "world 3; MTTR 10000 ms from the plan (the fault was recorded on another host)"),
        # the report has the incident but no commit under it yet: the plan's time
        ({"kind": "kill", "mttr_s": None}, 10.0, "plan", None),
    ],
)  # fmt: skip
def test_recovery_takes_the_reports_mttr_where_it_has_one(
    reported: dict | None, mttr: float, since: str, text: str | None
) -> None:
    rec = recovery(_note(2), 1000.0, reported)
    assert (rec.mttr_s, rec.since) == (pytest.approx(mttr), since)
    if text is not None:
        assert incident_line(rec) == text


def test_a_step_with_incidents() -> None:
    recs = [recovery(_note(2), 1000.0, REPORTED), recovery(_note(3, world=2), 1000.0, None)]
    entries = step_entries(RECORD, {}, first=False, recoveries=recs)
    assert [e.step for e in entries] == [15, 15]
    scalars, marker = entries
    assert dict(scalars.scalars)["train/loss"] == 2.5 and not scalars.restart
    assert dict(marker.scalars) == {INCIDENT_COUNT: 2.0, INCIDENT_MTTR: 10.0, INCIDENT_WORLD: 2.0}
    ((tag, text),) = marker.texts
    assert tag == INCIDENT_TEXT and text.count("**crash") == 2 and "epoch 3" in text


def test_the_jobs_first_record_restarts_the_stream() -> None:
    first = step_entries({**RECORD, "step": 1}, {}, first=True, recoveries=[])
    assert first[0] == Entry(1, 1000.0, restart=True) and not first[1].restart
    assert len(step_entries(RECORD, {}, first=False, recoveries=[])) == 1


def test_eval_and_rollback_entries() -> None:
    assert eval_entry({"step": 20, "eval_loss": 1.5, "time": 7.0}) == [
        Entry(20, 7.0, (("eval/loss", 1.5),))
    ]
    assert eval_entry({"step": 20, "eval_loss": None, "time": 7.0}) == []
    # rolled back to step 12: readers drop steps 13 on, which are redone
    assert rollback_entry(12, 9.0) == [Entry(13, 9.0, restart=True)]
    restart, marker = rollback_entry(12, 9.0, found_at=15)  # the check after 15 found it
    assert restart == Entry(13, 9.0, restart=True) and marker.step == 13
    assert dict(marker.scalars) == {INCIDENT_COUNT: 1.0}
    ((tag, text),) = marker.texts
    assert tag == INCIDENT_TEXT and "after step 15" in text and "steps 13–15 redone" in text


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((1000.0, 11, "h0"), (1000.0, 13, "h1")),  # the stream's order within a job
        ((1000.0, 999, "h1"), (1000.0, 1000, "h0")),  # not the host's, nor by digits
        ((1000.0, 5_000_000, "h0"), (1001.0, 3, "h0")),  # a later launch after the earlier
        ((1000.0, 13, "h0"), (1000.0, 13, "h1")),  # an evaluation's file beside a step's
    ],
)
def test_event_files_sort_in_the_streams_order(a: tuple, b: tuple) -> None:
    assert event_file_name(*a) < event_file_name(*b)
    assert event_file_name(*a).startswith("events.out.tfevents.")


def test_event_file_names_are_safe() -> None:
    assert "/" not in event_file_name(1.0, 1, "../x y")


def test_wandb_rows_and_id() -> None:
    entries = [
        Entry(1, 1.0, restart=True),
        Entry(1, 1.0, (("train/loss", 2.0),)),
        Entry(1, 1.0, ((INCIDENT_COUNT, 1.0),), ((INCIDENT_TEXT, "x"),)),
        Entry(2, 2.0, (("train/loss", 1.5),)),
    ]
    assert wandb_rows(entries) == [
        (1, {"train/loss": 2.0, INCIDENT_COUNT: 1.0, INCIDENT_TEXT: "x"}),
        (2, {"train/loss": 1.5}),
    ]
    assert wandb_run_id("my.job", 1234.5) == "my_job-1234"
