"""Shard layout and transfer plans: every element owned once, transfers disjoint and complete."""

from __future__ import annotations

import random

import pytest
import torch

from elaswave.runtime.shards import ShardLayout, buddy, plan_transfers, transfer_stats

SEGMENTS = ((0, 10), (10, 7), (17, 1), (18, 33))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_element_is_owned_exactly_once(world: int) -> None:
    layout = ShardLayout(SEGMENTS, world)
    owned = [i for r in range(world) for lo, n in layout.pieces(r) for i in range(lo, lo + n)]
    assert sorted(owned) == list(range(layout.numel))
    sizes = [layout.shard_size(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= len(SEGMENTS), "shards are balanced per layer"


@pytest.mark.parametrize("world", [1, 3, 4])
def test_gather_index_round_trips(world: int) -> None:
    layout = ShardLayout(SEGMENTS, world)
    flat = torch.arange(layout.numel, dtype=torch.float32) + 1
    ext = torch.cat([flat, torch.zeros(1)])
    index = layout.gather_index()
    rank_major = ext[index].view(world, layout.padded_size)
    for r in range(world):
        expect = torch.cat([flat[lo : lo + n] for lo, n in layout.pieces(r)] or [torch.zeros(0)])
        assert torch.equal(rank_major[r, : len(expect)], expect)
        assert torch.all(rank_major[r, len(expect) :] == 0), "padding reads the zero slot"
    back = torch.zeros(layout.numel + 1)
    back.index_copy_(0, index, rank_major.reshape(-1))
    assert torch.equal(back[: layout.numel], flat)


def _apply(moves, old, old_workers, holders, new, new_workers):  # noqa: ANN001, ANN202
    """Simulate: start from what each live worker holds, apply moves, return new ownership."""
    have: dict[str, set[int]] = {w: set() for w in set(old_workers) | set(new_workers)}
    for r, w in holders.items():
        for lo, n in old.pieces(r):
            have[w] |= set(range(lo, lo + n))
    for m in moves:
        span = set(range(m.offset, m.offset + m.length))
        assert span <= have[m.src], "a transfer sends data its source does not hold"
        have[m.dst] |= span
    return have


@pytest.mark.parametrize(
    ("old_world", "dead", "joiners"),
    [(4, [1], 0), (4, [3], 0), (4, [0, 2], 0), (3, [], 1), (4, [2], 1), (8, [5], 0), (2, [1], 0)],
)
def test_transfers_cover_the_new_layout_disjointly(
    old_world: int, dead: list[int], joiners: int
) -> None:
    old_workers = [f"w{i}" for i in range(old_world)]
    holders = {}
    for r in range(old_world):
        b = buddy(r, old_world)
        holders[r] = old_workers[r] if r not in dead else old_workers[b]
    new_workers = [w for i, w in enumerate(old_workers) if i not in dead] + [
        f"n{i}" for i in range(joiners)
    ]
    old, new = ShardLayout(SEGMENTS, old_world), ShardLayout(SEGMENTS, len(new_workers))
    moves = plan_transfers(old, holders, new, new_workers)
    have = _apply(moves, old, old_workers, holders, new, new_workers)
    for r, w in enumerate(new_workers):
        for lo, n in new.pieces(r):
            assert set(range(lo, lo + n)) <= have[w], f"{w} misses part of its new shard"
    received = [(m.dst, i) for m in moves for i in range(m.offset, m.offset + m.length)]
    assert len(received) == len(set(received)), "an element was sent twice to the same rank"
    assert all(m.src in holders.values() for m in moves)


def test_losing_both_copies_is_reported() -> None:
    old, new = ShardLayout(SEGMENTS, 4), ShardLayout(SEGMENTS, 2)
    holders = {0: "w0", 2: "w2"}  # ranks 1 and its buddy 2... rank 1's copy is gone
    with pytest.raises(KeyError, match="old rank 1"):
        plan_transfers(old, holders, new, ["w0", "w2"])


def test_stats_balance() -> None:
    rng = random.Random(0)
    segs = tuple((sum(range(i)), rng.randint(50, 90)) for i in range(1, 6))
    segs = tuple((sum(n for _, n in segs[:i]), n) for i, (_, n) in enumerate(segs))
    holders = {0: "a", 1: "c", 2: "c", 3: "d"}  # b died, its buddy c holds its shard
    moves = plan_transfers(ShardLayout(segs, 4), holders, ShardLayout(segs, 3), ["a", "c", "d"])
    stats = transfer_stats(moves, 4)
    assert stats["bytes"] == 4 * sum(m.length for m in moves) > 0
    assert stats["pairs"] >= 2 and stats["max_over_mean"] >= 1.0


@pytest.mark.parametrize(
    ("hosts", "shift"),
    [
        (["a", "a", "a", "a"], 1),  # one host: the next rank
        (["a", "a", "b", "b"], 2),  # two hosts of two: across
        (["a", "b", "a", "b"], 1),  # interleaved already
        (["a", "a", "a", "b", "b", "b"], 3),
        (["a", "a", "b"], 1),  # no shift works for everyone: fall back to the next rank
        (["h1", "h1", "h2", "h2", "h3", "h3"], 2),
    ],
)
def test_buddy_shift_crosses_hosts_when_it_can(hosts: list[str], shift: int) -> None:
    from elaswave.runtime.shards import buddy_shift

    assert buddy_shift(hosts) == shift
    world = len(hosts)
    holders = sorted(buddy(r, world, shift) for r in range(world))
    assert holders == list(range(world)), "every rank keeps exactly one replica"
