"""The campaign and the planner without a daemon: candidates on a real etcd, each with its own
lease, host key and worker key. One is elected and publishes the first plan; when it goes, the
other takes over and plans without it; a leader whose leadership is revoked stops planning."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest

from elaswave.config import ElasticConfig, JobConfig
from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.daemon.jobstore import JobStore
from elaswave.daemon.leader import Candidate, Leadership, Planner, campaign
from elaswave.keys import JobKeys
from elaswave.planning.plan import Plan
from elaswave.wire_etcd import WorkerInfo

_jobs = itertools.count()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with EmbeddedEtcd() as etcd:
        yield etcd.endpoint


class Host:
    """A candidate as a daemon would make it, with what it recorded."""

    def __init__(self, store: JobStore, cfg: JobConfig, host_id: str, lease: Any) -> None:
        self.host_id = host_id
        self.lease = lease
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.registered = asyncio.Event()
        self.registered.set()
        self.candidate = Candidate(
            store=store,
            cfg=cfg,
            host_id=host_id,
            store_address=f"{host_id}:1",
            emit=lambda kind, **fields: self.events.append((kind, fields)),
            leadership=Leadership(),
            registered=self.registered,
            lease=lambda: self.lease,
            stopping=lambda: False,
        )
        self.task: asyncio.Task[None] | None = None

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [fields for k, fields in self.events if k == kind]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


async def _register(etcd: Etcd, keys: JobKeys, host_id: str, lease: Any, slot: int = 0) -> str:
    wid = f"{host_id}.w{slot}"
    await etcd.put(keys.host(host_id), "{}", lease=lease)
    info = {"worker_id": wid, "host": host_id, "pid": 1, "slot": slot}
    await etcd.put(keys.worker(wid), json.dumps(info), lease=lease)
    return wid


async def _plan_where(store: JobStore, ok: Callable[[Plan], bool], timeout: float) -> Plan:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        plan, _ = await store.read_plan()
        if plan is not None and ok(plan):
            return plan
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"no such plan within {timeout}s (last: {plan})")
        await asyncio.sleep(0.05)


def run(endpoint: str, body: Callable[[Etcd, JobStore, JobConfig], Awaitable[None]]) -> None:
    async def main() -> None:
        cfg = JobConfig(
            job_id=f"campaign-{next(_jobs)}", elastic=ElasticConfig(nproc_per_node=1, nnodes="2:2")
        )
        keys = JobKeys(cfg.job_id)
        etcd = await Etcd.connect([endpoint], prefix=keys.prefix, timeout=5.0)
        try:
            await asyncio.wait_for(body(etcd, JobStore(etcd, keys), cfg), 60)
        finally:
            await etcd.close()

    asyncio.run(main())


def test_one_leader_plans_and_the_other_takes_over_when_it_goes(endpoint: str) -> None:
    async def body(etcd: Etcd, store: JobStore, cfg: JobConfig) -> None:
        hosts = []
        for host_id in ("h0", "h1"):
            lease = await etcd.lease(30)
            await _register(etcd, store.keys, host_id, lease)
            hosts.append(Host(store, cfg, host_id, lease))
        for h in hosts:
            h.task = asyncio.create_task(campaign(h.candidate))
        try:
            first = await _plan_where(store, lambda p: True, 20)
            assert first.workers == ("h0.w0", "h1.w0")  # in registration order
            [leader] = [h for h in hosts if h.of("leader_elected")]
            [other] = [h for h in hosts if h is not leader]
            assert leader.candidate.leadership.held and not other.candidate.leadership.held
            assert first.store == f"{leader.host_id}:1"
            assert [e["epoch"] for e in leader.of("plan_published")] == [first.epoch]
            assert not other.of("plan_published")

            await leader.stop()  # the leader's host dies: its lease goes, and its keys with it
            await etcd.revoke_lease(leader.lease)
            second = await _plan_where(store, lambda p: p.epoch > first.epoch, 20)
            assert second.workers == (f"{other.host_id}.w0",)
            assert f"host {leader.host_id} lost" in second.reason
            assert other.of("leader_elected") and other.candidate.leadership.held
            assert [e["host"] for e in other.of("host_lost")] == [leader.host_id]
            assert await store.leader() == other.host_id
        finally:
            for h in hosts:
                await h.stop()

    run(endpoint, body)


def test_a_revoked_leader_stops_planning_until_registered_again(endpoint: str) -> None:
    async def body(etcd: Etcd, store: JobStore, cfg: JobConfig) -> None:
        lease = await etcd.lease(30)
        for host_id in ("h0", "h1"):  # one daemon's view is enough: both hosts' keys, one lease
            await _register(etcd, store.keys, host_id, lease)
        h = Host(store, cfg, "h0", lease)
        h.task = asyncio.create_task(campaign(h.candidate))
        try:
            first = await _plan_where(store, lambda p: True, 20)
            assert h.candidate.leadership.held

            h.registered.clear()  # as the control plane does when the lease expired
            h.candidate.leadership.revoke()
            assert not h.candidate.leadership.held
            await etcd.delete(store.keys.worker("h1.w0"))  # a change a planner would act on
            await asyncio.sleep(1.5)
            assert (await store.read_plan())[0] == first  # nobody planned the change
            assert len(h.of("plan_published")) == 1

            h.registered.set()  # registered again: it still holds the key and plans on
            second = await _plan_where(store, lambda p: p.epoch > first.epoch, 20)
            assert second.workers == ("h0.w0",)
            assert h.candidate.leadership.held
            assert len(h.of("leader_elected")) == 1  # held throughout: not elected again
        finally:
            await h.stop()

    run(endpoint, body)


def test_a_worker_that_leaves_while_its_reason_is_read_is_planned_with_its_reason(
    endpoint: str,
) -> None:
    """The departures are read at one revision and the roster is kept by a watch: a worker
    whose departure lands after that read, and whose deletion the watch applies before the
    planner looks at the roster, still comes with its reason (no plan drops it without one)."""

    async def body(etcd: Etcd, store: JobStore, cfg: JobConfig) -> None:
        lease = await etcd.lease(30)
        w0 = await _register(etcd, store.keys, "h0", lease)
        w1 = await _register(etcd, store.keys, "h1", lease)
        planner = Planner(Host(store, cfg, "h0", lease).candidate)
        watcher = asyncio.create_task(planner._watch(await planner._read_roster() + 1))
        take = store.take_departures
        why = f"worker {w1} (rank 1) killed by SIGKILL"

        async def late(*args: Any, **kwargs: Any) -> tuple[list[str], int, int]:
            taken = await take(*args, **kwargs)
            if taken[0] or w1 not in planner.roster:
                return taken
            await store.record_departure(w1, why, lease=lease)  # after the read, before
            while w1 in planner.roster:  # its answer: the watch applies the deletion first
                await asyncio.sleep(0.01)
            return taken

        store.take_departures = late  # type: ignore[method-assign]
        try:
            members, causes = await planner._read_members()
            assert [m.worker_id for m in members] == [w0]
            assert causes == [why]
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    run(endpoint, body)


def test_a_departure_with_a_spare_as_successor_is_one_plan_of_the_same_size(
    endpoint: str,
) -> None:
    """A warm spare registered in the departure's own write: the next plan drops the dead
    worker and admits the spare at once (no plan without it, then a grow), with the cause."""

    async def body(etcd: Etcd, store: JobStore, cfg: JobConfig) -> None:
        lease = await etcd.lease(30)
        w0 = await _register(etcd, store.keys, "h0", lease)
        w1 = await _register(etcd, store.keys, "h1", lease)
        h = Host(store, cfg, "h0", lease)
        h.task = asyncio.create_task(campaign(h.candidate))
        try:
            first = await _plan_where(store, lambda p: True, 20)
            assert first.workers == (w0, w1)
            spare = WorkerInfo(worker_id="h1.s0", host="h1", pid=2, slot=0)
            why = f"worker {w1} (rank 1) killed by SIGKILL"
            await store.record_departure(w1, why, lease=lease, successor=spare)
            second = await _plan_where(store, lambda p: p.epoch > first.epoch, 20)
            assert set(second.workers) == {w0, "h1.s0"} and why in second.reason
            await asyncio.sleep(1.0)  # nothing else to plan: no further epoch
            assert (await store.read_plan())[0] == second
            assert len(h.of("plan_published")) == 2
        finally:
            await h.stop()

    run(endpoint, body)
