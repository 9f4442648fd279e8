"""ZeRO-1 inside pipeline stages: intervals, blocks, moment duties, the parameter gather, and
the moves after a layout change."""

from __future__ import annotations

import random

import pytest

from elaswave.planning.stageshards import (
    Block,
    LayersLost,
    Piece,
    coverage,
    gather_plan,
    holder_blocks,
    merge,
    moment_duty,
    part_keepers,
    piece_stats,
    plan_piece_transfers,
    split_even,
    subtract,
)

INSTANCES = 300
TEN = [(0, 10), (10, 20), (20, 30), (30, 40)]  # four layers of ten elements


def elements(intervals) -> set[int]:
    return {x for a, b in intervals for x in range(a, b)}


def random_intervals(rnd: random.Random, n: int) -> list[tuple[int, int]]:
    out = []
    for _ in range(rnd.randint(0, 3)):
        a = rnd.randint(0, n)
        out.append((a, rnd.randint(a, n)))
    return out


def random_layout(rnd: random.Random) -> tuple[list[range | None], list[tuple[int, int]], int]:
    """Ranks holding random contiguous layer ranges (some nothing) of layers of random sizes."""
    offsets, cursor = [], 0
    for _ in range(rnd.randint(1, 6)):
        size = rnd.choice([0, 1, 2, 3, 5, 8, 13])
        offsets.append((cursor, cursor + size))
        cursor += size
    layers_of: list[range | None] = []
    for _ in range(rnd.randint(1, 7)):
        if rnd.random() < 0.15:
            layers_of.append(None)
        else:
            a = rnd.randrange(len(offsets))
            layers_of.append(range(a, rnd.randint(a + 1, len(offsets))))
    return layers_of, offsets, len(layers_of)


def random_blocks(seed: int) -> tuple[list[Block], int]:
    _, _, world = layout = random_layout(random.Random(seed))
    return holder_blocks(layout[0], layout[1]), world


# ---- intervals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ([], []),
        ([(3, 3)], []),
        ([(5, 7), (0, 2)], [(0, 2), (5, 7)]),
        ([(0, 2), (2, 4)], [(0, 4)]),  # adjacent
        ([(0, 3), (2, 5)], [(0, 5)]),  # overlapping
        ([(0, 10), (2, 3)], [(0, 10)]),  # nested
        ([(4, 4), (1, 2), (2, 2)], [(1, 2)]),  # empty ones dropped
    ],
)
def test_merge(given, expected) -> None:
    assert merge(given) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ([], [(0, 5)], []),
        ([(0, 5)], [], [(0, 5)]),
        ([(0, 10)], [(2, 4)], [(0, 2), (4, 10)]),  # b nested in a
        ([(2, 4)], [(0, 10)], []),  # a nested in b
        ([(0, 10)], [(0, 10)], []),
        ([(0, 5)], [(5, 8)], [(0, 5)]),  # adjacent
        ([(0, 4), (4, 8)], [(3, 5)], [(0, 3), (5, 8)]),  # a's pieces merged first
        ([(0, 3), (6, 9)], [(2, 7)], [(0, 2), (7, 9)]),  # one b across two of a
        ([(0, 10)], [(1, 2), (3, 4), (8, 12)], [(0, 1), (2, 3), (4, 8)]),
        ([(6, 9), (0, 3)], [(7, 8), (1, 2)], [(0, 1), (2, 3), (6, 7), (8, 9)]),  # unsorted
    ],
)
def test_subtract(a, b, expected) -> None:
    assert subtract(a, b) == expected


def test_subtract_is_set_difference() -> None:
    rnd = random.Random(1)
    for _ in range(INSTANCES):
        a, b = random_intervals(rnd, 20), random_intervals(rnd, 20)
        got = subtract(a, b)
        assert elements(got) == elements(a) - elements(b)
        assert got == merge(got)


@pytest.mark.parametrize(
    ("start", "stop", "parts", "expected"),
    [
        (0, 10, 3, [(0, 4), (4, 7), (7, 10)]),
        (5, 7, 4, [(5, 6), (6, 7), (7, 7), (7, 7)]),
        (0, 0, 2, [(0, 0), (0, 0)]),
        (3, 9, 1, [(3, 9)]),
    ],
)
def test_split_even(start, stop, parts, expected) -> None:
    assert split_even(start, stop, parts) == expected


def test_split_even_needs_a_part() -> None:
    with pytest.raises(ValueError, match="parts"):
        split_even(0, 4, 0)


# ---- blocks ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("layers_of", "offsets", "expected"),
    [
        (  # dp 2 × pp 2, replicas cut alike: ranks 0,2 hold stage 0, ranks 1,3 stage 1
            [range(0, 2), range(2, 4), range(0, 2), range(2, 4)],
            TEN,
            [Block(0, 20, (0, 2)), Block(20, 40, (1, 3))],
        ),
        (  # after a takeover: rank 0 runs all four layers, ranks 1 and 2 half each
            [range(0, 4), range(0, 2), range(2, 4)],
            TEN,
            [Block(0, 20, (0, 1)), Block(20, 40, (0, 2))],
        ),
        (  # a newcomer holds nothing yet
            [range(0, 2), range(2, 4), None, range(0, 4)],
            TEN,
            [Block(0, 20, (0, 3)), Block(20, 40, (1, 3))],
        ),
        (  # layers 1 and 2 are held by nobody
            [range(0, 1), range(3, 4)],
            TEN,
            [Block(0, 10, (0,)), Block(30, 40, (1,))],
        ),
        (  # an empty layer is skipped and does not break the run
            [range(0, 3), range(0, 3)],
            [(0, 4), (4, 4), (4, 9)],
            [Block(0, 9, (0, 1))],
        ),
        ([None, None], TEN, []),
    ],
)
def test_holder_blocks(layers_of, offsets, expected) -> None:
    assert holder_blocks(layers_of, offsets) == expected


def test_blocks_are_maximal_runs_of_one_holder_set() -> None:
    for seed in range(INSTANCES):
        layers_of, offsets, _ = random_layout(random.Random(seed))
        blocks = holder_blocks(layers_of, offsets)
        holders_at = {}
        for layer, (a, b) in enumerate(offsets):
            owners = tuple(r for r, h in enumerate(layers_of) if h is not None and layer in h)
            holders_at.update(dict.fromkeys(range(a, b), owners))
        for block in blocks:
            assert block.stop > block.start and block.holders
            assert all(holders_at[x] == block.holders for x in range(block.start, block.stop))
        covered = elements((b.start, b.stop) for b in blocks)
        assert covered == {x for x, owners in holders_at.items() if owners}
        assert sum(b.stop - b.start for b in blocks) == len(covered)  # disjoint
        for left, right in zip(blocks, blocks[1:], strict=False):
            assert left.stop <= right.start
            assert left.stop < right.start or left.holders != right.holders  # maximal


# ---- moment duties -----------------------------------------------------------------------------
def test_moment_duty_of_three_holders() -> None:
    duty = moment_duty([Block(0, 10, (0, 2, 5))], world=6)
    # parts 0:4, 4:7, 7:10 kept by (0, 2), (2, 5), (5, 0)
    assert duty == [[(0, 4), (7, 10)], [], [(0, 7)], [], [], [(4, 10)]]
    assert moment_duty([Block(0, 10, (0, 2, 5))], world=6, copies=1) == [
        [(0, 4)], [], [(4, 7)], [], [], [(7, 10)]
    ]  # fmt: skip


def test_one_holder_keeps_its_block_and_two_keep_everything() -> None:
    assert moment_duty([Block(0, 7, (3,))], world=4) == [[], [], [], [(0, 7)]]
    assert moment_duty([Block(0, 7, (1, 2))], world=4) == [[], [(0, 7)], [(0, 7)], []]


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_every_element_kept_by_min_copies_k_holders(copies: int) -> None:
    for seed in range(INSTANCES):
        blocks, world = random_blocks(seed)
        duty = moment_duty(blocks, world, copies)
        assert len(duty) == world and all(d == merge(d) for d in duty)
        keepers: dict[int, list[int]] = {}
        for r, kept in enumerate(duty):
            for x in elements(kept):
                keepers.setdefault(x, []).append(r)
        in_blocks = elements((b.start, b.stop) for b in blocks)
        assert set(keepers) == in_blocks  # nothing outside blocks is kept
        for block in blocks:
            k, size = len(block.holders), block.stop - block.start
            for x in range(block.start, block.stop):
                assert len(keepers[x]) == min(copies, k)
                assert set(keepers[x]) <= set(block.holders)
            for r in block.holders:
                mine = len(elements(duty[r]) & set(range(block.start, block.stop)))
                assert abs(mine * k - min(copies, k) * size) <= copies * k


def test_a_single_loss_leaves_a_keeper_of_every_element() -> None:
    for seed in range(INSTANCES):
        blocks, world = random_blocks(seed)
        duty = moment_duty(blocks, world)
        for dead in range(world):
            alive = elements(i for r, d in enumerate(duty) if r != dead for i in d)
            for block in blocks:
                if len(block.holders) >= 2:
                    assert set(range(block.start, block.stop)) <= alive


# ---- the parameter gather ----------------------------------------------------------------------
def test_gather_plan_of_three_holders() -> None:
    # parts 0:4, 4:7, 7:10 with primaries 0, 2, 5; each goes to the one holder not keeping it
    assert gather_plan([Block(0, 10, (0, 2, 5))]) == [
        Piece(0, 5, 0, 4), Piece(2, 0, 4, 7), Piece(5, 2, 7, 10)
    ]  # fmt: skip


def test_gather_plan_of_two_or_fewer_holders_is_empty() -> None:
    blocks = [Block(0, 5, (0,)), Block(5, 9, (1, 2)), Block(9, 20, (0, 3))]
    assert gather_plan(blocks) == []


@pytest.mark.parametrize("copies", [1, 2, 3])
def test_kept_and_received_cover_each_holders_blocks_once(copies: int) -> None:
    for seed in range(INSTANCES):
        blocks, world = random_blocks(seed)
        duty = moment_duty(blocks, world, copies)
        plan = gather_plan(blocks, copies)
        received: list[list[int]] = [[] for _ in range(world)]
        for p in plan:
            assert p.stop > p.start
            assert elements([(p.start, p.stop)]) <= elements(duty[p.src])  # sends what it keeps
            received[p.dst] += range(p.start, p.stop)
        for r in range(world):
            mine = elements((b.start, b.stop) for b in blocks if r in b.holders)
            kept = elements(duty[r])
            assert len(received[r]) == len(set(received[r]))  # nothing twice
            assert not kept & set(received[r])  # never what it keeps
            assert kept | set(received[r]) == mine
        if all(len(b.holders) <= copies for b in blocks):
            assert plan == []
        runs = {(p.src, p.dst, p.stop) for p in plan}
        assert not any((p.src, p.dst, p.start) in runs for p in plan)  # adjacent ones joined


# ---- moves after a layout change ---------------------------------------------------------------
@pytest.mark.parametrize(
    ("have", "want", "expected"),
    [
        ([[(0, 10)], [(0, 10)], []], [[], [], [(0, 10)]], [Piece(0, 2, 0, 10)]),  # tie: lowest
        (  # the second receiver goes to the peer that has sent less
            [[(0, 10)], [(0, 10)], [], []],
            [[], [], [(0, 10)], [(0, 10)]],
            [Piece(0, 2, 0, 10), Piece(1, 3, 0, 10)],
        ),
        (  # cut where a source's interval ends
            [[(0, 4)], [(0, 10)], []],
            [[], [], [(0, 10)]],
            [Piece(0, 2, 0, 4), Piece(1, 2, 4, 10)],
        ),
        (  # same source on both sides of a cut: one piece
            [[(0, 10)], [(5, 20)], [], []],
            [[], [], [(10, 20)], [(0, 10)]],
            [Piece(1, 2, 10, 20), Piece(0, 3, 0, 10)],
        ),
        (  # what a rank has needs nothing
            [[(0, 10)], [(2, 4)]],
            [[(0, 5)], [(0, 6)]],
            [Piece(0, 1, 0, 2), Piece(0, 1, 4, 6)],
        ),
        ([[(0, 5)], []], [[(0, 5)], []], []),
    ],
)
def test_plan_piece_transfers(have, want, expected) -> None:
    assert plan_piece_transfers(have, want) == expected


def test_elements_held_by_nobody_are_lost() -> None:
    with pytest.raises(LayersLost, match="elements 5:8 are held by no surviving rank"):
        plan_piece_transfers([[(0, 5)], []], [[], [(0, 8)]])
    # elements nobody has (5:6) are no loss while nobody needs them
    assert plan_piece_transfers([[(0, 5)], [(6, 9)]], [[(0, 5)], [(1, 2)]]) == [Piece(0, 1, 1, 2)]


def test_plan_piece_transfers_ragged_arguments() -> None:
    with pytest.raises(ValueError, match="ranks"):
        plan_piece_transfers([[]], [[], []])


def check_moves(have, want, plan) -> None:
    received: list[list[int]] = [[] for _ in want]
    for p in plan:
        assert p.stop > p.start
        assert elements([(p.start, p.stop)]) <= elements(have[p.src])  # src has it
        received[p.dst] += range(p.start, p.stop)
    for d in range(len(want)):
        assert len(received[d]) == len(set(received[d]))  # nothing twice
        assert not set(received[d]) & elements(have[d])  # nothing it has
        assert set(received[d]) == elements(want[d]) - elements(have[d])
    runs = {(p.src, p.dst, p.stop) for p in plan}
    assert not any((p.src, p.dst, p.start) in runs for p in plan)  # adjacent ones joined


def test_plan_piece_transfers_delivers_exactly_what_is_missing() -> None:
    rnd, raised = random.Random(7), 0
    for _ in range(INSTANCES):
        world, n = rnd.randint(1, 6), rnd.randint(1, 30)
        have = [random_intervals(rnd, n) for _ in range(world)]
        want = [random_intervals(rnd, n) for _ in range(world)]
        missing = set().union(*(elements(w) - elements(h) for w, h in zip(want, have, strict=True)))
        lost = missing - set().union(*(elements(h) for h in have))
        if lost:
            raised += 1
            with pytest.raises(LayersLost) as info:
                plan_piece_transfers(have, want)
            a, b = (int(x) for x in str(info.value).split()[1].split(":"))
            assert a == min(lost) and set(range(a, b)) <= lost
            continue
        check_moves(have, want, plan_piece_transfers(have, want))
    assert 0 < raised < INSTANCES  # both branches exercised


def test_moments_after_a_loss_come_from_the_surviving_copy() -> None:
    """One rank dies and the survivors take over (stretch their stages, newcomers join): moments
    of layers that had two or more holders are never lost."""
    raised = 0
    for seed in range(INSTANCES):
        rnd = random.Random(seed)
        layers_of, offsets, world = random_layout(rnd)
        dead = rnd.randrange(world)
        before = holder_blocks(layers_of, offsets)
        have = [[] if r == dead else kept for r, kept in enumerate(moment_duty(before, world))]
        after: list[range | None] = []
        for r, held in enumerate(layers_of):
            if r == dead or held is None and rnd.random() < 0.5:
                after.append(None)
            else:
                a, b = (held.start, held.stop) if held else (len(offsets), 0)
                a = rnd.randint(0, min(a, len(offsets) - 1))
                after.append(range(a, rnd.randint(max(a + 1, b), len(offsets))))
        want = moment_duty(holder_blocks(after, offsets), world)
        safe = elements((b.start, b.stop) for b in before if b.holders != (dead,))
        unsafe = set().union(*map(elements, want)) - safe
        if unsafe:
            raised += 1
            with pytest.raises(LayersLost):
                plan_piece_transfers(have, want)
            continue
        check_moves(have, want, plan_piece_transfers(have, want))
    assert 0 < raised < INSTANCES


# ---- stats -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pieces", "expected"),
    [
        ([], {"elements": 0, "transfers": 0, "pairs": 0, "max_over_mean": 1.0}),
        (
            [Piece(2, 0, 0, 10), Piece(1, 3, 10, 30)],
            {"elements": 30, "transfers": 2, "pairs": 2, "max_over_mean": 1.333},
        ),
        (
            [Piece(0, 1, 0, 5), Piece(0, 1, 7, 9)],
            {"elements": 7, "transfers": 2, "pairs": 1, "max_over_mean": 1.0},
        ),
        (
            [Piece(0, 1, 0, 6), Piece(0, 2, 6, 9), Piece(3, 2, 9, 12)],
            {"elements": 12, "transfers": 3, "pairs": 3, "max_over_mean": 1.5},
        ),
    ],
)
def test_piece_stats(pieces, expected) -> None:
    assert piece_stats(pieces) == expected


def test_piece_to_dict() -> None:
    assert Piece(1, 2, 3, 4).to_dict() == {"src": 1, "dst": 2, "start": 3, "stop": 4}


def test_coverage_cuts_at_every_boundary_and_names_the_keepers() -> None:
    have = [[(0, 10)], [(5, 15)], [], [(12, 20), (0, 2)]]
    assert coverage(have) == [
        ((0, 2), (0, 3)),
        ((2, 5), (0,)),
        ((5, 10), (0, 1)),
        ((10, 12), (1,)),
        ((12, 15), (1, 3)),
        ((15, 20), (3,)),
    ]
    assert coverage([[], []]) == []


@pytest.mark.parametrize(
    ("holders", "hosts", "keepers"),
    [
        # one host (or unknown): holder i and i + 1, cyclically
        ((0, 2, 5), (), [(0, 2), (2, 5), (5, 0)]),
        # holders 0 and 2 share host a: part 0 skips 2 for 5 (host b); part 2 would pair 5 with
        # 0 anyway (another host)
        ((0, 2, 5), ("a", "a", "b"), [(0, 5), (2, 5), (5, 0)]),
        ((0, 1, 2, 3), ("a", "a", "b", "b"), [(0, 2), (1, 2), (2, 0), (3, 0)]),
        # all on one host: no choice
        ((0, 1), ("a", "a"), [(0, 1), (1, 0)]),
    ],
)
def test_keepers_of_a_part_sit_on_different_hosts(
    holders: tuple[int, ...], hosts: tuple[str, ...], keepers: list[tuple[int, int]]
) -> None:
    """A host loss must never take both copies of a part's moments: the second keeper is the
    next holder on another host (found by the pipeline chaos soak: two keepers on one host, the
    host died, the moments were lost)."""
    block = Block(0, 30 * len(holders), holders, hosts)
    assert [k for _, k in part_keepers([block])] == keepers
    host_of = dict(zip(holders, hosts, strict=True)) if hosts else {}
    for _, (a, b) in part_keepers([block]):
        if len(set(hosts)) > 1:
            assert host_of[a] != host_of[b]


def test_holder_blocks_carry_the_holders_hosts() -> None:
    blocks = holder_blocks([range(0, 1), range(0, 1), range(1, 2)], [(0, 10), (10, 20)],
                           ("a", "b", "a"))  # fmt: skip
    assert [(b.holders, b.hosts) for b in blocks] == [((0, 1), ("a", "b")), ((2,), ("a",))]
