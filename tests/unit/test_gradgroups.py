"""Gradient reduction among holders: which ranks sum which elements (tables)."""

from __future__ import annotations

import pytest

from elaswave.planning.gradgroups import first_holders, group_name, reductions, tie_copies
from elaswave.planning.stageshards import holder_blocks

# Four layers of 10 elements each.
OFFSETS = [(0, 10), (10, 20), (20, 30), (30, 40)]
SEGMENTS = [(a, b - a) for a, b in OFFSETS]


def _layout(*cuts: tuple[int, ...]) -> list[range]:
    """Rank order: replica 0's stages, then replica 1's, ... (as plans number them)."""
    return [range(cut[s], cut[s + 1]) for cut in cuts for s in range(len(cut) - 1)]


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [
        # dp=2 × pp=2, cut alike: one holder set per stage, each over its stage's elements.
        (((0, 2, 4), (0, 2, 4)), [((0, 2), ((0, 20),)), ((1, 3), ((20, 40),))]),
        # Replica 1 re-cut: only the layer where the cuts differ gets a set of its own.
        (
            ((0, 2, 4), (0, 3, 4)),
            [((0, 2), ((0, 20),)), ((1, 2), ((20, 30),)), ((1, 3), ((30, 40),))],
        ),
        # A replica of one stage next to one of two: its rank is in every set.
        (((0, 4), (0, 1, 4)), [((0, 1), ((0, 10),)), ((0, 2), ((10, 40),))]),
        # dp=1: every set has one member (nothing to reduce, but still listed).
        (((0, 1, 4),), [((0,), ((0, 10),)), ((1,), ((10, 40),))]),
    ],
)
def test_each_run_of_layers_is_reduced_among_exactly_its_holders(
    cuts: tuple[tuple[int, ...], ...], expected: list
) -> None:
    blocks = holder_blocks(_layout(*cuts), OFFSETS)
    got = [(r.members, r.spans) for r in reductions(blocks)]
    assert got == expected


def test_a_tied_weight_is_summed_over_the_holders_of_either_copy() -> None:
    """Layer 0's elements 0:4 and layer 3's 30:34 are one weight. dp=2 × pp=2: the first copy
    is summed over all four ranks, the second is not reduced (it is copied), and each block
    reduces its other elements among its holders."""
    blocks = holder_blocks(_layout((0, 2, 4), (0, 2, 4)), OFFSETS)
    ties = [((0, 4), (30, 34))]
    got = [(r.members, r.spans) for r in reductions(blocks, ties)]
    assert got == [
        ((0, 1, 2, 3), ((0, 4),)),
        ((0, 2), ((4, 20),)),
        ((1, 3), ((20, 30), (34, 40))),
    ]
    assert [tie_copies(blocks, ties, r) for r in range(4)] == [[], [((0, 4), (30, 34))]] * 2
    # Every element is reduced once or copied once: nothing summed twice, nothing left out.
    reduced = sorted(x for r in reductions(blocks, ties) for a, b in r.spans for x in range(a, b))
    assert reduced == [x for x in range(40) if not 30 <= x < 34]


def test_each_layer_is_counted_in_the_norm_by_one_rank() -> None:
    blocks = holder_blocks(_layout((0, 2, 4), (0, 3, 4)), OFFSETS)
    assert first_holders(blocks, SEGMENTS) == [0, 0, 1, 1]
    assert first_holders(blocks, [*SEGMENTS, (40, 0)]) == [0, 0, 1, 1, -1]


def test_a_group_is_named_by_its_workers_in_order() -> None:
    assert group_name(["w0", "w2"]) == group_name(["w0", "w2"])
    assert group_name(["w0", "w2"]) != group_name(["w2", "w0"])
    assert group_name(["w0", "w2"]) != group_name(["w0", "w3"])


@pytest.mark.parametrize(
    ("replicas", "hierarchy", "tiered"),
    [
        (
            ((0, 3), (1, 4), (5, 2)),
            "auto",
            2,
        ),  # each stage's holders: two on one host, one on the other
        (((0, 3), (1, 4), (5, 2)), "flat", 0),
        (((0, 3), (1, 4), (2, 5)), "auto", 0),  # each stage's holders on one host: nothing to gain
    ],
)
def test_holder_groups_go_by_tiers_where_they_span_hosts_and_share_one(
    replicas: tuple, hierarchy: str, tiered: int
) -> None:
    """Two hosts of three ranks, three pipelines of two stages: each holder group gets its own
    tiers over its members (host and lane groups named after it) where ``hierarchy: auto``,
    its members span both hosts and two of them share one."""
    from elaswave.planning.plan import Plan
    from elaswave.runtime.strategies.pipeline.stagegrads import GradLayout

    workers = tuple(f"{h}.w{i}" for h in "ab" for i in range(3))
    plan = Plan(epoch=1, workers=workers, hosts=("a",) * 3 + ("b",) * 3,
                microbatches=(1,) * 6, store="s", replicas=replicas, bounds=((0, 2, 4),) * 3,
                shares=(2, 2, 2))  # fmt: skip
    offsets = [(0, 10), (10, 20), (20, 30), (30, 40)]  # each layer's (start, stop)
    layout = GradLayout.of(plan, offsets, (), hierarchy=hierarchy)
    assert sum(t is not None for t in layout.tiers) == tiered
    groups = layout.groups(plan)
    for name, tiers in zip(layout.names, layout.tiers, strict=True):
        extra = {g for g in groups if g.startswith(f"{name}.")}
        if tiers is None:
            assert not extra
            continue
        (host,) = {g for g in extra if ".host" in g}  # the host with two of the holders
        assert extra == {host, f"{name}.lane0", f"{name}.lane1"}
        assert len({plan.hosts[plan.workers.index(w)] for w in groups[host]}) == 1
        for lane in (f"{name}.lane0", f"{name}.lane1"):  # one holder per host
            assert len({plan.hosts[plan.workers.index(w)] for w in groups[lane]}) == 2
    mine = layout.of_rank(0, [(a, b - a) for a, b in offsets])  # segments: (offset, length)
    assert set(mine.tiered) == ({mine.mine[0][0]} if tiered else set())
