"""The planners at 100,000 ranks (12,500 hosts × 8 workers), for data and pipeline parallelism:
the start plan, the plan after a host's 8 workers are lost, the plan after a new host joins.

The scale benchmark (``bench/scale.py``) times these plans on the same synthetic cluster
(:mod:`elaswave.planning.scaleplans`); here they must be right. Nothing is timed, but the test is
only fast because the planners are (a fraction of a second per plan, where quadratic scans took
minutes), and so are the lookups of every rank's position and micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import Member, Plan, next_plan
from elaswave.planning.scaleplans import host_name, synthetic_members

HOSTS, PER_HOST = 12_500, 8
RANKS = HOSTS * PER_HOST
MICROBATCHES = 2 * RANKS  # at least one per rank
LAYERS = 32
Planner = Callable[[Plan | None, list[Member], float], Plan | None]


def data_parallel(prev: Plan | None, members: list[Member], now: float) -> Plan | None:
    return next_plan(
        prev, members, num_microbatches=MICROBATCHES, max_workers=RANKS, store="s:1", now=now
    )


def pipelines(prev: Plan | None, members: list[Member], now: float) -> Plan | None:
    costs = [1.0 + 0.1 * (i % 5) for i in range(LAYERS)]
    return next_pipeline_plan(
        prev,
        members,
        pp=16,
        costs=costs,
        num_microbatches=MICROBATCHES,
        max_workers=RANKS,
        store="s:1",
        now=now,
    )


PLANNERS: dict[str, Planner] = {"dp": data_parallel, "pp=16": pipelines}


def plans(make: Planner) -> list[Plan]:
    """The start plan, the plan without host 5, the plan with host 12,500 joined."""
    everyone = synthetic_members(HOSTS, PER_HOST)
    left = [m for m in everyone if m.host != host_name(5)]
    joined = left + synthetic_members(1, PER_HOST, first=HOSTS)
    made: list[Plan] = []
    for t, members in enumerate((everyone, left, joined)):
        p = make(made[-1] if made else None, members, float(t))
        assert p is not None
        made.append(p)
    return made


@pytest.fixture(scope="module")
def histories() -> dict[str, list[Plan]]:
    return {kind: plans(make) for kind, make in PLANNERS.items()}


@pytest.fixture(params=PLANNERS)
def history(request: pytest.FixtureRequest, histories: dict[str, list[Plan]]) -> list[Plan]:
    return histories[request.param]


def test_epochs_worlds_and_departures(history: list[Plan]) -> None:
    start, fault, grown = history
    lost = tuple(f"{host_name(5)}.w{s}" for s in range(PER_HOST))
    assert [p.epoch for p in history] == [1, 2, 3]
    assert [p.world_size for p in history] == [RANKS, RANKS - PER_HOST, RANKS]
    assert [p.departed for p in history] == [(), lost, ()]
    assert host_name(5) not in fault.hosts and set(fault.workers) == set(start.workers) - set(lost)
    assert {w for w in grown.workers if w.startswith(host_name(HOSTS))} == {
        f"{host_name(HOSTS)}.w{s}" for s in range(PER_HOST)
    }
    for p in history:  # a pipeline's stages all run their replica's share
        assert sum(p.shares if p.is_pipeline else p.microbatches) == MICROBATCHES
        assert min(p.microbatches) >= 1
        assert len(p.reason) < 600  # summarised, not a list of 100,000 counts


def test_every_rank_finds_its_place(history: list[Plan]) -> None:
    """What each host asks of a plan for its own ranks, asked for all of them: the ranks' micro-
    batches tile the step (per replica for pipelines) and ``rank_of`` inverts ``workers``."""
    for p in history:
        assert all(p.rank_of(w) == r for r, w in enumerate(p.workers))
        assert p.rank_of("node-99999.w0") is None
        ranges = [p.microbatch_range(r) for r in range(p.world_size)]
        if not p.is_pipeline:
            assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
            assert ranges[-1].stop == MICROBATCHES
            continue
        for d, ranks in enumerate(p.replicas):
            assert [p.position(r) for r in ranks] == [(d, s) for s in range(len(ranks))]
            assert {ranges[r] for r in ranks} == {ranges[ranks[0]]}
            assert len(ranges[ranks[0]]) == p.shares[d] == p.microbatches[ranks[0]]
            assert p.bounds[d][0] == 0 and p.bounds[d][-1] == LAYERS
            assert len(p.bounds[d]) == len(ranks) + 1


def test_pipelines_keep_the_damaged_replica_and_refill_it(
    histories: dict[str, list[Plan]],
) -> None:
    stages = [[len(r) for r in p.replicas] for p in histories["pp=16"]]
    damaged = [d for d, n in enumerate(stages[1]) if n != 16]
    assert stages[0] == [16] * (RANKS // 16)
    assert len(damaged) == 1 and stages[1][damaged[0]] == 8  # its other host's 8 took over
    assert stages[2] == stages[0]  # the new host refilled it
