"""ZeRO-3 sharded inside each host (``train.shard_scope: host``): the pure planning of each host's
layout after a membership change, and of where every rank reads its new ranges from."""

from __future__ import annotations

import random

import pytest

from elaswave.planning.hostshards import Copy, host_layout, host_ranks, rebuild_transfers
from elaswave.planning.shards import ShardLayout, layer_cuts

SEGMENTS = ((0, 10), (10, 7), (17, 23))  # three layers
NUMEL = 40


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["a", "a", "b", "b"], ((0, 1), (2, 3))),
        (["a", "b", "a"], ((0, 2), (1,))),  # grouped by host, in the order of first rank
        (["a"], ((0,),)),
    ],
)
def test_host_ranks(hosts: list[str], expected: tuple) -> None:
    assert host_ranks(hosts) == expected


def _tiles(layout: ShardLayout) -> None:
    """Every element owned once, no range across a layer boundary (``layer_cuts`` checks)."""
    spans = sorted(r for rank in layout.ranges for r in rank)
    assert sum(n for _, n in spans) == NUMEL
    layer_cuts(layout)


def test_a_host_without_survivors_or_with_overlapping_ones_starts_even() -> None:
    assert host_layout(SEGMENTS, {}, ("x", "y")) == ShardLayout.even(SEGMENTS, 2)
    # two survivors whose ranges come from two layouts (a fault while the last one moved in)
    overlapping = {"x": ((0, 10), (10, 7)), "y": ((5, 5), (17, 23))}
    assert host_layout(SEGMENTS, overlapping, ("x", "y")) == ShardLayout.even(SEGMENTS, 2)


def test_survivors_keep_their_ranges_and_share_the_lost_ones() -> None:
    old = ShardLayout.even(SEGMENTS, 3)
    kept = {"a0": old.ranges[0], "a2": old.ranges[2]}  # a1 lost
    new = host_layout(SEGMENTS, kept, ("a0", "a2"))
    _tiles(new)
    for i, w in enumerate(("a0", "a2")):  # what a survivor held it still owns
        assert set(_elements(kept[w])) <= set(_elements(new.ranges[i]))
    sizes = [new.shard_size(r) for r in range(2)]
    assert max(sizes) - min(sizes) <= len(SEGMENTS)  # the lost ranges cut evenly, per layer


def test_a_joiner_carves_an_even_share_and_the_others_keep_the_rest() -> None:
    old = ShardLayout.even(SEGMENTS, 2)
    kept = {"a0": old.ranges[0], "a1": old.ranges[1]}
    new = host_layout(SEGMENTS, kept, ("a0", "a1", "a2"))
    _tiles(new)
    sizes = [new.shard_size(r) for r in range(3)]
    assert max(sizes) - min(sizes) <= 2 * len(SEGMENTS)
    for r in range(2):  # what a rank owns now it owned before
        assert set(_elements(new.ranges[r])) <= set(_elements(old.ranges[r]))


def test_each_want_reads_itself_then_its_host_then_another_host() -> None:
    copies = [
        Copy("a0", "A", ((0, 20),)),  # a1 (20-40) lost
        Copy("b0", "B", ((0, 10), (30, 10))),
        Copy("b1", "B", ((10, 20),)),
    ]
    wants = [Copy("a0", "A", ((0, 40),)), Copy("a2", "A", ((5, 5),))]
    moves = [(m.src, m.dst, m.offset, m.length) for m in rebuild_transfers(copies, wants)]
    assert moves == [
        ("a0", "a0", 0, 20),  # its own
        ("b1", "a0", 20, 10),  # from the other host, cut where its ranges end
        ("b0", "a0", 30, 10),
        ("a0", "a2", 5, 5),  # a joiner: from its host first
    ]


def test_an_element_without_any_copy_is_named() -> None:
    copies = [Copy("a0", "A", ((0, 20),)), Copy("b0", "B", ((0, 30),))]
    with pytest.raises(KeyError, match="elements 30.. of a0's"):
        rebuild_transfers(copies, [Copy("a0", "A", ((0, 40),))])


@pytest.mark.parametrize("seed", range(8))
def test_any_history_of_losses_and_joins_keeps_a_whole_copy_on_every_host(seed: int) -> None:
    """Random losses (never the last copy of an element) and joins over three hosts: after
    each, moving the data as the transfers say gives every rank exactly its new ranges' values
    (each received once), and every host's layout tiles the model."""
    rng = random.Random(seed)
    flat = list(range(1000, 1000 + NUMEL))
    hosts = {"A": ["A0", "A1"], "B": ["B0", "B1", "B2"], "C": ["C0"]}
    owned: dict[str, tuple] = {}  # each live worker's ranges, and its values of them
    for ws in hosts.values():
        for i, w in enumerate(ws):
            owned[w] = ShardLayout.even(SEGMENTS, len(ws)).ranges[i]
    data = {w: [flat[x] for x in _elements(r)] for w, r in owned.items()}
    for born in range(12):
        if rng.random() < 0.5:
            h = rng.choice([g for g, ws in hosts.items() if ws])
            w = rng.choice(hosts[h])
            if any(ws for g, ws in hosts.items() if g != h):  # another host holds a copy
                hosts[h].remove(w)
                del owned[w], data[w]
        else:
            h = rng.choice(list(hosts))
            hosts[h].append(f"{h}n{born}")
        copies = [Copy(w, h, owned[w]) for h, ws in hosts.items() for w in ws if w in owned]
        wants = []
        for h, ws in hosts.items():
            if ws:
                kept = {c.worker: c.ranges for c in copies if c.host == h}
                layout = host_layout(SEGMENTS, kept, tuple(ws))
                _tiles(layout)
                wants += [Copy(w, h, layout.ranges[i]) for i, w in enumerate(ws)]
        values = {c.worker: dict(zip(_elements(c.ranges), data[c.worker], strict=True))
                  for c in copies}  # fmt: skip
        got: dict[str, dict[int, int]] = {w.worker: {} for w in wants}
        for m in rebuild_transfers(copies, wants):
            for x in range(m.offset, m.offset + m.length):
                assert x not in got[m.dst]
                got[m.dst][x] = values[m.src][x]
        for w in wants:
            assert sorted(got[w.worker]) == _elements(w.ranges)
            owned[w.worker] = w.ranges
            data[w.worker] = [got[w.worker][x] for x in _elements(w.ranges)]
            assert data[w.worker] == [flat[x] for x in _elements(w.ranges)]


def _elements(ranges: tuple) -> list[int]:
    return [x for lo, n in ranges for x in range(lo, lo + n)]
