"""Leader election and plan publication.

Every daemon campaigns by creating the leader key under its host lease; the winner computes plans
(a pure function, :func:`~elaswave.planning.plan.next_plan`) on every membership change and
publishes each with a compare-and-set on the plan key's revision, so two leaders can never
publish two plans for one epoch. If the leader's host goes away its lease expires, the key
vanishes, and the others campaign again.

A host whose lease expires (a dead or partitioned host) loses its worker keys with it; the leader
names the lost host in the next plan's reason and records a ``host_lost`` event (detection time of
a host fault ≈ the lease TTL).

A leader whose own lease expired (its host was cut off, or its daemon paused) may not know it yet:
every plan is published in a transaction that also requires the leader key to still name this
host, so a former leader can never publish; it steps down and campaigns again.

The campaign and the planner know nothing of the daemon: they read and write the job's keys
through a :class:`~elaswave.daemon.jobstore.JobStore` and get what else they need (the config,
this host's id and store, the event log, its leadership, whether it is stopping) as a
:class:`Candidate`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from elaswave.config import JobConfig
from elaswave.daemon.aio import wait_for
from elaswave.daemon.jobstore import Change, JobStore, WorkerRecord
from elaswave.errors import EtcdUnavailable
from elaswave.planning.layercosts import measured_layers, plan_costs
from elaswave.planning.partition import NoCutFits, StageMemory
from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import Member, Plan, moved_store, next_plan, reshared_plan
from elaswave.planning.verdicts import (
    Hysteresis,
    PipelineVerdict,
    StragglerVerdict,
    loop_verdict,
    pipeline_straggler_verdict,
    straggler_verdict,
)
from elaswave.wire_etcd import Incident, Speeds

log = logging.getLogger(__name__)

MAX_INCIDENTS = 20
JOIN_SETTLE_S = 0.5  # how long a grow waits for further joiners before it is planned
CATCH_UP_S = 1.0  # how long a plan waits for the watch to bring a departure's change
SUCCESSION_STEP_S = 0.02  # a lost leader: each host in plan order claims this much later
SUCCESSION_CAP_S = 1.0

Emit = Callable[..., Any]  # records an event: emit(kind, **fields)


class Leadership:
    """Whether this host leads. The campaign takes it when it wins and gives it up when its
    planner returns; the control plane revokes it when the host's lease expired (the leader
    key went with it), which wakes a running planner so that it steps down."""

    def __init__(self) -> None:
        self.held = False
        self._wake: asyncio.Event | None = None  # the running planner's change event

    def revoke(self) -> None:
        self.held = False
        if self._wake is not None:
            self._wake.set()

    @contextlib.contextmanager
    def planning(self, wake: asyncio.Event) -> Iterator[None]:
        """While a planner runs: ``wake`` is set when leadership is revoked."""
        self._wake = wake
        try:
            yield
        finally:
            if self._wake is wake:
                self._wake = None


@dataclass(frozen=True)
class Candidate:
    """A host standing for leader: what its campaign and, once it wins, its planner need."""

    store: JobStore
    cfg: JobConfig
    host_id: str
    store_address: str  # the TCP store of this host (written into every plan it makes)
    emit: Emit
    leadership: Leadership
    registered: asyncio.Event  # set while this host's keys live under its lease
    lease: Callable[[], Any]  # the host's current lease (a new one after an expiry)
    stopping: Callable[[], bool]  # the host is shutting down
    turn: Callable[[], int] = lambda: 0  # its place in the succession (succession_turn)

    async def holds_leader(self) -> bool:
        """Whether the leader key names this host (and its keys are registered)."""
        return await self.store.leader() == self.host_id and self.registered.is_set()


def succession_turn(host: str, plan: Plan | None) -> int:
    """A host's place in the succession: the order of the hosts in the newest plan (rank
    order), 0 without a plan; a host the plan does not name comes after all of them. Asked at
    every wake of an election, so the plan keeps the order (one pass per plan, not per ask)."""
    return plan.host_place(host) if plan is not None else 0


def succession_delay(turn: int) -> float:
    """How long a host waits, once the leader key is gone, for an earlier host to take it
    before it claims: ``SUCCESSION_STEP_S`` per place, at most ``SUCCESSION_CAP_S``. A host
    that sees the key taken claims nothing: at a thousand hosts one or two claims reach etcd
    instead of a thousand, and if the first in line is dead too the next follows a step later."""
    return min(turn * SUCCESSION_STEP_S, SUCCESSION_CAP_S)


async def campaign(c: Candidate) -> None:
    """Win the election (or wait for the current leader to go, and for its turn), then lead
    until stopped, the job is done, or this host's lease expires (then campaign again under the
    new one)."""
    while not c.stopping():
        await c.registered.wait()
        if await c.store.is_done():
            return  # the job is over: hosts leaving now need no new leader
        claim = await c.store.claim_leader(c.host_id, lease=c.lease())
        # held already: an outage ran this again
        if claim.won or (claim.holder == c.host_id and c.registered.is_set()):
            if claim.won:
                c.emit("leader_elected", host=c.host_id)
            c.leadership.held = True
            await Planner(c).run()
            c.leadership.held = False
            continue
        await c.store.await_succession(
            since=claim.revision, patience=lambda: succession_delay(c.turn())
        )


class Planner:
    def __init__(self, c: Candidate) -> None:
        self.c = c
        self.store = c.store
        self.cfg = cfg = c.cfg
        self.changed = asyncio.Event()
        lo, hi = cfg.elastic.nnodes_range
        self.expected = lo * cfg.elastic.nproc_per_node
        self.max_workers = hi * cfg.elastic.nproc_per_node
        self.num_microbatches = cfg.train.num_microbatches
        self.early_causes: list[str] = []
        self.profiles: list[list[float]] = []  # pipelines: workers' start-up seconds per layer
        self.estimate: list[float] = []  # pipelines: the workload's cost per layer
        self.layer_bytes: list[float] = []  # pipelines: what a stage holds per layer
        self.online: list[dict[str, float]] = []  # layer_costs=online: live workers' measurements
        self.costs: tuple[float, ...] = ()  # pipelines: the layer costs the last plan used
        self.cost_source = ""  # where they came from: estimate | profile | online
        self.evicted: set[str] = set()  # never re-admitted, even if their key lingers
        self.speeds: dict[str, Speeds] = {}  # host -> its workers' compute times
        self.evicting: dict[str, str] = {}  # worker -> why a replay says to evict it (pending)
        self.hysteresis = Hysteresis()
        self.failure_steps: list[int] = []  # last committed step at each worker failure
        self.host_causes: list[str] = []  # hosts whose lease expired since the last plan
        self.job_done = False
        # The ready workers, read once and then kept by the watch (a plan reads no key per
        # worker): worker id -> record, and the revision of the newest change applied to it.
        self.roster: dict[str, WorkerRecord] = {}
        self.applied = 0
        self.snapshot = 0  # the revision the roster was last read at: older changes are in it
        self.dropped = 0  # the revision of the newest worker the roster dropped
        self.moved = asyncio.Event()  # set whenever the watch applied a change
        # A relaunched job's plans come after the epochs it recorded (its progress record's).
        self.epoch_floor = 0

    async def run(self) -> None:
        """Plan until the job is done or stops, or this host stops leading. An etcd outage
        raises :class:`EtcdUnavailable` (from a call, or from the watch): the daemon runs the
        campaign again once etcd answers, and a new planner starts from a fresh read."""
        rev = await self._read_roster()
        for wid, request in (await self.store.eviction_requests()).items():
            self.evicting.setdefault(wid, request.reason)
        watcher = asyncio.create_task(self._watch(rev + 1))
        try:
            with self.c.leadership.planning(self.changed):
                await self._lead(watcher)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

    async def _lead(self, watcher: asyncio.Task[None]) -> None:
        c, store = self.c, self.store
        current, plan_rev = await store.read_plan()
        progress = await store.progress()
        self.epoch_floor = progress.epoch or 0 if progress is not None else 0
        if current is None:
            await self._await_initial_members()
        elif not await store.is_done():
            for host in lost_hosts(current.hosts, await store.live_hosts()):
                self._host_lost(host, "not registered when this leader took over")
        if current is not None:  # the evicted processes still registered (see _watch): a key
            # made after the plan that evicted its id is a new process (its host relaunched)
            self.evicted.update(
                w for w in current.evicted if w in self.roster and self.roster[w].order < plan_rev
            )
        while not c.stopping() and c.leadership.held:
            self.changed.clear()
            if await store.is_done():
                return  # the last step is committed: leaving workers change nothing
            read_at = time.perf_counter()
            evicted = self._take_evictions(current)  # before the members: they leave them out
            members, causes = await self._read_members()
            causes, self.host_causes = self.host_causes + causes, []
            if current is None:
                causes = self.early_causes + causes
            if current is not None and not causes and self._only_joins(current, members):
                # Newcomers arrive one by one; admit those that come together in one plan.
                await asyncio.sleep(JOIN_SETTLE_S)
                members, more = await self._read_members()
                causes += more
                if await store.is_done():
                    return
            if current is not None and causes and await self._loop_breaker(len(causes)):
                return
            plan_at = time.perf_counter()
            try:  # an eviction is no failure: the loop breaker does not count it
                plan = self._next(current, members, "; ".join(causes + list(evicted.values())))
                if plan is not None and evicted:
                    plan = replace(plan, evicted=tuple(evicted))
                if plan is None and current is not None:
                    if current.is_pipeline:
                        plan = self._pipeline_straggler_plan(current, members)
                    else:
                        plan = self._straggler_plan(current)
            except NoCutFits as err:  # max_stage_bytes: no cut of the model fits
                reason = f"no pipeline plan fits: {err}"
                self.c.emit("plan_refused", reason=reason)
                await self.store.stop_job(reason)
                return
            if plan is None and current is not None and current.store != c.store_address:
                plan = moved_store(current, c.store_address, leader=c.host_id, now=time.time(),
                                   epoch_floor=self.epoch_floor)  # fmt: skip
            timing = {
                "read_s": round(plan_at - read_at, 6),  # the members (and costs) from etcd
                "planning_s": round(time.perf_counter() - plan_at, 6),  # the pure planner
            }
            if plan is not None:
                plan = replace(plan, committed=await store.committed_step())
                if await store.publish_plan(
                    plan, mod_revision=plan_rev, leader=c.host_id, base=current
                ):
                    self._published(plan, **timing)
                    await self._record_incident(plan, bool(causes) or bool(plan.evicted))
                    if current is None:
                        for fault in self.cfg.faults:
                            await store.submit_fault(fault)
                elif not await c.holds_leader():
                    log.warning("no longer the leader (this host's lease expired)")
                    return
                current, plan_rev = await store.read_plan()
                self.hysteresis.reset()
                continue  # re-check: membership may have moved while we published
            await self._wait_change(watcher)

    async def _wait_change(self, watcher: asyncio.Task[None]) -> None:
        """Until something changed; a watch that failed (etcd went away) raises its error."""
        change = asyncio.create_task(self.changed.wait())
        await asyncio.wait({change, watcher}, return_when=asyncio.FIRST_COMPLETED)
        change.cancel()
        if watcher.done():
            watcher.result()  # raises what ended it
            raise EtcdUnavailable("the leader's watch on etcd ended")

    def _next(self, current: Plan | None, members: list[Member], cause: str) -> Plan | None:
        cfg = self.cfg
        if cfg.pp > 1:
            costs, self.cost_source = plan_costs(
                cfg.layer_costs, self.estimate, self.profiles, observations=self.online
            )
            self.costs = costs
            return next_pipeline_plan(
                current,
                members,
                pp=cfg.pp,
                costs=costs,
                num_microbatches=self.num_microbatches,
                max_workers=self.max_workers,
                store=self.c.store_address,
                now=time.time(),
                cause=cause,
                policy=cfg.stage_loss,
                epoch_floor=self.epoch_floor,
                memory=self.memory,
            )
        return next_plan(
            current,
            members,
            num_microbatches=self.num_microbatches,
            max_workers=self.max_workers,
            store=self.c.store_address,
            now=time.time(),
            cause=cause,
            epoch_floor=self.epoch_floor,
            per_rank=(
                self.num_microbatches // self.max_workers if cfg.train.batch == "shrink" else None
            ),
        )

    @property
    def memory(self) -> StageMemory:
        """What a pipeline cut holds each stage to (the config's balance and limit)."""
        cfg = self.cfg
        limit = float(cfg.max_stage_bytes) if cfg.max_stage_bytes else math.inf
        return StageMemory(tuple(self.layer_bytes), cfg.stage_balance, limit)

    def _caps(self, plan: Plan) -> list[float | None]:
        """Each replica's bytes per stage (None: compute alone), once per stage count."""
        memory = self.memory
        caps = {n: _finite(memory.cap(n)) for n in {len(b) - 1 for b in plan.bounds}}
        return [caps[len(b) - 1] for b in plan.bounds]

    def _published(self, plan: Plan, **timing: float) -> None:
        self.c.emit(
            "plan_published",
            t=plan.created,  # decided then; workers may see it before CAS returns
            epoch=plan.epoch,
            **timing,
            world=plan.world_size,
            workers=list(plan.workers),
            microbatches=list(plan.microbatches),
            departed=list(plan.departed),
            evicted=list(plan.evicted),
            reason=plan.reason,
            **(
                {
                    "replicas": plan.replicas,
                    "bounds": plan.bounds,
                    "layer_costs": self.costs,
                    "cost_source": self.cost_source,
                    "measured_layers": measured_layers(self.online, len(self.costs)),
                    "layer_bytes": self.layer_bytes,  # what the cut held each stage to
                    "stage_bytes_cap": self._caps(plan),
                }
                if plan.is_pipeline
                else {}
            ),
            **({"racks": dict(plan.racks)} if plan.racks else {}),
        )

    def _samples(self, current: Plan) -> dict[str, list[float]]:
        """Every worker's recent compute seconds per micro-batch under ``current``."""
        samples: dict[str, list[float]] = {}
        for per_host in self.speeds.values():
            for wid, speed in per_host.workers.items():
                if speed.epoch == current.epoch:
                    samples[wid] = [float(x) for x in speed.per_mb]
        return samples

    def _pipeline_straggler_plan(self, current: Plan, members: list[Member]) -> Plan | None:
        """Re-cut the stages and re-share the replicas by speed, or evict a straggler (its
        stages are taken over as after a loss), once the verdict is stable."""
        verdict = pipeline_straggler_verdict(
            self._samples(current),
            current=current,
            costs=self.costs,
            threshold=self.cfg.elastic.straggler_threshold,
            store=self.c.store_address,
            now=time.time(),
            memory=self.memory,
        )
        if not self.hysteresis.observe(verdict.key):
            return None
        plan = verdict.plan
        if verdict.evict:
            self.evicted.update(verdict.evict)
            evict = set(verdict.evict)  # a set: a tuple scan per member is quadratic
            kept = [m for m in members if m.worker_id not in evict]
            plan = self._next(current, kept, verdict.reason)
            if plan is not None:
                plan = replace(plan, evicted=verdict.evict)
        if plan is None:
            return None
        self._straggler_detected(
            current, verdict, plan,
            microbatches=list(plan.microbatches),
            shares=list(plan.shares),
            bounds=[list(b) for b in plan.bounds],
        )  # fmt: skip
        return plan

    def _straggler_plan(self, current: Plan) -> Plan | None:
        """Re-share micro-batches by speed, or evict a straggler, once the verdict is stable."""
        verdict = straggler_verdict(
            self._samples(current),
            workers=current.workers,
            current=current.microbatches,
            threshold=self.cfg.elastic.straggler_threshold,
        )
        if not self.hysteresis.observe(verdict.key):
            return None
        assert verdict.microbatches is not None
        self.evicted.update(verdict.evict)
        plan = reshared_plan(
            current,
            verdict.microbatches,
            evict=verdict.evict,
            store=self.c.store_address,
            now=time.time(),
            cause=verdict.reason,
        )
        self._straggler_detected(current, verdict, plan, microbatches=list(verdict.microbatches))
        return plan

    def _straggler_detected(
        self, current: Plan, verdict: StragglerVerdict | PipelineVerdict, plan: Plan, **extra: Any
    ) -> None:
        """The event of a straggler plan (data-parallel or pipeline verdict)."""
        self.c.emit(
            "straggler_detected",
            epoch=current.epoch,
            stragglers=list(verdict.stragglers),
            evict=list(verdict.evict),
            slowdown={w: round(x, 3) for w, x in verdict.slowdown.items()},
            reason=verdict.reason,
            plan_reason=plan.reason,
            **extra,
        )

    async def _loop_breaker(self, failures: int) -> bool:
        """Count failures against committed progress; stop the whole job in a restart loop."""
        committed = await self.store.committed_step()
        self.failure_steps += [committed] * failures
        reason = loop_verdict(self.failure_steps, committed, self.cfg.elastic.loop_breaker)
        if reason is None:
            return False
        self.c.emit("loop_breaker", reason=reason, committed=committed)
        await self.store.stop_job(reason)
        return True

    @staticmethod
    def _only_joins(current: Plan, members: list[Member]) -> bool:
        live = {m.worker_id for m in members}
        return set(current.workers) <= live and bool(live - set(current.workers))

    async def _watch(self, start_revision: int) -> None:
        # Worker keys change on ready/exit; departures also cover workers that died before ready.
        async for change in self.store.changes(start_revision):
            if change.revision > self.snapshot:  # else the roster was read after it
                if change.worker is not None:
                    self.roster[change.worker.worker_id] = change.worker
                elif change.gone and self.roster.pop(change.gone, None) is not None:
                    self.dropped = change.revision
                    # An evicted worker's key goes once its daemon stopped it: the id may
                    # come back only as a new process (its host launched again), a newcomer.
                    self.evicted.discard(change.gone)
            self.applied = max(self.applied, change.revision)
            self.moved.set()
            if change.kind is Change.DONE:
                self.job_done = True  # hosts leaving from now on are finishing, not lost
            elif change.kind is Change.HOST_GONE and not self.job_done:
                current, _ = await self.store.read_plan()
                if current is not None and change.host in current.hosts:  # else it had no rank
                    self._host_lost(change.host, "its lease expired")
                self.changed.set()
            elif change.kind is Change.MEMBERSHIP:
                self.changed.set()
            elif change.kind is Change.SPEED and change.speeds is not None:
                self.speeds[change.host] = change.speeds
                self.changed.set()
            elif change.kind is Change.SPEED_GONE:
                self.speeds.pop(change.host, None)
            elif change.kind is Change.EVICT and change.evict is not None:
                self.evicting.setdefault(change.evicting, change.evict.reason)
                self.changed.set()

    def _take_evictions(self, current: Plan | None) -> dict[str, str]:
        """The pending evictions of workers the current plan runs (worker -> reason), now
        evicted for good; requests for others (gone already, or evicted) are dropped."""
        if current is None:
            return {}
        pending, self.evicting = self.evicting, {}
        out = {
            w: why for w, why in pending.items() if w in current.workers and w not in self.evicted
        }
        if out:
            self.evicted.update(out)
            self.c.emit(
                "replay_eviction",
                epoch=current.epoch,
                evict=list(out),
                reason="; ".join(out.values()),
            )
        return out

    def _host_lost(self, host: str, why: str) -> None:
        """A host key vanished without the job being done: the host died or is cut off."""
        if host == self.c.host_id:
            return
        self.host_causes.append(f"host {host} lost ({why})")
        self.c.emit("host_lost", host=host, leader=self.c.host_id, reason=why)

    async def _read_members(self) -> tuple[list[Member], list[str]]:
        """The live members (without the evicted), and why workers left since the last read.
        Pipelines also take the workers' cost profiles and, online, their measurements."""
        causes = await self._take_departures()
        members = []
        self.profiles = []
        for _, rec in sorted(self.roster.items()):  # key order, as etcd lists them
            if rec.worker_id in self.evicted:
                continue  # its daemon is stopping it
            if rec.layer_seconds:
                self.profiles.append(rec.layer_seconds)
            if rec.layer_estimate:  # every worker builds the same workload
                self.estimate = rec.layer_estimate
            if rec.layer_bytes:
                self.layer_bytes = rec.layer_bytes
            members.append(rec.member)
        if self.cfg.pp > 1 and self.cfg.layer_costs == "online":
            self.online = await self.store.online_costs({m.worker_id for m in members})
        return members, causes

    async def _take_departures(self) -> list[str]:
        """Why workers left since the last call, once the roster the watch keeps has caught up
        with them: a worker's departure and the deletion of its key are one revision, and no
        plan may name a cause with its worker still in, nor drop a worker without its cause
        (the watch may apply a departure while its reason's read is on the way: read again)."""
        causes: list[str] = []
        while True:
            more, newest, read_at = await self.store.take_departures()
            causes += more
            while self.applied < newest:
                self.moved.clear()
                try:
                    await wait_for(self.moved.wait(), CATCH_UP_S)
                except asyncio.TimeoutError:  # the watch lags (its etcd member went away,
                    await self._read_roster()  # say): read the roster as it is now instead
            if self.dropped <= read_at:
                return causes

    async def _read_roster(self) -> int:
        """Read the ready workers from etcd; the watch's changes up to that revision are in."""
        records, rev = await self.store.workers_at()
        self.roster = {r.worker_id: r for r in records}
        self.snapshot = rev
        self.dropped = rev  # it may lack workers whose departures are still unread
        self.applied = max(self.applied, rev)
        return rev

    async def _await_initial_members(self) -> None:
        """Initial rendezvous: wait for MIN hosts' workers, or the rendezvous timeout. Counts
        the roster (one key read per wake, whatever the job's size)."""
        cfg = self.cfg
        deadline = time.monotonic() + cfg.timeouts.rendezvous
        while not self.c.stopping():
            self.changed.clear()  # before reading: a change after the read must wake us
            self.early_causes += await self._take_departures()  # died before ready: do not
            ready = sum(1 for w in self.roster if w not in self.evicted)  # wait for them
            if ready + len(self.early_causes) >= self.expected and ready:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if ready >= cfg.elastic.min_workers:
                    return
                deadline = time.monotonic() + cfg.timeouts.rendezvous
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self.changed.wait(), remaining)

    async def _record_incident(self, plan: Plan, is_incident: bool) -> None:
        await self.store.record_incident(
            Incident(t=plan.created, epoch=plan.epoch, reason=plan.reason, fault=is_incident),
            keep=MAX_INCIDENTS,
        )


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def lost_hosts(plan_hosts: tuple[str, ...], live_hosts: set[str]) -> list[str]:
    """Hosts that hold ranks in the plan but are no longer registered, in rank order."""
    return list(dict.fromkeys(h for h in plan_hosts if h not in live_hosts))
