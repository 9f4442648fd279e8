"""The MTTR report, replayed from synthetic ``events.jsonl`` / ``metrics.jsonl`` run directories."""

from __future__ import annotations

import csv
import io
import json
import random
from pathlib import Path
from typing import Any

import pytest

from elaswave.events import EVENTS_FILE, METRICS_FILE, EventLog, JsonlWriter, read_jsonl
from elaswave.report import PHASES, build_report, merge_spans
from elaswave.report_text import CSV_FIELDS, render

CRASH_REASON = "worker w1 (rank 1) killed by SIGKILL"
PLAN2_REASON = f"{CRASH_REASON} → epoch 2: dp 4→3, micro-batches 16 → [6, 5, 5]"


def start_events() -> list[dict[str, Any]]:
    """A 4-worker job starting: epoch 1 and its (ignored) recovery-phase events."""
    events: list[dict[str, Any]] = [
        {"t": 90.0, "kind": "host_joined", "host": "h0"},
        {"t": 90.5, "kind": "plan_published", "epoch": 1, "world": 4, "departed": [],
         "workers": ["w0", "w1", "w2", "w3"], "reason": "epoch 1: start: dp 4"},
    ]  # fmt: skip
    for r in range(4):
        events.append({"t": 90.6, "kind": "comm_rebuilt", "worker": f"w{r}", "rank": r,
                       "epoch": 1, "seconds": 0.5})  # fmt: skip
        events.append({"t": 90.7, "kind": "state_synced", "worker": f"w{r}", "rank": r,
                       "epoch": 1, "bytes": 0, "resume_step": 0})  # fmt: skip
    return events


def kill_events() -> list[dict[str, Any]]:
    """Rank 1 (w1) killed while step 15 was in flight, and the recovery to epoch 2."""
    return [
        {"t": 100.0, "kind": "fault_injected", "worker": "w1", "rank": 1, "step": 15,
         "fault": {"kind": "kill", "rank": 1, "at_step": 15}},
        {"t": 100.02, "kind": "worker_exit", "worker": "w1", "rank": 1, "exit_code": -9,
         "reason": CRASH_REASON},
        {"t": 100.03, "kind": "plan_published", "epoch": 2, "world": 3, "departed": ["w1"],
         "workers": ["w0", "w2", "w3"], "reason": PLAN2_REASON},
        {"t": 100.035, "kind": "comm_rebuilt", "worker": "w0", "rank": 0, "epoch": 2,
         "seconds": 0.004},
        {"t": 100.04, "kind": "comm_rebuilt", "worker": "w2", "rank": 1, "epoch": 2,
         "seconds": 0.01},
        {"t": 100.038, "kind": "comm_rebuilt", "worker": "w3", "rank": 2, "epoch": 2,
         "seconds": 0.007},
        {"t": 100.043, "kind": "state_synced", "worker": "w0", "rank": 0, "epoch": 2,
         "bytes": 0, "resume_step": 14},
        {"t": 100.045, "kind": "state_synced", "worker": "w2", "rank": 1, "epoch": 2,
         "bytes": 1000, "resume_step": 14},
        {"t": 100.044, "kind": "state_synced", "worker": "w3", "rank": 2, "epoch": 2,
         "bytes": 1500, "resume_step": 14},
    ]  # fmt: skip


def metrics(steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Steps 1..40: epoch 1 (4 workers) up to step 14, then epoch 2 (3 workers) from 100.1 s."""
    out = []
    for s in steps if steps is not None else list(range(1, 41)):
        early = s <= 14
        out.append({
            "step": s,
            "loss": round(5.0 - 0.01 * s, 4),
            "epoch": 1 if early else 2,
            "world_size": 4 if early else 3,
            "samples": 32 * s,
            "step_seconds": 0.05,
            "time": 90.0 + 0.5 * s if early else round(100.1 + 0.1 * (s - 15), 6),
        })  # fmt: skip
    return out


def write_run(
    run_dir: Path, events: list[dict[str, Any]], metric_rows: list[dict[str, Any]]
) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    log = EventLog(run_dir / EVENTS_FILE)
    for ev in events:
        fields = {k: v for k, v in ev.items() if k not in ("t", "kind")}
        log.emit(ev["kind"], t=ev["t"], **fields)
    log.close()
    writer = JsonlWriter(run_dir / METRICS_FILE)
    for row in metric_rows:
        writer.write(row)
    writer.close()
    return run_dir


@pytest.fixture
def kill_run(tmp_path: Path) -> Path:
    return write_run(tmp_path / "kill", start_events() + kill_events(), metrics())


# ---- one planned kill ------------------------------------------------------------------------

EXPECTED_PHASES = {
    "detection_s": 0.02,
    "plan_s": 0.01,
    "comm_s": 0.01,
    "state_s": 0.005,
    "redo_s": 0.055,
}


def test_kill_incident_phases(kill_run: Path) -> None:
    report = build_report(kill_run)
    assert report["run_dir"] == str(kill_run)
    assert len(report["incidents"]) == 1
    inc = report["incidents"][0]
    for name, expected in EXPECTED_PHASES.items():
        assert inc[name] == pytest.approx(expected, abs=1e-6), name
    assert inc["mttr_s"] == pytest.approx(0.1, abs=1e-6)
    assert sum(inc[p] for p in PHASES) == pytest.approx(inc["mttr_s"], abs=1e-5)
    assert inc["first_commit_step"] == 15


def test_kill_incident_fields(kill_run: Path) -> None:
    inc = build_report(kill_run)["incidents"][0]
    assert inc["id"] == 1
    assert inc["kind"] == "kill"
    assert (inc["worker"], inc["rank"], inc["fault_step"]) == ("w1", 1, 15)
    assert inc["fault_t"] == 100.0
    assert (inc["epoch"], inc["world_after"]) == (2, 3)
    assert inc["reason"] == PLAN2_REASON
    # Only epoch 2's recovery events count, not epoch 1's start-up.
    assert inc["comm_rebuild_max_s"] == pytest.approx(0.01)
    assert inc["state_bytes"] == 2500
    assert inc["state_resume_step"] == 14


REDO = {
    "redo_step": 15,
    "kept_microbatches": {"w0": 4, "w2": 4, "w3": 4},
    "redo_microbatches": {"w0": [4, 5], "w2": [6], "w3": [7]},
}
STAGE_REDO = {
    "redo_step": 15,
    "kept_microbatches": {"w0": 0, "w2": 8, "w3": 8},
    "redo_replicas": [[0], [1, 2, 3]],
    "microbatches": 16,
}
ZERO = {"transfers": 3, "bytes": 3000, "pairs": 2, "max_over_mean": 1.25, "promoted_bytes": 512}
ROLLED_BACK = "; rolled back to snapshot step 14, 2 step(s) redone"
RESTORED = "; in-memory copies lost, restored checkpoint step 10, 5 step(s) recomputed"


def restore(reason: str) -> dict[str, Any]:
    return {"t": 100.05, "kind": "durable_restored", "step": 10, "recomputed_steps": 5,
            "reason": reason}  # fmt: skip


@pytest.mark.parametrize(
    ("state_extra", "more_events", "expected"),
    [
        # replicated sync: the bytes each rank received add up
        ({}, [], {"state_bytes": 2500, "state_pairs": 0, "state_max_over_mean": 1.0,
                  "state_promoted_bytes": None, "recomputed_steps": 0, "reason": PLAN2_REASON}),
        # ZeRO: every rank reports the whole plan's totals
        ({r: ZERO for r in range(3)}, [],
         {"state_bytes": 3000, "state_pairs": 2, "state_max_over_mean": 1.25,
          "state_promoted_bytes": 512}),
        ({1: {**ZERO, "promoted_bytes": 64}, 2: {"promoted_bytes": 128}}, [],
         {"state_bytes": 3000, "state_promoted_bytes": 128}),
        # pipelines: the migration's own record, else the longest rank's
        ({1: {"migration": "async", "migration_seconds": 0.3}},
         [{"t": 100.3, "kind": "migration_done", "epoch": 2, "seconds": 0.25}],
         {"migration": "async", "migration_s": 0.25}),
        ({0: {"migration": "blocking", "migration_seconds": 0.2},
          2: {"migration": "blocking", "migration_seconds": 0.4}}, [],
         {"migration": "blocking", "migration_s": 0.4}),
        ({1: {"migration": "async"}}, [], {"migration": "async", "migration_s": 0.0}),
        # rolled back to a snapshot, or restored from a durable checkpoint (which wins)
        ({1: {"redone_steps": 2}}, [],
         {"recomputed_steps": 2, "reason": PLAN2_REASON + ROLLED_BACK}),
        ({1: {"redone_steps": 2}}, [restore("lost")],
         {"recomputed_steps": 5, "reason": PLAN2_REASON + RESTORED}),
        ({}, [restore("lost")], {"recomputed_steps": 5, "reason": PLAN2_REASON + RESTORED}),
        ({}, [restore("resume")], {"recomputed_steps": 0, "reason": PLAN2_REASON}),
        # a partial redo: what the survivors kept and who computed the lost micro-batches
        ({r: REDO for r in range(3)}, [],
         {"kept_microbatches": 12, "redone_microbatches": 4, "redone_by": {"w0": 2, "w2": 1,
                                                                          "w3": 1}}),
        # pipelines: every stage of a replica runs its share of the lost micro-batches
        ({r: STAGE_REDO for r in range(3)}, [],
         {"kept_microbatches": 12, "redone_microbatches": 4,
          "redone_by": {"replica 0": 1, "replica 1": 3}}),
        # a strategy that does not say (ZeRO-3)
        ({}, [], {"kept_microbatches": None, "redone_microbatches": None, "redone_by": None}),
    ],
)  # fmt: skip
def test_kill_incident_state_and_rollback_table(
    tmp_path: Path,
    state_extra: dict[int, dict[str, Any]],
    more_events: list[dict[str, Any]],
    expected: dict[str, Any],
) -> None:
    events = kill_events() + more_events
    for ev in events:
        if ev["kind"] == "state_synced":
            ev.update(state_extra.get(ev["rank"], {}))
    inc = build_report(write_run(tmp_path / "run", start_events() + events, metrics()))[
        "incidents"
    ][0]
    assert {k: inc.get(k, "absent") for k in expected} == expected
    assert "_restored_t" not in inc
    if "migration" not in expected:
        assert "migration" not in inc and "migration_s" not in inc
    assert inc["mttr_s"] == pytest.approx(0.1, abs=1e-6)


def test_the_markdown_says_what_was_redone(tmp_path: Path) -> None:
    events = kill_events()
    for ev in events:
        if ev["kind"] == "state_synced":
            ev.update(REDO)
    report = build_report(write_run(tmp_path / "run", start_events() + events, metrics()))
    text = render(report, "md")
    assert "redone 4 of 16 micro-batches (w0 2, w2 1, w3 1)" in text
    row = next(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert (row["kept_microbatches"], row["redone_microbatches"]) == ("12", "4")


def test_the_totals_say_what_each_worker_last_held(tmp_path: Path) -> None:
    held = {"param_bytes": 400, "grad_bytes": 416, "optimizer_bytes": 800, "replica_bytes": 0}
    events = start_events() + [
        {"t": 90.8, "kind": "memory", "worker": f"w{r}", "epoch": 1, **held} for r in range(4)
    ] + kill_events() + [
        {"t": 100.05, "kind": "memory", "worker": "w2", "epoch": 2, **held, "grad_bytes": 9}
    ]  # fmt: skip
    memory = build_report(write_run(tmp_path / "run", events, metrics()))["totals"]["memory"]
    assert memory["w0"] == {"epoch": 1, **held}
    assert memory["w2"] == {"epoch": 2, **held, "grad_bytes": 9}, "the newest report wins"
    assert set(memory) == {"w0", "w1", "w2", "w3"}


def test_kill_totals(kill_run: Path) -> None:
    totals = build_report(kill_run)["totals"]
    assert totals["committed_steps"] == 40
    assert totals["last_step"] == 40
    assert totals["duplicate_steps"] == []
    assert totals["missing_steps"] == []
    assert totals["final_loss"] == pytest.approx(4.6)
    assert totals["final_world_size"] == 3
    assert totals["incidents"] == 1  # the kill's worker_exit is not a second incident
    assert totals["plans"] == 2
    assert totals["mttr_median_s"] == pytest.approx(0.1, abs=1e-6)
    assert totals["mttr_max_s"] == pytest.approx(0.1, abs=1e-6)
    assert totals["wall_s"] == pytest.approx(102.6 - 90.5, abs=1e-3)


def test_event_order_in_file_does_not_matter(tmp_path: Path, kill_run: Path) -> None:
    events = start_events() + kill_events()
    random.Random(7).shuffle(events)
    shuffled = build_report(write_run(tmp_path / "shuffled", events, metrics()))
    expected = build_report(kill_run)
    assert shuffled["incidents"] == expected["incidents"]
    assert shuffled["totals"] == expected["totals"]


def test_commit_must_be_in_the_new_epoch(tmp_path: Path) -> None:
    # A late epoch-1 commit recorded after the plan does not end the incident.
    rows = metrics()
    late = {**rows[13], "step": 14, "time": 100.05}  # epoch 1 row, after the plan
    rows = rows[:13] + [late] + rows[14:]
    inc = build_report(write_run(tmp_path / "late", start_events() + kill_events(), rows))[
        "incidents"
    ][0]
    assert inc["first_commit_step"] == 15
    assert inc["mttr_s"] == pytest.approx(0.1, abs=1e-6)


# ---- step accounting -------------------------------------------------------------------------


def test_duplicate_and_missing_steps_are_reported(tmp_path: Path) -> None:
    steps = [s for s in range(1, 41) if s != 30]
    steps.insert(steps.index(21), 20)  # step 20 committed twice
    run = write_run(tmp_path / "dup", start_events() + kill_events(), metrics(steps))
    totals = build_report(run)["totals"]
    assert totals["duplicate_steps"] == [20]
    assert totals["missing_steps"] == [30]
    assert totals["committed_steps"] == 39
    assert totals["last_step"] == 40


# ---- unplanned crash -------------------------------------------------------------------------


def crash_events(t0: float = 200.0) -> list[dict[str, Any]]:
    """w2 (rank 2) dies on its own: no fault_injected, only the daemon's worker_exit."""
    return [
        {"t": t0, "kind": "worker_exit", "worker": "w2", "rank": 2, "exit_code": 1,
         "reason": "worker w2 (rank 2) exited with code 1"},
        {"t": t0 + 0.05, "kind": "plan_published", "epoch": 3, "world": 2, "departed": ["w2"],
         "workers": ["w0", "w3"], "reason": "w2 exited → epoch 3: dp 3→2"},
        {"t": t0 + 0.07, "kind": "comm_rebuilt", "worker": "w0", "rank": 0, "epoch": 3},
        {"t": t0 + 0.08, "kind": "comm_rebuilt", "worker": "w3", "rank": 1, "epoch": 3},
        {"t": t0 + 0.1, "kind": "state_synced", "worker": "w0", "rank": 0, "epoch": 3,
         "bytes": 0, "resume_step": 40},
        {"t": t0 + 0.1, "kind": "state_synced", "worker": "w3", "rank": 1, "epoch": 3,
         "bytes": 0, "resume_step": 40},
    ]  # fmt: skip


def crash_metrics(t0: float = 200.0) -> list[dict[str, Any]]:
    return [
        {"step": s, "loss": 4.5, "epoch": 3, "world_size": 2, "samples": 32 * s,
         "time": round(t0 + 0.3 + 0.1 * (s - 41), 6)}
        for s in range(41, 46)
    ]  # fmt: skip


def test_unplanned_crash_starts_at_its_detection(tmp_path: Path) -> None:
    run = write_run(tmp_path / "crash", start_events() + crash_events(), crash_metrics())
    report = build_report(run)
    assert len(report["incidents"]) == 1
    inc = report["incidents"][0]
    assert inc["kind"] == "crash"
    assert (inc["worker"], inc["rank"], inc["fault_step"]) == ("w2", 2, None)
    assert inc["fault_t"] == 200.0
    assert inc["detection_s"] == 0.0
    assert inc["plan_s"] == pytest.approx(0.05, abs=1e-6)
    assert inc["comm_s"] == pytest.approx(0.03, abs=1e-6)
    assert inc["state_s"] == pytest.approx(0.02, abs=1e-6)
    assert inc["redo_s"] == pytest.approx(0.2, abs=1e-6)
    assert inc["mttr_s"] == pytest.approx(0.3, abs=1e-6)
    assert inc["first_commit_step"] == 41
    assert inc["epoch"] == 3 and inc["world_after"] == 2


def test_kill_then_crash_are_two_incidents_in_time_order(tmp_path: Path) -> None:
    events = crash_events() + kill_events() + start_events()  # file order is irrelevant
    run = write_run(tmp_path / "both", events, metrics() + crash_metrics())
    report = build_report(run)
    incidents = report["incidents"]
    assert [(i["id"], i["kind"], i["worker"]) for i in incidents] == [
        (1, "kill", "w1"),
        (2, "crash", "w2"),
    ]
    assert [i["mttr_s"] for i in incidents] == pytest.approx([0.1, 0.3], abs=1e-6)
    totals = report["totals"]
    assert totals["incidents"] == 2 and totals["plans"] == 3
    assert totals["mttr_median_s"] == pytest.approx(0.2, abs=1e-6)
    assert totals["mttr_max_s"] == pytest.approx(0.3, abs=1e-6)
    assert totals["committed_steps"] == 45 and totals["missing_steps"] == []


def test_fault_without_recovery_has_no_mttr(tmp_path: Path) -> None:
    events = start_events() + kill_events()[:2]  # killed and detected, no new plan
    report = build_report(write_run(tmp_path / "stuck", events, metrics(list(range(1, 15)))))
    inc = report["incidents"][0]
    assert inc["detection_s"] == pytest.approx(0.02, abs=1e-6)
    assert all(inc[p] is None for p in PHASES if p != "detection_s")
    assert inc["mttr_s"] is None and inc["first_commit_step"] is None
    assert inc["epoch"] is None and inc["reason"] == CRASH_REASON
    assert report["totals"]["mttr_median_s"] is None
    # Same keys as a recovered incident, so JSON consumers need no special case.
    recovered_run = write_run(tmp_path / "ok", start_events() + kill_events(), metrics())
    recovered = build_report(recovered_run)["incidents"][0]
    assert set(inc) == set(recovered)


# ---- torn lines ------------------------------------------------------------------------------


@pytest.mark.parametrize("filename", [EVENTS_FILE, METRICS_FILE])
def test_torn_last_line_is_skipped(tmp_path: Path, kill_run: Path, filename: str) -> None:
    expected = build_report(kill_run)
    with open(kill_run / filename, "a", encoding="utf-8") as f:
        f.write('{"t": 100.5, "kind": "worker_ex')  # writer killed mid-line: no newline
    torn = build_report(kill_run)
    assert torn["incidents"] == expected["incidents"]
    assert torn["totals"] == expected["totals"]


def test_read_jsonl_skips_torn_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "x.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3, "b"')
    assert list(read_jsonl(path)) == [{"a": 1}, {"a": 2}]
    assert list(read_jsonl(tmp_path / "absent.jsonl")) == []


def test_empty_run_dir_has_no_incidents(tmp_path: Path) -> None:
    report = build_report(tmp_path)
    assert report["incidents"] == []
    assert report["totals"]["committed_steps"] == 0
    assert report["totals"]["final_loss"] is None
    assert "No incidents." in render(report, "md")


# ---- render ----------------------------------------------------------------------------------


def test_render_json_parses_back(kill_run: Path) -> None:
    report = build_report(kill_run)
    assert json.loads(render(report, "json")) == report


def test_render_csv_has_header_and_one_row_per_incident(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "both",
        start_events() + kill_events() + crash_events(),
        metrics() + crash_metrics(),
    )
    report = build_report(run)
    text = render(report, "csv")
    rows = list(csv.reader(io.StringIO(text)))
    assert rows[0] == CSV_FIELDS
    assert len(rows) == 1 + len(report["incidents"]) == 3
    parsed = list(csv.DictReader(io.StringIO(text)))
    assert [r["id"] for r in parsed] == ["1", "2"]
    assert parsed[0]["reason"] == PLAN2_REASON  # commas in the reason survive quoting
    assert float(parsed[0]["mttr_s"]) == pytest.approx(0.1, abs=1e-6)
    assert parsed[1]["kind"] == "crash"


def test_render_csv_without_incidents_is_just_the_header(tmp_path: Path) -> None:
    rows = list(csv.reader(io.StringIO(render(build_report(tmp_path), "csv"))))
    assert rows == [CSV_FIELDS]


def test_render_markdown(kill_run: Path) -> None:
    text = render(build_report(kill_run), "md")
    assert "MTTR" in text
    assert "| 1 | kill rank 1 | 15 |" in text
    assert "**100 ms**" in text
    assert "20 ms" in text  # detection
    assert f"incident 1: {PLAN2_REASON}" in text
    assert "Committed steps: 40" in text
    assert text.endswith("\n")


@pytest.mark.parametrize("fmt", ["xml", "", "JSON", "markdown"])
def test_render_unknown_format(kill_run: Path, fmt: str) -> None:
    with pytest.raises(ValueError, match="unknown format"):
        render(build_report(kill_run), fmt)


# ---- stragglers and the restart-loop breaker -------------------------------------------------

SLOW_PLAN = "straggler: worker w3 (rank 3) 2.40× … → epoch 2: dp 4, micro-batches … → [5, 5, 4, 2]"


def test_slow_incident_runs_from_the_fault_to_the_first_reshared_commit(tmp_path: Path) -> None:
    events = start_events() + [
        {"t": 100.0, "kind": "fault_injected", "worker": "w3", "rank": 3, "step": 15,
         "delay": 0.1, "fault": {"kind": "slow", "rank": 3, "at_step": 15, "delay": 0.1}},
        {"t": 100.02, "kind": "straggler_detected", "stragglers": ["w1"], "evict": [],
         "plan_reason": "another plan"},  # another rank's verdict is not this incident's
        {"t": 100.03, "kind": "plan_published", "epoch": 2, "world": 4, "departed": [],
         "evicted": [], "workers": ["w0", "w1", "w2", "w3"], "reason": SLOW_PLAN},
        {"t": 100.031, "kind": "straggler_detected", "stragglers": ["w3"], "evict": [],
         "plan_reason": SLOW_PLAN},
        {"t": 100.04, "kind": "comm_rebuilt", "worker": "w0", "rank": 0, "epoch": 2,
         "seconds": 0.0},
        {"t": 100.05, "kind": "state_synced", "worker": "w0", "rank": 0, "epoch": 2,
         "bytes": 0, "resume_step": 14},
    ]  # fmt: skip
    rows = metrics()
    for row in rows:
        row["world_size"] = 4
    (inc,) = build_report(write_run(tmp_path / "slow", events, rows))["incidents"]
    assert inc["kind"] == "slow" and inc["worker"] == "w3"
    assert inc["reason"] == SLOW_PLAN and inc["epoch"] == 2 and inc["world_after"] == 4
    assert inc["detection_s"] == pytest.approx(0.031, abs=1e-6)
    assert inc["first_commit_step"] == 15 and inc["mttr_s"] == pytest.approx(0.1, abs=1e-6)


# ---- hangs: the stacks of the killed worker --------------------------------------------------

HUNG_EXIT = (
    "worker w1 (rank 1) hung (stuck computing for 10.1 s (limit 10 s; auto: floor, 4 × p99 of "
    "40 compute phases is 0.2 s)), killed"
)
HUNG_PLAN = f"{HUNG_EXIT} → epoch 2: dp 4→3, micro-batches 16 → [6, 5, 5]"
STACKS = (
    "Thread 0x00007f01 (most recent call first):\n"
    '  File "control_client.py", line 99 in beat\n\n'
    "Current thread 0x00007f02 (most recent call first):\n"
    '  File "replicated.py", line 120 in compute\n'
    '  File "engine.py", line 297 in train_step\n'
)


def hang_events(kind: str) -> list[dict[str, Any]]:
    """Rank 1 (w1) slowed (``slow``) or frozen (``hang``) in step 15 past the hang timeout:
    killed by its daemon, its stacks taken, and the recovery to epoch 2 (kill_events' own)."""
    fault = {"kind": kind, "rank": 1, "at_step": 15} | ({"delay": 30.0} if kind == "slow" else {})
    return [
        {"t": 100.0, "kind": "fault_injected", "worker": "w1", "rank": 1, "step": 15,
         "fault": fault},
        {"t": 100.01, "kind": "hang_detected", "worker": "w1", "rank": 1,
         "reason": HUNG_EXIT.split("hung (")[1].removesuffix("), killed")},
        {"t": 100.02, "kind": "worker_exit", "worker": "w1", "rank": 1, "exit_code": -9,
         "reason": HUNG_EXIT},
        {"t": 100.021, "kind": "hang_stacks", "worker": "w1", "rank": 1,
         "path": "stacks/w1-20250304-050607.txt", "stacks": STACKS, "seconds": 0.011},
        *[dict(e, reason=HUNG_PLAN) if e["kind"] == "plan_published" else e
          for e in kill_events()[2:]],
    ]  # fmt: skip


@pytest.mark.parametrize("kind", ["hang", "slow"])
def test_a_worker_killed_as_hung_carries_its_stacks(tmp_path: Path, kind: str) -> None:
    """A hang, or a slow worker past the hang timeout (a crash then, not a straggler: no
    straggler verdict answers it), is answered by the plan it departed in; the incident holds
    the stacks it was killed with and their file, and every format shows them."""
    run = write_run(tmp_path / kind, start_events() + hang_events(kind), metrics())
    report = build_report(run)
    (inc,) = report["incidents"]
    assert inc["kind"] == kind and inc["reason"] == HUNG_PLAN
    assert inc["detection_s"] == pytest.approx(0.02, abs=1e-6)
    assert inc["mttr_s"] == pytest.approx(0.1, abs=1e-6)
    assert inc["stacks"] == STACKS and inc["stacks_file"] == "stacks/w1-20250304-050607.txt"
    text = render(report, "md")
    assert "stacks of w1 as it was killed (stacks/w1-20250304-050607.txt):" in text
    assert '  File "engine.py", line 297 in train_step' in text
    (row,) = csv.DictReader(io.StringIO(render(report, "csv")))
    assert row["stacks_file"] == "stacks/w1-20250304-050607.txt"


def test_a_crash_carries_no_stacks(kill_run: Path) -> None:
    (inc,) = build_report(kill_run)["incidents"]
    assert "stacks" not in inc and "stacks" not in render(build_report(kill_run), "md")


def test_stop_verdict_and_evictions_are_in_the_totals(tmp_path: Path) -> None:
    reason = "restart loop (3 failures without a committed step since step 2)"
    events = start_events() + [
        {"t": 95.0, "kind": "worker_evicted", "worker": "w2", "epoch": 2, "reason": "slow"},
        {"t": 96.0, "kind": "loop_breaker", "reason": reason, "committed": 2},
        {"t": 96.1, "kind": "job_stopped", "host": "h0", "reason": reason},
    ]  # fmt: skip
    report = build_report(write_run(tmp_path / "stop", events, metrics([1, 2])))
    assert report["totals"]["stopped"] == reason
    assert report["totals"]["evicted"] == ["w2"]
    text = render(report, "md")
    assert f"Job stopped: {reason}." in text and "Evicted as stragglers: w2." in text


# ---- whole-host faults: host loss and partitions ----------------------------------------------


def host_fault_events(kind: str, own_record: bool) -> list[dict[str, Any]]:
    """Host h1 (workers h1.w0, h1.w1) lost at 100.0: the leader (h0) records the request and,
    a lease TTL later, ``host_lost``; epoch 2 drops h1's workers. A host fault's victim also
    writes its own record (in its own run directory) just before it dies."""
    fault = {"kind": kind, "host": "h1"}
    events: list[dict[str, Any]] = []
    if own_record:
        events.append({"t": 99.99, "kind": "fault_injected", "host": "h1", "fault": fault})
    events += [
        {"t": 100.0, "kind": "fault_requested", "host": "h1", "fault": fault},
        {"t": 103.0, "kind": "host_lost", "host": "h1", "leader": "h0",
         "reason": "its lease expired"},
        {"t": 103.02, "kind": "plan_published", "epoch": 2, "world": 2,
         "departed": ["h1.w0", "h1.w1"], "workers": ["w0", "w2"],
         "reason": "host h1 lost (its lease expired) → epoch 2: dp 4→2"},
        {"t": 103.03, "kind": "comm_rebuilt", "worker": "w0", "rank": 0, "epoch": 2,
         "seconds": 0.01},
        {"t": 103.05, "kind": "state_synced", "worker": "w0", "rank": 0, "epoch": 2,
         "bytes": 0, "resume_step": 14},
    ]  # fmt: skip
    return events


@pytest.mark.parametrize(
    ("kind", "own_record", "detection"),
    [("host", True, 3.01), ("host", False, 3.0), ("partition", False, 3.0)],
)
def test_host_faults_are_incidents_with_detection_and_mttr(
    tmp_path: Path, kind: str, own_record: bool, detection: float
) -> None:
    rows = [m for m in metrics() if m["step"] <= 14] + [
        {**m, "time": 103.1 + 0.1 * (m["step"] - 15)} for m in metrics() if m["step"] > 14
    ]
    run = write_run(tmp_path / kind, start_events() + host_fault_events(kind, own_record), rows)
    report = build_report(run)
    (inc,) = report["incidents"]
    assert inc["kind"] == kind and inc["host"] == "h1" and inc["rank"] is None
    assert inc["detection_s"] == pytest.approx(detection)
    assert inc["plan_s"] == pytest.approx(0.02) and inc["epoch"] == 2
    assert inc["first_commit_step"] == 15
    assert inc["mttr_s"] == pytest.approx(detection + 0.1)
    assert f"| 1 | {kind} host h1 |" in render(report, "md")
    (row,) = csv.DictReader(io.StringIO(render(report, "csv")))
    assert row["kind"] == kind and row["host"] == "h1" and float(row["mttr_s"]) > 3
    assert json.loads(render(report, "json"))["incidents"][0]["host"] == "h1"


def test_a_host_lost_with_no_recorded_cause_is_still_an_incident(tmp_path: Path) -> None:
    events = [e for e in host_fault_events("host", False) if e["kind"] != "fault_requested"]
    run = write_run(tmp_path / "bare", start_events() + events, metrics())
    (inc,) = build_report(run)["incidents"]
    assert inc["kind"] == "host" and inc["detection_s"] == 0.0 and inc["epoch"] == 2


def test_report_merges_the_run_directories_of_several_hosts(tmp_path: Path) -> None:
    events = host_fault_events("host", True)
    victim = write_run(tmp_path / "h1", [events[0]], [])
    leader = write_run(tmp_path / "h0", start_events() + events[1:], metrics())
    (inc,) = build_report(leader, victim)["incidents"]
    assert inc["detection_s"] == pytest.approx(3.01)


def test_a_host_lost_twice_is_timed_from_its_own_fault_each_time(tmp_path: Path) -> None:
    """The same host fails, comes back and fails again: each loss starts at its own request."""
    first = host_fault_events("partition", False)
    second = [{**e, "t": e["t"] + 100.0} for e in host_fault_events("partition", False)]
    for e in second:
        if e["kind"] == "plan_published":
            e["epoch"] = 4
        elif "epoch" in e:
            e["epoch"] = 4
    run = write_run(tmp_path / "twice", start_events() + first + second, metrics())
    incidents = build_report(run)["incidents"]
    assert [i["detection_s"] for i in incidents] == [pytest.approx(3.0), pytest.approx(3.0)]


@pytest.mark.parametrize(
    ("spans", "merged"),
    [
        ([], []),
        ([(1.0, 2.0, "etcd unreachable", "h0")], [(1.0, 2.0, ["etcd unreachable"], ["h0"])]),
        (  # every host sees the same etcd outage: one incident, every host named
            [(1.0, 5.0, "etcd unreachable", "h0"), (1.2, 5.5, "etcd unreachable", "h1")],
            [(1.0, 5.5, ["etcd unreachable"], ["h0", "h1"])],
        ),
        (  # the restart and the probe's view of it are one outage; the restart is named first
            [(1.0, 1.8, "embedded etcd restarted", "h0"), (1.1, 2.0, "etcd unreachable", "h0")],
            [(1.0, 2.0, ["embedded etcd restarted", "etcd unreachable"], ["h0"])],
        ),
        (  # apart in time: two incidents
            [(1.0, 2.0, "daemon paused", "h0"), (3.0, 4.0, "etcd unreachable", "h0")],
            [(1.0, 2.0, ["daemon paused"], ["h0"]), (3.0, 4.0, ["etcd unreachable"], ["h0"])],
        ),
    ],
)
def test_merge_outage_spans(spans: list[Any], merged: list[Any]) -> None:
    assert merge_spans(spans) == merged


def test_control_plane_outage_is_an_incident_with_downtime_and_steps_trained(
    tmp_path: Path,
) -> None:
    """An etcd that was away for 3 s while steps 4-6 committed: an incident without MTTR (the
    job never stopped), and no effect on the MTTR totals."""
    events = [
        *start_events(),
        {"t": 103.0, "kind": "etcd_unreachable", "host": "h0", "reason": "refused", "step": 4},
        {"t": 104.0, "kind": "etcd_exited", "host": "h0", "pid": 7, "exit_code": -9},
        {"t": 104.9, "kind": "etcd_restarted", "host": "h0", "pid": 8, "old_pid": 7,
         "downtime": 0.9, "tries": 1},
        {"t": 106.0, "kind": "etcd_reachable", "host": "h0", "since": 103.0, "downtime": 3.0,
         "step": 7, "trained": 3},
    ]  # fmt: skip
    log = EventLog(tmp_path / EVENTS_FILE)
    for e in events:
        log.write(e)
    writer = JsonlWriter(tmp_path / METRICS_FILE)
    for step in range(1, 9):
        writer.write({"step": step, "loss": 1.0, "time": 100.0 + step * 0.9, "world_size": 4})
    report = build_report(tmp_path)
    (inc,) = report["incidents"]
    assert inc["kind"] == "control plane" and inc["what"] == "embedded etcd restarted"
    assert inc["downtime_s"] == 3.0 and inc["steps_trained"] == 3 and inc["fault_step"] == 4
    assert inc["mttr_s"] is None and report["totals"]["mttr_median_s"] is None
    assert "3 steps trained meanwhile" in inc["reason"]
    assert "trained on: 3 steps" in render(report, "md")
    row = next(csv.DictReader(io.StringIO(render(report, "csv"))))
    assert row["downtime_s"] == "3.0" and row["steps_trained"] == "3"


@pytest.mark.parametrize(
    ("sparsity", "done", "line"),
    [
        (0.12, True, "train.prune: ended at group sparsity 0.12, below its target 0.50: raise "
                     "train.prune.epsilon (0.0 now; 0.9-0.95 is usual for short runs) or train "
                     "more steps"),
        (0.12, False, None),  # still running: not ended yet
        (0.5, True, None),
    ],
)  # fmt: skip
def test_a_pruning_run_reports_its_sparsity_and_a_shortfall_in_one_line(
    tmp_path: Path, sparsity: float, done: bool, line: str | None
) -> None:
    from elaswave.events import RUN_CONFIG

    rows = [{**m, "sparsity": sparsity if m["step"] > 5 else None} for m in metrics()]
    end = [{"t": 200.0, "kind": "job_done", "host": "h0", "step": 40}] if done else []
    run = write_run(tmp_path / "run", start_events() + end, rows)
    (run / RUN_CONFIG).write_text(json.dumps({"train": {"prune": {"target_sparsity": 0.5}}}))
    report = build_report(run)
    assert report["totals"]["prune"] == {
        "method": "dhspg", "sparsity": sparsity, "target": 0.5, "below_target": line,
    }  # fmt: skip
    text = render(report, "md")
    assert f"Group sparsity {sparsity:.2f}/0.50 (dhspg)." in text
    said = [x for x in text.splitlines() if x.startswith("train.prune:")]
    assert said == ([line] if line else [])
    assert "prune" not in build_report(write_run(tmp_path / "plain", [], metrics()))["totals"]


@pytest.mark.parametrize("replay_first", [True, False], ids=["replay-first", "checksum-first"])
def test_a_corruption_a_replay_meets_first_is_one_incident_answered_by_the_eviction(
    tmp_path: Path, replay_first: bool
) -> None:
    """Corrupted parameters give a replayed micro-batch another gradient: when the replay
    outvotes the rank before the checksums see it, the corruption's incident is that eviction
    (detected at the replay, ended by the step's commit) and there is no grad_sdc of its own;
    when the checksums come first, it is rolled back as ever and a later replay of the same
    worker stays an incident of its own."""
    fault = {
        "t": 100.0,
        "kind": "fault_injected",
        "worker": "w1",
        "rank": 1,
        "step": 15,
        "corrupted": "parameters[7]",
        "fault": {"kind": "corrupt", "rank": 1},
    }
    replay = {
        "t": 100.3 if replay_first else 101.0,
        "kind": "replay_mismatch",
        "step": 16,
        "odd_workers": ["w1"],
        "odd_ranks": [1],
        "verdict": "evict",
    }
    evict_plan = {
        "t": replay["t"] + 0.01,
        "kind": "plan_published",
        "epoch": 2,
        "world": 3,
        "departed": [],
        "evicted": ["w1"],
        "workers": ["w0", "w2", "w3"],
        "reason": "miscomputed gradient: w1 (rank 1) outvoted → evicted → epoch 2",
    }
    checks = [
        {"t": 100.6, "kind": "sdc_detected", "step": 15, "what": "replicated state"},
        {"t": 100.62, "kind": "sdc_rolled_back", "step": 15, "to_step": 10, "redone_steps": 5},
    ]
    events = start_events() + [fault, replay, evict_plan] + ([] if replay_first else checks)
    rows = [
        {
            "step": s,
            "loss": 1.0,
            "epoch": 1,
            "world_size": 4,
            "samples": 32 * s,
            "step_seconds": 0.05,
            "time": 90.0 + 0.5 * s,
        }
        for s in range(1, 16)
    ]
    rows.append(
        {
            "step": 16,
            "loss": 1.0,
            "epoch": 2,
            "world_size": 3,
            "samples": 32 * 16,
            "step_seconds": 0.05,
            "time": replay["t"] + 0.2,
        }
    )
    if not replay_first:  # the rollback's redo of step 15 lands before the replay
        rows[14]["time"] = 100.7
    report = build_report(write_run(tmp_path / "run", events, rows))
    kinds = [i["kind"] for i in report["incidents"]]
    (inc,) = [i for i in report["incidents"] if i["kind"] == "corrupt"]
    if replay_first:
        assert kinds == ["corrupt"]
        assert inc["detection_s"] == pytest.approx(0.3) and inc["detected_step"] == 16
        assert inc["evicted"] == ["w1"] and inc["world_after"] == 3 and inc["epoch"] == 2
        assert inc["mttr_s"] == pytest.approx(0.5) and inc["first_commit_step"] == 16
        assert "outvoted on a replayed micro-batch of step 16 → evicted" in inc["reason"]
    else:
        assert kinds == ["corrupt", "grad_sdc"]
        assert inc["detection_s"] == pytest.approx(0.6) and inc["detected_step"] == 15
        assert "rolled back to the known-good step 10" in inc["reason"]
