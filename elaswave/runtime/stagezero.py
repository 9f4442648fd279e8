"""ZeRO-1 inside pipeline stages: the state a rank keeps, and the tensors that move.

The layout is pure (:mod:`elaswave.runtime.stageshards`): the layers a group of data-parallel
ranks holds form a *block*; its Adam moments are cut into one part per holder and every part is
kept, and updated, by two holders. This module holds the tensors: a :class:`MomentStore` with
the moments of exactly the kept intervals (compact: a rank allocates ~2/k of its stage's
moments, not the whole model's), the update of the kept elements, and the messages of the
per-step parameter gather and of a relayout. Communication stays with the caller
(:class:`elaswave.runtime.pipeline.Pipeline`).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch

from elaswave.runtime.optim import AdamWHyper, adamw_
from elaswave.runtime.stageshards import Interval, Piece, merge

TAG_PARAM, TAG_MOMENT = 4, 5
Message = tuple[int, torch.Tensor, int]  # (peer, tensor, tag)


class MomentStore:
    """Adam's two moments for a set of flat element intervals, stored back to back."""

    def __init__(self, intervals: Sequence[Interval] = ()) -> None:
        self.intervals = merge(intervals)
        self._starts = [a for a, _ in self.intervals]
        self._base: list[int] = []
        total = 0
        for a, b in self.intervals:
            self._base.append(total)
            total += b - a
        self.exp_avg = torch.zeros(total, dtype=torch.float32)
        self.exp_avg_sq = torch.zeros(total, dtype=torch.float32)

    @property
    def numel(self) -> int:
        return self.exp_avg.numel()

    @property
    def nbytes(self) -> int:
        return 2 * self.numel * self.exp_avg.element_size()

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

    def packed(self, start: int, stop: int) -> torch.Tensor:
        """``[exp_avg | exp_avg_sq]`` of ``start:stop``: one message."""
        m, v = self.view(start, stop)
        return torch.cat([m, v])

    def unpack(self, start: int, stop: int, payload: torch.Tensor) -> None:
        m, v = self.view(start, stop)
        k = stop - start
        m.copy_(payload[:k])
        v.copy_(payload[k:])

    def fill_from(self, other: MomentStore) -> None:
        """Copy every element both stores keep from ``other``."""
        for a, b in self.intervals:
            for c, d in other.intervals:
                lo, hi = max(a, c), min(b, d)
                if lo < hi:
                    m, v = self.view(lo, hi)
                    om, ov = other.view(lo, hi)
                    m.copy_(om)
                    v.copy_(ov)

    def update(
        self, params: torch.Tensor, grad: torch.Tensor, step: int, hyper: AdamWHyper
    ) -> None:
        """AdamW on every kept element (element-wise: the other keeper of a part computes the
        same bits from the same all-reduced gradient)."""
        for a, b in self.intervals:
            m, v = self.view(a, b)
            adamw_(params[a:b], grad[a:b], m, v, step, hyper)


def gather_messages(
    pieces: Sequence[Piece], rank: int, params: torch.Tensor
) -> tuple[list[Message], list[Message], list[Piece]]:
    """This rank's sends and receive buffers of a parameter gather, and the pieces received."""
    sends = [(p.dst, params[p.start : p.stop], TAG_PARAM) for p in pieces if p.src == rank]
    mine = [p for p in pieces if p.dst == rank]
    recvs = [(p.src, torch.empty(p.stop - p.start), TAG_PARAM) for p in mine]
    return sends, recvs, mine


def moment_messages(
    pieces: Sequence[Piece], rank: int, store: MomentStore
) -> tuple[list[Message], list[Message], list[Piece]]:
    """This rank's sends (copies of kept moments) and receive buffers of a moment relayout."""
    sends = [(p.dst, store.packed(p.start, p.stop), TAG_MOMENT) for p in pieces if p.src == rank]
    mine = [p for p in pieces if p.dst == rank]
    recvs = [(p.src, torch.empty(2 * (p.stop - p.start)), TAG_MOMENT) for p in mine]
    return sends, recvs, mine
