"""Library functions behind ``status`` and ``inject-fault``: read/write a job's etcd keys."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.launch import find_job
from elaswave.daemon.supervisor import submit_fault
from elaswave.errors import FaultSpecError, JobNotFound
from elaswave.faults import FaultSpec
from elaswave.keys import JobKeys
from elaswave.plan import Plan


def resolve_etcd(job_id: str, etcd: str | None) -> list[str]:
    if etcd:
        return [e for e in etcd.split(",") if e.strip()]
    return list(find_job(job_id)["etcd"])


async def _status(job_id: str, endpoints: list[str], timeout: float) -> dict[str, Any]:
    db = await Etcd.connect(endpoints, timeout=timeout)
    keys = JobKeys(job_id)
    try:
        hosts = [kv.json() for kv in await db.get_prefix(keys.hosts)]
        workers = {kv.json()["worker_id"]: kv.json() for kv in await db.get_prefix(keys.workers)}
        plan_kv = await db.get(keys.plan)
        progress_kv = await db.get(keys.progress)
        incidents_kv = await db.get(keys.incidents)
        leader_kv = await db.get(keys.leader)
        done_kv = await db.get(keys.done)
    finally:
        await db.close()
    if not hosts and plan_kv is None:
        raise JobNotFound(f"no job {job_id!r} in etcd at {', '.join(endpoints)}")
    plan = Plan.from_json(plan_kv.value) if plan_kv else None
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
        "done": json.loads(done_kv.value) if done_kv else None,
    }


def _stage(plan: Plan, rank: int) -> dict[str, Any]:
    """Pipelines: the rank's place in the data × pipeline grid and the layers it owns."""
    if not plan.is_pipeline:
        return {}
    replica, stage = plan.position(rank)
    layers = plan.stage_layers(rank)
    return {"replica": replica, "stage": stage, "layers": [layers.start, layers.stop]}


def job_status(job_id: str, etcd: str | None, timeout: float = 5.0) -> dict[str, Any]:
    return asyncio.run(_status(job_id, resolve_etcd(job_id, etcd), timeout))


async def _inject(
    job_id: str, endpoints: list[str], fault: FaultSpec, timeout: float
) -> dict[str, Any]:
    db = await Etcd.connect(endpoints, timeout=timeout)
    keys = JobKeys(job_id)
    try:
        if not await db.get_prefix(keys.hosts):
            raise JobNotFound(f"no running job {job_id!r} in etcd at {', '.join(endpoints)}")
        plan_kv = await db.get(keys.plan)
        if plan_kv is None:
            raise FaultSpecError(f"job {job_id!r} has no plan yet; retry once it has started")
        plan = Plan.from_json(plan_kv.value)
        assert fault.rank is not None
        if fault.rank >= plan.world_size:
            raise FaultSpecError(
                f"rank {fault.rank} out of range: job {job_id!r} has ranks 0..{plan.world_size - 1}"
            )
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
    job_id: str, etcd: str | None, fault: FaultSpec, timeout: float = 5.0
) -> dict[str, Any]:
    return asyncio.run(_inject(job_id, resolve_etcd(job_id, etcd), fault, timeout))
