"""ZeRO shard layouts, replica placement and resharding plans — pure functions, no I/O.

A flat parameter buffer holds the model's layers one after another (``segments``: offset and
length of each). A :class:`ShardLayout` says which flat ranges each data-parallel rank owns. The
first layout is :meth:`ShardLayout.even`: every segment cut into ``world`` contiguous chunks, rank
``r`` owning chunk ``r`` of *every* segment (shards per layer and interleaved, ~1/world of each
layer per rank). Later layouts are explicit ranges per rank.

Replicas are spread: :func:`place_replicas` cuts every range of rank ``r`` into one piece per peer
(peers on other hosts when there are several), so each peer holds ~1/(world-1) of ``r``'s shard.
:func:`next_layout` makes the piece a peer holds exactly the piece it inherits when ``r`` leaves:
survivors keep their own ranges, and the lost ranges go to the holders of their replica pieces.
Restoring a lost shard then moves nothing over the network (each survivor promotes a verified
piece it already holds) and the recovery load is the same on every survivor. Only growth moves
data: each joiner carves an even share out of every rank's ranges, a set of disjoint
``(src, dst, offset, length)`` transfers from :func:`plan_transfers`, never an all-to-all.

A rank's shard buffer holds its ranges one after another in flat order (:func:`position`,
:func:`overlaps` translate). ZeRO-3 works a layer at a time: :func:`layer_cuts` says, for every
layer, where each rank's part of it lies in that rank's buffer, which is what a layer's
all-gather and its gradient's reduce-scatter exchange.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

Range = tuple[int, int]  # (flat offset, length)
# A rank may own this many ranges per layer and per rank of the world before the layout is made
# even again (one change can cut a lost range into a piece per survivor, and a kept range into a
# piece per joiner).
MAX_PIECES_PER_LAYER = 4


@dataclass(frozen=True)
class ShardLayout:
    segments: tuple[Range, ...]  # (offset, length) per layer in the flat buffer
    ranges: tuple[tuple[Range, ...], ...]  # per rank: the flat ranges it owns, by offset

    def __post_init__(self) -> None:
        if not self.ranges:
            raise ValueError("a layout needs at least one rank")
        spans = sorted(r for rank in self.ranges for r in rank if r[1] > 0)
        cursor = 0
        for lo, n in spans:
            if lo != cursor:
                raise ValueError(f"ranges do not tile the buffer exactly at offset {cursor}")
            cursor = lo + n
        if cursor != self.numel:
            raise ValueError(f"ranges cover {cursor} of {self.numel} elements")

    @classmethod
    def even(cls, segments: Sequence[Range], world: int) -> ShardLayout:
        """Chunk ``r`` of every segment to rank ``r``."""
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        ranges = []
        for r in range(world):
            mine = []
            for offset, length in segments:
                lo = offset + length * r // world
                hi = offset + length * (r + 1) // world
                if hi > lo:
                    mine.append((lo, hi - lo))
            ranges.append(tuple(mine))
        return cls(tuple(segments), tuple(ranges))

    @classmethod
    def of(cls, segments: Sequence[Range], ranges: Sequence[Sequence[Range]]) -> ShardLayout:
        """A layout from unordered ranges: sorted, and neighbours in one layer merged."""
        starts = {offset for offset, _ in segments}
        out = []
        for rank in ranges:
            merged: list[Range] = []
            for lo, n in sorted(r for r in rank if r[1] > 0):
                if merged and sum(merged[-1]) == lo and lo not in starts:
                    merged[-1] = (merged[-1][0], merged[-1][1] + n)
                else:
                    merged.append((lo, n))
            out.append(tuple(merged))
        return cls(tuple(segments), tuple(out))

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def numel(self) -> int:
        return sum(length for _, length in self.segments)

    def pieces(self, rank: int) -> list[Range]:
        """``(flat_offset, length)`` of the ranges ``rank`` owns, in flat order."""
        return list(self.ranges[rank])

    def shard_size(self, rank: int) -> int:
        return sum(length for _, length in self.ranges[rank])

    @property
    def padded_size(self) -> int:
        """Every rank's shard padded to this size (collectives want equal parts)."""
        return max(self.shard_size(r) for r in range(self.world))

    def gather_index(self) -> torch.Tensor:
        """Index into a flat buffer extended by one zero slot (index ``numel``) that lays the
        buffer out rank-major and padded: part ``r`` of ``buf[index].view(world, S)`` is rank
        ``r``'s shard. Scattering back with the same index restores the flat order."""
        size = self.padded_size
        index = torch.full((self.world, size), self.numel, dtype=torch.long)
        for r in range(self.world):
            cursor = 0
            for lo, length in self.ranges[r]:
                index[r, cursor : cursor + length] = torch.arange(lo, lo + length)
                cursor += length
        return index.reshape(-1)

    def to_json(self) -> list[list[list[int]]]:
        return [[[lo, n] for lo, n in rank] for rank in self.ranges]

    @classmethod
    def from_json(cls, segments: Sequence[Range], data: list[list[list[int]]]) -> ShardLayout:
        return cls(tuple(segments), tuple(tuple((lo, n) for lo, n in rank) for rank in data))


@dataclass(frozen=True)
class ReplicaPiece:
    owner: int  # rank whose shard this piece is part of
    holder: int  # rank that keeps the replica (and inherits the range if the owner leaves)
    offset: int  # flat offset
    length: int


def replica_holders(hosts: Sequence[str], world: int) -> list[list[int]]:
    """Per rank, the peers that may hold its replica pieces: every other rank, restricted to
    other hosts when the ranks span several hosts (``hosts`` empty: one host)."""
    if len(hosts) != world or len(set(hosts)) < 2:
        return [[s for s in range(world) if s != r] for r in range(world)]
    return [[s for s in range(world) if hosts[s] != hosts[r]] for r in range(world)]


def place_replicas(layout: ShardLayout, hosts: Sequence[str] = ()) -> tuple[ReplicaPiece, ...]:
    """Cut every range of every rank into one contiguous piece per holder, sizes differing by at
    most one; the larger pieces go to the holders that have the least of the owner so far, so
    every holder keeps the same share of the shard to within one element."""
    out = []
    for owner, holders in enumerate(replica_holders(hosts, layout.world)):
        k = len(holders)
        total = dict.fromkeys(holders, 0)
        for lo, n in layout.ranges[owner] if k else ():
            order = sorted(holders, key=lambda h: (total[h], h))
            cursor = lo
            for j, holder in enumerate(order):
                size = n // k + (1 if j < n % k else 0)
                if size:
                    out.append(ReplicaPiece(owner, holder, cursor, size))
                    total[holder] += size
                    cursor += size
    return tuple(out)


def held_by(placement: Sequence[ReplicaPiece], holder: int, owner: int) -> list[Range]:
    """The ranges of ``owner``'s shard that ``holder`` keeps, in flat order."""
    return sorted(
        (p.offset, p.length) for p in placement if p.holder == holder and p.owner == owner
    )


@dataclass(frozen=True)
class Holding:
    """A live copy of a flat range after a membership change."""

    worker: str
    offset: int
    length: int
    owner: int  # old rank whose shard the range belongs to
    replica: bool  # False: the owner's own copy; True: a replica piece on another worker


def holdings(
    old: ShardLayout,
    old_workers: Sequence[str],
    placement: Sequence[ReplicaPiece],
    *,
    alive: set[str],
) -> list[Holding]:
    """Where each element of the old layout lives now: with its owner if the owner is alive,
    else with the holder of its replica piece. Raises ``KeyError`` naming an old rank part of
    whose shard has no live copy (the owner and a holder of one of its pieces are both gone)."""
    out = []
    for r, worker in enumerate(old_workers):
        if worker in alive:
            out += [Holding(worker, lo, n, r, False) for lo, n in old.ranges[r]]
            continue
        pieces = [p for p in placement if p.owner == r]
        if sum(p.length for p in pieces) != old.shard_size(r):
            raise KeyError(f"the shard of old rank {r} ({worker}) has no replica")
        for p in pieces:
            if old_workers[p.holder] not in alive:
                raise KeyError(
                    f"the shard of old rank {r} ({worker}) and its replica are gone (old rank "
                    f"{p.holder}, {old_workers[p.holder]}, held a piece)"
                )
            out.append(Holding(old_workers[p.holder], p.offset, p.length, r, True))
    return out


def next_layout(
    old: ShardLayout,
    old_workers: Sequence[str],
    found: Sequence[Holding],
    *,
    new_workers: Sequence[str],
) -> ShardLayout:
    """The layout after a membership change: every live copy in ``found`` (see
    :func:`holdings`) stays where it is, so a lost shard is inherited by the holders of its
    replica pieces; then each joiner takes an even share of every rank's ranges (each range is
    cut so that its owner keeps ``stay/world`` of it and every joiner gets ``1/world``)."""
    index = {w: i for i, w in enumerate(new_workers)}
    ranges: list[list[Range]] = [[] for _ in new_workers]
    for h in found:
        if h.worker not in index:
            raise KeyError(f"{h.worker} holds a range but is not in the new layout")
        ranges[index[h.worker]].append((h.offset, h.length))
    stay = [i for i in range(len(new_workers)) if ranges[i]]
    joiners = [i for i in range(len(new_workers)) if not ranges[i]]
    if joiners and stay:
        carved: list[list[Range]] = [[] for _ in new_workers]
        for i in stay:
            for lo, hi, party in _carve(
                ranges[i], len(new_workers), i, joiners=joiners, stay=len(stay)
            ):
                carved[party].append((lo, hi - lo))
        ranges = carved
    layout = ShardLayout.of(old.segments, ranges)
    bound = MAX_PIECES_PER_LAYER * len(old.segments) * len(new_workers)
    if max(len(r) for r in layout.ranges) > bound:
        # Each change cuts ranges further (a lost shard into its replica pieces, every range
        # for joiners): left alone, the pieces multiply with every change and planning the
        # next reshard takes minutes. Past the bound, start again from the even layout: the
        # state moves over the network once, and the count is back to one piece per layer.
        return ShardLayout.even(old.segments, len(new_workers))
    return layout


def _carve(
    ranges: list[Range], world: int, keep: int, *, joiners: list[int], stay: int
) -> list[tuple[int, int, int]]:
    """Cut each of ``keep``'s ranges into ``world`` near-equal units: ``stay`` of them stay with
    it, one goes to each joiner. The larger units go to whoever is furthest behind its exact
    share so far, so every party's total stays within a few elements of that share."""
    got = dict.fromkeys([keep, *joiners], 0)
    weight = {keep: stay, **dict.fromkeys(joiners, 1)}
    out, seen = [], 0
    for lo, n in sorted(ranges):
        units = [(lo + n * c // world, lo + n * (c + 1) // world) for c in range(world)]
        need, seen = dict(weight), seen + n
        for a, b in sorted(units, key=lambda u: u[0] - u[1]):  # largest first
            behind = {q: seen * weight[q] - world * got[q] for q in need if need[q]}
            party = max(behind, key=lambda q: (behind[q], -q))
            need[party] -= 1
            got[party] += b - a
            if b > a:
                out.append((a, b, party))
    return out


@dataclass(frozen=True)
class Transfer:
    src: str  # worker that holds the data (owner, or the holder of a replica piece)
    dst: str  # worker that owns it in the new layout
    offset: int  # flat offset
    length: int


def plan_transfers(
    found: Sequence[Holding], new: ShardLayout, new_workers: Sequence[str]
) -> list[Transfer]:
    """Moves that give every new owner its ranges from the live copies in ``found``. Ranges
    already at their new owner are skipped; each element is sent at most once."""
    owner_at: list[tuple[int, int, str]] = []  # (lo, hi, new owner)
    for r, worker in enumerate(new_workers):
        for lo, length in new.ranges[r]:
            owner_at.append((lo, lo + length, worker))
    owner_at.sort()
    moves = []
    for h in found:
        lo, hi = h.offset, h.offset + h.length
        for a, b, dst in owner_at:
            if b <= lo or a >= hi:
                continue
            start, end = max(a, lo), min(b, hi)
            if dst != h.worker:
                moves.append(Transfer(h.worker, dst, start, end - start))
    return moves


def promoted(
    found: Sequence[Holding], new: ShardLayout, new_workers: Sequence[str]
) -> dict[str, int]:
    """Elements per worker that become its own from a replica piece it already holds."""
    out: dict[str, int] = defaultdict(int)
    for h in found:
        if not h.replica or h.worker not in new_workers:
            continue
        for lo, n in new.ranges[list(new_workers).index(h.worker)]:
            out[h.worker] += max(0, min(lo + n, h.offset + h.length) - max(lo, h.offset))
    return dict(out)


def recovery_stats(
    moves: Sequence[Transfer], local: Mapping[str, int], element_bytes: int
) -> dict[str, float]:
    """What a reshard costs: ``bytes`` sent over the network, ``promoted_bytes`` that became
    owned where they already were (replica pieces), pairs, and the balance figure the report
    shows: the largest per-rank recovery volume (sent + received + promoted) over the mean
    across ranks that take part (1.0 = perfectly balanced)."""
    volume: dict[str, int] = defaultdict(int)
    pairs = set()
    for m in moves:
        volume[m.src] += m.length * element_bytes
        volume[m.dst] += m.length * element_bytes
        pairs.add((m.src, m.dst))
    for worker, n in local.items():
        if n:
            volume[worker] += n * element_bytes
    mean = sum(volume.values()) / len(volume) if volume else 0.0
    return {
        "bytes": sum(m.length for m in moves) * element_bytes,
        "promoted_bytes": sum(local.values()) * element_bytes,
        "pairs": len(pairs),
        "max_over_mean": (max(volume.values()) / mean) if mean else 1.0,
    }


def position(pieces: Sequence[Range], flat_offset: int) -> int:
    """Index in a shard buffer (``pieces`` one after another) of ``flat_offset``, which lies
    inside one of ``pieces``."""
    cursor = 0
    for lo, n in pieces:
        if lo <= flat_offset < lo + n:
            return cursor + flat_offset - lo
        cursor += n
    raise ValueError(f"offset {flat_offset} is not in this shard")


def overlaps(pieces: Sequence[Range], lo: int, n: int) -> list[tuple[int, int, int]]:
    """Parts of ``[lo, lo + n)`` inside ``pieces``: (flat offset, length, shard position)."""
    out, cursor = [], 0
    for plo, pn in pieces:
        a, b = max(plo, lo), min(plo + pn, lo + n)
        if b > a:
            out.append((a, b - a, cursor + a - plo))
        cursor += pn
    return out


@dataclass(frozen=True)
class LayerCut:
    """How one layer (a segment of the flat buffer) is spread over a layout's ranks: rank ``r``
    owns ``sizes[r]`` of its elements, one run of its shard buffer from ``starts[r]`` on (its
    ranges inside the layer, in flat order), at the layer-local positions ``local[r]``
    (``(offset within the layer, length)`` runs)."""

    offset: int
    length: int
    starts: tuple[int, ...]
    sizes: tuple[int, ...]
    local: tuple[tuple[Range, ...], ...]

    @property
    def pad(self) -> int:
        """Every rank's part padded to this size (collectives want equal parts)."""
        return max(self.sizes, default=0)

    @property
    def rank_major(self) -> bool:
        """Rank ``r``'s part is the one run ``[r × pad, (r + 1) × pad)`` of the layer, every part
        of one size (an even layout of a layer the world divides): the layer in flat order is
        already the rank-major buffer the all-gather fills and the reduce-scatter reads, so
        neither needs a copy of it."""
        pad = self.pad
        return self.length == pad * len(self.local) and all(
            runs == ((r * pad, pad),) for r, runs in enumerate(self.local)
        )

    def positions(self, rank: int) -> torch.Tensor:
        """For each element of the layer (layer-local order), where it lies in ``rank``'s shard
        buffer; -1 where another rank owns it."""
        out = torch.full((self.length,), -1, dtype=torch.long)
        cursor = self.starts[rank]
        for lo, n in self.local[rank]:
            out[lo : lo + n] = torch.arange(cursor, cursor + n)
            cursor += n
        return out


def layer_cuts(layout: ShardLayout) -> tuple[LayerCut, ...]:
    """Every layer's :class:`LayerCut` under ``layout``. A range never crosses a layer boundary
    (layouts are cut per layer), so each rank's part of a layer is one run of its buffer."""
    out = []
    for offset, length in layout.segments:
        starts, sizes, local = [], [], []
        for r in range(layout.world):
            runs = []
            for lo, n in layout.ranges[r]:
                if offset <= lo < offset + length:
                    if lo + n > offset + length:
                        raise ValueError(f"range ({lo}, {n}) crosses the layer at {offset}")
                    runs.append((lo - offset, n))
            starts.append(sum(n for lo, n in layout.ranges[r] if lo < offset))
            sizes.append(sum(n for _, n in runs))
            local.append(tuple(runs))
        out.append(LayerCut(offset, length, tuple(starts), tuple(sizes), tuple(local)))
    return tuple(out)
