"""How long a worker may be silent, or stay in one phase, before the hang detector kills it.

Pure: the daemon feeds :func:`hang_limits` the phase times its workers' heartbeats showed, and
:func:`~elaswave.planning.verdicts.hang_verdict` judges each worker against the result.

``timeouts.hang`` is a number of seconds, the one bound of everything (silence, a compute phase,
an evaluation), or ``auto`` (the default), which bounds each on its own:

- **silence** (no heartbeat and no CPU time used: a frozen process, SIGSTOP, a deadlock, a
  stalled host; a silent process that uses CPU time is judged by the compute bound instead):
  ``max(SILENCE_FLOOR_S, SILENCE_BEATS × timeouts.heartbeat)``. Heartbeats come from a thread of
  their own, whatever the main thread does, so their rhythm does not depend on how long a step
  takes: a frozen worker of a fast job and one of a slow job are caught alike, in about a second.
- **one compute phase** (a live worker stuck computing): ``WARMUP_S`` until ``MIN_PHASES``
  compute phases were seen on the host (the first steps allocate, initialise lazily, compile),
  then ``max(COMPUTE_FLOOR_S, MULTIPLE × p99)`` of the newest ``WINDOW`` of them. The floor is
  the fixed default's: CPU contention and one-off work (a first step under a new plan, a
  pruning step) stretch short phases many times over, and a wrong kill costs a recovery where a
  late one costs seconds. Above it the bound follows the job: 30 s steps get two minutes.
- **one evaluation** (``train.eval_every``): ``max(WARMUP_S, MULTIPLE × the longest seen)``:
  evaluations are few, and one may score many more samples than a step trains.

Phase times come from the heartbeats (:func:`phase_ended`), not from the step records: they are
the very clock the verdict reads (the wall time of the main thread's phase, contention
included), every host sees its own workers' whatever rank they hold, and nothing new crosses
the wire. A heartbeat samples the phase every ``timeouts.heartbeat``: a phase is seen at most one
beat short of its length, and phases shorter than a beat are seen short or not at all, which
moves nothing: the floor is far above them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "AUTO", "COMPUTE_FLOOR_S", "MIN_PHASES", "MULTIPLE", "SILENCE_BEATS", "SILENCE_FLOOR_S",
    "WARMUP_S", "WINDOW", "HangLimits", "hang_limits", "percentile", "phase_ended", "seconds_text",
]  # fmt: skip

AUTO = "auto"
SILENCE_FLOOR_S = 1.0  # auto: the shortest silence that counts as frozen
SILENCE_BEATS = 5  # auto: ... or this many heartbeat intervals, if longer
COMPUTE_FLOOR_S = 10.0  # auto: the shortest compute phase that counts as stuck
MULTIPLE = 4.0  # auto: a phase this many times the p99 of the recent ones is stuck
QUANTILE = 0.99
MIN_PHASES = 20  # auto: compute phases seen before their times count
WARMUP_S = 300.0  # auto: the bound of a compute phase until then, and the floor of an evaluation
WINDOW = 200  # auto: the newest compute phases the percentile is taken over

JUDGED = ("compute", "eval")  # the phases a worker can be stuck in (not waits on its peers)


@dataclass(frozen=True, kw_only=True)
class HangLimits:
    """The bounds the hang detector applies now, each with how it was derived."""

    silence_s: float
    compute_s: float
    eval_s: float
    silence_how: str = "fixed"
    compute_how: str = "fixed"
    eval_how: str = "fixed"

    def phase(self, phase: str) -> tuple[float, str] | None:
        """The bound of one ``phase`` and how it was derived; ``None`` for a phase nobody is
        judged in (a wait on peers, on a plan)."""
        if phase == "compute":
            return self.compute_s, self.compute_how
        if phase == "eval":
            return self.eval_s, self.eval_how
        return None

    def describe(self) -> str:
        """One line for ``status``: each bound and how it was derived."""
        if self.compute_how == self.eval_how == self.silence_how == "fixed":
            return f"{self.compute_s:g} s (fixed)"
        return (
            f"computing {seconds_text(self.compute_s)} ({self.compute_how}), evaluating "
            f"{seconds_text(self.eval_s)} ({self.eval_how}), silent {seconds_text(self.silence_s)} "
            f"({self.silence_how})"
        )


def seconds_text(seconds: float) -> str:
    """A duration as a hang reason shows it: three digits, whole seconds from 100 s on."""
    return f"{seconds:.3g} s" if seconds < 100 else f"{seconds:.0f} s"


def hang_limits(
    setting: float | str,
    *,
    compute: Sequence[float],
    evals: Sequence[float],
    beat_s: float,
) -> HangLimits:
    """The bounds for ``timeouts.hang`` = ``setting`` (seconds, or ``auto``), given the recent
    compute-phase and evaluation durations seen on the host (newest last) and the heartbeat
    interval."""
    if setting != AUTO:
        limit = float(setting)
        return HangLimits(silence_s=limit, compute_s=limit, eval_s=limit)
    silence = max(SILENCE_FLOOR_S, SILENCE_BEATS * beat_s)
    beats = silence > SILENCE_FLOOR_S
    silence_how = f"auto: {SILENCE_BEATS} heartbeats" if beats else "auto: floor"
    recent = list(compute)[-WINDOW:]
    if len(recent) < MIN_PHASES:
        compute_s = WARMUP_S
        compute_how = f"auto: first steps, {len(recent)} of {MIN_PHASES} compute phases seen"
    else:
        p99 = percentile(recent, QUANTILE)
        compute_s = max(COMPUTE_FLOOR_S, MULTIPLE * p99)
        scaled = f"{MULTIPLE:g} × p99 of {len(recent)} compute phases"
        compute_how = (
            f"auto: {scaled}"
            if compute_s > COMPUTE_FLOOR_S
            else f"auto: floor, {scaled} is {seconds_text(MULTIPLE * p99)}"
        )
    longest = max(evals, default=0.0)
    eval_s = max(WARMUP_S, MULTIPLE * longest)
    if not evals:
        eval_how = "auto: no evaluation seen"
    elif eval_s > WARMUP_S:
        eval_how = f"auto: {MULTIPLE:g} × the longest of {len(evals)} evaluations"
    else:
        took = seconds_text(longest)
        eval_how = f"auto: floor, the longest of {len(evals)} evaluations took {took}"
    return HangLimits(
        silence_s=silence, compute_s=compute_s, eval_s=eval_s,
        silence_how=silence_how, compute_how=compute_how, eval_how=eval_how,
    )  # fmt: skip


def percentile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile of ``values`` (not empty): the smallest value at least a
    ``q`` share of them do not exceed."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def phase_ended(before: tuple[str, float], now: tuple[str, float]) -> tuple[str, float] | None:
    """The judged phase that ended between two heartbeats of a worker, with the longest it was
    seen to last, or ``None``. Each is ``(phase, seconds in it)``; a phase ended if the next
    beat shows another one, or the same one younger (a new one began in between)."""
    phase, age = before
    if phase not in JUDGED:
        return None
    if now[0] != phase or now[1] < age:
        return phase, age
    return None
