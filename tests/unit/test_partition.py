"""Layer partitioning: hand tables, errors, the takeover helper, and a brute-force cross-check."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from elaswave.errors import ElasWaveError
from elaswave.planning.partition import (
    Partition,
    PartitionError,
    StageMemory,
    bytes_cap,
    moved_layers,
    partition_layers,
    smallest_largest_stage,
    takeover,
)

# ---- partition_layers: hand cases ----------------------------------------------------------


@pytest.mark.parametrize(
    ("costs", "speeds", "current", "slack", "bounds", "moved"),
    [
        # uniform layers, uniform stages
        ([1] * 8, [1] * 4, None, 0.02, (0, 2, 4, 6, 8), 0),
        ([1] * 8, [1] * 3, None, 0.02, (0, 2, 5, 8), 0),  # tie on 3: smallest boundaries
        # skewed costs
        ([8, 1, 1, 1, 1, 1, 1, 1, 1], [1, 1], None, 0.0, (0, 1, 9), 0),
        ([1, 1, 1, 1, 4], [1, 1], None, 0.0, (0, 4, 5), 0),
        ([5, 1, 1, 1, 1, 1, 5], [1, 1, 1], None, 0.0, (0, 1, 6, 7), 0),
        # heterogeneous speeds: a twice-as-fast stage takes twice the layers
        ([1] * 6, [1, 2], None, 0.02, (0, 2, 6), 0),
        ([1] * 9, [2, 1], None, 0.02, (0, 6, 9), 0),
        ([1] * 8, [1, 1, 2], None, 0.0, (0, 2, 4, 8), 0),
        # one stage left takes every layer
        ([1, 2, 3], [0.5], None, 0.02, (0, 3), 0),
        ([1, 2, 3], [0.5], [0, 0, 0], 0.02, (0, 3), 0),
        # as many stages as layers
        ([3, 1, 2], [1, 1, 1], None, 0.02, (0, 1, 2, 3), 0),
        ([3, 1, 2], [1, 1, 1], [0, 0, 1], 0.02, (0, 1, 2, 3), 2),
        # the current placement is optimal: nothing moves
        ([1] * 8, [1] * 4, [0, 0, 1, 1, 2, 2, 3, 3], 0.02, (0, 2, 4, 6, 8), 0),
        ([1] * 8, [1] * 3, [0, 0, 0, 1, 1, 1, 2, 2], 0.02, (0, 3, 6, 8), 0),  # not the smallest
        # within the slack the current placement wins; outside it the optimum does
        ([1] * 10, [1, 1], [0] * 6 + [1] * 4, 0.25, (0, 6, 10), 0),
        ([1] * 10, [1, 1], [0] * 6 + [1] * 4, 0.02, (0, 5, 10), 1),
        # zero costs are allowed
        ([0, 0, 0], [1, 1], None, 0.0, (0, 1, 3), 0),
        # unknown current stages (-1, or past the last stage) always count as moved
        ([1] * 4, [1, 1], [-1, -1, 1, 5], 0.02, (0, 2, 4), 3),
    ],
)
def test_partition_table(
    costs: list[float],
    speeds: list[float],
    current: list[int] | None,
    slack: float,
    bounds: tuple[int, ...],
    moved: int,
) -> None:
    p = partition_layers(costs, speeds, current=current, slack=slack)
    assert p.bounds == bounds
    assert p.moved == moved
    assert p.stage_times == tuple(
        sum(costs[a:b]) / v for a, b, v in zip(bounds, bounds[1:], speeds, strict=False)
    )
    assert p.bottleneck == max(p.stage_times)
    assert p.optimum <= p.bottleneck <= p.optimum * (1 + slack)


@pytest.mark.parametrize(
    ("costs", "speeds", "current", "slack", "message"),
    [
        ([1, 1], [], None, 0.02, "no pipeline stages"),
        ([1, 1], [1, 1, 1], None, 0.02, "cannot cut 2 layers into 3 non-empty stages"),
        ([], [1], None, 0.02, "cannot cut 0 layers into 1"),
        ([1, 1], [1, 0], None, 0.02, "stage 1 has 0"),
        ([1, 1], [-1, 1], None, 0.02, "stage 0 has -1"),
        ([1, 1], [float("nan"), 1], None, 0.02, "stage speed must be"),
        ([1, -1], [1], None, 0.02, "layer 1 has -1"),
        ([1, float("inf")], [1], None, 0.02, "layer cost must be"),
        ([1, 1, 1], [1, 1], [0, 1], 0.02, "current placement names 2 layers, the model has 3"),
        ([1, 1], [1], None, -0.1, "slack must be"),
    ],
)
def test_partition_errors(
    costs: list[float],
    speeds: list[float],
    current: list[int] | None,
    slack: float,
    message: str,
) -> None:
    with pytest.raises(PartitionError, match=message) as info:
        partition_layers(costs, speeds, current=current, slack=slack)
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, ElasWaveError)


def test_partition_helpers() -> None:
    p = partition_layers([1] * 7, [1, 1, 1])
    assert p.bounds == (0, 1, 4, 7)  # bottleneck 3; the smallest boundaries among ties
    assert p.num_stages == 3 and p.num_layers == 7
    assert [list(p.layers(s)) for s in range(3)] == [
        list(range(a, b)) for a, b in zip(p.bounds, p.bounds[1:], strict=False)
    ]
    assert p.assignment() == [p.stage_of(i) for i in range(7)]
    assert sorted(p.assignment()) == p.assignment()
    for bad in (-1, 7):
        with pytest.raises(PartitionError, match="layer"):
            p.stage_of(bad)
    with pytest.raises(PartitionError, match="stage 3 out of range"):
        p.layers(3)
    assert p.describe().startswith("layers [0,")
    assert "moved" in p.describe()


# ---- moved_layers and takeover -------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ([0, 0, 1, 1], [0, 0, 1, 1], []),
        ([0, 0, 1, 1], [0, 1, 1, 1], [1]),
        ([0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 1, 1], [2, 4, 5]),
        ([], [], []),
    ],
)
def test_moved_layers(old: list[int], new: list[int], expected: list[int]) -> None:
    assert moved_layers(old, new) == expected


def test_moved_layers_rejects_length_mismatch() -> None:
    with pytest.raises(PartitionError, match="differ in length"):
        moved_layers([0, 0], [0])


@pytest.mark.parametrize(
    ("assignment", "lost", "speeds", "bounds", "moved"),
    [
        # lose the last of 4 stages: its 2 layers must move, one more shifts to balance 3/3/2
        ([0, 0, 1, 1, 2, 2, 3, 3], 3, [1, 1, 1], (0, 2, 5, 8), 3),
        # lose a middle stage: survivors keep everything they had except what balance needs
        ([0, 0, 1, 1, 2, 2, 3, 3], 1, [1, 1, 1], (0, 3, 6, 8), 2),
        # lose the first stage
        ([0, 0, 1, 1, 2, 2, 3, 3], 0, [1, 1, 1], (0, 3, 6, 8), 3),
        # two stages → one: all layers on the survivor
        ([0, 0, 0, 1, 1], 0, [1], (0, 5), 3),
        ([0, 0, 0, 1, 1], 1, [1], (0, 5), 2),
        # a faster survivor takes more of the lost stage's layers
        ([0, 0, 1, 1, 2, 2], 1, [1, 2], (0, 2, 6), 2),
    ],
)
def test_takeover_table(
    assignment: list[int], lost: int, speeds: list[float], bounds: tuple[int, ...], moved: int
) -> None:
    costs = [1.0] * len(assignment)
    p = takeover(assignment, lost, costs, speeds_of_survivors=speeds)
    assert p.bounds == bounds
    assert p.moved == moved
    renumbered = [-1 if s == lost else s - (s > lost) for s in assignment]
    assert len(moved_layers(renumbered, p.assignment())) == moved
    # every layer of the lost stage moved; nothing else moved beyond what the count says
    assert all(
        i in moved_layers(renumbered, p.assignment()) for i, s in enumerate(assignment) if s == lost
    )


@pytest.mark.parametrize(
    ("assignment", "lost", "costs", "speeds", "message"),
    [
        ([0, 1], 2, [1, 1], [1], "lost stage 2 is not one of the 2 stages"),
        ([0, 1], -1, [1, 1], [1], "lost stage -1"),
        ([0, 0], 0, [1, 1], [], "no stage survives"),
        ([0, 1, 1], 0, [1, 1], [1], "assignment names 3 layers, layer_costs 2"),
        ([1, 0], 0, [1, 1], [1], "non-decreasing"),
        ([0, 2], 0, [1, 1], [1], "non-decreasing stage indices in 0..1"),
        ([0, 1, 2], 0, [1, 1, 1], [1, 1], None),  # fine: a baseline for the table
    ],
)
def test_takeover_errors(
    assignment: list[int],
    lost: int,
    costs: list[float],
    speeds: list[float],
    message: str | None,
) -> None:
    if message is None:
        assert takeover(assignment, lost, costs, speeds_of_survivors=speeds).num_stages == len(
            speeds
        )
        return
    with pytest.raises(PartitionError, match=message):
        takeover(assignment, lost, costs, speeds_of_survivors=speeds)


# ---- brute force ---------------------------------------------------------------------------


def _span(costs: Sequence[float], a: int, e: int) -> float:
    acc = 0.0  # left to right, as the planner sums (sum() may compensate on newer Pythons)
    for c in costs[a:e]:
        acc += c
    return acc


def _all_cuts(n_layers: int, n_stages: int) -> list[tuple[int, ...]]:
    return [
        (0, *inner, n_layers) for inner in itertools.combinations(range(1, n_layers), n_stages - 1)
    ]


def _random_instance(rng: random.Random) -> tuple[list[float], list[float], list[int], float]:
    n_layers = rng.randint(1, 9)
    n_stages = rng.randint(1, min(4, n_layers))
    if rng.random() < 0.5:
        costs = [float(rng.randint(0, 6)) for _ in range(n_layers)]
        speeds = [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(n_stages)]
    else:
        costs = [rng.uniform(0.1, 5.0) for _ in range(n_layers)]
        speeds = [rng.uniform(0.3, 3.0) for _ in range(n_stages)]
    style = rng.choice(["contiguous", "random", "lost"])
    if style == "contiguous":  # a real earlier placement, possibly of a different stage count
        old = rng.randint(1, min(5, n_layers))
        current = [i * old // n_layers for i in range(n_layers)]
    elif style == "random":
        current = [rng.randint(0, n_stages - 1) for _ in range(n_layers)]
    else:
        current = [rng.choice([-1, *range(n_stages)]) for _ in range(n_layers)]
    slack = rng.choice([0.0, 0.02, 0.1, 0.3])
    return costs, speeds, current, slack


INSTANCES = [_random_instance(random.Random(7000 + i)) for i in range(300)]


def test_partition_matches_brute_force() -> None:
    for costs, speeds, current, slack in INSTANCES:
        where = f"costs={costs} speeds={speeds} current={current} slack={slack}"
        plans = []
        for bounds in _all_cuts(len(costs), len(speeds)):
            times = [
                _span(costs, a, e) / v for a, e, v in zip(bounds, bounds[1:], speeds, strict=False)
            ]
            assignment = [s for s in range(len(speeds)) for _ in range(bounds[s], bounds[s + 1])]
            plans.append((len(moved_layers(current, assignment)), max(times), bounds))
        optimum = min(bn for _, bn, _ in plans)
        within = [p for p in plans if p[1] <= optimum * (1 + slack)]
        fewest, lowest, bounds = min(within)

        got = partition_layers(costs, speeds, current=current, slack=slack)
        assert got.optimum == optimum, where
        assert got.bottleneck <= optimum * (1 + slack), where
        assert got.moved == fewest, where  # minimal among the plans within the slack
        assert (got.moved, got.bottleneck, got.bounds) == (fewest, lowest, bounds), where
        assert got.moved == len(moved_layers(current, got.assignment())), where

        plain = partition_layers(costs, speeds, slack=slack)  # no current: lowest bottleneck
        assert plain.bottleneck == optimum and plain.moved == 0, where
        assert plain.bounds == min(b for _, bn, b in plans if bn == optimum), where


def test_partition_is_deterministic_and_typed() -> None:
    costs, speeds, current, slack = INSTANCES[0]
    a = partition_layers(costs, speeds, current=current, slack=slack)
    b = partition_layers(list(costs), tuple(speeds), current=tuple(current), slack=slack)
    assert a == b and isinstance(a, Partition)
    assert all(isinstance(x, int) for x in a.bounds) and isinstance(a.moved, int)


# ---- memory: each stage's bytes as a constraint beside compute ------------------------------


def test_partition_under_a_byte_cap_matches_brute_force() -> None:
    """Among the cuts whose every stage holds at most the cap, the same order as without one;
    no such cut: an error naming the smallest largest stage."""
    rng = random.Random(91)
    for costs, speeds, current, slack in INSTANCES:
        sizes = [float(rng.randint(0, 9)) for _ in costs]
        fits = []
        for bounds in _all_cuts(len(costs), len(speeds)):
            held = [_span(sizes, a, e) for a, e in zip(bounds, bounds[1:], strict=False)]
            times = [
                _span(costs, a, e) / v for a, e, v in zip(bounds, bounds[1:], speeds, strict=False)
            ]
            assignment = [s for s in range(len(speeds)) for _ in range(bounds[s], bounds[s + 1])]
            fits.append((max(held), len(moved_layers(current, assignment)), max(times), bounds))
        least = min(h for h, *_ in fits)
        assert smallest_largest_stage(sizes, len(speeds)) == least
        cap = rng.choice([least, least + 1.0, sum(sizes)])
        within_cap = [p for p in fits if p[0] <= cap]
        optimum = min(bn for _, _, bn, _ in within_cap)
        within = [p[1:] for p in within_cap if p[2] <= optimum * (1 + slack)]
        where = f"costs={costs} sizes={sizes} speeds={speeds} current={current} cap={cap}"

        got = partition_layers(
            costs, speeds, current=current, slack=slack, layer_bytes=sizes, max_bytes=cap
        )
        assert got.optimum == optimum, where
        assert (got.moved, got.bottleneck, got.bounds) == min(within), where
        assert max(got.stage_bytes) <= cap and sum(got.stage_bytes) == sum(sizes), where
        if least > 0:
            with pytest.raises(PartitionError, match="smallest largest stage"):
                partition_layers(costs, speeds, layer_bytes=sizes, max_bytes=least * 0.99)


@pytest.mark.parametrize(
    ("costs", "sizes", "stages", "balance", "bounds"),
    [
        # an embedding that weighs much and costs little: compute alone puts it with 3 blocks
        ([0.2, 1, 1, 1, 1, 1, 1, 0.5], [8, 2, 2, 2, 2, 2, 2, 4], 2, 0.0, (0, 4, 8)),
        # held to 1.1 × an even share (12 bytes → 13.2): one block moves to the second stage
        ([0.2, 1, 1, 1, 1, 1, 1, 0.5], [8, 2, 2, 2, 2, 2, 2, 4], 2, 1.10, (0, 3, 8)),
        # no cut meets 1.1 × even (an embedding of 9 in 12): 1.1 × the least largest stage, 9
        ([1, 1, 1, 1], [9, 1, 1, 1], 2, 1.10, (0, 1, 4)),
        ([1, 1, 1, 1], [9, 1, 1, 1], 2, 0.0, (0, 2, 4)),
        # balanced bytes already: the compute cut stands
        ([1] * 6, [1] * 6, 3, 1.10, (0, 2, 4, 6)),
    ],
)
def test_stage_memory_cut(
    costs: list[float], sizes: list[float], stages: int, balance: float, bounds: tuple
) -> None:
    part = StageMemory(tuple(sizes), balance).cut(costs, [1.0] * stages)
    assert part.bounds == bounds
    if balance:
        assert max(part.stage_bytes) <= bytes_cap(sizes, stages, balance=balance)


def test_bytes_cap_and_limit() -> None:
    assert bytes_cap([4, 1, 1, 1, 1], 2) == pytest.approx(4.4)
    assert bytes_cap([9, 1, 1, 1], 2) == pytest.approx(9.9)  # the embedding alone outweighs 6
    assert bytes_cap([4, 1, 1, 1, 1], 2, limit=4.0) == 4.0
    assert StageMemory().cap(2) == float("inf")  # no bytes known: compute alone
    assert StageMemory((1.0, 1.0), 0.0, 5.0).cap(2) == 5.0  # balance off, the limit stays
    # a limit no cut meets is refused in one line
    with pytest.raises(
        PartitionError, match=r"at most 8 bytes per stage.*smallest largest stage is 9"
    ):
        StageMemory((9.0, 1.0, 1.0, 1.0), limit=8.0).cut([1] * 4, [1.0, 1.0])
    # bytes that do not name every layer are ignored, never a refusal
    assert StageMemory((9.0,), limit=1.0).cut([1] * 4, [1.0, 1.0]).bounds == (0, 2, 4)
    with pytest.raises(PartitionError, match="layer_bytes names 1 layers"):
        partition_layers([1, 1], [1.0], layer_bytes=[1.0])
    with pytest.raises(PartitionError, match="layer bytes must be finite"):
        partition_layers([1, 1], [1.0], layer_bytes=[1.0, -1.0])


def test_a_cap_at_the_smallest_largest_stage_is_met_exactly() -> None:
    """stage_balance 1.0 holds a cut to the least largest stage itself: the cap and the cut's
    bytes are the same sums, so fractional bytes never miss it by a rounding."""
    rng = random.Random(5)
    for _ in range(200):
        sizes = tuple(rng.uniform(0.01, 3.0) for _ in range(rng.randint(2, 9)))
        stages = rng.randint(1, len(sizes))
        part = StageMemory(sizes, balance=1.0).cut([1.0] * len(sizes), [1.0] * stages)
        assert max(part.stage_bytes) <= max(
            smallest_largest_stage(sizes, stages), 1.0 * sum(sizes) / stages
        )


def test_takeover_within_a_limit() -> None:
    """Survivors take over within the limit, or the takeover is refused (the planner then
    drops the replica)."""
    sizes = (4.0, 2.0, 2.0, 2.0, 2.0, 4.0)
    got = takeover(
        [0, 0, 1, 1, 2, 2], 1, [1] * 6, speeds_of_survivors=[1.0, 1.0], memory=StageMemory(sizes)
    )
    assert got.bounds == (0, 3, 6) and got.stage_bytes == (8.0, 8.0)
    with pytest.raises(PartitionError):
        takeover(
            [0, 0, 1, 1, 2, 2],
            1,
            [1] * 6,
            speeds_of_survivors=[1.0, 1.0],
            memory=StageMemory(sizes, limit=7.0),
        )
