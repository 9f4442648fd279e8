"""Prometheus metrics of a daemon (``launch --metrics-port P``): ``GET /metrics``.

Every daemon follows the job's progress record and plans in etcd (the same on every host), so
every daemon could tell the job-wide numbers; only the leader serves them, so a scrape of every
host gives each series once. Per-host series (this host's workers by state, whether it leads)
come from every daemon. Every series carries ``job`` and ``host`` labels.

Job-wide: ``elaswave_committed_step``, ``elaswave_epoch``, ``elaswave_world_size``,
``elaswave_loss``, ``elaswave_samples_per_second``, ``elaswave_step_seconds`` (histogram, one
observation per committed step), ``elaswave_incidents_total{kind}`` (plans that answered a
departure: crash, hang, host, straggler, other) and ``elaswave_mttr_seconds`` (histogram: from
the plan that answered an incident to the first step committed under it; the report's MTTR adds
the detection before the plan). Per host: ``elaswave_workers{state}`` (starting, training,
standby, exited), ``elaswave_is_leader`` and ``elaswave_script_metric{name}`` (what a script
logged with ``job.log``, on the host of its rank 0).
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client import Counter as PromCounter
from prometheus_client.registry import Collector

from elaswave.planning.plan import Plan

__all__ = ["DaemonMetrics", "answers_loss", "incident_kind", "worker_state"]

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MTTR_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
WORKER_STATES = ("starting", "training", "standby", "exited")


def incident_kind(reason: str) -> str:
    """What kind of loss a plan's reason describes (the leader writes why workers departed)."""
    text = reason.lower()
    if "hung" in text:
        return "hang"
    if "host " in text and " lost" in text:
        return "host"
    if "straggler" in text or "slower than" in text or "evict" in text:
        return "straggler"
    if "killed by" in text or "exit code" in text or "exited" in text:
        return "crash"
    return "other"


def answers_loss(plan: Plan) -> bool:
    """Whether a plan answers an incident: workers departed (a crash, a hang, a lost host) or
    were evicted (stragglers). A plan that only admits newcomers or re-shares work does not."""
    return bool(plan.departed or plan.evicted)


def worker_state(*, exited: bool, ready: bool, in_plan: bool) -> str:
    """One of ``WORKER_STATES`` for a worker process of this host."""
    if exited:
        return "exited"
    if not ready:
        return "starting"
    return "training" if in_plan else "standby"


class _WhenLeading(Collector):
    """The job-wide series, collected only while this daemon leads."""

    def __init__(self, registry: CollectorRegistry, leading: Callable[[], bool]) -> None:
        self.registry = registry
        self.leading = leading

    def collect(self) -> Iterable[Any]:
        if self.leading():
            yield from self.registry.collect()


class DaemonMetrics:
    """The series of one daemon, fed from the event loop (``progress``, ``plan``), read by the
    HTTP server's thread (``workers`` is called at scrape time)."""

    def __init__(
        self,
        job_id: str,
        host_id: str,
        *,
        leading: Callable[[], bool],
        workers: Callable[[], Iterable[str]],
    ) -> None:
        self.registry = CollectorRegistry()
        job = CollectorRegistry()
        labels = {"job": job_id, "host": host_id}
        names = list(labels)

        def gauge(name: str, doc: str, reg: CollectorRegistry) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**labels)

        self.step = gauge("elaswave_committed_step", "Newest committed step.", job)
        self.epoch = gauge("elaswave_epoch", "Epoch of the plan in force.", job)
        self.world = gauge("elaswave_world_size", "Ranks in the plan in force.", job)
        self.loss = gauge("elaswave_loss", "Loss of the newest committed step.", job)
        self.rate = gauge("elaswave_samples_per_second", "Training throughput.", job)
        self.step_seconds = Histogram(
            "elaswave_step_seconds", "Seconds per committed step.", names,
            buckets=STEP_BUCKETS, registry=job,
        ).labels(**labels)  # fmt: skip
        self.incidents = PromCounter(
            "elaswave_incidents", "Plans that answered a loss, by kind.", [*names, "kind"],
            registry=job,
        )  # fmt: skip
        self.mttr = Histogram(
            "elaswave_mttr_seconds", "Plan answering an incident -> first step committed under it.",
            names, buckets=MTTR_BUCKETS, registry=job,
        ).labels(**labels)  # fmt: skip
        self._labels = labels
        self.registry.register(_WhenLeading(job, leading))
        leader = Gauge("elaswave_is_leader", "1 while this daemon leads the job.", names,
                       registry=self.registry)  # fmt: skip
        leader.labels(**labels).set_function(lambda: 1.0 if leading() else 0.0)
        states = Gauge("elaswave_workers", "This host's worker processes by state.",
                       [*names, "state"], registry=self.registry)  # fmt: skip

        def count(state: str) -> float:
            return float(Counter(workers())[state])

        for state in WORKER_STATES:
            states.labels(**labels, state=state).set_function(functools.partial(count, state))
        self.script = Gauge(
            "elaswave_script_metric", "A value a script logged (job.log) on this host's rank 0.",
            [*names, "name"], registry=self.registry,
        )  # fmt: skip
        self._last_step = 0
        self._pending: dict[int, float] = {}  # incident plan epoch -> when it was made
        self.server: Any = None

    # ---- feeds (the daemon's event loop) --------------------------------------------------------
    def progress(self, record: dict[str, Any]) -> None:
        """A progress record from etcd (one per committed step; a rollback moves it back)."""
        step = int(record.get("step", 0))
        self.step.set(step)
        if record.get("rolled_back"):
            self._last_step = step
            return
        for key, gauge in (("loss", self.loss), ("samples_per_s", self.rate)):
            if isinstance(record.get(key), int | float):
                gauge.set(float(record[key]))
        if step > self._last_step and isinstance(record.get("step_seconds"), int | float):
            self.step_seconds.observe(float(record["step_seconds"]))
        self._last_step = max(self._last_step, step)
        epoch = int(record.get("epoch", 0))
        now = float(record.get("time") or time.time())
        for e in [e for e in self._pending if e <= epoch]:
            self.mttr.observe(max(now - self._pending.pop(e), 0.0))

    def logged(self, metrics: dict[str, float]) -> None:
        """Values a script logged after a step (``job.log``, from rank 0: its host serves them)."""
        for name, value in metrics.items():
            self.script.labels(**self._labels, name=name).set(float(value))

    def plan(self, plan: Plan) -> None:
        """A plan was published: the layout, and an incident when it answers a departure."""
        self.epoch.set(plan.epoch)
        self.world.set(plan.world_size)
        if answers_loss(plan):
            kind = incident_kind(plan.reason)
            self.incidents.labels(**self._labels, kind=kind).inc()
            self._pending[plan.epoch] = plan.created or time.time()

    # ---- serving ---------------------------------------------------------------------------------
    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve ``/metrics`` on ``port`` (0: a free one) in a thread; the port bound."""
        from prometheus_client import start_http_server

        self.server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return int(self.server.server_port)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None
