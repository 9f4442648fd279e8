"""The ZeRO strategies, each a choice of pieces around one shard state
(:class:`~.state.ShardState`):

==========  ===========================  ==============================  =====================
strategy    data path                    parameters (and the update)     scope
==========  ===========================  ==============================  =====================
Zero1       whole model (`WholeModel`)   whole on every rank             every rank (`MeshScope`)
            (partial redo)               (:func:`~.update.update_from_whole`)
Zero3       layer gather (`LayerPath`)   in the shard                    every rank (`MeshScope`)
                                         (:func:`~.update.update_from_layers`)
HostZero3   layer gather, across hosts   in the shard                    each host (`HostScope`)
==========  ===========================  ==============================  =====================

:class:`ZeroStrategy` is what they share: the step's tail, the staged update and the commit
barrier; the agreement on the resume step and the fallback to a durable checkpoint when both
copies of a shard are gone; verification and repair of the copies.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.tiers import Tiers
from elaswave.runtime.durable.checkpoints import DurableState, Piece
from elaswave.runtime.strategies.base import (
    DP,
    Final,
    Strategy,
    Whole,
    nbytes,
    plan_tiers,
    state_digests,
    vote,
)
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.strategies.wholemodel import Accumulation, WholeModel
from elaswave.runtime.strategies.zero.holding import ParamHolding, ShardedParams, WholeParams
from elaswave.runtime.strategies.zero.layerpath import LayerPath
from elaswave.runtime.strategies.zero.scopes import HostScope, MeshScope, ResumePoint, ShardScope
from elaswave.runtime.strategies.zero.shard import ShardLost
from elaswave.runtime.strategies.zero.state import ShardState
from elaswave.runtime.strategies.zero.update import (
    Clip,
    Update,
    commit_barrier,
    stage_unchanged,
    update_from_layers,
    update_from_whole,
)
from elaswave.runtime.workload.base import initial_params
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["HostZero3", "Zero1", "Zero3", "ZeroStrategy"]


class DataPath(Protocol):
    """What a ZeRO strategy asks of its data path (:class:`WholeModel`, :class:`LayerPath`)."""

    def gradient(self, sums: StepSums) -> torch.Tensor: ...

    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None: ...

    def covered(self, step: int) -> dict[int, Sequence[int]]: ...

    def forget_partial(self) -> None: ...

    def partial_row(self) -> list[float]: ...

    def plan_redo(
        self, plan: Plan, resume: int, steps: list[int], *, rows: list[list[float]]
    ) -> dict[str, Any]: ...


class ZeroStrategy(Strategy):
    """Data parallelism over a shard state: what every ZeRO mode shares. A mode picks the
    pieces: ``holding`` (where the parameters live), ``update`` (how a step's gradient reaches
    the shard), ``scope`` (which ranks the shards span) and, once the state exists, ``path``."""

    sharded = True
    sealed = True
    path: DataPath

    def __init__(
        self,
        ctx: RankContext,
        durable: DurableSource,
        *,
        holding: ParamHolding,
        update: Update,
        scope: Callable[[RankContext, ShardState], ShardScope],
    ) -> None:
        super().__init__(ctx, durable)
        st = self.state
        self.holding, self.update = holding, update
        self.zero = ShardState(st.flat, st.opt.hyper, st.segments, holding)
        self.zero.snapshot_every = ctx.cfg.snapshot_every
        self.zero.prune = st.prune
        self.zero.compressed = ctx.cfg.train.grad_compress == "int8"
        # NCCL's reduce-scatter moves half an all-reduce's bytes; gloo's is slower than its
        # all-reduce (see ``ShardState.native_reduce_scatter``).
        self.zero.native_reduce_scatter = getattr(ctx.comm, "backend", "gloo") != "gloo"
        # a native reduce-scatter goes flat; on gloo the gradient goes by the plan's tiers
        self.tiered = not self.zero.native_reduce_scatter
        self.tiers: Tiers | None = None  # the newest plan's (train.hierarchy)
        self.scope = scope(ctx, self.zero)

    # ---- one step -------------------------------------------------------------------------------
    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        return self.path.compute(step, every, sums, slowdown=slowdown)

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        return self.path.covered(step)

    def local_gradient(self, sums: StepSums) -> torch.Tensor:
        return self.path.gradient(sums)

    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        """The step's tail, the staged shard update and its replicas, the commit barrier."""
        z, st, comm, cfg, tail = self.zero, self.state, self.ctx.comm, self.ctx.cfg, sums.tail
        comm.allreduce(DP, tail.values, broken)
        count = tail.count
        if count <= 0:
            raise ValueError("the workload's loss counted nothing in the whole batch")
        norm = None
        if tail.nonfinite:  # every rank alike: the step counts, nothing is applied
            stage_unchanged(z, comm, step, abort=broken)
        else:
            norm = self.update(
                z, comm, self.path.gradient(sums), step, count=count,
                clip=Clip(cfg.train.grad_clip, st.ties, st.segments), measure=cfg.logging.enabled,
                reporter=comm.rank(DP) == 0, abort=broken, before_update=before_update,
            )  # fmt: skip
        assert z.staged is not None
        z.staged.reached_barrier = True
        commit_barrier(comm, broken)
        st.last_loss = tail.mean_loss
        # as data parallelism has it: every rank when clipping took it, else rank 0 (it reports)
        st.last_grad_norm = norm if cfg.train.grad_clip or comm.rank(DP) == 0 else None
        z.commit(st.last_loss)  # every rank staged (and replicated) this step: committed
        self.path.forget_partial()
        st.step = step
        return tail.epoch

    # ---- a new plan -----------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Every rank, the tiers' groups (each host's ranks, each lane's) when the gradient is
        reduced by tiers, and the scope's own."""
        self.tiers = plan_tiers(self.ctx, plan, tiered=self.tiered)
        self.zero.tiers = self.tiers
        extra = self.tiers.groups(plan.workers) if self.tiers is not None else {}
        return {**super().groups(plan), **extra, **self.scope.groups(plan)}

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Agree on the resume step, settle staged state, move shards to the new layout."""
        z, st, comm = self.zero, self.state, self.ctx.comm
        committed, staged = z.info()
        # what recovery restores: the snapshot (K > 1: its loss) or the live shard
        loss = z.snap_loss if z.keeps_params and z.snapshot_every else st.last_loss
        mine = torch.tensor(
            [committed, staged, float(z.layout_epoch), loss, float(st.step),
             *self.path.partial_row()],
            dtype=torch.float64,
            device=st.device,
        )  # fmt: skip
        rows = [r.tolist() for r in comm.allgather(DP, mine, broken)]
        with_state = [i for i, r in enumerate(rows) if r[0] >= 0]
        if not with_state:  # a fresh start: nobody holds optimizer state yet
            start = self.durable.start_over(plan, broken)
            if start is not None:
                out = self.restore(plan, broken, start[0], lost_from=start[1], reason=start[2])
                return {**out, **self.scope.fields, **self.sync_fields()}
            stats = self.scope.start_fresh(plan, broken)
            return {
                "resume_step": 0,
                "source_rank": 0,
                "steps": [0] * len(rows),
                "replica_holders": self.scope.holders(),
                **stats,
                **self.scope.fields,
                **self.sync_fields(),
            }
        resume = int(max(rows[i][0] for i in with_state))
        newest = int(max(rows[i][4] for i in with_state))  # committed, incl. rolled back
        source = next(i for i in with_state if int(rows[i][0]) == resume)  # holds ``resume``
        try:
            at = ResumePoint(rows=rows, with_state=with_state, resume=resume, source=source)
            stats = self.scope.reshard(plan, broken, at)
        except ShardLost as exc:  # both in-memory copies gone: the durable checkpoint, if any
            chosen = self.durable.newest(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            out = self.restore(plan, broken, Path(chosen), lost_from=newest, reason=str(exc))
            return {**out, **self.scope.fields, **self.sync_fields()}
        st.step, st.last_loss = resume, float(rows[source][3])
        z.snap_loss = st.last_loss
        steps = [int(r[4]) for r in rows]
        return {
            **self.path.plan_redo(plan, resume, steps, rows=[r[5:] for r in rows]),
            "replica_holders": self.scope.holders(),
            "resume_step": resume,
            "redone_steps": newest - resume,  # committed steps rolled back to the snapshot (K > 1)
            "source_rank": source,
            "steps": [int(r[0]) for r in rows],
            **stats,
            **self.scope.fields,
            **self.sync_fields(),
        }

    def sync_fields(self) -> dict[str, Any]:
        """What a sync's event says of the data path."""
        return {}

    # ---- whole state ----------------------------------------------------------------------------
    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The whole state in (a durable checkpoint): this rank's shard of a fresh even layout
        over the scope's ranks (the parameter chunk too, where the shard carries one)."""
        st, comm = self.state, self.ctx.comm
        self.path.forget_partial()
        self.holding.take_whole(self.zero, state.params)
        members = self.scope.adopt(plan)
        self.zero.restore_full(
            comm, members.workers, members.index, step=state.step, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, epoch=plan.epoch, abort=broken, hosts=members.domains,
            loss=state.loss, params=state.params,
        )  # fmt: skip
        st.step, st.last_loss = state.step, state.loss
        return {}

    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        """Parameters voted like replicated state; every shard and replica piece against the
        checksum it was written with, bad ones repaired from the other copy."""
        z, plan = self.zero, self.ctx.plan
        found, flags = vote(
            self, [self.state.flat.data], step, broken, z.verify_own(), z.verify_replicas()
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

    def holders(self) -> dict[str, list[int]]:
        """Owner rank -> ranks that keep pieces of its replica (for events and tests)."""
        return self.scope.holders()


class Zero1(ZeroStrategy):
    """Data parallelism with Adam's moments sharded over the ranks (parameters replicated)."""

    fills_gradients = True  # the whole-model path copies the whole sum into sums.grads

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(
            ctx, durable, holding=WholeParams(), update=update_from_whole, scope=MeshScope
        )
        self.path: WholeModel = WholeModel(ctx)

    def accumulation(self, step: int, sums: StepSums) -> Accumulation:
        """This rank's share of ``step``, micro-batch by micro-batch (a user's own loop)."""
        return self.path.accumulation(step, sums)

    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Parameters, and the moments all-gathered from the shards."""
        exp_avg, exp_avg_sq = self.zero.full_state(self.ctx.comm, broken)
        return Whole(self.state.flat.data, exp_avg, exp_avg_sq)

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        if target == "snapshot" and self.zero.own is not None:
            return self.zero.corrupt_target()
        if target == "snapshot":
            return self.state.opt.exp_avg, "optimizer state (exp_avg)"
        return self.state.flat.data, "parameters"

    def memory(self) -> dict[str, int]:
        """The whole parameters and gradient sums; the shard's moments (and the snapshot, where
        it is a copy of its own) as optimizer state; the pieces of peers' shards as replicas."""
        out = super().memory()
        out["grad_bytes"] += self.path.extra_grad_bytes()
        z = self.zero
        own = [t for shard in (z.own, z.snap) if shard is not None for t in shard.tensors()]
        out["optimizer_bytes"] += nbytes(*own)
        out["replica_bytes"] = nbytes(*(t for r in z.replicas.values() for t in r.tensors()))
        return out


class Zero3(ZeroStrategy):
    """Data parallelism with parameters, gradients and optimizer state sharded over the ranks;
    layers gathered while they run."""

    fills_gradients = False  # each layer's reduced gradient lands in the path's buffer as it runs

    def __init__(
        self,
        ctx: RankContext,
        durable: DurableSource,
        *,
        scope: Callable[[RankContext, ShardState], ShardScope] = MeshScope,
    ) -> None:
        st = ctx.state
        self.shards = ShardedParams(partial(initial_params, st.workload, st.model.seed))
        super().__init__(ctx, durable, holding=self.shards, update=update_from_layers, scope=scope)
        across_hosts = isinstance(self.scope, HostScope)
        self.path: LayerPath = LayerPath(ctx, self.zero, self.shards, across_hosts=across_hosts)

    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        out = super().groups(plan)
        self.path.planned(plan, self.tiers)
        return out

    def sync_fields(self) -> dict[str, Any]:
        """Whether this plan's backward gathers stay inside the hosts (hpZ)."""
        return {"hpz": self.path.gather.secondary is not None}

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        self.path.score(batches, slots, broken)

    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Parameters and moments gathered from the shards (every rank then holds them whole:
        for tests and tools; checkpoints and digests never need it)."""
        z, comm = self.zero, self.ctx.comm
        exp_avg, exp_avg_sq = z.full_state(comm, broken)
        return Whole(z.gather(comm, self.shards.params(z), broken), exp_avg, exp_avg_sq)

    def final(self, broken: Callable[[], bool]) -> Final:
        """The whole state's digests, a layer at a time: no rank ever holds all of it."""
        z, comm = self.zero, self.ctx.comm
        own = z.own
        assert own is not None and own.params is not None
        tensors = (own.params, own.exp_avg, own.exp_avg_sq)

        def layers() -> Iterator[tuple[int, torch.Tensor]]:
            for part, tensor in enumerate(tensors):
                for cut in self.shards.cuts:
                    yield part, self.shards.gather_layer(z, comm, tensor, cut, abort=broken)

        return Final(*state_digests(layers()), {})

    def durable_pieces(self) -> list[Piece] | None:
        """The flat intervals this rank owns, with their parameters and moments (none where
        the scope leaves the writing to other ranks)."""
        if not self.scope.writes_durable(self.ctx.plan):
            return []
        return self.shards.pieces(self.zero) if self.zero.own is not None else None

    def known_good(self, broken: Callable[[], bool]) -> torch.Tensor:
        """This rank's shard [params | exp_avg | exp_avg_sq]: no rank keeps the whole state."""
        own = self.zero.own
        assert own is not None and own.params is not None
        return torch.cat([own.params, own.exp_avg, own.exp_avg_sq])

    def layout_key(self) -> Any:
        """A known-good shard fits only the layout (and group) it was cut from."""
        z = self.zero
        return (z.group, z.workers, z.layout.ranges if z.layout is not None else None)

    def roll_back(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> None:
        """Take the known-good shard (of this very layout) back, and its replicas."""
        self.path.forget_partial()
        self.shards.take(
            self.zero, self.ctx.comm, state.step, state.params, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, loss=state.loss, abort=broken,
        )  # fmt: skip
        self.state.step, self.state.last_loss = state.step, state.loss

    def computes_with(self) -> torch.Tensor:
        z = self.zero
        return self.shards.params(z) if z.own is not None else self.state.flat.data

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        z = self.zero
        if z.own is None:
            return self.state.flat.data, "parameters"
        if target == "snapshot":
            return z.corrupt_target()
        return self.shards.params(z), "parameter shard"

    def memory(self) -> dict[str, int]:
        """The shard (its parameters, moments, and the snapshot where it is a copy of its own),
        the step's gradient sums of the shard, the pieces of peers' shards, and the most bytes
        held at once during the last step: of gathered layers' parameters (``gathered_bytes``),
        of whole layers' gradients and their reduction's buffers (``layer_grad_bytes``), and of
        both together (``transient_bytes``)."""
        z, gather = self.zero, self.path.gather
        shards = [s for s in (z.own, z.snap) if s is not None]
        return {
            "param_bytes": nbytes(*(s.params for s in shards)),
            "grad_bytes": nbytes(self.path.grads),
            "optimizer_bytes": nbytes(*(t for s in shards for t in (s.exp_avg, s.exp_avg_sq))),
            "replica_bytes": nbytes(*(t for r in z.replicas.values() for t in r.tensors())),
            "gathered_bytes": gather.peak_params,
            "layer_grad_bytes": gather.peak_grads,
            "transient_bytes": gather.peak,
        }


class HostZero3(Zero3):
    """ZeRO-3 with each host's ranks sharing one whole copy of the state
    (``train.shard_scope: host``; :class:`~.scopes.HostScope`)."""

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable, scope=HostScope)
