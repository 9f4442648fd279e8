"""Steps that are not applied, as the engine records them: a step whose reduced loss or gradient
is not finite, or one of ``train.skip_steps``.

Every rank reads the same reduced tail (its ``nonfinite`` count), so every rank reaches the same
verdict (:func:`~elaswave.planning.verdicts.nonfinite_verdict`) without a collective of its own:
the job goes on with the next step's samples, or stops (:class:`~elaswave.errors.NonFiniteStop`).
A rank whose own values were not finite names its micro-batches and samples; rank 0 records the
step as skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from elaswave.config import JobConfig
from elaswave.errors import NonFiniteStop
from elaswave.planning.plan import Plan
from elaswave.planning.verdicts import nonfinite_verdict
from elaswave.runtime.workload.data import microbatches

__all__ = ["NAMED_SAMPLES", "NonFiniteSteps"]

NAMED_SAMPLES = 64  # a non-finite step's event names at most this many of a rank's sample ids


class NonFiniteSteps:
    """``event(kind, **fields)``: a record for the daemon's events; ``num_samples``: the
    training samples a step draws from."""

    def __init__(self, cfg: JobConfig, event: Callable[..., None], *, num_samples: int) -> None:
        self.cfg, self.event, self.num_samples = cfg, event, num_samples
        self.streak = 0  # non-finite steps skipped in a row

    def applied(self) -> None:
        """A step was applied: the streak of non-finite ones ends."""
        self.streak = 0

    def not_applied(
        self, step: int, ranks: int, *, configured: bool, reporter: bool, loss: float
    ) -> str:
        """A step every rank left unapplied (``ranks``: how many saw non-finite values; the
        config's skip: every rank): why, recorded by the ``reporter`` rank; raises
        :class:`NonFiniteStop` when the job stops on it."""
        why = "configured" if configured else "nonfinite"
        t = self.cfg.train
        stop, self.streak = nonfinite_verdict(
            configured=configured, streak=self.streak, mode=t.nonfinite,
            limit=t.nonfinite_limit,
        )  # fmt: skip
        if reporter:
            self.event(
                "step_skipped", step=step, reason=why, ranks=ranks,
                loss=loss if math.isfinite(loss) else None,
            )  # fmt: skip
        if stop is not None:
            raise NonFiniteStop(f"step {step} is not finite and the job stops: {stop}")
        return why

    def name(self, step: int, covered: dict[int, Sequence[int]], *, rank: int, plan: Plan) -> None:
        """This rank brought non-finite values to ``step``: which of its micro-batches
        (``covered``: layer -> micro-batches it holds; empty: its share of the plan) and which
        samples (the report's incident names them)."""
        ids = sorted({i for mbs in covered.values() for i in mbs})
        if not ids:
            ids = list(plan.microbatch_range(rank))
        t = self.cfg.train
        every = microbatches(
            t.seed, step, t.global_batch, micro_batch_size=t.micro_batch_size,
            num_samples=self.num_samples,
        )  # fmt: skip
        samples: list[Any] = [int(s) for i in ids for s in every[i].sample_ids]
        self.event(
            "nonfinite_local", rank=rank, step=step, microbatches=ids,
            samples=samples[:NAMED_SAMPLES], samples_total=len(samples),
        )  # fmt: skip
