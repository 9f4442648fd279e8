"""DHSPG (Dual Half-Space Projected Gradient, OTOv2) as pure functions over group matrices.

ElasWave's own AdamW / SGD update runs first, as without pruning; DHSPG then adjusts the
parameters of the zero-invariant groups from three things per group: ``x`` (the group before the
update), ``h`` (after it) and the step's learning rate. The descent direction is
``d = (x - h) / lr``. Every decision is a function of these numbers alone, taken on the whole
model's parameters in a fixed order, so every rank takes the same ones whatever the world size.

Where this differs from OTOv2's reference code (``only_train_once/optimizer/dhspg.py``):

- the direction is that of ElasWave's update, weight decay included (OTOv2 recomputes its own
  Adam direction, with first moments that start at the first gradient, not at zero);
- norms and inner products are taken in float64, each a sum of per-layer sums added in layer
  order, so a pipeline (whose stages hold different layers) takes the same numbers;
- when a half-space projection would zero more groups than ``target + tolerance`` allows, the
  groups projected are those that cross the half-space furthest (smallest ``<h, x> / |x|^2``,
  then the lower index), not a random subset: the choice must be the same on every rank and in
  a redone step;
- with ``uniform``, each family picks its own share of redundant groups (the same number in
  every layer), so that a compressed model has one width per kind.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from elaswave.prune.method import Choice, no_marks
from elaswave.runtime.prunehook import Decisions

__all__ = [
    "DHSPG", "Hyper", "Stats", "decide", "group_stats", "lambdas", "part_sums", "partition",
]  # fmt: skip

SAFE = 1e-8  # OTOv2's safe guard in x / |x|


@dataclass(frozen=True)
class Hyper:
    target: float
    tolerance: float
    epsilon: float
    lmbda: float
    lmbda_amplify: float
    hat_lmbda_coeff: float

    @property
    def upper(self) -> float:
        return min(self.target + self.tolerance, 0.999)


@dataclass
class Stats:
    """Per-group float64 numbers of one step: ``|x|``, ``<x, d>``, ``|d|``, ``<h, x>``."""

    xn: torch.Tensor
    xd: torch.Tensor
    dn: torch.Tensor
    hx: torch.Tensor

    @property
    def zero(self) -> torch.Tensor:
        return self.xn == 0

    @classmethod
    def cat(cls, parts: Sequence[Stats]) -> Stats:
        """The statistics of several families' groups, one after another."""
        return cls(*(torch.cat([getattr(s, f.name) for s in parts]) for f in fields(cls)))

    @classmethod
    def of_sums(cls, sums: torch.Tensor) -> Stats:
        """The statistics from :func:`part_sums` (a group's parts already added)."""
        return cls(xn=sums[:, 0].sqrt(), xd=sums[:, 2], dn=sums[:, 1].sqrt(), hx=sums[:, 3])


def part_sums(x: torch.Tensor, h: torch.Tensor, lr: float) -> torch.Tensor:
    """``(G, 4)`` float64 sums over one part of groups ``x`` (before the update) and ``h``
    (after), each ``(G, S)``: ``|x|^2``, ``|d|^2``, ``<x, d>``, ``<h, x>``. A group whose
    elements lie in several layers is the sum of its parts in layer order (:meth:`Stats.of_sums`),
    whichever ranks hold them."""
    x64, h64 = x.double(), h.double()
    d = (x64 - h64) / lr
    return torch.stack(
        [(x64 * x64).sum(dim=1), (d * d).sum(dim=1), (x64 * d).sum(dim=1), (h64 * x64).sum(dim=1)],
        dim=1,
    )


def group_stats(x: torch.Tensor, h: torch.Tensor, lr: float) -> Stats:
    """The statistics of groups ``x`` (before the update) and ``h`` (after), each ``(G, S)``."""
    return Stats.of_sums(part_sums(x, h, lr))


def partition(
    stats: Stats, sizes: torch.Tensor, upper: float, *, buckets: Sequence[int] | None = None
) -> torch.Tensor:
    """The redundant groups (bool): OTOv2's score, half the cosine of ``-x`` and ``-d`` and half
    the inverse of the mean magnitude ``|x| / size``, each normalised over all groups; the
    ``upper`` share with the highest scores (ties: the lower index), over all groups, or in
    each bucket of consecutive groups (``buckets``: their sizes) when given."""
    cos = stats.xd / (stats.xn * stats.dn).clamp_min(SAFE)
    inv = 1.0 / (stats.xn / sizes + 1e-6)
    score = 0.5 * cos / cos.norm().clamp_min(SAFE) + 0.5 * inv / inv.norm().clamp_min(SAFE)
    out = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
    start = 0
    for n in buckets or [score.numel()]:
        k = int(n * upper)
        order = torch.sort(-score[start : start + n], stable=True).indices
        out[start + order[:k]] = True
        start += n
    return out


def lambdas(stats: Stats, redundant: torch.Tensor, hp: Hyper) -> torch.Tensor:
    """Each group's penalty: ``lmbda``, raised for a redundant group whose descent direction
    points away from zero (``<x, d> < 0``) so that the step still shrinks it, within OTOv2's
    bounds."""
    lam = torch.full_like(stats.xn, hp.lmbda)
    adjust = redundant & (stats.xd < 0) & (stats.xn > 0)
    if adjust.any():
        xn, xd, dn = stats.xn[adjust], stats.xd[adjust], stats.dn[adjust]
        lower = -xd / xn
        upper = -(dn * dn * xn / xd)
        value = (hp.lmbda_amplify * lower).clamp(hp.lmbda, hp.lmbda * hp.hat_lmbda_coeff)
        over = value >= upper
        value[over] = (upper[over] + lower[over]) / 2.0
        lam[adjust] = value
    return lam


def decide(
    stats: Stats,
    redundant: torch.Tensor,
    zero_before: int,
    *,
    lr: float,
    hp: Hyper,
    project: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's decisions for all ``N`` groups: (the pull of each group, float64: a
    redundant group ``g`` becomes ``h_g - pull_g * x_g``, that is ``lr * lambda / |x|``, 0 for the
    others; which groups are projected onto zero). With ``project``, the pulled groups that
    the step carries across the half-space ``<h, x> < epsilon |x|^2``, at most as many as keep
    the sparsity within ``upper`` (``zero_before`` groups are zero now)."""
    pull = redundant & (stats.xn > 0)
    lam = lambdas(stats, redundant, hp)
    scale = torch.where(pull, lr * lam / (stats.xn + SAFE), torch.zeros_like(lam))
    projected = torch.zeros_like(pull)
    if not project:
        return scale, projected
    hx = stats.hx - scale * stats.xn**2  # <h - pull x, x>: what the half-space test reads
    candidates = torch.nonzero(pull & (hx < hp.epsilon * stats.xn**2)).flatten()
    room = max(0, math.floor(stats.xn.numel() * hp.upper) - zero_before)
    if candidates.numel() > room:  # those that cross furthest
        ratio = hx[candidates] / stats.xn[candidates] ** 2
        candidates = candidates[torch.sort(ratio, stable=True).indices[:room]]
    projected[candidates] = True
    return scale, projected


@dataclass(frozen=True)
class DHSPG:
    """DHSPG as a :class:`~elaswave.prune.method.Method`. A group's mark is 1 where it is
    redundant; the marks are chosen once, at ``partition_at``."""

    hp: Hyper
    partition_at: int
    start_step: int  # the first step that projects
    buckets: tuple[int, ...] | None = None  # uniform: each family's group count

    @property
    def first_step(self) -> int:
        return self.partition_at

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
        """The redundant set, chosen first where this step chooses it (or again, in a redo of
        that step); then each redundant group's pull while the sparsity is below the target,
        and the groups projected onto zero (:func:`decide`). A group that is zero stays zero."""
        zero = stats.zero
        zero_before = int(zero.sum())
        if taken_at == 0 or taken_at >= step:
            marks = partition(stats, sizes, self.hp.upper, buckets=self.buckets).long().cpu()
            taken_at = step
        redundant = marks.to(zero.device).bool()
        if not zero_before < self.hp.target * zero.numel():  # reached: no more pulls
            redundant = torch.zeros_like(redundant)
        scale, projected = decide(
            stats, redundant, zero_before, lr=lr, hp=self.hp, project=step >= self.start_step
        )
        return Choice(
            Decisions(projected | zero, pull=scale), marks, taken_at,
            {"prune_projected": int(projected.sum())},
        )  # fmt: skip

    def kept(self, marks: torch.Tensor, taken_at: int, step: int) -> tuple[torch.Tensor, int]:
        if taken_at == 0 or taken_at > step:
            return no_marks(), 0
        return marks, taken_at
