"""How a pipeline plan's gradients are summed: the holder groups of its layout and each rank's
part of them (:class:`GradLayout`, :class:`RankGrads`), and each step's reductions: every held
layer among its holders, or, while a migration runs, every layer over every rank a chunk at a
time; either way the clipping norm is completed from the layers' first holders. Kept apart from
the strategy (:mod:`~elaswave.runtime.strategies.pipeline.strategy`), which decides which
reduction a step runs and what follows it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from elaswave.planning.gradgroups import (
    Reduction,
    first_holders,
    group_name,
    reductions,
    tie_copies,
)
from elaswave.planning.plan import Plan
from elaswave.planning.stageshards import Block, holder_blocks
from elaswave.planning.tiers import Tiers, tiers_of
from elaswave.runtime.comm.tiered import allreduce_tiered
from elaswave.runtime.optim import layer_sumsq
from elaswave.runtime.strategies.base import DP
from elaswave.runtime.strategies.sums import StepSums

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator
    from elaswave.runtime.state import TrainState

# While a migration runs the whole model's gradient is summed this many elements at a time (the
# most a rank allocates beside its window for it: 32 MiB in the float64 reduction); the final
# state is hashed in chunks of this size too.
WHOLE_CHUNK = 1 << 22


@dataclass(frozen=True)
class GradLayout:
    """How one plan's gradients are summed: the holder blocks of its layout, every reduction (in
    the order all ranks issue them) and the process group of each."""

    epoch: int
    blocks: tuple[Block, ...]
    reductions: tuple[Reduction, ...]
    names: tuple[str, ...]  # the group of each reduction ("" for a single holder: no collective)
    ties: tuple[tuple[tuple[int, int], tuple[int, int]], ...]
    # each reduction's tiers over its members (their ranks in it), None where it goes flat
    tiers: tuple[Tiers | None, ...] = ()

    @classmethod
    def of(
        cls,
        plan: Plan,
        offsets: list[tuple[int, int]],
        ties: tuple[tuple[slice, slice], ...],
        *,
        hierarchy: str = "flat",
    ) -> GradLayout:
        """The plan's reductions; ``hierarchy`` (``train.hierarchy``): auto sums each holder
        group by tiers where its members span two hosts or more and two share one."""
        targets = [plan.stage_layers(r) for r in range(plan.world_size)]
        blocks = tuple(holder_blocks(targets, offsets))
        pairs = tuple(((a.start, a.stop), (b.start, b.stop)) for a, b in ties)
        reds = tuple(reductions(blocks, pairs))
        names = tuple(
            group_name([plan.workers[r] for r in red.members]) if len(red.members) > 1 else ""
            for red in reds
        )
        tiers = tuple(
            tiers_of(
                [plan.hosts[r] for r in red.members], hierarchy if name else "flat",
                dict(plan.racks), workers=[plan.workers[r] for r in red.members], prefix=name,
            )
            for name, red in zip(names, reds, strict=True)
        )  # fmt: skip
        return cls(plan.epoch, blocks, reds, names, pairs, tiers)

    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        out = {}
        for name, red, tiers in zip(self.names, self.reductions, self.tiers, strict=True):
            if name:
                members = tuple(plan.workers[r] for r in red.members)
                out[name] = members
                if tiers is not None:
                    out.update(tiers.groups(members))
        return out

    def mine(self, rank: int) -> list[tuple[str, Reduction]]:
        """The reductions ``rank`` takes part in, in issue order."""
        return [
            (name, red)
            for name, red in zip(self.names, self.reductions, strict=True)
            if name and rank in red.members
        ]

    def of_rank(self, rank: int, segments: Sequence[tuple[int, int]]) -> RankGrads:
        """What ``rank`` does each step under this layout (computed once per plan)."""
        mine = self.mine(rank)
        tiers = dict(zip(self.names, self.tiers, strict=True))
        return RankGrads(
            self.epoch,
            mine,
            tie_copies(self.blocks, self.ties, rank),
            [first == rank for first in first_holders(self.blocks, segments)],
            {name: t for name, _ in mine if (t := tiers.get(name)) is not None},
        )


@dataclass(frozen=True)
class RankGrads:
    """One rank's part of a :class:`GradLayout`: its reductions in issue order, the tied second
    copies it fills from the first, and the layers it counts in the clipping norm."""

    epoch: int
    mine: list[tuple[str, Reduction]]
    copies: list[tuple[tuple[int, int], tuple[int, int]]]
    counted: list[bool]
    tiered: dict[str, Tiers] = field(default_factory=dict)  # the groups of ``mine`` by tiers


def chunks(total: int, size: int, lo: int, *, hi: int) -> list[tuple[int, int, int, int]]:
    """``[0, total)`` in chunks of ``size`` elements: ``(a, b, x, y)`` for each chunk ``[a, b)``
    with its overlap ``[x, y)`` with a window ``[lo, hi)`` (``x == y`` where they do not meet)."""
    out = []
    for a in range(0, total, size):
        b = min(a + size, total)
        x, y = max(a, lo), min(b, hi)
        out.append((a, b, x, y) if x < y else (a, b, a, a))
    return out


def reduce_among_holders(
    comm: Communicator,
    sums: StepSums,
    broken: Callable[[], bool],
    *,
    state: TrainState,
    mine: RankGrads | None,
    plan: Plan | None,
    second_copy: dict[tuple[int, int], tuple[int, int]],
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum each held layer's gradient among its holders, and the step's tail (loss, count,
    epochs, flag) over every rank, all at once. Returns how the clipping norm is completed:
    each rank adds the layers it is the first holder of, an all-reduce adds the rest."""
    assert mine is not None and plan is not None and mine.epoch == plan.epoch
    grads, second = state.flat.at(sums.grads), second_copy
    items: list[tuple[str, torch.Tensor]] = [(DP, sums.tail.values)]
    packed = []
    for name, red in mine.mine:
        if len(red.spans) == 1:
            ((a, b),) = red.spans
            if not grads.holds(a, b) and (a, b) in second:
                a, b = second[(a, b)]
            items.append((name, grads[a:b]))
        else:  # a block with a tied copy inside it: its other elements, packed
            t = torch.cat([grads[a:b] for a, b in red.spans])
            packed.append((red, t))
            items.append((name, t))
    tiered = [(name, t) for name, t in items if name in mine.tiered]
    comm.allreduce_many([(name, t) for name, t in items if name not in mine.tiered], broken)
    for name, t in tiered:  # after the flat ones, one by one in issue order: no cycle
        allreduce_tiered(comm, name, mine.tiered[name], tensor=t, abort=broken)
    for red, t in packed:
        offset = 0
        for a, b in red.spans:
            grads[a:b].copy_(t[offset : offset + b - a])
            offset += b - a
    for (a, b), (c, d) in mine.copies:
        if grads.holds(a, b):
            grads[c:d].copy_(grads[a:b])
    return norms(comm, broken, state=state, mine=mine)


def reduce_over_everyone(
    comm: Communicator,
    sums: StepSums,
    broken: Callable[[], bool],
    *,
    state: TrainState,
    mine: RankGrads | None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """While a migration runs: every layer's gradient summed over every rank, in chunks of
    the whole model's flat layout (each rank brings what its window holds, zeros for the
    rest), then each tied weight once (the copy a rank holds; both copies take the sum).
    The clipping norm is completed as among holders: the plan's first holders count."""
    n, flat, buf = state.flat.numel, state.flat, sums.grads
    grads = flat.at(buf)
    ties = []  # each tied weight's own sum, taken before the chunks overwrite its copies
    for first, second in state.ties:
        held = [s for s in (first, second) if grads.holds(s.start, s.stop)]
        own = grads[held[0]].clone() if held else buf.new_zeros(first.stop - first.start)
        ties.append((held, own))
    comm.allreduce(DP, sums.tail.values, broken)
    for a, b, x, y in chunks(flat.total, WHOLE_CHUNK, flat.base, hi=flat.base + n):
        chunk = buf.new_zeros(b - a)
        chunk[x - a : y - a] = grads[x:y]
        comm.allreduce(DP, chunk, broken)
        grads[x:y].copy_(chunk[x - a : y - a])
    for held, tied in ties:
        comm.allreduce(DP, tied, broken)
        for s in held:
            grads[s].copy_(tied)
    return norms(comm, broken, state=state, mine=mine)


def norms(
    comm: Communicator,
    broken: Callable[[], bool],
    *,
    state: TrainState,
    mine: RankGrads | None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """How the clipping norm is completed: each rank adds the layers it is the first holder
    of under the plan, an all-reduce adds the rest."""
    assert mine is not None

    def sumsq(mean: torch.Tensor) -> torch.Tensor:
        squares = layer_sumsq(state.flat.at(mean), state.segments, state.ties, only=mine.counted)
        comm.allreduce(DP, squares, broken)
        return squares

    return sumsq
