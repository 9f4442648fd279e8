"""Replicated data parallelism: every rank keeps the whole model and optimizer state.

A step: forward and backward over this rank's contiguous share of the fixed global batch's
micro-batches (each with RNG keyed by (seed, step, micro-batch, layer), loss scaled by 1/B), then
one SUM all-reduce of [gradients | loss sum | newest epoch seen] and the same AdamW update on every
rank. A new plan: ranks behind (a newcomer, a rank whose reduction failed) copy the most advanced
one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from elaswave.planning.plan import Plan
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.integrity.checksums import digest
from elaswave.runtime.integrity.verify import judge
from elaswave.runtime.strategies.base import COUNT, DP, EPOCH, LOSS, Strategy, Whole, mean_gradient
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.data import MicroBatch

__all__ = ["Replicated"]


class Replicated(Strategy):
    """Data parallelism with the whole state on every rank."""

    def compute(
        self, step: int, every: Sequence[MicroBatch], buf: torch.Tensor, slowdown: float
    ) -> float | None:
        plan, st, t = self.ctx.plan, self.state, self.ctx.cfg.train
        assert plan is not None
        mark = busy_mark()
        n = st.flat.numel
        mine = plan.microbatch_range(self.ctx.comm.rank(DP))
        slow = slowdown * plan.world_size / len(every)  # per micro-batch
        # In the reduction's own dtype the gradients accumulate where autograd puts them and
        # join the buffer once (the same float32 sums, in the same order); a wider reduction
        # (float64) takes each micro-batch's gradient as it comes.
        each = buf.dtype != st.flat.grad.dtype
        for mb in (every[i] for i in mine):
            inputs, targets = st.microbatch(mb.sample_ids)
            loss, count = st.loss(st.model(inputs, step, mb.id), targets)
            loss.backward()
            if t.device_time:
                time.sleep(t.device_time)  # emulated accelerator time (benchmarks)
            if each:
                self._collect(buf[:n])
            buf[n + LOSS] += loss.item()
            buf[n + COUNT] += count
            if slow:
                time.sleep(slow)
        if not each and len(mine):
            self._collect(buf[:n])
        # Time this rank needed, without the time its thread sat waiting for a CPU: on a shared
        # host that measures the neighbours, not this rank (sleeps and stalls still count).
        return busy_since(mark) / max(len(mine), 1)

    def _collect(self, into: torch.Tensor) -> None:
        """Add the gradients autograd accumulated to ``into`` and zero them."""
        grad = self.state.flat.collect_grads()
        into.add_(grad)
        grad.zero_()

    def reduce_update(
        self,
        step: int,
        buf: torch.Tensor,
        broken: Callable[[], bool],
        before_update: Callable[[], None],
    ) -> float:
        st, n = self.state, self.state.flat.numel
        self.ctx.comm.allreduce(DP, buf, broken)
        # -- the reduction succeeded: every rank now holds the identical full-batch gradient.
        self.ctx.enter("compute")
        grad, st.last_loss = mean_gradient(buf, n, self.ctx.cfg.train.grad_clip, st.ties)
        st.opt.step(st.flat.data, grad, st.opt.hyper.groups)
        st.step = step
        return float(buf[n + EPOCH])

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Ranks behind (a newcomer, a failed reduction) copy the most advanced one."""
        st, comm = self.state, self.ctx.comm
        rank = comm.rank(DP)
        mine = torch.tensor([float(st.step)], dtype=torch.float64, device=st.device)
        steps = [int(x.item()) for x in comm.allgather(DP, mine, broken)]
        start = self.durable.start_over(plan, broken) if max(steps) == 0 else None
        if start is not None:
            return {"steps": steps, **self.restore(plan, broken, *start)}
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
            comm.broadcast(DP, meta, source, broken)
            comm.broadcast(DP, state, source, broken)
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
        }

    def whole(self, broken: Callable[[], bool]) -> Whole:
        st = self.state
        return Whole(st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq)

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        st = self.state
        st.flat.data.copy_(state.params)
        st.opt.exp_avg.copy_(state.exp_avg)
        st.opt.exp_avg_sq.copy_(state.exp_avg_sq)
        st.opt.step_count = state.step
        st.step, st.last_loss = state.step, state.loss
        return {}

    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        st = self.state
        found, _ = self.vote([st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq], step, broken)
        return found

    def vote(
        self, parts: list[torch.Tensor], step: int, broken: Callable[[], bool], *flags: bool
    ) -> tuple[bool, list[list[int]]]:
        """Checksum ``parts`` on every rank; the majority's copy overwrites any disagreeing one
        (rank 0 reports it). Returns whether some copy disagreed, and every rank's ``flags``."""
        comm, plan = self.ctx.comm, self.ctx.plan
        dev = self.state.device
        mine = torch.tensor([digest(*parts), *map(int, flags)], dtype=torch.int64, device=dev)
        rows = [r.tolist() for r in comm.allgather(DP, mine, broken)]
        verdict = judge([r[0] for r in rows])
        workers = plan.workers if plan else ()
        if verdict.bad:
            self.say(
                "sdc_detected",
                step=step,
                what="replicated state",
                ranks=list(verdict.bad),
                workers=[workers[r] for r in verdict.bad],
                source_rank=verdict.source,
                tie=verdict.unanimous_loss,
            )
            for part in parts:
                comm.broadcast(DP, part, verdict.source, broken)
            self.say("sdc_repaired", step=step, what="replicated state")
        return bool(verdict.bad), [row[1:] for row in rows]

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        if target == "snapshot":
            return self.state.opt.exp_avg, "optimizer state (exp_avg)"
        return self.state.flat.data, "parameters"
