"""The pruning hook: what the train state and the strategies call on a rank's pruner.

Structured pruning (``train.prune``) changes the parameters after each update. The runtime knows
it only through :class:`PruneHook`; the concrete pruner (:class:`elaswave.prune.pruner.Pruner`)
is built outside the runtime, by the process that puts a worker together, and handed to
:meth:`TrainState.build <elaswave.runtime.state.TrainState.build>` as a :data:`PruneFactory`.
So the runtime never imports the pruning package, and pruning may import the runtime's leaf
modules (the workload's group types, the flat spans).

A strategy that holds the whole model calls :meth:`PruneHook.before` and :meth:`PruneHook.after`
around its update; a pipeline stage passes a :class:`Holding` (which layers it updates, which
sums it brings, how they are added over the ranks); a strategy that holds no layer whole
(ZeRO-3) gathers each layer for :meth:`PruneHook.sums` and applies :meth:`PruneHook.decide`'s
:class:`Decisions` to the elements it owns, part by part (:meth:`PruneHook.rows`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from elaswave.config import JobConfig
from elaswave.runtime.optim import Spans
from elaswave.runtime.workload.base import KeyedLayers, Workload

__all__ = ["WHOLE", "Decisions", "Holding", "Part", "PruneFactory", "PruneHook"]


@dataclass(frozen=True)
class Part:
    """One family's elements in one layer: ``(count, k)`` flat offsets (the whole model's
    layout), a slice of each group."""

    layer: int
    index: torch.Tensor


@dataclass(frozen=True)
class Holding:
    """What a rank reads and writes of the groups: the layers whose parts it updates
    (``held``), those whose sums it brings (``counted``: every layer by exactly one rank), and
    how every rank's sums are added (``reduce``, in place; None: this rank counts them all)."""

    held: Callable[[int], bool]
    counted: Callable[[int], bool]
    reduce: Callable[[torch.Tensor], None] | None = None


WHOLE = Holding(held=lambda _: True, counted=lambda _: True)  # the whole model, alone


@dataclass(frozen=True)
class Decisions:
    """One pruning step's decisions for every group, the same on every rank: a group's elements
    become ``keep * h - pull * x`` (``x`` before the update, ``h`` after it; float64 factors per
    group, None: ``keep`` 1 and ``pull`` 0, so that ``h`` is taken as it is), or exactly zero
    where ``cleared``."""

    cleared: torch.Tensor
    pull: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    def apply(self, x: torch.Tensor, h: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """Elements ``x`` and ``h`` after the decisions; ``group`` holds each element's group
        number, broadcast against them (a column ``(G, 1)`` for a matrix of whole groups)."""
        out = h if self.keep is None else self.keep[group].to(h.dtype) * h
        if self.pull is not None:
            out = out - self.pull[group].to(h.dtype) * x
        return out.masked_fill(self.cleared[group], 0.0)


class PruneHook(Protocol):
    """A rank's pruning, as the runtime drives it (every decision is the same on every rank)."""

    @property
    def last(self) -> dict[str, Any]:
        """The last pruning step's numbers, for the step's metrics."""
        ...

    def active(self, step: int) -> bool:
        """Whether step ``step`` prunes (before it, training is exactly as without pruning)."""
        ...

    def before(self, step: int, params: Spans) -> Spans | None:
        """A copy of the parameters before the update, where step ``step`` prunes."""
        ...

    def after(
        self, step: int, old: Spans | None, params: Spans, *, lr: float, holding: Holding = WHOLE
    ) -> None:
        """Prune ``params`` (just updated from ``old``; the parts ``holding`` holds) in place."""
        ...

    def to(self, device: torch.device) -> None:
        """Keep the groups' indices on ``device`` (where the parameters are)."""
        ...

    def rows(self) -> Iterator[tuple[int, int, Part]]:
        """Every part with its family's groups: (the first group's number, their count)."""
        ...

    def sums(self, spans: Callable[[int], tuple[Spans, Spans] | None], lr: float) -> torch.Tensor:
        """Each part's statistics, a layer at a time in layer order: ``spans(layer)`` gives the
        parameters before and after the update that hold the layer's parts (None: this rank
        does not count it)."""
        ...

    def decide(self, step: int, sums: torch.Tensor, lr: float) -> Decisions:
        """Step ``step``'s decisions from every part's sums (added over the ranks)."""
        ...

    def saved(self) -> torch.Tensor:
        """The pruning state a checkpoint keeps beside the parameters."""
        ...

    def adopt(self, saved: torch.Tensor | None, step: int) -> None:
        """Take a checkpoint's (or a peer's) :meth:`saved` state for a state at ``step``."""
        ...

    def share(
        self, comm: Any, step: int, broken: Callable[[], bool], *, device: torch.device
    ) -> int:
        """After a plan's sync to ``step``: every rank takes the same pruning state (a newcomer
        has none). Returns the step that state was chosen at (0: none yet)."""
        ...


# What builds a rank's pruning hook from the job's config, its workload and its layers (None:
# the job does not prune).
PruneFactory = Callable[[JobConfig, Workload, KeyedLayers], PruneHook | None]
