"""The per-host supervisor daemon (asyncio).

It registers its host under an etcd lease, campaigns for leadership, spawns and supervises one
worker per device, relays plans and faults to them over the control channel, turns every worker
exit into an event and a membership change within milliseconds, and writes the run directory.

The control plane's own failures never stop training. Workers never wait on the daemon (their
reports are queued), and the daemon never waits on etcd: what it must write goes through an
:class:`~elaswave.daemon.outbox.Outbox`, and every task that reads or watches etcd runs again from
a fresh read once etcd answers after an outage. A host whose lease expired meanwhile (etcd was
away, or this daemon paused, for longer than the TTL) registers again in place; only a newer plan
that drops its workers fences them (``_adopt``). ``launch`` restarts an embedded etcd that exits.

Its parts live apart: the worker pool (:mod:`~elaswave.daemon.pool`), the hang detector
(:mod:`~elaswave.daemon.hangs`), the compute times shared with the leader
(:mod:`~elaswave.daemon.compute`), the step records (:mod:`~elaswave.daemon.records`) and the
job's event stream hung off them (:mod:`~elaswave.daemon.streams`), the control plane, the fault
relay, the campaign for leader (:mod:`~elaswave.daemon.leader`, on the job's keys through a
:class:`~elaswave.daemon.jobstore.JobStore`), and the ordered, bounded shutdown
(:mod:`~elaswave.daemon.shutdown`). Each part declares what it reads of the daemon as a protocol
of its own (``PoolHost``, ``FaultHost``, ``PlaneHost``, ``EntryHost``, ``ChannelHost``,
``ShutdownHost``), which this class satisfies, and owns what it decides: the pool its workers,
the control plane the host lease, the entry whether the job resumes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.daemon.channel import WorkerChannel
from elaswave.daemon.compute import ComputeTimes
from elaswave.daemon.control_server import ControlServer, WorkerConn
from elaswave.daemon.controlplane import ControlPlane
from elaswave.daemon.entry import JobEntry
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_connect import EtcdSecurity
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.daemon.faultrelay import FaultRelay
from elaswave.daemon.hangs import HangDetector
from elaswave.daemon.jobstore import JobStore, PlanError
from elaswave.daemon.leader import Candidate, Leadership, campaign, succession_turn
from elaswave.daemon.metrics import DaemonMetrics, worker_state
from elaswave.daemon.netns import current_netns
from elaswave.daemon.pool import WorkerPool
from elaswave.daemon.records import StepRecords
from elaswave.daemon.shutdown import shut_down
from elaswave.daemon.store import StoreProcess
from elaswave.daemon.template import Template, TemplateGone
from elaswave.daemon.workers import WorkerProc, describe_exit
from elaswave.errors import (
    ConfigError,
    ElasWaveError,
    EtcdUnavailable,
    HostDrained,
    JobFailed,
    JobPreempted,
    JobStopped,
    RunDirFull,
)
from elaswave.events import EVENTS_FILE, METRICS_FILE, EventLog, JsonlWriter
from elaswave.keys import JobKeys
from elaswave.planning.plan import Plan
from elaswave.planning.relaunch import Records
from elaswave.wire_etcd import HostInfo, JobStop, Progress, decode_or_log

if TYPE_CHECKING:
    from elaswave.daemon.streams import JobStream

log = logging.getLogger(__name__)


def default_host_id() -> str:
    return f"{socket.gethostname().split('.')[0]}-{os.getpid()}"


def host_address_for(etcd_endpoint: str) -> str:
    """The local address peers can reach us on: the one our traffic to etcd leaves from."""
    host = etcd_endpoint.rpartition(":")[0]
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


class HostDaemon:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        etcd_endpoints: list[str],
        host_addr: str | None = None,
        embedded: EmbeddedEtcd | None = None,
        security: EtcdSecurity | None = None,
        template: Template | None = None,
        earlier: Records | None = None,
        moved: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.earlier = earlier  # what an earlier run of this job id left in this run directory
        self.moved = moved  # where --fresh moved it
        self.resuming = False  # a relaunch: the workers start from a durable checkpoint (entry)
        self.endpoints = etcd_endpoints
        self.security = security
        self.host_id = cfg.host_id or default_host_id()
        self.host_addr = host_addr or host_address_for(etcd_endpoints[0])
        self.keys = JobKeys(cfg.job_id)
        self.run_dir = cfg.resolved_run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.write_error: str | None = None  # the first failed write to the run directory
        self.events = EventLog(self.run_dir / EVENTS_FILE, on_error=self._cannot_write)
        self.metrics = JsonlWriter(self.run_dir / METRICS_FILE, on_error=self._cannot_write)
        self.etcd: Etcd = None  # type: ignore[assignment]  # set in run()
        self.jobstore: JobStore = None  # type: ignore[assignment]  # set in run()
        self.records: StepRecords = None  # type: ignore[assignment]  # set in run()
        self.template = template  # forks this host's workers and its store (None: executed)
        self.store: StoreProcess | None = None  # this host's rendezvous store
        self.store_address = ""
        self.store_up = asyncio.Event()  # the store serves: this host may lead (plans name it)
        self.channel = WorkerChannel(self)  # the workers' connections and their messages
        self.control = ControlServer(self.channel.on_message, self.channel.on_disconnect)
        self.plan: Plan | None = None
        self.leadership = Leadership()
        self.stopping = False
        self.finished = asyncio.Event()  # every worker process of this host has exited
        self._tasks: list[asyncio.Task[Any]] = []
        self.signal_received: int | None = None
        self.preempting: int | None = None  # the preemption signal, once it came
        self.embedded = embedded  # an etcd this launch started: restarted if it exits
        self.stopped: str | None = None  # the leader's verdict that ended the job
        self.compute = ComputeTimes()  # the workers' compute times, shared with the leader
        self.hangs = HangDetector(
            setting=cfg.timeouts.hang, heartbeat=cfg.timeouts.heartbeat, run_dir=self.run_dir,
            host_id=self.host_id, emit=self.events.emit,
        )  # fmt: skip
        # spawns, watches, respawns, fences and evicts workers; owns the table of them
        self.pool = WorkerPool(self, finished=self.finished)
        self.faults = FaultRelay(self)  # fault requests from etcd to this host's workers
        self.cp = ControlPlane(self)  # etcd outages, the outbox, the lease, the embedded etcd
        self.entry = JobEntry(self)  # joins the job: starts it, resumes it, or refuses
        self.outbox = self.cp.outbox
        self.prom: DaemonMetrics | None = None  # launch --metrics-port
        self.stream: JobStream | None = None  # logging.tensorboard / wandb: the job's stream
        if cfg.logging.enabled:
            from elaswave.daemon.streams import JobStream  # only a job that logs loads it

            self.stream = JobStream(cfg, host_id=self.host_id, run_dir=self.run_dir)

    # ---- lifecycle --------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until the job ends on this host; returns the process exit code."""
        code = await self._run()
        lost = self.events.unwritten + self.metrics.unwritten
        if lost:
            raise RunDirFull(
                f"{lost} record(s) could not be written to {self.run_dir} ({self.write_error})"
            )
        return code

    def _cannot_write(self, path: Path, exc: OSError) -> None:
        """The run directory refused a write (a full disk, as a rule): one line for the user,
        once; the records wait in memory and are written as soon as a write succeeds again."""
        if self.write_error is not None:
            return
        self.write_error = f"{path.name}: {exc.strerror or exc}"
        print(
            f"elaswave: cannot write to the run directory {self.run_dir} ({self.write_error}); "
            "training goes on, records are kept in memory until space returns",
            file=sys.stderr,
            flush=True,
        )

    async def _run(self) -> int:
        self.etcd = await Etcd.connect(
            self.endpoints,
            prefix=self.keys.prefix,
            timeout=self.cfg.timeouts.etcd_connect,
            security=self.security,
            client=self.host_id,
        )
        self.jobstore = JobStore(self.etcd, self.keys)
        self.records = StepRecords(
            self.etcd, self.keys, self.metrics, outbox=self.outbox,
            host_id=self.host_id, total_steps=self.cfg.train.steps, stream=self.stream,
            planned_hosts=lambda: set(self.plan.hosts) if self.plan else None,
        )  # fmt: skip
        try:
            self.resuming = await self.entry.join()
            self.cp.joined()
            resilient = {
                "leader": self._campaign,
                "plans": self._watch_plans,
                "faults": self.faults.watch,
                "done": self._watch_done,
                "stop": self._watch_stop,
            }
            if self.cfg.metrics_port is not None:
                self._serve_metrics(self.cfg.metrics_port)
                resilient["progress"] = self._watch_progress
            self._tasks = [
                asyncio.create_task(self.cp.keep_alive(), name="keep-alive"),
                asyncio.create_task(self.outbox.run(), name="outbox"),
                *(
                    asyncio.create_task(self.cp.resilient(body), name=name)
                    for name, body in resilient.items()
                ),
                asyncio.create_task(self._detect_hangs(), name="hangs"),
                asyncio.create_task(
                    self.hangs.share(self.jobstore, lease=lambda: self.lease), name="hang-bounds"
                ),
                asyncio.create_task(self._publish_compute(), name="compute"),
            ]
            if self.embedded is not None:
                supervise = self.cp.supervise_etcd(self.embedded)
                self._tasks.append(asyncio.create_task(supervise, name="etcd"))
            await self._preflight()
            if (
                (self.resuming or self.cfg.resume or self.cfg.durable_every)
                and self.template is not None
                and self.template.alive
            ):
                # Every worker will read a checkpoint, or write its pieces of one within
                # durable_every steps: import it once, before the fork, not in each worker at
                # once while the others wait for it at their next collective.
                with contextlib.suppress(TemplateGone):
                    await self.template.warm(self.cfg.timeouts.template)
            self.store = await StoreProcess.start(
                self.host_addr, self.run_dir / "logs" / f"{self.host_id}.store.log",
                template=self.template, timeout=self.cfg.timeouts.template,
            )  # fmt: skip
            self.store_address = self.store.address
            self.events.emit("store_started", host=self.host_id, pid=self.store.pid,
                             address=self.store_address)  # fmt: skip
            self.store_up.set()
            self._tasks.append(asyncio.create_task(self._watch_store(), name="store"))
            for slot in range(self.cfg.elastic.nproc_per_node):
                await self.pool.spawn(slot, 0)
            for _ in range(self.cfg.elastic.spares):  # after the workers: they train first
                await self.pool.spawn_spare()
            waiter = asyncio.create_task(self.finished.wait())
            pending: set[asyncio.Task[Any]] = {waiter, *self._tasks}
            while waiter in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception() if task is not waiter else None
                    if exc is not None:
                        raise exc
            return await self._finish()
        finally:
            await self._cleanup()
            if self.stream is not None:
                self.stream.close()  # after the last records landed (or were written locally)
            if self.prom is not None:
                self.prom.close()
            self.events.close()
            self.metrics.close()

    async def _preflight(self) -> None:
        """The model builds and its data fits (checked in the template, which has torch
        imported; without one, ``launch`` checked before the daemon started)."""
        if self.template is None:
            return
        try:
            error = await self.template.preflight(self.cfg.to_dict(), self.cfg.timeouts.template)
        except TemplateGone as exc:
            log.warning("%s; workers are executed instead", exc)
            return
        self.events.emit(
            "template_ready", host=self.host_id, pid=self.template.pid,
            seconds=self.template.ready_seconds,
        )  # fmt: skip
        if error is not None:
            raise ConfigError(error)

    async def _watch_store(self) -> None:
        """The store is part of this daemon: if its process dies, so does this host's part of
        the job (as when the daemon itself is killed; the other hosts plan without it)."""
        assert self.store is not None
        code = await self.store.proc.wait()
        if not self.stopping:
            raise JobFailed(
                f"this host's rendezvous store (pid {self.store.pid}) {describe_exit(code)}"
            )

    async def _campaign(self) -> None:
        """Stand for leader once this host's store serves (every plan it makes names it)."""
        await self.store_up.wait()
        await campaign(self._candidate())

    def _serve_metrics(self, port: int) -> None:
        """Prometheus ``/metrics`` on ``port`` (0: a free one, printed and recorded)."""
        prom = DaemonMetrics(
            self.cfg.job_id, self.host_id, leading=lambda: self.is_leader,
            workers=self._worker_states,
        )  # fmt: skip
        try:
            bound = prom.serve(port)
        except OSError as exc:
            raise ElasWaveError(f"--metrics-port {port}: cannot serve metrics ({exc})") from None
        self.prom = prom
        url = f"http://{self.host_addr}:{bound}/metrics"
        self.events.emit("metrics_serving", host=self.host_id, port=bound, url=url)
        print(f"elaswave: metrics at {url}", file=sys.stderr, flush=True)

    def _worker_states(self) -> list[str]:
        """This host's workers by state, for the metrics (read from the server's thread)."""
        plan = self.plan
        return [
            worker_state(
                exited=w.proc.returncode is not None,
                ready=w.ready,
                in_plan=plan is not None and wid in plan.workers,
            )  # fmt: skip
            for wid, w in dict(self.workers).items()
        ]

    async def _watch_progress(self) -> None:
        """The job's progress record, every write of it, into the metrics."""
        assert self.prom is not None
        async for value in self.etcd.values(self.keys.progress):
            record = decode_or_log(Progress, value, ignoring="a progress record")
            if record is not None:
                self.prom.progress(record.fields())

    @property
    def worker_step(self) -> int:
        """The newest step this host's workers have committed (their heartbeats say)."""
        return max((w.step for w in self.workers.values()), default=0)

    @property
    def is_leader(self) -> bool:
        return self.leadership.held

    def _leader_stops(self) -> bool:
        """Whether this host stops leading (or standing for leader): when it stops, except that
        a leader keeps leading while a preemption is under way. A fault that interrupted the
        last step still needs a plan without its worker (no respawn joins it), so that the
        survivors redo the step, read the preemption in its tail, checkpoint it and leave
        (:meth:`Engine.leave_preempted`). A preempted host that does not lead never claims."""
        if not self.stopping:
            return False
        return self.preempting is None or not self.leadership.held or self.finished.is_set()

    def _candidate(self) -> Candidate:
        """This host as a candidate for leader (once it joined: its store is up)."""
        return Candidate(
            store=self.jobstore,
            cfg=self.cfg,
            host_id=self.host_id,
            store_address=self.store_address,
            emit=self.events.emit,
            leadership=self.leadership,
            registered=self.cp.registered,
            lease=lambda: self.lease,
            stopping=self._leader_stops,
            turn=lambda: succession_turn(self.host_id, self.plan),
        )

    def _detect_hangs(self) -> Coroutine[Any, Any, None]:
        return self.hangs.watch(
            self.workers, rank_of=lambda wid: self.plan.rank_of(wid) if self.plan else None
        )

    def _publish_compute(self) -> Coroutine[Any, Any, None]:
        return self.compute.publish(
            self.jobstore, self.host_id, lease=lambda: self.lease, alive=self.running
        )

    def running(self) -> set[str]:
        """The workers of this host whose processes have not exited."""
        return {wid for wid, w in self.workers.items() if w.proc.returncode is None}

    def request_preempt(self, signum: int) -> None:
        """The preemption signal (``elastic.preempt_signal``): every worker of this host is
        told, the next step's tail tells every rank of the job, and each checkpoints that step
        and leaves (:meth:`Engine._preempted`). The launch then exits with
        :data:`EXIT_PREEMPTED`; after ``timeouts.preempt_grace`` it stops what is left anyway."""
        if self.preempting is not None:
            return  # the same signal again
        name = signal.Signals(signum).name
        self.preempting, self.signal_received, self.stopping = signum, signum, True
        self.pool.preempted = True
        grace = self.cfg.timeouts.preempt_grace
        self.events.emit("preempt_requested", host=self.host_id, signal=name, grace=grace)
        self.channel.send_all(wire.Preempt(signal=name))
        self._tasks.append(asyncio.create_task(self._preempt_deadline(grace), name="preempt"))

    async def _preempt_deadline(self, grace: float) -> None:
        await asyncio.sleep(grace)
        if not self.finished.is_set():
            self.events.emit("preempt_expired", host=self.host_id, grace=grace)
            self.finished.set()

    def request_stop(self, signum: int) -> None:
        self.signal_received = signum
        self.stopping = True
        self.events.emit(
            "shutdown_requested", host=self.host_id, signal=signal.Signals(signum).name
        )
        self.finished.set()

    def host_info(self) -> HostInfo:
        return HostInfo(
            host=self.host_id,
            addr=self.host_addr,
            pid=os.getpid(),
            nproc=self.cfg.elastic.nproc_per_node,
            run_dir=str(self.run_dir.resolve()),
            netns=current_netns(),
            started=self.entry.joined_at,
        )

    async def _finish(self) -> int:
        if self.channel.preempted is not None:
            step, name = self.channel.preempted
            raise JobPreempted(
                f"job {self.cfg.job_id!r} preempted by {name}: step {step} is checkpointed in "
                f"{self.cfg.resolved_durable_dir}; launch it again to resume"
            )
        if self.preempting is not None and any(w.unjoined for w in self.workers.values()):
            raise JobPreempted(
                f"job {self.cfg.job_id!r} preempted by {signal.Signals(self.preempting).name}: "
                f"host {self.host_id}'s workers had not joined it yet and held no state; launch "
                "it again to resume"
            )
        if self.signal_received is not None:
            return 128 + self.signal_received
        if self.unrecoverable:  # the cause; a loop breaker's stop that followed is its echo
            raise JobFailed(f"job {self.cfg.job_id!r} cannot recover: {self.unrecoverable}")
        if self.stopped is not None:
            raise JobStopped(f"job stopped: {self.stopped}")
        done = [w for w in self.workers.values() if w.done]
        if done:
            step = self.records.final_step
            self.events.emit("job_done", host=self.host_id, step=step)
            prune = self.cfg.train.prune
            below = prune.shortfall(self.records.last_sparsity, last_step=step) if prune else None
            if below is not None and self.records.committed_here:  # rank 0's host says it
                log.warning("%s", below)
            self.outbox.put("done", lambda: self.jobstore.finish_job(step))
            return 0
        done_elsewhere = False
        with contextlib.suppress(EtcdUnavailable):
            done_elsewhere = await self.etcd.get(self.keys.done) is not None
        if done_elsewhere:
            self.events.emit("job_done_elsewhere", host=self.host_id)
            return 0  # the job completed on other hosts before this one was needed
        evicted = self.pool.drained()
        if evicted:  # nothing left to run here: the job goes on without this host
            self.events.emit("host_drained", host=self.host_id, evicted=evicted)
            raise HostDrained(
                f"host {self.host_id} leaves job {self.cfg.job_id!r}: every worker it ran was "
                f"evicted ({', '.join(evicted)}); launch it again to bring its slots back"
            )
        raise JobFailed(
            f"job {self.cfg.job_id!r} failed on host {self.host_id}: every worker was lost"
        )

    async def _cleanup(self) -> None:
        self.stopping = True
        await shut_down(self, self._tasks)

    # ---- what the parts read of the daemon ---------------------------------------------------
    @property
    def workers(self) -> dict[str, WorkerProc]:
        """This host's workers, by worker id (the pool's)."""
        return self.pool.workers

    @property
    def control_path(self) -> str:
        """The control socket this host's workers connect to."""
        return self.control.path

    @property
    def conns(self) -> dict[str, WorkerConn]:
        """The live control connections, by worker."""
        return self.channel.conns

    @property
    def unrecoverable(self) -> str | None:
        """Why a worker said the job cannot go on (the first reason), if one did."""
        return self.channel.unrecoverable

    @property
    def lease(self) -> Any:
        """The host lease this host's keys live under (the control plane's)."""
        return self.cp.lease

    async def new_lease(self) -> Any:
        return await self.cp.new_lease()

    async def registered(self, wid: str) -> None:
        await self.pool.registered(wid)

    def dispatch_faults(self) -> None:
        self.faults.dispatch()

    async def _watch_done(self) -> None:
        """A host whose workers are all standbys finishes when the job does."""
        rev = await self.etcd.revision()
        if await self.etcd.get(self.keys.done) is None:
            async for ev in self.etcd.watch_prefix(self.keys.done, start_revision=rev + 1):
                if ev.key == self.keys.done and ev.kind == "put":
                    break
        self.pool.stop_unfinished()

    async def _watch_stop(self) -> None:
        """The leader's verdict to end the whole job (restart loop): stop everything here."""
        async for value in self.etcd.values(self.keys.stop):
            verdict = decode_or_log(JobStop, value, ignoring="a stop verdict")
            if verdict is not None:
                break
        else:
            return
        self.stopped = verdict.reason
        self.stopping = True  # no respawns; exits from here on are ours
        self.events.emit("job_stopped", host=self.host_id, reason=self.stopped)
        self.finished.set()

    # ---- plans and faults -------------------------------------------------------------------
    async def _watch_plans(self) -> None:
        async for plan in self.jobstore.plans(lambda: self.plan):
            self.adopt(plan)

    def adopt(self, plan: Plan | PlanError) -> None:
        """A plan read from etcd: followed if it is newer, recorded if it does not decode."""
        if isinstance(plan, PlanError):  # JSON only; a bad value is ignored
            log.warning("ignoring a malformed plan in etcd: %s", plan)
            self.events.emit("plan_rejected", reason=str(plan))
            return
        self._adopt(plan)

    def _adopt(self, plan: Plan) -> None:
        if self.plan is not None and plan.epoch <= self.plan.epoch:
            return
        # Dropped: this plan's departures, and (a host that was cut off may skip epochs) the
        # workers of the plan this host ran that are not in this one.
        before = self.plan.workers if self.plan is not None else ()
        gone = dict.fromkeys([*plan.departed, *(wid for wid in before if wid not in plan.workers)])
        self.plan = plan
        if self.prom is not None:
            self.prom.plan(plan)
        if self.stream is not None:
            self.stream.plan(plan)
        dropped = [
            w
            for wid in gone
            if (w := self.workers.get(wid)) is not None
            and wid not in plan.evicted
            and w.proc.returncode is None
            and not w.stopping
        ]
        if dropped:
            self.pool.fence(dropped, plan)  # before the plan reaches them: they must not act on it
        self.channel.send_plan(plan)
        for wid in plan.evicted:
            self.pool.evict(wid, plan)
        self.faults.dispatch()
