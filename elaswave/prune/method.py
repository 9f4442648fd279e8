"""What a pruning method is to the :class:`~elaswave.prune.pruner.Pruner`: one step's choice from
every group's statistics, and the state it keeps between steps.

The pruner owns the state (each group's mark and the step the newest marks were chosen at),
takes every group's statistics, and carries the state through snapshots, joins and
checkpoints; a method only decides. Each method's decisions are a pure function of the step,
the statistics (float64, the same on every rank) and the marks, so every rank takes the same
ones at every world size, and a redone step takes them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from elaswave.runtime.prunehook import Decisions

if TYPE_CHECKING:
    from elaswave.prune.dhspg import Stats

__all__ = ["Choice", "Method", "no_marks"]


@dataclass(frozen=True)
class Choice:
    """One step's choice: the decisions, the marks after the step (CPU, int64) and the step
    they were chosen at (0: none yet), and the method's own numbers for the step's metrics."""

    decisions: Decisions
    marks: torch.Tensor
    taken_at: int
    numbers: dict[str, int]


class Method(Protocol):
    """A pruning method: DHSPG (:class:`~elaswave.prune.dhspg.DHSPG`) or HESSO
    (:class:`~elaswave.prune.hesso.HESSO`)."""

    @property
    def first_step(self) -> int:
        """The first step that prunes (before it, training is exactly as without pruning)."""
        ...

    def decide(
        self,
        step: int,
        stats: Stats,
        *,
        marks: torch.Tensor,
        taken_at: int,
        sizes: torch.Tensor,
        lr: float,
    ) -> Choice:
        """Step ``step``'s choice from every group's ``stats`` (``sizes``: each group's
        element count, float64; ``lr``: the step's learning rate), the ``marks`` chosen so far
        and the step they were chosen at."""
        ...

    def kept(self, marks: torch.Tensor, taken_at: int, step: int) -> tuple[torch.Tensor, int]:
        """The marks of a state at ``step``: those chosen after ``step`` dropped (the steps that
        choose them are ahead), and the step the rest were chosen at."""
        ...


def no_marks() -> torch.Tensor:
    """The marks before any are chosen."""
    return torch.zeros(0, dtype=torch.int64)
