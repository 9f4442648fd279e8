"""Stragglers inside pipelines: re-cutting stages and re-sharing replicas by speed (pure)."""

from __future__ import annotations

import itertools

import pytest

from elaswave.planning.pipeplan import (
    next_pipeline_plan,
    predicted_step,
    respeed_pipeline_plan,
    stage_speeds,
)
from elaswave.planning.plan import Member, Plan
from elaswave.planning.verdicts import Hysteresis, peer_relative, pipeline_straggler_verdict

COSTS = (1.0,) * 8  # eight equal layers


def start(pp: int = 2, workers: int = 4, microbatches: int = 16, costs=COSTS) -> Plan:
    members = [Member(worker_id=f"w{i}", host="h", order=i) for i in range(workers)]
    plan = next_pipeline_plan(
        None, members, pp=pp, costs=costs, num_microbatches=microbatches,
        max_workers=workers, store="s:1", now=0.0,
    )  # fmt: skip
    assert plan is not None
    return plan


def respeed(plan: Plan, speeds: dict[str, float], costs=COSTS) -> Plan | None:
    return respeed_pipeline_plan(plan, speeds, costs, store="s:1", now=1.0, cause="why")


def _check(plan: Plan, prev: Plan, layers: int) -> None:
    """Same ranks and replicas, the same global batch, contiguous stages covering every layer."""
    assert plan.workers == prev.workers and plan.replicas == prev.replicas
    assert plan.epoch == prev.epoch + 1 and plan.departed == () and plan.evicted == ()
    assert sum(plan.shares) == sum(prev.shares)
    for r in range(plan.world_size):
        assert plan.microbatches[r] == plan.shares[plan.position(r)[0]]
    for ranks, cut in zip(plan.replicas, plan.bounds, strict=True):
        assert len(cut) == len(ranks) + 1 and cut[0] == 0 and cut[-1] == layers
        assert all(a < b for a, b in zip(cut, cut[1:], strict=False))


def test_no_change_when_every_worker_runs_at_nominal_speed() -> None:
    plan = start()
    assert respeed(plan, {}) is None
    assert respeed(plan, {w: 1.0 for w in plan.workers}) is None


@pytest.mark.parametrize(
    ("speeds", "bounds", "shares"),
    [
        # replica 0's stage 1 at half speed: it keeps 3 layers (3/0.5 = 6 > 5, the best cut) and
        # replica 0's bottleneck 6 against replica 1's 4 takes micro-batches off it
        ({"w1": 0.5}, ((0, 5, 8), (0, 4, 8)), (6, 10)),
        # replica 1's stage 0 at half speed: the mirror image
        ({"w2": 0.5}, ((0, 4, 8), (0, 3, 8)), (10, 6)),
        # a uniformly slow replica keeps its cut and gets a smaller share
        ({"w0": 0.5, "w1": 0.5}, ((0, 4, 8), (0, 4, 8)), (5, 11)),
        # a uniformly fast replica gets the larger share
        ({"w2": 2.0, "w3": 2.0}, ((0, 4, 8), (0, 4, 8)), (5, 11)),
    ],
)
def test_respeed_cuts_and_shares(speeds, bounds, shares) -> None:
    prev = start()
    plan = respeed(prev, speeds)
    assert plan is not None
    _check(plan, prev, 8)
    assert plan.bounds == bounds and plan.shares == shares
    assert plan.reason.startswith("why → epoch 2: stages re-cut for speed")


def test_a_slow_stage_gets_fewer_layers_and_its_replica_no_larger_share() -> None:
    prev = start(pp=4, workers=8, microbatches=24, costs=(1.0,) * 16)
    for slow, v in itertools.product(
        range(8), (0.25, 0.5, 0.7)
    ):  # 0.8: 4 layers / 0.8 = 5, no better cut
        plan = respeed(prev, {f"w{slow}": v}, costs=(1.0,) * 16)
        assert plan is not None
        _check(plan, prev, 16)
        d, s = prev.position(slow)
        old, new = prev.bounds[d], plan.bounds[d]
        assert new[s + 1] - new[s] < old[s + 1] - old[s], (slow, v, new)
        assert plan.shares[d] <= prev.shares[d]
        assert plan.bounds[1 - d] == prev.bounds[1 - d], "the other replica keeps its cut"


def test_respeed_never_predicts_a_slower_step() -> None:
    prev = start(pp=2, workers=6, microbatches=12)
    for v0, v1, v2 in itertools.product((0.3, 0.7, 1.0, 1.6), repeat=3):
        speeds = {"w0": v0, "w3": v1, "w4": v2}
        plan = respeed(prev, speeds)
        if plan is None:
            continue
        _check(plan, prev, 8)
        per = stage_speeds(prev, speeds)
        assert predicted_step(plan.bounds, plan.shares, per, costs=COSTS) <= predicted_step(
            prev.bounds, prev.shares, per, costs=COSTS
        )


# ---- the leader's verdict ----------------------------------------------------------------------


def verdict(plan: Plan, stage_s: dict[str, float], *, threshold: float = 0.0, n: int = 4):
    samples = {w: [x] * n for w, x in stage_s.items()}
    return pipeline_straggler_verdict(
        samples, current=plan, costs=COSTS, threshold=threshold, store="s:1", now=1.0
    )


def test_waits_for_samples_from_every_rank() -> None:
    plan = start()
    v = verdict(plan, {"w0": 0.1, "w1": 0.1, "w2": 0.1})
    assert not v.acts and "waiting" in v.reason
    assert not verdict(plan, {w: 0.1 for w in plan.workers}, n=3).acts


def test_equal_stage_times_change_nothing() -> None:
    plan = start()
    v = verdict(plan, {"w0": 0.10, "w1": 0.11, "w2": 0.1, "w3": 0.09})
    assert not v.acts and v.reason == "balanced" and v.stragglers == ()


def test_a_slow_stage_is_re_cut_and_named() -> None:
    plan = start()
    v = verdict(plan, {"w0": 0.1, "w1": 0.2, "w2": 0.1, "w3": 0.1})
    assert v.acts and v.stragglers == ("w1",) and v.evict == ()
    assert v.slowdown["w1"] == pytest.approx(2.0)
    assert v.plan is not None and v.plan.bounds[0] == (0, 5, 8)
    assert v.plan.shares[0] < v.plan.shares[1] and sum(v.plan.shares) == 16
    assert v.reason.startswith("straggler: worker w1 (rank 1) 2.00×")
    assert v.plan.reason.startswith(v.reason + " → epoch 2:")


def test_stages_compare_only_with_peers_that_run_the_same_layers() -> None:
    """Stage 1 takes three times as long as stage 0 in both replicas (a cost model would call
    that a straggler, and evict at threshold 3): nobody is slow, since each rank matches its
    peer. Replicas cut differently have no peers and are not judged at all."""
    plan = start()
    v = verdict(plan, {"w0": 0.1, "w1": 0.3, "w2": 0.1, "w3": 0.3}, threshold=3.0)
    assert not v.acts and v.stragglers == ()
    uneven = respeed(plan, {"w1": 0.5})  # replica 0 cut (0, 5, 8), replica 1 (0, 4, 8)
    assert uneven is not None
    v = pipeline_straggler_verdict(
        {"w0": [0.5] * 4, "w1": [0.9] * 4, "w2": [0.1] * 4, "w3": [0.4] * 4},
        current=uneven, costs=COSTS, threshold=3.0, store="s:1", now=1.0,
    )  # fmt: skip
    assert not v.acts and all(x == pytest.approx(1.0) for x in v.slowdown.values())


def test_peer_relative_times() -> None:
    groups = {"a": 0, "b": 0, "c": 1, "d": 2}
    out = peer_relative({"a": [2.0, 2.0], "b": [1.0, 3.0], "c": [5.0], "d": [0.0]}, groups)
    assert out == {"a": [1.0, 1.0], "b": [0.5, 1.5], "c": [1.0], "d": [1.0]}


def test_past_the_threshold_the_worker_is_evicted() -> None:
    plan = start()
    v = verdict(plan, {"w0": 0.1, "w1": 0.1, "w2": 0.5, "w3": 0.1}, threshold=3.0)
    assert v.acts and v.evict == ("w2",) and v.plan is None
    assert "evicted" in v.reason


def test_hysteresis_needs_the_same_proposal_repeatedly() -> None:
    plan = start()
    h = Hysteresis(needed=3)
    slow = {"w0": 0.1, "w1": 0.2, "w2": 0.1, "w3": 0.1}
    assert [h.observe(verdict(plan, slow).key) for _ in range(3)] == [False, False, True]
    h.reset()
    assert not h.observe(verdict(plan, slow).key)
    assert not h.observe(verdict(plan, {w: 0.1 for w in plan.workers}).key)
    assert not h.observe(verdict(plan, slow).key)
