"""ZeRO-3's layer-wise data path: a layer's full parameters exist only while it runs.

A rank keeps only its shard of every layer (:class:`~.holding.ShardedParams`); its layers are
shells (:func:`~elaswave.runtime.workload.base.hollow`: trainable parameters on the meta device,
buffers real). One training step over this rank's micro-batches, layer-major:

============  =====================================================================================
forward       layers ``0 .. L-2``: wait for layer ``i``'s all-gather (every rank's part of it) and
              post layer ``i+1``'s, fill the shell, run every micro-batch through it with no
              autograd graph, keeping each micro-batch's input to the layer; empty the shell.
backward      layers ``L-1 .. 0``: wait for layer ``i`` (gathered again; the last layer's once)
              and post ``i-1``'s, fill the shell with a gradient buffer, recompute each
              micro-batch's forward from its kept input with autograd on (the keyed random
              streams draw the same dropout masks) and backpropagate what came down from layer
              ``i+1`` (the last layer: the loss sum); the input's gradient goes on down. The
              layer's gradient, summed over the micro-batches exactly as data parallelism sums
              it (autograd's float32, or float64 in the deterministic mode), is reduce-scattered:
              each rank receives the batch's sum for its part of the layer. Empty the shell.
============  =====================================================================================

At most two layers' parameters exist at once (the one computing, the one being gathered), plus
the one layer's gradient. Tied copies (``TrainState.ties``) are summed before their layers'
reduction, as :meth:`~elaswave.runtime.state.TrainState.tie_gradients` does: those layers'
gradients wait until every layer of the tie has produced its own.

Layer-major rather than micro-batch-major: a step gathers every layer twice and reduces its
gradient once, whatever the number of micro-batches, every rank issues the same collectives
whatever its share of the batch (shares are uneven after a fault), and only one layer's gradient
is ever held. The price is the layer inputs of all the rank's micro-batches, kept through the
step (what activation checkpointing at layer boundaries keeps, times the micro-batches).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elaswave.planning.tiers import Tiers
from elaswave.runtime.comm.communicator import Communicator, Pending
from elaswave.runtime.comm.tiered import allgather_tiered, allreduce_tiered
from elaswave.runtime.strategies.base import DP
from elaswave.runtime.strategies.zero.holding import LayerShards, pack_layer, unpack_layer
from elaswave.runtime.workload.base import KeyedLayers

__all__ = ["Batch", "LayerGather"]

LossFn = Callable[[torch.Tensor, Any], tuple[torch.Tensor, int]]
# What autograd imports the first time a backward is handed a gradient (most of a second; the
# worker template imports it for ZeRO-3 jobs, so forked workers find it imported).
BACKWARD_IMPORTS = ("torch.fx.experimental.symbolic_shapes",)


@dataclass
class Batch:
    """One micro-batch as the data path runs it: its id (the random streams' key), the inputs
    of layer 0 and the loss's targets."""

    id: int
    inputs: Any
    targets: Any


@dataclass
class _Slot:
    """One trainable parameter of a layer: its shell (meta) tensor, where it lies in the layer's
    flat parameters, and every (module, name) that holds it."""

    meta: nn.Parameter
    offset: int
    places: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass
class _Gathering:
    layer: int
    out: torch.Tensor
    work: Pending | None
    piece: torch.Tensor | None = None  # hpZ: this rank's secondary part, gathered in its host


@dataclass
class _Reducing:
    layer: int
    send: torch.Tensor  # every rank's part, rank-major and padded
    out: torch.Tensor  # this rank's part (padded): what it receives
    work: Pending | None


class LayerGather:
    """One rank's layers as ZeRO-3 runs them. ``enter`` tells the hang detector whether the rank
    computes or waits for peers; ``native``: reduce-scatter gradients with the backend's
    reduce-scatter, else all-reduce and keep this rank's part; ``prefetch``: post the next
    layer's all-gather before computing the current one."""

    def __init__(
        self,
        model: KeyedLayers,
        comm: Communicator,
        enter: Callable[[str], None],
        *,
        native: bool,
        prefetch: bool = True,
    ) -> None:
        for module in BACKWARD_IMPORTS:  # now, not inside the first step's compute
            importlib.import_module(module)
        self.model, self.comm, self.enter = model, comm, enter
        self.native, self.prefetch = native, prefetch
        self.slots = [_slots(layer) for layer in model.layers]
        self.tiers: Tiers | None = None  # the plan's tiers: gradients reduced by them
        # hpZ: (the host's group, this rank's index in it, the host's ranks), or None: each
        # layer's forward gather leaves this rank its secondary part of the layer, which the
        # layer's backward gathers inside the host (see ``_keep``)
        self.secondary: tuple[str, int, int] | None = None
        self._kept: dict[int, torch.Tensor] = {}
        self.compressed = False  # by tiers, the hop between hosts as int8
        # train.shard_scope host: the shards are laid out over the host's ranks, every host a
        # whole copy; each layer's gradient is all-reduced over every rank (by tiers where the
        # plan has them) in flat order and each rank keeps its part
        self.across_hosts = False
        self.gather_tiers = False  # train.zero3_gather tiers: a layer gathered by the tiers
        # the most bytes held at once during the last step: of gathered layers' parameters, of
        # layer gradients (and their reduction's buffers), and of both together
        self.peak_params = self.peak_grads = self.peak = 0
        self.waited = 0.0  # seconds this step spent waiting for peers
        self._live = [0, 0]  # bytes held now: [gathered parameters, layer gradients]

    # ---- parameters in and out ------------------------------------------------------------------
    def post_gather(self, shards: LayerShards, i: int, abort: Callable[[], bool]) -> _Gathering:
        """Post the all-gather of layer ``i``'s parameters (every rank's part of it)."""
        cut, rank, world = shards.cuts[i], shards.rank, len(shards.workers)
        start, size = cut.starts[rank], cut.sizes[rank]
        mine = shards.params.new_zeros(cut.pad)
        mine[:size] = shards.params[start : start + size]
        out = mine.new_empty(world * cut.pad)
        self._hold(out)
        if self.gather_tiers and self.tiers is not None:  # done here, on the computing thread
            with self._waiting():
                allgather_tiered(self.comm, DP, self.tiers, out=out, part=mine, abort=abort)
            return _Gathering(i, out, None)
        work = (
            self.comm.start_allgather(shards.group, out, mine, abort=abort) if world > 1 else None
        )
        if work is None:
            out.copy_(mine)
        return _Gathering(i, out, work)

    def finish_gather(
        self, g: _Gathering, shards: LayerShards, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """Layer ``g.layer``'s parameters, whole and in flat order."""
        self._wait(g.work, abort)
        if g.piece is not None:  # from the host's secondary parts: in flat order already
            self._drop(g.piece)
            return g.out[: shards.cuts[g.layer].length]
        layer = unpack_layer(g.out, shards.cuts[g.layer])
        self._hold(layer)
        self._drop(g.out)
        return layer

    @contextlib.contextmanager
    def filled(
        self, i: int, flat: torch.Tensor, grad: torch.Tensor | None = None
    ) -> Iterator[nn.Module]:
        """Layer ``i``'s shell holding ``flat`` (its parameters, as views; their gradients
        accumulate in place into views of ``grad``), emptied again on the way out."""
        layer = self.model.layers[i]
        try:
            for slot in self.slots[i]:
                meta, n = slot.meta, slot.meta.numel()
                view = flat[slot.offset : slot.offset + n].view(meta.shape)
                p = nn.Parameter(view, requires_grad=grad is not None)
                if grad is not None:
                    p.grad = grad[slot.offset : slot.offset + n].view(meta.shape)
                for module, name in slot.places:
                    module._parameters[name] = p
            yield layer
        finally:
            for slot in self.slots[i]:
                for module, name in slot.places:
                    module._parameters[name] = slot.meta

    # ---- gradients ------------------------------------------------------------------------------
    def post_reduce(
        self, shards: LayerShards, i: int, sums: torch.Tensor, *, abort: Callable[[], bool]
    ) -> _Reducing:
        """Post the reduction of layer ``i``'s gradient sums: rank ``r`` receives the sum over
        the ranks of its part. Takes ``sums`` over (held; the caller no longer touches them): a
        rank-major layer's sums are the send buffer itself, others are packed into one."""
        cut, world = shards.cuts[i], len(shards.workers)
        if self.across_hosts:  # every host's ranks hold other parts: the whole layer, summed
            with self._waiting():
                int8 = sums.numel() if self.compressed else 0
                allreduce_tiered(
                    self.comm, DP, self.tiers, tensor=sums, abort=abort, compressed=int8
                )
            out = sums.new_empty(cut.pad)
            self._hold(out, grads=True)
            cursor = 0
            for lo, n in cut.local[shards.rank]:
                out[cursor : cursor + n] = sums[lo : lo + n]
                cursor += n
            return _Reducing(i, sums, out, None)
        if cut.rank_major:
            send = sums  # still held, now as the send buffer
        else:
            send = pack_layer(sums, cut, sums.new_empty(world * cut.pad))
            self._hold(send, grads=True)
            self._drop(sums, grads=True)
        if world == 1:
            return _Reducing(i, send, send, None)
        if self.tiers is not None:  # by hosts: the same sums; this rank keeps its part
            with self._waiting():  # a chain of collectives on the tiers' groups, done here
                int8 = send.numel() if self.compressed else 0
                allreduce_tiered(
                    self.comm, DP, self.tiers, tensor=send, abort=abort, compressed=int8
                )
            return _Reducing(i, send, send.view(world, cut.pad)[shards.rank], None)
        if self.native:
            out = sums.new_empty(cut.pad)
            self._hold(out, grads=True)
            parts = list(send.view(world, cut.pad).unbind(0))
            return _Reducing(
                i, send, out, self.comm.start_reduce_scatter(DP, parts, out, abort=abort)
            )
        work = self.comm.start_allreduce(DP, send, abort)  # the same sums; this rank keeps its part
        return _Reducing(i, send, send.view(world, cut.pad)[shards.rank], work)

    def finish_reduce(
        self, r: _Reducing, shards: LayerShards, grads: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        """This rank's part of the layer's reduced sums into its gradient shard ``grads``."""
        self._wait(r.work, abort)
        cut = shards.cuts[r.layer]
        start, size = cut.starts[shards.rank], cut.sizes[shards.rank]
        grads[start : start + size] = r.out[:size]
        self._drop(r.send, grads=True)
        if r.out.untyped_storage().data_ptr() != r.send.untyped_storage().data_ptr():
            self._drop(r.out, grads=True)

    # ---- the passes -----------------------------------------------------------------------------
    def train(
        self,
        shards: LayerShards,
        step: int,
        batches: Sequence[Batch],
        *,
        grads: torch.Tensor,
        loss_fn: LossFn,
        abort: Callable[[], bool],
        ties: Sequence[tuple[slice, slice]] = (),
    ) -> tuple[torch.Tensor, int]:
        """Forward and backward of ``batches`` for ``step``; every rank calls it together
        (with its own batches, maybe none). ``grads`` (this rank's shard, zeroed, in the
        reduction's dtype) receives the batch's gradient sums of its part. Returns the
        micro-batches' loss sum (float64) and count."""
        model, layers = self.model, len(self.model.layers)
        self.waited, self._live, self._kept = 0.0, [0, 0], {}
        self.peak_params = self.peak_grads = self.peak = 0
        acts: list[list[Any] | None] = [[b.inputs for b in batches]]
        pending: _Gathering | None = self._post(shards, 0 if layers > 1 else layers - 1, abort)
        try:
            for i in range(layers - 1):  # forward, no graph kept: only each layer's inputs
                assert pending is not None
                flat = self.finish_gather(pending, shards, abort)
                pending = self._post(shards, i + 1, abort) if self.prefetch else None
                self._keep(i, flat)
                with self.filled(i, flat), torch.no_grad():
                    xs = acts[i]
                    assert xs is not None
                    outs = [
                        model.run_layer(i, x, step, microbatch=b.id)
                        for x, b in zip(xs, batches, strict=True)
                    ]
                    acts.append(outs)
                self._drop(flat)
                pending = pending or self._post(shards, i + 1, abort)
            return self._backward(
                shards,
                step,
                batches,
                grads=grads,
                loss_fn=loss_fn,
                abort=abort,
                ties=ties,
                acts=acts,
                pending=pending,
            )
        except BaseException:
            self._abandon(pending)
            raise

    def _backward(
        self,
        shards: LayerShards,
        step: int,
        batches: Sequence[Batch],
        *,
        grads: torch.Tensor,
        loss_fn: LossFn,
        abort: Callable[[], bool],
        ties: Sequence[tuple[slice, slice]],
        acts: list[list[Any] | None],
        pending: _Gathering | None,
    ) -> tuple[torch.Tensor, int]:
        model, layers = self.model, len(self.model.layers)
        loss_sum = torch.zeros((), dtype=torch.float64, device=grads.device)
        count = 0
        upstream: list[torch.Tensor | None] = [None] * len(batches)
        tied = TiedLayers(ties, [(c.offset, c.length) for c in shards.cuts])
        reducing: list[_Reducing] = []
        for i in reversed(range(layers)):
            assert pending is not None
            flat = self.finish_gather(pending, shards, abort)
            pending = self._post(shards, i - 1, abort) if i > 0 and self.prefetch else None
            grad = torch.zeros_like(flat)
            # In the reduction's own dtype autograd's buffer is the accumulator (the same float32
            # sums, in the same order); a wider one (float64) takes each micro-batch's as it comes.
            acc = grads.new_zeros(flat.numel()) if grads.dtype != grad.dtype else None
            self._hold(grad, acc, grads=True)
            xs = acts[i]
            assert xs is not None
            with self.filled(i, flat, grad):
                for k, b in enumerate(batches):
                    x = xs[k]
                    if i > 0 and x.is_floating_point():
                        x = x.detach().requires_grad_(True)
                    out = model.run_layer(i, x, step, microbatch=b.id)
                    if i == layers - 1:
                        loss, n = loss_fn(out, b.targets)
                        loss_sum += loss.detach()
                        count += n
                        out = loss
                    if out.requires_grad and (i == layers - 1 or upstream[k] is not None):
                        out.backward(None if i == layers - 1 else upstream[k])
                    upstream[k] = x.grad if i > 0 and x.requires_grad else None
                    if acc is not None:
                        acc.add_(grad)
                        grad.zero_()
            acts[i] = None  # the inputs are spent
            self._drop(flat)
            if i > 0 and pending is None:
                pending = self._post(shards, i - 1, abort)
            if acc is not None:
                self._drop(grad, grads=True)
            for layer, sums in tied.ready(i, acc if acc is not None else grad):
                for r in reducing:  # one reduction in flight (its buffers are a layer each)
                    self.finish_reduce(r, shards, grads, abort=abort)
                reducing = [self.post_reduce(shards, layer, sums, abort=abort)]
        for r in reducing:
            self.finish_reduce(r, shards, grads, abort=abort)
        return loss_sum, count

    def score(
        self,
        shards: LayerShards,
        batches: Sequence[Batch],
        score_fn: Callable[[torch.Tensor, Any], tuple[float, int, int]],
        *,
        step: int,
        abort: Callable[[], bool],
    ) -> list[tuple[float, int, int]]:
        """Forward only (the caller holds no_grad and eval mode), every layer gathered once:
        what ``score_fn`` makes of each batch's output (:meth:`TrainState.score`). Every rank
        calls it together, with its own batches."""
        model, layers = self.model, len(self.model.layers)
        xs = [b.inputs for b in batches]
        self._kept = {}
        pending: _Gathering | None = self._post(shards, 0, abort)
        try:
            for i in range(layers):
                assert pending is not None
                flat = self.finish_gather(pending, shards, abort)
                ahead = i + 1 < layers
                pending = self._post(shards, i + 1, abort) if ahead and self.prefetch else None
                with self.filled(i, flat):
                    xs = [
                        model.run_layer(i, x, step, microbatch=b.id)
                        for x, b in zip(xs, batches, strict=True)
                    ]
                self._drop(flat)
                if ahead and pending is None:
                    pending = self._post(shards, i + 1, abort)
        except BaseException:
            self._abandon(pending)
            raise
        return [score_fn(x, b.targets) for x, b in zip(xs, batches, strict=True)]

    # ---- helpers --------------------------------------------------------------------------------
    def _post(self, shards: LayerShards, i: int, abort: Callable[[], bool]) -> _Gathering:
        """Post layer ``i``'s gather: inside the host from the secondary parts where this step's
        forward kept them (hpZ), else over every rank."""
        piece = self._kept.pop(i, None)
        if piece is None:
            return self.post_gather(shards, i, abort)
        assert self.secondary is not None
        group, _, k = self.secondary
        out = piece.new_empty(k * piece.numel())
        self._hold(out)
        return _Gathering(i, out, self.comm.start_allgather(group, out, piece, abort=abort), piece)

    def _keep(self, i: int, flat: torch.Tensor) -> None:
        """hpZ: this rank's secondary part of layer ``i`` (``flat``, gathered whole for its
        forward): the ``j``-th of ``k`` contiguous slices of the layer in flat order (padded to
        one size), held until the layer's backward gathers the host's parts again."""
        if self.secondary is None:
            return
        _, j, k = self.secondary
        n = flat.numel()
        size = -(-n // k)
        a, b = min(n, j * size), min(n, (j + 1) * size)
        piece = flat.new_zeros(size)
        piece[: b - a] = flat[a:b]
        self._kept[i] = piece
        self._hold(piece)

    def _wait(self, work: Pending | None, abort: Callable[[], bool]) -> None:
        if work is not None:
            with self._waiting():
                self.comm.wait([work], abort)

    @contextlib.contextmanager
    def _waiting(self) -> Iterator[None]:
        """The rank waits for its peers (the hang detector is told; the time is counted)."""
        start = time.perf_counter()
        self.enter("collective")
        try:
            yield
        finally:
            self.enter("compute")
            self.waited += time.perf_counter() - start

    def _abandon(self, pending: _Gathering | None) -> None:
        if pending is not None and pending.work is not None:
            self.comm.abandon([pending.work])

    def _hold(self, *tensors: torch.Tensor | None, grads: bool = False) -> None:
        """``tensors`` are now held (layer gradients where ``grads``, else gathered layers)."""
        self._live[int(grads)] += sum(
            t.untyped_storage().nbytes() for t in tensors if t is not None
        )
        self.peak_params = max(self.peak_params, self._live[0])
        self.peak_grads = max(self.peak_grads, self._live[1])
        self.peak = max(self.peak, sum(self._live))

    def _drop(self, what: torch.Tensor, grads: bool = False) -> None:
        self._live[int(grads)] -= what.untyped_storage().nbytes()


class TiedLayers:
    """Which layers' gradients must wait for others before their reduction: the layers of each
    tie (``(slice a, slice b)`` of the whole model's flat offsets) form a group, reduced once
    every layer of it has its sums, after the copies are summed as ``TrainState.tie_gradients``
    sums them (``a += b``, then ``b = a``, in the ties' order)."""

    def __init__(self, ties: Sequence[tuple[slice, slice]], segments: Sequence[tuple[int, int]]):
        self.ties, self.segments = list(ties), list(segments)
        self.group: dict[int, set[int]] = {}
        for a, b in self.ties:
            joined = {self.layer_of(a.start), self.layer_of(b.start)}
            for layer in list(joined):
                joined |= self.group.get(layer, set())
            for layer in joined:
                self.group[layer] = joined
        self.waiting: dict[int, torch.Tensor] = {}

    def layer_of(self, flat: int) -> int:
        return max(i for i, (offset, _) in enumerate(self.segments) if offset <= flat)

    def ready(self, layer: int, sums: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``layer``'s sums are complete: the (layer, sums) that can be reduced now."""
        group = self.group.get(layer)
        if group is None:
            return [(layer, sums)]
        self.waiting[layer] = sums
        if not group <= set(self.waiting):
            return []
        at = {i: self.waiting.pop(i) for i in sorted(group, reverse=True)}
        for a, b in self.ties:
            la, lb = self.layer_of(a.start), self.layer_of(b.start)
            if la in at and lb in at:
                va, vb = self._local(at[la], la, a), self._local(at[lb], lb, b)
                va.add_(vb)
                vb.copy_(va)
        return list(at.items())

    def _local(self, sums: torch.Tensor, layer: int, where: slice) -> torch.Tensor:
        offset = self.segments[layer][0]
        return sums[where.start - offset : where.stop - offset]


def _slots(layer: nn.Module) -> list[_Slot]:
    """The layer's trainable parameters in the flat order (``parameters()``, as ``FlatParams``
    lays them out), each with every place that holds it."""
    order = [p for p in layer.parameters() if p.requires_grad]
    slots, offset = {}, 0
    for p in order:
        slots[id(p)] = _Slot(p, offset)
        offset += p.numel()
    for module in layer.modules():
        for name, held in module._parameters.items():
            if held is not None and id(held) in slots:
                slots[id(held)].places.append((module, name))
    return list(slots.values())
