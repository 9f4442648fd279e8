"""Partial redo inside pipelines: what a stage keeps of a step that was not committed, and the
agreement, after a fault, on what the replicas compute again.

A stage adds each micro-batch's layer gradients into an accumulator that no collective writes
into (autograd's own gradient buffer in the float32 reduction, a float64 buffer of its layers in
the float64 one), and records, per layer, which micro-batches it holds there, with the loss of
those whose loss it counted (the last stage). A failed reduction leaves all of that in place.
When the next plan is applied, a rank whose stage kept its layers (same layers, same step, its
buffers not reallocated) offers its record; the others drop theirs. Every rank gathers the
records and derives the same :class:`~elaswave.planning.redo.StageRedo`: the micro-batches that
some layer lacks are computed again by the replicas in service, and each stage adds a redone
micro-batch's gradient only to the layers that lack it (the others run it without computing
their weight gradients), its loss only when the last layer lacks it. Every (layer,
micro-batch) gradient and every loss is then summed exactly once, as in a fault-free step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from elaswave.planning.redo import StageRedo, stage_redo

__all__ = ["StageKept", "agree", "kept_row", "masked"]


@dataclass
class StageKept:
    """What this rank's stage holds of step ``step`` in its accumulator: for each of its layers
    the micro-batch ids whose gradient is summed there (in computed order), and the loss sum
    (float64) and count of the micro-batches whose loss it counted."""

    step: int
    layers: range
    window: tuple[Any, ...]  # the accumulator's identity: its buffers must not be reallocated
    has: dict[int, list[int]] = field(default_factory=dict)
    loss: torch.Tensor | None = None
    count: int = 0

    def add(self, mb: int, kept: dict[int, frozenset[int]], loss: Any, *, count: int) -> None:
        """Micro-batch ``mb``'s backward finished: its gradient is in every layer that does not
        keep it elsewhere (``kept``), its loss counted unless the last layer keeps it."""
        for layer in self.layers:
            if mb not in kept.get(layer, ()):
                self.has.setdefault(layer, []).append(mb)
        if loss is not None:
            assert self.loss is not None
            self.loss += loss
            self.count += count


def kept_row(kept: StageKept | None, usable: bool, total: int, *, layers: int) -> list[float]:
    """This rank's record as a row for the all-gather: [usable, then for each layer and each
    micro-batch of the step 1.0 where the rank holds that gradient]."""
    row = [1.0 if usable and kept is not None else 0.0] + [0.0] * (layers * total)
    if usable and kept is not None:
        for layer, ids in kept.has.items():
            for i in ids:
                row[1 + layer * total + i] = 1.0
    return row


def agree(
    rows: Sequence[Sequence[float]],
    total: int,
    layers: int,
    *,
    split: Callable[[int], Sequence[int]],
) -> StageRedo | None:
    """Every rank's rows of :func:`kept_row` -> the redo (``None``: the whole step, as
    planned). Pure: every rank derives the same from the same rows."""
    kept: list[dict[int, list[int]] | None] = []
    for row in rows:
        if not row[0]:
            kept.append(None)
            continue
        mine = {
            layer: [i for i in range(total) if row[1 + layer * total + i]]
            for layer in range(layers)
        }
        kept.append({layer: ids for layer, ids in mine.items() if ids})
    return stage_redo(total, layers, kept, split=split)


@contextlib.contextmanager
def masked(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Run a forward without recording the weight gradients of ``layers`` (their sums for this
    micro-batch are kept on another rank): the graph still carries the input gradients through
    them, with the same values."""
    flags: list[tuple[torch.Tensor, bool]] = [
        (p, p.requires_grad) for layer in layers for p in layer.parameters()
    ]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, was in flags:
            p.requires_grad_(was)
