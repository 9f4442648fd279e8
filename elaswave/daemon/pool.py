"""A host's worker processes, one per device slot, as its daemon supervises them.

Every exit becomes an event and a departure in etcd within milliseconds (queued in the outbox: with
etcd away it lands, and is planned for, once etcd answers) and, within the restart budget, a new
worker in the same slot. Workers a newer plan dropped are fenced (killed and replaced by new ones
that join like any newcomer); workers the leader evicted are stopped for good.

Warm spares (``elastic.spares``) live in the same table, flagged: forked ahead, built as far as
they can be without a slot, never registered with the leader. A lost worker's place goes to a
waiting spare when :func:`~elaswave.planning.verdicts.replacement_verdict` says so: the spare
takes the dead worker's slot, and a spare that is built is registered in the very etcd write that
records the departure, so the leader's next plan replaces the one by the other. A new spare is
started in its stead. A spare that dies while it waits is not replaced (a respawn remains).

The pool owns the host's :class:`~elaswave.daemon.workers.WorkerProc` table; it reads what else it
needs of its daemon through :class:`PoolHost` and sets the ``finished`` event it is given once
every worker process has exited.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from elaswave import wire
from elaswave.config.cluster import preempt_signum
from elaswave.daemon.stacks import discard_unused
from elaswave.daemon.template import Adopted
from elaswave.daemon.workers import WorkerProc, spare_id, spawn, stop_all, worker_id
from elaswave.errors import EXIT_PREEMPTED
from elaswave.planning.verdicts import replacement_verdict
from elaswave.runtime.device import spare_builds_ahead
from elaswave.wire_etcd import WorkerInfo

if TYPE_CHECKING:
    from pathlib import Path

    from elaswave.config import JobConfig
    from elaswave.daemon.control_server import WorkerConn
    from elaswave.daemon.jobstore import JobStore
    from elaswave.daemon.outbox import Outbox
    from elaswave.daemon.template import Template
    from elaswave.events import EventLog
    from elaswave.planning.plan import Plan


class PoolHost(Protocol):
    """What the pool reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def host_id(self) -> str: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def control_path(self) -> str:
        """The control socket a spawned worker connects to."""

    @property
    def template(self) -> Template | None:
        """Forks this host's workers (None: they are executed)."""

    @property
    def events(self) -> EventLog: ...
    @property
    def outbox(self) -> Outbox: ...
    @property
    def jobstore(self) -> JobStore: ...
    @property
    def plan(self) -> Plan | None: ...
    @property
    def lease(self) -> Any: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def unrecoverable(self) -> str | None: ...
    @property
    def conns(self) -> Mapping[str, WorkerConn]: ...


class WorkerPool:
    def __init__(self, host: PoolHost, *, finished: asyncio.Event) -> None:
        self.host = host
        self.finished = finished  # set once every worker process of this host has exited
        self.workers: dict[str, WorkerProc] = {}  # this host's workers, by worker id
        self.restarts_used = 0
        self.replacing = 0  # fenced workers whose replacements are being spawned
        self.expecting: dict[str, asyncio.Event] = {}  # worker ids being spawned
        self.spares_started = 0  # warm spares started so far (the next one's number)
        self.preempted = False  # this host is preempted: a worker lost now is a departure
        self._spare_tasks: set[asyncio.Task[None]] = set()  # new spares being started

    @property
    def next_incarnation(self) -> int:
        """The first worker incarnation a replacement may use (fresh worker ids)."""
        return 1 + max((w.incarnation for w in self.workers.values()), default=-1)

    async def spawn(self, slot: int, incarnation: int, *, spare: str | None = None) -> WorkerProc:
        d = self.host
        # A forked worker may say hello before the template's answer reaches us: the daemon
        # holds its hello until the worker is registered (see ``registered``).
        wid = spare or worker_id(d.host_id, slot, incarnation)
        self.expecting[wid] = asyncio.Event()
        try:
            w = await self._spawn(slot, incarnation, spare=spare)
        finally:
            self.expecting.pop(wid).set()
        if d.stopping:  # this host stopped while the worker was being made: it never joins
            await stop_all([w], d.cfg.timeouts.shutdown_grace)
        return w

    async def registered(self, wid: str) -> None:
        """Return once worker ``wid``, if it is being spawned, is registered."""
        pending = self.expecting.get(wid)
        if pending is not None:
            await pending.wait()

    async def spawn_spare(self) -> WorkerProc:
        """Start one warm spare (no slot until it is activated)."""
        sid = spare_id(self.host.host_id, self.spares_started)
        self.spares_started += 1
        return await self.spawn(-1, 0, spare=sid)

    def waiting_spare(self) -> WorkerProc | None:
        """A spare that can take a place now: built ahead and ready, or, where spares build
        only once activated (an accelerator, a script), connected and configured."""
        d = self.host
        ahead = spare_builds_ahead(d.cfg.train.device, script=d.cfg.script is not None)
        for w in self.workers.values():
            if not w.spare or w.stopping or w.proc.returncode is not None:
                continue
            if w.ready if ahead else w.worker_id in d.conns:
                return w
        return None

    def _activate(self, spare: WorkerProc, dead: WorkerProc) -> WorkerInfo | None:
        """``spare`` takes ``dead``'s slot; returns its registration when it is built (else it
        registers when it reports ready, as a newcomer does)."""
        d = self.host
        spare.spare = False
        spare.slot, spare.incarnation = dead.slot, dead.incarnation + 1
        if spare.info is not None:
            spare.info = dataclasses.replace(spare.info, slot=dead.slot)
        d.conns[spare.worker_id].send(wire.Activate(slot=dead.slot, replaces=dead.worker_id))
        d.events.emit(
            "spare_activated", host=d.host_id, worker=spare.worker_id, replaces=dead.worker_id,
            slot=dead.slot, registered=spare.info is not None,
        )  # fmt: skip
        return spare.info

    async def _replace_spare(self) -> None:
        """A new spare in place of one that was activated."""
        try:
            if not self.host.stopping:
                await self.spawn_spare()
        finally:
            self.replacing -= 1
            self.check_finished()

    async def _spawn(self, slot: int, incarnation: int, *, spare: str | None) -> WorkerProc:
        d = self.host
        w = await spawn(
            host_id=d.host_id,
            slot=slot,
            incarnation=incarnation,
            control_path=d.control_path,
            log_dir=d.run_dir / "logs",
            device=d.cfg.train.device,
            template=d.template,
            timeout=d.cfg.timeouts.template,
            shield=preempt_signum(d.cfg.elastic.preempt_signal),
            spare=spare,
        )
        self.workers[w.worker_id] = w
        w.waiter = asyncio.create_task(self._watch_exit(w))
        d.events.emit(
            "worker_spawned",
            host=d.host_id,
            worker=w.worker_id,
            pid=w.pid,
            incarnation=incarnation,
            forked=isinstance(w.proc, Adopted),  # from the template; else executed
            spare=w.spare,
        )
        return w

    async def _watch_exit(self, w: WorkerProc) -> None:
        d = self.host
        w.exit_code = await w.proc.wait()
        discard_unused(w)  # its stacks file, unless it wrote its stacks (killed as hung)
        # finished, stopped by us, or checkpointed and left for a preemption (every rank of the
        # job leaves with it): no departure, no respawn. A worker lost while its host is
        # preempted is a departure (the survivors need a plan without it to reach the step that
        # checkpoints), never respawned; so is one that left before it joined (it held nothing).
        left = w.exit_code == EXIT_PREEMPTED and not w.unjoined
        if w.done or w.stopping or left or (d.stopping and not self.preempted):
            self.check_finished()
            return
        if w.spare:  # it never had a place: nothing to record or plan, and no new spare
            d.events.emit("spare_exit", host=d.host_id, worker=w.worker_id, pid=w.pid,
                          exit_code=w.exit_code, reason=w.describe_exit())  # fmt: skip
            self.check_finished()
            return
        if w.detect_delay:  # a fault that asks for a slow detector: the survivors meanwhile
            await asyncio.sleep(w.detect_delay)  # meet the dead peer in the transport alone
        rank = d.plan.rank_of(w.worker_id) if d.plan else None
        reason = f"worker {w.worker_id} (rank {rank}) {w.describe_exit()}"
        if not w.unjoined:  # one that left a preemption holding nothing is no incident
            d.events.emit(
                "worker_exit",
                host=d.host_id,
                worker=w.worker_id,
                rank=rank,
                pid=w.pid,
                exit_code=w.exit_code,
                reason=reason,
            )
        spare = self.waiting_spare()
        verdict = replacement_verdict(
            w.exit_code,
            self.restarts_used,
            d.cfg.elastic.max_restarts,
            unrecoverable=d.unrecoverable,
            spare_waiting=spare is not None,
        )
        if d.stopping:
            verdict = None
        successor = None
        if verdict == "spare":
            assert spare is not None
            successor = self._activate(spare, w)
        # Queued: with etcd away, the departure lands (and is planned for) once it answers.
        d.outbox.put(
            f"departure of {w.worker_id}",
            lambda: d.jobstore.record_departure(
                w.worker_id, reason, lease=d.lease, successor=successor
            ),
        )
        if verdict == "spare":
            self.restarts_used += 1
            self.replacing += 1
            task = asyncio.create_task(self._replace_spare(), name="new spare")
            self._spare_tasks.add(task)
            task.add_done_callback(self._spare_tasks.discard)
        elif verdict == "respawn":
            self.restarts_used += 1
            nw = await self.spawn(w.slot, w.incarnation + 1)
            d.events.emit(
                "worker_respawned", host=d.host_id, worker=nw.worker_id, replaces=w.worker_id
            )
        self.check_finished()

    def drained(self) -> list[str]:
        """The evicted workers, when each slot's newest worker was evicted (the host has
        nothing left to run); empty otherwise."""
        newest: dict[int, WorkerProc] = {}
        for w in self.workers.values():
            if not w.spare and (w.slot not in newest or w.incarnation > newest[w.slot].incarnation):
                newest[w.slot] = w
        if newest and all(w.evicted for w in newest.values()):
            return sorted(w.worker_id for w in newest.values())
        return []

    def check_finished(self) -> None:
        """This host is finished once every worker process has exited (standbys are told to stop
        by :meth:`stop_unfinished` when the job commits its last step)."""
        if not self.replacing and all(w.proc.returncode is not None for w in self.workers.values()):
            self.finished.set()

    def fence(self, workers: list[WorkerProc], plan: Plan) -> None:
        """A newer plan dropped these live workers (their host was cut off, or paused, and the
        others moved on): their state is stale. They are SIGKILLed and replaced by new workers
        (new ids) that join like any newcomer."""
        d = self.host
        pids = []
        for w in workers:
            w.stopping = True  # its exit is ours: no departure, no respawn
            pids.append(w.pid)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
        d.events.emit(
            "host_fenced",
            host=d.host_id,
            reason=f"plan epoch {plan.epoch} dropped {len(workers)} live worker(s): {plan.reason}",
            killed=pids,
            workers=[w.worker_id for w in workers],
            epoch=plan.epoch,
        )
        for w in workers:  # gone with an expired lease, as a rule; if not, gone now
            gone = functools.partial(d.jobstore.remove_worker, w.worker_id)
            d.outbox.put(f"fenced {w.worker_id}", gone)
        self.replacing += 1
        asyncio.create_task(self._replace(workers))

    async def _replace(self, workers: list[WorkerProc]) -> None:
        try:
            for w in workers:
                if w.waiter is not None:
                    await asyncio.wait([w.waiter])
            incarnation = self.next_incarnation
            if not self.host.stopping:
                for w in workers:
                    await self.spawn(w.slot, incarnation)
        finally:
            self.replacing -= 1
            self.check_finished()

    def evict(self, wid: str, plan: Plan) -> None:
        """Stop a worker the leader evicted (too slow): cleanly, and without a respawn."""
        d = self.host
        w = self.workers.get(wid)
        if w is None or w.stopping or w.proc.returncode is not None:
            return
        d.events.emit(
            "worker_evicted", host=d.host_id, worker=wid, epoch=plan.epoch, reason=plan.reason
        )
        w.evicted = True
        self._ask_to_stop(w)
        d.outbox.put(f"eviction of {wid}", lambda: d.jobstore.remove_worker(wid))

    def stop_unfinished(self) -> None:
        """The job is done: whoever has not finished (a standby, a late joiner) has nothing left
        to do and is told to stop."""
        for w in self.workers.values():
            if w.proc.returncode is None and not w.done:
                self._ask_to_stop(w)
        self.check_finished()

    def _ask_to_stop(self, w: WorkerProc) -> None:
        """A clean stop: its exit is not a failure (no departure, no respawn); over its
        connection when it has one, else SIGTERM."""
        w.stopping = True
        conn = self.host.conns.get(w.worker_id)
        if conn is not None:
            conn.send(wire.Stop())
        else:
            w.terminate()
