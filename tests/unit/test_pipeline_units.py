"""Pure parts of pipeline parallelism: the plan maker, the 1F1B schedule, layer transfers."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.planning.partition import COMPUTE_ONLY, NoCutFits, PartitionError, StageMemory
from elaswave.planning.pipeplan import (
    balanced_shares,
    next_pipeline_plan,
    respeed_pipeline_plan,
    serving_shares,
)
from elaswave.planning.plan import Member
from elaswave.planning.schedule import (
    Comm,
    Compute,
    LayerTransfer,
    plan_layer_transfers,
    schedule_1f1b,
    schedule_roles,
    transfer_stats,
)
from elaswave.planning.stageshards import LayersLost
from elaswave.runtime.workload.gpt import gpt_layer_costs

COSTS = gpt_layer_costs(vocab_size=256, seq_len=64, d_model=128, n_layer=2)  # 4 layers
UNIFORM = (1.0,) * 6


def members(*ids: str) -> list[Member]:
    return [Member(worker_id=w, host=f"h{i % 2}", order=i) for i, w in enumerate(ids)]


def plan(prev, ids, *, pp=2, costs=COSTS, policy="reshard", max_workers=8, memory=COMPUTE_ONLY):
    return next_pipeline_plan(
        prev, members(*ids), pp=pp, costs=costs, num_microbatches=16,
        max_workers=max_workers, store="s:1", now=0.0, policy=policy, memory=memory,
    )  # fmt: skip


# ---- plans ----------------------------------------------------------------------------------
def test_start_cuts_full_replicas_and_leaves_standbys() -> None:
    p = plan(None, ["a", "b", "c", "d", "e"])
    assert p.workers == ("a", "b", "c", "d")  # "e" cannot fill a replica: standby
    assert p.replicas == ((0, 1), (2, 3))
    assert p.bounds == ((0, 2, 4), (0, 2, 4))
    assert p.shares == (8, 8) and p.microbatches == (8, 8, 8, 8)
    assert [p.microbatch_range(r) for r in range(4)] == [range(0, 8)] * 2 + [range(8, 16)] * 2
    assert [p.stage_layers(r) for r in range(4)] == [range(0, 2), range(2, 4)] * 2


@pytest.mark.parametrize(
    ("lost", "replicas", "bounds", "shares"),
    [
        # replica 0 loses its last stage: its first stage takes every layer, runs fewer samples
        ("b", ((0,), (1, 2)), ((0, 4), (0, 2, 4)), (6, 10)),
        ("a", ((0,), (1, 2)), ((0, 4), (0, 2, 4)), (6, 10)),
        ("d", ((0, 1), (2,)), ((0, 2, 4), (0, 4)), (10, 6)),
    ],
)
def test_stage_loss_keeps_replica_in_service(lost, replicas, bounds, shares) -> None:
    ids = ["a", "b", "c", "d"]
    p1 = plan(None, ids)
    p2 = plan(p1, [w for w in ids if w != lost])
    assert p2.epoch == 2 and lost not in p2.workers
    assert (p2.replicas, p2.bounds, p2.shares) == (replicas, bounds, shares)
    assert sum(p2.shares) == 16  # the global batch never changes
    assert p2.departed == (lost,)


# an embedding that weighs much and costs little, three blocks, a head
HEAVY_EMBEDDING = StageMemory((8.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 4.0))
SKEWED = (0.2, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.5)


def test_the_cut_bounds_each_stage_s_bytes() -> None:
    """Compute alone puts the embedding with three blocks (14 of 24 bytes); held to 1.1 × an
    even share, the first stage gives one block up. A stage loss re-cuts within the cap too."""
    assert plan(None, ["a", "b"], costs=SKEWED).bounds == ((0, 4, 8),)
    p1 = plan(None, ["a", "b", "c", "d"], costs=SKEWED, memory=HEAVY_EMBEDDING)
    assert p1.bounds == ((0, 3, 8), (0, 3, 8))
    p3 = plan(None, list("abcdef"), pp=3, costs=SKEWED, memory=HEAVY_EMBEDDING)
    p4 = plan(p3, list("abcdf"), pp=3, costs=SKEWED, memory=HEAVY_EMBEDDING)  # "e" lost
    assert p4.bounds[1] == (0, 3, 8)  # its two survivors, the bytes held to 1.1 × 12


def test_a_limit_no_cut_meets_is_refused_and_a_replica_that_cannot_fit_is_dropped() -> None:
    limit = StageMemory(HEAVY_EMBEDDING.layer_bytes, limit=11.0)
    with pytest.raises(PartitionError, match="at most 12 bytes per stage"):
        plan(None, ["a", "b"], pp=2, costs=SKEWED, memory=StageMemory((20.0,) + (1.0,) * 7,
                                                                      limit=12.0))  # fmt: skip
    p1 = plan(None, list("abcdef"), pp=3, costs=SKEWED, memory=limit)
    assert max(p1.bounds[0][1:]) == 8
    p2 = plan(p1, list("abcdf"), pp=3, costs=SKEWED, memory=limit)  # "e" lost: 24 bytes in 2
    assert p2.replicas == ((0, 1, 2),) and "replica 1 dropped" in p2.reason
    assert "cannot hold its layers within 11 bytes each" in p2.reason
    assert sum(p2.shares) == 16  # the global batch never changes
    # its two survivors are placed again: with a newcomer they form a new replica
    p3 = plan(p2, list("abcdfg"), pp=3, costs=SKEWED, memory=limit)
    assert p3.replicas == ((0, 1, 2), (3, 4, 5)) and p3.workers[3:] == ("d", "f", "g")
    # the only replica cannot be held by its survivors: no plan, said in one line
    alone = plan(None, list("abc"), pp=3, costs=SKEWED, memory=limit)
    with pytest.raises(NoCutFits, match="no replica is left .* within 11 bytes each"):
        plan(alone, list("ab"), pp=3, costs=SKEWED, memory=limit)


def test_status_shows_the_grid() -> None:
    from elaswave.cli.jobs import _stage

    p2 = plan(plan(None, ["a", "b", "c", "d"]), ["a", "c", "d"])
    assert [_stage(p2, r) for r in range(3)] == [
        {"replica": 0, "stage": 0, "layers": [0, 4]},
        {"replica": 1, "stage": 0, "layers": [0, 2]},
        {"replica": 1, "stage": 1, "layers": [2, 4]},
    ]


def test_drop_policy_takes_the_replica_out() -> None:
    p1 = plan(None, ["a", "b", "c", "d"])
    p2 = plan(p1, ["a", "c", "d"], policy="drop")
    assert p2.workers == ("c", "d") and p2.shares == (16,)
    assert "replica 0 dropped" in p2.reason


def _stages(p) -> list[list[str]]:
    """Every replica's workers in stage order."""
    return [[p.workers[r] for r in ranks] for ranks in p.replicas]


@pytest.mark.parametrize(
    ("start", "pp", "lost", "joined", "expected", "note"),
    [
        # the last stage of replica 0 runs on replica 1's
        ("abcd", 2, "b", "", [["a", "d"], ["c", "d"]], "replica 0 rerouted: stage 1 → d"),
        # a first stage: the same, and the cut stays
        ("abcd", 2, "c", "", [["a", "b"], ["a", "d"]], "replica 1 rerouted: stage 0 → a"),
        # two losses of one stage (the second the first one's peer): the last peer runs all
        ("abcdef", 2, "bd", "", [["a", "f"], ["c", "f"], ["e", "f"]], "stage 1 → f"),
        # peers alike in roles: the first in replica order
        ("abcdefgh", 2, "b", "", [["a", "d"], ["c", "d"], ["e", "f"], ["g", "h"]], "→ d"),
        # a newcomer takes back a rerouted stage (the second of the worker's roles)
        ("abcd", 2, "b", "e", [["a", "d"], ["c", "e"]], "stage 1 on a newcomer (was rerouted)"),
        # every replica lost that stage: nothing to reroute to, every replica is dropped
        ("abcd", 2, "bd", "", [], ""),
        # a replica with nothing left of its own is gone, its peer's role with it
        ("abcdef", 3, "abc", "", [["d", "e", "f"]], "replica 0 gone"),
    ],
)
def test_recycle_reroutes_lost_stages_to_their_peers(
    start: str, pp: int, lost: str, joined: str, expected: list[list[str]], note: str
) -> None:
    p1 = plan(None, list(start), pp=pp, costs=UNIFORM)
    live = [w for w in start if w not in lost]
    p2 = plan(p1, live, pp=pp, costs=UNIFORM, policy="recycle")
    if joined:
        p2 = plan(p2, live + list(joined), pp=pp, costs=UNIFORM, policy="recycle")
    if not expected:  # no plan: the job stops (as under ``drop``)
        assert p2 is None
        return
    assert _stages(p2) == expected and note in p2.reason
    assert set(p2.bounds) == {p1.bounds[0]}  # every cut as it was
    assert sum(p2.shares) == 16 and max(p2.shares) - min(p2.shares) <= 1
    for rank in range(p2.world_size):  # every role of a rank is the same stage
        assert len({s for _, s in p2.roles(rank)}) == 1
    assert p2.rerouted == (len(set(p2.workers)) < sum(len(g) for g in expected))


def test_recycle_keeps_a_rerouted_layout_when_speeds_change() -> None:
    p2 = plan(plan(None, list("abcd")), list("acd"), policy="recycle")
    assert p2.rerouted and respeed_pipeline_plan(p2, {"d": 0.5}, COSTS, store="s", now=0) is None


def test_whole_replica_gone_and_nothing_changed() -> None:
    p1 = plan(None, ["a", "b", "c", "d"])
    assert plan(p1, ["a", "b", "c", "d"]) is None
    p2 = plan(p1, ["c", "d"])
    assert p2.replicas == ((0, 1),) and p2.shares == (16,) and "replica 0 gone" in p2.reason


def test_newcomer_refills_a_short_replica() -> None:
    p1 = plan(None, ["a", "b", "c", "d"])
    p2 = plan(p1, ["a", "c", "d"])
    p3 = plan(p2, ["a", "c", "d", "e"])
    assert p3.workers == ("a", "e", "c", "d")
    assert p3.replicas == ((0, 1), (2, 3)) and p3.bounds == ((0, 2, 4), (0, 2, 4))
    assert p3.shares == (8, 8)


def test_middle_stage_loss_splits_layers_over_both_neighbours() -> None:
    p1 = plan(None, ["a", "b", "c", "d", "e", "f"], pp=3, costs=UNIFORM)
    assert p1.bounds == ((0, 2, 4, 6), (0, 2, 4, 6))
    p2 = plan(p1, ["a", "c", "d", "e", "f"], pp=3, costs=UNIFORM)
    assert p2.bounds[0] == (0, 3, 6)  # survivors keep theirs, the middle splits in two
    assert p2.shares == (7, 9)  # (7 + 1) · 3 layers vs (9 + 2) · 2: both replicas ≈ 24


def test_serving_shares_spread_the_batch_over_replicas_in_service() -> None:
    p2 = plan(plan(None, ["a", "b", "c", "d"]), ["a", "c", "d"])
    assert serving_shares(p2, [False, True], COSTS) == (0, 16)
    assert serving_shares(p2, [True, True], COSTS) == p2.shares
    with pytest.raises(ValueError, match="no replica"):
        serving_shares(p2, [False, False], COSTS)


@pytest.mark.parametrize(
    ("total", "bottlenecks", "stages", "expected"),
    [
        (16, [1.0, 1.0], [2, 2], (8, 8)),  # identical replicas split evenly
        (16, [1.0, 0.5], [1, 2], (6, 10)),  # a one-stage replica of twice the bottleneck
        (16, [1.0, 0.5], [4, 2], (4, 12)),  # deeper pipelines pay more fill
        (3, [1.0, 1.0, 1.0], [1, 1, 1], (1, 1, 1)),
        (4, [1.0, float("inf")], [1, 1], (4, 0)),  # a replica out of service
    ],
)
def test_balanced_shares(total, bottlenecks, stages, expected) -> None:
    assert balanced_shares(total, bottlenecks, stages) == expected


def test_balanced_shares_minimise_the_slowest_replica() -> None:
    rnd = random.Random(3)
    for _ in range(200):
        n = rnd.randint(1, 4)
        b = [rnd.uniform(0.1, 2.0) for _ in range(n)]
        s = [rnd.randint(1, 4) for _ in range(n)]
        total = rnd.randint(1, 9)

        def span(counts, b=b, s=s):
            return max((c + s[d] - 1) * b[d] if c else 0.0 for d, c in enumerate(counts))

        got = balanced_shares(total, b, s)
        assert sum(got) == total
        best = min(
            span(c) for c in itertools.product(range(total + 1), repeat=n) if sum(c) == total
        )
        assert span(got) <= best + 1e-12


def test_unknown_policy_is_an_error() -> None:
    with pytest.raises(ValueError, match="stage-loss policy"):
        plan(None, ["a", "b"], policy="retry")


# ---- the 1F1B schedule -----------------------------------------------------------------------
def _simulate(stages: int, microbatches: int) -> None:
    """Run every stage's schedule against the others with rendezvous semantics (a message
    completes only when both sides have posted it); fail on deadlock or a broken order."""
    scheds = [schedule_1f1b(s, stages, microbatches) for s in range(stages)]
    pos = [0] * stages
    done_msgs: set[tuple[int, str, int, str]] = set()  # (stage, dir, mb, kind) completed
    forward_done: list[set[int]] = [set() for _ in range(stages)]
    backward_done: list[set[int]] = [set() for _ in range(stages)]

    def peer_msgs(s: int, item: Comm) -> list[tuple[int, tuple[str, int], str]]:
        out = []
        for kind, i in item.sends:
            out.append((s + 1 if kind == "act" else s - 1, (kind, i), "send"))
        for kind, i in item.recvs:
            out.append((s - 1 if kind == "act" else s + 1, (kind, i), "recv"))
        return out

    for _ in range(10_000):
        if all(pos[s] == len(scheds[s]) for s in range(stages)):
            break
        progressed = False
        for s in range(stages):
            if pos[s] == len(scheds[s]):
                continue
            item = scheds[s][pos[s]]
            if isinstance(item, Compute):
                if item.kind == "F":
                    if s > 0:
                        assert (s, "recv", item.mb, "act") in done_msgs
                    forward_done[s].add(item.mb)
                else:
                    assert item.mb in forward_done[s]
                    if s < stages - 1:
                        assert (s, "recv", item.mb, "grad") in done_msgs
                    backward_done[s].add(item.mb)
                pos[s] += 1
                progressed = True
                continue
            ok = True
            for peer, (kind, i), way in peer_msgs(s, item):
                other = scheds[peer][pos[peer]] if pos[peer] < len(scheds[peer]) else None
                mirror = "recvs" if way == "send" else "sends"
                posted = isinstance(other, Comm) and (kind, i) in getattr(other, mirror)
                if (
                    not posted
                    and (peer, "recv" if way == "send" else "send", i, kind) not in done_msgs
                ):
                    ok = False
            if ok:
                for _peer, (kind, i), way in peer_msgs(s, item):
                    done_msgs.add((s, way, i, kind))
                pos[s] += 1
                progressed = True
        assert progressed, f"deadlock at positions {pos}"
    for s in range(stages):
        assert forward_done[s] == backward_done[s] == set(range(microbatches))


@pytest.mark.parametrize(
    ("stages", "microbatches"), list(itertools.product([1, 2, 3, 4], [1, 2, 3, 8]))
)
def test_1f1b_completes_without_deadlock(stages: int, microbatches: int) -> None:
    _simulate(stages, microbatches)


def test_1f1b_keeps_in_flight_activations_bounded() -> None:
    sched = schedule_1f1b(0, 4, 8)
    live = peak = 0
    for item in sched:
        if isinstance(item, Compute):
            live += 1 if item.kind == "F" else -1
            peak = max(peak, live)
    assert peak == 4  # warm-up depth = stages, not micro-batches (GPipe would hold 8)


def test_schedule_rejects_a_stage_out_of_range() -> None:
    with pytest.raises(ValueError, match="out of range"):
        schedule_1f1b(3, 3, 4)


# ---- layer transfers -------------------------------------------------------------------------
SIZES = [10, 10, 10, 10]


@pytest.mark.parametrize(
    ("held", "targets", "expected"),
    [
        # replica 0's stage 1 died: its stage 0 takes layers 2-3 from replica 1's stage 1
        ([range(0, 2), range(0, 2), range(2, 4)], [range(0, 4), range(0, 2), range(2, 4)],
         [LayerTransfer(2, 0, 2, 4)]),
        # a newcomer needs everything; two holders share the work layer by layer
        ([range(0, 4), range(0, 4), None], [range(0, 4), range(0, 4), range(0, 4)],
         [LayerTransfer(0, 2, 0, 1), LayerTransfer(1, 2, 1, 2), LayerTransfer(0, 2, 2, 3),
          LayerTransfer(1, 2, 3, 4)]),
        # nothing to move
        ([range(0, 2), range(2, 4)], [range(0, 2), range(2, 4)], []),
    ],
)  # fmt: skip
def test_layer_transfers(held, targets, expected) -> None:
    assert plan_layer_transfers(held, targets, SIZES) == expected


def test_layer_transfers_cover_every_missing_layer_once() -> None:
    rnd = random.Random(7)
    for _ in range(200):
        layers = rnd.randint(1, 8)
        ranks = rnd.randint(2, 6)
        held = []
        for _ in range(ranks):
            a = rnd.randint(0, layers - 1)
            held.append(range(a, rnd.randint(a + 1, layers)) if rnd.random() < 0.8 else None)
        held[0] = range(0, layers)  # someone holds everything
        targets = []
        for _ in range(ranks):
            a = rnd.randint(0, layers - 1)
            targets.append(range(a, rnd.randint(a + 1, layers)))
        got = plan_layer_transfers(held, targets, [1] * layers)
        received = [(t.dst, layer) for t in got for layer in range(t.start, t.stop)]
        assert len(received) == len(set(received))
        need = {(r, x) for r, want in enumerate(targets) for x in want if x not in (held[r] or ())}
        assert set(received) == need
        assert all(held[t.src] is not None and t.start in held[t.src] for t in got)


def test_layer_held_by_nobody_is_lost() -> None:
    with pytest.raises(LayersLost, match="layer 3"):
        plan_layer_transfers([range(0, 3), None], [range(0, 2), range(2, 4)], SIZES)


def test_transfer_stats() -> None:
    stats = transfer_stats([LayerTransfer(2, 0, 2, 4), LayerTransfer(1, 3, 0, 1)], SIZES)
    assert stats == {"bytes": 30, "transfers": 2, "pairs": 2, "max_over_mean": 1.333}


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"pp": 7}, "only 4 layers"),
        ({"pp": 3}, "cannot be cut into pp=3"),
        ({"pp": 2, "dp": 3}, "dp × pp = 3 × 2 = 6"),
        ({"pp": 2, "migration": "lazy"}, "migration must be one of"),
        ({"pp": 2, "dvfs": "turbo"}, "dvfs must be one of"),
        ({"pp": 2, "stage_loss": "pray"}, "stage_loss must be one of"),
    ],
)
def test_pipeline_config_errors(data: dict, message: str) -> None:
    base = {"model": {"n_layer": 2}, "elastic": {"nproc_per_node": 4}}
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict({**base, **data})


def test_pipeline_config_ok() -> None:
    cfg = JobConfig.from_dict({"model": {"n_layer": 2}, "elastic": {"nproc_per_node": 4}, "pp": 2})
    assert (cfg.pp, cfg.dp, cfg.migration, cfg.dvfs) == (2, 0, "async", "off")
    base = {"model": {"n_layer": 2}, "elastic": {"nproc_per_node": 4}}
    assert JobConfig.from_dict({**base, "pp": 2, "zero": 1}).zero == 1  # ZeRO-1 inside stages


def test_measured_costs_take_the_median_and_ignore_bad_profiles() -> None:
    from elaswave.planning.layercosts import measured_costs

    fallback = (1.0, 1.0, 1.0)
    profiles = [[1.0, 4.0, 2.0], [3.0, 2.0, 2.0], [2.0, 3.0, 9.0], [1.0, 1.0], [0.0, 1.0, 1.0]]
    assert measured_costs(profiles, fallback=fallback) == (2.0, 3.0, 2.0)
    assert measured_costs([], fallback=fallback) == fallback


def test_a_rank_with_several_replicas_runs_them_one_after_another() -> None:
    order = schedule_roles(1, 2, [0, 0, 2])  # two of replica 0, then one of replica 2
    assert order == schedule_1f1b(1, 2, 2) + [
        Comm(recvs=(("act", 2),)), Compute("F", 2), Compute("B", 2), Comm(sends=(("grad", 2),))
    ]  # fmt: skip
    with pytest.raises(ValueError, match="replica by replica"):
        schedule_roles(0, 2, [1, 0])


def _completes(p, merged: bool = False) -> bool:
    """Whether every rank of pipeline plan ``p`` gets through its step when each message waits
    for its counterpart to be posted (a send completes only once its receive is posted: gloo's
    point-to-point), every rank posting its slot's sends and receives together as a stage does.
    A rank's micro-batches: those of each replica it runs, one replica after another (``merged``:
    taken in turn, in one 1F1B order over all of them)."""
    stages, slots = len(p.replicas[0]), {}
    for r in range(p.world_size):
        roles = p.roles(r)
        s, mine = roles[0][1], [d for d, _ in roles for _ in range(p.shares[d])]
        if merged:
            turns = [[d for d, _ in roles if p.shares[d] > i] for i in range(max(p.shares))]
            mine = [d for turn in turns for d in turn]
        schedule = (
            schedule_1f1b(s, stages, len(mine)) if merged else schedule_roles(s, stages, mine)
        )
        ops = []
        for item in schedule:
            if not isinstance(item, Comm):
                continue
            slot = []
            for kind, i in item.sends:  # an activation forward, its gradient back
                ranks = p.replicas[mine[i]]
                slot.append(("send", r, ranks[s + 1] if kind == "act" else ranks[s - 1], kind))
            for kind, i in item.recvs:
                ranks = p.replicas[mine[i]]
                slot.append(("recv", ranks[s - 1] if kind == "act" else ranks[s + 1], r, kind))
            ops.append(slot)
        slots[r] = ops
    seen: dict = {}  # the n-th message of (src, dst, kind) pairs with the n-th receive of it

    def tagged(op: tuple) -> tuple:
        key = op
        seen[key] = seen.get(key, 0) + 1
        return (*op, seen[key])

    at = dict.fromkeys(slots, 0)
    posted: dict = {}
    while True:
        for r, ops in slots.items():
            if r not in posted and at[r] < len(ops):
                posted[r] = {tagged(op): False for op in ops[at[r]]}
        live = {op for ops in posted.values() for op in ops}
        done = []
        for r, ops in posted.items():
            for op in ops:
                other = ("recv" if op[0] == "send" else "send", *op[1:])
                ops[op] = ops[op] or other in live
            if all(ops.values()):
                done.append(r)
        if not done:
            return not posted
        for r in done:
            del posted[r]
            at[r] += 1


def _recycled(stages: int, dp: int, lost: tuple[int, ...], shares: tuple[int, ...]):
    """The recycle plan after replica d lost its stage ``lost[d]`` (-1: none), with ``shares``."""
    ids = [f"w{i}" for i in range(stages * dp)]
    p1 = plan(None, ids, pp=stages, costs=UNIFORM)
    gone = {ids[d * stages + s] for d, s in enumerate(lost) if s >= 0}
    p2 = plan(p1, [w for w in ids if w not in gone], pp=stages, costs=UNIFORM, policy="recycle")
    return None if p2 is None else dataclasses.replace(p2, shares=shares)


def test_every_rerouted_layout_runs_its_step_to_the_end() -> None:
    """Every loss pattern of one stage per replica (dp 2-3, pp 2-4: a rank may run a stage for
    three replicas), each replica with 1 or 3 micro-batches: no rank waits forever."""
    checked = 0
    for stages, dp in itertools.product((2, 3, 4), (2, 3)):
        for lost in itertools.product(range(-1, stages), repeat=dp):
            for shares in itertools.product((1, 3), repeat=dp):
                p = _recycled(stages, dp, lost, shares)
                if p is None or not p.rerouted:
                    continue
                assert _completes(p), (stages, lost, shares, p.replicas)
                checked += 1
    assert checked > 300


def test_one_1f1b_order_over_several_replicas_would_deadlock() -> None:
    """What the order replica by replica avoids: dp=2 × pp=4, replica 1's first stage run by
    replica 0's, both replicas' micro-batches taken in turn in one 1F1B order: its warm-up of
    three forwards holds two of replica 0's, where replica 0's second stage waits for three."""
    p = _recycled(4, 2, (-1, 0), (8, 8))
    assert p is not None and _completes(p)
    assert not _completes(p, merged=True)
