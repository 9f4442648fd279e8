"""The daemon's side of its workers' control channel: which connection is which worker, and what
each message from a worker does (one handler per message class of :mod:`elaswave.wire`).

It reads what it needs of the daemon through :class:`ChannelHost` and keeps what it learns
itself: the live connections, each worker's memory report, and the first reason a worker gave
for the job being unable to go on (:attr:`WorkerChannel.unrecoverable`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from elaswave import wire
from elaswave.daemon.control_server import WorkerConn
from elaswave.wire_etcd import EvictRequest, MemoryReport, WorkerInfo

if TYPE_CHECKING:
    from elaswave.config import JobConfig
    from elaswave.daemon.compute import ComputeTimes
    from elaswave.daemon.jobstore import JobStore
    from elaswave.daemon.metrics import DaemonMetrics
    from elaswave.daemon.outbox import Outbox
    from elaswave.daemon.records import StepRecords
    from elaswave.daemon.workers import WorkerProc
    from elaswave.events import EventLog
    from elaswave.planning.plan import Plan

__all__ = ["UNRECOVERABLE", "ChannelHost", "WorkerChannel"]

# Events a worker sends when the job cannot go on: every copy of some state is gone, or the
# user's script failed (it would fail again in a respawned worker). The first one's reason is
# the job's.
UNRECOVERABLE = ("shard_lost", "script_failed", "nonfinite_stop", "replay_undecided")


class ChannelHost(Protocol):
    """What the channel reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def host_id(self) -> str: ...
    @property
    def host_addr(self) -> str: ...
    @property
    def jobstore(self) -> JobStore: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def records(self) -> StepRecords: ...
    @property
    def compute(self) -> ComputeTimes: ...
    @property
    def prom(self) -> DaemonMetrics | None: ...
    @property
    def plan(self) -> Plan | None: ...
    @property
    def workers(self) -> Mapping[str, WorkerProc]: ...

    @property
    def lease(self) -> Any:
        """The host lease this host's keys live under."""

    async def registered(self, wid: str) -> None:
        """A worker said hello: the pool may still be adopting its process."""

    def dispatch_faults(self) -> None:
        """Send pending faults to the workers that can take them now."""

    def running(self) -> set[str]:
        """The workers of this host whose processes have not exited."""


class WorkerChannel:
    """Connections and message handlers of one host's workers."""

    def __init__(self, host: ChannelHost) -> None:
        self.host = host
        self.conns: dict[str, WorkerConn] = {}
        self.memory: dict[str, dict[str, int]] = {}  # worker -> bytes it holds, by purpose
        self.unrecoverable: str | None = None  # why workers gave up (e.g. a lost ZeRO shard)
        # (step, signal) once a worker checkpointed a step and left for a preemption
        self.preempted: tuple[int, str] | None = None

    async def on_message(self, conn: WorkerConn, msg: wire.WorkerMessage) -> None:
        """One message from a worker, by :attr:`handlers`. Anything but a ``hello`` counts only
        from a worker this daemon started and that said hello."""
        if isinstance(msg, wire.Hello):
            await self._on_hello(conn, msg)
            return
        w = self.host.workers.get(conn.worker_id or "")
        if w is not None:
            self.handlers[type(msg)](w, msg)

    def on_disconnect(self, conn: WorkerConn) -> None:
        if conn.worker_id and self.conns.get(conn.worker_id) is conn:
            del self.conns[conn.worker_id]

    def send_all(self, msg: wire.DaemonMessage) -> None:
        """``msg`` to every connected worker."""
        for conn in list(self.conns.values()):
            conn.send(msg)

    def send_plan(self, plan: Plan) -> None:
        """``plan`` to every worker that is ready for plans."""
        msg = wire.PlanUpdate(plan)
        workers = self.host.workers
        for wid, conn in list(self.conns.items()):
            if (w := workers.get(wid)) is not None and w.ready and not w.spare:
                conn.send(msg)

    @functools.cached_property
    def handlers(self) -> dict[type[wire.Message], Callable[[WorkerProc, Any], None]]:
        """What each message from a worker does (``hello`` aside)."""
        h = self.host
        return {
            wire.Ready: self._on_ready,
            wire.Event: self._on_event,
            wire.Heartbeat: self._on_heartbeat,
            wire.Commit: lambda w, msg: h.records.commit(msg),
            wire.Eval: lambda w, msg: h.records.evaluated(msg),
            wire.Log: self._on_log,
            wire.Rollback: lambda w, msg: h.records.roll_back(msg.step),
            wire.Compute: lambda w, msg: h.compute.measured(w.worker_id, msg),
            wire.Memory: self._on_memory,
            wire.LayerCosts: lambda w, msg: h.compute.measured_layers(w.worker_id, msg),
            wire.Evict: self._on_evict,
            wire.Done: self._on_done,
        }

    # ---- the handlers ---------------------------------------------------------------------------
    async def _on_hello(self, conn: WorkerConn, msg: wire.Hello) -> None:
        h = self.host
        await h.registered(msg.worker_id)  # a forked worker can be that quick
        w = h.workers.get(msg.worker_id)
        if w is None:
            conn.send(wire.Stop())
            return
        self.conns[w.worker_id] = conn
        conn.send(wire.Config(config=h.cfg.to_dict(), host_addr=h.host_addr))

    def _on_ready(self, w: WorkerProc, msg: wire.Ready) -> None:
        h = self.host
        w.ready = True

        def floats(costs: list[float] | None) -> list[float] | None:
            return [float(x) for x in costs] if costs is not None else None

        info = WorkerInfo(
            worker_id=w.worker_id, host=h.host_id, pid=w.pid, slot=w.slot,
            rack=h.cfg.rack or None,  # the tier above hosts, for the planner
            # pipelines: the workload's estimate, a start-up profile, the layers' bytes
            layer_estimate=floats(msg.layer_estimate), layer_seconds=floats(msg.layer_seconds),
            layer_bytes=floats(msg.layer_bytes),
        )  # fmt: skip
        w.info = info
        if w.spare:  # built, and waiting: registered only once it takes a place
            h.events.emit("spare_ready", host=h.host_id, worker=w.worker_id, pid=w.pid)
            return
        h.outbox.put(
            f"registration of {w.worker_id}",
            lambda: h.jobstore.register_worker(info, lease=h.lease),
        )
        h.events.emit("worker_ready", host=h.host_id, worker=w.worker_id, pid=w.pid)
        conn = self.conns.get(w.worker_id)
        if h.plan is not None and conn is not None:
            conn.send(wire.PlanUpdate(h.plan))
        h.dispatch_faults()

    def _on_event(self, w: WorkerProc, msg: wire.Event) -> None:
        event = dict(msg.event)
        event.setdefault("worker", w.worker_id)
        event["host"] = self.host.host_id
        self.host.events.write(event)
        if event.get("kind") in UNRECOVERABLE and self.unrecoverable is None:
            self.unrecoverable = str(event.get("reason"))  # the first cause, not echoes
        if event.get("kind") == "preempted" and self.preempted is None:
            self.preempted = (int(event.get("step", 0)), str(event.get("signal")))
        if event.get("kind") == "preempt_left":
            w.unjoined = True

    def _on_heartbeat(self, w: WorkerProc, msg: wire.Heartbeat) -> None:
        w.heard(msg, time.monotonic())

    def _on_log(self, w: WorkerProc, msg: wire.Log) -> None:
        self.host.records.logged(msg)
        if self.host.prom is not None:
            self.host.prom.logged(msg.metrics)

    def _on_memory(self, w: WorkerProc, msg: wire.Memory) -> None:
        """A worker's bytes by purpose under its newest plan, in ``memory/<host>`` (what
        ``status`` shows per rank), with those of this host's other running workers."""
        h = self.host
        self.memory[w.worker_id] = {k: int(v) for k, v in msg.bytes.items() if k.endswith("_bytes")}
        live = h.running()
        record = MemoryReport({wid: m for wid, m in self.memory.items() if wid in live})
        h.outbox.put(
            f"memory of {w.worker_id}",
            lambda: h.jobstore.share_memory(h.host_id, record, lease=h.lease),
        )

    def _on_evict(self, w: WorkerProc, msg: wire.Evict) -> None:
        """A replay found workers miscomputing: a request per worker, which the leader reads."""
        h = self.host
        for wid in msg.workers:
            request = EvictRequest(step=msg.step, reason=msg.reason, by=w.worker_id)
            h.outbox.put(
                f"eviction request for {wid}",
                functools.partial(h.jobstore.request_eviction, wid, request),
            )

    def _on_done(self, w: WorkerProc, msg: wire.Done) -> None:
        w.done = True
        self.host.records.finished_at(msg.step)
