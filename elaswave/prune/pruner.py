"""A rank's pruning: a method (DHSPG or HESSO, :mod:`elaswave.prune.method`) applied to the
parameters it holds after each update.

The only state pruning adds is each group's mark, chosen from some step's parameters and
direction (DHSPG: the redundant set, chosen once at ``partition_step``; HESSO: the period that
picked the group): :attr:`Pruner.marks`, with :attr:`taken_at`, the step the newest marks were
chosen at. Which groups are zero is read off the parameters themselves, and everything else is
recomputed every step, so snapshots, transfers and checkpoints of the parameters carry the
rest. A newcomer receives the marks from a peer when the plan is applied (:meth:`share`), and a
durable checkpoint stores them beside the parameters (:meth:`saved`, :meth:`adopt`).

Every decision reads every group's statistics. A rank that holds the whole model takes them
alone; a pipeline stage holds some layers (:class:`Holding`): each layer's sums come from one
rank, the others bring zeros, and one all-reduce adds them (exactly: each entry has a single
non-zero term), so every rank takes the same decisions, on the same numbers as data
parallelism, whatever the cut. ZeRO-3 holds no layer whole: it gathers each layer for its sums
(:meth:`sums` asks for the parameters a layer at a time) and applies the decisions to the
elements it owns (:meth:`rows`, :meth:`decide`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.config.prune import PruneConfig
from elaswave.prune import dhspg
from elaswave.prune.dhspg import DHSPG
from elaswave.prune.groups import Family, find_groups, flat_index
from elaswave.prune.hesso import HESSO, Schedule
from elaswave.prune.method import Method, no_marks
from elaswave.runtime.optim import Spans
from elaswave.runtime.prunehook import WHOLE, Decisions, Holding, Part
from elaswave.runtime.workload.base import KeyedLayers, Workload

__all__ = ["WHOLE", "Decisions", "Holding", "Part", "Pruner", "method_of"]

DP = "dp"


def _parts(index: torch.Tensor, starts: torch.Tensor) -> list[Part]:
    """A family's flat offsets (``(count, size)``) cut by layer, in layer order (a member's
    elements lie in one layer; every group has the same members)."""
    layers = torch.searchsorted(starts, index[0], right=True) - 1
    return [Part(int(i), index[:, layers == i]) for i in torch.unique(layers).tolist()]


def _at(spans: Spans, index: torch.Tensor) -> torch.Tensor:
    return spans.tensor[index - spans.base]


def method_of(p: PruneConfig, *, buckets: tuple[int, ...] | None) -> Method:
    """The method ``p`` (resolved: every hyper-parameter set) asks for; ``buckets``: each
    family's group count where every family picks its own share (``uniform``)."""
    if p.method == "hesso":
        assert p.pruning_steps is not None and p.pruning_periods is not None
        schedule = Schedule.of(p.start_step, p.pruning_steps, p.pruning_periods)
        return HESSO(p.target_sparsity, schedule, buckets)
    assert p.lmbda is not None and p.lmbda_amplify is not None and p.hat_lmbda_coeff
    hp = dhspg.Hyper(
        p.target_sparsity, p.tolerance, p.epsilon, p.lmbda, p.lmbda_amplify, p.hat_lmbda_coeff
    )
    return DHSPG(hp, p.partition_at, p.start_step, buckets)


@dataclass(eq=False)
class Pruner:
    """A pruning method over the model's zero-invariant groups: the
    :class:`~elaswave.runtime.prunehook.PruneHook` a worker hands its train state."""

    families: list[Family]
    parts: list[list[Part]]  # each family's elements, layer by layer
    method: Method
    marks: torch.Tensor = field(default_factory=no_marks)  # each group's mark (CPU, int64)
    taken_at: int = 0  # the step the newest marks were chosen at (0: none yet)
    last: dict[str, Any] = field(default_factory=dict)  # the last step's numbers, for metrics

    @classmethod
    def build(cls, cfg: JobConfig, workload: Workload, model: KeyedLayers) -> Pruner | None:
        """The pruner ``cfg.train.prune`` asks for (None: off), over the model's groups."""
        p = cfg.train.prune
        if p is None:
            return None
        p = p.resolved(cfg.train.optimizer)
        families = find_groups(workload, model, p.kinds)
        starts = torch.tensor([offset for offset, _ in model.segments()], dtype=torch.int64)
        parts = [_parts(flat_index(f, model), starts) for f in families]
        buckets = tuple(f.count for f in families) if p.uniform else None
        return cls(families, parts, method_of(p, buckets=buckets))

    @property
    def groups(self) -> int:
        return sum(f.count for f in self.families)

    def active(self, step: int) -> bool:
        """Whether step ``step`` prunes (before it, training is exactly as without pruning)."""
        return step >= self.method.first_step

    def before(self, step: int, params: Spans) -> Spans | None:
        """A copy of the parameters before the update, where step ``step`` prunes."""
        return Spans(params.tensor.clone(), params.base) if self.active(step) else None

    def after(
        self, step: int, old: Spans | None, params: Spans, *, lr: float, holding: Holding = WHOLE
    ) -> None:
        """The method's step on ``params`` (just updated from ``old``; the parts ``holding``
        holds) in place."""
        if old is None:
            return
        self.to(params.tensor.device)
        sums = self.sums(lambda layer: (old, params) if holding.counted(layer) else None, lr)
        if holding.reduce is not None:
            holding.reduce(sums)
        decisions = self.decide(step, sums, lr)
        for start, count, p in self.rows():
            if holding.held(p.layer):
                group = torch.arange(start, start + count, device=params.tensor.device)
                at = p.index - params.base
                params.tensor[at] = decisions.apply(
                    _at(old, p.index), params.tensor[at], group.unsqueeze(1)
                )

    def to(self, device: torch.device) -> None:
        """The groups' indices on ``device`` (where the parameters are)."""
        if self.parts[0][0].index.device != device:
            self.parts = [[Part(p.layer, p.index.to(device)) for p in ps] for ps in self.parts]

    def rows(self) -> Iterator[tuple[int, int, Part]]:
        """Every part with its family's groups: (the first group's number, their count)."""
        start = 0
        for f, ps in zip(self.families, self.parts, strict=True):
            for p in ps:
                yield start, f.count, p
            start += f.count

    @property
    def layers(self) -> list[int]:
        """The layers that hold some group's elements, in order."""
        return sorted({p.layer for ps in self.parts for p in ps})

    def sums(self, spans: Callable[[int], tuple[Spans, Spans] | None], lr: float) -> torch.Tensor:
        """Each part's sums (:func:`~elaswave.prune.dhspg.part_sums`, one row per group and
        part), a layer at a time in layer order: ``spans(layer)`` gives the parameters before
        and after the update that hold the layer's parts (None: this rank does not count it;
        its rows stay zero)."""
        rows = sum(f.count * len(ps) for f, ps in zip(self.families, self.parts, strict=True))
        where, row = {}, 0
        for _, count, p in self.rows():
            where[id(p)] = row
            row += count
        sums = torch.zeros(rows, 4, dtype=torch.float64, device=self.parts[0][0].index.device)
        for layer in self.layers:
            held = spans(layer)
            if held is None:
                continue
            old, params = held
            for _, count, p in self.rows():
                if p.layer == layer:
                    at = where[id(p)]
                    sums[at : at + count] = dhspg.part_sums(
                        _at(old, p.index), _at(params, p.index), lr
                    )
        return sums

    def decide(self, step: int, sums: torch.Tensor, lr: float) -> Decisions:
        """Step ``step``'s decisions from every part's sums (added over the ranks), as the
        method takes them; the marks it chooses are kept."""
        stats = self._stats(sums)
        choice = self.method.decide(
            step, stats, marks=self.marks, taken_at=self.taken_at,
            sizes=self.sizes.to(sums.device), lr=lr,
        )  # fmt: skip
        self.marks, self.taken_at = choice.marks, choice.taken_at
        zeros = int(choice.decisions.cleared.sum())
        self.last = {
            "prune_sparsity": zeros / self.groups,
            "prune_zero_groups": zeros,
            **choice.numbers,
        }
        return choice.decisions

    @cached_property
    def sizes(self) -> torch.Tensor:
        """Each group's element count (float64)."""
        width = [sum(p.index.shape[1] for p in ps) for ps in self.parts]
        return torch.tensor(
            [w for f, w in zip(self.families, width, strict=True) for _ in range(f.count)],
            dtype=torch.float64,
        )

    def _stats(self, sums: torch.Tensor) -> dhspg.Stats:
        """Every group's statistics: a group's parts added in layer order."""
        totals, row = [], 0
        for f, ps in zip(self.families, self.parts, strict=True):
            total = sums[row : row + f.count]
            for k in range(1, len(ps)):
                total = total + sums[row + k * f.count : row + (k + 1) * f.count]
            totals.append(total)
            row += f.count * len(ps)
        return dhspg.Stats.of_sums(torch.cat(totals))

    # ---- carried state ----------------------------------------------------------------------
    def saved(self) -> torch.Tensor:
        """The marks for a checkpoint: ``[taken_at, marks...]`` (float64)."""
        return torch.cat(
            [torch.tensor([float(self.taken_at)], dtype=torch.float64), self.marks.double()]
        )

    def adopt(self, saved: torch.Tensor | None, step: int) -> None:
        """Take a checkpoint's (or a peer's) marks for a state at ``step``; those chosen after
        ``step`` are dropped (the steps that choose them are ahead)."""
        if saved is None or saved.numel() == 0 or int(saved[0]) == 0:
            self.marks, self.taken_at = no_marks(), 0
            return
        if saved.numel() != self.groups + 1:
            raise ValueError(
                f"the saved pruning state has {saved.numel() - 1} groups, the model {self.groups}"
            )
        self.marks, self.taken_at = self.method.kept(saved[1:].long().cpu(), int(saved[0]), step)

    def share(
        self, comm: Any, step: int, broken: Callable[[], bool], *, device: torch.device
    ) -> int:
        """After a plan's sync to ``step``: every rank takes the marks of the lowest rank that
        holds some chosen by ``step`` (a newcomer has none). Returns the step they were chosen
        at (0: none yet)."""
        self.marks, self.taken_at = self.method.kept(self.marks, self.taken_at, step)
        flag = torch.tensor([float(self.taken_at)], dtype=torch.float64, device=device)
        have = [int(r[0]) for r in comm.allgather(DP, flag, broken)]
        holders = [r for r, t in enumerate(have) if t]
        if not holders:
            self.adopt(None, step)
            return 0
        buf = self.saved() if self.taken_at else torch.zeros(self.groups + 1, dtype=torch.float64)
        buf = buf.to(device)
        comm.broadcast(DP, buf, holders[0], abort=broken)
        self.adopt(buf.cpu(), step)
        return self.taken_at
