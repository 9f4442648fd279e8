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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from elaswave.config import JobConfig
from elaswave.daemon import leader
from elaswave.daemon.control_server import ControlServer, WorkerConn
from elaswave.daemon.controlplane import ControlPlane
from elaswave.daemon.etcd import KV, Etcd, EtcdSecurity
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.daemon.faultrelay import FaultRelay
from elaswave.daemon.netns import current_netns
from elaswave.daemon.workers import WorkerProc, spawn, stop_all
from elaswave.errors import (
    ElasWaveError,
    EtcdUnavailable,
    JobFailed,
    JobStopped,
    RunDirFull,
)
from elaswave.events import EVENTS_FILE, METRICS_FILE, EventLog, JsonlWriter
from elaswave.keys import JobKeys
from elaswave.planning.plan import Plan
from elaswave.planning.verdicts import WINDOW, hang_verdict, respawn_verdict, silence

log = logging.getLogger(__name__)

COMPUTE_PUBLISH_S = 0.5  # how often a host shares its workers' compute times with the leader
DAEMON_STALL_BEATS = 2  # the hang detector's loop running this many beats late = the daemon paused


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
    ) -> None:
        self.cfg = cfg
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
        self.lease: Any = None
        self.store: Any = None
        self.store_address = ""
        self.control = ControlServer(self._on_message, self._on_disconnect)
        self.workers: dict[str, WorkerProc] = {}
        self.conns: dict[str, WorkerConn] = {}
        self.plan: Plan | None = None
        self.is_leader = False
        self.stopping = False
        self.restarts_used = 0
        self.last_metric_step = 0
        self.commit_times: list[tuple[float, int]] = []
        self.final_step = 0
        self._finished = asyncio.Event()
        self._tasks: list[asyncio.Task[Any]] = []
        self.signal_received: int | None = None
        self.embedded = embedded  # an etcd this launch started: restarted if it exits
        self.unrecoverable: str | None = None  # why workers gave up (e.g. a lost ZeRO shard)
        self.stopped: str | None = None  # the leader's verdict that ended the job
        # worker -> (plan epoch, its newest compute seconds per micro-batch under that epoch)
        self.compute: dict[str, tuple[int, list[float]]] = {}
        self._compute_dirty = False
        self.layer_costs: dict[str, dict[str, Any]] = {}  # worker -> its layers' seconds (online)
        self._costs_dirty = False
        self.faults = FaultRelay(self)  # fault requests from etcd to this host's workers
        self.cp = ControlPlane(self)  # etcd outages, the outbox, the lease, the embedded etcd
        self.outbox = self.cp.outbox
        self.planner: Any = None  # the running leader.Planner, if this host leads
        self._replacing = 0  # fenced workers whose replacements are being spawned

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
        )
        try:
            await self._join()
            self.cp.joined()
            resilient = {
                "leader": lambda: leader.campaign(self),
                "plans": self._watch_plans,
                "faults": self.faults.watch,
                "done": self._watch_done,
                "stop": self._watch_stop,
            }
            self._tasks = [
                asyncio.create_task(self.cp.keep_alive(), name="keep-alive"),
                asyncio.create_task(self.outbox.run(), name="outbox"),
                *(
                    asyncio.create_task(self.cp.resilient(body), name=name)
                    for name, body in resilient.items()
                ),
                asyncio.create_task(self._detect_hangs(), name="hangs"),
                asyncio.create_task(self._publish_compute(), name="compute"),
            ]
            if self.embedded is not None:
                self._tasks.append(asyncio.create_task(self.cp.supervise_etcd(), name="etcd"))
            for slot in range(self.cfg.elastic.nproc_per_node):
                await self._spawn(slot, 0)
            waiter = asyncio.create_task(self._finished.wait())
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
            self.events.close()
            self.metrics.close()

    @property
    def next_incarnation(self) -> int:
        """The first worker incarnation a replacement may use (fresh worker ids)."""
        return 1 + max((w.incarnation for w in self.workers.values()), default=-1)

    @property
    def worker_step(self) -> int:
        """The newest step this host's workers have committed (their heartbeats say)."""
        return max((w.step for w in self.workers.values()), default=0)

    def request_stop(self, signum: int) -> None:
        self.signal_received = signum
        self.stopping = True
        self.events.emit(
            "shutdown_requested", host=self.host_id, signal=signal.Signals(signum).name
        )
        self._finished.set()

    async def _join(self) -> None:
        import torch.distributed as dist  # heavy import: only the daemon's store needs it

        live_hosts = await self.etcd.get_prefix(self.keys.hosts)
        if not live_hosts:
            # Nobody is running this job: whatever is left under its prefix is stale.
            await self.etcd.delete_prefix(self.keys.prefix)
        await self._agree_on_config()
        self.lease = await self.etcd.lease(self.cfg.timeouts.lease_ttl)
        self.store = dist.TCPStore(self.host_addr, 0, is_master=True, wait_for_workers=False)
        self.store_address = f"{self.host_addr}:{self.store.port}"
        await self.control.start()
        self.started = time.time()
        if not await self.etcd.create(
            self.keys.host(self.host_id), json.dumps(self.host_info()), lease=self.lease
        ):
            raise ElasWaveError(
                f"host id {self.host_id!r} is already registered in job {self.cfg.job_id!r}"
            )
        self.events.emit(
            "host_joined",
            host=self.host_id,
            addr=self.host_addr,
            job=self.cfg.job_id,
            pid=os.getpid(),
            embedded_etcd_pid=self.embedded.pid if self.embedded else None,
        )

    def host_info(self) -> dict[str, Any]:
        return {
            "host": self.host_id,
            "addr": self.host_addr,
            "pid": os.getpid(),
            "nproc": self.cfg.elastic.nproc_per_node,
            "run_dir": str(self.run_dir.resolve()),
            "store": self.store_address,
            "netns": current_netns(),
            "started": self.started,
        }

    async def _agree_on_config(self) -> None:
        """Every host must train the same thing: the first publishes it, the others compare."""
        mine = training_config(self.cfg)
        if await self.etcd.create(self.keys.config, json.dumps(mine, sort_keys=True)):
            return
        kv = await self.etcd.get(self.keys.config)
        theirs = kv.json() if kv else mine
        diff = config_difference(theirs, mine)
        if diff:
            raise ElasWaveError(f"this host's config differs from job {self.cfg.job_id!r}: {diff}")

    async def _wait_for_other_hosts(self) -> None:
        deadline = (
            time.monotonic() + 2 * self.cfg.timeouts.shutdown_grace + self.cfg.timeouts.lease_ttl
        )
        while time.monotonic() < deadline:
            try:
                if not await self.etcd.get_prefix(self.keys.hosts):
                    return
            except EtcdUnavailable:
                return
            await asyncio.sleep(0.2)

    def _fence(self, workers: list[WorkerProc], plan: Plan) -> None:
        """A newer plan dropped these live workers (their host was cut off, or paused, and the
        others moved on): their state is stale. They are SIGKILLed and replaced by new workers
        (new ids) that join like any newcomer."""
        pids = []
        for w in workers:
            w.stopping = True  # its exit is ours: no departure, no respawn
            pids.append(w.pid)
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
        self.events.emit(
            "host_fenced",
            host=self.host_id,
            reason=f"plan epoch {plan.epoch} dropped {len(workers)} live worker(s): {plan.reason}",
            killed=pids,
            workers=[w.worker_id for w in workers],
            epoch=plan.epoch,
        )
        for w in workers:  # gone with an expired lease, as a rule; if not, gone now
            key = self.keys.worker(w.worker_id)
            self.outbox.put(f"fenced {w.worker_id}", lambda key=key: self.etcd.delete(key))
        self._replacing += 1
        asyncio.create_task(self._replace(workers))

    async def _replace(self, workers: list[WorkerProc]) -> None:
        try:
            for w in workers:
                if w.waiter is not None:
                    await asyncio.wait([w.waiter])
            incarnation = self.next_incarnation
            if not self.stopping:
                for w in workers:
                    await self._spawn(w.slot, incarnation)
        finally:
            self._replacing -= 1
            self._check_finished()

    async def _finish(self) -> int:
        if self.signal_received is not None:
            return 128 + self.signal_received
        if self.unrecoverable:  # the cause; a loop breaker's stop that followed is its echo
            raise JobFailed(f"job {self.cfg.job_id!r} cannot recover: {self.unrecoverable}")
        if self.stopped is not None:
            raise JobStopped(f"job stopped: {self.stopped}")
        done = [w for w in self.workers.values() if w.done]
        if done:
            self.events.emit("job_done", host=self.host_id, step=self.final_step)
            step = self.final_step
            self.outbox.put(
                "done", lambda: self.etcd.put_json(self.keys.done, {"step": step, "t": time.time()})
            )
            return 0
        done_elsewhere = False
        with contextlib.suppress(EtcdUnavailable):
            done_elsewhere = await self.etcd.get(self.keys.done) is not None
        if done_elsewhere:
            self.events.emit("job_done_elsewhere", host=self.host_id)
            return 0  # the job completed on other hosts before this one was needed
        raise JobFailed(
            f"job {self.cfg.job_id!r} failed on host {self.host_id}: every worker was lost"
        )

    async def _cleanup(self) -> None:
        self.stopping = True
        # Bounded: a shutdown that hangs must not leave the daemon running. The outbox and the
        # keep-alive run on until the writes still owed to etcd have landed (or time is up).
        with shutdown_watchdog(4 * self.cfg.timeouts.shutdown_grace + 30):
            last = {"outbox", "keep-alive"}
            early = [t for t in self._tasks if t.get_name() not in last]
            for task in early:
                task.cancel()
            if early:
                await asyncio.wait(early, timeout=5.0)
            await stop_all(list(self.workers.values()), self.cfg.timeouts.shutdown_grace)
            for w in self.workers.values():
                if w.waiter is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(w.waiter, 1.0)
            await self.control.stop()
            if self.etcd is not None and not await self.outbox.drain(
                self.cfg.timeouts.etcd_connect
            ):
                # etcd never came back: this host's records are the only ones it knows of
                log.warning("%d etcd write(s) never landed", self.outbox.pending)
                self.outbox.abandon()
            late = [t for t in self._tasks if t.get_name() in last]
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=5.0)
            if self.etcd is not None:
                with contextlib.suppress(Exception):
                    if self.lease is not None:
                        await self.lease.revoke()
                if self.embedded is not None and self.signal_received is None:
                    await self._wait_for_other_hosts()  # they still need the etcd we host
                with contextlib.suppress(Exception):  # last one out: no stale keys
                    if not await self.etcd.get_prefix(self.keys.hosts):
                        await self.etcd.delete_prefix(self.keys.prefix)
                await self.etcd.close()

    # ---- workers ----------------------------------------------------------------------------
    async def _spawn(self, slot: int, incarnation: int) -> WorkerProc:
        w = await spawn(
            host_id=self.host_id,
            slot=slot,
            incarnation=incarnation,
            control_path=self.control.path,
            log_dir=self.run_dir / "logs",
        )
        self.workers[w.worker_id] = w
        w.waiter = asyncio.create_task(self._watch_exit(w))
        self.events.emit(
            "worker_spawned",
            host=self.host_id,
            worker=w.worker_id,
            pid=w.pid,
            incarnation=incarnation,
        )
        return w

    async def _watch_exit(self, w: WorkerProc) -> None:
        w.exit_code = await w.proc.wait()
        if w.done or w.stopping or self.stopping:
            self._check_finished()
            return
        if w.detect_delay:  # a fault that asks for a slow detector: the survivors meanwhile
            await asyncio.sleep(w.detect_delay)  # meet the dead peer in the transport alone
        rank = self.plan.rank_of(w.worker_id) if self.plan else None
        reason = f"worker {w.worker_id} (rank {rank}) {w.describe_exit()}"
        self.events.emit(
            "worker_exit",
            host=self.host_id,
            worker=w.worker_id,
            rank=rank,
            pid=w.pid,
            exit_code=w.exit_code,
            reason=reason,
        )
        # Queued: with etcd away, the departure lands (and is planned for) once it answers.
        self.outbox.put(
            f"departure of {w.worker_id}",
            lambda: self.etcd.put_and_delete(
                self.keys.departures + w.worker_id,
                reason,
                self.keys.worker(w.worker_id),
                lease=self.lease,
            ),
        )
        if (
            respawn_verdict(
                w.exit_code, self.restarts_used, self.cfg.elastic.max_restarts, self.unrecoverable
            )
            and not self.stopping
        ):
            self.restarts_used += 1
            nw = await self._spawn(w.slot, w.incarnation + 1)
            self.events.emit(
                "worker_respawned", host=self.host_id, worker=nw.worker_id, replaces=w.worker_id
            )
        self._check_finished()

    async def _detect_hangs(self) -> None:
        """Kill a worker whose heartbeats stop or whose compute phase outlasts the hang timeout.

        Killing it turns a hang into a crash: its peers' collectives fail at once instead of
        waiting for a transport timeout, and the usual in-place recovery follows.
        """
        limit, beat = self.cfg.timeouts.hang, self.cfg.timeouts.heartbeat
        tick = resumed = time.monotonic()
        while True:
            await asyncio.sleep(beat / 2)
            now = time.monotonic()
            if now - tick > DAEMON_STALL_BEATS * beat:
                # This loop did not run: the daemon itself was paused (a stop signal, swapping, a
                # throttled container). Silence it did not listen to is not the workers' doing.
                resumed = now
                self.events.emit("daemon_paused", host=self.host_id, seconds=round(now - tick, 3))
            tick = now
            for w in list(self.workers.values()):
                if w.last_beat is None or w.proc.returncode is not None or w.stopping or w.done:
                    continue
                reason = hang_verdict(
                    silence(now, w.last_beat, resumed), w.phase, w.phase_age, limit, beat
                )
                if reason is None:
                    continue
                w.kill_reason = reason
                rank = self.plan.rank_of(w.worker_id) if self.plan else None
                self.events.emit(
                    "hang_detected", host=self.host_id, worker=w.worker_id, rank=rank, reason=reason
                )
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                w.last_beat = None

    def _check_finished(self) -> None:
        """This host is finished once every worker process has exited (standbys are told to stop
        by ``_watch_done`` when the job commits its last step)."""
        if not self._replacing and all(
            w.proc.returncode is not None for w in self.workers.values()
        ):
            self._finished.set()

    # ---- control channel --------------------------------------------------------------------
    async def _on_message(self, conn: WorkerConn, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        wid = conn.worker_id
        w = self.workers.get(wid or "")
        if kind == "hello":
            if w is None:
                conn.send({"type": "stop"})
                return
            self.conns[w.worker_id] = conn
            conn.send({"type": "config", "config": self.cfg.to_dict(), "host_addr": self.host_addr})
        elif w is None:
            return
        elif kind == "ready":
            w.ready = True
            info: dict[str, Any] = {
                "worker_id": w.worker_id, "host": self.host_id, "pid": w.pid, "slot": w.slot,
            }  # fmt: skip
            for costs in ("layer_estimate", "layer_seconds"):  # pipelines: the workload's
                if isinstance(msg.get(costs), list):  # estimate, a start-up profile
                    info[costs] = [float(x) for x in msg[costs]]
            w.info = info
            self.outbox.put(
                f"registration of {w.worker_id}",
                lambda: self.etcd.put_json(self.keys.worker(w.worker_id), info, lease=self.lease),
            )
            self.events.emit("worker_ready", host=self.host_id, worker=w.worker_id, pid=w.pid)
            if self.plan is not None:
                conn.send({"type": "plan", "plan": self.plan.to_json()})
            self.faults.dispatch()
        elif kind == "event":
            event = dict(msg.get("event") or {})
            event.setdefault("worker", w.worker_id)
            event["host"] = self.host_id
            self.events.write(event)
            if event.get("kind") == "shard_lost" and self.unrecoverable is None:
                self.unrecoverable = str(event.get("reason"))  # the first cause, not echoes
        elif kind == "hb":
            w.last_beat = time.monotonic()
            w.phase = str(msg.get("phase", "idle"))
            w.phase_age = float(msg.get("phase_age", 0.0))
            w.step = int(msg.get("step", w.step))
        elif kind == "commit":
            await self._record_commit(msg)
        elif kind == "rollback":
            self._roll_back_metrics(int(msg["step"]))
        elif kind == "compute":
            epoch, samples = self.compute.get(w.worker_id, (0, []))
            if int(msg["epoch"]) != epoch:
                epoch, samples = int(msg["epoch"]), []  # speeds under another plan do not count
            samples = [*samples, float(msg["per_mb"])][-WINDOW:]
            self.compute[w.worker_id] = (epoch, samples)
            self._compute_dirty = True
        elif kind == "layer_costs" and isinstance(msg.get("layer_seconds"), dict):
            fields = ("step", "epoch", "layer_seconds")  # pipelines, layer_costs: online
            self.layer_costs[w.worker_id] = {k: msg.get(k) for k in fields}
            self._costs_dirty = True
        elif kind == "done":
            w.done = True
            self.final_step = max(self.final_step, int(msg.get("step", 0)))

    def _on_disconnect(self, conn: WorkerConn) -> None:
        if conn.worker_id and self.conns.get(conn.worker_id) is conn:
            del self.conns[conn.worker_id]

    async def _record_commit(self, msg: dict[str, Any]) -> None:
        """A step rank 0 committed: its record, written once across the whole job (see
        ``_land_record``), after the records before it."""
        step = int(msg["step"])
        if step <= self.last_metric_step:
            return  # a re-report after recovery, or a redone step: already recorded here
        self.last_metric_step = step
        self.final_step = max(self.final_step, step)
        record = {
            "step": step,
            "loss": msg["loss"],
            "epoch": msg["epoch"],
            "world_size": msg["world"],
            "samples": msg["samples"],
            "step_seconds": msg.get("step_seconds"),
            "time": msg["t"],
        }
        self.commit_times.append((float(msg["t"]), int(msg["samples"])))
        self.commit_times = self.commit_times[-20:]
        rate = 0.0
        if len(self.commit_times) >= 2:
            (t0, s0), (t1, s1) = self.commit_times[0], self.commit_times[-1]
            rate = (s1 - s0) / max(t1 - t0, 1e-9)
        progress = {
            **record, "samples_per_s": rate, "total_steps": self.cfg.train.steps,
            "writer": f"{self.host_id}/{uuid.uuid4().hex}",  # this record's write, and no other
        }  # fmt: skip
        tried: list[int] = []  # revisions of the progress record a write of it was sent against
        self.outbox.put(
            f"record of step {step}",
            lambda: self._land_record(record, progress, tried),
            fallback=lambda: self.metrics.write(record),
        )
        if step >= self.cfg.train.steps:
            done = {"step": step, "t": time.time()}
            self.outbox.put("done", lambda: self.etcd.put_json(self.keys.done, done))

    async def _land_record(
        self, record: dict[str, Any], progress: dict[str, Any], tried: list[int]
    ) -> None:
        """Write a step's record if this host is the one that moves the job's progress record
        (in etcd, outside every lease) to that step. Rank 0 re-reports its resume step after a
        change; when rank 0 moved to this host, its old host may have recorded the step already
        (and, cut off from etcd, may do so later): whoever advances the progress record first
        writes the line, the other drops its copy. Never a step recorded twice, across hosts.

        A write whose answer was lost (the etcd member went away after applying it; the call was
        retried on another member and its compare failed) is recognised by its ``writer`` token
        in etcd's history, so its line is written: never a step recorded nowhere either."""
        while True:
            kv = await self.etcd.get(self.keys.progress)
            if kv is not None and int(kv.json().get("step", 0)) >= record["step"]:
                if await self._progress_landed(kv, progress["writer"], tried):
                    self.metrics.write(record)
                return  # recorded by another host (or redone after a recovery)
            rev = kv.mod_revision if kv is not None else 0
            tried.append(rev)
            if await self.etcd.compare_and_put(
                self.keys.progress, json.dumps(progress, sort_keys=True), mod_revision=rev
            ):
                self.metrics.write(record)
                return

    async def _progress_landed(self, kv: KV, writer: str, tried: list[int]) -> bool:
        """Whether the progress record ``kv`` is (or was, right after one of the revisions a
        write was sent against) the write tagged ``writer``."""
        if kv.json().get("writer") == writer:
            return True
        for rev in tried:
            value = await self.etcd.first_put_after(self.keys.progress, rev)
            if value is not None and json.loads(value).get("writer") == writer:
                return True
        return False

    def _roll_back_metrics(self, step: int) -> None:
        """Silent corruption rolled the job back to ``step``: the steps after it are redone, and
        their first records (computed from a corrupt state) give way to the redone ones. In the
        outbox's order: records of steps before the rollback land (or are dropped) first."""
        if step >= self.last_metric_step:
            return
        self.last_metric_step = step
        self.commit_times.clear()
        progress = {"step": step, "rolled_back": True, "time": time.time()}

        async def roll_back() -> None:
            self.metrics.keep_only(lambda r: int(r.get("step", 0)) <= step)
            await self.etcd.put_json(self.keys.progress, progress)

        self.outbox.put(
            f"rollback to step {step}",
            roll_back,
            fallback=lambda: self.metrics.keep_only(lambda r: int(r.get("step", 0)) <= step),
        )

    async def _watch_done(self) -> None:
        """A host whose workers are all standbys finishes when the job does."""
        rev = await self.etcd.revision()
        if await self.etcd.get(self.keys.done) is None:
            async for ev in self.etcd.watch_prefix(self.keys.done, start_revision=rev + 1):
                if ev.key == self.keys.done and ev.kind == "put":
                    break
        # Whoever has not finished by now (a standby, a late joiner) has nothing left to do.
        for w in self.workers.values():
            if w.proc.returncode is None and not w.done:
                w.stopping = True
                conn = self.conns.get(w.worker_id)
                if conn is not None:
                    conn.send({"type": "stop"})
                else:
                    w.proc.terminate()
        self._check_finished()

    async def _publish_compute(self) -> None:
        """Share this host's workers' compute times with the leader: seconds per micro-batch
        (straggler detection) and, with ``layer_costs: online``, seconds per layer (the next
        pipeline plan). Both live in per-host keys under the host lease, apart from the worker
        keys: a late write never makes a dead worker look alive, and never wakes the planner."""
        while True:
            await asyncio.sleep(COMPUTE_PUBLISH_S)
            alive = {wid for wid, w in self.workers.items() if w.proc.returncode is None}
            if self._compute_dirty:
                self._compute_dirty = False
                live = {
                    wid: {"epoch": epoch, "per_mb": samples}
                    for wid, (epoch, samples) in self.compute.items()
                    if wid in alive
                }
                with contextlib.suppress(Exception):
                    await self.etcd.put_json(self.keys.speed + self.host_id, live, lease=self.lease)
            if self._costs_dirty:
                self._costs_dirty = False
                costs = {wid: c for wid, c in self.layer_costs.items() if wid in alive}
                with contextlib.suppress(Exception):
                    await self.etcd.put_json(
                        self.keys.costs + self.host_id, costs, lease=self.lease
                    )

    async def _watch_stop(self) -> None:
        """The leader's verdict to end the whole job (restart loop): stop everything here."""
        rev = await self.etcd.revision()
        kv = await self.etcd.get(self.keys.stop)
        if kv is None:
            async for ev in self.etcd.watch_prefix(self.keys.stop, start_revision=rev + 1):
                if ev.key == self.keys.stop and ev.kind == "put":
                    kv = ev
                    break
        assert kv is not None
        self.stopped = str(json.loads(kv.value)["reason"])
        self.stopping = True  # no respawns; exits from here on are ours
        self.events.emit("job_stopped", host=self.host_id, reason=self.stopped)
        self._finished.set()

    # ---- plans and faults -------------------------------------------------------------------
    async def _watch_plans(self) -> None:
        rev = await self.etcd.revision()
        kv = await self.etcd.get(self.keys.plan)
        if kv is not None:
            self.adopt_json(kv.value)
        async for ev in self.etcd.watch_prefix(self.keys.plan, start_revision=rev + 1):
            if ev.key == self.keys.plan and ev.kind == "put":
                self.adopt_json(ev.value)

    def adopt_json(self, value: bytes) -> None:
        try:
            plan = Plan.from_json(value)
        except (ValueError, KeyError, TypeError) as exc:  # JSON only; a bad value is ignored
            log.warning("ignoring a malformed plan in etcd: %s", exc)
            self.events.emit("plan_rejected", reason=f"malformed plan ({type(exc).__name__})")
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
        dropped = [
            w
            for wid in gone
            if (w := self.workers.get(wid)) is not None
            and wid not in plan.evicted
            and w.proc.returncode is None
            and not w.stopping
        ]
        if dropped:
            self._fence(dropped, plan)  # before the plan reaches them: they must not act on it
        msg = {"type": "plan", "plan": plan.to_json()}
        for wid, conn in list(self.conns.items()):
            if self.workers.get(wid) and self.workers[wid].ready:
                conn.send(msg)
        for wid in plan.evicted:
            self._evict(wid, plan)
        self.faults.dispatch()

    def _evict(self, wid: str, plan: Plan) -> None:
        """Stop a worker the leader evicted (too slow): cleanly, and without a respawn."""
        w = self.workers.get(wid)
        if w is None or w.stopping or w.proc.returncode is not None:
            return
        w.stopping = True  # its exit is not a failure: no departure, no respawn
        self.events.emit(
            "worker_evicted", host=self.host_id, worker=wid, epoch=plan.epoch, reason=plan.reason
        )
        conn = self.conns.get(wid)
        if conn is not None:
            conn.send({"type": "stop"})
        else:
            w.proc.terminate()
        self.outbox.put(f"eviction of {wid}", lambda: self.etcd.delete(self.keys.worker(wid)))


def training_config(cfg: JobConfig) -> dict[str, Any]:
    """The sections every host of a job must agree on."""
    full = cfg.to_dict()
    return {k: full[k] for k in ("model", "data", "train")} | {
        "nproc_per_node": cfg.elastic.nproc_per_node,
        "nnodes": cfg.elastic.nnodes,
    }


def config_difference(theirs: dict[str, Any], mine: dict[str, Any], prefix: str = "") -> str:
    """The first differing key as ``key: job has X, this host Y`` ('' when equal)."""
    for key in sorted(set(theirs) | set(mine)):
        a, b = theirs.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = config_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}: job has {a!r}, this host {b!r}"
    return ""


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
