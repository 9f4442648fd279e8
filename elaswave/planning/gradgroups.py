"""Gradient reduction among each layer's holders: which ranks sum which gradients, and the
process groups that takes. Pure functions; no tensors, no I/O.

A pipeline rank computes the gradient of its stage's layers only, and only the ranks that hold a
layer need its sum (one per replica whose stage contains it). So each :class:`Reduction` sums
a run of layers among exactly its holders (a holder *block*,
:func:`~elaswave.planning.stageshards.holder_blocks`): a step issues one collective per holder
set, each over the bytes of its layers, instead of one all-reduce of the whole model over every
rank. Replicas cut alike give ``pp`` holder sets of ``dp`` ranks; replicas cut differently after
a takeover give a few more, each over the layers where their cuts differ.

Tied weights (one logical weight copied in two layers, say the input embedding and the output
head) are summed over the union of both layers' holders: before the reduction every rank holds
``own_a + own_b`` in the first copy's slot, so one sum over that union is the weight's whole
gradient; the second copy takes it from the first afterwards (:func:`tie_copies`).

A group is named by its members' worker ids (:func:`group_name`), so the communicator keeps a
group from one plan to the next exactly when its holder set is unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from elaswave.planning.stageshards import Block, Interval, subtract

__all__ = ["Reduction", "first_holders", "group_name", "reductions", "tie_copies"]


@dataclass(frozen=True)
class Reduction:
    """Elements ``spans`` of the flat gradient, summed among ``members`` (ranks, ascending)."""

    members: tuple[int, ...]
    spans: tuple[Interval, ...]

    @property
    def numel(self) -> int:
        return sum(b - a for a, b in self.spans)


def group_name(workers: Sequence[str]) -> str:
    """The process-group name of a holder set: the same workers in the same order, the same name
    (in every plan, on every rank)."""
    digest = hashlib.sha1("\n".join(workers).encode()).hexdigest()[:16]
    return f"grad-{digest}"


def _holders_at(blocks: Sequence[Block], element: int) -> tuple[int, ...]:
    for b in blocks:
        if b.start <= element < b.stop:
            return b.holders
    raise ValueError(f"element {element} lies in no holder block")


def reductions(
    blocks: Sequence[Block], ties: Sequence[tuple[Interval, Interval]] = ()
) -> list[Reduction]:
    """Every reduction of a layout, in element order (every rank computes the same list, so the
    collectives on a shared group are issued in the same order everywhere).

    Each block's elements are summed among its holders, except the tied copies: the first copy
    of a tied weight is summed among the holders of either copy, the second is not reduced
    (it is copied from the first, :func:`tie_copies`)."""
    tied = [a for a, _ in ties] + [b for _, b in ties]
    out = []
    for block in blocks:
        spans = subtract([(block.start, block.stop)], tied)
        if spans:
            out.append(Reduction(block.holders, tuple(spans)))
    for a, b in ties:
        members = sorted({*_holders_at(blocks, a[0]), *_holders_at(blocks, b[0])})
        out.append(Reduction(tuple(members), (a,)))
    return sorted(out, key=lambda r: r.spans[0][0])


def tie_copies(
    blocks: Sequence[Block], ties: Sequence[tuple[Interval, Interval]], rank: int
) -> list[tuple[Interval, Interval]]:
    """The (first, second) copies whose second ``rank`` holds: after the reductions it takes the
    first copy's sum (which it reduced, being in the union)."""
    return [(a, b) for a, b in ties if rank in _holders_at(blocks, b[0])]


def first_holders(blocks: Sequence[Block], segments: Sequence[tuple[int, int]]) -> list[int]:
    """The lowest-ranked holder of each layer (``-1``: an empty layer, or nobody holds it): the
    rank that counts that layer in the global gradient norm, so every layer counts once."""
    out = []
    for offset, length in segments:
        held = [b for b in blocks if b.start <= offset < b.stop]
        out.append(held[0].holders[0] if length and held else -1)
    return out
