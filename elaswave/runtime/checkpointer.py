"""A rank's part in the job's durable checkpoints: the periodic one (``durable_every``), a
preemption's, and the final state (``train.save_final``).

Each is written from the whole state, which rank 0 writes (``Strategy.whole`` is a collective:
ZeRO gathers the moments, pipelines assemble the model from the stages), or from every rank's own
pieces where the strategy has them (``Strategy.durable_pieces``: rank 0 commits the checkpoint
once every rank's are written). Writes run in the background; each is recorded by an event once
it is on disk. The norm layers' running statistics, a pruner's state and a script's own state go
with the model's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from elaswave.runtime.durable.checkpoints import DurableCheckpoints, Piece

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext
    from elaswave.runtime.strategies.base import Final, Strategy, Whole

__all__ = ["Checkpointer"]

DP = "dp"  # the training group (strategies.base.DP)


class Checkpointer:
    """``store``: where checkpoints go (None until one is owed: :meth:`ensure_store`)."""

    def __init__(
        self, ctx: RankContext, strategy: Strategy, store: DurableCheckpoints | None
    ) -> None:
        self.ctx, self.strategy, self.store = ctx, strategy, store

    def ensure_store(self) -> DurableCheckpoints:
        """The store, opened in the job's durable directory if none was (a preemption's
        checkpoint is owed whatever ``durable_every`` says)."""
        if self.store is None:
            self.store = DurableCheckpoints(self.ctx.cfg.resolved_durable_dir)
        return self.store

    def checkpoint(self, step: int, event: str) -> None:
        """A durable checkpoint of ``step`` (every rank takes part); ``event`` names its
        record."""
        pieces = self.strategy.durable_pieces()
        self.ctx.enter("collective")  # what the hang detector sees: a collective
        if pieces is None:
            self.save_whole(step, self.strategy.whole(self.ctx.broken), event)
        else:
            self._save_pieces(step, pieces, event)
        self.ctx.enter("idle")

    def save_final(self, final: Final) -> None:
        """The final state: the whole state the strategy assembled for its digests, or a
        checkpoint as any other (pipelines: each rank's own pieces)."""
        step = self.ctx.state.step
        if final.whole is not None:
            self.save_whole(step, final.whole, "final_saved")
        else:
            self.checkpoint(step, "final_saved")

    def save_whole(self, step: int, whole: Whole, event: str) -> None:
        """Rank 0 writes the whole state in the background."""
        store, st, ctx = self.store, self.ctx.state, self.ctx
        assert store is not None
        if ctx.comm.rank(DP) != 0:
            return

        def saved(path: Any, seconds: float) -> None:
            ctx.event(event, step=step, path=str(path), seconds=round(seconds, 4))

        prune = st.prune.saved() if st.prune is not None else None
        store.save_async(
            step, st.last_loss, whole.params, exp_avg=whole.exp_avg,
            exp_avg_sq=whole.exp_avg_sq, on_done=saved, extra=prune, buffers=self._stats(),
            script=self._script(),
        )  # fmt: skip

    def _save_pieces(self, step: int, pieces: list[Piece], event: str) -> None:
        """Every rank writes the intervals it owns; rank 0 commits the checkpoint once all are
        written and records ``event``."""
        store, plan, st, ctx = self.store, self.ctx.plan, self.ctx.state, self.ctx
        assert store is not None and plan is not None
        rank = ctx.comm.rank(DP)

        def saved(path: Any, seconds: float) -> None:
            ctx.event(
                event, step=step, path=str(path), seconds=round(seconds, 4),
                parts=plan.world_size,
            )  # fmt: skip

        prune = st.prune.saved() if st.prune is not None else None
        store.save_pieces_async(
            step, st.last_loss, rank=rank, world=plan.world_size, attempt=f"e{plan.epoch}",
            pieces=pieces, on_done=saved if rank == 0 else None, extra=prune,
            buffers=self._stats(), script=self._script(),
        )  # fmt: skip

    def _script(self) -> torch.Tensor | None:
        """A script's own registered state as a checkpoint keeps it (None: it has none)."""
        st = self.ctx.state
        return st.script.saved() if st.script is not None else None

    def _stats(self) -> torch.Tensor | None:
        """The norm layers' running statistics as a checkpoint keeps them (None: none)."""
        st = self.ctx.state
        return st.stats.saved() if st.stats is not None else None
