"""What a ZeRO rank keeps of a shard: one step's optimizer moments (and parameter chunk) over
the flat ranges it owns, or over the replica pieces it keeps of a peer's shard, with the checksum
taken when it was made; and what a step stages before its commit barrier."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elaswave.errors import ShardLost
from elaswave.planning.shards import Range
from elaswave.runtime.integrity.checksums import fast_checksum

__all__ = ["Shard", "ShardLost", "Staged"]


@dataclass
class Shard:
    """Adam moments of one rank's shard (or of the replica pieces kept of one peer's shard) at
    one step, with the checksum taken when made (``None``: live state between snapshots), and
    the owned parameter chunk where the shard carries it (ZeRO-3 always; ZeRO-1 when snapshots
    are ``K > 1`` steps apart)."""

    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    checksum: int | None
    params: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        step: int,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        params: torch.Tensor | None = None,
    ) -> Shard:
        shard = cls(step, exp_avg, exp_avg_sq, None, params)
        shard.checksum = fast_checksum(*shard.tensors())
        return shard

    def tensors(self) -> list[torch.Tensor]:
        extra = [self.params] if self.params is not None else []
        return [self.exp_avg, self.exp_avg_sq, *extra]

    def verify(self) -> bool:
        return self.checksum is None or fast_checksum(*self.tensors()) == self.checksum

    def cut(self, spans: Sequence[Range]) -> list[torch.Tensor]:
        """Each tensor restricted to buffer positions ``spans`` (concatenated)."""
        return [torch.cat([t[p : p + n] for p, n in spans]) for t in self.tensors()]


@dataclass
class Staged:
    step: int
    params: torch.Tensor  # ZeRO-1: every rank's updated parameter chunks, rank-major (gathered)
    own: Shard
    replicas: dict[int, Shard] | None  # None: not a snapshot step
    reached_barrier: bool = False
