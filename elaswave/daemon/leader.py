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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from elaswave.errors import EtcdUnavailable
from elaswave.planning.pipeplan import measured_layers, next_pipeline_plan, plan_costs
from elaswave.planning.plan import Member, Plan, next_plan, reshared_plan
from elaswave.planning.verdicts import (
    Hysteresis,
    PipelineVerdict,
    StragglerVerdict,
    loop_verdict,
    pipeline_straggler_verdict,
    straggler_verdict,
)

if TYPE_CHECKING:
    from elaswave.daemon.supervisor import HostDaemon

log = logging.getLogger(__name__)

MAX_INCIDENTS = 20
JOIN_SETTLE_S = 0.5  # how long a grow waits for further joiners before it is planned


async def campaign(d: HostDaemon) -> None:
    """Win the election (or wait for the current leader to go), then lead until stopped, the
    job is done, or this host's lease expires (then campaign again under the new one)."""
    while not d.stopping:
        await d.cp.registered.wait()
        if await d.etcd.get(d.keys.done) is not None:
            return  # the job is over: hosts leaving now need no new leader
        won = await d.etcd.create(d.keys.leader, d.host_id, lease=d.lease)
        if won or await _holds(d, d.keys.leader):  # held already: an outage ran this again
            if won:
                d.events.emit("leader_elected", host=d.host_id)
            d.is_leader = True
            await Planner(d).run()
            d.is_leader = False
            continue
        await _wait_for_key_gone(d, d.keys.leader)


async def _holds(d: HostDaemon, key: str) -> bool:
    kv = await d.etcd.get(key)
    return kv is not None and kv.value.decode() == d.host_id and d.cp.registered.is_set()


async def _wait_for_key_gone(d: HostDaemon, key: str) -> None:
    rev = await d.etcd.revision()
    if await d.etcd.get(key) is None:
        return
    async for ev in d.etcd.watch_prefix(key, start_revision=rev + 1):
        if ev.key == key and ev.kind == "delete":
            return


class Planner:
    def __init__(self, d: HostDaemon) -> None:
        self.d = d
        self.changed = asyncio.Event()
        cfg = d.cfg
        lo, hi = cfg.elastic.nnodes_range
        self.expected = lo * cfg.elastic.nproc_per_node
        self.max_workers = hi * cfg.elastic.nproc_per_node
        self.num_microbatches = cfg.train.num_microbatches
        self.early_causes: list[str] = []
        self.profiles: list[list[float]] = []  # pipelines: workers' start-up seconds per layer
        self.estimate: list[float] = []  # pipelines: the workload's cost per layer
        self.online: list[dict[str, float]] = []  # layer_costs=online: live workers' measurements
        self.costs: tuple[float, ...] = ()  # pipelines: the layer costs the last plan used
        self.cost_source = ""  # where they came from: estimate | profile | online
        self.evicted: set[str] = set()  # never re-admitted, even if their key lingers
        self.speeds: dict[str, dict[str, dict]] = {}  # host -> worker -> {epoch, per_mb}
        self.hysteresis = Hysteresis()
        self.failure_steps: list[int] = []  # last committed step at each worker failure
        self.host_causes: list[str] = []  # hosts whose lease expired since the last plan
        self.job_done = False

    async def run(self) -> None:
        """Plan until the job is done or stops, or this host stops leading. An etcd outage
        raises :class:`EtcdUnavailable` (from a call, or from the watch): the daemon runs the
        campaign again once etcd answers, and a new planner starts from a fresh read."""
        d = self.d
        rev = await d.etcd.revision()
        watcher = asyncio.create_task(self._watch(rev + 1))
        d.planner = self
        try:
            current, plan_rev = await self._read_plan()
            if current is None:
                await self._await_initial_members()
            elif await d.etcd.get(d.keys.done) is None:
                live = {
                    kv.key.removeprefix(d.keys.hosts)
                    for kv in await d.etcd.get_prefix(d.keys.hosts)
                }
                for host in lost_hosts(current.hosts, live):
                    self._host_lost(host, "not registered when this leader took over")
            if current is not None:
                self.evicted.update(current.evicted)
            while not d.stopping and d.is_leader:
                self.changed.clear()
                if await d.etcd.get(d.keys.done) is not None:
                    return  # the last step is committed: leaving workers change nothing
                members, causes = await self._read_members()
                causes, self.host_causes = self.host_causes + causes, []
                if current is None:
                    causes = self.early_causes + causes
                if current is not None and not causes and self._only_joins(current, members):
                    # Newcomers arrive one by one; admit those that come together in one plan.
                    await asyncio.sleep(JOIN_SETTLE_S)
                    members, more = await self._read_members()
                    causes += more
                    if await d.etcd.get(d.keys.done) is not None:
                        return
                if current is not None and causes and await self._loop_breaker(len(causes)):
                    return
                plan = self._next(current, members, "; ".join(causes))
                if plan is None and current is not None:
                    if current.is_pipeline:
                        plan = self._pipeline_straggler_plan(current, members)
                    else:
                        plan = self._straggler_plan(current)
                if plan is not None:
                    plan = replace(plan, committed=await self._committed())
                    if await self._publish(plan, plan_rev):
                        self._published(plan)
                        await self._record_incident(plan, bool(causes) or bool(plan.evicted))
                        if current is None:
                            await d.faults.submit_config_faults()
                    elif not await _holds(d, d.keys.leader):
                        log.warning("no longer the leader (this host's lease expired)")
                        return
                    current, plan_rev = await self._read_plan()
                    self.hysteresis.reset()
                    continue  # re-check: membership may have moved while we published
                await self._wait_change(watcher)
        finally:
            if d.planner is self:
                d.planner = None
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher

    async def _wait_change(self, watcher: asyncio.Task[None]) -> None:
        """Until something changed; a watch that failed (etcd went away) raises its error."""
        change = asyncio.create_task(self.changed.wait())
        await asyncio.wait({change, watcher}, return_when=asyncio.FIRST_COMPLETED)
        change.cancel()
        if watcher.done():
            watcher.result()  # raises what ended it
            raise EtcdUnavailable("the leader's watch on etcd ended")

    async def _publish(self, plan: Plan, plan_rev: int) -> bool:
        """Compare-and-set the plan. A write whose answer was lost (the etcd member went away
        after applying it and the retry's compare failed) is recognised in etcd's history."""
        d = self.d
        data = plan.to_json()
        if await d.etcd.compare_and_put(
            d.keys.plan, data, mod_revision=plan_rev, holder=(d.keys.leader, d.host_id)
        ):
            return True
        landed = await d.etcd.first_put_after(d.keys.plan, plan_rev)
        return landed is not None and landed.decode() == data

    async def _committed(self) -> int:
        """The job's newest committed step as etcd knows it (its progress record)."""
        kv = await self.d.etcd.get(self.d.keys.progress)
        return int(kv.json().get("step", 0)) if kv is not None else 0

    def _next(self, current: Plan | None, members: list[Member], cause: str) -> Plan | None:
        cfg = self.d.cfg
        if cfg.pp > 1:
            costs, self.cost_source = plan_costs(
                cfg.layer_costs, self.estimate, self.profiles, self.online
            )
            self.costs = costs
            return next_pipeline_plan(
                current,
                members,
                pp=cfg.pp,
                costs=costs,
                num_microbatches=self.num_microbatches,
                max_workers=self.max_workers,
                store=self.d.store_address,
                now=time.time(),
                cause=cause,
                policy=cfg.stage_loss,
            )
        return next_plan(
            current,
            members,
            num_microbatches=self.num_microbatches,
            max_workers=self.max_workers,
            store=self.d.store_address,
            now=time.time(),
            cause=cause,
        )

    def _published(self, plan: Plan) -> None:
        self.d.events.emit(
            "plan_published",
            t=plan.created,  # decided then; workers may see it before CAS returns
            epoch=plan.epoch,
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
                }
                if plan.is_pipeline
                else {}
            ),
        )

    def _samples(self, current: Plan) -> dict[str, list[float]]:
        """Every worker's recent compute seconds per micro-batch under ``current``."""
        samples: dict[str, list[float]] = {}
        for per_host in self.speeds.values():
            for wid, info in per_host.items():
                if int(info.get("epoch", 0)) == current.epoch:
                    samples[wid] = [float(x) for x in info.get("per_mb", [])]
        return samples

    def _pipeline_straggler_plan(self, current: Plan, members: list[Member]) -> Plan | None:
        """Re-cut the stages and re-share the replicas by speed, or evict a straggler (its
        stages are taken over as after a loss), once the verdict is stable."""
        verdict = pipeline_straggler_verdict(
            self._samples(current),
            current=current,
            costs=self.costs,
            threshold=self.d.cfg.elastic.straggler_threshold,
            store=self.d.store_address,
            now=time.time(),
        )
        if not self.hysteresis.observe(verdict.key):
            return None
        plan = verdict.plan
        if verdict.evict:
            self.evicted.update(verdict.evict)
            kept = [m for m in members if m.worker_id not in verdict.evict]
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
            threshold=self.d.cfg.elastic.straggler_threshold,
        )
        if not self.hysteresis.observe(verdict.key):
            return None
        assert verdict.microbatches is not None
        self.evicted.update(verdict.evict)
        plan = reshared_plan(
            current,
            verdict.microbatches,
            evict=verdict.evict,
            store=self.d.store_address,
            now=time.time(),
            cause=verdict.reason,
        )
        self._straggler_detected(current, verdict, plan, microbatches=list(verdict.microbatches))
        return plan

    def _straggler_detected(
        self, current: Plan, verdict: StragglerVerdict | PipelineVerdict, plan: Plan, **extra: Any
    ) -> None:
        """The event of a straggler plan (data-parallel or pipeline verdict)."""
        self.d.events.emit(
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
        d = self.d
        kv = await d.etcd.get(d.keys.progress)
        committed = int(kv.json()["step"]) if kv else 0
        self.failure_steps += [committed] * failures
        reason = loop_verdict(self.failure_steps, committed, d.cfg.elastic.loop_breaker)
        if reason is None:
            return False
        d.events.emit("loop_breaker", reason=reason, committed=committed)
        await d.etcd.put_json(d.keys.stop, {"reason": reason, "t": time.time()})
        return True

    @staticmethod
    def _only_joins(current: Plan, members: list[Member]) -> bool:
        live = {m.worker_id for m in members}
        return set(current.workers) <= live and bool(live - set(current.workers))

    async def _watch(self, start_revision: int) -> None:
        # Worker keys change on ready/exit; departures also cover workers that died before ready.
        keys = self.d.keys
        async for ev in self.d.etcd.watch_prefix(keys.prefix, start_revision=start_revision):
            if ev.key == keys.done:
                self.job_done = True  # hosts leaving from now on are finishing, not lost
            elif ev.key.startswith(keys.hosts) and ev.kind == "delete" and not self.job_done:
                host = ev.key.removeprefix(keys.hosts)
                current, _ = await self._read_plan()
                if current is not None and host in current.hosts:  # else it had no rank left
                    self._host_lost(host, "its lease expired")
                self.changed.set()
            elif ev.key.startswith(keys.workers) or (
                ev.key.startswith(keys.departures) and ev.kind == "put"
            ):
                self.changed.set()
            elif ev.key.startswith(keys.speed):
                host = ev.key[len(keys.speed) :]
                if ev.kind == "put":
                    self.speeds[host] = json.loads(ev.value)
                    self.changed.set()
                else:
                    self.speeds.pop(host, None)

    def _host_lost(self, host: str, why: str) -> None:
        """A host key vanished without the job being done: the host died or is cut off."""
        if host == self.d.host_id:
            return
        self.host_causes.append(f"host {host} lost ({why})")
        self.d.events.emit("host_lost", host=host, leader=self.d.host_id, reason=why)

    async def _read_plan(self) -> tuple[Plan | None, int]:
        kv = await self.d.etcd.get(self.d.keys.plan)
        if kv is None:
            return None, 0
        return Plan.from_json(kv.value), kv.mod_revision

    async def _read_members(self) -> tuple[list[Member], list[str]]:
        d = self.d
        members = []
        self.profiles = []
        for kv in await d.etcd.get_prefix(d.keys.workers):
            info = kv.json()
            if info["worker_id"] in self.evicted:
                continue  # its daemon is stopping it
            if info.get("layer_seconds"):
                self.profiles.append(info["layer_seconds"])
            if info.get("layer_estimate"):  # every worker builds the same workload
                self.estimate = info["layer_estimate"]
            members.append(
                Member(worker_id=info["worker_id"], host=info["host"], order=kv.create_revision)
            )
        if d.cfg.pp > 1 and d.cfg.layer_costs == "online":
            self.online = await self._read_online_costs({m.worker_id for m in members})
        causes = []
        for kv in await d.etcd.get_prefix(d.keys.departures):
            causes.append(kv.value.decode())
            await d.etcd.delete(kv.key)
        return members, causes

    async def _read_online_costs(self, live: set[str]) -> list[dict[str, float]]:
        """The newest per-layer seconds every live member measured while training (published
        per host by its daemon)."""
        out = []
        for kv in await self.d.etcd.get_prefix(self.d.keys.costs):
            per_worker = kv.json()
            for wid, record in per_worker.items() if isinstance(per_worker, dict) else ():
                seconds = record.get("layer_seconds") if isinstance(record, dict) else None
                if wid in live and isinstance(seconds, dict):
                    out.append(seconds)
        return out

    async def _await_initial_members(self) -> None:
        """Initial rendezvous: wait for MIN hosts' workers, or the rendezvous timeout."""
        d = self.d
        deadline = time.monotonic() + d.cfg.timeouts.rendezvous
        while not d.stopping:
            self.changed.clear()  # before reading: a change after the read must wake us
            members, causes = await self._read_members()
            self.early_causes += causes  # workers that died before ready: do not wait for them
            if len(members) + len(self.early_causes) >= self.expected and members:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if len(members) >= d.cfg.elastic.min_workers:
                    return
                deadline = time.monotonic() + d.cfg.timeouts.rendezvous
                continue
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)

    async def _record_incident(self, plan: Plan, is_incident: bool) -> None:
        d = self.d
        kv = await d.etcd.get(d.keys.incidents)
        incidents = json.loads(kv.value) if kv else []
        incidents.append(
            {"t": plan.created, "epoch": plan.epoch, "reason": plan.reason, "fault": is_incident}
        )
        await d.etcd.put_json(d.keys.incidents, incidents[-MAX_INCIDENTS:])


def lost_hosts(plan_hosts: tuple[str, ...], live_hosts: set[str]) -> list[str]:
    """Hosts that hold ranks in the plan but are no longer registered, in rank order."""
    return list(dict.fromkeys(h for h in plan_hosts if h not in live_hosts))
