"""How a host daemon takes its part of the job down once it stops, in order and bounded.

Every task but the outbox and the lease's keep-alive is cancelled first, then the workers are
stopped, then the control socket, the rendezvous store and the worker template; the writes still
owed to etcd land (or are given up once etcd cannot take them), and only then do the outbox and
the keep-alive stop and the host lease go. A daemon that hosts the embedded etcd and was not
signalled waits for the other hosts to leave it first; the last host out clears the job's keys
but its records. A watchdog exits the process if all this outlives its bound.

Apart from :mod:`~elaswave.daemon.supervisor`, which decides when to stop: this reads of the
daemon only what it must close (:class:`ShutdownHost`) and decides nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from elaswave.daemon.aio import wait_for
from elaswave.daemon.workers import stop_all
from elaswave.errors import EtcdUnavailable

if TYPE_CHECKING:
    from elaswave.config import JobConfig
    from elaswave.daemon.control_server import ControlServer
    from elaswave.daemon.etcd import Etcd
    from elaswave.daemon.etcd_server import EmbeddedEtcd
    from elaswave.daemon.jobstore import JobStore
    from elaswave.daemon.outbox import Outbox
    from elaswave.daemon.store import StoreProcess
    from elaswave.daemon.template import Template
    from elaswave.daemon.workers import WorkerProc
    from elaswave.keys import JobKeys

log = logging.getLogger(__name__)


class ShutdownHost(Protocol):
    """What the shutdown reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def keys(self) -> JobKeys: ...
    @property
    def etcd(self) -> Etcd | None:
        """None: the daemon never reached etcd."""

    @property
    def jobstore(self) -> JobStore: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def lease(self) -> Any: ...
    @property
    def workers(self) -> Mapping[str, WorkerProc]: ...
    @property
    def control(self) -> ControlServer: ...
    @property
    def store(self) -> StoreProcess | None: ...
    @property
    def template(self) -> Template | None: ...
    @property
    def embedded(self) -> EmbeddedEtcd | None:
        """An etcd this launch started: the other hosts may still need it."""

    @property
    def signal_received(self) -> int | None: ...


async def shut_down(host: ShutdownHost, tasks: list[asyncio.Task[Any]]) -> None:
    """Stop ``tasks`` and what ``host`` started, in order."""
    # Bounded: a shutdown that hangs must not leave the daemon running. The outbox and the
    # keep-alive run on until the writes still owed to etcd have landed (or time is up).
    with shutdown_watchdog(4 * host.cfg.timeouts.shutdown_grace + 30):
        last = {"outbox", "keep-alive"}
        early = [t for t in tasks if t.get_name() not in last]
        for task in early:
            task.cancel()
        if early:
            await asyncio.wait(early, timeout=5.0)
        await stop_all(list(host.workers.values()), host.cfg.timeouts.shutdown_grace)
        # a respawn under way may add a worker meanwhile (the pool stops it: we are stopping)
        for w in list(host.workers.values()):
            if w.waiter is not None:
                with contextlib.suppress(BaseException):
                    await wait_for(w.waiter, 1.0)
        await host.control.stop()
        if host.store is not None:
            await host.store.stop(host.cfg.timeouts.shutdown_grace)
        if host.template is not None:
            await host.template.close(host.cfg.timeouts.shutdown_grace)
        if host.etcd is not None and not await host.outbox.drain(host.cfg.timeouts.etcd_connect):
            # etcd never came back: this host's records are the only ones it knows of
            log.warning("%d etcd write(s) never landed", host.outbox.pending)
            host.outbox.abandon()
        late = [t for t in tasks if t.get_name() in last]
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late, timeout=5.0)
        if host.etcd is not None:
            with contextlib.suppress(Exception):
                if host.lease is not None:
                    await host.lease.revoke()
            if host.embedded is not None and host.signal_received is None:
                await _wait_for_other_hosts(host, host.etcd)  # they still need the etcd we host
            with contextlib.suppress(Exception):  # last one out: no stale keys, but the
                if not await host.etcd.get_prefix(host.keys.hosts):  # job's records
                    await host.jobstore.clear_but_records()
            await host.etcd.close()


async def _wait_for_other_hosts(host: ShutdownHost, etcd: Etcd) -> None:
    deadline = time.monotonic() + 2 * host.cfg.timeouts.shutdown_grace + host.cfg.timeouts.lease_ttl
    while time.monotonic() < deadline:
        try:
            if not await etcd.get_prefix(host.keys.hosts):
                return
        except EtcdUnavailable:
            return
        await asyncio.sleep(0.2)


def _stuck_shutdown() -> None:
    """Last resort: a shutdown that outlives every bounded wait must not leave us running."""
    log.error("shutdown did not finish in time; exiting")
    os._exit(70)


@contextlib.contextmanager
def shutdown_watchdog(
    seconds: float, on_expiry: Callable[[], None] = _stuck_shutdown
) -> Iterator[threading.Timer]:
    """``on_expiry`` (default: exit the process) if the block is still running after ``seconds``."""
    timer = threading.Timer(seconds, on_expiry)
    timer.daemon = True
    timer.start()
    try:
        yield timer
    finally:
        timer.cancel()
