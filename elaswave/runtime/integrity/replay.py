"""Miscomputed gradients (``replay_every``): one micro-batch of each rank computed again by a
peer, compared before the reduction.

A device that computes a gradient wrongly leaves no trace the state checksums can see: the
all-reduce spreads its wrong sum to every replica alike. Every ``replay_every`` steps, on the
whole-model data path (replicated data parallelism and ZeRO-1), rank ``r`` also computes the
first micro-batch of rank ``r - 1`` (into the flat gradient before its own micro-batches, then
zeroed), and each rank digests that gradient and the gradient of its own first micro-batch as it
computed it (before it is summed with the others). One all-gather of two 64-bit digests per rank
compares them; where an owner and its peer disagree, a third rank computes the micro-batch
again (a second all-gather) and the majority names the odd rank
(:func:`~elaswave.planning.replay.judge_replay`, the same verdict on every rank).

A finding is never applied: every rank drops the step's sums and raises :class:`Miscomputed`
(the engine waits for the next plan, as after a lost peer), and the lowest good rank asks its
daemon to evict the odd ranks (:class:`~elaswave.wire.Evict`); the leader publishes a plan
without them and the step is redone. Three different digests name nobody: the job stops
(:class:`~elaswave.errors.ReplayUndecided`) rather than apply a gradient nobody can vouch for.

Bit-identity: the RNG is keyed by (seed, step, micro-batch, layer) and the replicas hold the
same parameters, so two healthy CPUs give the same bytes in float32 and float64 alike (the same
kernels and thread count on every rank). Devices of different kinds or kernels that sum with
atomics can differ without a fault; such a job must not replay.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from elaswave import wire
from elaswave.errors import ReplayUndecided
from elaswave.planning.replay import (
    ReplayFinding,
    judge_replay,
    mismatched_owners,
    peer_of,
    replay_due,
    replay_ranks,
    third_of,
)
from elaswave.runtime.integrity.checksums import digest
from elaswave.runtime.integrity.verify import flip_bit

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

__all__ = ["GradReplay", "Miscomputed"]

DP = "dp"  # the training group (strategies.base.DP; not imported: base imports this path)
NONE = -1  # no digest in this slot


class Miscomputed(RuntimeError):
    """A replay found a rank that miscomputed a gradient: the step is dropped on every rank and
    redone under the plan without it."""


class GradReplay:
    """One rank's side of the replay (``ctx``: the rank's context; ``miscomputes(step)``: an
    injected fault makes this rank's gradients of the step's replayed micro-batches wrong)."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.every = ctx.cfg.replay_every
        self._said_skip: int | None = None  # the plan epoch whose skip was announced
        self.due = False
        self.bad = False  # this rank miscomputes this step (an injected fault)
        self.own = NONE  # digest of this rank's first micro-batch's gradient
        self.peer = NONE  # digest of its recomputation of rank - 1's first micro-batch

    def begin(
        self, step: int, mine: Sequence[int], *, redo: bool, compute: Callable[[int], torch.Tensor]
    ) -> None:
        """Before this rank's micro-batches: whether ``step`` is replayed, and if so the peer's
        recomputation (``compute(index)``: the flat gradient of micro-batch ``index`` alone,
        zeroed by the caller afterwards)."""
        plan, ctx = self.ctx.plan, self.ctx
        assert plan is not None
        miscomputes = ctx.miscomputes
        self.bad = bool(mine) and not redo and miscomputes is not None and miscomputes(step)
        self.own = self.peer = NONE
        self.due = replay_due(step, self.every, world=plan.world_size, redo=redo) and all(
            plan.microbatches
        )  # every rank has a first micro-batch
        if self.every and not self.due and (why := replay_ranks(plan.world_size)):
            if self._said_skip != plan.epoch and ctx.comm.rank(DP) == 0:
                ctx.event("replay_skipped", step=step, epoch=plan.epoch, reason=why)
            self._said_skip = plan.epoch
        if not self.due:
            return
        rank, world = ctx.comm.rank(DP), plan.world_size
        owner = (rank - 1) % world
        self.peer = self._digest(step, compute(self._first(owner)))

    def owned(self, step: int, grad: torch.Tensor) -> None:
        """This rank's first micro-batch's gradient, as computed (before it is summed): an
        injected fault flips a bit of it; on a replayed step, its digest."""
        if self.bad:
            flip_bit(grad, (step * 7919) % grad.numel())
        if self.due:
            self.own = digest(grad)

    def check(self, step: int, compute: Callable[[int], torch.Tensor]) -> None:
        """After this rank's micro-batches, before the reduction: compare the digests (one
        all-gather; a second after a disagreement, with a third rank's recomputation). Raises
        :class:`Miscomputed` on every rank when some rank miscomputed."""
        if not self.due:
            return
        ctx, plan = self.ctx, self.ctx.plan
        assert plan is not None
        dev, rank, world = ctx.state.device, ctx.comm.rank(DP), plan.world_size
        ctx.enter("collective")
        mine = torch.tensor([self.own, self.peer], dtype=torch.int64, device=dev)
        rows = [r.tolist() for r in ctx.comm.allgather(DP, mine, ctx.broken)]
        owners, peers = [r[0] for r in rows], [r[1] for r in rows]
        mismatched = mismatched_owners(owners, peers)
        if not mismatched:
            ctx.enter("compute")
            return
        tie = (rank - 2) % world  # the owner this rank is the third of
        third = NONE
        if tie in mismatched and third_of(tie, world) == rank:
            ctx.enter("compute")
            third = self._digest(step, compute(self._first(tie)))
            ctx.enter("collective")
        row = torch.tensor([third], dtype=torch.int64, device=dev)
        thirds = [int(r[0]) for r in ctx.comm.allgather(DP, row, ctx.broken)]
        finding = judge_replay(owners, peers, [t if t != NONE else None for t in thirds])
        self._found(step, finding, owners=owners, peers=peers, thirds=thirds)

    def _found(
        self, step: int, finding: ReplayFinding, *, owners: list[int], peers: list[int],
        thirds: list[int],
    ) -> None:  # fmt: skip
        ctx, plan = self.ctx, self.ctx.plan
        assert plan is not None
        world, rank = plan.world_size, ctx.comm.rank(DP)
        odd = [plan.workers[r] for r in finding.odd]
        pairs = [
            {
                "owner": o, "peer": peer_of(o, world), "third": third_of(o, world),
                "microbatch": self._first(o), "owner_digest": owners[o],
                "peer_digest": peers[peer_of(o, world)],
                "third_digest": thirds[third_of(o, world)] if thirds[third_of(o, world)] != NONE
                else None,
            }
            for o in finding.mismatched
        ]  # fmt: skip
        verdict = "undecided" if finding.undecided else "evict"
        reporter = min((r for r in range(world) if r not in finding.odd), default=None)
        if rank == reporter:
            ctx.event(
                "replay_mismatch", step=step, epoch=plan.epoch, pairs=pairs, verdict=verdict,
                odd_ranks=list(finding.odd), odd_workers=odd,
                undecided=list(finding.undecided),
            )  # fmt: skip
        if finding.undecided:
            raise ReplayUndecided(
                f"step {step}: a replayed micro-batch's gradient differs on three ranks "
                f"(owners {list(finding.undecided)}): no majority names the rank that "
                "miscomputes, and the job stops rather than apply a gradient nobody can vouch for"
            )
        reason = (
            f"miscomputed gradient: {', '.join(odd)} (rank {', '.join(map(str, finding.odd))}) "
            f"outvoted on a replayed micro-batch of step {step} → evicted"
        )
        if rank == reporter:
            ctx.send(wire.Evict(step=step, workers=odd, reason=reason))
        raise Miscomputed(reason)

    def _first(self, owner: int) -> int:
        """The micro-batch of ``owner`` that is replayed: the first of its plan's share."""
        plan = self.ctx.plan
        assert plan is not None
        return plan.microbatch_range(owner)[0]

    def _digest(self, step: int, grad: torch.Tensor) -> int:
        """The digest of a recomputed gradient (an injected fault flips a bit of it first)."""
        if self.bad:
            flip_bit(grad, (step * 7919) % grad.numel())
        return digest(grad)
