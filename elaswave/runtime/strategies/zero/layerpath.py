"""ZeRO-3's data path: this rank's micro-batches through the layers, each layer gathered while it
runs and its gradient reduce-scattered as backward produces it (:class:`~.gather.LayerGather`).
The rank ends a step with the batch's gradient sums of its own part (in the reduction's dtype),
its loss sum and count; :func:`~.update.update_from_layers` takes it from there.

An interrupted step is redone whole: the gradient is reduced layer by layer as backward produces
it, and what a rank computed of the step leaves it as soon as each layer is reduced (keeping it
would mean a whole-model gradient per rank, which ZeRO-3 exists to avoid), so the lost rank's part
of the reduced sums is gone with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.tiers import Tiers
from elaswave.runtime.strategies.base import DP
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.strategies.zero.gather import Batch, LayerGather
from elaswave.runtime.strategies.zero.holding import LayerShards, ShardedParams
from elaswave.runtime.strategies.zero.state import ShardState
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.base import EVAL_STEP
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

__all__ = ["GLOO_REDUCE_SCATTER", "LayerPath"]

# Gloo's reduce-scatter against its all-reduce for a layer's gradient (keep this rank's part):
# see docs/architecture.md, "ZeRO-3". Backends with a real reduce-scatter (NCCL) always use it.
GLOO_REDUCE_SCATTER = True


class LayerPath:
    """One rank's layer-wise compute over the shard state ``z`` (its parameters held by
    ``holding``). ``across_hosts``: the shards are laid out over each host's ranks, every host a
    whole copy (each layer's gradient is then summed over every rank, the gathers stay inside
    the host)."""

    def __init__(
        self, ctx: RankContext, z: ShardState, holding: ShardedParams, *, across_hosts: bool
    ) -> None:
        self.ctx, self.state, self.z = ctx, ctx.state, z
        self.shards = LayerShards(z, holding)
        native = getattr(ctx.comm, "backend", "gloo") != "gloo" or GLOO_REDUCE_SCATTER
        self.gather = LayerGather(ctx.state.model, ctx.comm, ctx.enter, native=native)
        self.gather.compressed = ctx.cfg.train.grad_compress == "int8"
        self.gather.gather_tiers = ctx.cfg.train.zero3_gather == "tiers"
        self.gather.across_hosts = across_hosts
        self.grads: torch.Tensor | None = None  # the step's gradient sums of this rank's part
        self.started = -1  # the step this rank began computing and has not committed
        self.computed: tuple[int, tuple[int, ...]] = (-1, ())  # (step, its micro-batches)

    def gradient(self, sums: StepSums) -> torch.Tensor:
        """The gradient sums a step's update reads: this rank's part, reduced already."""
        assert self.grads is not None
        return self.grads

    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        plan, st, t, z = self.ctx.plan, self.state, self.ctx.cfg.train, self.z
        assert plan is not None
        mark = busy_mark()
        mine = plan.microbatch_range(self.ctx.comm.rank(DP))
        batches = [Batch(every[i].id, *st.microbatch(every[i].sample_ids)) for i in mine]
        dtype = sums.grads.dtype
        if self.grads is None or self.grads.dtype != dtype or self.grads.numel() != z.size:
            self.grads = sums.grads.new_zeros(z.size)
        self.grads.zero_()
        self.started = step
        self.computed = (step, tuple(mine))
        self.gather.comm = self.ctx.comm
        loss, count = self.gather.train(
            self.shards, step, batches, grads=self.grads, loss_fn=st.loss, abort=self.ctx.broken,
            ties=st.ties,
        )  # fmt: skip
        extra = len(batches) * (t.device_time + slowdown * plan.world_size / len(every))
        if extra:
            time.sleep(extra)  # emulated accelerator time (benchmarks), a ``slow`` fault
        sums.tail.loss, sums.tail.count = loss, count
        if not batches:
            return None
        # Time this rank computed: without its waits for peers' parts of a layer, and without
        # the time its thread sat waiting for a CPU.
        return max(busy_since(mark) - self.gather.waited, 0.0) / len(batches)

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        """Every layer: this rank's share of the step (an interrupted step is redone whole)."""
        done, mine = self.computed
        return dict.fromkeys(range(len(self.state.model)), mine if done == step else ())

    def planned(self, plan: Plan, tiers: Tiers | None) -> None:
        """The layers' gradients go by the plan's tiers (none where the reduction is flat); with
        ``train.hpz: auto``, backward's gathers stay inside each host (hpZ), unless the shards
        are a host's already."""
        self.gather.tiers = tiers
        hpz = tiers if self.ctx.cfg.train.hpz == "auto" and not self.gather.across_hosts else None
        self.gather.secondary = hpz.secondary(plan.workers.index(self.ctx.worker)) if hpz else None

    def forget_partial(self) -> None:
        """The step is committed, or the state changed under it: nothing of it is kept."""
        self.started = -1

    def partial_row(self) -> list[float]:
        """[the step this rank began and did not commit (-1: none), then nothing kept]."""
        t = self.ctx.cfg.train
        return [float(self.started)] + [0.0] * (t.global_batch // t.micro_batch_size)

    def plan_redo(
        self, plan: Plan, resume: int, steps: list[int], *, rows: list[list[float]]
    ) -> dict[str, Any]:
        """An interrupted step is computed again whole (see the module docstring): for the
        event, the micro-batches each rank computes of it."""
        self.started = -1
        if not any(int(row[0]) == resume + 1 for row in rows):
            return {}
        return {
            "redo_step": resume + 1,
            "kept_microbatches": dict.fromkeys(plan.workers, 0),
            "redo_microbatches": {
                w: list(plan.microbatch_range(r)) for r, w in enumerate(plan.workers)
            },
        }

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        """Micro-batch ``i`` on rank ``i mod world``, every layer gathered once."""
        st, comm = self.state, self.ctx.comm
        rank, world = comm.rank(DP), comm.size(DP)
        mine = range(rank, len(batches), world)
        runs = [Batch(i, *st.microbatch(batches[i])) for i in mine]
        self.gather.comm = comm
        scores = self.gather.score(self.shards, runs, st.score, step=EVAL_STEP, abort=broken)
        for i, score in zip(mine, scores, strict=True):
            slots[3 * i : 3 * i + 3] = torch.tensor(score, dtype=slots.dtype)
