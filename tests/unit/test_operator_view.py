"""What an operator sees, as pure functions: the progress lines of ``launch`` and the daemon's
Prometheus series (parsed back with the client library's own text parser)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from elaswave.cli.progress import (
    Snapshot,
    clock,
    eta_seconds,
    incident_lines,
    plain_line,
    recovered_line,
)
from elaswave.daemon.metrics import DaemonMetrics, incident_kind, worker_state
from elaswave.planning.plan import Plan


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(None, "–"), (-1.0, "–"), (float("nan"), "–"), (0.4, "0:00"), (61, "1:01"),
     (3723, "1:02:03")],
)  # fmt: skip
def test_clock(seconds: float | None, text: str) -> None:
    assert clock(seconds) == text


@pytest.mark.parametrize(
    ("first", "now", "step", "total", "eta"),
    [
        (None, 10.0, 5, 40, None),  # no pace yet
        ((0.0, 5), 10.0, 5, 40, None),  # no step since
        ((0.0, 5), 10.0, 15, 40, 25.0),  # 1 s per step, 25 to go
        ((0.0, 5), 10.0, 45, 40, 0.0),  # past the end (a rollback moved the total)
    ],
)
def test_eta_is_the_pace_since_the_first_step_seen(
    first: tuple[float, int] | None, now: float, step: int, total: int, eta: float | None
) -> None:
    assert eta_seconds(first, now, step, total) == eta


STATUS = {
    "world_size": 3,
    "epoch": 2,
    "done": None,
    "progress": {"step": 17, "loss": 4.25, "samples_per_s": 321.5, "total_steps": 40},
}


def test_a_plain_line_says_everything_the_display_does() -> None:
    snap = Snapshot.of(STATUS, 99)
    assert snap == Snapshot(17, 40, 4.25, 321.5, 3, 2, False)
    assert plain_line(snap, 75.0, 120.0) == (
        "step 17/40  loss 4.2500  321.5 samples/s  world 3  epoch 2  elapsed 1:15  eta 2:00"
    )
    empty = Snapshot.of({"progress": None}, 40)
    assert plain_line(empty, 0, None).startswith("step 0/40  loss –")


def test_a_pruning_job_shows_its_sparsity_beside_its_target() -> None:
    status = {**STATUS, "progress": {**STATUS["progress"], "sparsity": 0.3125}}
    snap = Snapshot.of(status, 99)
    assert snap.sparsity == 0.3125
    assert plain_line(snap, 75.0, 120.0, target=0.5) == (
        "step 17/40  loss 4.2500  sparsity 0.31/0.50  321.5 samples/s  world 3  epoch 2  "
        "elapsed 1:15  eta 2:00"
    )
    before = Snapshot.of(STATUS, 99)  # before pruning starts: no sparsity yet
    assert "  sparsity –/0.50  " in plain_line(before, 75.0, 120.0, target=0.5)


def test_each_plan_after_the_first_is_shown_once() -> None:
    seen: set[int] = set()
    incidents: list[dict[str, Any]] = [
        {"epoch": 1, "reason": "epoch 1: start: dp 4", "fault": False},
        {"epoch": 2, "reason": "worker h.w1 (rank 1) killed by SIGKILL → epoch 2: dp 4→3",
         "fault": True},
    ]  # fmt: skip
    assert incident_lines(seen, incidents) == [
        (2, "incident: worker h.w1 (rank 1) killed by SIGKILL → epoch 2: dp 4→3")
    ]
    incidents.append({"epoch": 3, "reason": "epoch 3: host h2 joined", "fault": False})
    assert incident_lines(seen, incidents) == [(3, "plan: epoch 3: host h2 joined")]
    assert incident_lines(seen, incidents) == []


@pytest.mark.parametrize(
    ("mttr", "since", "line"),
    [
        (0.1074, 0.09, "recovered: epoch 2, step 15 committed; MTTR 107 ms"),
        (None, 0.09, "recovered: epoch 2, step 15 committed; 90 ms after the plan"),
        (None, None, "recovered: epoch 2, step 15 committed"),
    ],
)
def test_recovered_line(mttr: float | None, since: float | None, line: str) -> None:
    assert recovered_line(2, 15, mttr, since) == line


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        ("worker h.w1 (rank 1) killed by SIGKILL → epoch 2", "crash"),
        ("worker h.w1 (rank 1) exit code 3 → epoch 2", "crash"),
        ("worker h.w1 (rank 1) hung (no heartbeat for 3.0 s), killed → epoch 2", "hang"),
        ("host h2 lost (lease expired) → epoch 3", "host"),
        ("straggler h.w2 evicted → epoch 4", "straggler"),
        ("epoch 5: something else", "other"),
    ],
)
def test_incident_kind(reason: str, kind: str) -> None:
    assert incident_kind(reason) == kind


@pytest.mark.parametrize(
    ("exited", "ready", "in_plan", "state"),
    [(True, True, True, "exited"), (False, False, False, "starting"),
     (False, True, True, "training"), (False, True, False, "standby")],
)  # fmt: skip
def test_worker_state(exited: bool, ready: bool, in_plan: bool, state: str) -> None:
    assert worker_state(exited=exited, ready=ready, in_plan=in_plan) == state


def _scrape(metrics: DaemonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"job": "j", "host": "h0", **labels}.items())))
    return samples[key]


def _plan(epoch: int, world: int, departed: tuple[str, ...] = (), reason: str = "") -> Plan:
    workers = tuple(f"h0.w{i}" for i in range(world))
    return Plan(epoch=epoch, workers=workers, hosts=("h0",) * world,
                microbatches=(1,) * world, store="", reason=reason, created=100.0 + epoch,
                departed=departed)  # fmt: skip


def test_job_wide_series_only_from_the_leader_and_the_values_move() -> None:
    leading = [False]
    states = ["training", "training", "standby", "exited"]
    m = DaemonMetrics("j", "h0", leading=lambda: leading[0], workers=lambda: states)
    m.plan(_plan(1, 4))
    m.progress({"step": 1, "loss": 5.0, "epoch": 1, "samples_per_s": 10.0, "step_seconds": 0.07,
                "time": 101.5})  # fmt: skip
    follower = _scrape(m)
    assert _value(follower, "elaswave_is_leader") == 0.0
    assert _value(follower, "elaswave_workers", state="training") == 2.0
    assert _value(follower, "elaswave_workers", state="exited") == 1.0
    assert not any(name == "elaswave_committed_step" for name, _ in follower)
    leading[0] = True
    m.plan(_plan(2, 3, ("h0.w1",), "worker h0.w1 (rank 1) killed by SIGKILL → epoch 2"))
    m.progress({"step": 2, "loss": 4.5, "epoch": 2, "samples_per_s": 12.0, "step_seconds": 0.3,
                "time": 102.25})  # fmt: skip
    m.progress({"step": 2, "loss": 4.5, "epoch": 2, "step_seconds": 0.3, "time": 102.3})
    s = _scrape(m)
    assert _value(s, "elaswave_is_leader") == 1.0
    assert _value(s, "elaswave_committed_step") == 2.0
    assert (_value(s, "elaswave_epoch"), _value(s, "elaswave_world_size")) == (2.0, 3.0)
    assert _value(s, "elaswave_loss") == 4.5
    assert _value(s, "elaswave_samples_per_second") == 12.0
    assert _value(s, "elaswave_step_seconds_count") == 2.0, "a step is observed once"
    assert _value(s, "elaswave_step_seconds_sum") == pytest.approx(0.37)
    assert _value(s, "elaswave_incidents_total", kind="crash") == 1.0
    assert _value(s, "elaswave_mttr_seconds_count") == 1.0
    assert _value(s, "elaswave_mttr_seconds_sum") == pytest.approx(0.25)
    m.progress({"step": 1, "rolled_back": True, "time": 103.0})
    assert _value(_scrape(m), "elaswave_committed_step") == 1.0


def test_a_script_s_logged_values_are_served_by_its_rank_0_s_host() -> None:
    m = DaemonMetrics("j", "h0", leading=lambda: False, workers=lambda: [])
    m.logged({"train_loss": 2.5, "accuracy": 0.25})
    m.logged({"train_loss": 2.0})
    s = _scrape(m)  # whether or not it leads: the values reached this host
    key = ("elaswave_script_metric", (("host", "h0"), ("job", "j")))
    assert s[(key[0], (*key[1], ("name", "train_loss")))] == 2.0
    assert s[(key[0], (*key[1], ("name", "accuracy")))] == 0.25


@pytest.mark.parametrize("ended", [True, False])
def test_a_watch_that_loses_etcd_ends_only_if_the_launcher_did(
    monkeypatch: pytest.MonkeyPatch, ended: bool
) -> None:
    """``status --watch``: the launcher removes its record before it stops the job's etcd, so a
    read that found the record and then no etcd saw the job end (exit 0); with the record still
    there, losing etcd is an error (one line, etcd's exit code)."""
    import typer

    from elaswave.cli import status
    from elaswave.errors import EtcdUnavailable

    monkeypatch.setattr(status.time, "sleep", lambda _s: None)

    def read() -> dict[str, Any]:
        raise EtcdUnavailable("cannot reach etcd at 127.0.0.1:1 (connection refused)")

    st = {"job_id": "ops", "done": None, "progress": None, "epoch": 1, "world_size": 1,
          "leader": "h", "members": [], "standby": [], "incidents": [], "hosts": []}  # fmt: skip
    if ended:
        status._watch_status(st, read, lambda: True)
    else:
        with pytest.raises(typer.Exit) as exc:
            status._watch_status(st, read, lambda: False)
        assert exc.value.exit_code == 3  # etcd unreachable


@pytest.mark.parametrize(
    ("by_host", "lines"),
    [
        ({}, []),
        ({"h0": {"how": "1.5 s (fixed)"}, "h1": {"how": "1.5 s (fixed)"}},
         ["hang timeout: 1.5 s (fixed)"]),
        ({"h0": {"how": "A"}, "h1": {"how": "B"}, "h2": {"how": "B"}, "h3": {"how": "B"}},
         ["hang timeout on h0: A", "hang timeout on h1, h2 and 1 more: B"]),
    ],
)  # fmt: skip
def test_status_shows_each_hosts_hang_timeout_once(
    by_host: dict[str, dict[str, Any]], lines: list[str]
) -> None:
    """``status``: the bounds each host's hang detector applies (``hang/<host>``), one line when
    every host applies the same."""
    from elaswave.cli.status import _hang_timeout

    assert [str(t) for t in _hang_timeout(by_host)] == lines
