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

    >>> p = partition_layers([1, 1, 1, 1, 1, 1], [1.0, 2.0])
    >>> p.bounds, p.bottleneck
    ((0, 2, 6), 2.0)
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from elaswave.errors import ElasWaveError

_INF = math.inf


class PartitionError(ElasWaveError, ValueError):
    """The layers cannot be partitioned as asked (the message says why, in one line)."""


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
    slack: float,
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


def partition_layers(
    layer_costs: Sequence[float],
    stage_speeds: Sequence[float],
    *,
    current: Sequence[int] | None = None,
    slack: float = 0.02,
) -> Partition:
    """Cut the layers into ``len(stage_speeds)`` contiguous stages; minimise the slowest one.

    ``layer_costs[i]`` is layer ``i``'s work (any unit, >= 0), ``stage_speeds[s]`` how fast stage
    ``s`` does work (> 0); stage time = summed cost / speed. ``current[i]`` is the stage that
    holds layer ``i`` now; a value outside ``0..S-1`` (e.g. -1 for a layer whose stage is gone)
    counts as moved wherever the layer goes. Among the cuts whose bottleneck is at most
    ``(1 + slack)`` times the optimum, the result moves the fewest layers, then has the lowest
    bottleneck, then the lexicographically smallest ``bounds``.

    Three dynamic programs over (stage, boundary), each O(L^2 * S) at worst and about
    O(L^2) in practice (a scan stops at the first stage that is too slow): the optimum, the
    fewest moves (and then the lowest bottleneck) under the slack, and a suffix table that lets
    the smallest boundaries be picked front to back.
    """
    _check_inputs(layer_costs, stage_speeds, current, slack)
    costs = [float(c) for c in layer_costs]
    speeds = [float(v) for v in stage_speeds]
    n_layers, n_stages = len(costs), len(speeds)

    # span[a][e] = cost of layers [a, e), summed left to right so every table sees the same value.
    span = [[0.0] * (n_layers + 1) for _ in range(n_layers + 1)]
    for a in range(n_layers):
        acc = 0.0
        for e in range(a + 1, n_layers + 1):
            acc += costs[e - 1]
            span[a][e] = acc

    # kept[s][i] = layers among the first i that stage s holds now (so they need not move).
    kept = [[0] * (n_layers + 1) for _ in range(n_stages)]
    if current is not None:
        for s in range(n_stages):
            row = kept[s]
            for i, c in enumerate(current):
                row[i + 1] = row[i] + (1 if c == s else 0)

    def time(s: int, a: int, e: int) -> float:
        return span[a][e] / speeds[s]

    def moves(s: int, a: int, e: int) -> int:
        if current is None:
            return 0
        return (e - a) - (kept[s][e] - kept[s][a])

    def ends(s: int) -> range:  # where stage s may end, leaving a layer for every later stage
        return range(s + 1, n_layers - (n_stages - 1 - s) + 1)

    def starts(s: int, e: int) -> range:  # where stage s may start if it ends at e, latest first
        return range(e - 1, s - 1, -1)

    # Costs are >= 0, so a stage's time only grows as its start moves left or its end right
    # (float rounding is monotone too): each scan below stops at the first segment too slow.

    # 1. Minimax: best[e] = lowest bottleneck of stages 0..s covering layers [0, e).
    best = [_INF] * (n_layers + 1)
    for e in ends(0):
        best[e] = time(0, 0, e)
    for s in range(1, n_stages):
        nxt = [_INF] * (n_layers + 1)
        for e in ends(s):
            for a in starts(s, e):
                t = time(s, a, e)
                if t >= nxt[e]:
                    break
                nxt[e] = min(nxt[e], max(best[a], t))
        best = nxt
    optimum = best[n_layers]
    limit = optimum * (1.0 + slack)

    # 2. Under the limit, lexicographic (moved, bottleneck). Adding a stage keeps that order
    #    (sums and maxima are monotone), so the best prefix per boundary suffices.
    prefix: list[tuple[float, float]] = [(_INF, _INF)] * (n_layers + 1)
    for e in ends(0):
        if time(0, 0, e) <= limit:
            prefix[e] = (moves(0, 0, e), time(0, 0, e))
    for s in range(1, n_stages):
        nxt_p: list[tuple[float, float]] = [(_INF, _INF)] * (n_layers + 1)
        for e in ends(s):
            for a in starts(s, e):
                t = time(s, a, e)
                if t > limit:
                    break
                if prefix[a][0] != _INF:
                    cand = (prefix[a][0] + moves(s, a, e), max(prefix[a][1], t))
                    nxt_p[e] = min(nxt_p[e], cand)
        prefix = nxt_p
    fewest, lowest = prefix[n_layers]
    fewest = int(fewest)

    # 3. Suffix table under the chosen bottleneck: rest[s][a] = fewest moves for stages s.. on
    #    layers [a, L). Then walk front to back taking the smallest end that still completes.
    rest = [[_INF] * (n_layers + 1) for _ in range(n_stages + 1)]
    rest[n_stages][n_layers] = 0
    for s in range(n_stages - 1, -1, -1):
        last = n_layers - (n_stages - 1 - s)
        for a in range(s, last):
            for e in range(a + 1, last + 1):
                if time(s, a, e) > lowest:
                    break
                if rest[s + 1][e] != _INF:
                    rest[s][a] = min(rest[s][a], moves(s, a, e) + rest[s + 1][e])
    bounds = [0]
    used = 0
    for s in range(n_stages):
        a = bounds[-1]
        for e in range(a + 1, n_layers + 1):
            if time(s, a, e) > lowest:
                break
            step = moves(s, a, e)
            if used + step + rest[s + 1][e] == fewest:
                bounds.append(e)
                used += step
                break
    assert len(bounds) == n_stages + 1 and used == fewest, (bounds, used, fewest)
    stage_times = tuple(time(s, bounds[s], bounds[s + 1]) for s in range(n_stages))
    return Partition(
        bounds=tuple(bounds),
        stage_times=stage_times,
        bottleneck=max(stage_times),
        optimum=optimum,
        moved=used,
    )


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
    speeds_of_survivors: Sequence[float],
    *,
    slack: float = 0.02,
) -> Partition:
    """Re-partition one pipeline replica's layers over its stages that survive ``lost_stage``.

    ``assignment[i]`` is the stage (of the old pipeline) holding layer ``i``. The surviving stages
    are renumbered in order (old stage ``k`` becomes ``k`` below ``lost_stage`` and ``k - 1``
    above it); ``speeds_of_survivors`` lists their speeds in that new order. The lost stage's
    layers must move; the survivors keep as many of theirs as the slack allows.
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
    return partition_layers(layer_costs, speeds_of_survivors, current=current, slack=slack)
