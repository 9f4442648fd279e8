"""The job's keys as the planner sees them (:class:`JobStore`), against a real etcd: the plan's
compare-and-set (one winner, a stale or deposed writer loses, a lost answer is recognised),
the election key, members and departures, progress, shared measurements and the change feed."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from typing import Any, TypeVar

import pytest

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.daemon.jobstore import Change, JobChange, JobStore, PlanError
from elaswave.faults import FaultKind, FaultSpec, decode_request
from elaswave.keys import JobKeys
from elaswave.planning import planwire
from elaswave.planning.plan import Plan
from elaswave.wire_etcd import (
    Incident,
    LayerCostsReport,
    Speeds,
    WorkerInfo,
    WorkerLayerCosts,
    WorkerSpeed,
)

T = TypeVar("T")
_jobs = itertools.count()


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with EmbeddedEtcd() as etcd:
        yield etcd.endpoint


def run(endpoint: str, body: Callable[[JobStore], Awaitable[T]]) -> T:
    """``body`` on a store of a fresh job (its own prefix) in this module's etcd."""

    async def main() -> T:
        keys = JobKeys(f"jobstore-{next(_jobs)}")
        etcd = await Etcd.connect([endpoint], prefix=keys.prefix, timeout=5.0)
        try:
            return await asyncio.wait_for(body(JobStore(etcd, keys)), 30)
        finally:
            await etcd.close()

    return asyncio.run(main())


def _plan(epoch: int, workers: list[str]) -> Plan:
    return Plan(
        epoch=epoch, workers=tuple(workers), hosts=tuple(w.split(".")[0] for w in workers),
        microbatches=(1,) * len(workers), store="h0:1",
    )  # fmt: skip


# ---- the plan ------------------------------------------------------------------------------
def test_the_first_plan_is_published_once_by_the_leader(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.read_plan() == (None, 0)
        assert await s.claim_leader("h0", lease=None)
        first = _plan(1, ["h0.w0"])
        assert await s.publish_plan(first, mod_revision=0, leader="h0")
        plan, rev = await s.read_plan()
        assert plan == first and rev > 0
        # Against the same (now stale) revision, even the leader's next plan loses.
        assert not await s.publish_plan(_plan(2, ["h0.w0", "h0.w1"]), mod_revision=0, leader="h0")
        assert await s.read_plan() == (first, rev)
        second = _plan(2, ["h0.w0", "h0.w1"])
        assert await s.publish_plan(second, mod_revision=rev, leader="h0")
        plan, rev2 = await s.read_plan()
        assert plan == second and rev2 > rev

    run(endpoint, body)


def test_concurrent_publishers_one_wins(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.claim_leader("h0", lease=None)
        plans = [_plan(1, [f"h0.w{i}"]) for i in range(6)]
        won = await asyncio.gather(*(s.publish_plan(p, mod_revision=0, leader="h0") for p in plans))
        assert sum(won) == 1, won
        stored, _ = await s.read_plan()
        assert stored == plans[won.index(True)]

    run(endpoint, body)


def test_a_writer_that_came_first_wins_over_a_stale_revision(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.claim_leader("h0", lease=None)
        assert await s.publish_plan(_plan(1, ["h0.w0"]), mod_revision=0, leader="h0")
        _, rev = await s.read_plan()
        theirs = _plan(2, ["h0.w0", "h1.w0"])
        assert await s.publish_plan(theirs, mod_revision=rev, leader="h0")  # the other writer
        mine = _plan(2, ["h0.w0", "h2.w0"])
        assert not await s.publish_plan(mine, mod_revision=rev, leader="h0")
        assert (await s.read_plan())[0] == theirs

    run(endpoint, body)


def test_only_the_host_the_leader_key_names_can_publish(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert not await s.publish_plan(_plan(1, ["h1.w0"]), mod_revision=0, leader="h1")
        assert await s.claim_leader("h0", lease=None)
        assert not await s.claim_leader("h1", lease=None)
        assert await s.leader() == "h0"
        assert not await s.publish_plan(_plan(1, ["h1.w0"]), mod_revision=0, leader="h1")
        assert await s.read_plan() == (None, 0)

    run(endpoint, body)


class _LostAnswer:
    """An etcd client whose compare-and-put applies the write, then answers False (the member
    went away after applying it; the retry elsewhere found the revision moved on)."""

    def __init__(self, etcd: Etcd, meanwhile: Callable[[], Awaitable[Any]] | None = None):
        self._etcd = etcd
        self._meanwhile = meanwhile

    def __getattr__(self, name: str) -> Any:
        return getattr(self._etcd, name)

    async def compare_and_put(self, *args: Any, **kwargs: Any) -> bool:
        assert await self._etcd.compare_and_put(*args, **kwargs)
        if self._meanwhile is not None:
            await self._meanwhile()
        return False


def test_a_publish_whose_answer_was_lost_is_recognised(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.claim_leader("h0", lease=None)
        assert await s.publish_plan(_plan(1, ["h0.w0"]), mod_revision=0, leader="h0")
        _, rev = await s.read_plan()
        mine = _plan(2, ["h0.w0", "h0.w1"])
        flaky = JobStore(_LostAnswer(s.etcd), s.keys)  # type: ignore[arg-type]
        assert await flaky.publish_plan(mine, mod_revision=rev, leader="h0")
        assert (await s.read_plan())[0] == mine

    run(endpoint, body)


def test_a_lost_answer_is_found_in_the_history_after_a_later_write(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.claim_leader("h0", lease=None)
        mine, later = _plan(1, ["h0.w0"]), _plan(2, ["h0.w0", "h1.w0"])

        async def overtaken() -> None:
            _, rev = await s.read_plan()
            assert await s.publish_plan(later, mod_revision=rev, leader="h0")

        flaky = JobStore(_LostAnswer(s.etcd, overtaken), s.keys)  # type: ignore[arg-type]
        assert await flaky.publish_plan(mine, mod_revision=0, leader="h0")
        assert (await s.read_plan())[0] == later

    run(endpoint, body)


def test_a_write_that_did_not_land_is_not_taken_for_ours(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.claim_leader("h0", lease=None)
        assert await s.publish_plan(_plan(1, ["h0.w0"]), mod_revision=0, leader="h0")
        _, rev = await s.read_plan()
        theirs = _plan(2, ["h0.w0", "h1.w0"])
        assert await s.publish_plan(theirs, mod_revision=rev, leader="h0")
        # Our write against ``rev`` lost: the first put after ``rev`` is theirs, not ours.
        assert not await s.publish_plan(_plan(2, ["h2.w0"]), mod_revision=rev, leader="h0")

    run(endpoint, body)


# ---- the election --------------------------------------------------------------------------
def test_the_leader_key_lives_under_the_winners_lease(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.leader() is None
        await asyncio.wait_for(s.await_succession(), 2)  # nobody leads: at once
        lease = await s.etcd.lease(30)
        claims = await asyncio.gather(*(s.claim_leader(h, lease=lease) for h in ("a", "b", "c")))
        won = [c.won for c in claims]
        assert sorted(won) == [False, False, True]
        winner = "abc"[won.index(True)]
        assert await s.leader() == winner
        # the losers learn who won, and since when, from their own claim
        lost = [c for c in claims if not c.won]
        assert {c.holder for c in lost} == {winner} and len({c.revision for c in lost}) == 1
        waiter = asyncio.create_task(s.await_succession(since=lost[0].revision))
        await asyncio.sleep(0.2)
        await s.etcd.put(s.keys.leader, winner, lease=lease)  # written again: still there
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await s.etcd.revoke_lease(lease)  # its host went away
        await asyncio.wait_for(waiter, 5)
        assert await s.leader() is None

    run(endpoint, body)


def test_a_successor_in_line_waits_and_one_taking_the_key_holds_back_the_others(
    endpoint: str,
) -> None:
    """Once the leader key goes, the host whose turn is later waits its patience: if an
    earlier one takes the key meanwhile it goes on waiting (for that leader to go), else it
    claims."""

    async def body(s: JobStore) -> tuple[bool, float]:
        first = await s.etcd.lease(30)
        assert await s.claim_leader("a", lease=first)
        claim = await s.claim_leader("c", lease=None)
        loop = asyncio.get_running_loop()
        patient = asyncio.create_task(s.await_succession(since=claim.revision,
                                                         patience=lambda: 0.5))  # fmt: skip
        await asyncio.sleep(0.2)
        await s.etcd.revoke_lease(first)  # the leader goes
        await asyncio.sleep(0.1)
        second = await s.etcd.lease(30)
        assert await s.claim_leader("b", lease=second)  # b, earlier in line, takes it
        await asyncio.sleep(0.8)  # past c's patience: c waits on, b leads
        held_back = not patient.done()
        gone_at = loop.time()
        await s.etcd.revoke_lease(second)  # b goes too, nobody takes it: c's turn after 0.5 s
        await asyncio.wait_for(patient, 5)
        return held_back, loop.time() - gone_at

    held_back, waited = run(endpoint, body)
    assert held_back
    assert 0.45 <= waited < 3.0

    run(endpoint, body)


# ---- membership ----------------------------------------------------------------------------
def test_workers_are_listed_with_their_registration_order(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        assert await s.workers() == []
        profile = [0.5, 1.5]
        for wid, extra in (("h1.w0", {}), ("h0.w1", {"layer_seconds": profile}), ("h0.w0", {})):
            info = {"worker_id": wid, "host": wid.split(".")[0], "pid": 1, "slot": 0, **extra}
            await s.etcd.put_json(s.keys.worker(wid), info)
        await s.etcd.put_json(s.keys.worker("h0.w2"), {"worker_id": "h0.w2", "host": "h0",
                                                        "pid": 1, "slot": 2,
                                                        "layer_estimate": []})  # fmt: skip
        # Registered again (its host renewed an expired lease): it keeps its place.
        await s.register_worker(WorkerInfo(worker_id="h1.w0", host="h1", pid=2, slot=0), lease=None)
        # A malformed worker key is left out (logged), the others are read.
        await s.etcd.put_json(s.keys.worker("h9.w0"), {"worker_id": "h9.w0", "host": "h9"})
        records = {r.worker_id: r for r in await s.workers()}
        assert set(records) == {"h0.w0", "h0.w1", "h0.w2", "h1.w0"}
        by_order = sorted(records.values(), key=lambda r: r.order)
        assert [r.worker_id for r in by_order] == ["h1.w0", "h0.w1", "h0.w0", "h0.w2"]
        assert records["h0.w1"].layer_seconds == profile
        assert records["h0.w0"].layer_seconds is None
        assert records["h0.w2"].layer_estimate is None  # empty: no estimate
        member = records["h1.w0"].member
        assert (member.worker_id, member.host, member.order) == ("h1.w0", "h1", by_order[0].order)

    run(endpoint, body)


def test_departures_are_taken_once(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        await s.etcd.put(s.keys.departures + "h0.w1", "worker h0.w1 (rank 1) exit code 1")
        last = await s.etcd.put(
            s.keys.departures + "h1.w0", "worker h1.w0 (rank 2) killed by SIGKILL"
        )
        taken, newest, read_at = await s.take_departures()
        assert sorted(taken) == [
            "worker h0.w1 (rank 1) exit code 1",
            "worker h1.w0 (rank 2) killed by SIGKILL",
        ]
        assert newest == last <= read_at  # the newest departure's revision, read after it
        assert (await s.take_departures())[:2] == ([], 0)
        assert await s.etcd.get_prefix(s.keys.departures) == []

    run(endpoint, body)


def test_live_hosts_go_with_their_lease(endpoint: str) -> None:
    async def body(s: JobStore) -> set[str]:
        assert await s.live_hosts() == set()
        lease = await s.etcd.lease(30)
        await s.etcd.put(s.keys.host("h0"), "{}", lease=lease)
        await s.etcd.put(s.keys.host("h1"), "{}")
        assert await s.live_hosts() == {"h0", "h1"}
        await s.etcd.revoke_lease(lease)
        return await s.live_hosts()

    assert run(endpoint, body) == {"h1"}


# ---- progress and measurements -------------------------------------------------------------
def test_committed_step_follows_the_progress_record(endpoint: str) -> None:
    async def body(s: JobStore) -> list[int]:
        seen = [await s.committed_step()]
        await s.etcd.put_json(s.keys.progress, {"step": 7, "loss": 1.0, "writer": "h0/x"})
        seen.append(await s.committed_step())
        await s.etcd.put_json(s.keys.progress, {"step": 3, "rolled_back": True})
        seen.append(await s.committed_step())
        return seen

    assert run(endpoint, body) == [0, 7, 3]


def test_online_costs_of_live_workers_only(endpoint: str) -> None:
    async def body(s: JobStore) -> list[dict[str, float]]:
        await s.share_layer_costs(
            "h0",
            LayerCostsReport(
                {
                    "h0.w0": WorkerLayerCosts(step=4, epoch=1, layer_seconds={"0": 0.1, "1": 0.2}),
                    "h0.w1": WorkerLayerCosts(step=4, epoch=1, layer_seconds={"0": 0.3}),  # gone
                }
            ),
            lease=None,
        )
        await s.etcd.put_json(
            s.keys.costs + "h2",
            {"h0.w2": {"step": 4, "epoch": 1, "layer_seconds": [0.1]}},  # malformed
        )
        await s.etcd.put(s.keys.costs + "h1", json.dumps(["not", "a", "mapping"]))
        return await s.online_costs({"h0.w0", "h0.w2", "h1.w0"})

    assert run(endpoint, body) == [{"0": 0.1, "1": 0.2}]


def test_incidents_keep_the_newest(endpoint: str) -> None:
    async def body(s: JobStore) -> Any:
        for epoch in range(1, 6):
            await s.record_incident(Incident(t=0.5, epoch=epoch, reason="r", fault=False), keep=3)
        kv = await s.etcd.get(s.keys.incidents)
        return kv.json() if kv else None

    assert [i["epoch"] for i in run(endpoint, body)] == [3, 4, 5]


def test_faults_stop_and_done(endpoint: str) -> None:
    async def body(s: JobStore) -> None:
        fault = FaultSpec(kind=FaultKind.KILL, rank=1)
        fault_id = await s.submit_fault(fault)
        kv = await s.etcd.get(s.keys.fault(fault_id))
        assert kv is not None and decode_request(kv.value) == fault
        assert not await s.is_done()
        await s.etcd.put_json(s.keys.done, {"step": 10})
        assert await s.is_done()
        await s.stop_job("restart loop")
        kv = await s.etcd.get(s.keys.stop)
        assert kv is not None and kv.json()["reason"] == "restart loop"

    run(endpoint, body)


# ---- following the plans ---------------------------------------------------------------------
def test_a_host_follows_the_plans_by_their_deltas(endpoint: str) -> None:
    """A host holding the plan a new one follows gets it from the small delta key; one that
    missed an epoch, or holds nothing, reads the whole plan; a value that does not decode comes
    as a PlanError, and the follower goes on."""

    async def body(s: JobStore) -> tuple[list[Plan | PlanError], list[str]]:
        assert await s.claim_leader("h0", lease=None)
        p1 = _plan(1, ["h0.w0", "h0.w1", "h1.w0"])
        p2 = replace(_plan(2, ["h0.w0", "h1.w0"]), departed=("h0.w1",))
        p3 = _plan(3, ["h0.w0", "h1.w0", "h2.w0"])
        p4 = _plan(4, ["h1.w0", "h2.w0"])
        got: list[Plan | PlanError] = []
        how: list[str] = []  # per plan: read "whole" or applied as a "delta"
        held: list[Plan] = []

        class Counting(JobStore):
            decodes = 0

            def decode(self, value: bytes) -> Plan | PlanError:
                self.decodes += 1
                return super().decode(value)

        follower = Counting(s.etcd, s.keys)

        async def follow() -> None:
            decodes = 0
            async for plan in follower.plans(lambda: held[-1] if held else None):
                got.append(plan)
                how.append("whole" if follower.decodes > decodes else "delta")
                decodes = follower.decodes
                if isinstance(plan, Plan):  # the host is made to miss epoch 2
                    held.append(p1 if plan.epoch == 2 else plan)
                if len(got) == 6:
                    return

        async def followed(n: int) -> None:  # each change is taken before the next is made
            while len(got) < n:
                await asyncio.sleep(0.01)

        task = asyncio.create_task(follow())
        rev = 0
        for n, (base, plan) in enumerate(((None, p1), (p1, p2), (p2, p3)), 1):
            assert await s.publish_plan(plan, mod_revision=rev, leader="h0", base=base)
            _, rev = await s.read_plan()
            await followed(n)
        await s.etcd.put(s.keys.delta, b"not a delta")  # the whole plan again: p3
        await followed(4)
        await s.etcd.put(s.keys.plan, b"{broken")
        await s.etcd.put(s.keys.delta, b"{}")
        await followed(5)
        kv = await s.etcd.get(s.keys.plan)
        assert kv is not None
        assert await s.publish_plan(p4, mod_revision=kv.mod_revision, leader="h0", base=p3)
        await asyncio.wait_for(task, 10)
        return got, how

    got, how = run(endpoint, body)
    plans = [p.epoch if isinstance(p, Plan) else "error" for p in got]
    # p1: nothing held, the whole plan; p2: a delta onto p1; p3: its base p2 is not held (the
    # host was made to miss it), the whole plan; a junk delta: the whole plan (p3 again: the
    # daemon ignores a plan it holds); a broken plan key: its error; p4: a delta onto p3
    assert plans == [1, 2, 3, 3, "error", 4]
    assert how == ["whole", "delta", "whole", "whole", "whole", "delta"]
    assert isinstance(got[4], PlanError) and "malformed plan" in str(got[4])


# ---- the change feed -----------------------------------------------------------------------
def test_changes_name_what_planning_reacts_to(endpoint: str) -> None:
    async def body(s: JobStore) -> list[JobChange]:
        k = s.keys
        lease = await s.etcd.lease(30)
        await s.etcd.put(k.host("h1"), "{}", lease=lease)
        rev = await s.revision()
        seen: list[JobChange] = []

        async def collect() -> None:
            async for change in s.changes(rev + 1):
                seen.append(change)
                if change.kind is Change.DONE:
                    return

        task = asyncio.create_task(collect())
        await s.etcd.put(k.host("h2"), "{}")  # a host joins: nothing to plan
        worker = WorkerInfo(worker_id="h1.w0", host="h1", pid=1, slot=0)
        await s.register_worker(worker, lease=lease)
        await s.etcd.put(k.departures + "h1.w1", "gone")
        await s.etcd.delete(k.departures + "h1.w1")  # taken by the planner: nothing
        speeds = Speeds({"h1.w0": WorkerSpeed(epoch=1, per_mb=[0.5])})
        await s.share_speeds("h1", speeds, lease=lease)
        await s.etcd.put(k.plan, planwire.encode(_plan(1, ["h1.w0"])))  # the plan itself: nothing
        await s.etcd.put_json(k.progress, {"step": 1})  # progress: nothing
        await s.etcd.revoke_lease(lease)  # h1 goes: its host, worker and speed keys
        await s.etcd.put_json(k.done, {"step": 1})
        await asyncio.wait_for(task, 10)
        return seen

    seen = run(endpoint, body)
    kinds = [(c.kind, c.host) for c in seen]
    assert kinds[:3] == [
        (Change.MEMBERSHIP, ""),  # the worker registered
        (Change.MEMBERSHIP, ""),  # the departure
        (Change.SPEED, "h1"),
    ]
    assert seen[2].speeds == Speeds({"h1.w0": WorkerSpeed(epoch=1, per_mb=[0.5])})
    # what the leader keeps its roster with: the record registered, the worker whose key went
    assert seen[0].worker is not None and seen[0].worker.worker_id == "h1.w0"
    assert [c.gone for c in seen[3:6] if c.gone] == ["h1.w0"]
    revisions = [c.revision for c in seen]
    assert revisions == sorted(revisions) and revisions[0] > 0
    # The lease's keys go in one revision, in key order: hosts/, speed/, workers/.
    assert sorted(kinds[3:6], key=str) == sorted(
        [(Change.HOST_GONE, "h1"), (Change.SPEED_GONE, "h1"), (Change.MEMBERSHIP, "")], key=str
    )
    assert kinds[6:] == [(Change.DONE, "")]


# ---- the client's one-round-trip compare-and-set -------------------------------------------
def test_compare_and_put_get_returns_the_key_as_it_is_after(endpoint: str) -> None:
    """Held: the value just written with its new revision; failed: the value that made the
    compare fail (what a read would have returned)."""

    async def body(s: JobStore) -> None:
        etcd, k = s.etcd, s.keys.progress
        ok, kv = await etcd.compare_and_put_get(k, "one", mod_revision=0)
        assert ok and kv is not None and kv.value == b"one"
        now = await etcd.get(k)
        assert now is not None and now.mod_revision == kv.mod_revision
        ok, stale = await etcd.compare_and_put_get(k, "two", mod_revision=kv.mod_revision - 1)
        assert not ok and stale is not None and stale.value == b"one"
        assert stale.mod_revision == kv.mod_revision
        ok, kv2 = await etcd.compare_and_put_get(k, "two", mod_revision=kv.mod_revision)
        assert ok and kv2 is not None and kv2.value == b"two"
        assert kv2.mod_revision > kv.mod_revision
        assert kv2.create_revision == kv.create_revision

    run(endpoint, body)


def test_a_job_cleared_for_its_start_keeps_its_start_key_and_other_jobs_keys(
    endpoint: str,
) -> None:
    """The host that holds a job's start key clears what is stale under the job's prefix but the
    key itself; a job whose id extends this one's (``j`` and ``j0``) keeps its keys."""

    async def main() -> tuple[list[bool], list[str], list[str]]:
        keys, other = JobKeys("clear-j"), JobKeys("clear-j0")
        root = await Etcd.connect([endpoint], prefix="/elaswave/", timeout=5.0)
        try:
            for key in (keys.plan, keys.progress, keys.host("h1"), keys.worker("h1.w0"),
                        other.plan, other.host("h1")):  # fmt: skip
                await root.put(key, "stale")
            lock = await root.lease(5)
            won = [await root.create(keys.starting, h, lease=lock) for h in ("h0", "h1")]
            await root.delete_prefix_but(keys.prefix, keys.starting)
            mine = [kv.key for kv in await root.get_prefix(keys.prefix)]
            theirs = [kv.key for kv in await root.get_prefix(other.prefix)]
            await root.revoke_lease(lock)
            return won, mine, theirs
        finally:
            await root.close()

    won, mine, theirs = asyncio.run(main())
    assert won == [True, False]  # one host starts the job
    assert mine == [JobKeys("clear-j").starting]
    assert sorted(theirs) == sorted([JobKeys("clear-j0").plan, JobKeys("clear-j0").host("h1")])
