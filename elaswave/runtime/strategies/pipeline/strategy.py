"""Pipeline stages as a strategy: the 1F1B step of this rank's stage
(:class:`~elaswave.runtime.strategies.pipeline.stage.Pipeline`), one all-reduce of every layer's
gradient, the update of the held layers (replicated or ZeRO stage state), and the takeover of
layers on a new layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.stageshards import LayersLost
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.integrity import stageverify
from elaswave.runtime.strategies.base import (
    DP,
    EPOCH,
    FLAG,
    Strategy,
    Whole,
    mean_gradient,
    nbytes,
)
from elaswave.runtime.strategies.pipeline.stage import MIG, Pipeline
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["PipelineStages"]


class PipelineStages(Strategy):
    """This rank runs one stage of one replica; layers are reduced over the replicas."""

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable)
        self.pipe = Pipeline(ctx)
        self.sharded = bool(ctx.cfg.zero)  # ZeRO inside the stages: an optimizer phase
        self.sealed = self.sharded  # and the parameters it does not keep come from peers

    def ready(self) -> dict[str, Any]:
        """The leader partitions with the workload's estimate, or with what the layers measured."""
        out: dict[str, Any] = {"layer_estimate": list(self.pipe.costs)}
        if self.ctx.cfg.layer_costs in ("profile", "online"):
            out["layer_seconds"] = self.pipe.profile_layers()
        return out

    def memory(self) -> dict[str, int]:
        """ZeRO inside the stages: the moments of the parts this rank keeps; the pre-update
        copies of the held layers (a rollback's source) as copies kept for recovery."""
        out = super().memory()
        pipe = self.pipe
        out["optimizer_bytes"] += nbytes(pipe.store.exp_avg, pipe.store.exp_avg_sq)
        undo = pipe.undo
        out["replica_bytes"] = nbytes(*(copy for _, copy in undo.saved)) if undo else 0
        return out

    # ---- one step -----------------------------------------------------------------------------
    def compute(
        self, step: int, every: Sequence[MicroBatch], buf: torch.Tensor, slowdown: float
    ) -> float | None:
        plan = self.ctx.plan
        assert plan is not None
        self.state.flat.grad.zero_()
        slow = slowdown * len(plan.replicas) / len(every)  # per micro-batch
        per_mb = self.pipe.run_step(step, buf, list(every), self._broken, slow=slow)
        buf[self.state.flat.numel + FLAG] = self.pipe.ready_flag
        return per_mb

    def reduce_update(
        self,
        step: int,
        buf: torch.Tensor,
        broken: Callable[[], bool],
        before_update: Callable[[], None],
    ) -> float:
        st, n, pipe, ctx = self.state, self.state.flat.numel, self.pipe, self.ctx
        ctx.comm.allreduce(DP, buf, broken)
        ctx.enter("compute")
        grad, loss = mean_gradient(buf, n, ctx.cfg.train.grad_clip, st.ties)
        pipe.update(step, grad, broken, before_update)
        st.step, st.last_loss = step, loss
        switched = pipe.after_step(step, float(buf[n + FLAG]))
        if switched is not None:
            assert ctx.plan is not None
            self.say("migration_done", epoch=ctx.plan.epoch, **switched)
            self._set_clocks()
        return float(buf[n + EPOCH])

    def _broken(self) -> bool:
        return self.ctx.broken()

    # ---- a new plan ---------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        # asynchronous migrations run beside the training group
        return {DP: plan.workers, MIG: plan.workers}

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The stage takeover; ``--resume`` and the durable fallback when every holder of some
        layer is gone."""

        def start_from() -> DurableState | None:
            start = self.durable.start_over(plan, broken)
            return self.durable.load(*start) if start is not None else None

        try:
            return self.pipe.sync(plan, broken, self.ctx.cfg.migration == "async", start_from)
        except LayersLost as exc:
            chosen = self.durable.newest(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            state = self.durable.load(Path(chosen), self.state.step, str(exc))
            return self.pipe.restore_whole(plan, state)

    def after_apply(self, plan: Plan) -> None:
        self._set_clocks()

    def _set_clocks(self) -> None:
        clocks = self.pipe.set_clocks()
        if clocks is not None:
            assert self.ctx.plan is not None
            self.ctx.event(
                "dvfs_applied", epoch=self.ctx.plan.epoch, worker=self.ctx.worker, **clocks
            )

    def after_commit(self, step: int) -> None:
        """Every ``cost_every`` committed steps (``layer_costs: online``): this stage's measured
        seconds per layer, for the leader's next plan."""
        cfg, plan = self.ctx.cfg, self.ctx.plan
        if cfg.layer_costs != "online" or step % cfg.cost_every or plan is None:
            return
        seconds = self.pipe.timer.snapshot()
        if seconds:
            self.ctx.send(
                {
                    "type": "layer_costs",
                    "step": step,
                    "epoch": plan.epoch,
                    "layer_seconds": {str(i): x for i, x in seconds.items()},
                }
            )

    # ---- whole state --------------------------------------------------------------------------
    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Stages hold different layers: the whole model assembled from the holders."""
        whole, agree = self.pipe.assemble(broken)
        params, exp_avg, exp_avg_sq = whole.chunk(3)
        return Whole(params, exp_avg, exp_avg_sq, {"holders_agree": agree})

    def eval_params(self, broken: Callable[[], bool]) -> torch.Tensor:
        return self.whole(broken).params

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        return self.pipe.restore_whole(plan, state)

    def roll_back(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> None:
        if self.pipe.migration is not None:
            self.ctx.comm.mark_broken()  # its posted messages are void: fresh groups next plan
        self.pipe.restore_whole(plan, state)
        stageverify.record(self.pipe, state.step)  # what the next check compares with

    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        """Every layer's and moment part's copies compared, bad ones repaired."""
        plan = self.ctx.plan
        assert plan is not None
        findings = stageverify.verify(self.pipe, step, broken)
        for f in findings:
            self.say("sdc_detected", step=step, workers=[plan.workers[r] for r in f["ranks"]], **f)
            if f["source_rank"] is not None:
                self.say("sdc_repaired", step=step, what=f["what"], ranks=f["ranks"])
        return bool(findings)

    def computes_with(self) -> torch.Tensor:
        pipe = self.pipe
        return self.state.flat.data[pipe.span(pipe.held) if pipe.held else slice(0, 0)]

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        """What this rank keeps current: its held layers (or their kept moments)."""
        pipe, st = self.pipe, self.state
        if not pipe.held:
            if target == "snapshot":
                return st.opt.exp_avg, "optimizer state (exp_avg)"
            return st.flat.data, "parameters"
        held = pipe.span(pipe.held)
        if target != "snapshot":
            return st.flat.data[held], "parameters"
        if pipe.zero:
            return pipe.store.exp_avg, "optimizer state (exp_avg)"
        return st.opt.exp_avg[held], "optimizer state (exp_avg)"
