"""ZeRO shard layout and resharding transfer plans — pure functions, no I/O.

A flat parameter buffer holds the model's layers one after another (``segments``: offset and
length of each). With ``world`` data-parallel ranks every segment is cut into ``world`` contiguous
chunks and rank ``r`` owns chunk ``r`` of *every* segment: shards are per layer and interleaved,
so each rank owns ~1/world of each layer.

When membership changes, every element of the optimizer state moves from the rank that holds it
(its old owner, or that owner's buddy replica if the owner died) to its new owner. Because chunks
are contiguous per segment, this is a set of disjoint ``(src, dst, offset, length)`` ranges: no
element is sent twice, no rank receives data it does not own afterwards, and no all-to-all.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardLayout:
    segments: tuple[tuple[int, int], ...]  # (offset, length) per layer in the flat buffer
    world: int

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ValueError(f"world must be >= 1, got {self.world}")

    @property
    def numel(self) -> int:
        return sum(length for _, length in self.segments)

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        """``(flat_offset, length)`` of the chunks ``rank`` owns, in segment order."""
        out = []
        for offset, length in self.segments:
            lo = offset + length * rank // self.world
            hi = offset + length * (rank + 1) // self.world
            if hi > lo:
                out.append((lo, hi - lo))
        return out

    def shard_size(self, rank: int) -> int:
        return sum(length for _, length in self.pieces(rank))

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
            for lo, length in self.pieces(r):
                index[r, cursor : cursor + length] = torch.arange(lo, lo + length)
                cursor += length
        return index.reshape(-1)


@dataclass(frozen=True)
class Transfer:
    src: str  # worker that holds the data (owner, or the dead owner's buddy)
    dst: str  # worker that owns it in the new layout
    offset: int  # flat offset
    length: int


def plan_transfers(
    old: ShardLayout,
    holders: Mapping[int, str],
    new: ShardLayout,
    new_workers: Sequence[str],
) -> list[Transfer]:
    """Moves that turn the old layout into the new one. ``holders[r]`` is the live worker that
    holds old rank ``r``'s shard (itself, or its buddy). Ranges already at their new owner are
    skipped. Raises ``KeyError`` naming an old rank whose shard nobody holds."""
    owner_at: list[tuple[int, int, str]] = []  # (lo, hi, new owner)
    for r, worker in enumerate(new_workers):
        for lo, length in new.pieces(r):
            owner_at.append((lo, lo + length, worker))
    owner_at.sort()
    moves = []
    for r in range(old.world):
        pieces = old.pieces(r)
        if not pieces:
            continue
        if r not in holders:
            raise KeyError(f"no live copy of the shard of old rank {r}")
        src = holders[r]
        for lo, length in pieces:
            hi = lo + length
            for a, b, dst in owner_at:
                if b <= lo or a >= hi:
                    continue
                start, end = max(a, lo), min(b, hi)
                if dst != src:
                    moves.append(Transfer(src, dst, start, end - start))
    return moves


def buddy(rank: int, world: int, shift: int = 1) -> int:
    """The rank that keeps a replica of ``rank``'s shard: ``shift`` ranks on, cyclically."""
    return (rank + shift) % world


def buddy_shift(hosts: Sequence[str]) -> int:
    """The smallest cyclic shift that puts every rank's buddy on another host, if one exists
    (else 1). A shift keeps "who holds whose replica" a permutation: one replica per rank."""
    world = len(hosts)
    for shift in range(1, world):
        if all(hosts[r] != hosts[(r + shift) % world] for r in range(world)):
            return shift
    return 1


def transfer_stats(moves: Sequence[Transfer], element_bytes: int) -> dict[str, float]:
    """Bytes, pairs, and the balance figure the report shows: the largest per-rank volume (sent +
    received) over the mean across ranks that take part (1.0 = perfectly balanced)."""
    volume: dict[str, int] = defaultdict(int)
    pairs = set()
    for m in moves:
        volume[m.src] += m.length * element_bytes
        volume[m.dst] += m.length * element_bytes
        pairs.add((m.src, m.dst))
    total = sum(m.length for m in moves) * element_bytes
    mean = sum(volume.values()) / len(volume) if volume else 0.0
    return {
        "bytes": total,
        "pairs": len(pairs),
        "max_over_mean": (max(volume.values()) / mean) if mean else 1.0,
    }
