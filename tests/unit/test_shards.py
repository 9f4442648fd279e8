"""Shard layouts, spread replicas and transfer plans: every element owned exactly once, replica
pieces cover each shard exactly once off its owner (and off its host), inheritance equals the
replica placement, transfers disjoint and complete."""

from __future__ import annotations

import pytest
import torch

from elaswave.planning.plan import Plan
from elaswave.planning.shards import (
    MAX_PIECES_PER_LAYER,
    ShardLayout,
    holdings,
    layer_cuts,
    next_layout,
    overlaps,
    place_replicas,
    plan_transfers,
    position,
    promoted,
    recovery_stats,
)

SEGMENTS = ((0, 10), (10, 7), (17, 1), (18, 33))
BIG = tuple((i * 1000, 1000 + 7 * i) for i in range(6))  # layers of a few thousand elements
BIG = tuple((sum(n for _, n in BIG[:i]), n) for i, (_, n) in enumerate(BIG))


def _elements(ranges) -> list[int]:  # noqa: ANN001
    return [i for lo, n in ranges for i in range(lo, lo + n)]


def _assert_tiles(layout: ShardLayout) -> None:
    owned = [i for r in range(layout.world) for i in _elements(layout.pieces(r))]
    assert sorted(owned) == list(range(layout.numel)), "every element owned exactly once"


def _workers(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_element_is_owned_exactly_once(world: int) -> None:
    layout = ShardLayout.even(SEGMENTS, world)
    _assert_tiles(layout)
    sizes = [layout.shard_size(r) for r in range(world)]
    assert max(sizes) - min(sizes) <= len(SEGMENTS), "shards are balanced per layer"


@pytest.mark.parametrize(
    ("ranges", "error"),
    [
        ((((0, 10), (10, 7)), ((17, 1), (18, 32))), "cover 50 of 51"),
        ((((0, 10), (10, 7)), ((16, 2), (18, 33))), "exactly at offset 17"),
        ((((0, 10), (10, 7)), ((17, 1), (18, 33)), ((40, 2),)), "exactly at offset 51"),
    ],
)
def test_a_layout_that_does_not_tile_the_buffer_is_rejected(ranges, error: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=error):
        ShardLayout(SEGMENTS, ranges)


@pytest.mark.parametrize("world", [1, 3, 4])
def test_gather_index_round_trips(world: int) -> None:
    layout = ShardLayout.even(SEGMENTS, world)
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


def _after_losses(world: int, deaths: list[int]) -> tuple[ShardLayout, list[str]]:
    """The layout after losing ``deaths`` one at a time (indices into the then-current ranks)."""
    workers = _workers(world)
    layout = ShardLayout.even(BIG, world)
    for d in deaths:
        new = [w for i, w in enumerate(workers) if i != d]
        found = holdings(layout, workers, place_replicas(layout), alive=set(new))
        layout, workers = next_layout(layout, workers, found, new_workers=new), new
    return layout, workers


HOSTS = [
    (),
    ("a", "a", "b", "b"),
    ("a", "b", "a", "b"),
    ("a", "a", "a", "b", "b", "b"),
    ("a", "a", "b"),
    ("h1", "h1", "h2", "h2", "h3", "h3", "h4", "h4"),
]


@pytest.mark.parametrize("hosts", HOSTS)
@pytest.mark.parametrize("deaths", [[], [1], [0, 2]])
def test_replica_pieces_cover_each_shard_once_off_its_owner_and_host(
    hosts: tuple[str, ...], deaths: list[int]
) -> None:
    world = len(hosts) or 5
    layout, _ = (
        _after_losses(world + len(deaths), deaths) if not hosts else _after_losses(world, [])
    )
    hosts = hosts[: layout.world]
    placement = place_replicas(layout, hosts)
    for owner in range(layout.world):
        mine = [p for p in placement if p.owner == owner]
        assert sorted(_elements((p.offset, p.length) for p in mine)) == sorted(
            _elements(layout.pieces(owner))
        ), "the pieces cover the shard exactly once"
        assert all(p.holder != owner for p in mine)
        if hosts and len(set(hosts)) > 1:
            assert all(hosts[p.holder] != hosts[owner] for p in mine), "replica off the host"
        per_holder: dict[int, int] = {}
        for p in mine:
            per_holder[p.holder] = per_holder.get(p.holder, 0) + p.length
        assert max(per_holder.values()) - min(per_holder.values()) <= 1, "even to one element"


def test_a_whole_rack_lost_leaves_every_piece_of_its_ranks_in_the_other_rack() -> None:
    """Racks A (hosts h0, h1) and B (h2): the plan's fault domains are the racks, so the copies
    of A's ranks all sit in B; both of A's hosts can go at once and B holds every piece of their
    shards. By host alone, A's copies would be half on its other host, lost with it."""
    hosts = ("h0", "h0", "h1", "h1", "h2", "h2")
    plan = Plan(epoch=1, workers=tuple(_workers(6)), hosts=hosts, microbatches=(1,) * 6, store="",
                racks=(("h0", "A"), ("h1", "A"), ("h2", "B")))  # fmt: skip
    layout = ShardLayout.even(BIG, 6)
    in_rack = {r for r, h in enumerate(hosts) if h != "h2"}
    for domains, survives in ((plan.domains, True), (plan.hosts, False)):
        placement = place_replicas(layout, domains)
        kept_in_b = {p.owner for p in placement if p.holder not in in_rack}
        whole = all(
            sum(p.length for p in placement if p.owner == r and p.holder not in in_rack)
            == layout.shard_size(r)
            for r in in_rack
        )
        assert whole is survives and in_rack <= kept_in_b


@pytest.mark.parametrize(
    ("world", "dead", "hosts"),
    [(2, 1, ()), (4, 1, ()), (4, 3, ()), (8, 5, ()), (4, 0, ("a", "a", "b", "b")),
     (6, 4, ("a", "a", "a", "b", "b", "b"))],
)  # fmt: skip
def test_a_lost_shard_is_inherited_by_its_replica_holders_without_transfers(
    world: int, dead: int, hosts: tuple[str, ...]
) -> None:
    workers = _workers(world)
    layout = ShardLayout.even(BIG, world)
    placement = place_replicas(layout, hosts)
    new = [w for i, w in enumerate(workers) if i != dead]
    found = holdings(layout, workers, placement, alive=set(new))
    after = next_layout(layout, workers, found, new_workers=new)
    _assert_tiles(after)
    for r, w in enumerate(new):
        old = workers.index(w)
        kept = set(_elements(layout.pieces(old)))
        inherited = {i for p in placement if p.owner == dead and p.holder == old
                     for i in range(p.offset, p.offset + p.length)}  # fmt: skip
        assert set(_elements(after.pieces(r))) == kept | inherited, "inheritance = placement"
    assert plan_transfers(found, after, new) == [], "a single loss moves nothing"
    local = promoted(found, after, new)
    assert sum(local.values()) == layout.shard_size(dead)
    stats = recovery_stats([], local, element_bytes=8)
    assert stats["bytes"] == 0 and stats["promoted_bytes"] == 8 * layout.shard_size(dead)
    if not hosts:  # every survivor promotes the same share, to within one element
        assert len(local) == world - 1 and max(local.values()) - min(local.values()) <= 1
        assert 1.0 <= stats["max_over_mean"] <= 1.0 + 1 / min(local.values())


def _apply(moves, found, new_workers):  # noqa: ANN001, ANN202
    """Simulate: start from what each live worker holds, apply moves, return what each holds."""
    have: dict[str, set[int]] = {w: set() for w in new_workers}
    for h in found:
        have[h.worker] |= set(range(h.offset, h.offset + h.length))
    for m in moves:
        span = set(range(m.offset, m.offset + m.length))
        assert span <= have[m.src], "a transfer sends data its source does not hold"
        have[m.dst] |= span
    return have


@pytest.mark.parametrize(
    ("old_world", "dead", "joiners"),
    [(4, [1], 1), (3, [], 1), (4, [], 2), (8, [5], 2), (2, [1], 1), (1, [], 3)],
)
def test_growth_transfers_cover_the_new_layout_disjointly_and_balance_it(
    old_world: int, dead: list[int], joiners: int
) -> None:
    old_workers = _workers(old_world)
    layout = ShardLayout.even(BIG, old_world)
    new_workers = [w for i, w in enumerate(old_workers) if i not in dead] + _workers(joiners, "n")
    found = holdings(layout, old_workers, place_replicas(layout), alive=set(new_workers))
    after = next_layout(layout, old_workers, found, new_workers=new_workers)
    _assert_tiles(after)
    sizes = [after.shard_size(r) for r in range(after.world)]
    assert max(sizes) - min(sizes) <= 2 * len(new_workers), sizes  # rounding only
    moves = plan_transfers(found, after, new_workers)
    have = _apply(moves, found, new_workers)
    for r, w in enumerate(new_workers):
        assert set(_elements(after.pieces(r))) <= have[w], f"{w} misses part of its new shard"
    received = [(m.dst, i) for m in moves for i in range(m.offset, m.offset + m.length)]
    assert len(received) == len(set(received)), "an element was sent twice to the same rank"
    assert all(m.dst.startswith("n") for m in moves), "only joiners receive"
    survivors = [w for w in new_workers if w.startswith("w")]
    for w in survivors:  # a survivor keeps (a part of) everything it held
        r = new_workers.index(w)
        assert set(_elements(after.pieces(r))) <= set(
            i for h in found if h.worker == w for i in range(h.offset, h.offset + h.length)
        )


@pytest.mark.parametrize("pair", [(1, 2), (0, 3), (1, 3)])
def test_losing_a_rank_and_a_holder_of_its_replica_is_reported(pair: tuple[int, int]) -> None:
    workers = _workers(4)
    layout = ShardLayout.even(SEGMENTS, 4)
    alive = {w for i, w in enumerate(workers) if i not in pair}
    with pytest.raises(KeyError, match="replica are gone"):
        holdings(layout, workers, place_replicas(layout), alive=alive)


def test_two_hosts_survive_losing_two_ranks_of_one_host() -> None:
    """With replicas on the other host only, both ranks of one host may die together."""
    workers, hosts = _workers(4), ("a", "a", "b", "b")
    layout = ShardLayout.even(BIG, 4)
    found = holdings(layout, workers, place_replicas(layout, hosts), alive={"w2", "w3"})
    after = next_layout(layout, workers, found, new_workers=["w2", "w3"])
    _assert_tiles(after)
    assert plan_transfers(found, after, ["w2", "w3"]) == []


def test_a_shard_without_replicas_is_reported() -> None:
    layout = ShardLayout.even(SEGMENTS, 1)
    with pytest.raises(KeyError, match="has no replica"):
        holdings(layout, ["w0"], place_replicas(layout), alive={"n0"})


def test_repeated_losses_stay_balanced() -> None:
    layout, _ = _after_losses(8, [3, 0, 4])
    _assert_tiles(layout)
    sizes = [layout.shard_size(r) for r in range(layout.world)]
    assert max(sizes) - min(sizes) <= 3, sizes


def test_layout_json_round_trips() -> None:
    layout, _ = _after_losses(5, [2])
    assert ShardLayout.from_json(BIG, layout.to_json()) == layout


def test_pieces_stay_bounded_over_many_changes() -> None:
    """Each change cuts ranges further (a lost shard into its replica pieces, every range for
    joiners): left alone, a rank's pieces tripled with every change (12 134 after ten changes
    of gpt-tiny on 3 hosts × 2, and planning a reshard took minutes). Past MAX_PIECES_PER_LAYER
    per layer and rank on average the next layout is even again; until then a lost rank still moves
    nothing over the network."""
    segments = ((0, 1000), (1000, 3000), (4000, 3000), (7000, 500))
    members = [(f"w{i}", f"h{i // 2}") for i in range(6)]
    layout = ShardLayout.even(segments, 6)
    fresh = 6
    bound = MAX_PIECES_PER_LAYER * len(segments) * 6
    for change in range(30):
        workers = tuple(w for w, _ in members)
        hosts = tuple(h for _, h in members)
        if change % 2 == 0:  # lose one worker, or every third time a whole host
            victim = f"h{change % 3}" if change % 6 == 0 else None
            index = change % len(members)
            new = [m for i, m in enumerate(members) if (m[1] != victim if victim else i != index)]
        else:  # grow back to two workers per host
            new = list(members)
            for host in ("h0", "h1", "h2"):
                while sum(h == host for _, h in new) < 2:
                    new.append((f"x{fresh}", host))
                    fresh += 1
        new_workers = tuple(w for w, _ in new)
        found = holdings(layout, workers, place_replicas(layout, hosts), alive=set(new_workers))
        nxt = next_layout(layout, workers, found, new_workers=new_workers)
        assert max(len(r) for r in nxt.ranges) <= bound, change
        if change % 2 == 0 and nxt != ShardLayout.even(segments, len(new_workers)):
            assert plan_transfers(found, nxt, new_workers) == [], "a shrink moves nothing"
        layout, members = nxt, new


# ---- where a layer lies in each rank's shard buffer (ZeRO-3) --------------------------------


@pytest.mark.parametrize(
    ("pieces", "offset", "expected"),
    [
        ([(0, 4), (10, 3)], 0, 0),
        ([(0, 4), (10, 3)], 3, 3),
        ([(0, 4), (10, 3)], 10, 4),
        ([(0, 4), (10, 3)], 12, 6),
        ([(5, 2)], 6, 1),
    ],
)
def test_position_in_a_shard_buffer(pieces, offset: int, expected: int) -> None:  # noqa: ANN001
    assert position(pieces, offset) == expected


def test_an_offset_outside_the_shard_has_no_position() -> None:
    with pytest.raises(ValueError, match="not in this shard"):
        position([(0, 4), (10, 3)], 5)


@pytest.mark.parametrize(
    ("pieces", "lo", "n", "expected"),
    [
        ([(0, 4), (10, 3)], 2, 10, [(2, 2, 2), (10, 2, 4)]),  # across the gap
        ([(0, 4), (10, 3)], 4, 6, []),  # only the gap
        ([(0, 4), (10, 3)], 0, 20, [(0, 4, 0), (10, 3, 4)]),
        ([(5, 5)], 7, 1, [(7, 1, 2)]),
    ],
)
def test_overlaps_with_a_shard(pieces, lo: int, n: int, expected) -> None:  # noqa: ANN001
    assert overlaps(pieces, lo, n) == expected


@pytest.mark.parametrize(
    ("ranges", "layer", "starts", "sizes", "local"),
    [
        # even, 2 ranks: each its half of every layer, one run
        (None, 0, (0, 0), (5, 5), (((0, 5),), ((5, 5),))),
        (None, 1, (5, 5), (3, 4), (((0, 3),), ((3, 4),))),
        (None, 2, (8, 9), (0, 1), ((), ((0, 1),))),  # one element: rank 0 has none of it
        # after a loss: rank 0 also holds a promoted piece of layer 3: two runs of the layer,
        # one run of its buffer (from 8: [0,5) and [10,13) come first)
        (
            (((0, 5), (10, 3), (18, 16), (45, 6)), ((5, 5), (13, 4), (17, 1), (34, 11))),
            3,
            (8, 10),
            (22, 11),
            (((0, 16), (27, 6)), ((16, 11),)),
        ),
    ],
)
def test_layer_cuts(ranges, layer: int, starts, sizes, local) -> None:  # noqa: ANN001
    """Where each rank's part of a layer lies in its buffer and inside the layer."""
    layout = ShardLayout.even(SEGMENTS, 2) if ranges is None else ShardLayout(SEGMENTS, ranges)
    cut = layer_cuts(layout)[layer]
    assert (cut.offset, cut.length) == SEGMENTS[layer]
    assert (cut.starts, cut.sizes, cut.local) == (starts, sizes, local)
    assert cut.pad == max(sizes)


@pytest.mark.parametrize(
    ("segments", "world", "deaths", "expected"),
    [
        (((0, 8), (8, 12)), 4, [], [True, True]),  # the world divides every layer
        (((0, 8), (8, 10)), 4, [], [True, False]),  # 10 = 3 + 3 + 2 + 2: padded, copied
        (((0, 8),), 1, [], [True]),
        (((0, 12),), 4, [1], [False]),  # the lost rank's part went to its holders in pieces
    ],
)
def test_a_rank_major_cut_needs_no_copy(
    segments: tuple, world: int, deaths: list[int], expected: list[bool]
) -> None:
    """Where every rank's part of a layer is one equal run in rank order, the layer is its own
    rank-major buffer: unpacking an all-gather returns it without a copy. Packing and
    unpacking stay inverses either way."""
    from elaswave.runtime.strategies.zero.holding import pack_layer, unpack_layer

    layout = ShardLayout.even(segments, world + len(deaths))
    workers = _workers(layout.world)
    for dead in deaths:
        gone = workers[dead]
        survivors = [w for w in workers if w != gone]
        layout = next_layout(
            layout, workers,
            holdings(layout, workers, place_replicas(layout), alive=set(survivors)),
            new_workers=survivors,
        )  # fmt: skip
        workers = survivors
    cuts = layer_cuts(layout)
    assert [cut.rank_major for cut in cuts] == expected
    for cut in cuts:
        layer = torch.arange(cut.length, dtype=torch.float32)
        packed = pack_layer(layer, cut, torch.empty(layout.world * cut.pad))
        back = unpack_layer(packed, cut)
        assert torch.equal(back, layer)
        shares = back.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
        assert shares is cut.rank_major


@pytest.mark.parametrize("deaths", [[], [1], [1, 2], [0, 3, 1]])
def test_layer_cuts_reassemble_every_layer(deaths: list[int]) -> None:
    """Every layer put together from every rank's part of it (read where the cut says, in each
    rank's buffer) is the layer, after any losses."""
    layout, workers = _after_losses(6, deaths)
    flat = torch.arange(layout.numel, dtype=torch.float32)
    buffers = [torch.cat([flat[lo : lo + n] for lo, n in layout.pieces(r)])
               for r in range(layout.world)]  # fmt: skip
    for cut in layer_cuts(layout):
        layer = torch.full((cut.length,), -1.0)
        for r, runs in enumerate(cut.local):
            part = buffers[r][cut.starts[r] : cut.starts[r] + cut.sizes[r]]
            cursor = 0
            for lo, n in runs:
                layer[lo : lo + n] = part[cursor : cursor + n]
                cursor += n
        assert torch.equal(layer, flat[cut.offset : cut.offset + cut.length])
        # and each element found where ``positions`` says, in exactly one rank's buffer
        owners = torch.zeros(cut.length, dtype=torch.long)
        for r in range(layout.world):
            at = cut.positions(r)
            mine = at >= 0
            owners += mine
            expected = flat[cut.offset : cut.offset + cut.length][mine]
            assert torch.equal(buffers[r][at[mine]], expected)
        assert torch.equal(owners, torch.ones_like(owners))
