"""The strategy interface: how a rank computes, reduces and updates one step, and how it keeps its
state across plans.

The engine's loop drives exactly one :class:`Strategy` (replicated data parallelism, ZeRO-1, or a
pipeline stage with replicated or ZeRO stage state) and never branches on which. A strategy
works on the rank's :class:`~elaswave.runtime.state.TrainState` through its
:class:`~elaswave.runtime.state.RankContext`; it never sees the engine.

One step, as the engine drives it::

    per_mb = strategy.compute(step, micro_batches, sums, slowdown=slowdown)  # forward + backward
    epochs = strategy.reduce_update(step, sums, broken, before_update=hook)  # reduce, then update

A new plan: ``groups(plan)`` names the process groups, ``sync(plan, broken)`` brings this rank's
state to the plan's resume step (from peers, else from a durable checkpoint), ``after_apply``
runs once the plan is in force. Integrity and durability: ``whole`` (the whole state, assembled
or gathered: a collective), ``adopt`` (take a whole state), ``roll_back`` (take the known-good
state), ``verify`` (compare copies, repair, say what was found), ``computes_with`` (what the
seal covers), ``corrupt_target`` (where an injected flip lands).
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.plan import Plan
from elaswave.planning.tiers import Tiers, tiers_of
from elaswave.runtime.durable.checkpoints import DurableState, Piece
from elaswave.runtime.integrity.checksums import digest, host_bytes
from elaswave.runtime.integrity.verify import judge
from elaswave.runtime.optim import clip_scale, global_norm, layer_sumsq
from elaswave.runtime.strategies.sums import StepSums, StepTail
from elaswave.runtime.workload.base import EVAL_STEP
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext, TrainState

DP = "dp"  # the training group: every rank of the plan

__all__ = [
    "DP", "Final", "StepSums", "StepTail", "Strategy", "Whole", "mean_gradient", "nbytes",
    "plan_tiers", "reduction_buffer", "state_digests", "step_sums", "vote",
]  # fmt: skip


def nbytes(*tensors: torch.Tensor | None) -> int:
    """Bytes of ``tensors``' storages, each storage counted once (views share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def reduction_dtype(reduce_dtype: str) -> torch.dtype:
    """The dtype gradients are summed in (``train.reduce_dtype``)."""
    return torch.float64 if reduce_dtype == "float64" else torch.float32


def reduction_buffer(state: TrainState, reduce_dtype: str) -> torch.Tensor:
    """A zeroed gradient-sum buffer for ``state`` on its device, in the reduction dtype."""
    dtype = reduction_dtype(reduce_dtype)
    return state.flat.data.new_zeros(state.flat.numel, dtype=dtype)


def step_sums(state: TrainState, reduce_dtype: str) -> StepSums:
    """A step's zeroed sums for ``state``: gradient sums and tail."""
    return StepSums(reduction_buffer(state, reduce_dtype), StepTail(state.flat.data.device))


def mean_gradient(
    sums: StepSums,
    *,
    max_norm: float = 0.0,
    ties: Sequence[tuple[slice, slice]] = (),
    segments: Sequence[tuple[int, int]] | None = None,
    sumsq: Callable[[torch.Tensor], torch.Tensor] | None = None,
    measure: bool = False,
) -> tuple[torch.Tensor, float, float | None]:
    """After the reduction: the gradient of the batch's mean loss (float32, ``sums.grads``
    divided in place by the reduced count, clipped to ``max_norm`` by its global norm when that
    is set), the mean loss, and that global norm before clipping (None unless clipping or
    ``measure`` asks for it). Every rank divides the same sums by the same count, so every
    rank's update is the same whatever its share of the batch. ``sumsq``: each layer's squared
    norm of the mean gradient (default: from this rank's whole buffer; a pipeline rank holds
    only its layers, and its ``sumsq`` is a collective: every rank must ask for the norm, or
    none)."""
    count = sums.tail.count
    if count <= 0:
        raise ValueError("the workload's loss counted nothing in the whole batch")
    mean = sums.grads.div_(count)
    n = mean.numel()
    factor, norm = 1.0, None
    if max_norm or measure:
        layers = segments or ((0, n),)
        squares = sumsq(mean) if sumsq is not None else layer_sumsq(mean, layers, ties)
        norm = global_norm(squares)
        if max_norm:
            factor = clip_scale(norm, max_norm)
    grad = mean if mean.dtype == torch.float32 else mean.to(torch.float32)
    if factor < 1.0:
        grad.mul_(factor)
    return grad, sums.tail.loss / count, norm


def state_digests(pieces: Iterable[tuple[int, torch.Tensor]]) -> tuple[str, str]:
    """SHA-256 of the parameters and of [params | exp_avg | exp_avg_sq], from consecutive
    pieces of the whole state in order: ``(part, tensor)``, part 0 parameters, 1 and 2 the
    moments (any cut into pieces gives the same digests)."""
    params, state = hashlib.sha256(), hashlib.sha256()
    for part, tensor in pieces:
        data = host_bytes(tensor)
        if part == 0:
            params.update(data)
        state.update(data)
    return params.hexdigest(), state.hexdigest()


@dataclass
class Final:
    """The whole state's digests at the end of a run (the same on every rank), what the holders
    agree on, and the whole state itself where the strategy assembled it (None: a pipeline
    hashes it a chunk at a time and never holds it whole)."""

    params_sha256: str
    state_sha256: str
    checks: dict[str, bool]
    whole: Whole | None = None


@dataclass
class Whole:
    """The whole model's training state as one rank sees it after a collective (parameters and
    both Adam moments, possibly views of the rank's own buffers)."""

    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    checks: dict[str, bool] = field(default_factory=dict)  # e.g. whether layer holders agree

    def copy(self) -> torch.Tensor:
        """[params | exp_avg | exp_avg_sq] in one new tensor."""
        return torch.cat([self.params, self.exp_avg, self.exp_avg_sq])


class Strategy(ABC):
    """How one rank trains. ``sums`` are the step's sums (:class:`StepSums`): the gradient
    sums, laid out like the state's flat buffers (the whole model, or a pipeline rank's window
    of layers), and the tail record (loss, epoch, flag, count)."""

    sharded = False  # the update has a phase of its own (ZeRO): faults can aim at it
    # Parameters are overwritten from peers after every update (ZeRO gathers them): a bit flipped
    # at rest is gone from the copies a step later and only the seal can see it. Without that,
    # a flip stays in the copy it hit until the next check compares the copies.
    sealed = False
    # ``compute`` writes every element of ``sums.grads`` (a copy of its own sums): the engine
    # zeroes only the tail before a step, not the whole buffer again.
    fills_gradients = False

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        self.ctx = ctx
        self.state = ctx.state
        self.durable = durable

    # ---- one step -----------------------------------------------------------------------------
    @abstractmethod
    def compute(
        self, step: int, every: Sequence[MicroBatch], sums: StepSums, *, slowdown: float
    ) -> float | None:
        """Forward and backward over this rank's share of ``every`` (the step's micro-batches):
        the gradients of the loss sums, the loss sums and their counts added into ``sums``;
        ``slowdown``: extra seconds an injected slow fault adds to the step. Returns this rank's
        compute seconds per micro-batch."""

    @abstractmethod
    def reduce_update(
        self,
        step: int,
        sums: StepSums,
        broken: Callable[[], bool],
        *,
        before_update: Callable[[], None],
    ) -> int:
        """Reduce ``sums`` over the plan's ranks, apply the update, set the state's step and
        loss. Returns the reduced "newest epoch seen" sum (the engine switches plans when it
        says some rank saw a newer one)."""

    def local_gradient(self, sums: StepSums) -> torch.Tensor:
        """The gradient sums this rank brings to the step's reduction (judged finite or not
        before it): the step's buffer (ZeRO-3: the rank's part, reduced as it computed)."""
        return sums.grads

    def covered(self, step: int) -> dict[int, Sequence[int]]:
        """Which micro-batches of ``step`` this rank's reduction holds the gradients of, per
        layer (layer -> micro-batch ids): the rows of the norm layers' batch statistics it adds
        to the step's sum (:mod:`elaswave.runtime.runningstats`)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no running statistics")

    def before_step(self) -> None:  # noqa: B027 (an optional hook)
        """Before a step's buffer is sized and zeroed: the state may change its flat layout
        (a pipeline rank frees layers it no longer needs)."""

    # ---- a new plan ---------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """The process groups this strategy needs under ``plan``."""
        return {DP: plan.workers}

    @abstractmethod
    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Bring this rank's state to the plan's resume step; what moved, for the event."""

    def after_apply(self, plan: Plan) -> None:  # noqa: B027 (an optional hook)
        """``plan`` is in force (it is the context's plan now)."""

    def after_commit(self, step: int) -> None:  # noqa: B027 (an optional hook)
        """``step`` is committed (reports that go with it)."""

    def ready(self) -> dict[str, Any]:
        """What the worker's ready message tells the leader before the first plan."""
        return {}

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds, by purpose: parameters, gradients (the engine adds its
        reduction buffer), optimizer state, copies kept for recovery (``replica_bytes``: ZeRO
        replica pieces of peers' shards, a pipeline's pre-update copies), and the most bytes of
        whole layers' parameters gathered at once during a step (``gathered_bytes``), of whole
        layers' gradients (``layer_grad_bytes``) and of both (``transient_bytes``): ZeRO-3 only."""
        st = self.state
        return {
            "param_bytes": nbytes(st.flat.data),
            "grad_bytes": nbytes(st.flat.grad),
            "optimizer_bytes": nbytes(st.opt.exp_avg, st.opt.exp_avg_sq),
            "replica_bytes": 0,
            "gathered_bytes": 0,
            "layer_grad_bytes": 0,
            "transient_bytes": 0,
        }

    # ---- whole state: integrity and durability ------------------------------------------------
    @abstractmethod
    def whole(self, broken: Callable[[], bool]) -> Whole:
        """The whole training state (a collective: every rank of the plan calls it)."""

    def final(self, broken: Callable[[], bool]) -> Final:
        """The whole state's digests at the end of a run (a collective)."""
        whole = self.whole(broken)
        params, state = state_digests(
            [(0, whole.params), (1, whole.exp_avg), (2, whole.exp_avg_sq)]
        )
        return Final(params, state, whole.checks, whole)

    def durable_pieces(self) -> list[Piece] | None:
        """What this rank writes of a durable checkpoint: the flat intervals it owns, with their
        parameters and moments (every rank of the plan writes its own; pipelines), or None:
        rank 0 writes the whole state from :meth:`whole` (the same answer on every rank)."""
        return None

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        """Held-out evaluation (the model in eval mode, no gradients): the (loss sum, count,
        top-1 hits) of each micro-batch this rank scores into its slots ``3 i .. 3 i + 2``
        (:meth:`TrainState.score`); every slot is filled by one rank. Here micro-batch ``i`` on
        rank ``i mod world``, whole model."""
        st, rank, world = self.state, self.ctx.comm.rank(DP), self.ctx.comm.size(DP)
        for i in range(rank, len(batches), world):
            inputs, targets = st.microbatch(batches[i])
            slots[3 * i : 3 * i + 3] = torch.tensor(
                st.score(st.model(inputs, EVAL_STEP, i), targets), dtype=slots.dtype
            )

    @abstractmethod
    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Take a whole training state (a durable checkpoint) into this rank."""

    def roll_back(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> None:
        """Take the known-good state after a check found corruption."""
        self.adopt(state, plan, broken)

    @abstractmethod
    def verify(self, step: int, broken: Callable[[], bool]) -> bool:
        """Compare the copies of the state across ranks and repair bad ones (a collective);
        rank 0 reports what it found. True when something was found."""

    def computes_with(self) -> torch.Tensor:
        """The parameters this rank computes with (what the seal's CRC covers)."""
        return self.state.flat.data

    def held_here(self) -> list[tuple[int, torch.Tensor]]:
        """What this rank holds of the state, as ``(part, tensor)`` (0 parameters, 1 and 2 the
        moments), read without a collective: the digests a rank reports when the job's end
        could not gather the whole."""
        st = self.state
        return [(0, st.flat.data), (1, st.opt.exp_avg), (2, st.opt.exp_avg_sq)]

    def known_good(self, broken: Callable[[], bool]) -> torch.Tensor:
        """What this rank keeps of a state a check found clean, [params | exp_avg | exp_avg_sq]
        (a collective): the whole state, which fits any later layout. :meth:`take_known_good`
        takes it back."""
        return self.whole(broken).copy()

    def take_known_good(
        self, step: int, loss: float, good: torch.Tensor, *, plan: Plan, broken: Callable[[], bool]
    ) -> None:
        """Roll back to what :meth:`known_good` kept at ``step`` (three equal parts: the state
        as a durable checkpoint holds it)."""
        params, exp_avg, exp_avg_sq = good.chunk(3)
        state = DurableState(step, loss, params, exp_avg, exp_avg_sq, Path(f"known-good@{step}"))
        self.roll_back(state, plan, broken)

    def layout_key(self) -> Any:
        """What a kept known-good state depends on: None for the whole state; a strategy that
        keeps only its shard names its layout, and a plan that changes it voids the state."""
        return None

    def layout_generation(self) -> Any:
        """Which layout every rank runs, the same value on every rank: a known-good state kept
        per layout (``layout_key``) is taken again at the first commit of a new one, so that a
        corruption found later can still be rolled back (``None``: not yet settled, e.g. while
        layers migrate)."""
        plan = self.ctx.plan
        return plan.epoch if plan is not None else None

    @abstractmethod
    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]:
        """Where an injected bit flip aimed at ``target`` (parameters | snapshot) lands."""

    # ---- shared helpers -----------------------------------------------------------------------
    def restore(
        self, plan: Plan, broken: Callable[[], bool], path: Path, *, lost_from: int, reason: str
    ) -> dict[str, Any]:
        """Load a durable checkpoint into this rank (any world size) and report it."""
        state = self.durable.load(path, lost_from, reason)
        self.adopt(state, plan, broken)
        return {"resume_step": state.step, "source_rank": -1, "bytes": 0, "durable": str(path)}

    def say(self, kind: str, **fields: Any) -> None:
        """An event from rank 0 only (the others know the same)."""
        if self.ctx.comm.rank(DP) == 0:
            self.ctx.event(kind, **fields)


def vote(
    strategy: Strategy,
    parts: list[torch.Tensor],
    step: int,
    broken: Callable[[], bool],
    *flags: bool,
) -> tuple[bool, list[list[int]]]:
    """Checksum ``parts`` (copies every rank of ``strategy`` holds alike) on every rank; the
    majority's copy overwrites any disagreeing one (rank 0 reports it). Returns whether some
    copy disagreed, and every rank's ``flags``."""
    comm, plan = strategy.ctx.comm, strategy.ctx.plan
    dev = strategy.state.device
    mine = torch.tensor([digest(*parts), *map(int, flags)], dtype=torch.int64, device=dev)
    rows = [r.tolist() for r in comm.allgather(DP, mine, broken)]
    verdict = judge([r[0] for r in rows])
    workers = plan.workers if plan else ()
    if verdict.bad:
        strategy.say(
            "sdc_detected",
            step=step,
            what="replicated state",
            ranks=list(verdict.bad),
            workers=[workers[r] for r in verdict.bad],
            source_rank=verdict.source,
            tie=verdict.unanimous_loss,
        )
        assert verdict.source is not None  # judge names one whenever a rank is bad
        for part in parts:
            comm.broadcast(DP, part, verdict.source, abort=broken)
        strategy.say("sdc_repaired", step=step, what="replicated state")
    return bool(verdict.bad), [row[1:] for row in rows]


def plan_tiers(ctx: RankContext, plan: Plan, *, tiered: bool) -> Tiers | None:
    """The tiers a data-parallel gradient reduction goes by under ``plan`` (``train.hierarchy``;
    None: flat, or ``tiered`` is False)."""
    mode = ctx.cfg.train.hierarchy if tiered else "flat"
    return tiers_of(plan.hosts, mode, dict(plan.racks), workers=plan.workers)
