"""ZeRO-1 as a strategy: the local compute of data parallelism, the sharded update and recovery
of :class:`~elaswave.runtime.strategies.zero.ZeroState` (its module says how a step commits and
how shards survive a loss)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.shards import ShardLayout
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.strategies.base import DP, Whole, nbytes
from elaswave.runtime.strategies.replicated import Replicated
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.strategies.zero import ShardLost, ZeroState, commit_barrier

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["ResumePoint", "Zero1"]


@dataclass(frozen=True)
class ResumePoint:
    """What the ranks agreed at a sync: every rank's row (step, layout epoch, ...), the ranks
    that hold optimizer state, the step they resume from and a rank that holds it."""

    rows: list[list[float]]
    with_state: list[int]
    resume: int
    source: int


class Zero1(Replicated):
    """Data parallelism with Adam's moments sharded over the ranks (parameters replicated)."""

    sharded = True
    sealed = True

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable)
        self.zero = self.make_shards()
        self.zero.snapshot_every = ctx.cfg.snapshot_every
        self.zero.prune = self.state.prune
        self.zero.compressed = ctx.cfg.train.grad_compress == "int8"
        # NCCL's reduce-scatter moves half an all-reduce's bytes; gloo's is slower than its
        # all-reduce (see ``ZeroState.native_reduce_scatter``).
        self.zero.native_reduce_scatter = getattr(ctx.comm, "backend", "gloo") != "gloo"
        # a native reduce-scatter goes flat (and ZeRO-3's per-layer one: its class says so)
        self.tiered = type(self).tiered and not self.zero.native_reduce_scatter

    def make_shards(self) -> ZeroState:
        """The shard state (ZeRO-3's carries the parameters too)."""
        st = self.state
        return ZeroState(st.flat, st.opt.hyper, st.segments)

    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        """The step's tail, the staged shard update and its replicas, the commit barrier."""
        z, st, comm, tail = self.zero, self.state, self.ctx.comm, sums.tail
        comm.allreduce(DP, tail.values, broken)
        z.tiers = None if z.native_reduce_scatter else self.tiers
        clip = (self.ctx.cfg.train.grad_clip, st.ties, st.segments)
        # Rank 0 reports the norm; with a native reduce-scatter every rank adds its squares.
        measure = self.ctx.cfg.logging.enabled and (comm.rank(DP) == 0 or z.native_reduce_scatter)
        count = tail.count
        z.stage(
            comm, sums.grads, step, abort=broken, before_update=before_update,
            batch_count=count, clip=clip, measure=measure,
        )  # fmt: skip
        assert z.staged is not None
        z.staged.reached_barrier = True
        commit_barrier(comm, broken)
        st.last_loss = tail.loss / count
        # as data parallelism has it: every rank when clipping took it, else rank 0 (it reports)
        clipped = self.ctx.cfg.train.grad_clip
        st.last_grad_norm = z.grad_norm if clipped or comm.rank(DP) == 0 else None
        z.commit(st.last_loss)  # every rank staged (and replicated) this step: committed
        self.forget_partial()
        st.step = step
        return tail.epoch

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Agree on the resume step, settle staged state, move shards to the new layout."""
        z, st, comm = self.zero, self.state, self.ctx.comm
        committed, staged = z.info()
        # what recovery restores: the snapshot (K > 1: its loss) or the live shard
        loss = z.snap_loss if z.keeps_params and z.snapshot_every else st.last_loss
        mine = torch.tensor(
            [committed, staged, float(z.layout_epoch), loss, float(st.step), *self.partial_row()],
            dtype=torch.float64,
            device=st.device,
        )
        rows = [r.tolist() for r in comm.allgather(DP, mine, broken)]
        with_state = [i for i, r in enumerate(rows) if r[0] >= 0]
        if not with_state:  # a fresh start: nobody holds optimizer state yet
            start = self.durable.start_over(plan, broken)
            if start is not None:
                return self.restore(plan, broken, start[0], lost_from=start[1], reason=start[2])
            stats = self._start_fresh(plan, broken)
            return {
                "resume_step": 0,
                "source_rank": 0,
                "steps": [0] * len(rows),
                "replica_holders": self.holders(),
                **stats,
            }
        resume = int(max(rows[i][0] for i in with_state))
        newest = int(max(rows[i][4] for i in with_state))  # committed, incl. rolled back
        source = next(i for i in with_state if int(rows[i][0]) == resume)  # holds ``resume``
        try:
            at = ResumePoint(rows=rows, with_state=with_state, resume=resume, source=source)
            stats = self._reshard(plan, broken, at)
        except ShardLost as exc:  # both in-memory copies gone: the durable checkpoint, if any
            chosen = self.durable.newest(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            return self.restore(plan, broken, Path(chosen), lost_from=newest, reason=str(exc))
        st.step, st.last_loss = resume, float(rows[source][3])
        z.snap_loss = st.last_loss
        steps = [int(r[4]) for r in rows]
        return {
            **self.plan_redo(plan, resume, steps, rows=[r[5:] for r in rows]),
            "replica_holders": self.holders(),
            "resume_step": resume,
            "redone_steps": newest - resume,  # committed steps rolled back to the snapshot (K > 1)
            "source_rank": source,
            "steps": [int(r[0]) for r in rows],
            **stats,
        }

    def _start_fresh(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Nobody holds state: every shard starts from its initial values."""
        z, comm = self.zero, self.ctx.comm
        return z.reshard(
            comm, (), None, new_workers=plan.workers, new_rank=comm.rank(DP), resume_step=0,
            epoch=plan.epoch, abort=broken, new_hosts=plan.domains,
        )  # fmt: skip

    def _reshard(self, plan: Plan, broken: Callable[[], bool], at: ResumePoint) -> dict[str, Any]:
        """Survivors roll back to ``at.resume`` and move their shards to the plan's layout (the
        old layout comes from rank ``at.source``); what moved."""
        z, comm = self.zero, self.ctx.comm
        rows, with_state, resume, source = at.rows, at.with_state, at.resume, at.source
        if len({int(rows[i][2]) for i in with_state}) > 1:
            raise ShardLost("ranks hold shards of different layouts (a fault while resharding)")
        z.settle(resume)
        layout = z.layout.to_json() if z.layout is not None else []
        old = comm.broadcast_json(
            DP, {"workers": z.workers, "ranges": layout, "hosts": z.hosts}, source, abort=broken
        )
        if len(with_state) < len(rows) and not z.keeps_params:
            # newcomers: full parameters from the source (K > 1 rebuilds them from chunks)
            comm.broadcast(DP, self.state.flat.data, source, abort=broken)
        stats = z.reshard(
            comm, tuple(old["workers"]), ShardLayout.from_json(z.segments, old["ranges"]),
            new_workers=plan.workers, new_rank=comm.rank(DP), resume_step=resume, epoch=plan.epoch,
            abort=broken, old_hosts=tuple(old["hosts"]), new_hosts=plan.domains,
        )  # fmt: skip
        return stats

    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Parameters, and the moments all-gathered from the shards."""
        exp_avg, exp_avg_sq = self.zero.full_state(self.ctx.comm, broken)
        return Whole(self.state.flat.data, exp_avg, exp_avg_sq)

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The whole state in: parameters kept whole, the moments as this rank's shard of a
        fresh even layout."""
        st, comm = self.state, self.ctx.comm
        self.forget_partial()
        st.flat.data.copy_(state.params)
        self.zero.restore_full(
            comm, plan.workers, comm.rank(DP), step=state.step, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, epoch=plan.epoch, abort=broken, hosts=plan.domains,
            loss=state.loss,
        )  # fmt: skip
        st.step, st.last_loss = state.step, state.loss
        return {}

    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        """Parameters voted like replicated state; every shard and replica piece against the
        checksum it was written with, bad ones repaired from the other copy."""
        z, plan = self.zero, self.ctx.plan
        found, flags = self.vote(
            [self.state.flat.data], step, broken, z.verify_own(), z.verify_replicas()
        )
        bad_own = [r for r, f in enumerate(flags) if not f[0]]
        bad_replica = [r for r, f in enumerate(flags) if not f[1]]
        if not bad_own and not bad_replica:
            return found
        workers = plan.workers if plan else ()
        ranks = bad_own + bad_replica
        self.say(
            "sdc_detected", step=step, what="zero shard copy",
            ranks=ranks, workers=[workers[r] for r in ranks],
        )  # fmt: skip
        z.repair(self.ctx.comm, bad_own, bad_replica, abort=broken)
        self.say("sdc_repaired", step=step, what="zero shard copy")
        return True

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        if target == "snapshot" and self.zero.own is not None:
            return self.zero.corrupt_target()
        return super().corrupt_target(target)

    def memory(self) -> dict[str, int]:
        """The shard's moments (and the snapshot, where it is a copy of its own) as optimizer
        state; the pieces of peers' shards as replicas."""
        out = super().memory()
        z = self.zero
        own = [t for shard in (z.own, z.snap) if shard is not None for t in shard.tensors()]
        out["optimizer_bytes"] += nbytes(*own)
        out["replica_bytes"] = nbytes(*(t for r in z.replicas.values() for t in r.tensors()))
        return out

    def holders(self) -> dict[str, list[int]]:
        """Owner rank -> ranks that keep pieces of its replica (for events and tests)."""
        out: dict[str, set[int]] = {}
        for p in self.zero.placement:
            out.setdefault(str(p.owner), set()).add(p.holder)
        return {owner: sorted(holders) for owner, holders in out.items()}
