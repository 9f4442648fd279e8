"""A host's hold on etcd through the control plane's own failures.

Training never waits for the control plane. This module keeps the daemon's side of that promise:

- the lease keep-alive, which is also the probe of etcd: its first failure starts an outage
  (``etcd_unreachable``), its first success after that ends it (``etcd_reachable``, with the
  downtime and the steps trained meanwhile). Nothing is fenced on a lost watch or a missed
  refresh: a host cut off from etcd cannot commit a step the others planned without it;
- the :class:`~elaswave.daemon.outbox.Outbox` of writes that must land once etcd answers;
- :meth:`ControlPlane.resilient`, which runs a watching task again from a fresh read after an
  outage (or after the lease was renewed), so none is lost;
- :meth:`ControlPlane.renew`: a host whose lease expired (etcd away, or the daemon paused, for
  longer than the TTL) registers again in place; the plan decides which of its workers stay;
- the supervision of an embedded etcd: restarted at once on its data directory and ports.

It owns the host lease (:meth:`ControlPlane.new_lease`) and reads what else it needs of its daemon
through :class:`PlaneHost`.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from elaswave.daemon.aio import wait_for
from elaswave.daemon.outbox import Outbox
from elaswave.errors import ElasWaveError, EtcdUnavailable, LeaseExpired
from elaswave.wire_etcd import HostInfo, encode

if TYPE_CHECKING:
    from elaswave.config import JobConfig
    from elaswave.daemon.etcd import Etcd
    from elaswave.daemon.etcd_server import EmbeddedEtcd
    from elaswave.daemon.jobstore import JobStore, PlanError
    from elaswave.daemon.leader import Leadership
    from elaswave.daemon.workers import WorkerProc
    from elaswave.events import EventLog
    from elaswave.keys import JobKeys
    from elaswave.planning.plan import Plan

log = logging.getLogger(__name__)

RETRY_S = 0.2  # how soon a task that lost etcd, or a keep-alive during an outage, tries again
RESTART_TRIES = 3  # failed restarts of an embedded etcd before the job is told FT is off


class PlaneHost(Protocol):
    """What the control plane reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def host_id(self) -> str: ...
    @property
    def keys(self) -> JobKeys: ...
    @property
    def etcd(self) -> Etcd: ...
    @property
    def jobstore(self) -> JobStore: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def leadership(self) -> Leadership:
        """This host's hold on the leader key (it goes with an expired lease)."""

    @property
    def worker_step(self) -> int:
        """The newest step this host's workers have committed."""

    @property
    def workers(self) -> Mapping[str, WorkerProc]: ...

    def host_info(self) -> HostInfo:
        """This host's key's value."""

    def adopt(self, plan: Plan | PlanError) -> None:
        """A plan read from etcd (or why it does not decode), for the daemon to follow."""


class ControlPlane:
    def __init__(self, host: PlaneHost) -> None:
        self.host = host
        self.up = asyncio.Event()  # set while etcd answers
        self.outbox = Outbox(self.up, self.lost)
        self.registered = asyncio.Event()  # set while this host's keys live under its lease
        self.outage_since: float | None = None  # wall clock when etcd stopped answering
        self.outage_step = 0
        self.lease: Any = None  # the host lease its keys live under (a new one after expiry)

    async def new_lease(self) -> Any:
        """A new host lease, the one this host's keys go under from now on (this part owns
        it: joining the job takes the first, an expiry the next)."""
        d = self.host
        self.lease = await d.etcd.lease(d.cfg.timeouts.lease_ttl)
        return self.lease

    def joined(self) -> None:
        """The host registered at start-up: etcd answers, the keys are there."""
        self.up.set()
        self.registered.set()

    # ---- reachability -----------------------------------------------------------------------
    async def keep_alive(self) -> None:
        """Refresh the host lease every TTL/4 (every ``RETRY_S`` during an outage). A refresh
        answered "expired" means etcd dropped this host's keys: it registers again."""
        d = self.host
        interval = max(0.1, d.cfg.timeouts.lease_ttl / 4)
        while True:
            await asyncio.sleep(interval if self.outage_since is None else RETRY_S)
            try:
                try:
                    remaining = await wait_for(d.etcd.refresh_lease(self.lease), interval)
                except LeaseExpired:
                    remaining = 0
                if remaining <= 0 or not self.registered.is_set():
                    await self.renew()
            except (EtcdUnavailable, asyncio.TimeoutError) as exc:
                self.lost(str(exc) or "no answer to a lease refresh")
                continue
            self.back()

    def lost(self, reason: str) -> None:
        """etcd did not answer: the start of an outage (recorded once); every waiter waits."""
        self.up.clear()
        if self.outage_since is not None:
            return
        d = self.host
        self.outage_since, self.outage_step = time.time(), d.worker_step
        log.warning("etcd unreachable (%s); training goes on, fault tolerance waits for it", reason)
        d.events.emit(
            "etcd_unreachable", host=d.host_id, reason=reason[:300], step=self.outage_step
        )

    def back(self) -> None:
        self.up.set()
        if self.outage_since is None:
            return
        d = self.host
        since, self.outage_since = self.outage_since, None
        d.events.emit(
            "etcd_reachable",
            host=d.host_id,
            downtime=round(time.time() - since, 3),
            since=since,
            step=d.worker_step,
            trained=d.worker_step - self.outage_step,
        )
        log.info("etcd answers again after %.1f s", time.time() - since)

    async def resilient(self, body: Callable[[], Awaitable[Any]]) -> Any:
        """Run ``body`` to its end; when etcd stops answering (or refuses this host's expired
        lease), run it again once etcd answers (and the host is registered): ``body`` starts
        with a fresh read of what it watches, so no outage loses a watch."""
        while True:
            try:
                return await body()
            except EtcdUnavailable as exc:
                self.lost(str(exc))
                await asyncio.sleep(RETRY_S)
                await self.up.wait()
            except LeaseExpired:  # before the keep-alive noticed: it registers again first
                self.registered.clear()
                await asyncio.sleep(RETRY_S)
                await self.registered.wait()

    # ---- membership -------------------------------------------------------------------------
    async def renew(self) -> None:
        """The lease expired: the host, worker and leader keys are gone. Register again in
        place under a new lease. Workers a newer plan dropped meanwhile are fenced by the
        daemon when it adopts that plan; the others' keys come back in one transaction that
        holds only if no plan was published since the plan was read."""
        d = self.host
        self.registered.clear()
        d.leadership.revoke()  # the leader key went with the lease: a planner steps down
        d.events.emit("lease_expired", host=d.host_id, step=d.worker_step)
        await self.new_lease()
        await d.etcd.put(d.keys.host(d.host_id), encode(d.host_info()), lease=self.lease)
        while True:
            kv = await d.etcd.get(d.keys.plan)
            if kv is not None:
                d.adopt(d.jobstore.decode(kv.value))
            live = {
                d.keys.worker(wid): encode(w.info)
                for wid, w in d.workers.items()
                if w.info is not None and w.proc.returncode is None and not w.stopping
            }
            rev = kv.mod_revision if kv is not None else 0
            if await d.etcd.put_all_if(live, key=d.keys.plan, mod_revision=rev, lease=self.lease):
                break
        self.registered.set()
        d.events.emit("host_registered", host=d.host_id, workers=sorted(live))

    # ---- the embedded etcd ------------------------------------------------------------------
    async def supervise_etcd(self, etcd: EmbeddedEtcd) -> None:
        """Restart the embedded ``etcd`` at once if it exits (same data directory and ports:
        keys, revisions and leases survive). After ``RESTART_TRIES`` failed restarts the job
        trains on without fault tolerance, says so once, and the daemon keeps trying, less
        often."""
        d = self.host
        while True:
            await asyncio.sleep(0.1)
            code = etcd.exit_code()
            if code is None:
                continue
            down_at, old_pid = time.time(), etcd.pid
            d.events.emit("etcd_exited", host=d.host_id, pid=old_pid, exit_code=code)
            log.warning("embedded etcd (pid %s) exited with %s; restarting it", old_pid, code)
            tries = 0
            while True:
                tries += 1
                try:
                    etcd.spawn()
                    await asyncio.to_thread(etcd.wait_healthy)
                    break
                except ElasWaveError as exc:
                    etcd.kill()
                    if tries == RESTART_TRIES:
                        d.events.emit("etcd_down", host=d.host_id, reason=str(exc)[:300])
                        print(
                            f"elaswave: the embedded etcd does not come back ({exc}); training "
                            "goes on, fault tolerance is off until etcd returns",
                            file=sys.stderr,
                            flush=True,
                        )
                    await asyncio.sleep(min(30.0, 0.5 * 2**tries))
            d.events.emit(
                "etcd_restarted",
                host=d.host_id,
                pid=etcd.pid,
                old_pid=old_pid,
                downtime=round(time.time() - down_at, 3),
                tries=tries,
            )
