"""ZeRO-3's shard state: ZeRO-1's shards (:class:`~elaswave.runtime.strategies.zero.ZeroState`)
that always carry their parameter chunk, because no rank holds the parameters whole.

Rank ``r`` owns its ranges of every layer (the same interleaved, world-size-independent layout as
ZeRO-1, :mod:`elaswave.planning.shards`): the parameters there, their optimizer moments, and,
during a step, their gradient sums. So everything ZeRO-1 does with a shard holds for the
parameters too: a snapshot step sends each peer its piece of the staged shard (parameters and
moments, one checksum), recovery promotes the pieces survivors keep (nothing crosses the
network), joiners receive disjoint transfers, corrupt copies are repaired from the other copy.
What differs is the step: the gradient arrives already reduced, a layer at a time, from the
layer-wise data path (:mod:`~elaswave.runtime.strategies.gather`); the update stages the
shard's parameters and moments and nothing is gathered afterwards (the next forward gathers each
layer as it needs it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from elaswave.planning.shards import LayerCut, ShardLayout, layer_cuts
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.durable.checkpoints import Piece
from elaswave.runtime.optim import FlatOptimizer, Spans
from elaswave.runtime.strategies.shard import Shard, Staged
from elaswave.runtime.strategies.zero import ZeroState

__all__ = ["ParamShards"]

Initial = Callable[[int], torch.Tensor]  # layer index -> its initial trainable parameters, flat


@dataclass
class ParamShards(ZeroState):
    """One rank's ZeRO-3 state. ``initial`` builds a layer's initial parameters (a fresh start
    takes this rank's chunk of each, one layer at a time); ``cuts`` say where every rank's part
    of each layer lies in its buffer (see :func:`~elaswave.planning.shards.layer_cuts`)."""

    initial: Initial | None = None
    cuts: tuple[LayerCut, ...] = ()
    # per layer: where its elements lie in this rank's buffer (pruning; of this layout)
    _positions: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def keeps_params(self) -> bool:
        return True

    @property
    def params(self) -> torch.Tensor:
        """The parameter chunk this rank computes with (its live shard's)."""
        assert self.own is not None and self.own.params is not None
        return self.own.params

    # ---- what ZeRO-1 does with replicated parameters, for sharded ones -------------------------
    def _index_of(self, layout: ShardLayout) -> torch.Tensor:
        """No whole-model index (it would cost 8 bytes per parameter): per-layer cuts."""
        self.cuts = layer_cuts(layout)
        self._positions = {}
        return torch.zeros(0, dtype=torch.long, device=self.flat.data.device)

    def _mine(self, whole: torch.Tensor) -> torch.Tensor:
        assert self.layout is not None
        out = torch.zeros(self.size, dtype=whole.dtype, device=whole.device)
        cursor = 0
        for lo, n in self.layout.pieces(self.rank):
            out[cursor : cursor + n] = whole[lo : lo + n]
            cursor += n
        return out.to(self.flat.data.device)

    def _fresh_params(self) -> torch.Tensor:
        """This rank's chunk of the initial parameters, from each layer built alone."""
        assert self.initial is not None
        out = self.flat.data.new_zeros(self.size)
        for i, cut in enumerate(self.cuts):
            if not cut.sizes[self.rank]:
                continue
            layer = self.initial(i).to(out.device)
            cursor = cut.starts[self.rank]
            for lo, n in cut.local[self.rank]:
                out[cursor : cursor + n] = layer[lo : lo + n]
                cursor += n
        return out

    def _apply_params(self, staged: Staged) -> None:
        """Nothing to gather: the staged shard carries the parameters."""

    def _rebuilt(self, comm: Communicator, own: Shard, abort: Callable[[], bool]) -> None:
        """Nothing to gather: the reshard moved the parameter chunks with the moments."""

    def _gather(
        self, comm: Communicator, part: torch.Tensor, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """A shard-laid-out tensor of every rank, whole in flat order (a layer at a time)."""
        assert self.layout is not None
        out = part.new_empty(self.layout.numel)
        for cut in self.cuts:
            out[cut.offset : cut.offset + cut.length] = self.gather_layer(
                comm, part, cut, abort=abort
            )
        return out

    def gather_layer(
        self, comm: Communicator, part: torch.Tensor, cut: LayerCut, *, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """Layer ``cut``'s elements of a shard-laid-out tensor, from every rank's part."""
        world, pad = len(self.workers), cut.pad
        mine = part.new_zeros(pad)
        start, size = cut.starts[self.rank], cut.sizes[self.rank]
        mine[:size] = part[start : start + size]
        gathered = part.new_empty(world * pad)
        comm.allgather_into(self.group, gathered, mine, abort=abort)
        return unpack_layer(gathered, cut)

    # ---- one step -------------------------------------------------------------------------------
    def stage3(
        self,
        comm: Communicator,
        grads: torch.Tensor,
        step: int,
        *,
        count: int,
        abort: Callable[[], bool],
        before_update: Callable[[], None],
        clip: tuple[float, Sequence[tuple[slice, slice]]] = (0.0, ()),
        measure: bool = False,
    ) -> float | None:
        """Stage the update of this rank's shard from ``grads`` (its part of the batch's
        gradient sums, reduced; divided here by the batch's ``count``) and, on a snapshot step,
        replicate it. Clipping (``clip``: max norm and ties) and ``measure`` take the global norm
        from every rank's per-layer squares (an all-reduce: every rank asks, or none). Returns
        the norm (None unless asked)."""
        assert self.own is not None and self.own.params is not None
        max_norm, ties = clip
        mean = grads.div_(count)
        layers = [(cut.offset, cut.length) for cut in self.cuts]
        factor, norm = self.shard_clip(
            comm, mean, max_norm, ties=ties, segments=layers, measure=measure, abort=abort
        )
        grad = mean if mean.dtype == torch.float32 else mean.to(torch.float32)
        if factor < 1.0:  # after the conversion, as replicated data parallelism does
            grad.mul_(factor)
        before_update()
        param = self.own.params.clone()
        opt = FlatOptimizer(0, self.hyper)  # update copies: the live shard stays put
        opt.exp_avg, opt.exp_avg_sq = self.own.exp_avg.clone(), self.own.exp_avg_sq.clone()
        opt.step_count = step - 1
        opt.step(param, grad, self.groups)
        if self.prune is not None and self.prune.active(step):
            self._prune_chunk(comm, step, param, abort=abort)
        if self.is_snapshot(step):
            own = Shard.of(step, opt.exp_avg, opt.exp_avg_sq, params=param)
            self.staged = Staged(step, param, own, None)
            self.staged.replicas = self._replicate(comm, own, abort)
        else:
            own = Shard(step, opt.exp_avg, opt.exp_avg_sq, None, param)
            self.staged = Staged(step, param, own, None)
        return norm

    def _prune_chunk(
        self, comm: Communicator, step: int, param: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        """DHSPG on the updated chunk ``param``. No rank holds the whole parameters: each layer
        with groups is gathered whole, before and after the update, for its groups' sums (the
        numbers replicated data parallelism takes, on every rank alike, whatever the layout);
        the decisions then apply to this rank's elements, each as
        :func:`~elaswave.prune.dhspg.apply` computes it."""
        prune, old = self.prune, self.params
        assert prune is not None
        prune.to(param.device)

        def spans(layer: int) -> tuple[Spans, Spans]:
            cut = self.cuts[layer]
            before = self.gather_layer(comm, old, cut, abort=abort)
            return Spans(before, cut.offset), Spans(
                self.gather_layer(comm, param, cut, abort=abort), cut.offset
            )

        lr = self.hyper.lr_at(step)
        scale, cleared = prune.decide(step, prune.sums(spans, lr), lr)
        for start, count, part in prune.rows():
            cut = self.cuts[part.layer]
            if part.layer not in self._positions:  # once per layout, not every pruning step
                self._positions[part.layer] = cut.positions(self.rank).to(param.device)
            at = self._positions[part.layer][part.index - cut.offset]
            mine = at >= 0
            if not bool(mine.any()):
                continue
            group = torch.arange(start, start + count, device=param.device).unsqueeze(1)
            group = group.expand_as(at)[mine]
            at = at[mine]
            x, h = old[at], param[at]
            out = h - scale[group].to(h.dtype) * x
            out[cleared[group]] = 0.0
            param[at] = out

    def take(
        self,
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
        if params.numel() != self.size:
            raise ValueError(f"a shard of {params.numel()} elements for one of {self.size}")
        own = Shard.of(step, exp_avg.clone(), exp_avg_sq.clone(), params=params.clone())
        self._start_from(comm, own, loss, abort=abort)

    # ---- durability -----------------------------------------------------------------------------
    def pieces(self) -> list[Piece]:
        """The flat intervals this rank owns with their parameters and moments (what it writes
        of a durable checkpoint: the ranks' pieces tile the model)."""
        assert self.layout is not None and self.own is not None
        out, cursor = [], 0
        for lo, n in self.layout.pieces(self.rank):
            span = slice(cursor, cursor + n)
            own = self.own
            assert own.params is not None
            out.append((lo, lo + n, own.params[span], own.exp_avg[span], own.exp_avg_sq[span]))
            cursor += n
        return out


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
