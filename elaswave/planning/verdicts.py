"""The daemons' pure decisions about slow, hung and failing workers (no I/O, table-tested).

- :func:`straggler_verdict`: from each rank's recent compute time per micro-batch, the
  micro-batch shares proportional to speed (global batch unchanged) and the ranks to evict.
- :func:`pipeline_straggler_verdict`: the same judgement for pipeline ranks; the answer is a
  re-cut of the stages' layers and a re-share of the replicas' micro-batches, or an eviction.
- :class:`Hysteresis`: a proposal is acted on only once it has been made several times in a row.
- :func:`loop_verdict`: whether the job keeps failing without committing a step.
- :func:`hang_verdict` and :func:`silence`: whether a worker is hung (against the bounds of
  :mod:`~elaswave.planning.hanglimits`), judged only on silence the daemon was there to hear;
  :func:`respawn_verdict`: whether a worker that exited is replaced.

The leader runs the straggler verdicts whenever a host reports its workers' speeds, so at 100,000
ranks they must stay (near) linear: ranks are looked up in dicts and sets, never by scanning the
plan per worker, and a reason names at most ``LISTED`` workers, then how many more.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from elaswave.errors import (
    EXIT_NONFINITE,
    EXIT_PREEMPTED,
    EXIT_SCRIPT_FAILED,
    EXIT_STATE_LOST,
    EXIT_UNDECIDED,
)
from elaswave.planning.hanglimits import HangLimits, seconds_text
from elaswave.planning.partition import COMPUTE_ONLY, StageMemory
from elaswave.planning.pipeplan import predicted_step, respeed_pipeline_plan, stage_speeds
from elaswave.planning.plan import Plan, assign_microbatches, capped

WINDOW = 8  # samples per rank the speed estimate looks at (the newest)
MIN_SAMPLES = 4  # samples every rank needs under the current plan before anything is decided
MIN_GAIN = 0.10  # re-share only if the slowest rank's compute time drops by at least this much
OUTLIER = 1.25  # a rank this much slower than the median is a straggler; the rest count as equal
STABLE_CHECKS = 3  # the same proposal this many evaluations in a row before it becomes a plan


@dataclass(frozen=True)
class StragglerVerdict:
    """What to do about slow ranks. ``microbatches`` is ``None`` when the plan stays as it is;
    otherwise it gives the new shares of the ranks that remain (``workers`` minus ``evict``, in
    rank order)."""

    microbatches: tuple[int, ...] | None
    evict: tuple[str, ...] = ()
    reason: str = ""
    slowdown: Mapping[str, float] = field(default_factory=dict)
    stragglers: tuple[str, ...] = ()  # ranks judged slower than the median (``outlier``)

    @property
    def acts(self) -> bool:
        return self.microbatches is not None

    @property
    def key(self) -> Hashable:
        """What must stay the same across evaluations for :class:`Hysteresis`: who is slow and
        who goes (not the exact shares, which noise may move by one micro-batch)."""
        return (self.stragglers, self.evict) if self.acts else None


def straggler_verdict(
    compute_time_per_mb: Mapping[str, Sequence[float]],
    *,
    workers: Sequence[str],
    current: Sequence[int],
    threshold: float,
    min_samples: int = MIN_SAMPLES,
    window: int = WINDOW,
    min_gain: float = MIN_GAIN,
    outlier: float = OUTLIER,
) -> StragglerVerdict:
    """Judge each rank's speed against the median rank's.

    ``compute_time_per_mb[w]`` are worker ``w``'s seconds of forward+backward per micro-batch in
    recent steps of the current plan (oldest first; time blocked in collectives excluded, since
    in synchronous data parallelism every rank's wall step time is the same). ``workers`` and
    ``current`` are the plan's ranks and their micro-batch counts.

    A rank slower than ``threshold`` × the median (per micro-batch, median over the newest
    ``window`` samples) is evicted, unless ``threshold`` is 0. Ranks more than ``outlier`` × the
    median are stragglers; all others count as exactly as fast as the median, so that noise
    among healthy ranks moves nothing. The micro-batches are re-shared proportionally to those
    speeds when that cuts the predicted compute time of a step (its slowest rank) by at least
    ``min_gain``, so single micro-batches do not move back and forth. The sum of the shares is
    always ``sum(current)``: the global batch never changes.
    """
    if len(workers) != len(current):
        raise ValueError(f"{len(workers)} workers but {len(current)} shares")
    total = sum(current)
    missing = [w for w in workers if len(compute_time_per_mb.get(w, ())) < min_samples]
    if missing:
        return StragglerVerdict(
            None, reason=f"waiting for {min_samples} samples from {_names(missing)}"
        )
    per_mb = {w: statistics.median(list(compute_time_per_mb[w])[-window:]) for w in workers}
    ref = statistics.median(per_mb.values())
    if ref <= 0:
        return StragglerVerdict(None, reason="no compute time measured")
    slowdown = {w: per_mb[w] / ref for w in workers}
    est = {w: per_mb[w] if slowdown[w] > outlier else ref for w in workers}
    slow = tuple(w for w in workers if slowdown[w] > outlier)
    evict = tuple(w for w in workers if threshold > 0 and slowdown[w] > threshold)
    if evict and len(evict) < len(workers):
        leaving = set(evict)
        kept = [w for w in workers if w not in leaving]
        shares = assign_microbatches(total, [1.0 / est[w] for w in kept])
        who = _who(evict, _first_ranks(workers).get, slowdown, digits=1)
        return StragglerVerdict(
            shares, evict, f"straggler: {who} (threshold {threshold:g}×) → evicted", slowdown, slow
        )
    proposed = assign_microbatches(total, [1.0 / est[w] for w in workers])
    now_s = max(n * est[w] for n, w in zip(current, workers, strict=True))
    new_s = max(n * est[w] for n, w in zip(proposed, workers, strict=True))
    if tuple(proposed) == tuple(current) or new_s > (1.0 - min_gain) * now_s:
        return StragglerVerdict(None, reason="balanced", slowdown=slowdown, stragglers=slow)
    who = (
        _who(slow, _first_ranks(workers).get, slowdown, digits=2)
        or "no rank slower than the median any more"
    )
    return StragglerVerdict(
        proposed,
        (),
        f"straggler: {who} → re-shared for speed, "
        f"predicted compute {now_s * 1000:.0f} → {new_s * 1000:.0f} ms/step",
        slowdown,
        slow,
    )


@dataclass(frozen=True)
class PipelineVerdict:
    """What to do about slow pipeline ranks: a re-cut and re-share (``plan``), an eviction
    (``evict``; the leader then plans the takeover as for a lost rank), or nothing (neither)."""

    plan: Plan | None = None
    evict: tuple[str, ...] = ()
    reason: str = ""
    slowdown: Mapping[str, float] = field(default_factory=dict)
    stragglers: tuple[str, ...] = ()

    @property
    def acts(self) -> bool:
        return self.plan is not None or bool(self.evict)

    @property
    def key(self) -> Hashable:
        """What must stay the same across evaluations for :class:`Hysteresis`."""
        return (self.stragglers, self.evict) if self.acts else None


def pipeline_straggler_verdict(
    stage_time_per_mb: Mapping[str, Sequence[float]],
    *,
    current: Plan,
    costs: Sequence[float],
    threshold: float,
    store: str,
    now: float,
    min_samples: int = MIN_SAMPLES,
    window: int = WINDOW,
    min_gain: float = MIN_GAIN,
    outlier: float = OUTLIER,
    memory: StageMemory = COMPUTE_ONLY,
) -> PipelineVerdict:
    """Judge pipeline ranks' speeds and fit the layout to them.

    ``stage_time_per_mb[w]`` are worker ``w``'s seconds per micro-batch of its own stage in
    recent steps of ``current``. A rank is compared only with its *peers*, the ranks that run
    exactly the same layers (:func:`peer_relative`): its time over the fastest peer's. Scaling
    stages by a cost model instead would turn every error of the model (a FLOP estimate says
    little about an embedding or a loss head) into a straggler, and at the default threshold
    into an eviction. A rank without a peer (replicas cut differently after a loss or a re-cut)
    is not judged, and while there is one nothing is re-cut (only judged ranks are evicted).
    Slowdowns, stragglers and evictions follow :func:`straggler_verdict` (a rank's speed is
    1 / its slowdown, healthy ranks count as exactly 1). Without an eviction the stages are
    re-cut and the replicas re-shared for those speeds
    (:func:`~elaswave.planning.pipeplan.respeed_pipeline_plan`) when that cuts the predicted
    step time by at least ``min_gain``, each stage within ``memory``'s bytes.
    """
    layers = {w: current.stage_layers(r) for r, w in enumerate(current.workers)}
    scaled = peer_relative(stage_time_per_mb, layers, window=window)
    base = straggler_verdict(
        scaled,
        workers=current.workers,
        current=current.microbatches,
        threshold=threshold,
        min_samples=min_samples,
        window=window,
        min_gain=min_gain,
        outlier=outlier,
    )
    if not base.slowdown:  # too few samples yet
        return PipelineVerdict(reason=base.reason)
    slowdown, slow = base.slowdown, base.stragglers
    if base.evict and len(base.evict) < current.world_size:
        return PipelineVerdict(None, base.evict, base.reason, slowdown, slow)
    runs = Counter(layers.values())  # how many ranks run each stage's layers
    if any(runs[layers[w]] < 2 for w in current.workers):
        # a rank without peers: its speed is unknown, a re-cut would pretend it is nominal and
        # could flap
        return PipelineVerdict(
            reason="no peers to compare with", slowdown=slowdown, stragglers=slow
        )
    straggling = set(slow)
    speeds = {w: 1.0 / slowdown[w] if w in straggling else 1.0 for w in current.workers}
    plan = respeed_pipeline_plan(current, speeds, costs, store=store, now=now, memory=memory)
    if plan is None:
        return PipelineVerdict(reason="balanced", slowdown=slowdown, stragglers=slow)
    per_stage = stage_speeds(current, speeds)  # the same ranks and replicas in both layouts
    now_s = predicted_step(current.bounds, current.shares, per_stage, costs=costs)
    new_s = predicted_step(plan.bounds, plan.shares, per_stage, costs=costs)
    if new_s > (1.0 - min_gain) * now_s:
        return PipelineVerdict(reason="balanced", slowdown=slowdown, stragglers=slow)
    who = (
        _who(slow, current.rank_of, slowdown, digits=2) or "no rank slower than the median any more"
    )
    reason = (
        f"straggler: {who} → re-cut for speed, predicted step "
        f"{now_s:.4g} → {new_s:.4g} (cost units)"
    )
    plan = replace(plan, reason=f"{reason} → {plan.reason}")
    return PipelineVerdict(plan, (), reason, slowdown, slow)


def peer_relative(
    samples: Mapping[str, Sequence[float]], groups: Mapping[str, Hashable], *, window: int = WINDOW
) -> dict[str, list[float]]:
    """Each worker's samples over the typical time (median of the newest ``window``) of the
    fastest worker in its group (same ``groups`` value); 1.0 is as fast as the best peer. A
    worker alone in its group gets 1.0 throughout: nobody to compare it with.

    Each group's size and fastest time are found once (:func:`_fastest_by_group`), where a scan
    of every worker for each worker's peers made this quadratic in the ranks."""
    typical = {
        w: statistics.median(xs[-window:]) for w, xs in samples.items() if xs and w in groups
    }
    sizes = Counter(groups[w] for w in typical)
    fastest = _fastest_by_group(typical, groups)
    out: dict[str, list[float]] = {}
    for w, t in typical.items():
        best = min(t, fastest[groups[w]])
        out[w] = (
            [1.0] * len(samples[w])
            if sizes[groups[w]] < 2 or best <= 0
            else [x / best for x in samples[w]]
        )
    return out


def _fastest_by_group(
    typical: Mapping[str, float], groups: Mapping[str, Hashable]
) -> dict[Hashable, float]:
    """The smallest typical time in each group, ``inf`` for a group of only NaN.

    NaN is left out because ``min`` leaves it out unless it comes first: the minimum over a
    worker and its peers, worker first, is then ``min(its time, this)`` whatever the peers'
    order (NaN for a NaN worker, as before)."""
    fastest: dict[Hashable, float] = {}
    for w, t in typical.items():
        g = groups[w]
        fastest.setdefault(g, math.inf)
        if t == t and t < fastest[g]:  # t == t: not NaN
            fastest[g] = t
    return fastest


def _first_ranks(workers: Sequence[str]) -> dict[str, int]:
    """Worker → its rank (the first, as ``workers.index`` finds it), built once instead of a
    scan of the ranks per worker named."""
    ranks: dict[str, int] = {}
    for r, w in enumerate(workers):
        ranks.setdefault(w, r)
    return ranks


def _who(
    named: Sequence[str],
    rank_of: Callable[[str], int | None],
    slowdown: Mapping[str, float],
    *,
    digits: int,
) -> str:
    """A reason's list of slow workers, each with its rank and slowdown: at most ``LISTED`` of
    them, then how many more (:func:`~elaswave.planning.plan.capped`), so that a reason stays
    short when thousands of ranks are slow. Empty when none is named."""
    return ", ".join(
        capped(
            [
                f"worker {w} (rank {rank_of(w)}) {slowdown[w]:.{digits}f}× the median compute time"
                for w in named
            ]
        )
    )


def _names(workers: Sequence[str]) -> str:
    """Worker names as Python prints a list (``['a', 'b']``), at most ``LISTED`` of them, then
    how many more."""
    return "[" + ", ".join(capped([repr(w) for w in workers])) + "]"


@dataclass
class Hysteresis:
    """Acts on a proposal only once it was made ``needed`` evaluations in a row."""

    needed: int = STABLE_CHECKS
    last: Hashable = None
    streak: int = 0

    def observe(self, key: Hashable) -> bool:
        """Record one evaluation's proposal (``None``: no change); True when it is stable."""
        if key is None:
            self.last, self.streak = None, 0
            return False
        self.streak = self.streak + 1 if key == self.last else 1
        self.last = key
        return self.streak >= self.needed

    def reset(self) -> None:
        self.last, self.streak = None, 0


def loop_verdict(failure_steps: Sequence[int], committed: int, limit: int) -> str | None:
    """Why the job should stop as a restart loop, or ``None``.

    ``failure_steps`` holds, for each worker failure so far (oldest first), the last committed
    step when it was seen; ``committed`` is the last committed step now. The job is in a loop
    when the latest ``limit`` failures all happened with no step committed since. ``limit`` 0
    disables the breaker.
    """
    if limit <= 0:
        return None
    streak = 0
    for step in reversed(failure_steps):
        if step < committed:
            break
        streak += 1
    if streak < limit:
        return None
    return f"restart loop ({streak} failures without a committed step since step {committed})"


# Exit codes a worker leaves with on purpose: a new one would meet the same state or step.
NEVER_RESPAWNED = (
    EXIT_STATE_LOST, EXIT_SCRIPT_FAILED, EXIT_NONFINITE, EXIT_UNDECIDED, EXIT_PREEMPTED,
)  # fmt: skip


def respawn_verdict(
    exit_code: int | None, restarts_used: int, max_restarts: int, *, unrecoverable: str | None
) -> bool:
    """Whether a worker that exited is replaced. Pure. Never after it gave up on purpose
    (:data:`NEVER_RESPAWNED`: state lost, its script failed, a verdict that stops the job, a
    preemption) or another worker reported state lost: a fresh worker would start the job over
    from step 0, or meet the same step; the job stops with the reason instead."""
    if exit_code in NEVER_RESPAWNED or unrecoverable is not None:
        return False
    return restarts_used < max_restarts


Replacement = Literal["spare", "respawn"]


def replacement_verdict(
    exit_code: int | None,
    restarts_used: int,
    max_restarts: int,
    *,
    unrecoverable: str | None,
    spare_waiting: bool,
) -> Replacement | None:
    """Who takes the place of a worker that exited: a warm spare that waits (``spare_waiting``),
    a respawned worker when none does, or nobody (``None``). Pure.

    A spare counts against ``max_restarts`` as a respawn does: the budget bounds how many times
    a host replaces a lost rank, whichever process takes its place. Were spares free, a crash
    that repeats would go through every spare and each spare's own replacement without bound,
    and ``--spares`` would quietly lift the limit the operator set."""
    if not respawn_verdict(exit_code, restarts_used, max_restarts, unrecoverable=unrecoverable):
        return None
    return "spare" if spare_waiting else "respawn"


def hang_verdict(
    silent_s: float,
    phase: str,
    phase_age_s: float,
    *,
    limits: HangLimits,
    beat_s: float,
    still_s: float | None = None,
) -> str | None:
    """Why a worker counts as hung, or ``None``. Pure: the hang detector's whole decision.

    Three disjoint cases:

    - the process is frozen: no heartbeat and no CPU time used for longer than
      ``limits.silence_s`` (``still_s``: seconds since it last did either; ``None`` when its CPU
      time cannot be read, then silence alone counts);
    - it is busy but silent: its CPU time grows, yet no heartbeat comes, because its main thread
      holds the interpreter in one long call (an import, a garbage collection, an unpickling)
      and the heartbeat thread cannot run. That is judged like a compute phase, by
      ``limits.compute_s``: a busy process is no more hung than a long step is;
    - it is alive (beats still arrive) but its main thread has been in one compute phase, or one
      evaluation, for longer than that phase's bound.

    A worker waiting in a collective or for a plan is never hung on its own account: a peer may
    be. The reason names the bound and how it was derived (``auto``:
    :mod:`elaswave.planning.hanglimits`).
    """
    still = silent_s if still_s is None else min(still_s, silent_s)
    if still > limits.silence_s:
        return f"no heartbeat for {silent_s:.1f} s{_bound(limits.silence_s, limits.silence_how)}"
    if silent_s > max(limits.silence_s, limits.compute_s):
        busy = _bound(limits.compute_s, limits.compute_how)
        return f"no heartbeat for {silent_s:.1f} s while using CPU{busy}"
    bound = limits.phase(phase)
    if bound is not None and silent_s <= 2 * beat_s and phase_age_s > bound[0]:
        doing = "computing" if phase == "compute" else "evaluating"
        return f"stuck {doing} for {phase_age_s:.1f} s{_bound(*bound)}"
    return None


def _bound(limit_s: float, how: str) -> str:
    """A hang reason's bound, in its parentheses: the limit, and how auto derived it."""
    limit = seconds_text(limit_s)
    return f" (limit {limit})" if how == "fixed" else f" (limit {limit}; {how})"


def silence(now: float, last_beat: float, resumed: float) -> float:
    """How long a worker has been silent as far as the daemon can tell. Pure. Time before the
    daemon last resumed from a pause of its own does not count: it was not listening then."""
    return now - max(last_beat, resumed)


def nonfinite_verdict(
    *, configured: bool, streak: int, mode: str, limit: int
) -> tuple[str | None, int]:
    """What a skipped step means for the job, and the new count of non-finite steps in a row.
    Pure; every rank computes it from the same reduced tail. ``configured``: the step is one of
    ``train.skip_steps`` (not a fault: the streak is left as it is); else the step was not
    finite. Returns (the one-line reason the job stops, or None to go on; the streak)."""
    if configured:
        return None, streak
    streak += 1
    if mode == "stop":
        return "train.nonfinite is stop", streak
    if streak > limit:
        return f"{streak} non-finite steps in a row (train.nonfinite_limit: {limit})", streak
    return None, streak
