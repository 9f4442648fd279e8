"""HESSO (Hybrid Efficient Structured Sparse Optimizer, OTOv3) as pure functions over groups.

ElasWave's own AdamW / SGD update runs first, as without pruning; HESSO then acts on the
updated groups by a schedule of the step alone. From ``start`` on, ``pruning_steps`` are cut into
``periods`` periods of ``length`` steps (:class:`Schedule`). The first step of a period picks the
next share of the groups, those of lowest saliency among the groups not picked yet
(:func:`saliency`, :func:`pick`); on each step of the period the picked groups are scaled by
``(length - 1 - j) / (length - j)`` (``j``: the step's place in the period, from 0), which
shrinks them linearly and leaves them exactly zero on the period's last step
(:func:`keep_factor`). A group picked in an earlier period stays zero; the others train as
without pruning. After the last period ``ceil(target * groups)`` groups are zero (:func:`quota`).

Each group's mark is the period that picked it (1 for the first, 0: not picked). The saliency is
read on a period's first step only, from the statistics DHSPG takes (``|x|``, ``<x, d>``, ``|d|``;
``x`` the group before the update, ``d = (x - h) / lr`` its update direction): float64, the same
on every rank whatever the world size. Everything else is a function of the step and the marks.

Where this differs from the reference code (``only_train_once/optimizer/hesso.py``):

- the first period begins at ``start_step`` itself and shrinks its groups over all of its steps
  (the reference begins the step after ``start_pruning_step``, and its counter zeroes the
  groups one step before the period's end);
- the groups picked by the end of period ``k`` of ``P`` are ``ceil(target * N) * k // P``
  (the reference gives ``int(target * N) // P`` to each period and the rest to the last), so
  that the sparsity reached is at least the target, as DHSPG's is;
- a period picks the lowest saliency among the groups not picked yet, ties to the lower index
  (the reference takes the lowest indices of the lowest scores over all groups);
- the update direction ``d`` is ElasWave's, weight decay included (as DHSPG's, see
  :mod:`~elaswave.prune.dhspg`);
- with ``uniform``, each family picks its own share (the same number in every layer).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elaswave.prune.dhspg import SAFE, Stats
from elaswave.prune.method import Choice, no_marks
from elaswave.runtime.prunehook import Decisions

__all__ = ["HESSO", "Schedule", "keep_factor", "pick", "quota", "saliency"]

# The reference's default saliency: five criteria, each normalised over all groups, equally
# weighted (only_train_once/optimizer/hesso.py, importance_score_criteria='default').
WEIGHT = 0.2


@dataclass(frozen=True)
class Schedule:
    """When HESSO's periods run: ``periods`` periods of ``length`` steps from step ``start``."""

    start: int
    length: int
    periods: int

    @classmethod
    def of(cls, start: int, steps: int, periods: int) -> Schedule:
        """``steps`` pruning steps from ``start`` cut into ``periods`` periods (the steps left
        over by the division are plain steps after the last period)."""
        return cls(start, steps // periods, periods)

    @property
    def end(self) -> int:
        """The last period's last step: every picked group is zero after it."""
        return self.start + self.periods * self.length - 1

    def begins(self, period: int) -> int:
        """The first step of ``period`` (1 for the first)."""
        return self.start + (period - 1) * self.length

    def at(self, step: int) -> tuple[int, int] | None:
        """(the period ``step`` lies in, from 1; its place in it, from 0); None before the
        first period or after the last."""
        if not self.start <= step <= self.end:
            return None
        period, place = divmod(step - self.start, self.length)
        return period + 1, place

    def begun(self, step: int) -> int:
        """How many periods have begun by ``step``."""
        if step < self.start:
            return 0
        return min(self.periods, (step - self.start) // self.length + 1)


def quota(groups: int, target: float, periods: int, period: int) -> int:
    """How many of ``groups`` are picked by the end of ``period`` (from 1) of ``periods``: an
    even share of ``ceil(target * groups)`` per period, at most all but one."""
    total = min(groups - 1, math.ceil(groups * target - 1e-9))
    return max(total, 0) * period // periods


def saliency(stats: Stats, sizes: torch.Tensor) -> torch.Tensor:
    """Each group's saliency (float64; low: the first to prune), the reference's default: the
    mean of five criteria, each divided by its norm over all groups: the magnitude ``|x|``, the
    mean magnitude ``|x| / size``, the cosine of ``x`` and ``d`` plus 1, and the first- and
    second-order Taylor terms ``|<x, d>|`` and ``<x, d>^2 / 2``."""
    terms = (
        stats.xn,
        stats.xn / (sizes + 1e-6),
        stats.xd / (stats.xn + SAFE) / (stats.dn + SAFE) + 1.0,
        stats.xd.abs(),
        0.5 * stats.xd**2,
    )
    score = torch.zeros_like(stats.xn)
    for term in terms:
        score = score + term * (WEIGHT / ((term * term).sum() + SAFE).sqrt().add(SAFE))
    return score


def pick(
    score: torch.Tensor,
    marks: torch.Tensor,
    period: int,
    *,
    target: float,
    periods: int,
    buckets: Sequence[int],
) -> torch.Tensor:
    """The marks after ``period`` (from 1) picks its groups: the marks of this period and later
    ones dropped (a redone first step picks again), then in each bucket of consecutive groups
    (``buckets``: their sizes) the groups not picked yet with the lowest ``score`` (ties: the
    lower index), as many as bring the bucket to its :func:`quota`."""
    marks = torch.where(marks >= period, torch.zeros_like(marks), marks)
    start = 0
    for n in buckets:
        free = marks[start : start + n] == 0
        want = quota(n, target, periods, period) - int((~free).sum())
        if want > 0:
            inf = torch.full_like(score[start : start + n], math.inf)
            masked = torch.where(free.to(score.device), score[start : start + n], inf)
            order = torch.sort(masked, stable=True).indices[:want].cpu()
            marks[start + order] = period
        start += n
    return marks


def keep_factor(length: int, place: int) -> float:
    """What the groups a period shrinks are scaled by on its step ``place`` (from 0) of
    ``length``: ``(length - 1 - place) / (length - place)``, so that after ``j + 1`` steps a group
    is ``(length - 1 - j) / length`` of what the updates alone make it, and 0 after the last."""
    return (length - 1 - place) / (length - place)


@dataclass(frozen=True)
class HESSO:
    """HESSO as a :class:`~elaswave.prune.method.Method`."""

    target: float
    schedule: Schedule
    buckets: tuple[int, ...] | None = None  # uniform: each family's group count

    @property
    def first_step(self) -> int:
        return self.schedule.start

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
        """A period's first step picks its groups; every step of it scales them by
        :func:`keep_factor` (the last one clears them), and clears the groups of the periods
        before it."""
        del lr  # HESSO's steps are the optimizer's; only the saliency reads the direction
        device = stats.xn.device
        groups = stats.xn.numel()
        if marks.numel() != groups:
            marks = torch.zeros(groups, dtype=torch.int64)
        where = self.schedule.at(step)
        if where is not None and where[1] == 0:
            marks = pick(
                saliency(stats, sizes), marks, where[0], target=self.target,
                periods=self.schedule.periods, buckets=self.buckets or (groups,),
            )  # fmt: skip
            taken_at = step
        period = where[0] if where is not None else self.schedule.periods + 1
        on = marks.to(device)
        shrinking = on == period
        cleared = (on >= 1) & (on < period)
        keep = None
        if where is not None:
            factor = keep_factor(self.schedule.length, where[1])
            if factor == 0.0:
                cleared = cleared | shrinking
            else:
                keep = torch.where(
                    shrinking,
                    torch.full_like(stats.xn, factor),
                    torch.ones_like(stats.xn),
                )
        return Choice(
            Decisions(cleared, keep=keep), marks, taken_at,
            {"prune_shrinking": int(shrinking.sum()) if keep is not None else 0},
        )  # fmt: skip

    def kept(self, marks: torch.Tensor, taken_at: int, step: int) -> tuple[torch.Tensor, int]:
        """The marks of the periods begun by ``step`` that the marks hold."""
        if taken_at == 0 or marks.numel() == 0:
            return no_marks(), 0
        held = min(self.schedule.begun(taken_at), self.schedule.begun(step))
        if held == 0:
            return no_marks(), 0
        return torch.where(marks > held, torch.zeros_like(marks), marks), self.schedule.begins(held)
