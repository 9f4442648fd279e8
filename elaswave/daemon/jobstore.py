"""One job's keys in etcd, as its leader's planner reads and writes them.

:class:`JobStore` is a small typed facade over a job's :class:`~elaswave.keys.JobKeys`: the
election key, the plan (read, and published with a compare-and-set that only the current leader
can win), the ready workers and the departures of the others, the committed progress, the hosts'
shared compute times and layer costs, the incident list, fault requests and the job's end (done,
or stopped by the leader). It holds an :class:`~elaswave.daemon.etcd.Etcd` client and the key
names, nothing of a daemon.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from elaswave.daemon.aio import wait_for
from elaswave.daemon.etcd import Etcd, WatchEvent
from elaswave.faults import FaultSpec
from elaswave.keys import JobKeys
from elaswave.planning import planwire
from elaswave.planning.plan import Member, Plan
from elaswave.planning.plandelta import apply_delta, delta_epochs, encode_delta
from elaswave.wire import WireError
from elaswave.wire_etcd import (
    Done,
    EvictRequest,
    HangBounds,
    HostInfo,
    Incident,
    Incidents,
    JobStop,
    LayerCostsReport,
    MemoryReport,
    Progress,
    Speeds,
    TrainedConfig,
    WorkerInfo,
    decode,
    decode_entries,
    decode_or_log,
    encode,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerRecord:
    """A ready worker's key (it lives under its host's lease), as its daemon registered it."""

    worker_id: str
    host: str
    order: int  # the key's create revision: workers that became ready earlier come first
    layer_seconds: list[float] | None = None  # pipelines: its start-up profile, per layer
    layer_estimate: list[float] | None = None  # pipelines: the workload's estimate, per layer
    layer_bytes: list[float] | None = None  # pipelines: what a stage holds per layer
    rack: str = ""  # its host's rack (``launch --rack``)

    @property
    def member(self) -> Member:
        return Member(worker_id=self.worker_id, host=self.host, order=self.order, rack=self.rack)

    @classmethod
    def parse(cls, value: bytes, create_revision: int) -> WorkerRecord:
        """The record of a worker key's value; :class:`WireError` when it is malformed."""
        info = decode(WorkerInfo, value)
        return cls(
            worker_id=info.worker_id,
            host=info.host,
            order=create_revision,
            layer_seconds=info.layer_seconds or None,
            layer_estimate=info.layer_estimate or None,
            layer_bytes=info.layer_bytes or None,
            rack=info.rack or "",
        )


class Change(enum.Enum):
    """What moved under a job's prefix, as far as planning cares."""

    DONE = "done"  # the done key was written or removed
    HOST_GONE = "host_gone"  # a host key vanished: its lease expired, or the host left
    MEMBERSHIP = "membership"  # a worker key came or went, or a departure was recorded
    SPEED = "speed"  # a host shared its workers' compute times
    SPEED_GONE = "speed_gone"  # a host's compute times went (with its lease)
    EVICT = "evict"  # a replay found a worker miscomputing: plan without it


@dataclass(frozen=True)
class JobChange:
    kind: Change
    host: str = ""  # HOST_GONE, SPEED, SPEED_GONE: which host
    speeds: Speeds | None = None  # SPEED: the host's workers' compute times
    worker: WorkerRecord | None = None  # MEMBERSHIP: a worker key written (registered)
    gone: str = ""  # MEMBERSHIP: the worker whose key was deleted
    evicting: str = ""  # EVICT: the worker to evict
    evict: EvictRequest | None = None  # EVICT: who found it and why
    revision: int = 0  # the change's etcd revision


@dataclass(frozen=True)
class Claim:
    """A bid for the leader key: won, or who holds it (and the revision it was written at)."""

    won: bool
    holder: str | None = None
    revision: int = 0

    def __bool__(self) -> bool:
        return self.won


class PlanError(ValueError):
    """A plan in etcd that does not decode (the daemon never trusts what it reads there)."""


def decode_plan(value: bytes) -> Plan | PlanError:
    """The plan a value of the plan key holds, or why it holds none."""
    try:
        return planwire.decode(value)
    except (ValueError, KeyError, TypeError) as exc:
        return PlanError(f"malformed plan ({type(exc).__name__})")


class JobStore:
    """A job's keys in etcd, read and written with typed values."""

    def __init__(self, etcd: Etcd, keys: JobKeys) -> None:
        self.etcd = etcd
        self.keys = keys

    async def revision(self) -> int:
        """The store's current revision (a watch from the one after misses nothing)."""
        return await self.etcd.revision()

    # ---- the election -------------------------------------------------------------------------
    async def claim_leader(self, host_id: str, *, lease: Any) -> Claim:
        """Create the leader key for ``host_id`` under ``lease``; if someone holds it, who and
        since which revision (one round trip: when a leader dies every host claims at once)."""
        won, kv = await self.etcd.create_or_get(self.keys.leader, host_id, lease=lease)
        if won or kv is None:
            return Claim(won)
        return Claim(False, kv.value.decode(), kv.mod_revision)

    async def leader(self) -> str | None:
        """The host the leader key names (None: nobody leads)."""
        kv = await self.etcd.get(self.keys.leader)
        return kv.value.decode() if kv is not None else None

    async def await_succession(
        self, *, since: int = 0, patience: Callable[[], float] = lambda: 0.0
    ) -> None:
        """Until this host's turn to claim the leader key: the key is gone and nobody took it
        within ``patience()`` seconds (at once if nobody leads). ``since``: a revision at which
        the key was there (a lost claim's), else it is read. One watch throughout: a key taken
        meanwhile is followed to its next deletion."""
        key = self.keys.leader
        if not since:
            since = await self.etcd.revision()
            if await self.etcd.get(key) is None:
                return
        events = self.etcd.watch_prefix(key, start_revision=since + 1)
        gone = False
        try:
            while True:
                try:
                    ev = await wait_for(anext(events), patience() if gone else None)
                except asyncio.TimeoutError:
                    return  # gone, and nobody before this host took it
                if ev.key == key:
                    gone = ev.kind == "delete"
        finally:
            await events.aclose()

    # ---- the plan -----------------------------------------------------------------------------
    async def read_plan(self) -> tuple[Plan | None, int]:
        """The current plan and its key's mod revision ((None, 0): no plan yet)."""
        kv = await self.etcd.get(self.keys.plan)
        if kv is None:
            return None, 0
        return planwire.decode(kv.value), kv.mod_revision

    async def publish_plan(
        self, plan: Plan, *, mod_revision: int, leader: str, base: Plan | None = None
    ) -> bool:
        """Put ``plan`` only if the plan key's mod revision is still ``mod_revision`` (0: no
        plan yet) and the leader key still names ``leader``; with it, in the same transaction,
        the plan as a change to ``base`` (the plan it follows) for the hosts to follow. True if
        this write landed, also when its answer was lost (the etcd member went away after
        applying it and the retry's compare failed): that write is recognised in etcd's
        history."""
        data = planwire.encode(plan)
        if await self.etcd.compare_and_put(
            self.keys.plan,
            data,
            mod_revision=mod_revision,
            holder=(self.keys.leader, leader),
            also={self.keys.delta: encode_delta(base, plan)},
        ):
            return True
        landed = await self.etcd.first_put_after(self.keys.plan, mod_revision)
        return landed is not None and landed.decode() == data

    # ---- membership: what a host's daemon writes --------------------------------------------
    async def register_host(self, info: HostInfo, *, lease: Any) -> bool:
        """Create this host's key under its lease; False if a live host holds that id."""
        return await self.etcd.create(self.keys.host(info.host), encode(info), lease=lease)

    async def register_worker(self, info: WorkerInfo, *, lease: Any) -> None:
        """A ready worker's key (its id, host, costs), under the host lease."""
        await self.etcd.put(self.keys.worker(info.worker_id), encode(info), lease=lease)

    async def remove_worker(self, worker_id: str) -> None:
        """A worker this host stopped on purpose (fenced, evicted): its key goes, no departure."""
        await self.etcd.delete(self.keys.worker(worker_id))

    async def record_departure(
        self, worker_id: str, reason: str, *, lease: Any, successor: WorkerInfo | None = None
    ) -> None:
        """A worker left: why (read once by the leader), and its key removed, in one write;
        with a ``successor`` (a warm spare that takes its place) that worker's key in the same
        write, so that the leader plans the departure and the spare together."""
        keys = self.keys
        also = ((keys.worker(successor.worker_id), encode(successor)),) if successor else ()
        await self.etcd.put_and_delete(
            keys.departures + worker_id, reason, keys.worker(worker_id), lease=lease, also=also
        )

    async def plans(self, held: Callable[[], Plan | None]) -> AsyncIterator[Plan | PlanError]:
        """What a host follows: the plan now (if any), then every newer plan as it is
        published. A host that holds (``held()``) the plan a new one follows applies the small
        delta it watches; any other reads the whole plan. A plan that does not decode comes as
        a :class:`PlanError` (the daemon records it and goes on)."""
        rev = await self.etcd.revision()
        kv = await self.etcd.get(self.keys.plan)
        if kv is not None:
            yield self.decode(kv.value)
        async for ev in self.etcd.watch_prefix(self.keys.delta, start_revision=rev + 1):
            if ev.key != self.keys.delta or ev.kind != "put":
                continue
            mine = held()
            plan: Plan | PlanError | None = None
            try:
                base, epoch = delta_epochs(ev.value)
                if mine is not None and mine.epoch >= epoch:
                    continue  # read whole already (this host was behind)
                if mine is not None and mine.epoch == base:
                    plan = apply_delta(mine, ev.value)
            except Exception:  # noqa: BLE001 - a delta that does not apply: the whole plan
                plan = None
            if plan is None:
                kv = await self.etcd.get(self.keys.plan)
                if kv is None:
                    continue
                plan = self.decode(kv.value)
            yield plan

    def decode(self, value: bytes) -> Plan | PlanError:
        """A whole plan as read from the plan key."""
        return decode_plan(value)

    # ---- membership: what the leader reads ----------------------------------------------------
    async def live_hosts(self) -> set[str]:
        """The hosts registered now (their keys live under their leases)."""
        hosts = self.keys.hosts
        return {kv.key.removeprefix(hosts) for kv in await self.etcd.get_prefix(hosts)}

    async def workers(self) -> list[WorkerRecord]:
        """The ready workers' keys, in key order."""
        return (await self.workers_at())[0]

    async def workers_at(self) -> tuple[list[WorkerRecord], int]:
        """The ready workers' keys, in key order, and the revision they were read at (the
        leader keeps the list from there by watching the changes after it)."""
        kvs, revision = await self.etcd.get_prefix_at(self.keys.workers)
        records = []
        for kv in kvs:
            try:
                records.append(WorkerRecord.parse(kv.value, kv.create_revision))
            except WireError as exc:
                log.error("ignoring worker key %s: %s", kv.key, exc)
        return records, revision

    async def take_departures(self) -> tuple[list[str], int, int]:
        """Why workers left since the last call (each departure is read once, then deleted),
        the newest departure's revision (0: none): its worker's key was deleted in that same
        revision, and the revision the departures were read at: every worker key deleted by
        then with a departure had its reason in this read or an earlier one."""
        reasons, newest = [], 0
        kvs, read_at = await self.etcd.get_prefix_at(self.keys.departures)
        for kv in kvs:
            reasons.append(kv.value.decode())
            newest = max(newest, kv.mod_revision)
            await self.etcd.delete(kv.key)
        return reasons, newest, read_at

    # ---- progress, measurements ---------------------------------------------------------------
    async def committed_step(self) -> int:
        """The job's newest committed step as its progress record says (0: none yet)."""
        progress = await self.progress()
        return progress.step if progress is not None else 0

    async def progress(self) -> Progress | None:
        """The job's progress record (its newest committed step, that step's epoch, ...);
        None without one, or with one that does not decode (logged)."""
        kv = await self.etcd.get(self.keys.progress)
        if kv is None:
            return None
        return decode_or_log(Progress, kv.value, ignoring="the job's progress record")

    async def clear_but_records(self) -> None:
        """The last host out: remove the job's keys but its records (the progress record and
        what it trained), which a later launch of the job id resumes from or is refused by."""
        kept = [(key, await self.etcd.get(key)) for key in (self.keys.progress, self.keys.config)]
        await self.etcd.delete_prefix(self.keys.prefix)
        for key, kv in kept:
            if kv is not None:
                await self.etcd.put(key, kv.value)

    async def trained(self) -> dict[str, Any] | None:
        """What the job trains, as its first host published it (None: no record, or one that
        does not decode: logged)."""
        kv = await self.etcd.get(self.keys.config)
        if kv is None:
            return None
        trained = decode_or_log(TrainedConfig, kv.value, ignoring="the job's config record")
        return trained.config if trained is not None else None

    async def seed_progress(self, step: int, epoch: int, reason: str) -> None:
        """A relaunched job's progress as its earlier runs recorded it: the steps up to ``step``
        are recorded already (trained again, they are not recorded twice), and its plans come
        after ``epoch``."""
        record = Progress(step=step, epoch=epoch, relaunched=reason, time=time.time())
        await self.etcd.put(self.keys.progress, encode(record))

    async def share_speeds(self, host_id: str, speeds: Speeds, *, lease: Any) -> None:
        """A host's workers' compute seconds per micro-batch."""
        await self.etcd.put(self.keys.speed + host_id, encode(speeds), lease=lease)

    async def request_eviction(self, worker: str, request: EvictRequest) -> None:
        """A replay found ``worker`` miscomputing: the leader plans without it. No lease: the
        request outlives the host that made it (the job's keys go at its end)."""
        await self.etcd.put(self.keys.evict + worker, encode(request))

    async def eviction_requests(self) -> dict[str, EvictRequest]:
        """Every eviction request recorded so far (a leader that takes over reads them once);
        a malformed one is skipped (logged)."""
        out: dict[str, EvictRequest] = {}
        for kv in await self.etcd.get_prefix(self.keys.evict):
            try:
                out[kv.key.removeprefix(self.keys.evict)] = decode(EvictRequest, kv.value)
            except WireError as exc:
                log.error("ignoring %s: %s", kv.key, exc)
        return out

    async def share_layer_costs(self, host_id: str, costs: LayerCostsReport, *, lease: Any) -> None:
        """A host's workers' measured seconds per layer."""
        await self.etcd.put(self.keys.costs + host_id, encode(costs), lease=lease)

    async def share_memory(self, host_id: str, memory: MemoryReport, *, lease: Any) -> None:
        """A host's workers' bytes by purpose (what ``status`` shows per rank)."""
        await self.etcd.put(self.keys.memory + host_id, encode(memory), lease=lease)

    async def share_hang_bounds(self, host_id: str, bounds: HangBounds, *, lease: Any) -> None:
        """A host's hang detector's bounds now (what ``status`` shows)."""
        await self.etcd.put(self.keys.hang + host_id, encode(bounds), lease=lease)

    async def online_costs(self, live: set[str]) -> list[dict[str, float]]:
        """The newest per-layer seconds every worker in ``live`` measured while training, as its
        host shared them; a malformed entry is skipped (logged), the host's others are kept."""
        out: list[dict[str, float]] = []
        for kv in await self.etcd.get_prefix(self.keys.costs):
            try:
                report, errors = decode_entries(LayerCostsReport, kv.value)
            except WireError as exc:
                errors, report = [str(exc)], LayerCostsReport({})
            for error in errors:
                log.error("ignoring layer costs in %s: %s", kv.key, error)
            out.extend(c.layer_seconds for wid, c in report.workers.items() if wid in live)
        return out

    # ---- the job's record and its end ---------------------------------------------------------
    async def record_incident(self, incident: Incident, *, keep: int) -> None:
        """Append ``incident`` to the job's incident list, keeping the newest ``keep``."""
        kv = await self.etcd.get(self.keys.incidents)
        incidents: list[Incident] = []
        if kv is not None:
            try:
                incidents = decode(Incidents, kv.value).incidents
            except WireError as exc:  # the list starts over
                log.error("replacing the job's incident list: %s", exc)
        incidents.append(incident)
        await self.etcd.put(self.keys.incidents, encode(Incidents(incidents[-keep:])))

    async def submit_fault(self, fault: FaultSpec) -> str:
        """Request ``fault`` (as ``inject-fault`` does); its request id."""
        fault_id = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
        await self.etcd.put_json(self.keys.fault(fault_id), fault.to_dict())
        return fault_id

    async def is_done(self) -> bool:
        """Whether the job has committed its last step."""
        return await self.etcd.get(self.keys.done) is not None

    async def stop_job(self, reason: str) -> None:
        """The leader's verdict that ends the whole job: every host stops."""
        await self.etcd.put(self.keys.stop, encode(JobStop(reason=reason, t=time.time())))

    async def finish_job(self, step: int) -> None:
        """The job committed its last ``step``: every host finishes."""
        await self.etcd.put(self.keys.done, encode(Done(step=step, t=time.time())))

    # ---- changes ------------------------------------------------------------------------------
    async def changes(self, start_revision: int) -> AsyncIterator[JobChange]:
        """What planning reacts to under the job's prefix, from ``start_revision`` on: the done
        key, hosts that vanish, worker keys and new departures, the hosts' compute times.
        Anything else (the plan itself, progress, requests) is skipped; a value that does not
        decode is logged and skipped."""
        table = self.change_table
        async for ev in self.etcd.watch_prefix(self.keys.prefix, start_revision=start_revision):
            for prefix, change_of in table.items():
                if ev.key.startswith(prefix):
                    try:
                        change = change_of(ev, ev.key.removeprefix(prefix))
                    except WireError as exc:
                        log.error("ignoring %s: %s", ev.key, exc)
                        change = None
                    if change is not None:
                        yield change
                    break

    @property
    def change_table(self) -> dict[str, Callable[[WatchEvent, str], JobChange | None]]:
        """What an event under each key (by prefix) means to planning; the rest of the key
        names the host or worker."""
        k = self.keys
        return {
            k.done: _done_change,
            k.hosts: _host_change,
            k.workers: _worker_change,
            k.departures: _departure_change,
            k.speed: _speed_change,
            k.evict: _evict_change,
        }


def _done_change(ev: WatchEvent, rest: str) -> JobChange | None:
    return JobChange(Change.DONE, revision=ev.mod_revision) if not rest else None


def _host_change(ev: WatchEvent, host: str) -> JobChange | None:
    if ev.kind != "delete":
        return None
    return JobChange(Change.HOST_GONE, host=host, revision=ev.mod_revision)


def _worker_change(ev: WatchEvent, worker: str) -> JobChange:
    if ev.kind == "put":
        record = WorkerRecord.parse(ev.value, ev.create_revision)
        return JobChange(Change.MEMBERSHIP, worker=record, revision=ev.mod_revision)
    return JobChange(Change.MEMBERSHIP, gone=worker, revision=ev.mod_revision)


def _departure_change(ev: WatchEvent, worker: str) -> JobChange | None:
    return JobChange(Change.MEMBERSHIP, revision=ev.mod_revision) if ev.kind == "put" else None


def _evict_change(ev: WatchEvent, worker: str) -> JobChange | None:
    if ev.kind != "put":
        return None
    request = decode(EvictRequest, ev.value)
    return JobChange(Change.EVICT, evicting=worker, evict=request, revision=ev.mod_revision)


def _speed_change(ev: WatchEvent, host: str) -> JobChange:
    if ev.kind == "put":
        speeds = decode(Speeds, ev.value)
        return JobChange(Change.SPEED, host=host, speeds=speeds, revision=ev.mod_revision)
    return JobChange(Change.SPEED_GONE, host=host, revision=ev.mod_revision)
