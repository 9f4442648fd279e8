"""Library functions behind ``status`` and ``inject-fault``: read/write a job's etcd keys."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from elaswave.config import EtcdTLSConfig
from elaswave.daemon.discovery import find_job
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_connect import EtcdSecurity
from elaswave.daemon.faultrelay import submit_fault
from elaswave.daemon.netns import set_links
from elaswave.errors import FaultSpecError, JobNotFound
from elaswave.faults import FaultKind, FaultSpec
from elaswave.keys import JobKeys
from elaswave.planning import planwire
from elaswave.planning.plan import Plan
from elaswave.report import MEMORY_FIELDS  # null per rank until its worker reports under a plan


def resolve_etcd(
    job_id: str, etcd: str | None, tls: EtcdTLSConfig | None = None
) -> tuple[list[str], EtcdSecurity]:
    """Endpoints and credentials for a job: from the flags, else from its discovery record.

    TLS files given on the command line win; without any, a job found through its discovery
    record is reached with the files its launch used. User and password come from the
    environment only.
    """
    tls = tls or EtcdTLSConfig()
    if etcd:
        return [e for e in etcd.split(",") if e.strip()], EtcdSecurity.load(tls)
    record = find_job(job_id)
    if not tls.enabled and not tls.cert and record.get("etcd_tls"):
        tls = EtcdTLSConfig(**record["etcd_tls"])
    return list(record["etcd"]), EtcdSecurity.load(tls)


async def _status(
    job_id: str, endpoints: list[str], security: EtcdSecurity, timeout: float
) -> dict[str, Any]:
    keys = JobKeys(job_id)
    db = await Etcd.connect(endpoints, prefix=keys.prefix, timeout=timeout, security=security)
    try:
        st = await read_status(db, job_id)
    finally:
        await db.close()
    if st is None:
        raise JobNotFound(f"no job {job_id!r} in etcd at {', '.join(endpoints)}")
    return st


async def read_status(db: Etcd, job_id: str) -> dict[str, Any] | None:
    """The status document of ``job_id`` through an open connection (None: no such job)."""
    keys = JobKeys(job_id)
    hosts = [kv.json() for kv in await db.get_prefix(keys.hosts)]
    workers = {kv.json()["worker_id"]: kv.json() for kv in await db.get_prefix(keys.workers)}
    memory: dict[str, Any] = {}
    for kv in await db.get_prefix(keys.memory):
        memory.update(kv.json())
    hang = {  # each host's hang detector's bounds now
        kv.key.removeprefix(keys.hang): kv.json() for kv in await db.get_prefix(keys.hang)
    }
    plan_kv = await db.get(keys.plan)
    progress_kv = await db.get(keys.progress)
    incidents_kv = await db.get(keys.incidents)
    leader_kv = await db.get(keys.leader)
    done_kv = await db.get(keys.done)
    if not hosts and plan_kv is None:
        return None
    plan = planwire.decode(plan_kv.value) if plan_kv else None
    members = []
    if plan is not None:
        for rank, wid in enumerate(plan.workers):
            info = workers.get(wid, {})
            members.append(
                {
                    "rank": rank,
                    "worker": wid,
                    "host": plan.hosts[rank],
                    "pid": info.get("pid"),
                    "alive": wid in workers,
                    "microbatches": plan.microbatches[rank],
                    **_stage(plan, rank),
                    **dict.fromkeys(MEMORY_FIELDS),
                    **{k: v for k, v in memory.get(wid, {}).items() if k in MEMORY_FIELDS},
                }
            )
    standby = [w for w in workers if plan is None or w not in plan.workers]
    return {
        "job_id": job_id,
        "leader": leader_kv.value.decode() if leader_kv else None,
        "hosts": hosts,
        "epoch": plan.epoch if plan else 0,
        "world_size": plan.world_size if plan else 0,
        "members": members,
        "standby": standby,
        "progress": json.loads(progress_kv.value) if progress_kv else None,
        "incidents": json.loads(incidents_kv.value) if incidents_kv else [],
        "hang_timeout": hang,
        "done": json.loads(done_kv.value) if done_kv else None,
    }


def _stage(plan: Plan, rank: int) -> dict[str, Any]:
    """Pipelines: the rank's place in the data × pipeline grid and the layers it owns."""
    if not plan.is_pipeline:
        return {}
    replica, stage = plan.position(rank)
    layers = plan.stage_layers(rank)
    out = {"replica": replica, "stage": stage, "layers": [layers.start, layers.stop]}
    roles = plan.roles(rank)
    if len(roles) > 1:  # stage_loss recycle: it runs this stage for other replicas too
        out["replicas"] = [d for d, _ in roles]
    return out


def job_status(
    job_id: str, etcd: str | None, timeout: float = 5.0, tls: EtcdTLSConfig | None = None
) -> dict[str, Any]:
    endpoints, security = resolve_etcd(job_id, etcd, tls)
    return asyncio.run(_status(job_id, endpoints, security, timeout))


def fault_target_error(
    job_id: str, fault: FaultSpec, plan: Plan, live_workers: set[str], done: bool
) -> str | None:
    """Why ``fault`` cannot be aimed at the job as it is now, or ``None``. Pure."""
    assert fault.rank is not None
    if done:
        return f"job {job_id!r} has already finished; nothing to inject into"
    if fault.rank >= plan.world_size:
        return (
            f"rank {fault.rank} out of range: job {job_id!r} has ranks 0..{plan.world_size - 1} "
            f"in its current plan (epoch {plan.epoch})"
        )
    target = plan.workers[fault.rank]
    if target not in live_workers:
        return (
            f"rank {fault.rank} (worker {target}) of job {job_id!r} is gone; the job is "
            "recovering, retry once `elaswave status` shows the new plan"
        )
    return None


async def _inject(
    job_id: str, endpoints: list[str], security: EtcdSecurity, fault: FaultSpec, timeout: float
) -> dict[str, Any]:
    keys = JobKeys(job_id)
    db = await Etcd.connect(endpoints, prefix=keys.prefix, timeout=timeout, security=security)
    try:
        hosts = {kv.json()["host"]: kv.json() for kv in await db.get_prefix(keys.hosts)}
        if not hosts:
            raise JobNotFound(f"no running job {job_id!r} in etcd at {', '.join(endpoints)}")
        plan_kv = await db.get(keys.plan)
        if plan_kv is None:
            raise FaultSpecError(f"job {job_id!r} has no plan yet; retry once it has started")
        plan = planwire.decode(plan_kv.value)
        if fault.host is not None:
            return await _inject_host(db, keys, plan, hosts, fault)
        live = {kv.key.removeprefix(keys.workers) for kv in await db.get_prefix(keys.workers)}
        done = await db.get(keys.done) is not None
        problem = fault_target_error(job_id, fault, plan, live, done)
        if problem:
            raise FaultSpecError(problem)
        assert fault.rank is not None
        fault_id = await submit_fault(db, keys, fault)
    finally:
        await db.close()
    return {
        "fault_id": fault_id,
        "fault": fault.to_dict(),
        "target": plan.workers[fault.rank],
        "epoch": plan.epoch,
    }


def inject_fault(
    job_id: str,
    etcd: str | None,
    fault: FaultSpec,
    timeout: float = 5.0,
    tls: EtcdTLSConfig | None = None,
) -> dict[str, Any]:
    endpoints, security = resolve_etcd(job_id, etcd, tls)
    return asyncio.run(_inject(job_id, endpoints, security, fault, timeout))


async def _inject_host(
    db: Etcd, keys: JobKeys, plan: Plan, hosts: dict[str, Any], fault: FaultSpec
) -> dict[str, Any]:
    """Whole-host faults: ``host`` goes through etcd to the host's daemon, which kills itself and
    its workers; ``partition`` cuts the host's links here, which needs the host to be a network
    namespace on this machine (the multi-host test bed)."""
    info = hosts.get(fault.host or "")
    if info is None:
        raise FaultSpecError(
            f"no live host {fault.host!r} in job {keys.job_id!r} (live: {', '.join(sorted(hosts))})"
        )
    result = {"fault": fault.to_dict(), "target": fault.host, "epoch": plan.epoch}
    if fault.kind is FaultKind.HOST:
        return {"fault_id": await submit_fault(db, keys, fault), **result}
    if not info.get("netns"):
        raise FaultSpecError(
            f"partition needs host {fault.host!r} to run in a network namespace of this machine "
            "(the netns test bed); it does not, so there is no link to cut here"
        )
    t = time.time()
    cut = set_links(info["netns"], up=False)
    # Recorded in etcd after the cut: the leader logs it, so the report can time the incident.
    fault_id = await submit_fault(db, keys, fault)
    return {"fault_id": fault_id, **result, "t": t, "netns": info["netns"], "links": cut}
