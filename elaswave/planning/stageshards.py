"""ZeRO-1 inside pipeline stages: who keeps which Adam moments, and who sends which parameters.

Pure functions over element intervals of the flat parameter buffer (layers one after another);
no tensors, no I/O. An interval is a half-open ``(start, stop)`` element range.

Blocks. The ranks that hold a layer (its data-parallel peers: the replicas whose stage contains
it) all receive its summed gradient (summed among exactly them). A :class:`Block` is a maximal
run of elements whose holder set is the same; after a takeover one replica's stage may span what two
stages of another replica hold, so one stage can lie across several blocks.

Moments. Each block is cut into ``k = len(holders)`` near-equal parts; part ``i`` is kept by
holders ``i`` and ``i + 1`` (cyclically; on several hosts the next holder on another host) —
two copies (:func:`moment_duty`). Two, because the
gradient reaches every holder anyway: both keepers of a part update it from the same gradient and
stay identical with no snapshot traffic, and a single loss still leaves a copy of every part, so
the new layout restores moments by a plain transfer (:func:`plan_piece_transfers`). A rank's
moments then take ~2/k of its stage instead of all of it. With ``k = 2`` both holders keep
everything (plain replication) and with ``k = 1`` the only holder keeps its block.

Parameters. A rank updates the parameters of the elements it keeps moments for; the rest of its
layers arrive after each update from the part's primary (holder ``i`` of part ``i``) by the
:func:`gather_plan`. With ``k <= 2`` every holder keeps every part, so nothing is gathered.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

Interval = tuple[int, int]  # (start, stop) elements of the flat buffer, half-open


class LayersLost(RuntimeError):
    """Every rank that held some layers (or elements of them) is gone."""


@dataclass(frozen=True)
class Block:
    start: int  # elements start:stop, a maximal run of consecutive layers
    stop: int  # whose holder sets are identical (and non-empty)
    holders: tuple[int, ...]  # sorted ranks holding every layer of the run
    hosts: tuple[str, ...] = ()  # the host of each holder (empty: unknown, one host)


@dataclass(frozen=True)
class Piece:
    src: int
    dst: int
    start: int  # elements start:stop
    stop: int

    def to_dict(self) -> dict[str, int]:
        return {"src": self.src, "dst": self.dst, "start": self.start, "stop": self.stop}


# ---- intervals ---------------------------------------------------------------------------------
def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, with overlapping and adjacent intervals joined and empty ones dropped."""
    out: list[Interval] = []
    for a, b in sorted(i for i in intervals if i[1] > i[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def subtract(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The elements of ``a`` that are not in ``b``, merged."""
    cut, j = merge(b), 0
    out: list[Interval] = []
    for lo, hi in merge(a):
        while j < len(cut) and cut[j][1] <= lo:  # both sorted: skip what ends before lo for good
            j += 1
        for c, d in cut[j:]:
            if c >= hi:
                break
            if c > lo:
                out.append((lo, c))
            lo = max(lo, d)
        if lo < hi:
            out.append((lo, hi))
    return out


def _covers(intervals: Sequence[Interval], a: int, b: int) -> bool:
    """Whether merged ``intervals`` contain all of ``a:b``."""
    j = bisect.bisect_right(intervals, (a, float("inf"))) - 1
    return j >= 0 and intervals[j][1] >= b


def split_even(start: int, stop: int, parts: int) -> list[Interval]:
    """``parts`` contiguous pieces of ``start:stop``, sizes differing by at most one (the earlier
    ones larger); some pieces are empty when ``parts`` exceeds the size."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    n = stop - start
    out, cursor = [], start
    for i in range(parts):
        size = n // parts + (1 if i < n % parts else 0)
        out.append((cursor, cursor + size))
        cursor += size
    return out


# ---- duties within stages ----------------------------------------------------------------------
def holder_blocks(
    layers_of: Sequence[range | None],
    offsets: Sequence[tuple[int, int]],
    hosts: Sequence[str] = (),
) -> list[Block]:
    """The blocks of a layout: ``layers_of[r]`` is the layers rank ``r`` holds (``None``:
    nothing), ``offsets[L]`` the elements of layer ``L``, ``hosts[r]`` rank ``r``'s host (for
    keepers on different hosts; empty: one host). Layers nobody holds get no block; empty
    layers are skipped; blocks come in layer order."""
    out: list[Block] = []
    for layer, (start, stop) in enumerate(offsets):
        holders = tuple(r for r, held in enumerate(layers_of) if held is not None and layer in held)
        if not holders or stop <= start:
            continue
        on = tuple(hosts[r] for r in holders) if len(hosts) == len(layers_of) else ()
        if out and out[-1].holders == holders and out[-1].stop == start:
            out[-1] = Block(out[-1].start, stop, holders, on)
        else:
            out.append(Block(start, stop, holders, on))
    return out


def _keepers(block: Block, copies: int) -> list[tuple[Interval, tuple[int, ...]]]:
    """Each part of ``block`` with the holders that keep its moments (its primary first).

    Part ``i``'s primary is holder ``i``; the other keepers are the next holders in cyclic
    order, skipping holders on a host that already keeps the part while another host could: a
    host loss must never take every copy of a part."""
    h, k = block.holders, len(block.holders)
    want = min(copies, k)
    out = []
    for i, part in enumerate(split_even(block.start, block.stop, k)):
        order = [(i + j) % k for j in range(k)]
        chosen = [order[0]]
        for j in order[1:]:  # first holders on hosts that keep no copy yet
            if len(chosen) < want and (
                not block.hosts or block.hosts[j] not in {block.hosts[c] for c in chosen}
            ):
                chosen.append(j)
        for j in order[1:]:  # then, with too few hosts, any holder
            if len(chosen) < want and j not in chosen:
                chosen.append(j)
        out.append((part, tuple(h[j] for j in chosen)))
    return out


def part_keepers(
    blocks: Sequence[Block], copies: int = 2
) -> list[tuple[Interval, tuple[int, ...]]]:
    """Every part of every block with its keepers (primary first), in element order."""
    return [pk for block in blocks for pk in _keepers(block, copies)]


def coverage(have: Sequence[Sequence[Interval]]) -> list[tuple[Interval, tuple[int, ...]]]:
    """The elements some rank has, cut wherever any rank's intervals start or stop, each piece
    with the ranks that have it: the parts and keepers of a layout nobody planned (the old
    duties that ranks keep, renumbered, while an asynchronous migration runs)."""
    merged = [merge(h) for h in have]
    marks = sorted({x for h in merged for i in h for x in i})
    out = []
    for a, b in zip(marks, marks[1:], strict=False):
        keepers = tuple(r for r, h in enumerate(merged) if _covers(h, a, b))
        if keepers:
            out.append(((a, b), keepers))
    return out


def moment_duty(blocks: Sequence[Block], world: int, copies: int = 2) -> list[list[Interval]]:
    """Per rank ``0..world-1``, the merged intervals whose Adam moments it keeps and updates:
    part ``i`` of a block with holders ``H`` goes to ``H[i], H[i+1], ...`` (``copies`` of them,
    cyclically, at most ``len(H)``). Ranks that hold nothing keep nothing."""
    kept: list[list[Interval]] = [[] for _ in range(world)]
    for block in blocks:
        for part, keepers in _keepers(block, copies):
            for r in keepers:
                kept[r].append(part)
    return [merge(k) for k in kept]


def gather_plan(blocks: Sequence[Block], copies: int = 2) -> list[Piece]:
    """The parameter sends after each optimizer update: part ``i`` of a block goes from its
    primary ``H[i]`` to every holder that does not keep it. Empty parts send nothing; adjacent
    pieces with the same source and destination are joined. Ordered by (start, dst)."""
    runs: dict[tuple[int, int], list[Interval]] = {}
    for block in blocks:
        for part, keepers in _keepers(block, copies):
            if part[1] <= part[0]:
                continue
            for dst in block.holders:
                if dst not in keepers:
                    runs.setdefault((keepers[0], dst), []).append(part)
    out = [Piece(s, d, a, b) for (s, d), parts in runs.items() for a, b in merge(parts)]
    return sorted(out, key=lambda p: (p.start, p.dst))


# ---- moves after a layout change ---------------------------------------------------------------
def plan_piece_transfers(
    have: Sequence[Sequence[Interval]], want: Sequence[Sequence[Interval]]
) -> list[Piece]:
    """Who sends which elements to whom so that rank ``d`` ends up with ``want[d]``.

    Elements a rank already has (``have[d]``) need nothing. Every other element comes from
    exactly one rank that has it: the one that has sent the fewest elements so far (ties: lowest
    rank), choosing per run between boundaries of the sources' intervals. Adjacent pieces with the
    same source and destination are joined. Raises :class:`LayersLost` for elements nobody has.
    """
    if len(have) != len(want):
        raise ValueError(f"have names {len(have)} ranks, want {len(want)}")
    have = [merge(h) for h in have]
    needs = [subtract(w, h) for w, h in zip(want, have, strict=True)]
    anywhere = merge(i for h in have for i in h)
    lost = subtract([i for n in needs for i in n], anywhere)
    if lost:
        a, b = lost[0]
        raise LayersLost(f"elements {a}:{b} are held by no surviving rank")
    cuts = sorted({x for h in have for i in h for x in i})
    load = [0] * len(have)
    pieces: list[Piece] = []
    for dst, need in enumerate(needs):
        for lo, hi in need:
            marks = [lo, *cuts[bisect.bisect_right(cuts, lo) : bisect.bisect_left(cuts, hi)], hi]
            for a, b in zip(marks, marks[1:], strict=False):
                src = min(
                    (r for r, h in enumerate(have) if _covers(h, a, b)),
                    key=lambda r: (load[r], r),
                )
                load[src] += b - a
                last = pieces[-1] if pieces else None
                if last and (last.src, last.dst, last.stop) == (src, dst, a):
                    pieces[-1] = Piece(src, dst, last.start, b)
                else:
                    pieces.append(Piece(src, dst, a, b))
    return pieces


def piece_stats(pieces: Sequence[Piece]) -> dict[str, Any]:
    """Totals for the report: elements, transfers, rank pairs, and the busiest rank's volume
    (sent + received) over the mean of the ranks that take part (1.0: perfectly balanced)."""
    volume: dict[int, int] = {}
    for p in pieces:
        n = p.stop - p.start
        volume[p.src] = volume.get(p.src, 0) + n
        volume[p.dst] = volume.get(p.dst, 0) + n
    mean = sum(volume.values()) / len(volume) if volume else 0.0
    return {
        "elements": sum(p.stop - p.start for p in pieces),
        "transfers": len(pieces),
        "pairs": len({(p.src, p.dst) for p in pieces}),
        "max_over_mean": round(max(volume.values()) / mean, 3) if mean else 1.0,
    }
