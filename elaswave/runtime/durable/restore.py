"""Where a rank's whole state comes from when no peer holds it.

A plan whose ranks all hold no state starts from ``--resume``'s checkpoint, or, for a job that has
already committed steps, from its newest durable checkpoint; a new job starts at step 0. When both
in-memory copies of some state are gone the strategies fall back here too. Every rank of the plan
calls these together and sees the same choice (rank 0 picks, and broadcasts it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from elaswave.errors import ShardLost
from elaswave.planning.plan import Plan
from elaswave.runtime.durable import checkpoints
from elaswave.runtime.durable.checkpoints import DurableCheckpoints, DurableState
from elaswave.runtime.durable.layout import newest_intact, resume_point

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

DP = "dp"

__all__ = ["DurableSource"]


class DurableSource:
    """The job's durable checkpoints (``checkpoints`` is None when they are off) as a source of
    whole state for every rank of a plan."""

    def __init__(self, ctx: RankContext, store: DurableCheckpoints | None) -> None:
        self.ctx = ctx
        self.checkpoints = store
        self._skipped = ""  # rank 0: the newer checkpoints the last choice passed over, and why

    def start_over(self, plan: Plan, broken: Callable[[], bool]) -> tuple[Path, int, str] | None:
        """Where a plan whose ranks all hold no state starts: ``--resume``'s checkpoint; for a
        job that has committed steps, its newest durable checkpoint; ``None`` for a new job
        (step 0). Never step 0 once the job has committed steps: with no checkpoint the state is
        lost, and the job stops saying so."""
        cfg = self.ctx.cfg
        if cfg.resume:  # rank 0 reads the checkpoint back and decides for every rank
            comm = self.ctx.comm
            mine = None
            if comm.rank(DP) == 0:
                path, refused = resume_point(cfg.resume)
                mine = [str(path) if path is not None else "", refused]
            chosen, refused = comm.broadcast_json(DP, mine, 0, abort=broken)
            if not chosen:
                raise ShardLost(refused)
            return Path(chosen), 0, "resume"
        if not plan.committed:
            return None
        why = f"every worker holding the job's state is gone (step {plan.committed} committed)"
        chosen = self.newest(broken)
        if not chosen and self._skipped:
            raise ShardLost(f"{why} and no durable checkpoint is intact ({self._skipped})")
        if not chosen:
            raise ShardLost(
                f"{why} and there is no durable checkpoint: the job will not start over from "
                "step 0 (configure durable_every to fall back to one)"
            )
        return Path(chosen), plan.committed, why

    def newest(self, broken: Callable[[], bool]) -> str:
        """The newest intact durable checkpoint as rank 0 sees it, the same on every rank
        ("" when there is none). With periodic checkpoints off there can still be one: the
        final state of an earlier run of the job, which a relaunch with more steps goes on
        from."""
        if self.checkpoints is not None:
            self.checkpoints.flush()  # a write still in flight is the newest checkpoint
        comm, cfg = self.ctx.comm, self.ctx.cfg
        newest = None
        if comm.rank(DP) == 0:
            choice = newest_intact(cfg.resolved_durable_dir)
            newest, self._skipped = choice.path, choice.failures()
        return comm.broadcast_json(DP, str(newest) if newest else "", 0, abort=broken)

    def load(self, path: Path, lost_from: int, reason: str) -> DurableState:
        """Read a durable checkpoint (every rank reads all of it) and report the restore."""
        state = checkpoints.load(path, self.ctx.state.flat.total)
        if self.ctx.state.prune is not None:
            self.ctx.state.prune.adopt(state.prune, state.step)
        if self.ctx.state.stats is not None:
            self.ctx.state.stats.adopt(state.buffers, state.step)
        if self.ctx.state.script is not None:
            self.ctx.state.script.adopt(state.script, state.step)
        if self.ctx.comm.rank(DP) == 0:
            self.ctx.event(
                "durable_restored",
                path=str(path),
                step=state.step,
                recomputed_steps=max(0, lost_from - state.step),
                reason=reason,
                **({"skipped": self._skipped} if self._skipped else {}),
            )
        return state
