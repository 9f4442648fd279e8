"""The job's stream on disk: the records of several hosts, landed through the real step records
(one progress record in a fake etcd), written by each host's stream into one TensorBoard run
directory and read back with TensorBoard's own readers; a W&B offline run read back from its
file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.daemon.records import StepRecords
from elaswave.daemon.sinks import TensorBoardFiles
from elaswave.daemon.streamplan import step_entries
from elaswave.daemon.streams import JobStream
from elaswave.planning.plan import Plan
from tests.streamread import accumulate, data_server_scalars, scalars, texts, wandb_history
from tests.unit.test_record_once import FakeEtcd

JOB = "tbjob"


class Etcd(FakeEtcd):
    async def put(self, key: str, value: str) -> int:
        if key == "progress":  # the one key this etcd keeps (``done`` goes nowhere)
            self.record(json.loads(value))
        return self.revision


class Outbox:
    """Runs each write at once, in order (the daemon's outbox, etcd there); while ``down``,
    holds them until ``abandon`` runs their fallbacks (etcd never came back)."""

    def __init__(self) -> None:
        self.down = False
        self.held: list[Any] = []

    def put(self, what: str, write: Any, fallback: Any = None) -> None:
        if self.down:
            self.held.append(fallback)
        else:
            asyncio.run(write())

    def abandon(self) -> None:
        for fallback in self.held:
            if fallback is not None:
                fallback()
        self.held.clear()


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def write(self, record: dict[str, Any]) -> None:
        self.lines.append(record)

    def keep_only(self, keep: Any) -> None:
        self.lines = [r for r in self.lines if keep(r)]


def _cfg(tb: Path | None, wandb: dict | None = None) -> JobConfig:
    logging: dict[str, Any] = {}
    if tb is not None:
        logging["tensorboard"] = str(tb)
    if wandb is not None:
        logging["wandb"] = wandb
    return JobConfig.from_dict({"job_id": JOB, "logging": logging})


class Host:
    """One host's step records and stream (the daemon's parts that write the stream)."""

    def __init__(
        self,
        name: str,
        etcd: Etcd,
        cfg: JobConfig,
        run_dir: Path,
        started: float = 1.7e9,
        **kw: Any,
    ) -> None:
        self.metrics, self.outbox = Lines(), Outbox()
        self.records = StepRecords(
            etcd, SimpleNamespace(progress="progress", done="done"), self.metrics,
            outbox=self.outbox, host_id=name, total_steps=1000,
        )  # fmt: skip
        self.stream = JobStream(cfg, host_id=name, run_dir=run_dir, **kw)
        self.records.stream = self.stream
        self.stream.start(started)

    def commit(self, step: int, loss: float, epoch: int = 1, world: int = 4) -> None:
        self.records.commit(
            wire.Commit(step=step, loss=loss, epoch=epoch, world=world, samples=32 * step,
                        t=1000.0 + step, step_seconds=0.1, lr=1e-3, grad_norm=0.5 + step)
        )  # fmt: skip

    def plan(self, epoch: int, world: int, departed: tuple[str, ...] = ()) -> None:
        reason = f"worker x (rank 1) killed by SIGKILL → epoch {epoch}" if departed else "start"
        self.stream.plan(
            Plan(epoch=epoch, workers=tuple(f"w{i}" for i in range(world)), hosts=("h",) * world,
                 microbatches=(1,) * world, store="", reason=reason, created=1000.0 + epoch,
                 departed=departed)
        )  # fmt: skip


def test_several_hosts_one_stream_every_step_once(tmp_path: Path) -> None:
    """Rank 0 moves from host a to host b (a crash), back to a, then silent corruption rolls
    the job back: both readers of TensorBoard see every step once, with the redone values, and
    the incident at the first step recorded under its plan, whichever host wrote it."""
    etcd, tb = Etcd(), tmp_path / "tb"
    reported = {"kind": "kill", "mttr_s": 0.25, "detection_s": 0.05}
    a = Host("a", etcd, _cfg(tb), tmp_path / "a", lookup=lambda d, e: None)
    b = Host("b", etcd, _cfg(tb), tmp_path / "b", lookup=lambda d, e: reported if e == 2 else None)
    for h in (a, b):
        h.plan(1, 4)
    for step in range(1, 6):
        a.commit(step, 10.0 - step)
    for h in (a, b):
        h.plan(2, 3, departed=("w1",))
    b.commit(5, 5.0, epoch=2)  # the new rank 0 re-reports its resume step: a recorded it
    for step in range(6, 9):
        b.commit(step, 10.0 - step, epoch=2)
    a.commit(9, 1.0, epoch=2)  # rank 0 is back on a (no incident: same epoch)
    a.commit(10, 0.5, epoch=2)
    a.records.roll_back(8)  # silent corruption: steps 9 and 10 are redone
    a.commit(9, 1.25, epoch=2)
    a.commit(10, 0.75, epoch=2)
    a.records.evaluated(wire.Eval(step=10, loss=0.6, samples=8, t=1010.5))
    a.commit(11, 0.7, epoch=2)
    for h in (a, b):
        h.stream.close()

    want = {**{s: 10.0 - s for s in range(1, 9)}, 9: 1.25, 10: 0.75, 11: 0.7}
    lines = [m for h in (a, b) for m in h.metrics.lines if "kind" not in m]
    assert sorted((m["step"], m["loss"]) for m in lines) == sorted(want.items())
    run = tb / JOB
    files = sorted(p.name for p in run.iterdir())
    assert [f.split(".")[-2] for f in files] == ["a", "b", "a", "a"]  # a, b, a, a's rollback

    acc = accumulate(run)
    loss = scalars(acc, "train/loss")
    assert [s for s, _ in loss] == list(range(1, 12))  # every step once, in order
    assert loss == [(s, pytest.approx(v)) for s, v in sorted(want.items())]
    assert [s for s, _ in scalars(acc, "train/grad_norm")] == list(range(1, 12))
    assert scalars(acc, "eval/loss") == [(10, pytest.approx(0.6))]
    assert scalars(acc, "incidents/mttr_s") == [(6, pytest.approx(0.25))]
    (step, text), (rolled, why) = texts(acc, "incidents")
    assert step == 6 and "killed by SIGKILL" in text and "MTTR 250 ms from the fault" in text
    assert rolled == 9 and "rolled back to the known-good step 8, steps 9–10 redone" in why
    assert scalars(acc, "incidents/world_size") == [(6, 3.0)]

    try:
        fast = data_server_scalars(tb, ["train/loss", "incidents/mttr_s", "eval/loss"])
    except Exception as exc:  # noqa: BLE001 - no data server binary on this platform
        pytest.skip(f"TensorBoard's data server: {exc}")
    assert fast[JOB]["train/loss"] == loss
    assert fast[JOB]["incidents/mttr_s"] == [(6, pytest.approx(0.25))]
    assert fast[JOB]["eval/loss"] == [(10, pytest.approx(0.6))]


def test_a_later_launch_of_the_same_job_replaces_what_it_writes_again(tmp_path: Path) -> None:
    """The same job id launched again into the same directory (fresh etcd, revisions from the
    start again): its files sort after the first launch's, and its first record tells the
    readers to drop the old steps from there on."""
    tb = tmp_path / "tb"
    first = Host("a", Etcd(), _cfg(tb), tmp_path / "a")
    for step in range(1, 6):
        first.commit(step, 1.0)
    first.stream.close()
    again = Host("a", Etcd(), _cfg(tb), tmp_path / "a", started=1.7e9 + 100)
    for step in range(1, 4):
        again.commit(step, 2.0)
    again.stream.close()
    assert scalars(accumulate(tb / JOB), "train/loss") == [(s, 2.0) for s in (1, 2, 3)]


def test_records_etcd_never_took_follow_in_the_stream(tmp_path: Path) -> None:
    """etcd goes away for good: the records still queued are written locally (metrics.jsonl)
    and into the stream after the last one, without a restart and without marking again an
    incident already marked."""
    tb = tmp_path / "tb"
    h = Host("a", Etcd(), _cfg(tb), tmp_path / "a", lookup=lambda d, e: None)
    h.plan(1, 4)
    for step in (1, 2):
        h.commit(step, 3.0 - step)
    h.plan(2, 3, departed=("w1",))
    h.commit(3, 0.5, epoch=2)
    h.outbox.down = True
    for step in (4, 5):
        h.commit(step, 3.0 - step, epoch=2)
    h.outbox.abandon()
    h.stream.close()
    assert [m["step"] for m in h.metrics.lines] == [1, 2, 3, 4, 5]
    acc = accumulate(tb / JOB)
    assert [s for s, _ in scalars(acc, "train/loss")] == [1, 2, 3, 4, 5]
    assert scalars(acc, "incidents/count") == [(3, 1.0)]
    assert len(list((tb / JOB).iterdir())) == 1


def test_a_sink_that_fails_stops_alone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    blocked = tmp_path / "tb"
    blocked.write_text("a file where the directory should be")
    h = Host("a", Etcd(), _cfg(blocked), tmp_path / "a")
    h.commit(1, 1.0)
    h.stream.close()
    assert [m["step"] for m in h.metrics.lines] == [1]  # the records are untouched
    err = capsys.readouterr().err
    assert err.count("elaswave: logging.tensorboard stopped") == 1


def test_wandb_offline_run_holds_every_step_once(tmp_path: Path) -> None:
    """One W&B run (offline: no network) with every recorded step once and the incident at its
    step; the evaluation joins its step's row."""
    etcd = Etcd()
    cfg = _cfg(None, {"project": "elaswave-test", "mode": "offline"})
    h = Host("a", etcd, cfg, tmp_path / "run", lookup=lambda d, e: None)
    h.plan(1, 4)
    for step in range(1, 4):
        h.commit(step, 3.0 - step)
    h.plan(2, 3, departed=("w1",))
    for step in range(4, 7):
        h.commit(step, 3.0 - step, epoch=2, world=3)
    h.records.evaluated(wire.Eval(step=6, loss=0.1, samples=8, t=1006.5))
    h.stream.close()
    assert not h.stream.failed
    rows = wandb_history(tmp_path / "run")
    assert [r["_step"] for r in rows] == list(range(1, 7))
    assert [r["train/loss"] for r in rows] == [3.0 - s for s in range(1, 7)]
    assert [r.get("incidents/count") for r in rows] == [None] * 3 + [1] + [None] * 2
    assert "killed by SIGKILL" in rows[3]["incidents"]
    assert rows[5]["eval/loss"] == 0.1 and rows[5]["train/world_size"] == 3


def test_files_of_one_stream_copied_together_read_as_one(tmp_path: Path) -> None:
    """Without a shared filesystem each host keeps the files it wrote; copied into one
    directory they are the stream again (their names carry its order)."""

    def rec(step: int) -> dict[str, Any]:
        return {"step": step, "loss": 1.0 / step, "epoch": 1, "world_size": 2, "time": step}

    hosts = {h: TensorBoardFiles(tmp_path / h / JOB, host=h, started=1.0) for h in ("a", "b")}
    order = ["a", "a", "b", "b", "a", "b"]  # who recorded steps 1..6 (rank 0 moving)
    for step, h in enumerate(order, 1):
        continues = step > 1 and order[step - 2] == h
        hosts[h].write(
            step_entries(rec(step), {}, first=step == 1, recoveries=[]),
            key=10 + step, continues=continues,
        )  # fmt: skip
    for files in hosts.values():
        files.close()
    merged = tmp_path / "merged"
    merged.mkdir()
    for h in hosts:
        for path in (tmp_path / h / JOB).iterdir():
            (merged / path.name).write_bytes(path.read_bytes())
    assert [s for s, _ in scalars(accumulate(merged), "train/loss")] == list(range(1, 7))


@pytest.mark.parametrize("wrote_it", [True, False], ids=["written", "not-written"])
def test_a_step_whose_writer_died_is_in_the_stream_once(tmp_path: Path, wrote_it: bool) -> None:
    """Rank 0 moves to host b at step 5, the first step under a plan that answered a loss; b
    moves the progress record to step 5 and dies, after putting the step into its own file or
    before. Host a, which takes rank 0 over, writes step 5 again from the progress record and
    goes on: both readers see every step once, and each incident once at its step, though b's
    file (keyed at that write) sorts after a's name."""
    etcd, tb = Etcd(), tmp_path / "tb"
    a = Host("a", etcd, _cfg(tb), tmp_path / "a", lookup=lambda d, e: None)
    b = Host("b", etcd, _cfg(tb), tmp_path / "b", lookup=lambda d, e: None)
    for h in (a, b):
        h.plan(1, 4)
    for step in range(1, 5):
        a.commit(step, 10.0 - step)
    for h in (a, b):
        h.plan(2, 3, departed=("w1",))
    if not wrote_it:  # killed between its metrics.jsonl line and its event file
        b.records.stream = None
    b.commit(5, 5.0, epoch=2)
    b.stream.close()
    a.plan(3, 2, departed=("w2",))  # b's loss
    a.records.planned_hosts = lambda: {"a"}
    a.commit(5, 5.0, epoch=3)  # the new rank 0 re-reports its resume step
    for step in range(6, 9):
        a.commit(step, 10.0 - step, epoch=3)
    a.stream.close()

    lines = [m["step"] for h in (a, b) for m in h.metrics.lines]
    assert sorted(lines) == [1, 2, 3, 4, 5, 5, 6, 7, 8]  # step 5's line twice, with b's token
    files = sorted(p.name for p in (tb / JOB).iterdir())
    assert [f.split(".")[-2] for f in files] == (["a", "b", "a"] if wrote_it else ["a", "a"])
    acc = accumulate(tb / JOB)
    loss = scalars(acc, "train/loss")
    assert loss == [(s, pytest.approx(10.0 - s)) for s in range(1, 9)]
    assert scalars(acc, "incidents/count") == [(5, 1.0), (6, 1.0)]
    assert scalars(acc, "incidents/world_size") == [(5, 3.0), (6, 2.0)]
    try:
        fast = data_server_scalars(tb, ["train/loss", "incidents/count"])
    except Exception as exc:  # noqa: BLE001 - no data server binary on this platform
        pytest.skip(f"TensorBoard's data server: {exc}")
    assert fast[JOB]["train/loss"] == loss
    assert fast[JOB]["incidents/count"] == [(5, 1.0), (6, 1.0)]
