"""How a host enters its job: the job starts, starts again (a relaunch resumes it from its
records: :mod:`elaswave.planning.relaunch`), or must not start; the host agrees with the others
on what the job trains, registers under a new host lease (the control plane's: ``new_lease``) and
says so. It reads what it needs of its daemon through :class:`EntryHost`; :meth:`JobEntry.join`
returns whether the job resumes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from elaswave.config.jobs import config_difference, training_config
from elaswave.daemon.earlier import etcd_records, write_run_config
from elaswave.errors import ElasWaveError, JobComplete, StartOverRefused
from elaswave.planning.relaunch import Verdict, merge_records, relaunch_verdict
from elaswave.runtime.durable.layout import newest_intact
from elaswave.wire import WireError
from elaswave.wire_etcd import HostInfo, StreamStart, TrainedConfig, decode, encode

if TYPE_CHECKING:
    from pathlib import Path

    from elaswave.config import JobConfig
    from elaswave.daemon.control_server import ControlServer
    from elaswave.daemon.etcd import Etcd
    from elaswave.daemon.etcd_server import EmbeddedEtcd
    from elaswave.daemon.jobstore import JobStore
    from elaswave.daemon.records import StepRecords
    from elaswave.daemon.streams import JobStream
    from elaswave.events import EventLog
    from elaswave.keys import JobKeys
    from elaswave.planning.relaunch import Records


log = logging.getLogger(__name__)


class EntryHost(Protocol):
    """What the job entry reads of its daemon."""

    @property
    def cfg(self) -> JobConfig: ...
    @property
    def host_id(self) -> str: ...
    @property
    def host_addr(self) -> str: ...
    @property
    def keys(self) -> JobKeys: ...
    @property
    def etcd(self) -> Etcd: ...
    @property
    def jobstore(self) -> JobStore: ...
    @property
    def events(self) -> EventLog: ...
    @property
    def run_dir(self) -> Path: ...
    @property
    def earlier(self) -> Records | None:
        """What an earlier run of this job id left in this run directory."""

    @property
    def moved(self) -> Path | None:
        """Where ``--fresh`` moved that earlier run."""

    @property
    def records(self) -> StepRecords:
        """Told which steps a relaunch recorded already."""

    @property
    def stream(self) -> JobStream | None:
        """Started once the job's start time is agreed."""

    @property
    def control(self) -> ControlServer:
        """Started just before the host registers."""

    @property
    def embedded(self) -> EmbeddedEtcd | None: ...

    async def new_lease(self) -> Any:
        """A new host lease, the one this host's keys go under from now on."""

    def host_info(self) -> HostInfo:
        """This host's key's value."""


class JobEntry:
    def __init__(self, host: EntryHost) -> None:
        self.host = host
        self._kept: dict[str, Any] | None = None  # the progress record etcd kept (a relaunch)
        self._resuming = False
        self.joined_at = 0.0  # when this host registered in the job (wall clock)

    async def join(self) -> bool:
        """Register this host in the job: first of all, if no host runs it, decide whether the
        job starts, starts again (a relaunch resumes) or must not start (one host decides:
        :meth:`_start`); then agree on the config. Returns whether this host started the job
        again from its durable checkpoints (a relaunch that resumes)."""
        d = self.host
        live_hosts = await self._outlive_earlier_self(await d.etcd.get_prefix(d.keys.hosts))
        if live_hosts and d.cfg.fresh:
            raise ElasWaveError(
                f"--fresh: job {d.cfg.job_id!r} is running on {len(live_hosts)} host(s); it "
                "starts over only when no host runs it"
            )
        # Nobody is running this job: it starts, or starts again, by one host.
        starting = None if live_hosts else await self._start()
        if d.moved is not None:
            d.events.emit("fresh_start", host=d.host_id, moved_to=str(d.moved))
        try:
            await self._register()
        finally:
            if starting is not None:  # in the job: the others may join it now
                await d.etcd.revoke_lease(starting)
        return self._resuming

    async def _register(self) -> None:
        d = self.host
        await self._agree_on_config()
        write_run_config(d.cfg, d.run_dir)  # in the job now: what it trains is this run's
        if d.stream is not None:
            d.stream.start(await self._stream_started())
        lease = await d.new_lease()
        await d.control.start()
        self.joined_at = time.time()
        if not await d.jobstore.register_host(d.host_info(), lease=lease):
            raise ElasWaveError(
                f"host id {d.host_id!r} is already registered in job {d.cfg.job_id!r}"
            )
        d.events.emit(
            "host_joined",
            host=d.host_id,
            addr=d.host_addr,
            job=d.cfg.job_id,
            pid=os.getpid(),
            embedded_etcd_pid=d.embedded.pid if d.embedded else None,
        )

    async def _outlive_earlier_self(self, live: list[Any]) -> list[Any]:
        """This host may have run the job before and be launched again at once (a scheduler's
        requeue, with the node's name for host id): killed, its own key is still registered;
        stopped, its id is still in the job's newest plan. Either way the other hosts of that
        run may still be registered too: their keys last until their leases expire (an etcd
        restarted from its data directory gives every lease a whole TTL again). Wait for the
        keys registered then to go, or, if the job still runs, for its leader to plan without
        this host, then read again; which host starts the job again is :meth:`_start`'s to
        decide, and a host still running keeps its key and is joined."""
        d = self.host
        if not live:
            return live  # nobody registered: nothing to outlive (and no plan to read)
        mine = d.keys.host(d.host_id)
        plan, _ = await d.jobstore.read_plan()
        planned = plan is not None and d.host_id in plan.hosts
        if not (planned or any(kv.key == mine for kv in live)):
            return live
        earlier = {(kv.key, kv.create_revision) for kv in live}
        deadline = time.monotonic() + d.cfg.timeouts.lease_ttl + 2.0
        while time.monotonic() < deadline:
            await asyncio.sleep(0.2)
            kvs = await d.etcd.get_prefix(d.keys.hosts)
            now = {(kv.key, kv.create_revision) for kv in kvs}
            if not now & earlier:
                break
            if plan is not None and all(kv.key != mine for kv in kvs):
                newer, _ = await d.jobstore.read_plan()
                if newer is not None and newer.epoch > plan.epoch and d.host_id not in newer.hosts:
                    break  # the job runs on: its leader planned without this host
        return await d.etcd.get_prefix(d.keys.hosts)

    async def _start(self) -> Any:
        """Start the job (again), or join the host that does. Hosts launched together (srun
        starts every node's launch at once, and a requeue all of them again) take turns: the one
        that creates the job's start key, under a lease of its own, decides whether the job
        starts, resumes or must not start, and clears what is stale under the job's prefix but
        for what its records say was committed; the others wait until a host is registered and
        join it, or, if the key goes first (that host was refused, or died), try again. The
        starter lets the key go only once it is registered, so a host that finds the key free
        and a host registered joins. Returns the lease of the start key this host holds until
        it is registered (None: another host started the job)."""
        d = self.host
        while True:
            lock = await d.etcd.lease(d.cfg.timeouts.lease_ttl)
            if await d.etcd.create(d.keys.starting, d.host_id, lease=lock):
                if not await d.etcd.get_prefix(d.keys.hosts):
                    break
                await d.etcd.revoke_lease(lock)  # free: the job's starter is in it already
                return None
            await d.etcd.revoke_lease(lock)
            if await self._started_by_another():
                return None
        try:
            verdict = await self._verdict()
            self._refuse_unless_startable(verdict)  # before anything changes in etcd
            await d.etcd.delete_prefix_but(d.keys.prefix, d.keys.starting)
            await self._start_as(verdict)
        except BaseException:
            await d.etcd.revoke_lease(lock)
            raise
        return lock

    async def _started_by_another(self) -> bool:
        """While another host holds the start key: True once a host is registered, False if
        the key went without one."""
        d = self.host
        while not await d.etcd.get_prefix(d.keys.hosts):
            if await d.etcd.get(d.keys.starting) is None:
                return bool(await d.etcd.get_prefix(d.keys.hosts))
            await asyncio.sleep(0.1)
        return True

    async def _verdict(self) -> Verdict:
        """Whether this job id starts new, resumes, is done already, or must not start: from
        what its earlier runs left in the run directory, the checkpoints and etcd."""
        d = self.host
        cfg = d.cfg
        seen = None
        if not cfg.fresh:
            plan, _ = await d.jobstore.read_plan()
            trained = await d.jobstore.trained()
            diff = "" if trained is None else config_difference(
                {k: trained.get(k) for k in ("model", "data")},
                {k: v for k, v in training_config(cfg).items() if k in ("model", "data")},
            ).replace("job has", "it had", 1)  # fmt: skip
            kept = await d.jobstore.progress()
            progress = self._kept = kept.fields() if kept is not None else None
            seen = etcd_records(progress, plan.epoch if plan else 0, config_diff=diff)
            if seen is not None and d.earlier is None:  # where checkpoints would be
                intact = newest_intact(cfg.resolved_durable_dir)
                seen = replace(
                    seen, checkpoint=intact.step, checkpoint_dir=str(cfg.resolved_durable_dir),
                    checkpoint_failed=intact.failures(),
                )  # fmt: skip
        found = merge_records(d.earlier, seen)
        return relaunch_verdict(
            found, job_id=cfg.job_id, total_steps=cfg.train.steps, resume=bool(cfg.resume)
        )

    @staticmethod
    def _refuse_unless_startable(verdict: Verdict) -> None:
        """A job that must not start (it would train from step 0 again) or has nothing left
        to train ends here, its records in etcd untouched for a later launch."""
        if verdict.action == "refuse":
            raise StartOverRefused(verdict.reason)
        if verdict.action == "done":
            raise JobComplete(verdict.reason)

    async def _start_as(self, verdict: Verdict) -> None:
        """Start as the relaunch verdict says: new, or resumed with the job's progress seeded
        so that the steps it recorded are not recorded again."""
        d = self.host
        if verdict.action == "resume":
            self._resuming = True
            await d.jobstore.seed_progress(verdict.committed, verdict.epoch, verdict.reason)
            here = d.earlier.committed if d.earlier is not None else 0
            line_of = d.records.recorded_up_to(
                verdict.committed, kept=self._kept if here < verdict.committed else None
            )
            d.events.emit(
                "relaunched", host=d.host_id, committed=verdict.committed,
                resume_step=verdict.resume_step, lost_steps=verdict.lost_steps,
                reason=verdict.reason, line_from_etcd=line_of,
            )  # fmt: skip

    async def _agree_on_config(self) -> None:
        """Every host must train the same thing: the first publishes it, the others compare."""
        d = self.host
        mine = training_config(d.cfg)
        if await d.etcd.create(d.keys.config, encode(TrainedConfig(mine))):
            return
        kv = await d.etcd.get(d.keys.config)
        try:
            theirs = decode(TrainedConfig, kv.value).config if kv is not None else mine
        except WireError as exc:
            raise ElasWaveError(f"job {d.cfg.job_id!r} cannot be compared with: {exc}") from None
        diff = config_difference(theirs, mine)
        if diff:
            raise ElasWaveError(f"this host's config differs from job {d.cfg.job_id!r}: {diff}")

    async def _stream_started(self) -> float:
        """When the job's event stream started: set once by the first host that asks; every
        host names its event files and the W&B run by it."""
        d = self.host
        mine = StreamStart(started=time.time())
        if await d.etcd.create(d.keys.logging, encode(mine)):
            return mine.started
        kv = await d.etcd.get(d.keys.logging)
        if kv is None:
            return mine.started
        try:
            return decode(StreamStart, kv.value).started
        except WireError as exc:
            log.error("naming the job's stream by this host's start: %s", exc)
            return mine.started
