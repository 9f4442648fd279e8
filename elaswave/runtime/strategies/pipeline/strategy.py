"""Pipeline stages as a strategy: the 1F1B step of this rank's stage
(:class:`~elaswave.runtime.strategies.pipeline.stage.Pipeline`), each layer's gradient summed
among its holders (:mod:`~elaswave.planning.gradgroups`; the reductions are
:mod:`~elaswave.runtime.strategies.pipeline.stagegrads`'), the update of the held layers
(replicated or ZeRO stage state), and the takeover of layers on a new layout.

While an asynchronous migration runs, the ranks taking layers over replay the gradients of layers
they do not hold yet: until the switch every layer's gradient is summed over every rank, a
bounded chunk of the model at a time (each rank brings the layers it allocates and zeros for the
rest), so no rank allocates the whole model."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elaswave import wire
from elaswave.planning.pipeplan import serving_shares
from elaswave.planning.plan import Plan
from elaswave.planning.redo import StageRedo
from elaswave.planning.stageshards import LayersLost, holder_blocks
from elaswave.runtime.durable.checkpoints import DurableState, Piece
from elaswave.runtime.optim import Spans, free, freed
from elaswave.runtime.prunehook import Holding
from elaswave.runtime.strategies.base import (
    DP,
    Final,
    Strategy,
    Whole,
    mean_gradient,
    nbytes,
    reduction_dtype,
    state_digests,
)
from elaswave.runtime.strategies.pipeline import stageverify
from elaswave.runtime.strategies.pipeline.stage import Pipeline
from elaswave.runtime.strategies.pipeline.stagegrads import (
    WHOLE_CHUNK,
    GradLayout,
    RankGrads,
    chunks,
    reduce_among_holders,
    reduce_over_everyone,
)
from elaswave.runtime.strategies.pipeline.stageredo import StageKept, agree, kept_row
from elaswave.runtime.strategies.pipeline.stagestate import unpack_into
from elaswave.runtime.strategies.pipeline.stagesync import MIG
from elaswave.runtime.strategies.sums import StepSums
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
        self.grads: GradLayout | None = None  # the newest plan's reductions
        self.my_grads: RankGrads | None = None  # this rank's part of them, once the plan applies
        # each tied weight's first copy -> its second (a rank that holds only the second brings
        # the weight's gradient from there)
        self.second_copy = {(a.start, a.stop): (b.start, b.stop) for a, b in ctx.state.ties}
        # A partial redo: what this stage's accumulator holds of a step not committed yet, the
        # float64 accumulator (the float64 reduction), and the agreed redo of an interrupted step
        self.kept: StageKept | None = None
        self._acc: torch.Tensor | None = None
        self.redo: tuple[int, StageRedo] | None = None
        self._switches = 0  # asynchronous migrations switched to their layout (every rank alike)

    def ready(self) -> dict[str, Any]:
        """The leader partitions with the workload's estimate, or with what the layers measured,
        and with what each layer weighs on the stage that holds it."""
        out: dict[str, Any] = {
            "layer_estimate": list(self.pipe.costs),
            "layer_bytes": list(self.pipe.layer_bytes),
        }
        if self.ctx.cfg.layer_costs in ("profile", "online"):
            out["layer_seconds"] = self.pipe.profile_layers()
        return out

    def memory(self) -> dict[str, int]:
        """ZeRO inside the stages: the moments of the parts this rank keeps; the pre-update
        copies of the held layers (a rollback's source) as copies kept for recovery. ZeRO-3:
        the parameters of those parts, and the window (the held layers' parameters and their
        gradients, freed between steps) as gathered and transient bytes."""
        out = super().memory()
        pipe = self.pipe
        out["optimizer_bytes"] += nbytes(pipe.store.exp_avg, pipe.store.exp_avg_sq)
        undo = pipe.undo
        out["replica_bytes"] = nbytes(*(copy for _, copy in undo.saved)) if undo else 0
        if pipe.zero3:
            flat, reduce = self.state.flat, reduction_dtype(self.ctx.cfg.train.reduce_dtype)
            window = flat.numel * flat.data.element_size()
            # the step's gradient: the window's, the reduction buffer, and in a float64
            # reduction the accumulator beside them (all freed after the update)
            grads = window + flat.numel * reduce.itemsize
            if reduce != flat.grad.dtype:
                grads += flat.numel * reduce.itemsize
            out.update(
                param_bytes=nbytes(pipe.store.params), grad_bytes=0, gathered_bytes=window,
                layer_grad_bytes=grads, transient_bytes=window + grads,
            )  # fmt: skip
        return out

    def held_here(self) -> list[tuple[int, torch.Tensor]]:
        """ZeRO-3: the parts this rank keeps (its window is freed between steps)."""
        store = self.pipe.store
        if store.params is None:
            return super().held_here()
        return list(enumerate(store.arrays))

    # ---- one step -----------------------------------------------------------------------------
    def before_step(self) -> None:
        self.pipe.fit_window()

    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        plan = self.ctx.plan
        assert plan is not None
        redo = self.redo[1] if self.redo is not None and self.redo[0] == step else None
        kept, acc = self._accumulator(step, sums.grads, continued=redo is not None)
        slow = slowdown * len(plan.replicas) / len(every)  # per micro-batch
        self.pipe.fill(self._broken)  # ZeRO-3: the held layers gathered for the step
        per_mb = self.pipe.run_step(
            step, sums, list(every), broken=self._broken, kept=kept, acc=acc, redo=redo, slow=slow
        )
        sums.tail.flag = self.pipe.ready_flag
        return None if redo is not None else per_mb  # a redo's share says nothing of speed

    def _accumulator(
        self, step: int, buf: torch.Tensor, continued: bool
    ) -> tuple[StageKept, torch.Tensor | None]:
        """The record of this stage's sums for ``step`` and the float64 accumulator (``None``:
        autograd's gradient buffer accumulates): the kept ones when ``continued`` (a redo) and
        this rank kept its sums, else new and zeroed."""
        st, layers = self.state, self.pipe.target
        region = self.pipe.span(layers)
        size = region.stop - region.start
        acc = None
        if buf.dtype != st.flat.grad.dtype:
            acc = self._acc
            if acc is None or acc.numel() != size or acc.dtype != buf.dtype or freed(acc):
                self._acc = buf.new_zeros(size)
            acc = self._acc
        kept = self.kept
        if not continued or kept is None or kept.step != step:
            st.flat.collect_grads().zero_()  # re-pointed first, as autograd may replace one
            if acc is not None:
                acc.zero_()
            loss = torch.zeros((), dtype=torch.float64, device=st.device)
            kept = self.kept = StageKept(step, layers, self._window(), loss=loss)
        return kept, acc

    def _window(self) -> tuple[Any, ...]:
        """What the accumulator's sums live in: they survive a new plan only if it is the same."""
        flat, acc = self.state.flat, self._acc
        return (
            flat.base,
            flat.numel,
            flat.grad.data_ptr(),
            acc.data_ptr() if acc is not None else 0,
        )

    def forget_partial(self) -> None:
        """The state changed under the kept sums (a restore, a rollback): drop them."""
        self.kept, self.redo = None, None

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        """The stage's layers: the micro-batches whose gradients each one holds."""
        kept = self.kept
        return dict(kept.has) if kept is not None and kept.step == step else {}

    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        st, pipe, ctx = self.state, self.pipe, self.ctx
        sumsq = None
        if ctx.cfg.grad_reduce == "all":  # the comparison mode: every rank holds every layer
            ctx.comm.allreduce_many([(DP, sums.grads), (DP, sums.tail.values)], broken)
        elif pipe.migration is None:
            sumsq = reduce_among_holders(
                ctx.comm, sums, broken, state=st, mine=self.my_grads, plan=ctx.plan,
                second_copy=self.second_copy,
            )  # fmt: skip
        else:  # receivers replay every layer they take over: the whole model's gradient
            sumsq = reduce_over_everyone(ctx.comm, sums, broken, state=st, mine=self.my_grads)
        self.forget_partial()  # reduced: every rank holds the step's sums of its layers
        if sums.tail.nonfinite:  # every rank alike: the step counts, nothing is applied (a
            pipe.skip(step)  # migration's replay misses it too: it never queued its gradient)
            st.step, st.last_loss, st.last_grad_norm = step, sums.tail.mean_loss, None
        else:
            ctx.enter("compute")
            clip = ctx.cfg.train.grad_clip
            # the norm for the job's curves: a collective here (``sumsq``), so every rank asks
            # for it or none (``logging`` is a section every host agrees on)
            measure = ctx.cfg.logging.enabled
            grad, loss, norm = mean_gradient(
                sums, max_norm=clip, ties=st.ties, segments=st.segments, sumsq=sumsq,
                measure=measure,
            )  # fmt: skip
            pipe.update(
                step, grad, broken, before_gather=before_update, finish=self._pruning(step, broken)
            )
            st.step, st.last_loss, st.last_grad_norm = step, loss, norm
        switched = pipe.after_step(step, sums.tail.flag)
        epochs = sums.tail.epoch
        if pipe.zero3:  # no gradient outlives the step: the next one allocates its buffers
            for t in (sums.grads, self._acc):
                if t is not None:
                    free(t)
        if switched is not None:
            assert ctx.plan is not None
            self.say("migration_done", epoch=ctx.plan.epoch, **switched)
            self._switches += 1
            self._set_clocks()
        return epochs

    def _broken(self) -> bool:
        return self.ctx.broken()

    def _pruning(self, step: int, broken: Callable[[], bool]) -> Callable[[], None]:
        """Pruning on the held layers once they are updated (nothing where step ``step`` does not
        prune): each layer's group sums from its first holder under the plan, added over every
        rank, so all ranks decide alike (:class:`~elaswave.runtime.prunehook.Holding`)."""
        st, pipe, mine, prune = self.state, self.pipe, self.my_grads, self.state.prune
        if prune is None or not prune.active(step):
            return lambda: None
        assert mine is not None
        held = pipe.span(pipe.held) if pipe.held else slice(st.flat.base, st.flat.base)
        old = prune.before(step, Spans(st.params[held], held.start))
        holding = Holding(
            held=lambda layer: pipe.held is not None and layer in pipe.held,
            counted=lambda layer: mine.counted[layer],
            reduce=lambda sums: self.ctx.comm.allreduce(DP, sums, broken),
        )
        lr = st.opt.hyper.lr_at(step)
        return lambda: prune.after(step, old, st.params, lr=lr, holding=holding)

    # ---- a new plan ---------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """The training group, the migrations' group beside it, and one group per holder set
        (kept from plan to plan while its holders are the same)."""
        hierarchy = self.ctx.cfg.train.hierarchy
        self.grads = GradLayout.of(plan, self.pipe.offsets, self.state.ties, hierarchy=hierarchy)
        return {DP: plan.workers, MIG: plan.workers, **self.grads.groups(plan)}

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The stage takeover; ``--resume`` and the durable fallback when every holder of some
        layer is gone."""

        def start_from() -> DurableState | None:
            start = self.durable.start_over(plan, broken)
            return self.durable.load(*start) if start is not None else None

        step_before = self.state.step
        try:
            # pruning reads every layer's current values each step, and ZeRO-3 moves only
            # its intervals (every layer is gathered each step anyway): layers move blocking
            moving = (
                self.ctx.cfg.migration == "async"
                and self.state.prune is None
                and not self.pipe.zero3
            )
            info = self.pipe.sync(plan, broken, moving, start_from=start_from)
        except LayersLost as exc:
            chosen = self.durable.newest(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            state = self.durable.load(Path(chosen), self.state.step, str(exc))
            info = self.pipe.restore_whole(plan, state)
            self.forget_partial()
        info.update(self._agree_redo(plan, step_before, broken))
        assert self.grads is not None
        self.my_grads = self.grads.of_rank(self.ctx.comm.rank(DP), self.state.segments)
        element = reduction_dtype(self.ctx.cfg.train.reduce_dtype).itemsize
        # What this rank reduces each step once the layout is in force (k members, n elements
        # per group) and what a ring all-reduce sends for it: 2 (k - 1) / k of the group's bytes.
        groups = [(len(r.members), r.numel) for _, r in self.my_grads.mine]
        if self.ctx.cfg.grad_reduce == "all":  # one all-reduce of the whole buffer
            groups = [(plan.world_size, self.state.flat.total)]
        info.update(
            grad_groups=len(groups),
            grad_reduce_bytes=sum(n for _, n in groups) * element,
            grad_sent_bytes=round(sum(2 * (k - 1) / k * n for k, n in groups) * element),
        )
        return info

    def _agree_redo(
        self, plan: Plan, step_before: int, broken: Callable[[], bool]
    ) -> dict[str, Any]:
        """After the layout is agreed: which micro-batches of the interrupted step (the one
        after the resume step) each replica computes again (``train.partial_redo``). A rank
        offers its kept sums when its stage kept its layers and buffers and had not gone past
        the resume step. What is redone, for the event (nothing when no step was interrupted)."""
        st, pipe, cfg = self.state, self.pipe, self.ctx.cfg.train
        if not cfg.partial_redo:  # the same on every rank: no records to gather
            self.kept, self.redo = None, None
            return {}
        resume, kept = st.step, self.kept
        layers, total = pipe.num_layers, cfg.global_batch // cfg.micro_batch_size
        roles = plan.roles(self.ctx.comm.rank(DP))
        usable = (
            kept is not None
            and kept.step == resume + 1
            and step_before == resume
            and kept.layers == pipe.held == pipe.target
            and all(pipe.serving[d] for d, _ in roles)
            and kept.window == self._window()
        )
        mine = torch.tensor(kept_row(kept, usable, total, layers=layers), dtype=torch.float64,
                            device=st.device)  # fmt: skip
        rows = [r.tolist() for r in self.ctx.comm.allgather(DP, mine, broken)]

        def split(n: int) -> tuple[int, ...]:  # balanced like the step: 1F1B time, bubble too
            return serving_shares(plan, pipe.serving, pipe.costs, total=n)

        redo = agree(rows, total, layers, split=split)
        self.redo = (resume + 1, redo) if redo is not None else None
        if not usable or redo is None:
            self.kept = None  # the step starts from zero
        if not any(row[0] for row in rows) or redo is None:
            return {}
        workers = plan.workers
        return {
            "redo_step": resume + 1,
            "kept_microbatches": {
                workers[r]: sum(
                    all(row[1 + j * total + i] for j in plan.stage_layers(r)) for i in range(total)
                )
                for r, row in enumerate(rows)
            },  # fmt: skip
            "redo_replicas": [list(share) for share in redo.shares],
            "microbatches": total,
        }

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
                wire.LayerCosts(
                    step=step,
                    epoch=plan.epoch,
                    layer_seconds={str(i): x for i, x in seconds.items()},
                )
            )

    # ---- whole state --------------------------------------------------------------------------
    def whole(self, broken: Callable[[], bool]) -> Whole:
        """Stages hold different layers: the whole model assembled from the holders."""
        whole, agree = self.pipe.assemble(broken)
        params, exp_avg, exp_avg_sq = whole.chunk(3)
        return Whole(params, exp_avg, exp_avg_sq, {"holders_agree": agree})

    def final(self, broken: Callable[[], bool]) -> Final:
        """The whole state hashed a chunk at a time: no rank ever holds all of it."""
        pieces, agree = self.pipe.contributions(broken)
        n, ctx = self.state.flat.total, self.ctx
        dtype = self.state.flat.data.dtype

        def chunks_of_whole() -> Iterator[tuple[int, torch.Tensor]]:
            for part in range(3):
                for a, b, _, _ in chunks(n, WHOLE_CHUNK, 0, hi=0):
                    chunk = torch.zeros(b - a, dtype=dtype, device=self.state.device)
                    for p, x, y, tensor in pieces:
                        lo, hi = max(a, x), min(b, y)
                        if p == part and lo < hi:
                            chunk[lo - a : hi - a] = tensor[lo - x : hi - x]
                    ctx.comm.allreduce(DP, chunk, broken)
                    yield part, chunk

        return Final(*state_digests(chunks_of_whole()), {"holders_agree": agree})

    def durable_pieces(self) -> list[Piece] | None:
        """The layers this rank is the first holder of (with ZeRO inside the stages: the moment
        parts it is primary of, with their parameters): each element written by one rank.
        While an asynchronous migration runs, of the layers ranks hold until the switch (ZeRO:
        the parts they keep until then)."""
        pipe, st, grads = self.pipe, self.state, self.grads
        if grads is None:
            return None
        rank, params = self.ctx.comm.rank(DP), st.params
        if pipe.zero:
            out: list[Piece] = []
            for (a, b), keepers in pipe.parts:
                if keepers[0] == rank and b > a:
                    kept = pipe.store.views(a, b)  # ZeRO-3: the parameters are the store's
                    out.append((a, b, kept[0] if pipe.zero3 else params[a:b], kept[-2], kept[-1]))
            return out
        m, v = st.exp_avg, st.exp_avg_sq
        blocks = grads.blocks
        if pipe.migration is not None:
            blocks = tuple(holder_blocks(pipe.migration.held_by, pipe.offsets))
        return [
            (blk.start, blk.stop, params[blk.start : blk.stop], m[blk.start : blk.stop],
             v[blk.start : blk.stop])
            for blk in blocks
            if blk.holders[0] == rank
        ]  # fmt: skip

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        """Micro-batch ``i`` through the stages of serving replica ``i mod replicas`` (those out
        of service while layers migrate score nothing), forward only: no rank needs a layer it
        does not hold."""
        self.pipe.fill(broken)  # ZeRO-3: the held layers gathered (kept for the next step)
        self.pipe.score(batches, slots, broken)

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        self.forget_partial()
        return self.pipe.restore_whole(plan, state)

    def _kept_tensors(self) -> list[torch.Tensor]:
        """The tensors of the units this rank keeps current (its held layers' parameters, their
        moments or, ZeRO inside the stages, its moment parts), in unit order."""
        pipe = self.pipe
        return [t for u in sorted(stageverify.kept(pipe)) for t in stageverify.tensors(pipe, u)]

    def known_good(self, broken: Callable[[], bool]) -> torch.Tensor:
        """The units this rank keeps, one after another: no rank keeps the whole."""
        kept = [t.reshape(-1) for t in self._kept_tensors()]
        return torch.cat(kept) if kept else self.state.flat.data.new_empty(0)

    def layout_generation(self) -> Any:
        """The plan and the migrations switched under it; ``None`` while layers migrate."""
        plan = self.ctx.plan
        if self.pipe.migration is not None or plan is None:
            return None
        return (plan.epoch, self._switches)

    def layout_key(self) -> Any:
        """A stage's known-good state fits only the layers it was taken from: the plan's
        members, the held and target layers and the moment parts' keepers; never while layers
        migrate (each call a new key: nothing taken then is kept)."""
        pipe, plan = self.pipe, self.ctx.plan
        if pipe.migration is not None or plan is None:
            return object()
        return (plan.workers, plan.bounds, pipe.held, pipe.target, tuple(pipe.parts))

    def take_known_good(
        self, step: int, loss: float, good: torch.Tensor, *, plan: Plan, broken: Callable[[], bool]
    ) -> None:
        """Each unit back from this rank's own known-good copy (same layout: nothing moves)."""
        self.forget_partial()
        tensors = self._kept_tensors()
        assert sum(t.numel() for t in tensors) == good.numel(), (
            "a known-good state of another layout"
        )
        unpack_into(good, tensors)
        self.pipe.undo = None
        self.state.step, self.state.last_loss = step, loss
        stageverify.record(self.pipe, step)  # what the next check compares with

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
        if pipe.store.params is not None:  # ZeRO-3: between steps only the store's intervals
            return pipe.store.params
        return self.state.params[pipe.span(pipe.held) if pipe.held else slice(0, 0)]

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        """What this rank keeps current: its held layers (or their kept moments)."""
        pipe, st = self.pipe, self.state
        if pipe.store.params is not None and target != "snapshot":
            return pipe.store.params, "parameter shard"
        if not pipe.held:
            if target == "snapshot":
                return st.opt.exp_avg, "optimizer state (exp_avg)"
            return st.flat.data, "parameters"
        held = pipe.span(pipe.held)
        if target != "snapshot":
            return st.params[held], "parameters"
        if pipe.zero:
            return pipe.store.exp_avg, "optimizer state (exp_avg)"
        return st.exp_avg[held], "optimizer state (exp_avg)"
