"""Plans: micro-batch assignment, rank order, the next-plan function and the JSON form."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from elaswave.planning import planwire
from elaswave.planning.plan import (
    Member,
    Plan,
    assign_microbatches,
    by_host,
    capped,
    listed,
    moved_store,
    next_plan,
    order_members,
    reshared_plan,
)

# ---- assign_microbatches ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (16, [1, 1, 1, 1], (4, 4, 4, 4)),
        (16, [1, 1, 1], (6, 5, 5)),  # ties: the lower rank gets the extra one
        (17, [1, 1, 1], (6, 6, 5)),
        (5, [1, 1, 1, 1], (2, 1, 1, 1)),
        (10, [3, 1], (8, 2)),  # exact 7.5 / 2.5: tie on the remainder, lower rank wins
        (10, [1, 3], (3, 7)),
        (7, [2, 1], (5, 2)),
        (12, [0.5, 0.25, 0.25], (6, 3, 3)),
        (3, [1, 0, 1], (2, 0, 1)),  # zero weight: nothing
        (1, [1], (1,)),
        (0, [1, 1], (0, 0)),
        (1, [1, 1, 1], (1, 0, 0)),  # fewer micro-batches than ranks
        (6, [100, 1], (5, 1)),  # every positive weight gets at least one
        (4, [1, 1e-9, 1e-9, 1e-9], (1, 1, 1, 1)),
        (6, [10, 1, 1, 1, 1, 1], (1, 1, 1, 1, 1, 1)),  # one donor, drained down to one
        (4, [5, 1, 1, 1, 1, 1], (1, 1, 1, 1, 0, 0)),  # nobody left with more than one to give
    ],
)
def test_assign_table(total: int, weights: list[float], expected: tuple[int, ...]) -> None:
    assert assign_microbatches(total, weights) == expected


@pytest.mark.parametrize(
    "weights",
    [[], [0], [0, 0, 0], [1, -1], [-1], [0.0, -0.0]],
)
def test_assign_rejects_bad_weights(weights: list[float]) -> None:
    with pytest.raises(ValueError):
        assign_microbatches(8, weights)


def _random_case(rng: random.Random) -> tuple[int, list[float]]:
    n = rng.randint(1, 12)
    style = rng.choice(["equal", "ints", "floats", "with_zeros", "skewed"])
    if style == "equal":
        weights = [1.0] * n
    elif style == "ints":
        weights = [float(rng.randint(1, 5)) for _ in range(n)]
    elif style == "floats":
        weights = [rng.uniform(0.01, 10.0) for _ in range(n)]
    elif style == "with_zeros":
        weights = [rng.choice([0.0, rng.uniform(0.1, 3.0)]) for _ in range(n)]
    else:
        weights = [rng.choice([1e-3, 1.0, 1e3]) for _ in range(n)]
    if sum(weights) <= 0:
        weights[rng.randrange(n)] = 1.0
    return rng.randint(0, 64), weights


RANDOM_CASES = [_random_case(random.Random(20240601 + i)) for i in range(1500)]


def test_assign_properties_randomized() -> None:
    for total, weights in RANDOM_CASES:
        counts = assign_microbatches(total, weights)
        where = f"total={total} weights={weights} counts={counts}"
        assert len(counts) == len(weights), where
        assert sum(counts) == total, where
        assert all(isinstance(c, int) and c >= 0 for c in counts), where
        assert assign_microbatches(total, list(weights)) == counts, where  # deterministic
        positive = [r for r, w in enumerate(weights) if w > 0]
        for r, w in enumerate(weights):
            if w == 0:
                assert counts[r] == 0, where
        if total >= len(positive):
            assert all(counts[r] >= 1 for r in positive), where
        exact = [total * w / sum(weights) for w in weights]
        if all(exact[r] >= 1 for r in positive):
            # The at-least-one guarantee has nothing to do: plain largest remainder.
            assert all(abs(c - e) < 1 for c, e in zip(counts, exact, strict=True)), where
        if len(set(weights)) == 1:
            # Equal weights: balanced to within one, extras on the lowest ranks.
            assert max(counts) - min(counts) <= 1, where
            assert list(counts) == sorted(counts, reverse=True), where


def test_assign_random_cases_cover_the_interesting_regimes() -> None:
    # Guard the property test against a generator that stopped producing the hard cases.
    assert any(0.0 in w for _, w in RANDOM_CASES)
    assert any(t < len(w) for t, w in RANDOM_CASES)
    assert any(t == 0 for t, _ in RANDOM_CASES)
    assert any(t >= len(w) and any(0 < t * x / sum(w) < 1 for x in w) for t, w in RANDOM_CASES)


@pytest.mark.parametrize(("total", "n"), [(t, n) for t in (7, 16, 31) for n in (2, 3, 5)])
def test_assign_equal_weights_ties_go_to_lower_ranks(total: int, n: int) -> None:
    counts = assign_microbatches(total, [1.0] * n)
    base, extra = divmod(total, n)
    assert counts == tuple([base + 1] * extra + [base] * (n - extra))


# ---- order_members ---------------------------------------------------------------------------


def member(worker_id: str, order: int, host: str = "h0", rack: str = "") -> Member:
    return Member(worker_id=worker_id, host=host, order=order, rack=rack)


def plan_with(workers: list[str], epoch: int = 1, total: int = 16) -> Plan:
    return Plan(
        epoch=epoch,
        workers=tuple(workers),
        hosts=tuple("h0" for _ in workers),
        microbatches=assign_microbatches(total, [1.0] * len(workers)),
        store="127.0.0.1:1",
    )


def test_order_members_without_plan_is_join_order() -> None:
    members = [member("c", 30), member("a", 10), member("b", 20)]
    assert [m.worker_id for m in order_members(None, members)] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("prev", "members", "expected"),
    [
        # Survivors keep their previous relative order even if their join order disagrees.
        (["d", "a", "c", "b"], [("a", 1), ("b", 2), ("c", 3), ("d", 4)], ["d", "a", "c", "b"]),
        (["d", "a", "c", "b"], [("a", 1), ("c", 3), ("d", 4)], ["d", "a", "c"]),
        # Newcomers go after the survivors, in join order, whatever the input order.
        (["w0", "w1"], [("w9", 50), ("w1", 2), ("w5", 10), ("w0", 1)], ["w0", "w1", "w5", "w9"]),
        (["w0", "w1", "w2"], [("w2", 3), ("w7", 0)], ["w2", "w7"]),  # early order, still after
        (["w0"], [], []),
    ],
)
def test_order_members_keeps_survivors_then_newcomers(
    prev: list[str], members: list[tuple[str, int]], expected: list[str]
) -> None:
    got = order_members(plan_with(prev), [member(w, o) for w, o in members])
    assert [m.worker_id for m in got] == expected


def test_order_members_is_independent_of_input_order() -> None:
    prev = plan_with(["b", "a"])
    members = [member("a", 1), member("b", 2), member("x", 9), member("y", 5)]
    results = {
        tuple(m.worker_id for m in order_members(prev, list(p)))
        for p in itertools.permutations(members)
    }
    assert results == {("b", "a", "y", "x")}


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], []),
        (["a@h0", "b@h1", "c@h0", "d@h1"], ["a@h0", "c@h0", "b@h1", "d@h1"]),
        # hosts come in the order of their first member; members keep their order in a host
        (["d@h1", "a@h0", "b@h1", "c@h0"], ["d@h1", "b@h1", "a@h0", "c@h0"]),
        (["a@h0", "b@h1", "c@h2", "d@h1", "e@h0"], ["a@h0", "e@h0", "b@h1", "d@h1", "c@h2"]),
        (["a@h0", "b@h0"], ["a@h0", "b@h0"]),
    ],
)
def test_by_host(given: list[str], expected: list[str]) -> None:
    members = [member(w, i, host=h) for i, (w, h) in enumerate(x.split("@") for x in given)]
    assert [f"{m.worker_id}@{m.host}" for m in by_host(members)] == expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        # racks in the order of their first member, hosts in a rack in theirs
        (["a@h0@A", "b@h1@B", "c@h2@A", "d@h0@A"], ["a@h0@A", "d@h0@A", "c@h2@A", "b@h1@B"]),
        (["b@h1@B", "a@h0@A", "c@h2@A"], ["b@h1@B", "a@h0@A", "c@h2@A"]),
        # hosts without a rack are one tier of their own
        (["a@h0@", "b@h1@A", "c@h2@", "d@h3@A"], ["a@h0@", "c@h2@", "b@h1@A", "d@h3@A"]),
    ],
)
def test_by_host_goes_rack_by_rack(given: list[str], expected: list[str]) -> None:
    members = [
        member(w, i, host=h, rack=r) for i, (w, h, r) in enumerate(x.split("@") for x in given)
    ]
    assert [f"{m.worker_id}@{m.host}@{m.rack}" for m in by_host(members)] == expected


@pytest.mark.parametrize(
    ("hosts", "racks", "domains"),
    [
        (("h0", "h0", "h1"), (), ("h0", "h0", "h1")),  # no racks: the hosts
        (("h0", "h1", "h2"), (("h0", "A"), ("h1", "A"), ("h2", "A")), ("h0", "h1", "h2")),
        (("h0", "h1", "h2"), (("h0", "A"), ("h1", "A"), ("h2", "B")), ("A", "A", "B")),
        # a host without a rack is a domain of its own beside the racks
        (("h0", "h1", "h2"), (("h0", "A"), ("h1", "A")), ("A", "A", "")),
    ],
)
def test_plan_domains(hosts: tuple, racks: tuple, domains: tuple) -> None:
    plan = Plan(epoch=1, workers=("a", "b", "c"), hosts=hosts, microbatches=(1, 1, 1),
                store="", racks=racks)  # fmt: skip
    assert plan.domains == domains


def test_a_plan_carries_the_racks_of_its_hosts() -> None:
    live = [member("a", 1, "h0", "A"), member("b", 2, "h1", "B"), member("c", 3, "h2", "A"),
            member("d", 4, "h3")]  # fmt: skip
    plan = next_plan(None, live, num_microbatches=8, max_workers=8, store="", now=0.0)
    assert plan is not None
    assert plan.workers == ("a", "c", "b", "d")
    assert plan.racks == (("h0", "A"), ("h1", "B"), ("h2", "A"))
    assert plan.domains == ("A", "A", "B", "")
    shrunk = reshared_plan(plan, [4, 2, 2], evict=["b"], store="", now=0.0)
    assert shrunk.racks == (("h0", "A"), ("h2", "A"))
    plain = next_plan(None, [member("a", 1, "h0")], num_microbatches=8, max_workers=8,
                      store="", now=0.0)  # fmt: skip
    assert plain is not None and plain.racks == () and plain.domains == ("h0",)


def test_plans_stay_host_by_host_and_survivors_keep_their_order() -> None:
    rng = random.Random(7)
    for _ in range(200):
        live: dict[str, Member] = {}
        prev = None
        for order in range(12):
            if live and rng.random() < 0.4:
                del live[rng.choice(sorted(live))]
            else:
                w = f"w{order}"
                live[w] = member(w, order, host=f"h{rng.randrange(3)}")
            plan = next_plan(prev, list(live.values()), num_microbatches=8, max_workers=6,
                             store="h0:1", now=0.0)  # fmt: skip
            if plan is None:
                continue
            assert [h for h, _ in itertools.groupby(plan.hosts)] == list(dict.fromkeys(plan.hosts))
            if prev is not None:
                kept = [w for w in prev.workers if w in plan.workers]
                assert [w for w in plan.workers if w in kept] == kept
            prev = plan


# ---- next_plan -------------------------------------------------------------------------------

TOTAL = 16


def workers(n: int, start: int = 0) -> list[Member]:
    return [member(f"w{i}", 100 + i, host=f"h{i % 2}") for i in range(start, start + n)]


def plan_next(prev: Plan | None, members: list[Member], **kw: object) -> Plan | None:
    args: dict = {"num_microbatches": TOTAL, "max_workers": 8, "store": "h0:29500", "now": 5.0}
    args.update(kw)
    return next_plan(prev, members, **args)


def test_first_plan() -> None:
    members = workers(4)
    plan = plan_next(None, list(reversed(members)), now=12.5)
    assert plan is not None
    assert plan.epoch == 1
    assert plan.workers == ("w0", "w2", "w1", "w3")  # join order, host by host
    assert plan.hosts == ("h0", "h0", "h1", "h1")
    assert plan.microbatches == (4, 4, 4, 4)
    assert plan.departed == ()
    assert plan.store == "h0:29500" and plan.created == 12.5
    assert "start: dp 4" in plan.reason and "[4, 4, 4, 4]" in plan.reason


def test_no_change_gives_no_plan() -> None:
    first = plan_next(None, workers(4))
    assert first is not None
    assert plan_next(first, workers(4)) is None
    assert plan_next(first, list(reversed(workers(4)))) is None


def test_no_members_gives_no_plan() -> None:
    assert plan_next(None, []) is None
    assert plan_next(plan_with(["w0"]), []) is None


def test_crash_shrinks_and_grow_back() -> None:
    first = plan_next(None, workers(4))
    assert first is not None
    survivors = [m for m in workers(4) if m.worker_id != "w1"]
    second = plan_next(first, survivors, cause="worker w1 (rank 1) killed by SIGKILL", now=6.0)
    assert second is not None
    assert second.epoch == first.epoch + 1 == 2
    assert second.workers == ("w0", "w2", "w3")
    assert second.hosts == ("h0", "h0", "h1")
    assert second.departed == ("w1",)
    assert second.microbatches == (6, 5, 5)
    assert sum(second.microbatches) == TOTAL
    assert "worker w1 (rank 1) killed by SIGKILL" in second.reason
    assert "dp 4→3" in second.reason
    assert "[6, 5, 5]" in second.reason
    assert second.reason.index("killed") < second.reason.index("dp 4→3")  # cause first
    assert second.rank_of("w2") == 1 and second.rank_of("w1") is None

    # A replacement joins: it takes the next rank after its host's survivors.
    third = plan_next(second, [*survivors, member("w4", 200)], cause="worker w4 joined")
    assert third is not None
    assert third.epoch == 3
    assert third.workers == ("w0", "w2", "w4", "w3")
    assert third.departed == ()
    assert third.microbatches == (4, 4, 4, 4)
    assert "dp 3→4" in third.reason


def test_reason_without_cause_has_no_arrow_prefix() -> None:
    first = plan_next(None, workers(2))
    second = plan_next(first, workers(1))
    assert second is not None
    assert second.reason.startswith("epoch 2: dp 2→1")
    assert second.microbatches == (TOTAL,)


def test_max_workers_cap_leaves_extras_as_standbys() -> None:
    members = workers(5)
    first = plan_next(None, members, max_workers=4)
    assert first is not None
    assert first.workers == ("w0", "w2", "w1", "w3")  # the first four, host by host
    assert "w4" not in first.workers and first.world_size == 4
    # The standby alone is no change.
    assert plan_next(first, members, max_workers=4) is None
    # When a worker goes, the standby takes the free slot, after its host's survivors.
    second = plan_next(first, [m for m in members if m.worker_id != "w0"], max_workers=4)
    assert second is not None
    assert second.workers == ("w2", "w4", "w1", "w3")
    assert second.departed == ("w0",)
    assert "dp 4→4" in second.reason


def test_world_never_exceeds_micro_batches() -> None:
    plan = plan_next(None, workers(6), max_workers=8, num_microbatches=4)
    assert plan is not None
    assert plan.workers == ("w0", "w2", "w1", "w3")
    assert plan.microbatches == (1, 1, 1, 1)


@pytest.mark.parametrize(("n", "total"), [(1, 16), (3, 16), (4, 16), (5, 17), (7, 7), (3, 31)])
def test_microbatch_ranges_partition_contiguously(n: int, total: int) -> None:
    plan = plan_next(None, workers(n), num_microbatches=total)
    assert plan is not None
    ranges = [plan.microbatch_range(r) for r in range(plan.world_size)]
    assert [len(r) for r in ranges] == list(plan.microbatches)
    assert list(itertools.chain.from_iterable(ranges)) == list(range(total))
    for a, b in itertools.pairwise(ranges):
        assert a.stop == b.start


def test_epochs_increase_by_one_over_a_history() -> None:
    plan = plan_next(None, workers(4))
    assert plan is not None
    history = [plan]
    for live in (workers(3), workers(2), workers(4), workers(4, start=1)):
        nxt = plan_next(history[-1], live)
        assert nxt is not None
        history.append(nxt)
    assert [p.epoch for p in history] == [1, 2, 3, 4, 5]
    assert all(sum(p.microbatches) == TOTAL for p in history)
    for prev, cur in itertools.pairwise(history):
        assert set(cur.departed) == set(prev.workers) - set(cur.workers)


# ---- JSON ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "plan",
    [
        plan_with(["w0"]),
        Plan(
            epoch=7,
            workers=("w0", "w2", "w3"),
            hosts=("h0", "h1", "h1"),
            microbatches=(6, 5, 5),
            store="10.0.0.1:29500",
            reason="worker w1 died → epoch 7: dp 4→3, micro-batches 16 → [6, 5, 5]",
            created=1700000000.25,
            departed=("w1",),
        ),
    ],
)
def test_plan_json_round_trip(plan: Plan) -> None:
    text = planwire.encode(plan)
    assert planwire.decode(text) == plan
    assert planwire.decode(text.encode()) == plan
    assert json.loads(text)["v"] == 2  # the compact wire format (test_planwire.py has the rest)
    assert planwire.encode(plan) == text  # stable


def test_plan_from_minimal_json_uses_defaults() -> None:
    text = json.dumps(
        {"epoch": 1, "workers": ["a"], "hosts": ["h"], "microbatches": [4], "store": "s:1"}
    )
    plan = planwire.decode(text)
    assert (plan.reason, plan.created, plan.departed) == ("", 0.0, ())
    assert plan.microbatch_range(0) == range(0, 4)


# ---- reasons stay short ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "text"),
    [
        ([6, 5, 5], "[6, 5, 5]"),
        ([2] * 16, str([2] * 16)),  # up to 16 values: as they are
        ([3] * 16 + [2] * 99_976, "[16×3, 99976×2]"),
        ([5, 5, 4, *[2] * 20], "[2×5, 4, 20×2]"),
        (list(range(40)), "[" + ", ".join(map(str, range(16))) + ", … 24 more runs]"),
    ],
)
def test_listed(values: list[int], text: str) -> None:
    assert listed(values) == text


@pytest.mark.parametrize(
    ("count", "shown"),
    [
        (0, []),
        (16, [f"n{i}" for i in range(16)]),
        (20, [*(f"n{i}" for i in range(16)), "… and 4 more"]),
    ],
)
def test_capped(count: int, shown: list[str]) -> None:
    assert capped([f"n{i}" for i in range(count)]) == shown


def test_a_moved_store_keeps_the_layout_under_the_next_epoch() -> None:
    members = [Member(worker_id=f"h{i % 2}.w{i}", host=f"h{i % 2}", order=i) for i in range(4)]
    prev = next_plan(None, members, num_microbatches=16, max_workers=8, store="h0:1", now=1.0)
    prev = reshared_plan(prev, [6, 5, 5], evict=[prev.workers[0]], store="h0:1", now=2.0)
    moved = moved_store(prev, "h1:2", leader="h1", now=3.0)
    assert (moved.epoch, moved.store, moved.created) == (prev.epoch + 1, "h1:2", 3.0)
    assert (moved.workers, moved.hosts, moved.microbatches) == (
        prev.workers, prev.hosts, prev.microbatches,
    )  # fmt: skip
    assert moved.departed == moved.evicted == ()  # nobody leaves with it
    assert (
        moved.reason == f"leader h1 → epoch {moved.epoch}: the rendezvous store moved to its daemon"
    )
    assert planwire.decode(planwire.encode(moved)) == moved
    # a new leader's epochs only grow past those the job recorded
    assert moved_store(prev, "h1:2", leader="h1", now=3.0, epoch_floor=9).epoch == 10


@pytest.mark.parametrize(
    ("world", "per_rank", "counts"),
    [
        (4, None, (4, 4, 4, 4)),
        (3, None, (6, 5, 5)),  # the fixed global batch: the survivors share all 16
        (4, 4, (4, 4, 4, 4)),
        (3, 4, (4, 4, 4)),  # train.batch: shrink: 12 of the 16 micro-batches
        (1, 4, (4,)),
        (5, 4, (4, 3, 3, 3, 3)),  # more ranks than the full world's: never over the step's 16
    ],
)
def test_a_shrinking_batch_keeps_each_ranks_share(
    world: int, per_rank: int | None, counts: tuple[int, ...]
) -> None:
    live = [member(f"w{i}", i) for i in range(world)]
    plan = next_plan(None, live, num_microbatches=16, max_workers=8, store="", now=0.0,
                     per_rank=per_rank)  # fmt: skip
    assert plan is not None and plan.microbatches == counts
