"""The records of committed steps: ``metrics.jsonl`` lines and the job's progress record.

Rank 0 reports every step it commits to its daemon. Each step's line is written once across the
whole job (by the host whose write moves the progress record in etcd to that step), after the
lines before it: the writes go through the daemon's outbox, in order, and a line whose progress
write never lands (etcd never came back) is written locally instead.

The job's event stream (TensorBoard, W&B: :mod:`~elaswave.daemon.streams`) hangs off the same
decision: whatever writes a line here hands it to the stream too, with the progress record the
write replaced (its epoch tells which plans came in between) and the revision that orders it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from elaswave import wire
from elaswave.daemon.etcd import KV, Etcd
from elaswave.daemon.outbox import Outbox
from elaswave.events import JsonlWriter
from elaswave.keys import JobKeys
from elaswave.wire_etcd import Done, Progress, decode_or_log, encode, from_json

if TYPE_CHECKING:
    from elaswave.daemon.streams import JobStream

log = logging.getLogger(__name__)


class StepRecords:
    def __init__(
        self,
        etcd: Etcd,
        keys: JobKeys,
        metrics: JsonlWriter,
        *,
        outbox: Outbox,
        host_id: str,
        total_steps: int,
        stream: JobStream | None = None,
        planned_hosts: Callable[[], Collection[str] | None] = lambda: None,
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.metrics = metrics
        self.outbox = outbox
        self.host_id = host_id
        self.total_steps = total_steps
        self.last_metric_step = 0
        # The progress record as this host last wrote or read it: the revision the next write
        # compares against first, which saves a read per step while this host records them all.
        self._progress: KV | None = None
        self.commit_times: list[tuple[float, int]] = []
        self.final_step = 0  # the newest step a worker of this host committed or finished at
        self.recorded_before = 0  # steps an earlier run of the job recorded (a relaunch)
        self.stream = stream  # logging.tensorboard / wandb: the job's stream
        self.last_epoch = 0  # the epoch of the newest step rank 0 reported here
        self.last_sparsity: float | None = None  # train.prune: that step's group sparsity
        self.committed_here = False  # whether rank 0 reported a committed step here
        self._last_writer = ""  # the writer token of this host's newest record in etcd
        self._local: dict[str, Any] | None = None  # the newest record written only locally
        # The hosts of the plan in force (None: none yet): a record whose writer is not among
        # them may have died with its host before its line was written (``_land_record``).
        self.planned_hosts = planned_hosts

    def recorded_up_to(self, step: int, *, kept: dict[str, Any] | None = None) -> int | None:
        """A relaunch: earlier runs of the job recorded the steps up to ``step`` (those after
        its checkpoint are trained again, and not recorded twice, nor their evaluations).

        ``kept``: the progress record etcd kept, if this run directory has no line of its step.
        A launch killed between moving the progress record and writing that step's line left
        the step recorded nowhere but in etcd; its line is written here from the record, with
        its writer's token (a reader of both run directories keeps it once:
        :func:`~elaswave.events.distinct_records`). Returns that step (None: no line written)."""
        self.last_metric_step = max(self.last_metric_step, step)
        self.recorded_before = max(self.recorded_before, step)
        if kept is None or not _is_step_record(kept) or int(kept["step"]) != step:
            return None
        self.metrics.write(_line(kept))
        return step

    def finished_at(self, step: int) -> None:
        """A worker of this host finished the job at ``step``."""
        self.final_step = max(self.final_step, step)

    def commit(self, msg: wire.Commit) -> None:
        """A step rank 0 committed: its record, written once across the whole job (see
        ``_land_record``), after the records before it."""
        step = msg.step
        if step <= self.last_metric_step:
            return  # a re-report after recovery, or a redone step: already recorded here
        self.last_metric_step = step
        self.final_step = max(self.final_step, step)
        self.last_epoch = msg.epoch
        self.last_sparsity = msg.prune.get("prune_sparsity")
        self.committed_here = True
        record = {
            "step": step,
            "loss": msg.loss,
            "epoch": msg.epoch,
            "world_size": msg.world,
            "samples": msg.samples,
            "step_seconds": msg.step_seconds,
            "lr": msg.lr,
            "grad_norm": msg.grad_norm,  # None where not measured (no stream, no clip)
            "sparsity": msg.prune.get("prune_sparsity"),  # train.prune: the share of zero groups
            "skipped": msg.skipped,  # why the step counted and was not applied (None: applied)
            "time": msg.t,
        }
        self.commit_times.append((msg.t, msg.samples))
        self.commit_times = self.commit_times[-20:]
        rate = 0.0
        if len(self.commit_times) >= 2:
            (t0, s0), (t1, s1) = self.commit_times[0], self.commit_times[-1]
            rate = (s1 - s0) / max(t1 - t0, 1e-9)
        progress = {
            **record, "samples_per_s": rate, "total_steps": self.total_steps,
            "writer": f"{self.host_id}/{uuid.uuid4().hex}",  # this record's write, and no other
        }  # fmt: skip
        tried: list[int] = []  # revisions of the progress record a write of it was sent against
        befores: dict[int, Any] = {}  # revision a write was sent against -> the record there
        self.outbox.put(
            f"record of step {step}",
            lambda: self._land_record(record, progress, tried, befores=befores),
            fallback=lambda: self._landed(record, progress, self._newest(), revision=None),
        )
        if step >= self.total_steps:
            done = Done(step=step, t=time.time())
            self.outbox.put("done", lambda: self.etcd.put(self.keys.done, encode(done)))

    def evaluated(self, msg: wire.Eval) -> None:
        """A held-out evaluation rank 0 made after committing a step: a line of its own, in the
        outbox's order (after that step's record)."""
        record = {
            "kind": "eval",
            "step": msg.step,
            "eval_loss": msg.loss,
            "eval_samples": msg.samples,
            **({"eval_accuracy": msg.accuracy} if msg.accuracy is not None else {}),
            "time": msg.t,
        }
        self._side_line(record, "eval")

    def logged(self, msg: wire.Log) -> None:
        """Metrics a script logged after a step (``job.log``): a line of their own, like an
        evaluation's."""
        metrics = {str(k): float(v) for k, v in msg.metrics.items()}
        record = {"kind": "log", "step": msg.step, **metrics, "time": msg.t}
        self._side_line(record, "log")

    def _side_line(self, record: dict[str, Any], what: str) -> None:
        if record["step"] <= self.recorded_before:
            return  # trained again after a relaunch: recorded already

        def land() -> None:
            self.metrics.write(record)
            if self.stream is not None:
                kv = self._progress
                self.stream.evaluated(
                    record,
                    revision=kv.mod_revision if kv is not None else None,
                    continues=kv is not None and _writer(kv) == self._last_writer,
                )

        async def write() -> None:
            land()

        self.outbox.put(f"{what} of step {record['step']}", write, fallback=land)

    async def _land_record(
        self,
        record: dict[str, Any],
        progress: dict[str, Any],
        tried: list[int],
        *,
        befores: dict[int, Any] | None = None,
    ) -> None:
        """Write a step's record if this host is the one that moves the job's progress record
        (in etcd, outside every lease) to that step. Rank 0 re-reports its resume step after a
        change; when rank 0 moved to this host, its old host may have recorded the step already
        (and, cut off from etcd, may do so later): whoever advances the progress record first
        writes the line, the other drops its copy. Never a step recorded twice, across hosts.

        A write whose answer was lost (the etcd member went away after applying it; the call was
        retried on another member and its compare failed) is recognised by its ``writer`` token
        in etcd's history, so its line is written: never a step recorded nowhere either.

        The first compare is against the record as this host last saw it (no read): if nobody
        else wrote since, that is the read's answer; if somebody did, the failed compare returns
        the current record, and the decision is taken on it as after a read.

        ``befores`` keeps the record each write was compared against (by revision): the one the
        landed write replaced, which the job's stream needs."""
        befores = {} if befores is None else befores
        kv = self._progress
        if kv is None or _covers(kv, record["step"]):
            kv = await self.etcd.get(self.keys.progress)  # only a fresh read may drop a line
        while True:
            if kv is not None and _covers(kv, record["step"]):
                rev = await self._progress_landed(kv, progress["writer"], tried)
                if rev is not None:
                    # our write came right after ``rev``: its own revision is above it
                    mine = kv.mod_revision if _writer(kv) == progress["writer"] else rev + 1
                    self._landed(record, progress, befores.get(rev), revision=mine)
                elif self._orphaned(kv, record["step"]):
                    self._adopt(kv)
                return  # recorded by another host (or redone after a recovery)
            rev = kv.mod_revision if kv is not None else 0
            tried.append(rev)
            before = befores[rev] = _value(kv.value) if kv is not None else None
            # the epoch it follows: what a host that adopts the record marks with it (_adopt)
            sent = {**progress, "prior_epoch": before.get("epoch") if before else None}
            ok, kv = await self.etcd.compare_and_put_get(
                self.keys.progress, encode(from_json(Progress, sent)), mod_revision=rev
            )
            self._progress = kv
            if ok:
                self._landed(
                    record, progress, befores[rev], revision=kv.mod_revision if kv else None
                )
                return

    def _landed(
        self,
        record: dict[str, Any],
        progress: dict[str, Any],
        before: dict[str, Any] | None,
        *,
        revision: int | None,
    ) -> None:
        """This host records ``record``: its line, and its place in the job's stream after
        ``before`` (the progress record the write replaced) at ``revision`` (None: etcd never
        came back and the line is written locally)."""
        self.metrics.write({**record, "writer": progress["writer"]})
        if self.stream is not None:
            continues = revision is None or (
                before is not None and before.get("writer") == self._last_writer
            )
            self.stream.landed(
                record, progress, before=before, revision=revision, continues=continues
            )
        if revision is not None:
            self._last_writer = str(progress["writer"])
        else:
            self._local = progress

    def _adopt(self, kv: KV) -> None:
        """Write the line of the progress record ``kv``, whose writer left the plan
        (``_orphaned``), and put the step into the job's stream again, on which this host's
        next records follow (:meth:`~elaswave.daemon.streams.JobStream.adopted`)."""
        value = _value(kv.value)
        line = _line(value)
        self.metrics.write(line)
        if self.stream is not None:
            self.stream.adopted(line, value, revision=kv.mod_revision)
        self._last_writer = str(value.get("writer"))

    def _orphaned(self, kv: KV, step: int) -> bool:
        """Whether the progress record ``kv``, this very ``step`` written by another host that
        has left the plan, may be a record whose line was never written: that host may have
        died after moving the progress record and before writing its line. Rank 0 re-reports
        its resume step after every change, so the host that took rank 0 over sees it first and
        writes the line from the record, with the writer's token (a reader keeps one line per
        token: :func:`~elaswave.events.distinct_records`, should the first writer have written
        it after all)."""
        value, hosts = _value(kv.value), self.planned_hosts()
        writer = str(value.get("writer") or "")
        host = writer.rpartition("/")[0]
        return (
            hosts is not None and int(value.get("step", -1)) == step
            and not value.get("rolled_back") and bool(host) and host != self.host_id
            and host not in hosts
        )  # fmt: skip

    def _newest(self) -> dict[str, Any] | None:
        """The newest progress record this host knows of: the last it wrote locally (etcd never
        came back), else the last it saw in etcd (what a local line comes after)."""
        if self._local is not None:
            return self._local
        return _value(self._progress.value) if self._progress is not None else None

    async def _progress_landed(self, kv: KV, writer: str, tried: list[int]) -> int | None:
        """Whether the progress record ``kv`` is (or was, right after one of the revisions a
        write was sent against) the write tagged ``writer``: the revision it came right after,
        or None."""
        if _writer(kv) == writer:
            return tried[-1] if tried else kv.mod_revision - 1
        for rev in tried:
            value = await self.etcd.first_put_after(self.keys.progress, rev)
            if value is not None and _value(value).get("writer") == writer:
                return rev
        return None

    def roll_back(self, step: int) -> None:
        """Silent corruption rolled the job back to ``step``: the steps after it are redone, and
        their first records (computed from a corrupt state) give way to the redone ones. In the
        outbox's order: records of steps before the rollback land (or are dropped) first."""
        if step >= self.last_metric_step:
            return
        found_at, self.last_metric_step = self.last_metric_step, step
        self.commit_times.clear()
        writer = f"{self.host_id}/{uuid.uuid4().hex}"
        progress = {
            "step": step, "rolled_back": True, "time": time.time(),
            "epoch": self.last_epoch, "writer": writer,  # the stream continues from here
        }  # fmt: skip

        async def roll_back() -> None:
            self.metrics.keep_only(lambda r: int(r.get("step", 0)) <= step)
            self._progress = None
            revision = await self.etcd.put(
                self.keys.progress, encode(from_json(Progress, progress))
            )
            if self.stream is not None:
                self.stream.rolled_back(step, found_at=found_at, revision=revision)
            self._last_writer = writer

        def locally() -> None:
            self.metrics.keep_only(lambda r: int(r.get("step", 0)) <= step)
            if self.stream is not None:
                self.stream.rolled_back(step, found_at=found_at, revision=None)

        self.outbox.put(f"rollback to step {step}", roll_back, fallback=locally)


RECORD = ("step", "loss", "epoch", "world_size", "samples", "step_seconds", "lr", "grad_norm",
          "sparsity", "skipped", "time", "writer")  # fmt: skip


def _is_step_record(progress: dict[str, Any]) -> bool:
    """Whether a progress record is a committed step's record (it holds the step's line), not a
    rollback's or a relaunch's marker."""
    return "loss" in progress and "writer" in progress and not progress.get("rolled_back")


def _line(progress: dict[str, Any]) -> dict[str, Any]:
    """A step's ``metrics.jsonl`` line as its progress record holds it."""
    return {key: progress.get(key) for key in RECORD}


def _value(raw: bytes) -> dict[str, Any]:
    """A progress record as read from etcd, checked (:class:`~elaswave.wire_etcd.Progress`);
    one that does not decode is logged and read as empty (no step: the next write replaces it)."""
    record = decode_or_log(Progress, raw, ignoring="a malformed progress record in etcd")
    return record.fields() if record is not None else {}


def _writer(kv: KV) -> str | None:
    """The writer token of a progress record (None: a record without one)."""
    return _value(kv.value).get("writer")


def _covers(kv: KV, step: int) -> bool:
    """Whether the progress record ``kv`` is at ``step`` or past it."""
    return int(_value(kv.value).get("step", 0)) >= step
