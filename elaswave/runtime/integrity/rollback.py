"""Silent corruption leaves no trace in the trajectory: roll back to the last state known good.

Repairing a corrupt copy is not enough: every step computed from it between the flip and the check
already pushed its error into the gradients, and from there into every replica. So after each check
that finds nothing, every rank keeps the training state of that step in memory (the *known-good*
state: parameters and both Adam moments). Data parallelism keeps the whole state, as a durable
checkpoint holds it, so it fits any later layout; ZeRO-3 keeps its shard and pipeline stages their
held layers, which fit only the layout they were taken under. When a check finds corruption, every
rank restores the known-good state and the steps since are redone: with the same data and the same
per-micro-batch random numbers they give the very values the fault-free run gives.

Two things make a flip visible to the check:

* copies that should agree and do not (replicas of the parameters and moments, ZeRO's shard
  copies, a pipeline layer's holders): the checks of :mod:`~elaswave.runtime.integrity.verify` and
  :mod:`~elaswave.runtime.strategies.pipeline.stageverify`;
* the *seal*: each rank records a CRC of the parameters it runs with right after every commit
  and compares it before the next step uses them. This catches a flip that the next step would
  wash out of the copies (ZeRO all-gathers every parameter after the update, so a flip in a
  parameter another rank owns disappears after one step, but the gradients it produced stay).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

NONE = -1  # a rank that keeps no known-good state


@dataclass
class KnownGood:
    """What a rank keeps of the training state after a clean check at ``step`` (the strategy's
    ``known_good``: the whole [params | exp_avg | exp_avg_sq], or the part its layout holds)."""

    step: int
    loss: float
    kept: torch.Tensor


@dataclass(frozen=True)
class RollbackVerdict:
    """Where to roll back to (``None``: no known-good state to roll back to, with the reason),
    and which rank sends it to the ranks that do not keep it."""

    target: int | None
    source: int | None = None
    reason: str = ""


def rollback_verdict(
    good_steps: Sequence[int], step: int, *, whole: bool = True
) -> RollbackVerdict:
    """Decide the rollback from each rank's known-good step (``NONE``: it keeps none) at the
    check of ``step``. Pure: every rank computes it from the same all-gathered row.

    The ranks that keep a state must agree on its step (they took it at the same check); a rank
    without one (a newcomer) receives it from the lowest rank that has it, where states are
    ``whole`` (one rank's fits another's layout): a part of one (a shard, a stage's layers) fits
    no other rank, so every rank must keep its own. A state newer than the current step (the job
    went back to an older one since, e.g. a durable fallback) is not a state this trajectory can
    roll back to."""
    kept = sorted({s for s in good_steps if s != NONE})
    if not kept:
        return RollbackVerdict(None, reason="no rank keeps a known-good state")
    if not whole and NONE in good_steps:
        return RollbackVerdict(None, reason="a rank's layout changed since the last clean check")
    if len(kept) > 1:
        return RollbackVerdict(None, reason=f"ranks keep known-good states of steps {kept}")
    target = kept[0]
    if target > step:
        return RollbackVerdict(None, reason=f"the known-good state (step {target}) is newer")
    return RollbackVerdict(target, good_steps.index(target))
