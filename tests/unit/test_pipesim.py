"""The device model behind ``bench pipeline``'s ReCycle comparison: fixed 1F1B orders,
ReCycle's rerouted, decoupled and staggered schedule, and the policies' layouts."""

from __future__ import annotations

import math

import pytest

from bench.pipesim import (
    Op,
    Pipe,
    ScheduleError,
    Timeline,
    _deps,
    reroute,
    run_orders,
    run_recycle,
    stage_seconds,
)
from bench.recycle import compare, failed_slots
from elaswave.runtime.workload.gpt import gpt_layer_costs

T = 0.15  # seconds per micro-batch through the whole model


def _equal(dp: int, pp: int, m: int) -> list[Pipe]:
    return [Pipe((T / pp,) * pp, m) for _ in range(dp)]


def _assert_feasible(tl: Timeline, stages: int, split: bool) -> None:
    """No device runs two ops at once; every op starts after what it waits for ended."""
    by_device: dict = {}
    for op, (dev, start, end) in tl.spans.items():
        by_device.setdefault(dev, []).append((start, end))
        for dep in _deps(op, stages, split):
            assert tl.spans[dep][2] <= start + 1e-12, (op, dep)
    for spans in by_device.values():
        spans.sort()
        for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
            assert e0 <= s1 + 1e-12


@pytest.mark.parametrize(("pp", "m"), [(1, 4), (2, 1), (2, 8), (3, 5), (4, 8), (4, 16)])
def test_fixed_1f1b_orders_take_the_textbook_time(pp: int, m: int) -> None:
    tl = run_orders(_equal(2, pp, m), overhead=0.05)
    assert math.isclose(tl.step_s, (m + pp - 1) * T / pp + 0.05)
    _assert_feasible(tl, pp, split=False)


@pytest.mark.parametrize(("pp", "m"), [(2, 8), (3, 5), (4, 8), (4, 16)])
def test_the_list_schedule_without_recycles_parts_is_1f1b(pp: int, m: int) -> None:
    """No failure, no decoupled backward, no stagger: the greedy schedule under 1F1B's
    activation limit runs each iteration in 1F1B's time."""
    tl = run_recycle(_equal(2, pp, m), decoupled=False, staggered=False, overhead=0.05)
    assert math.isclose(tl.step_s, (m + pp - 1) * T / pp + 0.05, rel_tol=1e-9)
    _assert_feasible(tl, pp, split=False)
    for dev in {d for d, _, _ in tl.spans.values()}:  # and in 1F1B's activation memory
        assert _peak_inflight(tl, dev) == min(pp - dev[1], m)


def _peak_inflight(tl: Timeline, device) -> int:
    """The most micro-batches ``device`` held activations of (forward begun, backward not
    done) at once."""
    moves = sorted(
        (start, 1) if op.kind == "F" else (end, -1)
        for op, (dev, start, end) in tl.spans.items()
        if dev == device and op.kind in ("F", "B", "BW")
    )
    level = peak = 0
    for _, step in moves:
        level += step
        peak = max(peak, level)
    return peak


@pytest.mark.parametrize("decoupled", [False, True])
@pytest.mark.parametrize("staggered", [False, True])
def test_two_pipelines_after_a_loss_are_bound_by_the_peer(decoupled: bool, staggered: bool) -> None:
    """dp=2: the peer runs both pipelines' micro-batches of its stage; nothing beats its work."""
    m = 8
    tl = run_recycle(_equal(2, 2, m), [(0, 1)], decoupled=decoupled, staggered=staggered)
    assert tl.step_s >= 2 * m * T / 2 - 1e-9
    assert {tl.spans[op][0] for op in tl.spans if op.stage == 1} == {(1, 1)}
    _assert_feasible(tl, 2, split=decoupled)


def test_recycle_fills_the_bubbles_of_many_pipelines() -> None:
    """dp=4 × pp=4, 8 micro-batches each: the three peers' extra work fits in the bubbles with
    decoupled backward and a staggered optimizer, but not with rerouting alone."""
    healthy = (8 + 3) * T / 4
    full = run_recycle(_equal(4, 4, 8), [(0, 3)])
    plain = run_recycle(_equal(4, 4, 8), [(0, 3)], decoupled=False, staggered=False)
    assert full.step_s <= healthy + 1e-9 < plain.step_s
    _assert_feasible(full, 4, split=True)


@pytest.mark.parametrize(
    ("pipes", "failed", "expect"),
    [
        (2, [(0, 1)], {(0, 1): [(1, 1)], (1, 1): [(1, 1)], (0, 0): [(0, 0)]}),
        (3, [(0, 1)], {(0, 1): [(1, 1), (2, 1)], (2, 1): [(2, 1)]}),
        (3, [(0, 1), (2, 1)], {(0, 1): [(1, 1)], (2, 1): [(1, 1)]}),
        (2, [(0, 1), (1, 0)], {(0, 1): [(1, 1)], (1, 0): [(0, 0)]}),
    ],
)
def test_reroute_sends_a_lost_stage_to_its_live_peers(pipes, failed, expect) -> None:
    got = reroute(pipes, 2, failed)
    assert {k: got[k] for k in expect} == expect


def test_a_stage_with_no_live_holder_cannot_be_rerouted() -> None:
    with pytest.raises(ScheduleError, match="stage 1 has no live holder"):
        reroute(2, 2, [(0, 1), (1, 1)])


def test_recycle_needs_one_cut() -> None:
    with pytest.raises(ScheduleError, match="one cut"):
        run_recycle([Pipe((0.1, 0.2), 4), Pipe((0.2, 0.1), 4)])


def test_stage_seconds_split_the_device_time_by_cost() -> None:
    assert stage_seconds([1.0, 2.0, 1.0], [0, 1, 3], 0.4) == (0.1, 0.30000000000000004)
    assert Op(0, 0, 0, 0, "F") < Op(1, 0, 0, 0, "F")


def test_the_policies_take_the_planners_layouts() -> None:
    costs = gpt_layer_costs(vocab_size=256, seq_len=64, d_model=128, n_layer=2)
    one = compare(2, 2, 1, costs=costs, device_time=T, microbatches=16, batch=32, overhead=0.0)
    assert one["layout"] == {"reshard": "cut [0, 4] × 6; cut [0, 2, 4] × 10",
                             "drop": "cut [0, 2, 4] × 16"}  # fmt: skip
    assert one["failed"] == failed_slots(2, 2, 1) == [(0, 1)]
    # Replica 0 alone: 6 micro-batches over the whole model.
    assert math.isclose(one["step_s"]["reshard"], max(6 * T, 11 * T * costs_share(costs, 2, 4)))
    assert one["reshard_over_recycle"] > 1.3  # dp=2: the peer doubles its stage's work
    two = compare(2, 2, 2, costs=costs, device_time=T, microbatches=16, batch=32, overhead=0.0)
    assert two["layout"]["drop"] == "nothing left" and two["samples_per_s"]["drop"] is None
    assert two["samples_per_s"]["recycle"] is not None  # each stage still has one holder


def costs_share(costs, a: int, b: int) -> float:
    return sum(costs[a:b]) / sum(costs)


def test_a_stage_of_no_time_does_not_stall_the_schedule() -> None:
    """An op that takes no time makes the next ones ready at the same instant."""
    tl = run_recycle([Pipe((0.0, 0.1), 4), Pipe((0.0, 0.1), 4)], [(0, 1)])
    assert math.isclose(tl.step_s, 8 * 0.1)  # the peer runs both pipelines' last stage
