"""ZeRO-3 as a strategy: parameters, gradients and optimizer state sharded over the data-parallel
ranks, elastic like ZeRO-1.

It composes two pieces: the shard state (:class:`~.paramshards.ParamShards`, ZeRO-1's shards,
snapshots and recovery, with the parameter chunk always in the shard) and the layer-wise data
path (:class:`~.gather.LayerGather`). One step:

1. ``compute``: this rank's micro-batches through the layers, each layer gathered while it runs
   and its gradient reduce-scattered as backward produces it: the rank ends with the batch's
   gradient sums of its own part (in the reduction's dtype), its loss sum and count;
2. ``reduce_update``: the step's tail (a tiny float64 all-reduce: loss sum, count, newest epoch
   seen), the mean gradient of the shard (clipping by the global norm from every rank's
   per-layer squares: one more all-reduce of a number per layer), the staged update of the shard
   (parameters and moments), the snapshot's replica pieces sent to the peers, then the commit
   barrier, exactly as ZeRO-1 commits.

Recovery is ZeRO-1's (:class:`~.sharded.Zero1`): survivors agree on the resume step, promote the
replica pieces they hold of a lost shard, newcomers receive disjoint transfers, two losses that
take both copies of a piece fall back to the durable checkpoint. An interrupted step is redone
whole: the gradient is reduced layer by layer as backward produces it, and what a rank computed
of the step leaves it as soon as each layer is reduced (keeping it would mean a whole-model
gradient per rank, which ZeRO-3 exists to avoid), so the lost rank's part of the reduced sums is
gone with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.runtime.durable.checkpoints import DurableState, Piece
from elaswave.runtime.strategies.base import DP, Final, Whole, nbytes, state_digests
from elaswave.runtime.strategies.gather import Batch, LayerGather
from elaswave.runtime.strategies.paramshards import ParamShards
from elaswave.runtime.strategies.sharded import Zero1
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.strategies.zero import ZeroState, commit_barrier
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.base import EVAL_STEP, initial_params
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["Zero3"]

# Gloo's reduce-scatter against its all-reduce for a layer's gradient (keep this rank's part):
# see docs/architecture.md, "ZeRO-3". Backends with a real reduce-scatter (NCCL) always use it.
GLOO_REDUCE_SCATTER = True


class Zero3(Zero1):
    """Data parallelism with parameters, gradients and optimizer state sharded over the ranks;
    layers gathered while they run."""

    # each layer's gradient goes by tiers where the plan has them, on gloo (an all-reduce of
    # which each rank keeps its part); NCCL's real reduce-scatter goes flat
    tiered = True
    fills_gradients = False  # each layer's reduced gradient lands in the buffer as it runs

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable)
        native = getattr(ctx.comm, "backend", "gloo") != "gloo" or GLOO_REDUCE_SCATTER
        self.path = LayerGather(ctx.state.model, ctx.comm, ctx.enter, native=native)
        self.path.compressed = ctx.cfg.train.grad_compress == "int8"
        self.path.gather_tiers = ctx.cfg.train.zero3_gather == "tiers"
        self.grads: torch.Tensor | None = None  # the step's gradient sums of this rank's part
        self.started = -1  # the step this rank began computing and has not committed
        self.computed: tuple[int, tuple[int, ...]] = (-1, ())  # (step, its micro-batches)

    @property
    def shards(self) -> ParamShards:
        assert isinstance(self.zero, ParamShards)
        return self.zero

    def make_shards(self) -> ZeroState:
        st = self.state
        initial = partial(initial_params, st.workload, st.model.seed)
        return ParamShards(st.flat, st.opt.hyper, st.segments, initial=initial)

    # ---- one step -------------------------------------------------------------------------------
    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        plan, st, t, z = self.ctx.plan, self.state, self.ctx.cfg.train, self.shards
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
        self.path.comm = self.ctx.comm
        loss, count = self.path.train(
            z, step, batches, grads=self.grads, loss_fn=st.loss, abort=self.ctx.broken, ties=st.ties
        )
        extra = len(batches) * (t.device_time + slowdown * plan.world_size / len(every))
        if extra:
            time.sleep(extra)  # emulated accelerator time (benchmarks), a ``slow`` fault
        sums.tail.loss, sums.tail.count = loss, count
        if not batches:
            return None
        # Time this rank computed: without its waits for peers' parts of a layer, and without
        # the time its thread sat waiting for a CPU.
        return max(busy_since(mark) - self.path.waited, 0.0) / len(batches)

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        """Every layer: this rank's share of the step (an interrupted step is redone whole)."""
        done, mine = self.computed
        return dict.fromkeys(range(len(self.state.model)), mine if done == step else ())

    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        """The step's tail, the staged shard update and its replicas, the commit barrier."""
        z, st, comm, cfg, tail = self.shards, self.state, self.ctx.comm, self.ctx.cfg, sums.tail
        assert self.grads is not None
        comm.allreduce(DP, tail.values, broken)
        count = tail.count
        if count <= 0:
            raise ValueError("the workload's loss counted nothing in the whole batch")
        measure = cfg.logging.enabled  # every rank adds its squares: all ask, or none
        norm = z.stage3(
            comm, self.grads, step, count=count, abort=broken, before_update=before_update,
            clip=(cfg.train.grad_clip, st.ties), measure=measure,
        )  # fmt: skip
        assert z.staged is not None
        z.staged.reached_barrier = True
        commit_barrier(comm, broken)
        st.last_loss = tail.loss / count
        # as data parallelism has it: every rank when clipping took it, else rank 0 (it reports)
        st.last_grad_norm = norm if cfg.train.grad_clip or comm.rank(DP) == 0 else None
        z.commit(st.last_loss)  # every rank staged (and replicated) this step: committed
        self.started = -1
        st.step = step
        return tail.epoch

    # ---- a new plan -----------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Data parallelism's groups; the layers' gradients go by the plan's tiers (none where
        the reduction is flat)."""
        out = super().groups(plan)
        self.path.tiers = self.tiers
        tiers = self.tiers if self.ctx.cfg.train.hpz == "auto" else None
        self.path.secondary = (
            tiers.secondary(plan.workers.index(self.ctx.worker)) if tiers else None
        )
        return out

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """ZeRO-1's, and whether this plan's backward gathers stay inside the hosts (hpZ)."""
        return {**super().sync(plan, broken), "hpz": self.path.secondary is not None}

    def partial_row(self) -> list[float]:
        """[the step this rank began and did not commit (-1: none), then nothing kept]."""
        t = self.ctx.cfg.train
        return [float(self.started)] + [0.0] * (t.global_batch // t.micro_batch_size)

    def plan_redo(
        self, plan: Plan, resume: int, steps: list[int], *, rows: list[list[float]]
    ) -> dict[str, Any]:
        """An interrupted step is computed again whole (see the module docstring): for the
        event, the micro-batches each rank computes of it."""
        self.partial, self.redo, self.started = None, None, -1
        if not any(int(row[0]) == resume + 1 for row in rows):
            return {}
        return {
            "redo_step": resume + 1,
            "kept_microbatches": dict.fromkeys(plan.workers, 0),
            "redo_microbatches": {
                w: list(plan.microbatch_range(r)) for r, w in enumerate(plan.workers)
            },
        }

    # ---- whole state ----------------------------------------------------------------------------
    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Parameters and moments gathered from the shards (every rank then holds them whole:
        for tests and tools; checkpoints and digests never need it)."""
        z, comm = self.shards, self.ctx.comm
        exp_avg, exp_avg_sq = z.full_state(comm, broken)
        return Whole(z._gather(comm, z.params, broken), exp_avg, exp_avg_sq)

    def final(self, broken: Callable[[], bool]) -> Final:
        """The whole state's digests, a layer at a time: no rank ever holds all of it."""
        z, comm = self.shards, self.ctx.comm
        own = z.own
        assert own is not None and own.params is not None
        tensors = (own.params, own.exp_avg, own.exp_avg_sq)

        def layers() -> Iterator[tuple[int, torch.Tensor]]:
            for part, tensor in enumerate(tensors):
                for cut in z.cuts:
                    yield part, z.gather_layer(comm, tensor, cut, abort=broken)

        return Final(*state_digests(layers()), {})

    def durable_pieces(self) -> list[Piece] | None:
        """The flat intervals this rank owns, with their parameters and moments."""
        return self.shards.pieces() if self.shards.own is not None else None

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        """Micro-batch ``i`` on rank ``i mod world``, every layer gathered once."""
        st, comm = self.state, self.ctx.comm
        rank, world = comm.rank(DP), comm.size(DP)
        mine = range(rank, len(batches), world)
        runs = [Batch(i, *st.microbatch(batches[i])) for i in mine]
        self.path.comm = comm
        scores = self.path.score(self.shards, runs, st.score, step=EVAL_STEP, abort=broken)
        for i, score in zip(mine, scores, strict=True):
            slots[3 * i : 3 * i + 3] = torch.tensor(score, dtype=slots.dtype)

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The whole state in (a durable checkpoint): this rank's shard of a fresh even layout."""
        st, comm = self.state, self.ctx.comm
        self.forget_partial()
        self.zero.restore_full(
            comm, plan.workers, comm.rank(DP), step=state.step, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, epoch=plan.epoch, abort=broken, hosts=plan.domains,
            loss=state.loss, params=state.params,
        )  # fmt: skip
        st.step, st.last_loss = state.step, state.loss
        return {}

    # ---- integrity ------------------------------------------------------------------------------
    def known_good(self, broken: Callable[[], bool]) -> torch.Tensor:
        """This rank's shard [params | exp_avg | exp_avg_sq]: no rank keeps the whole state."""
        own = self.shards.own
        assert own is not None and own.params is not None
        return torch.cat([own.params, own.exp_avg, own.exp_avg_sq])

    def layout_key(self) -> Any:
        """A known-good shard fits only the layout it was cut from."""
        z = self.shards
        return (z.workers, z.layout.ranges if z.layout is not None else None)

    def roll_back(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> None:
        """Take the known-good shard (of this very layout) back, and its replicas."""
        self.forget_partial()
        self.started = -1
        self.shards.take(
            self.ctx.comm, state.step, state.params, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, loss=state.loss, abort=broken,
        )  # fmt: skip
        self.state.step, self.state.last_loss = state.step, state.loss

    def computes_with(self) -> torch.Tensor:
        z = self.shards
        return z.params if z.own is not None else self.state.flat.data

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        z = self.shards
        if z.own is None:
            return self.state.flat.data, "parameters"
        if target == "snapshot":
            return z.corrupt_target()
        return z.params, "parameter shard"

    def memory(self) -> dict[str, int]:
        """The shard (its parameters, moments, and the snapshot where it is a copy of its own),
        the step's gradient sums of the shard, the pieces of peers' shards, and the most bytes
        held at once during the last step: of gathered layers' parameters (``gathered_bytes``),
        of whole layers' gradients and their reduction's buffers (``layer_grad_bytes``), and of
        both together (``transient_bytes``)."""
        z = self.shards
        shards = [s for s in (z.own, z.snap) if s is not None]
        return {
            "param_bytes": nbytes(*(s.params for s in shards)),
            "grad_bytes": nbytes(self.grads),
            "optimizer_bytes": nbytes(*(t for s in shards for t in (s.exp_avg, s.exp_avg_sq))),
            "replica_bytes": nbytes(*(t for r in z.replicas.values() for t in r.tensors())),
            "gathered_bytes": self.path.peak_params,
            "layer_grad_bytes": self.path.peak_grads,
            "transient_bytes": self.path.peak,
        }
