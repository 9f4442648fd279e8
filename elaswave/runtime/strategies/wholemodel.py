"""The whole-model data path of data parallelism (replicated, and ZeRO-1 where only the
optimizer state is sharded): every rank runs the whole model over its share of the step's
micro-batches and sums their gradients for the whole model.

A step: forward and backward over this rank's contiguous share of the fixed global batch's
micro-batches (each with RNG keyed by (seed, step, micro-batch, layer), loss scaled by 1/B),
summed into the step's gradient sums.

Partial redo: the micro-batches a rank finished are summed in an accumulator of its own
(autograd's flat gradient, or a float64 one in the deterministic mode) and only copied into the
step's reduction buffer, so a reduction that fails cannot touch them. A survivor keeps them; the
next plan's ranks agree which micro-batches nobody keeps
(:func:`~elaswave.planning.redo.redo_shares`) and compute only those before the step is reduced
once.

Miscomputed gradients (``replay_every``): on a replayed step the rank also recomputes a peer's
first micro-batch before its own, and digests its own first micro-batch's gradient before it is
summed; the digests are compared before the reduction (:mod:`~elaswave.runtime.integrity.replay`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.redo import redo_shares
from elaswave.runtime.integrity.replay import GradReplay, Miscomputed
from elaswave.runtime.strategies.base import DP, nbytes
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext, TrainState

__all__ = ["Accumulation", "Partial", "WholeModel"]


@dataclass
class Partial:
    """What this rank finished of a step that is not committed yet: the micro-batches summed in
    its accumulator, and their loss sum and count (float64, as the step's tail holds them)."""

    step: int
    sums: torch.Tensor  # [loss sum, count]
    done: list[int] = field(default_factory=list)  # micro-batch indices, in computed order


class Accumulation:
    """One step's forward and backward on this rank, micro-batch by micro-batch: ``mine`` are
    the indices to compute; after each one's backward, :meth:`add` takes its gradient (autograd
    summed it into the flat gradient; the float64 mode adds it to ``acc``) and its loss sum and
    count; :meth:`finish` fills the step's sums."""

    def __init__(
        self,
        state: TrainState,
        *,
        sums: StepSums,
        acc: torch.Tensor | None,
        part: Partial,
        mine: tuple[int, ...],
        redo: bool,
        world: int,
    ) -> None:
        self.state, self.sums, self.acc, self.part = state, sums, acc, part
        self.mine, self.redo, self.world = mine, redo, world
        self._mark = busy_mark()

    def add(self, index: int, loss: torch.Tensor, count: int) -> None:
        if self.acc is not None:
            grad = self.state.flat.collect_grads()
            self.acc.add_(grad)
            grad.zero_()
        part = self.part
        part.sums[0] += loss.detach().to(part.sums.dtype)  # no host sync per micro-batch
        part.sums[1] += count
        part.done.append(index)

    def finish(self) -> float | None:
        """Fill the step's sums; this rank's busy seconds per micro-batch (None: a redone
        share, or none, says nothing about its speed)."""
        st, sums, part = self.state, self.sums, self.part
        sums.grads.copy_(self.acc if self.acc is not None else st.flat.collect_grads())
        sums.tail.loss, sums.tail.count = part.sums[0], part.sums[1]
        if self.redo or not self.mine:
            return None
        # Time this rank needed, without the time its thread sat waiting for a CPU: on a shared
        # host that measures the neighbours, not this rank (sleeps and stalls still count).
        return busy_since(self._mark) / len(self.mine)


def rng_key(mode: str, microbatch: int, *, rank: int, first: int, count: int) -> int:
    """What micro-batch ``microbatch``'s layers key their random numbers by (``train.rng``):
    the micro-batch itself ("sample"), or the computing rank and the micro-batch's place among
    that rank's, whose first is ``first`` ("rank"; ``count``: the step's micro-batches, so that
    no two (rank, place) pairs share a key)."""
    if mode == "sample":
        return microbatch
    return count * (1 + rank) + microbatch - first


class WholeModel:
    """One rank's whole-model compute with partial redo (``ctx``: the rank's context)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.partial: Partial | None = None
        self.redo: tuple[int, tuple[int, ...]] | None = None  # (step, my micro-batches)
        self._acc: torch.Tensor | None = None  # the float64 accumulator (deterministic mode)
        self.replay = GradReplay(ctx)

    def gradient(self, sums: StepSums) -> torch.Tensor:
        """The gradient sums a step's update reduces: the whole model's, in the step's buffer."""
        return sums.grads

    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        st, t = self.state, self.ctx.cfg.train
        run = self.accumulation(step, sums)
        slow = slowdown * run.world / len(every)  # per micro-batch
        replay = self.replay
        replay.begin(
            step, run.mine, redo=run.redo, compute=lambda i: self._aside(step, every[i], keep=False)
        )
        rank = self.ctx.comm.rank(DP)
        first = self.ctx.plan.microbatch_range(rank).start if self.ctx.plan else 0
        for i in run.mine:
            mb = every[i]
            key = rng_key(t.rng, mb.id, rank=rank, first=first, count=len(every))
            inputs, targets = st.microbatch(mb.sample_ids)
            loss, count = st.loss(st.model(inputs, step, mb.id, rng=key), targets)
            loss.backward()
            if t.device_time:
                time.sleep(t.device_time)  # emulated accelerator time (benchmarks)
            if i == run.mine[0]:  # its gradient alone (the step's first), before it is summed
                replay.owned(step, st.flat.collect_grads())
            run.add(i, loss, count)
            if slow:
                time.sleep(slow)
        per_mb = run.finish()
        try:
            replay.check(step, lambda i: self._aside(step, every[i], keep=run.acc is None))
        except Miscomputed:
            self.forget_partial()  # the step is redone whole under the plan without the odd rank
            raise
        return per_mb

    def _aside(self, step: int, mb: MicroBatch, *, keep: bool) -> torch.Tensor:
        """A copy of the gradient of ``mb`` alone (a peer's micro-batch, recomputed), computed in
        the flat gradient and zeroed after; ``keep``: the flat gradient holds sums (autograd's
        accumulator, mid-step), kept aside and restored."""
        st = self.state
        grad = st.flat.collect_grads()
        saved = grad.clone() if keep else None
        grad.zero_()
        inputs, targets = st.microbatch(mb.sample_ids)
        loss, _ = st.loss(st.model(inputs, step, mb.id), targets)
        loss.backward()
        out = st.flat.collect_grads().clone()
        if saved is not None:
            grad.copy_(saved)
        else:
            grad.zero_()
        return out

    def accumulation(self, step: int, sums: StepSums) -> Accumulation:
        """This rank's share of ``step`` (a redo's, or the plan's), to be computed micro-batch
        by micro-batch: the engine's loop above, or a user's own (:mod:`elaswave.runtime.loop`)."""
        plan = self.ctx.plan
        assert plan is not None
        redo = self.redo[1] if self.redo is not None and self.redo[0] == step else None
        mine = redo if redo is not None else plan.microbatch_range(self.ctx.comm.rank(DP))
        acc, part = self._accumulator(step, sums.grads)
        return Accumulation(
            self.state, sums=sums, acc=acc, part=part, mine=tuple(mine), redo=redo is not None,
            world=plan.world_size,
        )  # fmt: skip

    def _accumulator(self, step: int, buf: torch.Tensor) -> tuple[torch.Tensor | None, Partial]:
        """The float64 accumulator (None: autograd's flat gradient is the accumulator) and the
        step's partial sums: the kept ones when this step was interrupted, else zeroed."""
        st = self.state
        acc = None
        if buf.dtype != st.flat.grad.dtype:
            if self._acc is None or self._acc.dtype != buf.dtype:
                self._acc = buf.new_zeros(st.flat.numel)
            acc = self._acc
        if self.partial is None or self.partial.step != step:
            (acc if acc is not None else st.flat.collect_grads()).zero_()
            self.partial = Partial(step, buf.new_zeros(2, dtype=torch.float64))
        return acc, self.partial

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        """Every layer: the micro-batches summed in the accumulator (kept ones included)."""
        part = self.partial
        done = tuple(part.done) if part is not None and part.step == step else ()
        return dict.fromkeys(range(len(self.state.model)), done)

    def extra_grad_bytes(self) -> int:
        """The deterministic mode's float64 sums, beside the state's flat gradient."""
        return nbytes(self._acc)

    def forget_partial(self) -> None:
        """The state changed under the kept sums (a copy, a restore, a rollback): drop them."""
        self.partial, self.redo = None, None

    def partial_row(self) -> list[float]:
        """What this rank tells its peers at a sync about the step it keeps sums of:
        [step (-1: none), then 1.0 for each micro-batch index it finished]."""
        t = self.ctx.cfg.train
        row = [-1.0] + [0.0] * (t.global_batch // t.micro_batch_size)
        if self.partial is not None:
            row[0] = float(self.partial.step)
            for i in self.partial.done:
                row[1 + i] = 1.0
        return row

    def plan_redo(
        self, plan: Plan, resume: int, steps: list[int], *, rows: list[list[float]]
    ) -> dict[str, Any]:
        """Agree (every rank, from the same rows of ``partial_row``) which micro-batches of step
        ``resume + 1`` each rank computes: only those no rank kept (``train.partial_redo``),
        else all of them as the plan shares them. ``steps``: each rank's step before the sync
        (kept sums are usable only if computed from the resume step's parameters). What is
        redone, for the event: nothing when no step was interrupted."""
        total = len(rows[0]) - 1
        kept = [
            [i for i in range(total) if row[1 + i]]
            if int(row[0]) == resume + 1 and steps[r] == resume
            else None
            for r, row in enumerate(rows)
        ]
        me, interrupted = self.ctx.comm.rank(DP), any(kept)
        shares = redo_shares(total, kept, plan.microbatches)
        if not self.ctx.cfg.train.partial_redo or shares is None:
            shares, kept = None, [None] * len(kept)
        if kept[me] is None:
            self.partial = None  # the step starts from zero
        self.redo = (resume + 1, shares[me]) if shares is not None else None
        if not interrupted:
            return {}
        every = shares or [tuple(plan.microbatch_range(r)) for r in range(len(rows))]
        return {
            "redo_step": resume + 1,
            "kept_microbatches": {plan.workers[r]: len(k or ()) for r, k in enumerate(kept)},
            "redo_microbatches": {plan.workers[r]: list(s) for r, s in enumerate(every) if s},
        }
