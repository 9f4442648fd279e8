"""A rank's pruning: DHSPG applied to the parameters it holds after each update.

The only state pruning adds is the redundant set, chosen once at ``partition_step`` from that
step's parameters and direction: :attr:`Pruner.redundant` (with :attr:`taken_at`, the step it
was chosen at). Which groups are zero is read off the parameters themselves, and the penalties
are recomputed every step, so snapshots, transfers and checkpoints of the parameters carry the
rest. A newcomer receives the set from a peer when the plan is applied (:meth:`share`), and a
durable checkpoint stores it beside the parameters (:meth:`saved`, :meth:`adopt`).

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
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.prune import dhspg
from elaswave.prune.groups import Family, find_groups, flat_index
from elaswave.runtime.optim import Spans
from elaswave.runtime.prunehook import WHOLE, Holding, Part
from elaswave.runtime.workload.base import KeyedLayers, Workload

__all__ = ["WHOLE", "Holding", "Part", "Pruner"]

DP = "dp"


def _parts(index: torch.Tensor, starts: torch.Tensor) -> list[Part]:
    """A family's flat offsets (``(count, size)``) cut by layer, in layer order (a member's
    elements lie in one layer; every group has the same members)."""
    layers = torch.searchsorted(starts, index[0], right=True) - 1
    return [Part(int(i), index[:, layers == i]) for i in torch.unique(layers).tolist()]


def _at(spans: Spans, index: torch.Tensor) -> torch.Tensor:
    return spans.tensor[index - spans.base]


@dataclass(eq=False)
class Pruner:
    """DHSPG over the model's zero-invariant groups: the
    :class:`~elaswave.runtime.prunehook.PruneHook` a worker hands its train state."""

    families: list[Family]
    parts: list[list[Part]]  # each family's elements, layer by layer
    hp: dhspg.Hyper
    partition_at: int
    start_step: int
    uniform: bool
    redundant: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    taken_at: int = 0  # the step the redundant set was chosen at (0: not yet)
    last: dict[str, Any] = field(default_factory=dict)  # the last step's numbers, for metrics

    @classmethod
    def build(cls, cfg: JobConfig, workload: Workload, model: KeyedLayers) -> Pruner | None:
        """The pruner ``cfg.train.prune`` asks for (None: off), over the model's groups."""
        p = cfg.train.prune
        if p is None:
            return None
        p = p.resolved(cfg.train.optimizer)
        families = find_groups(workload, model, p.kinds)
        assert p.lmbda is not None and p.lmbda_amplify is not None and p.hat_lmbda_coeff
        hp = dhspg.Hyper(
            p.target_sparsity, p.tolerance, p.epsilon, p.lmbda, p.lmbda_amplify, p.hat_lmbda_coeff
        )
        starts = torch.tensor([offset for offset, _ in model.segments()], dtype=torch.int64)
        parts = [_parts(flat_index(f, model), starts) for f in families]
        return cls(families, parts, hp, p.partition_at, p.start_step, p.uniform)

    @property
    def groups(self) -> int:
        return sum(f.count for f in self.families)

    def active(self, step: int) -> bool:
        """Whether step ``step`` prunes (before it, training is exactly as without pruning)."""
        return step >= self.partition_at

    def before(self, step: int, params: Spans) -> Spans | None:
        """A copy of the parameters before the update, where step ``step`` prunes."""
        return Spans(params.tensor.clone(), params.base) if self.active(step) else None

    def after(
        self, step: int, old: Spans | None, params: Spans, *, lr: float, holding: Holding = WHOLE
    ) -> None:
        """DHSPG on ``params`` (just updated from ``old``; the parts ``holding`` holds) in
        place."""
        if old is None:
            return
        self.to(params.tensor.device)
        sums = self.sums(lambda layer: (old, params) if holding.counted(layer) else None, lr)
        if holding.reduce is not None:
            holding.reduce(sums)
        scale, cleared = self.decide(step, sums, lr)
        for start, count, p in self.rows():
            if holding.held(p.layer):
                x, h = _at(old, p.index), _at(params, p.index)
                params.tensor[p.index - params.base] = dhspg.apply(
                    x, h, scale[start : start + count], zero=cleared[start : start + count]
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

    def decide(self, step: int, sums: torch.Tensor, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s decisions from every part's sums (added over the ranks): each
        group's pull and whether it is zero after the step (see
        :func:`~elaswave.prune.dhspg.decide`); the redundant set is chosen first where this
        step chooses it."""
        stats = self._stats(sums)
        device = sums.device
        zero = stats.zero
        zero_before = int(zero.sum())
        if self.taken_at == 0 or self.taken_at >= step:  # chosen now (or again, in a redo)
            width = [sum(p.index.shape[1] for p in ps) for ps in self.parts]  # a group's size
            sizes = torch.tensor(
                [w for f, w in zip(self.families, width, strict=True) for _ in range(f.count)],
                dtype=torch.float64, device=device,
            )  # fmt: skip
            buckets = [f.count for f in self.families] if self.uniform else None
            self.redundant = dhspg.partition(stats, sizes, self.hp.upper, buckets=buckets).cpu()
            self.taken_at = step
        pulling = zero_before < self.hp.target * self.groups
        redundant = self.redundant.to(device)
        if not pulling:  # the target is reached: no more pulls, zero groups stay zero
            redundant = torch.zeros_like(redundant)
        scale, projected = dhspg.decide(
            stats, redundant, zero_before, lr=lr, hp=self.hp, project=step >= self.start_step
        )
        cleared = projected | zero
        zeros = int(cleared.sum())
        self.last = {
            "prune_sparsity": zeros / self.groups,
            "prune_zero_groups": zeros,
            "prune_projected": int(projected.sum()),
        }
        return scale, cleared

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
        """The redundant set for a checkpoint: ``[taken_at, flags...]`` (float64)."""
        return torch.cat(
            [torch.tensor([float(self.taken_at)], dtype=torch.float64), self.redundant.double()]
        )

    def adopt(self, saved: torch.Tensor | None, step: int) -> None:
        """Take a checkpoint's (or a peer's) redundant set for a state at ``step``; one chosen
        after ``step`` is dropped (the step that chooses it is ahead)."""
        if saved is None or saved.numel() == 0 or int(saved[0]) == 0 or int(saved[0]) > step:
            self.redundant, self.taken_at = torch.zeros(0, dtype=torch.bool), 0
            return
        if saved.numel() != self.groups + 1:
            raise ValueError(
                f"the saved pruning state has {saved.numel() - 1} groups, the model {self.groups}"
            )
        self.taken_at, self.redundant = int(saved[0]), saved[1:].bool().cpu()

    def share(
        self, comm: Any, step: int, broken: Callable[[], bool], *, device: torch.device
    ) -> int:
        """After a plan's sync to ``step``: every rank takes the redundant set of the lowest rank
        that holds one chosen by ``step`` (a newcomer has none). Returns the step the set was
        chosen at (0: none yet)."""
        mine = self.taken_at if 0 < self.taken_at <= step else 0
        flag = torch.tensor([float(mine)], dtype=torch.float64, device=device)
        have = [int(r[0]) for r in comm.allgather(DP, flag, broken)]
        holders = [r for r, t in enumerate(have) if t]
        if not holders:
            self.adopt(None, step)
            return 0
        buf = self.saved() if mine else torch.zeros(self.groups + 1, dtype=torch.float64)
        buf = buf.to(device)
        comm.broadcast(DP, buf, holders[0], abort=broken)
        self.adopt(buf.cpu(), step)
        return self.taken_at
