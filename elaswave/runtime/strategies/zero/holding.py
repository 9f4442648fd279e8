"""Where a ZeRO rank's parameters live: the piece a shard state (:class:`~.state.ShardState`)
asks whenever the answer depends on it.

- :class:`WholeParams` (ZeRO-1): every rank holds the parameters whole; a shard carries its
  parameter chunk only when snapshots are ``K > 1`` steps apart (a rollback then needs the
  parameters of the snapshot step). The shard's elements are picked from the whole buffers by one
  rank-major gather index, and the commit writes every rank's updated chunk back into them.
- :class:`ShardedParams` (ZeRO-3): no rank holds the parameters whole. Rank ``r`` owns its ranges
  of every layer (the same interleaved, world-size-independent layout as ZeRO-1,
  :mod:`elaswave.planning.shards`): the parameters there, their optimizer moments and, during a
  step, their gradient sums. Everything the shard state does with a shard (snapshots, replica
  pieces, promotion, transfers, repair) then holds for the parameters too. A layer is gathered
  whole only while it runs (:mod:`~elaswave.runtime.strategies.zero.gather`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from elaswave.planning.shards import LayerCut, ShardLayout, layer_cuts
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.durable.checkpoints import Piece
from elaswave.runtime.strategies.zero.shard import Shard, Staged

if TYPE_CHECKING:
    from elaswave.runtime.strategies.zero.state import ShardState

__all__ = [
    "Initial", "LayerShards", "ParamHolding", "ShardedParams", "WholeParams", "pack_layer",
    "padded", "unpack_layer",
]  # fmt: skip

Initial = Callable[[int], torch.Tensor]  # layer index -> its initial trainable parameters, flat


class ParamHolding(ABC):
    """What a shard state asks of where its parameters live (``z``: that state)."""

    @abstractmethod
    def keeps_params(self, z: ShardState) -> bool:
        """Whether a shard (and its snapshot and replicas) carries its parameter chunk."""

    @abstractmethod
    def index_of(self, z: ShardState, layout: ShardLayout) -> torch.Tensor:
        """Taken once per layout: the whole-buffer gather index where one is used."""

    @abstractmethod
    def mine(self, z: ShardState, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard (padded, on the state's device) of a tensor laid out like the whole
        flat buffer."""

    @abstractmethod
    def fresh_params(self, z: ShardState) -> torch.Tensor | None:
        """The parameter chunk a fresh shard starts from, where the shard carries one."""

    @abstractmethod
    def apply(self, z: ShardState, staged: Staged) -> None:
        """At the commit: the parameters take the staged update."""

    @abstractmethod
    def rebuilt(
        self, z: ShardState, comm: Communicator, own: Shard, abort: Callable[[], bool]
    ) -> None:
        """After a reshard to ``own``: the parameters of the resume step, where they must be
        rebuilt from the shards."""

    @abstractmethod
    def gather(
        self, z: ShardState, comm: Communicator, part: torch.Tensor, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """A shard-laid-out tensor of every rank, whole in flat order."""

    @abstractmethod
    def take_whole(self, z: ShardState, params: torch.Tensor) -> None:
        """A whole state taken in (a durable checkpoint): the parameters, where they are kept
        whole (the shard's chunk is cut by :meth:`ShardState.restore_full`)."""

    @abstractmethod
    def unchanged(self, z: ShardState) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """A step that changes nothing, as its update would stage it: the staged parameters
        (what :meth:`apply` takes), a copy of this rank's chunk, and whether the live shard
        carries that chunk between snapshots."""


class WholeParams(ParamHolding):
    """ZeRO-1: the parameters are replicated; the shards hold the optimizer moments."""

    def keeps_params(self, z: ShardState) -> bool:
        """Snapshots K > 1 steps apart roll parameters back too: they keep the owned chunk."""
        return z.snapshot_every > 1

    def index_of(self, z: ShardState, layout: ShardLayout) -> torch.Tensor:
        """The rank-major gather index of the whole buffer (see ``ShardLayout.gather_index``)."""
        return layout.gather_index().to(z.flat.data.device)

    def mine(self, z: ShardState, whole: torch.Tensor) -> torch.Tensor:
        my_index = z.index.view(len(z.workers), z.size)[z.rank]
        return padded(whole.to(z.flat.data.device))[my_index]

    def fresh_params(self, z: ShardState) -> torch.Tensor | None:
        return self.mine(z, z.flat.data).clone() if self.keeps_params(z) else None

    def apply(self, z: ShardState, staged: Staged) -> None:
        """The replicated parameters take every rank's updated chunk."""
        live = padded(z.flat.data)
        live.index_copy_(0, z.index, staged.params)  # padding lands in the extra slot
        z.flat.data.copy_(live[:-1])

    def rebuilt(
        self, z: ShardState, comm: Communicator, own: Shard, abort: Callable[[], bool]
    ) -> None:
        """The parameters from every rank's chunk, where shards carry them (snapshots ``K > 1``
        steps apart roll them back)."""
        if own.params is not None:
            z.flat.data.copy_(self.gather(z, comm, own.params, abort))

    def gather(
        self, z: ShardState, comm: Communicator, part: torch.Tensor, abort: Callable[[], bool]
    ) -> torch.Tensor:
        assert z.layout is not None
        gathered = z.flat.data.new_empty(len(z.workers) * z.size)
        comm.allgather_into(z.group, gathered, part, abort=abort)
        flat = z.flat.data.new_zeros(z.layout.numel + 1)
        flat.index_copy_(0, z.index, gathered)
        return flat[:-1]

    def take_whole(self, z: ShardState, params: torch.Tensor) -> None:
        z.flat.data.copy_(params)  # whole on every rank

    def unchanged(self, z: ShardState) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Every rank's chunk rank-major, as the update's all-gather leaves them."""
        staged = padded(z.flat.data).index_select(0, z.index)
        return staged, self.mine(z, z.flat.data).clone(), False


@dataclass
class ShardedParams(ParamHolding):
    """ZeRO-3: the parameters are in the shard. ``initial`` builds a layer's initial parameters
    (a fresh start takes this rank's chunk of each, one layer at a time); ``cuts`` say where
    every rank's part of each layer lies in its buffer (see
    :func:`~elaswave.planning.shards.layer_cuts`)."""

    initial: Initial
    cuts: tuple[LayerCut, ...] = ()
    # per layer: where its elements lie in this rank's buffer (pruning; of this layout)
    positions: dict[int, torch.Tensor] = field(default_factory=dict)

    def keeps_params(self, z: ShardState) -> bool:
        return True

    def index_of(self, z: ShardState, layout: ShardLayout) -> torch.Tensor:
        """No whole-model index (it would cost 8 bytes per parameter): per-layer cuts."""
        self.cuts = layer_cuts(layout)
        self.positions = {}
        return torch.zeros(0, dtype=torch.long, device=z.flat.data.device)

    def mine(self, z: ShardState, whole: torch.Tensor) -> torch.Tensor:
        assert z.layout is not None
        out = torch.zeros(z.size, dtype=whole.dtype, device=whole.device)
        cursor = 0
        for lo, n in z.layout.pieces(z.rank):
            out[cursor : cursor + n] = whole[lo : lo + n]
            cursor += n
        return out.to(z.flat.data.device)

    def fresh_params(self, z: ShardState) -> torch.Tensor:
        """This rank's chunk of the initial parameters, from each layer built alone."""
        out = z.flat.data.new_zeros(z.size)
        for i, cut in enumerate(self.cuts):
            if not cut.sizes[z.rank]:
                continue
            layer = self.initial(i).to(out.device)
            cursor = cut.starts[z.rank]
            for lo, n in cut.local[z.rank]:
                out[cursor : cursor + n] = layer[lo : lo + n]
                cursor += n
        return out

    def apply(self, z: ShardState, staged: Staged) -> None:
        """Nothing to gather: the staged shard carries the parameters."""

    def rebuilt(
        self, z: ShardState, comm: Communicator, own: Shard, abort: Callable[[], bool]
    ) -> None:
        """Nothing to gather: the reshard moved the parameter chunks with the moments."""

    def take_whole(self, z: ShardState, params: torch.Tensor) -> None:
        """Nothing whole: the shard takes its chunk."""

    def unchanged(self, z: ShardState) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The shard's own chunk: it is the staged parameters too."""
        assert z.own is not None and z.own.params is not None
        param = z.own.params.clone()
        return param, param, True

    def gather(
        self, z: ShardState, comm: Communicator, part: torch.Tensor, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """A layer at a time."""
        assert z.layout is not None
        out = part.new_empty(z.layout.numel)
        for cut in self.cuts:
            out[cut.offset : cut.offset + cut.length] = self.gather_layer(
                z, comm, part, cut, abort=abort
            )
        return out

    def gather_layer(
        self,
        z: ShardState,
        comm: Communicator,
        part: torch.Tensor,
        cut: LayerCut,
        *,
        abort: Callable[[], bool],
    ) -> torch.Tensor:
        """Layer ``cut``'s elements of a shard-laid-out tensor, from every rank's part."""
        world, pad = len(z.workers), cut.pad
        mine = part.new_zeros(pad)
        start, size = cut.starts[z.rank], cut.sizes[z.rank]
        mine[:size] = part[start : start + size]
        gathered = part.new_empty(world * pad)
        comm.allgather_into(z.group, gathered, mine, abort=abort)
        return unpack_layer(gathered, cut)

    @staticmethod
    def params(z: ShardState) -> torch.Tensor:
        """The parameter chunk this rank computes with (its live shard's)."""
        assert z.own is not None and z.own.params is not None
        return z.own.params

    @staticmethod
    def take(
        z: ShardState,
        comm: Communicator,
        step: int,
        params: torch.Tensor,
        *,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        loss: float,
        abort: Callable[[], bool],
    ) -> None:
        """This rank's shard of the current layout, as kept earlier (a known-good state): the
        live state and the snapshot again, its replica pieces sent to the peers."""
        if params.numel() != z.size:
            raise ValueError(f"a shard of {params.numel()} elements for one of {z.size}")
        own = Shard.of(step, exp_avg.clone(), exp_avg_sq.clone(), params=params.clone())
        z.start_from(comm, own, loss, abort=abort)

    @staticmethod
    def pieces(z: ShardState) -> list[Piece]:
        """The flat intervals this rank owns with their parameters and moments (what it writes
        of a durable checkpoint: the ranks' pieces tile the model)."""
        assert z.layout is not None and z.own is not None
        out, cursor = [], 0
        own = z.own
        assert own.params is not None
        for lo, n in z.layout.pieces(z.rank):
            span = slice(cursor, cursor + n)
            out.append((lo, lo + n, own.params[span], own.exp_avg[span], own.exp_avg_sq[span]))
            cursor += n
        return out


@dataclass(frozen=True)
class LayerShards:
    """What the layer-wise data path reads of a sharded-parameter state: every layer's cut,
    this rank's index among the shards' ranks, the group they are laid out over, and the live
    parameter chunk."""

    z: ShardState
    holding: ShardedParams

    @property
    def cuts(self) -> tuple[LayerCut, ...]:
        return self.holding.cuts

    @property
    def rank(self) -> int:
        return self.z.rank

    @property
    def workers(self) -> tuple[str, ...]:
        return self.z.workers

    @property
    def group(self) -> str:
        return self.z.group

    @property
    def params(self) -> torch.Tensor:
        return self.holding.params(self.z)


def padded(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` with one extra zero: where a layout's padding positions point."""
    return torch.cat([flat, flat.new_zeros(1)])


def unpack_layer(gathered: torch.Tensor, cut: LayerCut) -> torch.Tensor:
    """A layer in flat order from an all-gather of every rank's padded part of it (``gathered``
    itself, no copy, where the cut is rank-major)."""
    if cut.rank_major:
        return gathered[: cut.length]
    layer = gathered.new_empty(cut.length)
    for r, runs in enumerate(cut.local):
        cursor = r * cut.pad
        for lo, n in runs:
            layer[lo : lo + n] = gathered[cursor : cursor + n]
            cursor += n
    return layer


def pack_layer(layer: torch.Tensor, cut: LayerCut, out: torch.Tensor) -> torch.Tensor:
    """The inverse: ``layer``'s elements rank-major and padded into ``out`` (world x pad, the
    padding zero), what a reduce-scatter hands each rank its part of."""
    view = out.view(len(cut.local), cut.pad)
    for r, runs in enumerate(cut.local):
        cursor = 0
        for lo, n in runs:
            view[r, cursor : cursor + n] = layer[lo : lo + n]
            cursor += n
        view[r, cursor:] = 0
    return out
