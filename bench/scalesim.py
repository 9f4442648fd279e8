"""Many simulated hosts in one asyncio process, running the daemon's own control-plane parts
against a real etcd cluster: the engine of ``python -m bench scale``.

A :class:`SimHost` is a host daemon without worker processes. It does what
:class:`~elaswave.daemon.supervisor.HostDaemon` does, with the same code:

- it registers its host key under a lease and its workers' keys as they "become ready"
  (:class:`~elaswave.daemon.jobstore.JobStore`), and keeps the lease alive with the daemon's
  :class:`~elaswave.daemon.controlplane.ControlPlane` (an etcd outage, a renewal after expiry);
- it campaigns for leader (:func:`~elaswave.daemon.leader.campaign`); the winner runs the real
  :class:`~elaswave.daemon.leader.Planner`, which makes real plans from the worker keys;
- it follows the plan key (``JobStore.plans``) and decodes every plan (``planwire.decode``).

Faults are the daemon's own paths: a worker exit is the departure record a daemon writes when a
worker process exits; a dying host stops refreshing its lease (its keys go when etcd expires
it), the leader host included; an etcd member is SIGKILLed.

Times are ``time.monotonic()`` in this one process. A host that holds the plan a new one follows
applies the small delta it receives (each host here does its own); one that reads a whole plan
(the first, say) gets the same bytes as every other: that plan is decoded once per process and
its decode time added to each host's receipt, which stands for the hosts decoding in parallel,
each on its own CPU (here they would queue on one).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import random
import statistics
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from elaswave.config import JobConfig
from elaswave.daemon.controlplane import ControlPlane
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EtcdCluster
from elaswave.daemon.jobstore import JobStore, PlanError
from elaswave.daemon.leader import Candidate, Leadership, campaign, succession_turn
from elaswave.keys import JobKeys
from elaswave.planning import planwire
from elaswave.planning.plan import Plan
from elaswave.planning.plandelta import encode_delta
from elaswave.wire_etcd import HostInfo, WorkerInfo

ETCD_REQUEST_LIMIT = 1_572_864  # etcd's default --max-request-bytes (1.5 MiB)
CONNECT_AT_ONCE = 16  # hosts connecting at the same time while the job starts


class SimEvents:
    """The events every simulated host and its planner emit, stamped on arrival."""

    def __init__(self) -> None:
        self.log: list[tuple[float, str, dict[str, Any]]] = []

    def emit(self, kind: str, **fields: Any) -> None:
        self.log.append((time.monotonic(), kind, fields))

    def of(self, kind: str, since: float = 0.0) -> list[tuple[float, dict[str, Any]]]:
        return [(t, f) for t, k, f in self.log if k == kind and t >= since]


class WholeReads:
    """The whole plans the hosts of this process read (not applied as deltas): how many, and
    each distinct one decoded once (see the module's note)."""

    def __init__(self) -> None:
        self.count = 0
        self.decoded: dict[bytes, tuple[Plan | PlanError, float]] = {}  # -> (plan, seconds)


class SimJobStore(JobStore):
    """The daemon's job store, but a whole plan is decoded once for all the hosts of this
    process: a host served from that cache owes the first decode's time, added to its
    receipt."""

    def __init__(self, etcd: Etcd, keys: JobKeys, reads: WholeReads) -> None:
        super().__init__(etcd, keys)
        self.reads = reads
        self.owed = 0.0

    def decode(self, value: bytes) -> Plan | PlanError:
        self.reads.count += 1
        got = self.reads.decoded.get(value)
        if got is None:
            start = time.perf_counter()
            plan = super().decode(value)
            self.reads.decoded[value] = (plan, time.perf_counter() - start)
            return plan
        self.owed = got[1]
        return got[0]


@dataclass
class _NoWorker:  # what ControlPlane.renew reads of a worker: none here is re-registered
    info: Any = None


class SimHost:
    """A host daemon's control-plane parts, with ``per_host`` workers that never run."""

    def __init__(self, sim: Sim, index: int) -> None:
        self.sim = sim
        self.cfg: JobConfig = sim.cfg
        self.host_id = f"node-{index:05d}"
        self.keys: JobKeys = sim.keys
        self.etcd: Etcd = None  # type: ignore[assignment]  # set in start()
        self.jobstore: SimJobStore = None  # type: ignore[assignment]
        self.events = sim.events
        self.leadership = Leadership()
        self.workers: dict[str, _NoWorker] = {}
        self.worker_ids = [f"{self.host_id}.w{slot}" for slot in range(sim.per_host)]
        self.cp = ControlPlane(self)  # type: ignore[arg-type]  # the parts it uses are here
        self.outbox = self.cp.outbox
        self.plan: Plan | None = None
        self.seen: dict[int, float] = {}  # epoch -> when this host held it (decoded)
        self.dead = False
        self.tasks: list[asyncio.Task[Any]] = []

    # what the control plane reads of its host
    worker_step = 0
    is_leader = property(lambda self: self.leadership.held)

    def host_info(self) -> HostInfo:
        return HostInfo(
            host=self.host_id, addr="", pid=os.getpid(), nproc=self.sim.per_host, run_dir="",
            netns=None, started=time.time(),
        )  # fmt: skip

    @property
    def lease(self) -> Any:  # the control plane's: a renewal takes a new one
        return self.cp.lease

    async def start(self) -> None:
        self.etcd = await Etcd.connect(
            self.sim.endpoints, prefix=self.keys.prefix, timeout=10.0, client=self.host_id
        )
        self.jobstore = SimJobStore(self.etcd, self.keys, self.sim.whole)
        await self.cp.new_lease()
        if not await self.jobstore.register_host(self.host_info(), lease=self.lease):
            raise RuntimeError(f"host {self.host_id} registered twice")
        self.cp.joined()
        candidate = Candidate(
            store=self.jobstore,
            cfg=self.cfg,
            host_id=self.host_id,
            store_address=f"{self.host_id}:29500",
            emit=self.events.emit,
            leadership=self.leadership,
            registered=self.cp.registered,
            lease=lambda: self.lease,
            stopping=lambda: self.dead,
            turn=lambda: succession_turn(self.host_id, self.plan),
        )
        self.tasks = [
            asyncio.create_task(self.cp.keep_alive()),
            asyncio.create_task(self.cp.resilient(lambda: campaign(candidate))),
            asyncio.create_task(self.cp.resilient(self._follow_plans)),
        ]
        for slot, wid in enumerate(self.worker_ids):
            info = WorkerInfo(worker_id=wid, host=self.host_id, pid=os.getpid(), slot=slot)
            await self.jobstore.register_worker(info, lease=self.lease)

    async def _follow_plans(self) -> None:
        async for plan in self.jobstore.plans(lambda: self.plan):
            self.adopt(plan)

    def adopt(self, plan: Plan | PlanError) -> None:  # a renewal re-reads the plan too
        got = time.monotonic() + self.jobstore.owed
        self.jobstore.owed = 0.0
        if isinstance(plan, PlanError):
            raise plan  # the leader's plans always decode
        if self.plan is None or plan.epoch > self.plan.epoch:
            # One copy per plan in this process (each host has its own on real hosts): the
            # host computed its own; an equal one held already replaces it.
            shared = self.sim.plans.setdefault(plan.epoch, plan)
            self.plan = shared if shared == plan else plan
            self.seen[plan.epoch] = got

    async def worker_exit(self) -> str:
        """One of this host's workers exits: the departure its daemon records."""
        wid = self.worker_ids.pop()
        await self.jobstore.record_departure(wid, f"worker {wid} exit code 1", lease=self.lease)
        return wid

    async def die(self) -> None:
        """The host goes silent: nothing is refreshed or revoked; etcd expires its lease."""
        self.dead = True
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(BaseException):
                await task
        await self.etcd.close()

    async def close(self) -> None:
        if not self.dead:
            await self.die()


def _percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def spread(xs: Sequence[float]) -> dict[str, float]:
    """p50, p99 and max of ``xs`` (seconds), rounded to the millisecond's tenth."""
    return {
        "p50": round(statistics.median(xs), 4),
        "p99": round(_percentile(xs, 0.99), 4),
        "max": round(max(xs), 4),
    }


def etcd_counters(cluster: EtcdCluster) -> dict[str, float]:
    """Requests received (gRPC messages, lease keep-alives included) and bytes sent to clients
    (watch events included), summed over the live members; the largest backend database."""
    received, sent, db = 0.0, 0.0, 0.0
    for m in cluster.members:
        if m.exit_code() is not None:
            continue
        try:
            with urllib.request.urlopen(m.metrics_url + "/metrics", timeout=5.0) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("grpc_server_msg_received_total"):
                received += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_network_client_grpc_sent_bytes_total "):
                sent += float(line.rsplit(" ", 1)[1])
            elif line.startswith("etcd_mvcc_db_total_size_in_bytes "):
                db = max(db, float(line.rsplit(" ", 1)[1]))
    return {"requests": received, "sent_bytes": sent, "db_bytes": db}


@dataclass
class Sim:
    """``hosts`` simulated hosts of ``per_host`` workers each, one job, one etcd cluster."""

    cluster: EtcdCluster
    hosts: int
    per_host: int = 8
    lease_ttl: int = 5
    job: str = "scale"
    seed: int = 0
    events: SimEvents = field(default_factory=SimEvents)

    def __post_init__(self) -> None:
        n = self.hosts * self.per_host
        self.cfg = JobConfig.from_dict(
            {
                "job_id": self.job,
                # the whole job at once: the rendezvous waits for every host's workers
                "elastic": {"nproc_per_node": self.per_host, "nnodes": f"{self.hosts}"},
                "train": {"global_batch": 2 * n, "micro_batch_size": 1},
                "timeouts": {"lease_ttl": self.lease_ttl, "rendezvous": 600.0},
            }
        )
        self.keys = JobKeys(self.job)
        self.endpoints = self.cluster.endpoints
        self.members: list[SimHost] = []
        self.whole = WholeReads()
        self.plans: dict[int, Plan] = {}  # epoch -> the one copy the hosts here hold
        self.held: Plan | None = None  # the newest plan every live host holds
        self.rng = random.Random(self.seed)
        self.observer: Etcd = None  # type: ignore[assignment]
        self.watched: list[tuple[float, str, str]] = []  # (t, put|delete, key) hosts/ and leader
        self._watch: asyncio.Task[None] | None = None

    # ---- the job ------------------------------------------------------------------------------
    async def start(self) -> dict[str, Any]:
        """Every host registers and its workers become ready; returns how long until every
        host held the first plan."""
        self.observer = await Etcd.connect(self.endpoints, prefix=self.keys.prefix, timeout=10.0)
        await self.observer.delete_prefix(self.keys.prefix)
        self._watch = asyncio.create_task(self._observe(await self.observer.revision() + 1))
        started = time.monotonic()
        self.members = [SimHost(self, i) for i in range(self.hosts)]
        gate = asyncio.Semaphore(CONNECT_AT_ONCE)

        async def one(h: SimHost) -> None:
            async with gate:
                await h.start()

        await asyncio.gather(*(one(h) for h in self.members))
        registered = time.monotonic()
        await self.wait_epoch(1, timeout=120.0 + self.hosts * 0.05)
        self.held = self.members[0].plan
        self.whole.count = 0  # every host read the first plan whole
        # Thousands of hosts' connections are millions of long-lived objects in this one
        # process; a full garbage collection over them stalls every simulated host at once
        # (each real host has its own small heap). They are left out of collection.
        gc.collect()
        gc.freeze()
        return {
            "register_s": round(registered - started, 3),
            "first_plan_s": round(max(h.seen[1] for h in self.members) - registered, 3),
        }

    async def _observe(self, rev: int) -> None:
        k = self.keys
        async for ev in self.observer.watch_prefix(k.prefix, start_revision=rev):
            if ev.key.startswith(k.hosts) or ev.key == k.leader:
                self.watched.append((time.monotonic(), ev.kind, ev.key))

    def live(self) -> list[SimHost]:
        return [h for h in self.members if not h.dead]

    def leader(self) -> SimHost | None:
        return next((h for h in self.live() if h.leadership.held), None)

    def epoch(self) -> int:
        return max((h.plan.epoch for h in self.live() if h.plan is not None), default=0)

    async def wait_epoch(self, epoch: int, timeout: float) -> None:
        """Until every live host holds plan ``epoch`` (or a newer one)."""
        deadline = time.monotonic() + timeout
        while any(h.plan is None or h.plan.epoch < epoch for h in self.live()):
            if time.monotonic() > deadline:
                behind = sum(1 for h in self.live() if h.plan is None or h.plan.epoch < epoch)
                raise TimeoutError(f"{behind} host(s) never saw plan epoch {epoch}")
            await asyncio.sleep(0.01)

    async def wait_watched(self, kind: str, key: str, since: float, timeout: float) -> float:
        """When the observer saw ``kind`` on ``key`` after ``since``."""
        deadline = time.monotonic() + timeout
        while True:
            for t, k, name in self.watched:
                if t >= since and k == kind and name == key:
                    return t
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {kind} of {key} within {timeout:.0f} s")
            await asyncio.sleep(0.005)

    # ---- one fault and what followed it ----------------------------------------------------------
    def _pick(self, *, leader: bool = False) -> SimHost:
        if leader:
            h = self.leader()
            assert h is not None, "no leader"
            return h
        choices = [h for h in self.live() if not h.leadership.held and h.worker_ids]
        return self.rng.choice(choices)

    async def _answer(
        self, fault: str, detected: float, epoch: int, before: dict[str, float], **extra: Any
    ) -> dict:
        """How the job answered a fault detected at ``detected``: plan ``epoch`` published and
        held by every live host; etcd's work from ``before`` (its counters) until then."""
        await self.wait_epoch(epoch, timeout=60.0 + self.lease_ttl)
        t_pub, info = await self._published(epoch)  # hosts may see it before the CAS answers
        after = etcd_counters(self.cluster)
        whole, self.whole.count = self.whole.count, 0
        seen = [h.seen[epoch] - detected for h in self.live() if epoch in h.seen]
        plan = next(h.plan for h in self.live() if h.plan and h.plan.epoch == epoch)
        value = planwire.encode(plan).encode()
        base, self.held = self.held, plan
        return {
            "fault": fault,
            "epoch": epoch,
            "world": plan.world_size,
            "published_s": round(t_pub - detected, 4),
            "seen_s": spread(seen),
            "hosts_seen": len(seen),
            "read_s": info.get("read_s"),
            "planning_s": info.get("planning_s"),
            "plan_bytes": len(value),
            "delta_bytes": len(encode_delta(base, plan).encode()) if base else None,
            "whole_reads": whole,  # hosts that read the whole plan instead of its delta
            "requests": int(after["requests"] - before["requests"]),
            "sent_mb": round((after["sent_bytes"] - before["sent_bytes"]) / 1e6, 3),
            "db_mb": round(after["db_bytes"] / 1e6, 2),
            **extra,
        }

    async def _published(self, epoch: int, timeout: float = 30.0) -> tuple[float, dict]:
        """When the leader's compare-and-set of plan ``epoch`` answered, and its event."""
        deadline = time.monotonic() + timeout
        while True:
            found = [(t, f) for t, f in self.events.of("plan_published") if f["epoch"] == epoch]
            if found:
                return found[-1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"plan epoch {epoch} was never published")
            await asyncio.sleep(0.005)

    async def worker_exit(self) -> dict[str, Any]:
        epoch = self.epoch() + 1
        host = self._pick()
        before = etcd_counters(self.cluster)
        detected = time.monotonic()  # the daemon saw the process exit
        wid = await host.worker_exit()
        out = await self._answer("worker exit", detected, epoch, before)
        plan = self.live()[0].plan
        assert plan is not None and wid not in plan.workers and wid in plan.departed
        return out

    async def host_lost(self, *, leader: bool = False) -> dict[str, Any]:
        epoch = self.epoch() + 1
        host = self._pick(leader=leader)
        before = etcd_counters(self.cluster)
        killed = time.monotonic()
        await host.die()
        detected = await self.wait_watched(
            "delete", self.keys.host(host.host_id), killed, timeout=3 * self.lease_ttl + 10
        )
        extra: dict[str, Any] = {"lease_expiry_s": round(detected - killed, 3)}
        if leader:
            elected = await self.wait_watched("put", self.keys.leader, detected, timeout=30.0)
            extra["failover_s"] = round(elected - detected, 4)
        fault = "leader host lost" if leader else "host lost"
        out = await self._answer(fault, detected, epoch, before, **extra)
        plan = self.live()[0].plan
        assert plan is not None and host.host_id not in plan.hosts
        return out

    async def etcd_member_lost(self) -> dict[str, Any]:
        """The etcd member the leader talks to dies (a third of the hosts talk to it); once
        every host on it has moved to another member, a worker exits. Moving them all costs
        this one process a new connection and watches per host (on real hosts each does its
        own), so the move and the fault after it are timed apart."""
        before = len(self.events.of("etcd_unreachable"))
        leader = self.leader()
        assert leader is not None, "no leader"
        dead = leader.etcd.endpoint  # the worst member to lose: the leader's watch is there
        on_it = [h for h in self.live() if h.etcd.endpoint == dead]
        killed = time.monotonic()
        self.cluster.kill(self.endpoints.index(dead))
        deadline = killed + 60.0
        while any(h.etcd.endpoint == dead for h in on_it):  # each moves at its next call
            if time.monotonic() > deadline:
                raise TimeoutError("hosts still on a dead etcd member after 60 s")
            await asyncio.sleep(0.01)
        moved = time.monotonic()
        out = await self.worker_exit()
        out["fault"] = "etcd member lost, then worker exit"
        out["hosts_on_member"] = len(on_it)
        out["moved_s"] = round(moved - killed, 3)  # until the last of them used another member
        out["hosts_unreachable"] = len(self.events.of("etcd_unreachable")) - before
        return out

    async def steady_rate(self, seconds: float) -> float:
        """etcd requests per second while nothing happens (lease keep-alives, mostly)."""
        a = etcd_counters(self.cluster)["requests"]
        await asyncio.sleep(seconds)
        return round((etcd_counters(self.cluster)["requests"] - a) / seconds, 1)

    async def close(self) -> None:
        gc.unfreeze()
        await asyncio.gather(*(h.close() for h in self.members), return_exceptions=True)
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(BaseException):
                await self._watch
        if self.observer is not None:
            await self.observer.close()
