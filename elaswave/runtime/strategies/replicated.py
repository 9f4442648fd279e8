"""Replicated data parallelism: every rank keeps the whole model and optimizer state.

A step: the whole-model data path (:mod:`~elaswave.runtime.strategies.wholemodel`: this rank's
share of the step's micro-batches, partial redo), then a SUM all-reduce of the gradients and of
the step's tail record (loss sum, count, newest epoch seen; float64) and the same update on every
rank. A new plan: ranks behind (a newcomer, a rank whose reduction failed) copy the most advanced
one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.tiers import Tiers
from elaswave.runtime.comm.tiered import allreduce_tiered
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.strategies.base import (
    DP,
    Strategy,
    Whole,
    mean_gradient,
    plan_tiers,
    vote,
)
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.strategies.wholemodel import Accumulation, WholeModel
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["Replicated"]


class Replicated(Strategy):
    """Data parallelism with the whole state on every rank."""

    tiered = True  # the gradient's all-reduce goes by hosts when the plan has tiers
    fills_gradients = True  # Accumulation.finish copies the whole sum into sums.grads

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable)
        self.tiers: Tiers | None = None  # the newest plan's (train.hierarchy)
        self.path = WholeModel(ctx)

    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        return self.path.compute(step, every, sums, slowdown=slowdown)

    def accumulation(self, step: int, sums: StepSums) -> Accumulation:
        """This rank's share of ``step``, to be computed micro-batch by micro-batch (the
        engine's loop, or a user's own: :mod:`elaswave.runtime.loop`)."""
        return self.path.accumulation(step, sums)

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        return self.path.covered(step)

    def memory(self) -> dict[str, int]:
        out = super().memory()
        out["grad_bytes"] += self.path.extra_grad_bytes()
        return out

    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        st, comm = self.state, self.ctx.comm
        if self.tiers is None:  # both in flight at once
            comm.allreduce_many([(DP, sums.grads), (DP, sums.tail.values)], broken)
        else:
            compressed = sums.grads.numel() if self.ctx.cfg.train.grad_compress == "int8" else 0
            allreduce_tiered(
                comm, DP, self.tiers, tensor=sums.grads, abort=broken, compressed=compressed
            )
            comm.allreduce(DP, sums.tail.values, broken)
        # -- the reduction succeeded: every rank now holds the identical full-batch gradient.
        self.path.forget_partial()
        if sums.tail.nonfinite:  # every rank alike: the step counts, nothing is applied
            st.opt.step_count, st.step = step, step
            st.last_loss, st.last_grad_norm = sums.tail.mean_loss, None
            return sums.tail.epoch
        self.ctx.enter("compute")
        measure = self.ctx.cfg.logging.enabled and comm.rank(DP) == 0  # it reports
        grad, st.last_loss, st.last_grad_norm = mean_gradient(
            sums, max_norm=self.ctx.cfg.train.grad_clip, ties=st.ties, segments=st.segments,
            measure=measure,
        )  # fmt: skip
        old = st.prune.before(step, st.params) if st.prune else None
        st.opt.step(st.flat.data, grad, st.opt.hyper.groups)
        if st.prune:
            st.prune.after(step, old, st.params, lr=st.opt.hyper.lr_at(step))
        st.step = step
        return sums.tail.epoch

    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Every rank, and the tiers' groups (each host's ranks, each lane's) when the
        gradient is reduced by tiers."""
        self.tiers = plan_tiers(self.ctx, plan, tiered=self.tiered)
        extra = self.tiers.groups(plan.workers) if self.tiers is not None else {}
        return {**super().groups(plan), **extra}

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Ranks behind (a newcomer, a failed reduction) copy the most advanced one; the
        micro-batches of an interrupted step that survivors kept are not computed again."""
        st, comm = self.state, self.ctx.comm
        rank = comm.rank(DP)
        mine = torch.tensor(
            [float(st.step), *self.path.partial_row()], dtype=torch.float64, device=st.device
        )
        rows = [r.tolist() for r in comm.allgather(DP, mine, broken)]
        steps = [int(r[0]) for r in rows]
        start = self.durable.start_over(plan, broken) if max(steps) == 0 else None
        if start is not None:
            return {
                "steps": steps,
                **self.restore(plan, broken, start[0], lost_from=start[1], reason=start[2]),
            }
        target = max(steps)
        moved = 0
        source = steps.index(target)
        if min(steps) != target:
            state = torch.cat([st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq])
            meta = torch.tensor(
                [float(st.step), float(st.opt.step_count), st.last_loss],
                dtype=torch.float64,
                device=st.device,
            )
            comm.broadcast(DP, meta, source, abort=broken)
            comm.broadcast(DP, state, source, abort=broken)
            if st.step != target:
                n = st.flat.numel
                st.flat.data.copy_(state[:n])
                st.opt.exp_avg.copy_(state[n : 2 * n])
                st.opt.exp_avg_sq.copy_(state[2 * n :])
                st.step = int(meta[0].item())
                st.opt.step_count = int(meta[1].item())
                st.last_loss = float(meta[2].item())
            moved = state.numel() * state.element_size() + meta.numel() * meta.element_size()
        return {
            "resume_step": target,
            "source_rank": source,
            "steps": steps,
            "bytes": moved if rank != source else 0,
            **self.path.plan_redo(plan, target, steps, rows=[r[1:] for r in rows]),
        }

    def whole(self, broken: Callable[[], bool]) -> Whole:
        st = self.state
        return Whole(st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq)

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        st = self.state
        self.path.forget_partial()
        st.flat.data.copy_(state.params)
        st.opt.exp_avg.copy_(state.exp_avg)
        st.opt.exp_avg_sq.copy_(state.exp_avg_sq)
        st.opt.step_count = state.step
        st.step, st.last_loss = state.step, state.loss
        return {}

    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        st = self.state
        found, _ = vote(self, [st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq], step, broken)
        return found

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        if target == "snapshot":
            return self.state.opt.exp_avg, "optimizer state (exp_avg)"
        return self.state.flat.data, "parameters"
