"""Layer partitioning for pipeline stages: which contiguous layers each stage owns.

Pure functions, no I/O. A pipeline replica with ``S`` stages cuts its ``L`` layers into ``S``
contiguous, non-empty ranges; stage ``s`` holds layers ``[bounds[s], bounds[s + 1])``. A stage's
time is the sum of its layers' costs divided by its speed, and a 1F1B pipeline runs at the pace
of its slowest stage, so :func:`partition_layers` minimises that *bottleneck* (a minimax dynamic
program). Moving a layer means copying its parameters and optimizer state, so among the plans
whose bottleneck is within ``1 + slack`` of the optimum it keeps the one that moves the fewest
layers away from where they are now.

The ordering among candidate plans is total and deterministic: fewest moved layers, then the
lowest bottleneck, then the lexicographically smallest boundaries.

Memory is a constraint beside compute: given each layer's bytes and a cap, only cuts whose every
stage holds at most the cap are candidates (:func:`bytes_cap` picks the cap a plan uses).

    >>> p = partition_layers([1, 1, 1, 1, 1, 1], [1.0, 2.0])
    >>> p.bounds, p.bottleneck
    ((0, 2, 6), 2.0)
"""

from __future__ import annotations

import functools
import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from elaswave.errors import ElasWaveError

_INF = math.inf


class PartitionError(ElasWaveError, ValueError):
    """The layers cannot be partitioned as asked (the message says why, in one line)."""


class NoCutFits(PartitionError):
    """Valid inputs, but no cut holds every stage within the bytes asked."""


@dataclass(frozen=True, kw_only=True)
class Partition:
    """A cut of ``L`` layers into ``S`` contiguous stages.

    ``bounds`` has ``S + 1`` entries from 0 to ``L``; stage ``s`` holds layers
    ``range(bounds[s], bounds[s + 1])``. ``stage_times[s]`` is that stage's summed layer cost
    divided by its speed; ``bottleneck`` their maximum and ``optimum`` the lowest bottleneck any
    cut reaches (``bottleneck <= optimum * (1 + slack)``). ``moved`` counts the layers whose
    stage differs from the ``current`` placement the plan was made against (0 without one).
    """

    bounds: tuple[int, ...]
    stage_times: tuple[float, ...]
    bottleneck: float
    optimum: float
    moved: int
    stage_bytes: tuple[float, ...] = ()  # each stage's bytes, when the layers' were given

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    @property
    def num_layers(self) -> int:
        return self.bounds[-1]

    def layers(self, stage: int) -> range:
        """The layers stage ``stage`` holds."""
        if not 0 <= stage < self.num_stages:
            raise PartitionError(f"stage {stage} out of range (0..{self.num_stages - 1})")
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stage_of(self, layer: int) -> int:
        """The stage that holds ``layer``."""
        if not 0 <= layer < self.num_layers:
            raise PartitionError(f"layer {layer} out of range (0..{self.num_layers - 1})")
        return bisect_right(self.bounds, layer) - 1

    def assignment(self) -> list[int]:
        """Per-layer stage index: ``assignment()[i] == stage_of(i)``."""
        return [s for s in range(self.num_stages) for _ in self.layers(s)]

    def describe(self) -> str:
        """One line for events and reports, e.g. ``layers [0,3) [3,6) [6,8); ...``."""
        ranges = " ".join(f"[{a},{b})" for a, b in zip(self.bounds, self.bounds[1:], strict=False))
        return (
            f"layers {ranges}; bottleneck {self.bottleneck:.4g} (optimum {self.optimum:.4g}); "
            f"{self.moved} layer{'' if self.moved == 1 else 's'} moved"
        )


def _check_inputs(
    layer_costs: Sequence[float],
    stage_speeds: Sequence[float],
    current: Sequence[int] | None,
    *,
    slack: float,
    layer_bytes: Sequence[float] | None = None,
) -> None:
    n_layers, n_stages = len(layer_costs), len(stage_speeds)
    if n_stages == 0:
        raise PartitionError("no pipeline stages to partition the layers over")
    if n_stages > n_layers:
        raise PartitionError(f"cannot cut {n_layers} layers into {n_stages} non-empty stages")
    for s, speed in enumerate(stage_speeds):
        if not (math.isfinite(speed) and speed > 0):
            raise PartitionError(f"stage speed must be a finite number > 0, stage {s} has {speed}")
    for i, cost in enumerate(layer_costs):
        if not (math.isfinite(cost) and cost >= 0):
            raise PartitionError(f"layer cost must be a finite number >= 0, layer {i} has {cost}")
    if current is not None and len(current) != n_layers:
        raise PartitionError(
            f"current placement names {len(current)} layers, the model has {n_layers}"
        )
    if not (math.isfinite(slack) and slack >= 0):
        raise PartitionError(f"slack must be a finite number >= 0, got {slack}")
    if layer_bytes is not None:
        if len(layer_bytes) != n_layers:
            raise PartitionError(
                f"layer_bytes names {len(layer_bytes)} layers, layer_costs {n_layers}"
            )
        for i, b in enumerate(layer_bytes):
            if not (math.isfinite(b) and b >= 0):
                raise PartitionError(f"layer bytes must be finite and >= 0, layer {i} has {b}")


def partition_layers(
    layer_costs: Sequence[float],
    stage_speeds: Sequence[float],
    *,
    current: Sequence[int] | None = None,
    slack: float = 0.02,
    layer_bytes: Sequence[float] | None = None,
    max_bytes: float = _INF,
) -> Partition:
    """Cut the layers into ``len(stage_speeds)`` contiguous stages; minimise the slowest one.

    ``layer_costs[i]`` is layer ``i``'s work (any unit, >= 0), ``stage_speeds[s]`` how fast stage
    ``s`` does work (> 0); stage time = summed cost / speed. ``current[i]`` is the stage that
    holds layer ``i`` now; a value outside ``0..S-1`` (e.g. -1 for a layer whose stage is gone)
    counts as moved wherever the layer goes. Among the cuts whose bottleneck is at most
    ``(1 + slack)`` times the optimum, the result moves the fewest layers, then has the lowest
    bottleneck, then the lexicographically smallest ``bounds``.

    With ``layer_bytes`` (what a stage holds per layer: parameters, gradients, optimizer state),
    only cuts whose every stage holds at most ``max_bytes`` are considered, and ``optimum`` is the
    lowest bottleneck among them; no such cut is a :class:`PartitionError` that names the
    smallest cap any cut meets.

    Three dynamic programs over (stage, boundary), each O(L^2 * S) at worst and about
    O(L^2) in practice (a scan stops at the first stage that is too slow): the optimum
    (:func:`_lowest_bottleneck`), the fewest moves and then the lowest bottleneck under the slack
    (:func:`_fewest_moves`), and a suffix table that lets the smallest boundaries be picked front
    to back (:func:`_smallest_bounds`).
    """
    _check_inputs(layer_costs, stage_speeds, current, slack=slack, layer_bytes=layer_bytes)
    seg = _Segments.build(
        layer_costs, stage_speeds, current, layer_bytes=layer_bytes, cap=max_bytes
    )
    optimum = _lowest_bottleneck(seg)
    if optimum == _INF:
        assert layer_bytes is not None  # without a cap every cut is a candidate
        least = smallest_largest_stage(layer_bytes, len(stage_speeds))
        raise NoCutFits(
            f"no cut of {len(layer_costs)} layers into {len(stage_speeds)} stages holds at most "
            f"{max_bytes:.4g} bytes per stage: the smallest largest stage is {least:.4g} bytes"
        )
    fewest, lowest = _fewest_moves(seg, optimum * (1.0 + slack))
    bounds, used = _smallest_bounds(seg, fewest, lowest)
    stage_times = tuple(seg.time(s, bounds[s], bounds[s + 1]) for s in range(seg.n_stages))
    return Partition(
        bounds=tuple(bounds),
        stage_times=stage_times,
        bottleneck=max(stage_times),
        optimum=optimum,
        moved=used,
        stage_bytes=tuple(seg.bytes(bounds[s], bounds[s + 1]) for s in range(seg.n_stages))
        if layer_bytes is not None
        else (),
    )


def smallest_largest_stage(layer_bytes: Sequence[float], stages: int) -> float:
    """The fewest bytes the largest of ``stages`` contiguous stages can hold (minimax)."""
    return _lowest_bottleneck(_Segments.build(layer_bytes, [1.0] * stages, None))


def bytes_cap(
    layer_bytes: Sequence[float], stages: int, *, balance: float = 1.10, limit: float = _INF
) -> float:
    """The bytes per stage a cut of ``stages`` stages is held to: ``balance`` times an even share
    of the layers' bytes where some cut meets that, else ``balance`` times the smallest largest
    stage any cut reaches (an embedding alone may outweigh an even share), and never above
    ``limit`` (a user's budget: :func:`partition_layers` refuses a cap no cut meets).

        >>> bytes_cap([4, 1, 1, 1, 1], 2)  # an even share is 4
        4.4
        >>> bytes_cap([9, 1, 1, 1], 2)  # no cut holds 6: the least largest stage is 9
        9.9
    """
    if stages < 1:
        raise PartitionError(f"need at least one stage, got {stages}")
    even = balance * sum(float(b) for b in layer_bytes) / stages
    least = smallest_largest_stage(layer_bytes, stages)
    return min(even if least <= even else balance * least, limit)


@dataclass(frozen=True)
class _Segments:
    """The time and the moves of every candidate segment: stage ``s`` holding layers ``[a, e)``.

    Costs are >= 0, so a stage's time only grows as its start moves left or its end right (float
    rounding is monotone too): the scans over segments stop at the first one too slow.
    """

    speeds: list[float]
    current: Sequence[int] | None
    span: list[list[float]]  # span[a][e] = cost of layers [a, e)
    kept: list[list[int]]  # kept[s][i] = layers among the first i that stage s holds now
    # weight[a][e] = bytes of layers [a, e), summed left to right as ``span`` is: the same
    # values as smallest_largest_stage's, so a cap it returns is met exactly (empty: no bytes)
    weight: list[list[float]]
    cap: float  # the most bytes a stage may hold

    @classmethod
    def build(
        cls,
        layer_costs: Sequence[float],
        stage_speeds: Sequence[float],
        current: Sequence[int] | None,
        *,
        layer_bytes: Sequence[float] | None = None,
        cap: float = _INF,
    ) -> _Segments:
        costs = [float(c) for c in layer_costs]
        speeds = [float(v) for v in stage_speeds]
        n_layers, n_stages = len(costs), len(speeds)
        span = _spans(costs)
        kept = [[0] * (n_layers + 1) for _ in range(n_stages)]
        if current is not None:
            for s in range(n_stages):
                row = kept[s]
                for i, c in enumerate(current):
                    row[i + 1] = row[i] + (1 if c == s else 0)
        weight = _spans([float(b) for b in layer_bytes]) if layer_bytes is not None else []
        return cls(speeds=speeds, current=current, span=span, kept=kept, weight=weight, cap=cap)

    @property
    def n_layers(self) -> int:
        return len(self.span) - 1

    @property
    def n_stages(self) -> int:
        return len(self.speeds)

    def time(self, s: int, a: int, e: int) -> float:
        return self.span[a][e] / self.speeds[s]

    def bytes(self, a: int, e: int) -> float:
        return self.weight[a][e] if self.weight else 0.0

    def fits(self, a: int, e: int) -> bool:
        """Whether a stage holding ``[a, e)`` stays within the cap (a longer one never does
        if this one does not: bytes are >= 0)."""
        return self.bytes(a, e) <= self.cap

    def moves(self, s: int, a: int, e: int) -> int:
        """Layers of ``[a, e)`` that stage ``s`` does not hold now (0 without a placement)."""
        if self.current is None:
            return 0
        return (e - a) - (self.kept[s][e] - self.kept[s][a])

    def ends(self, s: int) -> range:
        """Where stage ``s`` may end, leaving a layer for every later stage."""
        return range(s + 1, self.n_layers - (self.n_stages - 1 - s) + 1)

    def starts(self, s: int, e: int) -> range:
        """Where stage ``s`` may start if it ends at ``e``, latest first."""
        return range(e - 1, s - 1, -1)


def _spans(values: Sequence[float]) -> list[list[float]]:
    """``out[a][e]`` = the sum of ``values[a:e]``, left to right, so that every table sees the
    same value for a segment."""
    n = len(values)
    out = [[0.0] * (n + 1) for _ in range(n + 1)]
    for a in range(n):
        acc = 0.0
        for e in range(a + 1, n + 1):
            acc += values[e - 1]
            out[a][e] = acc
    return out


def _lowest_bottleneck(seg: _Segments) -> float:
    """The optimum: the lowest bottleneck of any cut (minimax over the stages' times).

    ``best[e]`` is the lowest bottleneck of stages ``0..s`` covering layers ``[0, e)``.
    """
    best = [_INF] * (seg.n_layers + 1)
    for e in seg.ends(0):
        if not seg.fits(0, e):
            break
        best[e] = seg.time(0, 0, e)
    for s in range(1, seg.n_stages):
        nxt = [_INF] * (seg.n_layers + 1)
        for e in seg.ends(s):
            for a in seg.starts(s, e):
                t = seg.time(s, a, e)
                if t >= nxt[e] or not seg.fits(a, e):
                    break
                nxt[e] = min(nxt[e], max(best[a], t))
        best = nxt
    return best[seg.n_layers]


def _fewest_moves(seg: _Segments, limit: float) -> tuple[int, float]:
    """The fewest moved layers of a cut whose stages all take at most ``limit``, and the lowest
    bottleneck among the cuts that move that few.

    Lexicographic (moved, bottleneck) per boundary: adding a stage keeps that order (sums and
    maxima are monotone), so the best prefix per boundary suffices.
    """
    prefix: list[tuple[float, float]] = [(_INF, _INF)] * (seg.n_layers + 1)
    for e in seg.ends(0):
        if seg.time(0, 0, e) <= limit and seg.fits(0, e):
            prefix[e] = (seg.moves(0, 0, e), seg.time(0, 0, e))
    for s in range(1, seg.n_stages):
        nxt_p: list[tuple[float, float]] = [(_INF, _INF)] * (seg.n_layers + 1)
        for e in seg.ends(s):
            for a in seg.starts(s, e):
                t = seg.time(s, a, e)
                if t > limit or not seg.fits(a, e):
                    break
                if prefix[a][0] != _INF:
                    cand = (prefix[a][0] + seg.moves(s, a, e), max(prefix[a][1], t))
                    nxt_p[e] = min(nxt_p[e], cand)
        prefix = nxt_p
    fewest, lowest = prefix[seg.n_layers]
    return int(fewest), lowest


def _smallest_bounds(seg: _Segments, fewest: int, lowest: float) -> tuple[list[int], int]:
    """The lexicographically smallest boundaries of a cut that moves ``fewest`` layers with no
    stage slower than ``lowest``, and the layers it moves.

    A suffix table ``rest[s][a]`` (fewest moves for stages ``s..`` on layers ``[a, L)``) lets a
    walk front to back take, stage by stage, the smallest end that still completes.
    """
    n_layers, n_stages = seg.n_layers, seg.n_stages
    rest = [[_INF] * (n_layers + 1) for _ in range(n_stages + 1)]
    rest[n_stages][n_layers] = 0
    for s in range(n_stages - 1, -1, -1):
        last = n_layers - (n_stages - 1 - s)
        for a in range(s, last):
            for e in range(a + 1, last + 1):
                if seg.time(s, a, e) > lowest or not seg.fits(a, e):
                    break
                if rest[s + 1][e] != _INF:
                    rest[s][a] = min(rest[s][a], seg.moves(s, a, e) + rest[s + 1][e])
    bounds = [0]
    used = 0
    for s in range(n_stages):
        a = bounds[-1]
        for e in range(a + 1, n_layers + 1):
            if seg.time(s, a, e) > lowest or not seg.fits(a, e):
                break
            step = seg.moves(s, a, e)
            if used + step + rest[s + 1][e] == fewest:
                bounds.append(e)
                used += step
                break
    assert len(bounds) == n_stages + 1 and used == fewest, (bounds, used, fewest)
    return bounds, used


@dataclass(frozen=True)
class StageMemory:
    """What a pipeline cut must hold each stage to: the layers' bytes (parameters, gradients and
    optimizer state), ``balance`` times an even share where a cut meets it (0: compute alone
    decides), and a user's ``limit`` that no stage may pass."""

    layer_bytes: tuple[float, ...] = ()
    balance: float = 1.10
    limit: float = _INF

    @functools.lru_cache(maxsize=64)  # noqa: B019 - frozen values: equal memories share caps
    def cap(self, stages: int) -> float:
        """The bytes per stage a cut of ``stages`` stages is held to (a minimax over the layers,
        taken once per stage count: every cut of a plan and the event ask again)."""
        if not self.layer_bytes:
            return _INF
        if not self.balance:
            return self.limit
        return bytes_cap(self.layer_bytes, stages, balance=self.balance, limit=self.limit)

    def cut(
        self,
        layer_costs: Sequence[float],
        stage_speeds: Sequence[float],
        *,
        current: Sequence[int] | None = None,
        slack: float = 0.02,
    ) -> Partition:
        """:func:`partition_layers` under this cap (the bytes ignored when they do not name
        every layer: a plan is never refused for a workload that reports none)."""
        known = len(self.layer_bytes) == len(layer_costs)
        return partition_layers(
            layer_costs,
            stage_speeds,
            current=current,
            slack=slack,
            layer_bytes=self.layer_bytes if known else None,
            max_bytes=self.cap(len(stage_speeds)) if known else _INF,
        )


COMPUTE_ONLY = StageMemory(balance=0.0)


def moved_layers(old_assignment: Sequence[int], new_assignment: Sequence[int]) -> list[int]:
    """The layers whose stage differs between two per-layer assignments (ascending)."""
    if len(old_assignment) != len(new_assignment):
        raise PartitionError(
            f"assignments differ in length ({len(old_assignment)} vs {len(new_assignment)} layers)"
        )
    return [
        i for i, (a, b) in enumerate(zip(old_assignment, new_assignment, strict=True)) if a != b
    ]


def takeover(
    assignment: Sequence[int],
    lost_stage: int,
    layer_costs: Sequence[float],
    *,
    speeds_of_survivors: Sequence[float],
    slack: float = 0.02,
    memory: StageMemory = COMPUTE_ONLY,
) -> Partition:
    """Re-partition one pipeline replica's layers over its stages that survive ``lost_stage``.

    ``assignment[i]`` is the stage (of the old pipeline) holding layer ``i``. The surviving stages
    are renumbered in order (old stage ``k`` becomes ``k`` below ``lost_stage`` and ``k - 1``
    above it); ``speeds_of_survivors`` lists their speeds in that new order. The lost stage's
    layers must move; the survivors keep as many of theirs as the slack allows, within
    ``memory``'s cap.
    """
    n_old = len(speeds_of_survivors) + 1
    if len(assignment) != len(layer_costs):
        raise PartitionError(
            f"assignment names {len(assignment)} layers, layer_costs {len(layer_costs)}"
        )
    if not 0 <= lost_stage < n_old:
        raise PartitionError(
            f"lost stage {lost_stage} is not one of the {n_old} stages "
            f"({len(speeds_of_survivors)} survivors given)"
        )
    if n_old == 1:
        raise PartitionError("no stage survives: the replica has no stage left to take over")
    if any(not 0 <= s < n_old for s in assignment) or list(assignment) != sorted(assignment):
        raise PartitionError(
            f"assignment must be non-decreasing stage indices in 0..{n_old - 1}, "
            f"got {list(assignment)}"
        )
    current = [-1 if s == lost_stage else (s if s < lost_stage else s - 1) for s in assignment]
    return memory.cut(layer_costs, speeds_of_survivors, current=current, slack=slack)
