"""Each committed step's record is written once across the job: by the daemon whose write moves
the progress record to it, including when etcd's answer to that write was lost."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elaswave.daemon.etcd import KV
from elaswave.daemon.records import StepRecords
from elaswave.events import JsonlWriter, distinct_records, read_jsonl

KEY = "progress"


class FakeEtcd:
    """One key with its history. ``lose_answers``: that many compare-and-sets are applied but
    reported as failed (the member applied the write, went away, the retry's compare failed)."""

    def __init__(self, lose_answers: int = 0) -> None:
        self.history: list[tuple[int, bytes]] = []  # (mod revision, value)
        self.revision = 10
        self.lose_answers = lose_answers

    def record(self, value: dict[str, Any]) -> None:
        self.revision += 1
        self.history.append((self.revision, json.dumps(value).encode()))

    async def get(self, key: str) -> KV | None:
        if not self.history:
            return None
        rev, value = self.history[-1]
        return KV(key, value, self.history[0][0], rev)

    async def compare_and_put(self, key: str, value: str, *, mod_revision: int) -> bool:
        current = self.history[-1][0] if self.history else 0
        if current != mod_revision:
            return False
        self.record(json.loads(value))
        if self.lose_answers:
            self.lose_answers -= 1
            return False
        return True

    async def compare_and_put_get(
        self, key: str, value: str, *, mod_revision: int
    ) -> tuple[bool, KV | None]:
        ok = await self.compare_and_put(key, value, mod_revision=mod_revision)
        return ok, await self.get(key)

    async def first_put_after(self, key: str, revision: int) -> bytes | None:
        return next((v for rev, v in self.history if rev > revision), None)


def _daemon(etcd: FakeEtcd) -> tuple[Any, list[dict[str, Any]]]:
    lines: list[dict[str, Any]] = []
    d = SimpleNamespace(etcd=etcd, keys=SimpleNamespace(progress=KEY))
    d.metrics = SimpleNamespace(write=lines.append)
    d._progress = None
    d._progress_landed = lambda kv, writer, tried: StepRecords._progress_landed(
        d, kv, writer, tried
    )
    d._landed = lambda *args, **kw: StepRecords._landed(d, *args, **kw)
    d._orphaned = lambda kv, step: StepRecords._orphaned(d, kv, step)
    d._adopt = lambda kv: StepRecords._adopt(d, kv)
    d.stream, d._last_writer = None, ""
    d.host_id, d.planned_hosts = "h1", lambda: None
    return d, lines


def steps(lines: list[dict[str, Any]]) -> list[int]:
    return [line["step"] for line in lines]


def _land(d: Any, step: int, writer: str, tried: list[int] | None = None) -> None:
    record = {"step": step}
    progress = {"step": step, "writer": writer}
    asyncio.run(StepRecords._land_record(d, record, progress, [] if tried is None else tried))


def test_the_write_that_moves_progress_writes_the_line() -> None:
    etcd = FakeEtcd()
    d, lines = _daemon(etcd)
    _land(d, 1, "a")
    _land(d, 2, "b")
    assert lines == [{"step": 1, "writer": "a"}, {"step": 2, "writer": "b"}]


def test_a_step_another_host_recorded_is_dropped() -> None:
    etcd = FakeEtcd()
    etcd.record({"step": 3, "writer": "other host"})
    d, lines = _daemon(etcd)
    _land(d, 3, "a")  # a new rank 0 re-reports its resume step
    assert lines == []


def test_a_write_whose_answer_was_lost_still_writes_its_line() -> None:
    etcd = FakeEtcd(lose_answers=1)
    etcd.record({"step": 4, "writer": "earlier"})
    d, lines = _daemon(etcd)
    _land(d, 5, "mine")
    assert steps(lines) == [5]
    assert json.loads(etcd.history[-1][1])["writer"] == "mine"


def test_found_in_the_history_when_a_later_record_came_first() -> None:
    etcd = FakeEtcd(lose_answers=1)
    etcd.record({"step": 4, "writer": "earlier"})
    d, lines = _daemon(etcd)
    tried: list[int] = []
    original = etcd.compare_and_put

    async def lost_then_overtaken(key: str, value: str, *, mod_revision: int) -> bool:
        ok = await original(key, value, mod_revision=mod_revision)
        etcd.record({"step": 6, "writer": "other host"})  # progress moved on before we re-read
        return ok

    etcd.compare_and_put = lost_then_overtaken  # type: ignore[method-assign]
    _land(d, 5, "mine", tried)
    assert steps(lines) == [5]
    assert tried == [11]


class CountingEtcd(FakeEtcd):
    def __init__(self) -> None:
        super().__init__()
        self.reads = self.writes = 0

    async def get(self, key: str) -> KV | None:
        self.reads += 1
        return await super().get(key)

    async def compare_and_put_get(
        self, key: str, value: str, *, mod_revision: int
    ) -> tuple[bool, KV | None]:
        self.writes += 1
        ok = await self.compare_and_put(key, value, mod_revision=mod_revision)
        return ok, await FakeEtcd.get(self, key)


def test_consecutive_records_take_one_round_trip_each() -> None:
    etcd = CountingEtcd()
    d, lines = _daemon(etcd)
    for step in range(1, 6):
        _land(d, step, f"a{step}")
    assert steps(lines) == list(range(1, 6))
    assert (etcd.reads, etcd.writes) == (1, 5)


def test_a_stale_guess_never_records_a_step_twice() -> None:
    """This host's last view is step 1; another host recorded step 2 meanwhile: the compare
    against the stale revision fails, returns the current record, and the line is dropped."""
    etcd = FakeEtcd()
    d, lines = _daemon(etcd)
    _land(d, 1, "a1")
    etcd.record({"step": 2, "writer": "other host"})
    _land(d, 2, "a2")
    assert steps(lines) == [1]


def test_after_another_host_rolled_back_a_fresh_read_decides() -> None:
    """This host last saw step 3; another host rolled the job back to step 1. The redone step 2
    is written: a view that already covers the step is never trusted to drop a line."""
    etcd = FakeEtcd()
    d, lines = _daemon(etcd)
    for step in (1, 2, 3):
        _land(d, step, f"a{step}")
    etcd.record({"step": 1, "rolled_back": True})
    _land(d, 2, "a2-redone")
    assert steps(lines) == [1, 2, 3, 2]


def test_the_stream_gets_the_record_the_write_replaced() -> None:
    """The job's stream hangs off the same decision: it is told what the landed write replaced
    (its epoch says which plans came in between), the write's revision (its files' order), and
    whether this host wrote the record before it — also when etcd's answer was lost."""
    etcd = FakeEtcd(lose_answers=1)
    etcd.record({"step": 4, "writer": "other host", "epoch": 1})
    d, lines = _daemon(etcd)
    calls: list[dict[str, Any]] = []
    d.stream = SimpleNamespace(landed=lambda record, progress, **kw: calls.append(kw))
    _land(d, 5, "mine")
    _land(d, 6, "mine again")
    assert steps(lines) == [5, 6]
    assert calls == [
        {"before": {"step": 4, "writer": "other host", "epoch": 1}, "revision": 12,
         "continues": False},
        {"before": {"step": 5, "writer": "mine", "prior_epoch": 1}, "revision": 13,
         "continues": True},
    ]  # fmt: skip
    _land(d, 6, "a re-report")  # recorded already: nothing for the stream either
    assert len(calls) == 2


RECORD = {"step": 7, "loss": 1.5, "epoch": 1, "world_size": 6, "samples": 224,
          "step_seconds": 0.1, "lr": 0.003, "grad_norm": None, "sparsity": None, "skipped": None,
          "time": 100.0}  # fmt: skip


def test_a_record_whose_writer_left_the_plan_is_written_again_from_etcd() -> None:
    """Host h2 moved the progress record to step 7 and died before writing its line. Rank 0,
    now on h1, re-reports step 7: h2 is not in the plan, so h1 writes the line from the
    progress record, with h2's token (a reader keeps one line per token)."""
    etcd = FakeEtcd()
    etcd.record({**RECORD, "samples_per_s": 9.0, "total_steps": 30, "writer": "h2/abc"})
    d, lines = _daemon(etcd)
    d.planned_hosts = lambda: {"h0", "h1"}
    _land(d, 7, "h1/def")
    assert lines == [{**RECORD, "writer": "h2/abc"}]


def test_a_record_of_a_writer_still_in_the_plan_or_rolled_back_is_not_written_again() -> None:
    for value, planned in (
        ({**RECORD, "writer": "h0/abc"}, {"h0", "h1"}),  # h0 lives: it wrote or will write it
        ({"step": 7, "rolled_back": True, "writer": "h2/abc"}, {"h1"}),  # not a step's record
        ({**RECORD, "step": 8, "writer": "h2/abc"}, {"h1"}),  # a later step: not the re-report
        ({**RECORD, "writer": "h2/abc"}, None),  # no plan yet
    ):
        etcd = FakeEtcd()
        etcd.record(value)
        d, lines = _daemon(etcd)
        d.planned_hosts = lambda planned=planned: planned
        _land(d, 7, "h1/def")
        assert lines == [], value


def test_a_record_written_twice_is_read_once() -> None:
    lines = [
        {"step": 6, "writer": "h2/a"}, {"step": 7, "writer": "h2/b"}, {"kind": "eval", "step": 7},
        {"step": 7, "writer": "h2/b"},  # written again by the host that took rank 0 over
        {"step": 8, "writer": "h1/c"}, {"step": 8, "writer": "h1/d"},  # two records: both kept
        {"step": 9}, {"step": 9},  # lines of before: no token, kept as they are
    ]  # fmt: skip
    assert [(x.get("step"), x.get("writer")) for x in distinct_records(lines)] == [
        (6, "h2/a"), (7, "h2/b"), (7, None), (8, "h1/c"), (8, "h1/d"), (9, None), (9, None),
    ]  # fmt: skip


KEPT = {"step": 18, "loss": 2.5, "epoch": 1, "time": 5.0, "writer": "node1/abc", "lr": 0.1}


@pytest.mark.parametrize(
    ("kept", "step", "written"),
    [
        (KEPT, 18, [18]),  # the killed launch moved the record, never wrote the line: written
        (None, 18, []),  # the run directory has the step already (nothing handed over)
        ({**KEPT, "rolled_back": True}, 18, []),  # a rollback's marker holds no line
        ({"step": 18, "epoch": 1, "relaunched": "x", "time": 1.0}, 18, []),  # a relaunch's seed
        (KEPT, 20, []),  # resumed from records newer than etcd's: not this step's line
    ],
)
def test_a_relaunch_writes_the_line_of_the_record_etcd_kept(
    tmp_path: Path, kept: dict[str, Any] | None, step: int, written: list[int]
) -> None:
    metrics = JsonlWriter(tmp_path / "metrics.jsonl")
    records = StepRecords(None, None, metrics, outbox=None, host_id="node1", total_steps=40)  # type: ignore[arg-type]
    assert records.recorded_up_to(step, kept=kept) == (written[0] if written else None)
    lines = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert steps(lines) == written and records.last_metric_step == step
    if written:  # the same record as the lost line: same token, so readers keep one of the two
        assert lines[0]["writer"] == KEPT["writer"] and lines[0]["loss"] == KEPT["loss"]
        assert distinct_records([dict(lines[0]), dict(lines[0])]) == [lines[0]]
