"""What a pipeline rank keeps between steps besides its parameters: the Adam moments of the
intervals it keeps under ZeRO (:class:`MomentStore`), an asynchronous migration in progress, the
undo copy of its last update, and the small encodings of layer ranges that ranks exchange when
they agree on a new layout.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from elaswave.planning.stageshards import Interval, merge
from elaswave.runtime.optim import OptimHyper, Spans, update_


class MomentStore:
    """Adam's two moments for a set of flat element intervals, stored back to back; under
    ZeRO-3 (``params``) the parameters of those intervals too: then the store is all a rank
    keeps of its layers between steps."""

    def __init__(
        self,
        intervals: Sequence[Interval] = (),
        device: torch.device | None = None,
        params: bool = False,
    ) -> None:
        self.intervals = merge(intervals)
        self._starts = [a for a, _ in self.intervals]
        self._base: list[int] = []
        total = 0
        for a, b in self.intervals:
            self._base.append(total)
            total += b - a
        self.exp_avg = torch.zeros(total, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32, device=device)
        self.params = torch.zeros(total, dtype=torch.float32, device=device) if params else None

    @property
    def arrays(self) -> tuple[torch.Tensor, ...]:
        """What the store keeps per element: ([parameters,] exp_avg, exp_avg_sq)."""
        moments = (self.exp_avg, self.exp_avg_sq)
        return moments if self.params is None else (self.params, *moments)

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.arrays)

    def locate(self, start: int, stop: int) -> slice:
        """The compact slice of flat elements ``start:stop`` (they must lie in one interval)."""
        i = bisect_right(self._starts, start) - 1
        if i < 0 or stop > self.intervals[i][1]:
            raise KeyError(f"elements {start}:{stop} are not kept here")
        lo = self._base[i] + start - self.intervals[i][0]
        return slice(lo, lo + stop - start)

    def view(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.locate(start, stop)
        return self.exp_avg[s], self.exp_avg_sq[s]

    def views(self, start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """Every array's elements ``start:stop``, in :attr:`arrays` order."""
        s = self.locate(start, stop)
        return tuple(t[s] for t in self.arrays)

    def packed(self, start: int, stop: int) -> torch.Tensor:
        """``[params | exp_avg | exp_avg_sq]`` of ``start:stop`` (no parameters outside
        ZeRO-3): one message."""
        return torch.cat(self.views(start, stop))

    def unpack(self, start: int, stop: int, payload: torch.Tensor) -> None:
        unpack_into(payload, self.views(start, stop))

    def fill_from(self, other: MomentStore) -> None:
        """Copy every element both stores keep from ``other``."""
        for a, b in self.intervals:
            for c, d in other.intervals:
                lo, hi = max(a, c), min(b, d)
                if lo < hi:
                    for mine, theirs in zip(self.views(lo, hi), other.views(lo, hi), strict=True):
                        mine.copy_(theirs)

    def update(self, params: Spans, grad: Spans, step: int, *, hyper: OptimHyper) -> None:
        """AdamW on every kept element (element-wise: the other keeper of a part computes the
        same bits from the same all-reduced gradient): of the store's own parameters under
        ZeRO-3, else of ``params``."""
        for a, b in self.intervals:
            m, v = self.view(a, b)
            p = params[a:b] if self.params is None else self.params[self.locate(a, b)]
            update_(
                p,
                grad[a:b],
                m,
                exp_avg_sq=v,
                step=step,
                h=hyper,
                groups=hyper.groups_of(slice(a, b)),
            )


@dataclass
class Migration:
    """An asynchronous migration in progress on this rank."""

    transfers: list[Any]  # LayerTransfer, or Piece with ZeRO (for the event)
    # Flat regions this rank brings up to date by replaying the missed updates, and whether it
    # owns their parameters (False: ZeRO moments of layers it holds already; the parameters
    # come from the gather, so the replay updates a scratch copy).
    replay: list[tuple[slice, bool]]
    receivers: int  # ranks that receive something (every rank knows the same number)
    # The layers each rank holds and keeps current until the switch (replicated stage state:
    # what a durable checkpoint taken meanwhile is written from)
    held_by: list[range | None] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)
    pending: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)  # (step, grads)
    landed: list[tuple[Callable[[torch.Tensor], object], torch.Tensor]] = field(
        default_factory=list
    )  # (where it goes, payload)
    store: MomentStore | None = None  # ZeRO: the moments being brought up to date
    switch: Callable[[], None] | None = None  # ZeRO: adopt the new layout's duties
    caught_up: bool = False
    nbytes: int = 0


@dataclass
class Undo:
    """The local snapshot taken before an update: what rolling the step back restores."""

    step: int
    loss: float
    held: range | None
    # (where the live tensor is, looked up when restoring; its pre-update copy)
    saved: list[tuple[Callable[[], torch.Tensor], torch.Tensor]]
    store: MomentStore | None = None  # ZeRO: the moments it saved (a switch replaces the store)

    def restore(self) -> None:
        for live, copy in self.saved:
            live().copy_(copy)


def hull(*layers: range | None) -> range:
    """The smallest range of layers that contains every one given (empty if none is)."""
    given = [r for r in layers if r]
    if not given:
        return range(0)
    return range(min(r.start for r in given), max(r.stop for r in given))


def bounds_of(layers: range | None) -> tuple[float, float]:
    return (float(layers.start), float(layers.stop)) if layers is not None else (-1.0, -1.0)


def range_of(start: float, stop: float) -> range | None:
    return range(int(start), int(stop)) if start >= 0 else None


def unpack_into(payload: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``payload`` (``torch.cat`` of tensors shaped like
    ``targets``) into ``targets``."""
    offset = 0
    for t in targets:
        t.copy_(payload[offset : offset + t.numel()])
        offset += t.numel()
