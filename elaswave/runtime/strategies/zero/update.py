"""How one step's gradient reaches a rank's shard and stages its update: steps 1–3 of
:mod:`~elaswave.runtime.strategies.zero.state`, in the two forms a ZeRO strategy picks from.

- :func:`update_from_whole` (ZeRO-1): every rank computed gradient sums for the whole model;
  they are reduced (each rank keeps its shard's part), the shard is updated, and the updated
  chunks are all-gathered back into whole parameters.
- :func:`update_from_layers` (ZeRO-3): the layer-wise data path already reduced each layer's
  gradient into this rank's part as backward produced it; the shard's parameters and moments are
  updated in place of a copy and nothing is gathered afterwards.

Both divide by the batch's exact count (reduced in the step's tail), clip by the global norm
taken over the same numbers in the same order as replicated data parallelism, stage the update
on copies (the live shard stays put until the commit barrier) and, on a snapshot step, send the
replica pieces. :func:`commit_barrier` is step 4's barrier.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from elaswave.planning.shards import Range, overlaps
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.comm.tiered import allgather_tiered, allreduce_tiered
from elaswave.runtime.optim import (
    FlatOptimizer,
    Spans,
    clip_and_norm,
    clip_scale,
    global_norm,
)
from elaswave.runtime.strategies.zero.holding import ShardedParams, padded
from elaswave.runtime.strategies.zero.shard import Shard, Staged
from elaswave.runtime.strategies.zero.state import DP, ShardState

__all__ = [
    "Clip",
    "Update",
    "commit_barrier",
    "layer_runs",
    "shard_clip",
    "shard_sumsq",
    "stage_unchanged",
    "update_from_layers",
    "update_from_whole",
]


@dataclass(frozen=True)
class Clip:
    """Gradient clipping: the max norm (0: none), the tied copies (each tie's second copy left
    out of the norm), the layers' (offset, length) in the flat buffer."""

    max_norm: float
    ties: Sequence[tuple[slice, slice]]
    segments: Sequence[tuple[int, int]]


class Update(Protocol):
    def __call__(
        self,
        z: ShardState,
        comm: Communicator,
        grads: torch.Tensor,
        step: int,
        *,
        count: int,
        clip: Clip,
        measure: bool,
        reporter: bool,
        abort: Callable[[], bool],
        before_update: Callable[[], None],
    ) -> float | None:
        """Stage step ``step``'s update of ``z`` from ``grads`` (this rank's gradient sums,
        divided here by the batch's ``count``). ``measure``: the logs want the global gradient
        norm even without clipping; ``reporter``: this rank reports it. Returns the norm (None
        unless taken)."""


def update_from_whole(
    z: ShardState,
    comm: Communicator,
    grads: torch.Tensor,
    step: int,
    *,
    count: int,
    clip: Clip,
    measure: bool,
    reporter: bool,
    abort: Callable[[], bool],
    before_update: Callable[[], None],
) -> float | None:
    """ZeRO-1: reduce the whole model's sums (``grads``), each rank keeping its shard's part,
    stage the update, all-gather the updated chunks, replicate on a snapshot step. Without a
    native reduce-scatter every rank holds the whole sum, so only the reporter takes the norm
    unless clipping needs it; with one, every rank adds its squares."""
    assert z.layout is not None and z.own is not None
    measure = measure and (reporter or z.native_reduce_scatter)
    world, size = len(z.workers), z.size
    reduced = grads.new_empty(world * size)  # rank-major gradient sums
    torch.index_select(padded(grads), 0, z.index, out=reduced)
    if z.native_reduce_scatter:
        mine = grads.new_empty(size)
        comm.reduce_scatter(DP, list(reduced.view(world, size).unbind(0)), mine, abort=abort)
        mine = mine.div_(count)  # each rank holds only its part of the sums
        factor, norm = shard_clip(
            z, comm, mine, clip.max_norm, ties=clip.ties,
            segments=clip.segments or ((0, z.flat.numel),), measure=measure, abort=abort,
        )  # fmt: skip
    else:  # same sum, each rank keeps its part (see ``ShardState.native_reduce_scatter``)
        compressed = world * size if z.compressed else 0
        allreduce_tiered(comm, DP, z.tiers, tensor=reduced, abort=abort, compressed=compressed)
        mine = reduced.view(world, size)[z.rank]
        factor, norm = _whole_clip(z, reduced, count, clip, measure=measure)
        mine = mine.div_(count)
    grad = mine.to(torch.float32) if mine.dtype != torch.float32 else mine
    if factor < 1.0:  # after the conversion, as replicated data parallelism does
        grad.mul_(factor)
    before_update()
    param = z.mine(z.flat.data).clone()
    opt = _staged_optimizer(z, step)
    opt.step(param, grad, z.groups)
    gathered = z.flat.data.new_empty(world * size)
    allgather_tiered(comm, DP, z.tiers, out=gathered, part=param, abort=abort)
    if z.prune is not None and z.prune.active(step):
        gathered = _pruned_whole(z, step, gathered, param)
    if z.is_snapshot(step):
        own = Shard.of(step, opt.exp_avg, opt.exp_avg_sq, params=param if z.keeps_params else None)
        z.staged = Staged(step, gathered, own, None)
        z.staged.replicas = z.replicate(comm, own, abort)
    else:
        z.staged = Staged(step, gathered, Shard(step, opt.exp_avg, opt.exp_avg_sq, None), None)
    return norm


def update_from_layers(
    z: ShardState,
    comm: Communicator,
    grads: torch.Tensor,
    step: int,
    *,
    count: int,
    clip: Clip,
    measure: bool,
    reporter: bool,
    abort: Callable[[], bool],
    before_update: Callable[[], None],
) -> float | None:
    """ZeRO-3: ``grads`` are this rank's part of the batch's sums, reduced already; clipping
    and ``measure`` take the global norm from every rank's per-layer squares (an all-reduce:
    every rank asks, or none, ``reporter`` or not)."""
    holding = z.holding
    assert isinstance(holding, ShardedParams)
    assert z.own is not None and z.own.params is not None
    mean = grads.div_(count)
    layers = [(cut.offset, cut.length) for cut in holding.cuts]
    factor, norm = shard_clip(
        z, comm, mean, clip.max_norm, ties=clip.ties, segments=layers, measure=measure, abort=abort
    )
    grad = mean if mean.dtype == torch.float32 else mean.to(torch.float32)
    if factor < 1.0:  # after the conversion, as replicated data parallelism does
        grad.mul_(factor)
    before_update()
    param = z.own.params.clone()
    opt = _staged_optimizer(z, step)
    opt.step(param, grad, z.groups)
    if z.prune is not None and z.prune.active(step):
        _pruned_chunk(z, holding, comm, step, param, abort=abort)
    if z.is_snapshot(step):
        own = Shard.of(step, opt.exp_avg, opt.exp_avg_sq, params=param)
        z.staged = Staged(step, param, own, None)
        z.staged.replicas = z.replicate(comm, own, abort)
    else:
        own = Shard(step, opt.exp_avg, opt.exp_avg_sq, None, param)
        z.staged = Staged(step, param, own, None)
    return norm


def stage_unchanged(
    z: ShardState, comm: Communicator, step: int, *, abort: Callable[[], bool]
) -> None:
    """Stage step ``step`` as one that changes nothing (a non-finite step, a skipped one): the
    live shard under the step's number, staged, replicated on a snapshot step and committed
    like any other, so that every rank's committed step and every replica's move on alike."""
    own = z.own
    assert own is not None
    staged, param, live_chunk = z.holding.unchanged(z)
    moments = own.exp_avg.clone(), own.exp_avg_sq.clone()
    if z.is_snapshot(step):
        shard = Shard.of(step, *moments, params=param if z.keeps_params else None)
        z.staged = Staged(step, staged, shard, None)
        z.staged.replicas = z.replicate(comm, shard, abort)
    else:
        live = Shard(step, *moments, None, param if live_chunk else None)
        z.staged = Staged(step, staged, live, None)


def _staged_optimizer(z: ShardState, step: int) -> FlatOptimizer:
    """An optimizer over copies of the live moments: the live ones stay put until the commit."""
    assert z.own is not None
    opt = FlatOptimizer(0, z.hyper)
    opt.exp_avg, opt.exp_avg_sq = z.own.exp_avg.clone(), z.own.exp_avg_sq.clone()
    opt.step_count = step - 1
    return opt


def _whole_clip(
    z: ShardState, reduced: torch.Tensor, count: float, clip: Clip, *, measure: bool
) -> tuple[float, float | None]:
    """Gradient clipping where this rank holds the whole sums (``reduced``, rank-major): the
    whole model's mean gradient back in flat order (the same numbers, in the same order, as
    replicated data parallelism takes its norm over), and the norm (None unless clipping or
    ``measure`` asks for it)."""
    if not (clip.max_norm or measure):
        return 1.0, None
    n = z.flat.numel
    flat = reduced.new_zeros(n + 1)
    flat.index_copy_(0, z.index, reduced)  # padding (zeros) lands on index n
    return clip_and_norm(
        flat[:n].div_(count), clip.max_norm, clip.ties, segments=clip.segments, measure=measure
    )


def _pruned_whole(
    z: ShardState, step: int, gathered: torch.Tensor, param: torch.Tensor
) -> torch.Tensor:
    """Pruning on the whole updated parameters (every rank holds them after the all-gather, so
    every rank takes the same decisions, as replicated data parallelism does): ``gathered`` back
    in flat order, pruned against the parameters before the update (still the live ones), then
    rank-major again; this rank's updated chunk ``param`` takes its part."""
    assert z.prune is not None
    whole = padded(z.flat.data).clone()
    whole.index_copy_(0, z.index, gathered)  # padding lands in the extra slot
    z.prune.after(step, Spans(z.flat.data), Spans(whole[:-1]), lr=z.hyper.lr_at(step))
    out = whole[z.index]
    param.copy_(out.view(len(z.workers), z.size)[z.rank])
    return out


def _pruned_chunk(
    z: ShardState,
    holding: ShardedParams,
    comm: Communicator,
    step: int,
    param: torch.Tensor,
    *,
    abort: Callable[[], bool],
) -> None:
    """Pruning on the updated chunk ``param``. No rank holds the whole parameters: each layer
    with groups is gathered whole, before and after the update, for its groups' sums (the
    numbers replicated data parallelism takes, on every rank alike, whatever the layout); the
    decisions then apply to this rank's elements, each as
    :meth:`~elaswave.runtime.prunehook.Decisions.apply` computes it for a whole group."""
    prune, old = z.prune, holding.params(z)
    assert prune is not None
    prune.to(param.device)

    def spans(layer: int) -> tuple[Spans, Spans]:
        cut = holding.cuts[layer]
        before = holding.gather_layer(z, comm, old, cut, abort=abort)
        after = holding.gather_layer(z, comm, param, cut, abort=abort)
        return Spans(before, cut.offset), Spans(after, cut.offset)

    lr = z.hyper.lr_at(step)
    decisions = prune.decide(step, prune.sums(spans, lr), lr)
    for start, count, part in prune.rows():
        cut = holding.cuts[part.layer]
        if part.layer not in holding.positions:  # once per layout, not every pruning step
            holding.positions[part.layer] = cut.positions(z.rank).to(param.device)
        at = holding.positions[part.layer][part.index - cut.offset]
        mine = at >= 0
        if not bool(mine.any()):
            continue
        group = torch.arange(start, start + count, device=param.device).unsqueeze(1)
        group = group.expand_as(at)[mine]
        at = at[mine]
        param[at] = decisions.apply(old[at], param[at], group)


def shard_clip(
    z: ShardState,
    comm: Communicator,
    mean: torch.Tensor,
    max_norm: float,
    *,
    ties: Sequence[tuple[slice, slice]],
    segments: Sequence[tuple[int, int]],
    measure: bool,
    abort: Callable[[], bool],
) -> tuple[float, float | None]:
    """Gradient clipping where each rank holds only its part of the mean gradient (``mean``, in
    this rank's shard layout): the global norm from every rank's per-layer squares
    (:func:`shard_sumsq` over ``segments``, the layers), summed by an all-reduce, so every rank
    asks or none. (clip factor, norm; None unless clipping or ``measure``)."""
    if not (max_norm or measure):
        return 1.0, None
    assert z.layout is not None
    pieces = z.layout.pieces(z.rank)
    if z.clip_runs is None:  # once per layout: every step's clip reads the same runs
        z.clip_runs = layer_runs(pieces, segments)
    squares = shard_sumsq(mean, pieces, segments, runs=z.clip_runs, ties=ties)
    if not z.norm_share:
        squares.zero_()
    comm.allreduce(DP, squares, abort)
    norm = global_norm(squares)
    return (clip_scale(norm, max_norm) if max_norm else 1.0), norm


def commit_barrier(comm: Communicator, abort: Callable[[], bool]) -> None:
    """Step 4's barrier: it returns on a rank only once every rank of the plan staged (and
    replicated) the step."""
    comm.allreduce(DP, torch.ones(1, device=comm.device), abort)


def layer_runs(
    pieces: Sequence[Range], segments: Sequence[tuple[int, int]]
) -> list[tuple[int, int]]:
    """Where each layer (``segments``: (offset, length)) lies in a shard laid out as ``pieces``:
    one run (start, stop) of the shard per layer, since the pieces come in flat order (empty:
    (0, 0))."""
    out = []
    for offset, length in segments:
        spans = overlaps(pieces, offset, length)
        out.append((spans[0][2], spans[-1][2] + spans[-1][1]) if spans else (0, 0))
    return out


def shard_sumsq(
    part: torch.Tensor,
    pieces: Sequence[Range],
    segments: Sequence[tuple[int, int]],
    *,
    runs: Sequence[tuple[int, int]],
    ties: Sequence[tuple[slice, slice]] = (),
) -> torch.Tensor:
    """A rank's part of each layer's squared gradient norm (float64; the second copy of a tied
    weight left out, as :func:`~elaswave.runtime.optim.layer_sumsq` does): ``part`` is the rank's
    shard of the mean gradient, laid out as ``pieces``, ``segments`` the layers' (offset, length)
    and ``runs`` where each lies in the shard (:func:`layer_runs`). Summed over the ranks, the
    squares the global norm is taken from."""
    sq = torch.zeros(len(segments), dtype=torch.float64, device=part.device)
    for i, (lo, hi) in enumerate(runs):
        if hi > lo:
            sq[i] = torch.linalg.vector_norm(part[lo:hi], dtype=torch.float64).square()
    starts = [offset for offset, _ in segments]
    for _, b in ties:
        i = bisect.bisect_right(starts, b.start) - 1
        for _, n, pos in overlaps(pieces, b.start, b.stop - b.start):
            sq[i] -= torch.linalg.vector_norm(part[pos : pos + n], dtype=torch.float64).square()
    return sq
