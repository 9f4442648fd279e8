"""ZeRO-3 sharded inside each host and replicated across hosts (``train.shard_scope: host``, the
hybrid sharding of FSDP's HSDP): pure functions, no I/O.

Every host holds the whole model, cut over its own ranks by a layout of its own
(:class:`~elaswave.planning.shards.ShardLayout` over the host's workers), so a layer's gathers
stay inside the host and only the gradient's reduction crosses hosts. The hosts' copies are the
same bits (the same reduced gradient, the same update), so they are each other's recovery
copies: nothing is snapshotted. After a membership change:

- :func:`host_layout`: a host's next layout. Its surviving ranks keep their ranges; the ranges of
  its lost ranks are cut evenly among them (per layer); joiners then carve an even share out of
  every rank's ranges (:func:`~elaswave.planning.shards.next_layout`). A host with no survivor
  (new, or back) starts from the even layout.
- :func:`rebuild_transfers`: where each rank reads its new ranges from. Its own old copy first,
  then a rank of its host, then the other hosts' ranks in plan order: a worker lost on one host
  comes back from the same elements on another; a host's joiners carve from their host. An
  element no surviving rank holds is lost (the caller falls back to the durable checkpoint).

    >>> host_layout(((0, 8),), {"a0": ((0, 4),)}, ("a0",)).ranges
    (((0, 8),),)
    >>> copies = [Copy("a0", "A", ((0, 4),)), Copy("b0", "B", ((0, 8),))]
    >>> moves = rebuild_transfers(copies, [Copy("a0", "A", ((0, 8),))])
    >>> [(t.src, t.offset, t.length) for t in moves]
    [('a0', 0, 4), ('b0', 4, 4)]
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from elaswave.planning.shards import Holding, Range, ShardLayout, Transfer, next_layout

__all__ = ["Copy", "host_layout", "host_ranks", "rebuild_transfers"]


@dataclass(frozen=True)
class Copy:
    """A rank's flat ranges (``ranges``, in flat order), on host ``host``: what it holds of the
    model (a copy) or what it must hold (a want)."""

    worker: str
    host: str
    ranges: tuple[Range, ...]


def host_ranks(hosts: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """The ranks of each host of a plan whose rank ``r`` runs on ``hosts[r]``, hosts in the order
    of their first rank.

    >>> host_ranks(["a", "b", "a"])
    ((0, 2), (1,))
    """
    out: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        out.setdefault(host, []).append(r)
    return tuple(tuple(v) for v in out.values())


def host_layout(
    segments: Sequence[Range], kept: Mapping[str, Sequence[Range]], new_workers: Sequence[str]
) -> ShardLayout:
    """A host's layout over ``new_workers``: those in ``kept`` (its ranks that hold a current
    copy, with the ranges they hold, disjoint) keep them; the rest of the model (the ranges of
    the host's lost ranks) is cut evenly among them, layer by layer; joiners then carve an even
    share out of everyone's. No survivor, or survivors whose ranges overlap (cut by two layouts:
    a fault in the middle of the last rebuild), the even layout."""
    survivors = [w for w in new_workers if w in kept]
    held = sorted(r for w in survivors for r in kept[w] if r[1] > 0)
    if not survivors or any(a[0] + a[1] > b[0] for a, b in zip(held, held[1:], strict=False)):
        return ShardLayout.even(segments, len(new_workers))
    found = [Holding(w, lo, n, 0, False) for w in survivors for lo, n in kept[w]]
    k = len(survivors)
    for lo, n in _gaps(held, segments):  # a lost rank's range: in near-equal pieces
        cursor = lo
        for j, heir in enumerate(survivors):
            size = n // k + (1 if j < n % k else 0)
            if size:
                found.append(Holding(heir, cursor, size, 0, True))
                cursor += size
    return next_layout(ShardLayout.even(segments, 1), (), found, new_workers=new_workers)


def _gaps(held: Sequence[Range], segments: Sequence[Range]) -> list[Range]:
    """The parts of the model no range of ``held`` (sorted, disjoint) covers, cut at the layers'
    boundaries."""
    out, i = [], 0
    for offset, length in segments:
        cursor, end = offset, offset + length
        while i < len(held) and held[i][0] < end:
            lo, n = held[i]
            if lo > cursor:
                out.append((cursor, lo - cursor))
            cursor = max(cursor, lo + n)
            i += 1
        if cursor < end:
            out.append((cursor, end - cursor))
    return out


def rebuild_transfers(copies: Sequence[Copy], wants: Sequence[Copy]) -> list[Transfer]:
    """The transfers that give every want its ranges from the ``copies`` (the ranks that hold a
    current copy of their old ranges, in plan order): from the rank itself where it holds them
    (``src == dst``: a local copy), else from a rank of its host, else from another host's, the
    first in plan order. Raises ``KeyError`` naming the first elements no copy holds."""
    index = []
    for c in copies:
        starts = [lo for lo, _ in c.ranges]
        index.append((c, starts))
    out = []
    for want in wants:
        order = sorted(
            range(len(index)),
            key=lambda i: (index[i][0].worker != want.worker, index[i][0].host != want.host, i),
        )
        for lo, n in want.ranges:
            cursor, end = lo, lo + n
            while cursor < end:
                found = _holder(index, order, cursor)
                if found is None:
                    raise KeyError(
                        f"elements {cursor}.. of {want.worker}'s new ranges have no live copy"
                    )
                src, stop = found
                stop = min(stop, end)
                out.append(Transfer(src, want.worker, cursor, stop - cursor))
                cursor = stop
    return out


def _holder(
    index: Sequence[tuple[Copy, list[int]]], order: Sequence[int], at: int
) -> tuple[str, int] | None:
    """The first copy (in ``order``) that holds element ``at``: its worker and where its range
    ends."""
    for i in order:
        copy, starts = index[i]
        k = bisect.bisect_right(starts, at) - 1
        if k >= 0:
            lo, n = copy.ranges[k]
            if at < lo + n:
                return copy.worker, lo + n
    return None
