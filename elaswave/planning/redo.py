"""Which micro-batches a recovery computes again: only those that no survivor kept.

A fault in the middle of a step used to throw the whole step away. The micro-batches a rank
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

from collections.abc import Collection, Sequence

from elaswave.planning.plan import assign_microbatches

__all__ = ["redo_shares"]


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
    cursor = 0
    for r, n in zip(keepers, counts, strict=True):
        out[r] = tuple(lost[cursor : cursor + n])
        cursor += n
    return tuple(out)
