"""Which micro-batches a recovery computes again: only those that no survivor kept.

A fault in the middle of a step need not throw the whole step away. The micro-batches a rank
finished are sums in its own gradient accumulator, which no collective writes into, so a
survivor keeps them through the failed reduction (see
:class:`~elaswave.runtime.strategies.replicated.Replicated`). When the next plan is applied, its
ranks say which micro-batches of the interrupted step they keep; the ones nobody keeps (those of
the ranks that died, or that lost their sums) are shared out among the ranks that keep some, in
proportion to their shares in the new plan (which follow the measured speeds), and the step is
reduced and committed once. Ranks that keep nothing (a newcomer) compute nothing until the next
step.

The global batch, each micro-batch's random numbers and the 1/B scale are unchanged: every
micro-batch is computed exactly once across the ranks' sums, only by other ranks than planned.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from elaswave.planning.plan import assign_microbatches

__all__ = ["StageRedo", "redo_shares", "stage_redo"]


def redo_shares(
    total: int, kept: Sequence[Collection[int] | None], weights: Sequence[float]
) -> tuple[tuple[int, ...], ...] | None:
    """What each rank computes of a step that ``total`` micro-batches (indices ``0..total-1``)
    make up, when rank ``r`` keeps the finished micro-batches ``kept[r]`` (``None``: it keeps
    nothing usable) and has plan weight ``weights[r]``.

    Returns, per rank, the micro-batch indices it computes (ascending; the lost ones split in
    contiguous runs, in rank order, largest remainder by weight among the ranks that keep
    something); ``None`` when the whole step must be computed as planned: nobody keeps anything,
    or the kept sets are not disjoint subsets of the step (they cannot be combined safely)."""
    if len(kept) != len(weights):
        raise ValueError(f"{len(kept)} kept sets for {len(weights)} ranks")
    keepers = [r for r, k in enumerate(kept) if k]
    if not keepers:
        return None
    seen: set[int] = set()
    for r in keepers:
        mine = set(kept[r] or ())
        if seen & mine or not all(0 <= i < total for i in mine):
            return None
        seen |= mine
    lost = [i for i in range(total) if i not in seen]
    share = [max(float(weights[r]), 0.0) for r in keepers]
    if sum(share) <= 0:
        share = [1.0] * len(keepers)
    counts = assign_microbatches(len(lost), share) if lost else (0,) * len(keepers)
    out: list[tuple[int, ...]] = [()] * len(kept)
    for r, run in zip(keepers, _runs(lost, counts), strict=True):
        out[r] = run
    return tuple(out)


def _runs(lost: Sequence[int], counts: Sequence[int]) -> list[tuple[int, ...]]:
    """``lost`` cut in contiguous runs of ``counts`` (which add up to its length), in order."""
    out, cursor = [], 0
    for n in counts:
        out.append(tuple(lost[cursor : cursor + n]))
        cursor += n
    return out


@dataclass(frozen=True)
class StageRedo:
    """An interrupted pipeline step, agreed from every rank's kept sums: for each layer the
    micro-batches whose gradient some survivor keeps (``kept[layer]``), and per replica of the
    new plan the micro-batches it computes again (``shares[d]``, ascending). A replica computes
    a micro-batch whole (every stage's forward and backward) but adds its gradient only to the
    layers that do not keep it, and its loss only when the last layer does not."""

    kept: tuple[frozenset[int], ...]
    shares: tuple[tuple[int, ...], ...]

    @property
    def redone(self) -> tuple[int, ...]:
        return tuple(sorted(i for share in self.shares for i in share))


def stage_redo(
    total: int,
    layers: int,
    kept: Sequence[Mapping[int, Collection[int]] | None],
    *,
    split: Callable[[int], Sequence[int]],
) -> StageRedo | None:
    """What the replicas of a pipeline plan compute of a step of ``total`` micro-batches over
    ``layers`` layers, when rank ``r`` keeps, for each layer it holds, the gradient sums of the
    micro-batches ``kept[r][layer]`` (``None``: nothing usable); ``split(n)`` says how many of
    ``n`` micro-batches each replica of the new plan runs (the plan's balance: a replica's
    1F1B time, its bubble included; 0 for one out of service).

    A micro-batch is computed again when some layer keeps none of its gradient; the lost ones
    are handed out in contiguous runs, in replica order. ``None`` when the whole step must be
    computed as planned: nobody keeps anything, or a layer's kept sets overlap (they could not
    be combined)."""
    per_layer: list[set[int]] = [set() for _ in range(layers)]
    anything = False
    for mine in kept:
        for layer, ids in (mine or {}).items():
            ids = set(ids)
            if not 0 <= layer < layers or not all(0 <= i < total for i in ids):
                return None
            if per_layer[layer] & ids:
                return None
            per_layer[layer] |= ids
            anything = anything or bool(ids)
    if not anything:
        return None
    lost = [i for i in range(total) if any(i not in k for k in per_layer)]
    counts = split(len(lost))
    if sum(counts) != len(lost) or min(counts, default=0) < 0:
        raise ValueError(f"split({len(lost)}) gave {list(counts)}")
    return StageRedo(tuple(frozenset(k) for k in per_layer), tuple(_runs(lost, counts)))
