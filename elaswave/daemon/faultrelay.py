"""Fault requests from etcd to the workers of this host (``inject-fault`` and ``--fault``).

The daemon never trusts what it reads in etcd: a malformed request is logged, recorded as
``fault_rejected`` and removed. A request names a rank (sent to the worker holding it under the
current plan, or signalled directly) or a host (``host``: that daemon kills its workers and
itself; ``partition``: only a record here, the CLI acts on the network). A repeated fault stays
armed for every worker that holds its rank later. Each request key is taken once, also when the
watch runs again after an etcd outage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from elaswave import wire
from elaswave.daemon.aio import wait_for
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.jobstore import JobStore
from elaswave.errors import ElasWaveError
from elaswave.faults import FaultKind, FaultSpec, decode_request
from elaswave.keys import JobKeys

if TYPE_CHECKING:
    from elaswave.config import JobConfig
    from elaswave.daemon.control_server import WorkerConn
    from elaswave.daemon.outbox import Outbox
    from elaswave.daemon.workers import WorkerProc
    from elaswave.events import EventLog
    from elaswave.planning.plan import Plan

log = logging.getLogger(__name__)


class FaultHost(Protocol):
    """What the fault relay reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def host_id(self) -> str: ...
    @property
    def keys(self) -> JobKeys: ...
    @property
    def etcd(self) -> Etcd: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def plan(self) -> Plan | None: ...
    @property
    def is_leader(self) -> bool: ...
    @property
    def workers(self) -> Mapping[str, WorkerProc]: ...
    @property
    def conns(self) -> Mapping[str, WorkerConn]: ...


class FaultRelay:
    """The daemon's fault requests: read from etcd, checked, and sent where they belong."""

    def __init__(self, host: FaultHost) -> None:
        self.host = host
        self._pending_faults: dict[str, FaultSpec] = {}
        self._repeat_sent: dict[str, set[str]] = {}  # repeat fault key -> workers it went to
        self._seen_faults: set[str] = set()  # fault keys taken (a watch re-read skips them)

    async def watch(self) -> None:
        d = self.host
        rev = await d.etcd.revision()
        for kv in await d.etcd.get_prefix(d.keys.faults):
            self._queue_fault(kv.key, kv.value)
        async for ev in d.etcd.watch_prefix(d.keys.faults, start_revision=rev + 1):
            if ev.kind == "put":
                self._queue_fault(ev.key, ev.value)

    def _queue_fault(self, key: str, value: bytes) -> None:
        """Accept a fault request from etcd only if it is well-formed; anything else is logged,
        removed and ignored (the daemon never trusts what it reads there). Each key is taken
        once: a watch that runs again after an etcd outage re-reads requests already handled."""
        d = self.host
        if key in self._seen_faults:
            return
        self._seen_faults.add(key)
        try:
            self._pending_faults[key] = decode_request(value)
        except ElasWaveError as exc:
            log.warning("ignoring fault request %s: %s", key, exc)
            d.events.emit("fault_rejected", key=key, reason=str(exc))
            if d.is_leader:
                self._delete_request(key)
            return
        self.dispatch()

    def _delete_request(self, key: str) -> None:
        d = self.host
        d.outbox.put("fault request removal", lambda: d.etcd.delete(key))

    def dispatch(self) -> None:
        d = self.host
        if d.plan is None:
            return
        for key, fault in list(self._pending_faults.items()):
            if fault.host is not None:
                del self._pending_faults[key]  # only the target host acts; the others drop it
                if fault.host != d.host_id:
                    # Every other daemon records the request: the report's incident starts at
                    # the first record (the victim's own dies with it, or, cut off, never
                    # reaches anyone; the leader may be the victim).
                    d.events.emit("fault_requested", fault=fault.to_dict(), host=fault.host)
                    if d.is_leader and fault.kind is FaultKind.PARTITION:  # a record only
                        self._delete_request(key)
                if fault.host == d.host_id and fault.kind is FaultKind.HOST:
                    asyncio.create_task(self._die(key, fault))
                continue
            assert fault.rank is not None
            if fault.epoch is not None and d.plan.epoch < fault.epoch:
                continue  # armed later: its rank is resolved in that plan
            if fault.repeat:
                self._dispatch_repeat(key, fault)
                continue
            if fault.rank >= d.plan.world_size:
                if d.is_leader:
                    del self._pending_faults[key]
                    reason = (
                        f"rank {fault.rank} is not in the plan (epoch {d.plan.epoch}: "
                        f"ranks 0..{d.plan.world_size - 1})"
                    )
                    log.warning("ignoring fault request %s: %s", key, reason)
                    d.events.emit("fault_rejected", key=key, fault=fault.to_dict(), reason=reason)
                    self._delete_request(key)
                continue
            target = d.plan.workers[fault.rank]
            w = d.workers.get(target)
            if w is None:
                del self._pending_faults[key]  # another host's worker: its daemon handles it
                continue
            conn = d.conns.get(target)
            needs_worker = fault.at_step is not None or fault.kind.signal is None
            if needs_worker and conn is None:
                continue  # not connected yet: dispatched again on the next plan or ready
            del self._pending_faults[key]
            self._delete_request(key)
            d.events.emit("fault_requested", fault=fault.to_dict(), worker=target, host=d.host_id)
            w.sent(fault.detect_delay)
            if not needs_worker:
                d.events.emit(
                    "fault_injected",
                    fault=fault.to_dict(),
                    worker=target,
                    rank=fault.rank,
                    pid=w.pid,
                )
                sig = fault.kind.signal
                assert sig is not None  # needs_worker is False only for a kind with a signal
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, sig)
            elif conn is not None:
                conn.send(wire.Fault(fault))

    def _dispatch_repeat(self, key: str, fault: FaultSpec) -> None:
        """A repeated fault stays armed: each worker that holds its rank gets it once."""
        d = self.host
        assert d.plan is not None and fault.rank is not None
        if fault.rank >= d.plan.world_size:
            return  # the rank may exist again after a grow
        target = d.plan.workers[fault.rank]
        sent = self._repeat_sent.setdefault(key, set())
        conn = d.conns.get(target)
        if target in sent or target not in d.workers or conn is None:
            return
        sent.add(target)
        d.workers[target].sent(fault.detect_delay)
        d.events.emit("fault_requested", fault=fault.to_dict(), worker=target, host=d.host_id)
        conn.send(wire.Fault(fault))

    async def _die(self, key: str, fault: FaultSpec) -> None:
        """A host fault: SIGKILL every worker and then this daemon. Nothing tidies up after it,
        as with a host that loses power: its lease expires and the leader plans without it."""
        d = self.host
        with contextlib.suppress(Exception):
            await wait_for(d.etcd.delete(key), d.cfg.timeouts.etcd_connect)
        pids = [w.pid for w in d.workers.values() if w.proc.returncode is None]
        d.events.emit(
            "fault_injected", fault=fault.to_dict(), host=d.host_id, pid=os.getpid(), pids=pids
        )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)


async def submit_fault(etcd: Etcd, keys: JobKeys, fault: FaultSpec) -> str:
    """Request ``fault`` in the job of ``keys``; its request id."""
    return await JobStore(etcd, keys).submit_fault(fault)
