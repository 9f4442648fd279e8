"""A rank's pruning: DHSPG applied to its whole flat parameters after each update.

The only state pruning adds is the redundant set, chosen once at ``partition_step`` from that
step's parameters and direction: :attr:`Pruner.redundant` (with :attr:`taken_at`, the step it
was chosen at). Which groups are zero is read off the parameters themselves, and the penalties
are recomputed every step, so snapshots, transfers and checkpoints of the parameters carry the
rest. A newcomer receives the set from a peer when the plan is applied (:meth:`share`), and a
durable checkpoint stores it beside the parameters (:meth:`saved`, :meth:`adopt`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.prune import dhspg
from elaswave.prune.groups import Family, find_groups, flat_index
from elaswave.runtime.workload.base import KeyedLayers, Workload

__all__ = ["Pruner"]

DP = "dp"


@dataclass(eq=False)
class Pruner:
    families: list[Family]
    index: list[torch.Tensor]  # each family's (count, size) flat offsets
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
        index = [flat_index(f, model) for f in families]
        return cls(families, index, hp, p.partition_at, p.start_step, p.uniform)

    @property
    def groups(self) -> int:
        return sum(f.count for f in self.families)

    def active(self, step: int) -> bool:
        """Whether step ``step`` prunes (before it, training is exactly as without pruning)."""
        return step >= self.partition_at

    def before(self, step: int, params: torch.Tensor) -> torch.Tensor | None:
        """The parameters before the update, where step ``step`` prunes."""
        return params.clone() if self.active(step) else None

    def after(self, step: int, old: torch.Tensor | None, params: torch.Tensor, lr: float) -> None:
        """DHSPG on ``params`` (the whole model's, just updated from ``old``) in place."""
        if old is None:
            return
        if self.index[0].device != params.device:
            self.index = [i.to(params.device) for i in self.index]
        xs = [old[i] for i in self.index]
        hs = [params[i] for i in self.index]
        stats = dhspg.Stats.cat([dhspg.group_stats(x, h, lr) for x, h in zip(xs, hs, strict=True)])
        zero = stats.zero
        zero_before = int(zero.sum())
        if self.taken_at == 0 or self.taken_at >= step:  # chosen now (or again, in a redo)
            sizes = torch.tensor(
                [i.shape[1] for i in self.index for _ in range(i.shape[0])],
                dtype=torch.float64, device=params.device,
            )  # fmt: skip
            buckets = [f.count for f in self.families] if self.uniform else None
            self.redundant = dhspg.partition(stats, sizes, self.hp.upper, buckets).cpu()
            self.taken_at = step
        pulling = zero_before < self.hp.target * self.groups
        redundant = self.redundant.to(params.device)
        if not pulling:  # the target is reached: no more pulls, zero groups stay zero
            redundant = torch.zeros_like(redundant)
        scale, projected = dhspg.decide(
            stats, redundant, zero_before, lr, self.hp, project=step >= self.start_step
        )
        cleared = projected | zero
        start = 0
        for i, x, h in zip(self.index, xs, hs, strict=True):
            n = i.shape[0]
            params[i] = dhspg.apply(x, h, scale[start : start + n], cleared[start : start + n])
            start += n
        zeros = int(cleared.sum())
        self.last = {
            "prune_sparsity": zeros / self.groups,
            "prune_zero_groups": zeros,
            "prune_projected": int(projected.sum()),
        }

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

    def share(self, comm: Any, step: int, broken: Callable[[], bool], device: torch.device) -> int:
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
        comm.broadcast(DP, buf, holders[0], broken)
        self.adopt(buf.cpu(), step)
        return self.taken_at
