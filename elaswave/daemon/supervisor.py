"""The per-host supervisor daemon (asyncio).

It registers its host under an etcd lease, campaigns for leadership, spawns and supervises one
worker per device, relays plans and faults to them over the control channel, turns every worker
exit into an event and a membership change within milliseconds, and writes the run directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from elaswave.config import JobConfig
from elaswave.daemon import leader
from elaswave.daemon.control import ControlServer, WorkerConn
from elaswave.daemon.etcd import Etcd, EtcdSecurity
from elaswave.daemon.netns import current_netns
from elaswave.daemon.policy import WINDOW
from elaswave.daemon.workers import WorkerProc, spawn, stop_all
from elaswave.errors import (
    EXIT_STATE_LOST,
    ElasWaveError,
    EtcdUnavailable,
    HostFenced,
    JobFailed,
    JobStopped,
)
from elaswave.events import EVENTS_FILE, METRICS_FILE, EventLog, JsonlWriter
from elaswave.faults import FaultKind, FaultSpec, decode_request
from elaswave.keys import JobKeys
from elaswave.plan import Plan

log = logging.getLogger(__name__)

COMPUTE_PUBLISH_S = 0.5  # how often a host shares its workers' compute times with the leader


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
        embedded_etcd_pid: int | None = None,
        security: EtcdSecurity | None = None,
        first_incarnation: int = 0,
    ) -> None:
        self.cfg = cfg
        self.endpoints = etcd_endpoints
        self.security = security
        self.host_id = cfg.host_id or default_host_id()
        self.host_addr = host_addr or host_address_for(etcd_endpoints[0])
        self.keys = JobKeys(cfg.job_id)
        self.run_dir = cfg.resolved_run_dir
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.events = EventLog(self.run_dir / EVENTS_FILE)
        self.metrics = JsonlWriter(self.run_dir / METRICS_FILE)
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
        self._pending_faults: dict[str, FaultSpec] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self.signal_received: int | None = None
        self.embedded_etcd_pid = embedded_etcd_pid
        self.unrecoverable: str | None = None  # why workers gave up (e.g. a lost ZeRO shard)
        self.stopped: str | None = None  # the leader's verdict that ended the job
        # worker -> (plan epoch, its newest compute seconds per micro-batch under that epoch)
        self.compute: dict[str, tuple[int, list[float]]] = {}
        self._compute_dirty = False
        self.layer_costs: dict[str, dict[str, Any]] = {}  # worker -> its layers' seconds (online)
        self._costs_dirty = False
        self._repeat_sent: dict[str, set[str]] = {}  # repeat fault key -> workers it went to
        self.first_incarnation = first_incarnation  # > 0 after a fence: new worker ids
        self.fenced: str | None = None  # why this host stopped its workers (lease lost)

    # ---- lifecycle --------------------------------------------------------------------------
    async def run(self) -> int:
        """Run until the job ends on this host; returns the process exit code."""
        self.etcd = await Etcd.connect(
            self.endpoints,
            prefix=self.keys.prefix,
            timeout=self.cfg.timeouts.etcd_connect,
            security=self.security,
        )
        try:
            await self._join()
            self._tasks = [
                asyncio.create_task(self._keep_alive(), name="keep-alive"),
                asyncio.create_task(leader.campaign(self), name="leader"),
                asyncio.create_task(self._watch_plans(), name="plans"),
                asyncio.create_task(self._watch_faults(), name="faults"),
                asyncio.create_task(self._watch_done(), name="done"),
                asyncio.create_task(self._detect_hangs(), name="hangs"),
                asyncio.create_task(self._publish_compute(), name="compute"),
                asyncio.create_task(self._watch_stop(), name="stop"),
            ]
            if self.first_incarnation and await self.etcd.get(self.keys.done) is not None:
                self.events.emit("job_done_elsewhere", host=self.host_id)
                return 0  # the job finished while this host was fenced
            for slot in range(self.cfg.elastic.nproc_per_node):
                await self._spawn(slot, self.first_incarnation)
            waiter = asyncio.create_task(self._finished.wait())
            pending: set[asyncio.Task[Any]] = {waiter, *self._tasks}
            while waiter in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception() if task is not waiter else None
                    if exc is None:
                        continue
                    if isinstance(exc, EtcdUnavailable) and self._work_is_over():
                        continue  # etcd went away after our last step: nothing left to lose
                    if isinstance(exc, EtcdUnavailable) and not self.stopping:
                        self._fence(f"lost etcd ({exc})")  # membership can no longer be trusted
                    raise exc
            return await self._finish()
        finally:
            await self._cleanup()

    @property
    def next_incarnation(self) -> int:
        """The first worker incarnation a rejoin of this host may use (fresh worker ids)."""
        return 1 + max((w.incarnation for w in self.workers.values()), default=-1)

    def _work_is_over(self) -> bool:
        return bool(self.workers) and all(
            w.done or w.proc.returncode is not None for w in self.workers.values()
        )

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
        info = {
            "host": self.host_id,
            "addr": self.host_addr,
            "pid": os.getpid(),
            "nproc": self.cfg.elastic.nproc_per_node,
            "run_dir": str(self.run_dir.resolve()),
            "store": self.store_address,
            "netns": current_netns(),
            "started": time.time(),
        }
        if not await self.etcd.create(
            self.keys.host(self.host_id), json.dumps(info), lease=self.lease
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
            embedded_etcd_pid=self.embedded_etcd_pid,
        )

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

    async def _keep_alive(self) -> None:
        """Refresh the host lease; fence this host once it cannot have been refreshed for a TTL.

        Past that point etcd has expired (or is about to expire) the lease and the leader plans
        without this host, so its workers must stop before anything of theirs can count: they
        are SIGKILLed and the daemon leaves with :class:`HostFenced` (``launch`` then rejoins as
        a new member once etcd answers again).
        """
        ttl = self.cfg.timeouts.lease_ttl
        interval = max(0.1, ttl / 4)
        last_ok = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            remaining: int | None = None
            try:
                remaining = await asyncio.wait_for(self.etcd.refresh_lease(self.lease), interval)
                if remaining > 0:
                    last_ok = time.monotonic()
            except (EtcdUnavailable, asyncio.TimeoutError) as exc:
                log.warning("lease keep-alive failed: %s", exc)
            reason = fence_verdict(time.monotonic() - last_ok, remaining, ttl)
            if reason is not None:
                self._fence(reason)

    def _fence(self, reason: str) -> None:
        self.fenced = reason
        self.stopping = True
        pids = []
        for w in self.workers.values():
            if w.proc.returncode is None:
                w.stopping = True
                pids.append(w.pid)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
        self.events.emit("host_fenced", host=self.host_id, reason=reason, killed=pids)
        raise HostFenced(f"host {self.host_id} fenced: {reason}")

    async def _finish(self) -> int:
        if self.signal_received is not None:
            return 128 + self.signal_received
        if self.stopped is not None:
            raise JobStopped(f"job stopped: {self.stopped}")
        done = [w for w in self.workers.values() if w.done]
        if done:
            self.events.emit("job_done", host=self.host_id, step=self.final_step)
            with contextlib.suppress(Exception):
                await self.etcd.put_json(
                    self.keys.done, {"step": self.final_step, "t": time.time()}
                )
            return 0
        if await self.etcd.get(self.keys.done) is not None:
            self.events.emit("job_done_elsewhere", host=self.host_id)
            return 0  # the job completed on other hosts before this one was needed
        if self.unrecoverable:
            raise JobFailed(f"job {self.cfg.job_id!r} cannot recover: {self.unrecoverable}")
        raise JobFailed(
            f"job {self.cfg.job_id!r} failed on host {self.host_id}: every worker was lost"
        )

    async def _cleanup(self) -> None:
        self.stopping = True
        # Bounded: a shutdown that hangs must not leave the daemon running. Cancelled once done,
        # because after a fence this process goes on with a new daemon (it must not be shot).
        with shutdown_watchdog(4 * self.cfg.timeouts.shutdown_grace + 30):
            for task in self._tasks:
                task.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks, timeout=5.0)
            await stop_all(list(self.workers.values()), self.cfg.timeouts.shutdown_grace)
            for w in self.workers.values():
                if w.waiter is not None:
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(w.waiter, 1.0)
            await self.control.stop()
            if self.etcd is not None and self.fenced is not None:
                await self.etcd.close()  # unreachable or forgot us: nothing to tidy there
            elif self.etcd is not None:
                with contextlib.suppress(Exception):
                    if self.lease is not None:
                        await self.lease.revoke()
                if self.embedded_etcd_pid is not None and self.signal_received is None:
                    await self._wait_for_other_hosts()  # they still need the etcd we host
                with contextlib.suppress(Exception):  # last one out: no stale keys
                    if not await self.etcd.get_prefix(self.keys.hosts):
                        await self.etcd.delete_prefix(self.keys.prefix)
                await self.etcd.close()
            self.events.close()
            self.metrics.close()

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
        with contextlib.suppress(Exception):
            await self.etcd.put_and_delete(
                self.keys.departures + w.worker_id,
                reason,
                self.keys.worker(w.worker_id),
                lease=self.lease,
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
        limit = self.cfg.timeouts.hang
        while True:
            await asyncio.sleep(self.cfg.timeouts.heartbeat / 2)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if w.last_beat is None or w.proc.returncode is not None or w.stopping or w.done:
                    continue
                reason = hang_verdict(
                    now - w.last_beat, w.phase, w.phase_age, limit, self.cfg.timeouts.heartbeat
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
        if all(w.proc.returncode is not None for w in self.workers.values()):
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
            info = {"worker_id": w.worker_id, "host": self.host_id, "pid": w.pid, "slot": w.slot}
            if isinstance(msg.get("layer_seconds"), list):  # pipelines: a start-up profile
                info["layer_seconds"] = [float(x) for x in msg["layer_seconds"]]
            await self.etcd.put_json(self.keys.worker(w.worker_id), info, lease=self.lease)
            self.events.emit("worker_ready", host=self.host_id, worker=w.worker_id, pid=w.pid)
            if self.plan is not None:
                conn.send({"type": "plan", "plan": self.plan.to_json()})
            self._dispatch_faults()
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
        step = int(msg["step"])
        if step <= self.last_metric_step:
            return  # a re-report after recovery: already recorded
        if step != self.last_metric_step + 1:
            # Rank 0 moved to this host (its old host died): the old one may have recorded it.
            with contextlib.suppress(Exception):
                kv = await self.etcd.get(self.keys.progress)
                if kv is not None and int(kv.json().get("step", 0)) >= step:
                    self.last_metric_step = step
                    return
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
        self.metrics.write(record)
        if step >= self.cfg.train.steps:
            with contextlib.suppress(Exception):
                await self.etcd.put_json(self.keys.done, {"step": step, "t": time.time()})
        self.commit_times.append((float(msg["t"]), int(msg["samples"])))
        self.commit_times = self.commit_times[-20:]
        rate = 0.0
        if len(self.commit_times) >= 2:
            (t0, s0), (t1, s1) = self.commit_times[0], self.commit_times[-1]
            rate = (s1 - s0) / max(t1 - t0, 1e-9)
        progress = {**record, "samples_per_s": rate, "total_steps": self.cfg.train.steps}
        with contextlib.suppress(Exception):
            await self.etcd.put_json(self.keys.progress, progress)

    def _roll_back_metrics(self, step: int) -> None:
        """Silent corruption rolled the job back to ``step``: the steps after it are redone, and
        their first records (computed from a corrupt state) give way to the redone ones."""
        if step >= self.last_metric_step:
            return
        self.metrics.keep_only(lambda r: int(r.get("step", 0)) <= step)
        self.last_metric_step = step
        self.commit_times.clear()

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
            self._adopt_json(kv.value)
        async for ev in self.etcd.watch_prefix(self.keys.plan, start_revision=rev + 1):
            if ev.key == self.keys.plan and ev.kind == "put":
                self._adopt_json(ev.value)

    def _adopt_json(self, value: bytes) -> None:
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
        self.plan = plan
        msg = {"type": "plan", "plan": plan.to_json()}
        for wid, conn in list(self.conns.items()):
            if self.workers.get(wid) and self.workers[wid].ready:
                conn.send(msg)
        for wid in plan.evicted:
            self._evict(wid, plan)
        self._dispatch_faults()

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
        asyncio.create_task(self.etcd.delete(self.keys.worker(wid)))

    async def _watch_faults(self) -> None:
        rev = await self.etcd.revision()
        for kv in await self.etcd.get_prefix(self.keys.faults):
            self._queue_fault(kv.key, kv.value)
        async for ev in self.etcd.watch_prefix(self.keys.faults, start_revision=rev + 1):
            if ev.kind == "put":
                self._queue_fault(ev.key, ev.value)

    def _queue_fault(self, key: str, value: bytes) -> None:
        """Accept a fault request from etcd only if it is well-formed; anything else is logged,
        removed and ignored (the daemon never trusts what it reads there)."""
        try:
            self._pending_faults[key] = decode_request(value)
        except ElasWaveError as exc:
            log.warning("ignoring fault request %s: %s", key, exc)
            self.events.emit("fault_rejected", key=key, reason=str(exc))
            if self.is_leader:
                asyncio.create_task(self._delete_quietly(key))
            return
        self._dispatch_faults()

    async def _delete_quietly(self, key: str) -> None:
        with contextlib.suppress(ElasWaveError):
            await self.etcd.delete(key)

    def _dispatch_faults(self) -> None:
        if self.plan is None:
            return
        for key, fault in list(self._pending_faults.items()):
            if fault.host is not None:
                del self._pending_faults[key]  # only the target host acts; the others drop it
                if fault.host != self.host_id:
                    # Every other daemon records the request: the report's incident starts at
                    # the first record (the victim's own dies with it, or, cut off, never
                    # reaches anyone; the leader may be the victim).
                    self.events.emit("fault_requested", fault=fault.to_dict(), host=fault.host)
                    if self.is_leader and fault.kind is FaultKind.PARTITION:  # a record only
                        asyncio.create_task(self._delete_quietly(key))
                if fault.host == self.host_id and fault.kind is FaultKind.HOST:
                    asyncio.create_task(self._die(key, fault))
                continue
            assert fault.rank is not None
            if fault.repeat:
                self._dispatch_repeat(key, fault)
                continue
            if fault.rank >= self.plan.world_size:
                if self.is_leader:
                    del self._pending_faults[key]
                    reason = (
                        f"rank {fault.rank} is not in the plan (epoch {self.plan.epoch}: "
                        f"ranks 0..{self.plan.world_size - 1})"
                    )
                    log.warning("ignoring fault request %s: %s", key, reason)
                    self.events.emit(
                        "fault_rejected", key=key, fault=fault.to_dict(), reason=reason
                    )
                    asyncio.create_task(self._delete_quietly(key))
                continue
            target = self.plan.workers[fault.rank]
            w = self.workers.get(target)
            if w is None:
                del self._pending_faults[key]  # another host's worker: its daemon handles it
                continue
            conn = self.conns.get(target)
            needs_worker = fault.at_step is not None or fault.kind.signal is None
            if needs_worker and conn is None:
                continue  # not connected yet: dispatched again on the next plan or ready
            del self._pending_faults[key]
            asyncio.create_task(self.etcd.delete(key))
            self.events.emit(
                "fault_requested", fault=fault.to_dict(), worker=target, host=self.host_id
            )
            w.sent(fault.detect_delay)
            if not needs_worker:
                self.events.emit(
                    "fault_injected",
                    fault=fault.to_dict(),
                    worker=target,
                    rank=fault.rank,
                    pid=w.pid,
                )
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, fault.kind.signal)
            elif conn is not None:
                conn.send({"type": "fault", "fault": fault.to_dict()})

    def _dispatch_repeat(self, key: str, fault: FaultSpec) -> None:
        """A repeated fault stays armed: each worker that holds its rank gets it once."""
        assert self.plan is not None and fault.rank is not None
        if fault.rank >= self.plan.world_size:
            return  # the rank may exist again after a grow
        target = self.plan.workers[fault.rank]
        sent = self._repeat_sent.setdefault(key, set())
        conn = self.conns.get(target)
        if target in sent or target not in self.workers or conn is None:
            return
        sent.add(target)
        self.workers[target].sent(fault.detect_delay)
        self.events.emit("fault_requested", fault=fault.to_dict(), worker=target, host=self.host_id)
        conn.send({"type": "fault", "fault": fault.to_dict()})

    async def _die(self, key: str, fault: FaultSpec) -> None:
        """A host fault: SIGKILL every worker and then this daemon. Nothing tidies up after it,
        as with a host that loses power: its lease expires and the leader plans without it."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.etcd.delete(key), self.cfg.timeouts.etcd_connect)
        pids = [w.pid for w in self.workers.values() if w.proc.returncode is None]
        self.events.emit(
            "fault_injected", fault=fault.to_dict(), host=self.host_id, pid=os.getpid(), pids=pids
        )
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    async def submit_config_faults(self) -> None:
        for fault in self.cfg.faults:
            await submit_fault(self.etcd, self.keys, fault)


async def submit_fault(etcd: Etcd, keys: JobKeys, fault: FaultSpec) -> str:
    fault_id = f"{time.time_ns()}-{uuid.uuid4().hex[:8]}"
    await etcd.put_json(keys.fault(fault_id), fault.to_dict())
    return fault_id


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


def respawn_verdict(
    exit_code: int | None, restarts_used: int, max_restarts: int, unrecoverable: str | None
) -> bool:
    """Whether a worker that exited is replaced. Pure. Never after it gave up because state is
    lost (``EXIT_STATE_LOST``, or another worker reported it): a fresh worker would start the
    job over from step 0, silently; the job stops with the reason instead."""
    if exit_code == EXIT_STATE_LOST or unrecoverable is not None:
        return False
    return restarts_used < max_restarts


def hang_verdict(
    silent_s: float, phase: str, phase_age_s: float, limit_s: float, beat_s: float
) -> str | None:
    """Why a worker counts as hung, or ``None``. Pure: the hang detector's whole decision.

    Two disjoint cases, each needing the full ``limit_s``: the process is frozen (no heartbeat
    for longer than the limit), or it is alive (beats still arrive) but its main thread has been
    in one compute phase for longer than the limit. A worker waiting in a collective or for a
    plan is never hung on its own account: a peer may be.
    """
    if silent_s > limit_s:
        return f"no heartbeat for {silent_s:.1f} s"
    if phase == "compute" and silent_s <= 2 * beat_s and phase_age_s > limit_s:
        return f"stuck computing for {phase_age_s:.1f} s"
    return None


def fence_verdict(since_refresh_s: float, remaining_ttl: int | None, ttl: int) -> str | None:
    """Why this host must fence itself, or ``None``. Pure: the partition detector's decision.

    ``since_refresh_s`` is the time since the last lease refresh etcd acknowledged and
    ``remaining_ttl`` what the latest refresh answered (``None``: it failed). A refresh answered
    with TTL <= 0 means etcd already dropped the lease (we come back from a partition too late);
    no acknowledged refresh for a whole TTL means etcd may drop it any moment.
    """
    if remaining_ttl is not None and remaining_ttl <= 0:
        return "etcd expired this host's lease"
    if since_refresh_s > ttl:
        return f"no lease refresh reached etcd for {since_refresh_s:.1f} s (lease TTL {ttl} s)"
    return None
