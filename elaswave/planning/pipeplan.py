"""Plans for data × pipeline parallelism. Pure: the leader calls it on every membership change.

A pipeline plan says, for every replica, which ranks run its stages (in stage order), which
contiguous layers each stage owns, and how many of the step's micro-batches the replica runs.
When a stage's rank is lost, the replica is *not* taken out of service (TorchFT's policy): its
surviving stages take over the layers (minimax partition, fewest moved layers) and the replica's
share of the global batch follows its predicted speed. The global batch never changes. The
layer costs it cuts with come from :mod:`elaswave.planning.layercosts`.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from heapq import heapify, heapreplace

from elaswave.planning.partition import (
    COMPUTE_ONLY,
    NoCutFits,
    Partition,
    StageMemory,
    takeover,
)
from elaswave.planning.plan import LISTED, Member, Plan, capped, gone, listed, racks_of

POLICIES = ("reshard", "drop", "recycle")


def next_pipeline_plan(
    prev: Plan | None,
    members: Sequence[Member],
    *,
    pp: int,
    costs: Sequence[float],
    num_microbatches: int,
    max_workers: int,
    store: str,
    now: float,
    cause: str = "",
    policy: str = "reshard",
    epoch_floor: int = 0,
    memory: StageMemory = COMPUTE_ONLY,
) -> Plan | None:
    """The pipeline plan that follows ``prev`` for this membership, or ``None`` if none changes
    (its first epoch after ``epoch_floor``: see :func:`~elaswave.planning.plan.next_plan`).

    - start: ``len(members) // pp`` full replicas (ranks in join order), layers cut by the
      minimax partition within ``memory``'s bytes per stage (a cap no cut meets is a
      :class:`~elaswave.planning.partition.PartitionError`); leftover workers wait as standbys;
    - a replica that lost stages keeps its survivors, which take over the lost layers
      (``policy="reshard"``), or is dropped whole with its survivors put on standby
      (``policy="drop"``, the replica-dropping baseline), or keeps its cut with each lost stage
      run by a rank that runs the same stage in another replica (``policy="recycle"``,
      ReCycle's rerouting baseline: :func:`_rerouted`); a replica with no survivor is gone;
    - a replica whose survivors cannot hold its layers within ``memory``'s limit is dropped,
      its survivors admitted again as newcomers are (in join order, before the new ones); if
      no replica is left, :class:`~elaswave.planning.partition.NoCutFits`;
    - newcomers first refill replicas short of ``pp`` stages (appended as the last stage), or
      under ``recycle`` take over rerouted stages, then form new full replicas;
    - shares of the global batch balance the replicas' predicted 1F1B step times
      (:func:`balanced_shares`).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown stage-loss policy {policy!r} (expected one of {POLICIES})")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    live = {m.worker_id: m for m in members}
    groups, bounds, notes, spare = _surviving_replicas(
        prev, live, costs, policy=policy, memory=memory
    )
    prev_workers = set(prev.workers) if prev else set()
    newcomers = sorted(
        (m for m in members if m.worker_id not in prev_workers), key=lambda m: m.order
    )
    newcomers = sorted((live[w] for w in spare), key=lambda m: m.order) + newcomers
    _admit_newcomers(
        groups,
        bounds,
        notes,
        fresh=[m.worker_id for m in newcomers],
        pp=pp,
        costs=costs,
        num_microbatches=num_microbatches,
        max_workers=max_workers,
        policy=policy,
        memory=memory,
    )
    if not groups and spare:
        raise NoCutFits(
            f"no replica is left whose stages can hold the model within {memory.limit:.4g} "
            f"bytes each ({len(spare)} worker(s) left to place)"
        )
    if not groups:
        return None
    workers = tuple(dict.fromkeys(w for g in groups for w in g))  # a rerouted one: its first
    rank = {w: r for r, w in enumerate(workers)}
    replicas = tuple(tuple(rank[w] for w in g) for g in groups)
    plan_bounds = tuple(bounds)
    if (
        prev is not None and workers == prev.workers and plan_bounds == prev.bounds
        and replicas == prev.replicas
    ):  # fmt: skip
        return None
    slowest = {b: _bottleneck(costs, b) for b in set(bounds)}  # most replicas are cut alike
    shares = balanced_shares(num_microbatches, [slowest[b] for b in bounds],
                             [len(b) - 1 for b in bounds])  # fmt: skip
    epoch = max(prev.epoch if prev else 0, epoch_floor) + 1
    reason = _change_reason(
        epoch,
        groups,
        num_microbatches,
        shares=shares,
        notes=notes,
        started=prev is None,
        pp=pp,
        cause=cause,
    )
    return Plan(
        epoch=epoch,
        workers=workers,
        hosts=tuple(live[w].host for w in workers),
        racks=racks_of(live[w] for w in workers),
        microbatches=_runs(replicas, shares, len(workers)),
        store=store,
        reason=reason,
        created=now,
        departed=gone(prev.workers if prev else (), workers),
        replicas=replicas,
        bounds=plan_bounds,
        shares=shares,
    )


def _runs(replicas: Sequence[Sequence[int]], shares: Sequence[int], world: int) -> tuple[int, ...]:
    """Per rank, the micro-batches it runs a step: its replica's share, or under ``recycle`` the
    shares of every replica it runs a stage for."""
    runs = [0] * world
    for ranks, share in zip(replicas, shares, strict=True):
        for r in ranks:
            runs[r] += share
    return tuple(runs)


def _change_reason(
    epoch: int,
    groups: Sequence[Sequence[str]],
    num_microbatches: int,
    *,
    shares: Sequence[int],
    notes: Sequence[str],
    started: bool,
    pp: int,
    cause: str,
) -> str:
    """A pipeline plan's reason: the new layout (``dp × pp`` at the start, else every replica's
    stage count), how the micro-batches are shared, the notes on replicas changed or gone, all
    after ``cause`` if given."""
    sizes = [len(g) for g in groups]
    grid = "×".join(map(str, sizes)) if len(sizes) <= LISTED else listed(sizes)
    change = f"start: dp {len(groups)} × pp {pp}" if started else f"stages {grid}"
    reason = f"epoch {epoch}: {change}, micro-batches {num_microbatches} → {listed(shares)}"
    if notes:
        reason += " (" + "; ".join(capped(notes)) + ")"
    if cause:
        reason = f"{cause} → {reason}"
    return reason


def _surviving_replicas(
    prev: Plan | None,
    live: Mapping[str, Member],
    costs: Sequence[float],
    *,
    policy: str,
    memory: StageMemory = COMPUTE_ONLY,
) -> tuple[list[list[str]], list[tuple[int, ...]], list[str], list[str]]:
    """The replicas of ``prev`` that stay in service: (their live workers in stage order, their
    layer bounds, a note per replica changed or gone, the survivors to place again), in
    ``prev``'s replica order.

    A replica with no live stage is gone; one that lost some is dropped under ``policy="drop"``,
    or else keeps its survivors with the lost layers taken over (:func:`_taken_over`) unless
    they cannot hold them within ``memory``'s limit: then it is dropped too, and its survivors
    are to be placed again.
    """
    groups: list[list[str]] = []
    bounds: list[tuple[int, ...]] = []
    notes: list[str] = []
    spare: list[str] = []
    if prev is None or not prev.replicas:
        return groups, bounds, notes, spare
    roles = Counter(prev.workers[r] for ranks in prev.replicas for r in ranks)
    for d, ranks in enumerate(prev.replicas):
        stages = [prev.workers[r] for r in ranks]
        alive = [w for w in stages if w in live]
        if not alive:
            notes.append(f"replica {d} gone")
            continue
        if len(alive) < len(stages) and policy == "recycle":
            rerouted = _rerouted(prev, d, live, roles=roles)
            if rerouted is not None:
                moved = [f"stage {s} → {w}" for s, w in enumerate(rerouted) if w != stages[s]]
                notes.append(f"replica {d} rerouted: " + ", ".join(moved))
                groups.append(rerouted)
                bounds.append(tuple(prev.bounds[d]))
                continue
        if len(alive) < len(stages) and policy in ("drop", "recycle"):
            why = "" if policy == "drop" else ", no replica runs the stage to reroute to"
            notes.append(f"replica {d} dropped (lost {len(stages) - len(alive)} stage(s){why})")
            continue
        cut = prev.bounds[d]
        if len(alive) < len(stages):
            try:
                cut = _taken_over(cut, stages, alive, costs=costs, memory=memory)
            except NoCutFits:
                notes.append(f"replica {d} dropped (its {len(alive)} stage(s) cannot hold its "
                             f"layers within {memory.limit:.4g} bytes each)")  # fmt: skip
                spare += alive
                continue
            notes.append(f"replica {d}: {len(stages)}→{len(alive)} stages, layers {list(cut)}")
        groups.append(alive)
        bounds.append(tuple(cut))
    return groups, bounds, notes, spare


def _rerouted(
    prev: Plan, d: int, live: Mapping[str, Member], *, roles: Counter[str]
) -> list[str] | None:
    """ReCycle's adaptive pipelining: replica ``d``'s workers in stage order, each lost stage run
    by a live worker that runs the same stage of another replica cut alike, the one with the
    fewest roles (then the first in replica order); None if a lost stage has no such worker.
    ``roles`` counts each worker's roles so far and takes the new ones."""
    cut, mine = prev.bounds[d], prev.replicas[d]
    out, taken = [], Counter[str]()
    for s, r in enumerate(mine):
        w = prev.workers[r]
        if w not in live:
            peers = [
                prev.workers[ranks[s]] for e, ranks in enumerate(prev.replicas)
                if e != d and prev.bounds[e] == cut and prev.workers[ranks[s]] in live
            ]  # fmt: skip
            if not peers:
                return None
            w = min(peers, key=lambda p: roles[p] + taken[p])
            taken[w] += 1
        out.append(w)
    roles.update(taken)  # only once the whole replica is placed
    return out


def _taken_over(
    cut: Sequence[int],
    stages: Sequence[str],
    alive: Sequence[str],
    *,
    costs: Sequence[float],
    memory: StageMemory = COMPUTE_ONLY,
) -> tuple[int, ...]:
    """The bounds of a replica after its ``alive`` stages took over the layers of the others
    (``stages``: its workers in stage order, ``cut``: its bounds before the loss)."""
    assignment = _assignment(cut)
    for s in reversed(range(len(stages))):  # highest first: indices stay valid
        if stages[s] not in alive:
            speeds = [1.0] * (max(assignment) if assignment else 0)
            part = takeover(assignment, s, costs, speeds_of_survivors=speeds, memory=memory)
            assignment = list(part.assignment())
    return _bounds(assignment, len(alive))


def _admit_newcomers(
    groups: list[list[str]],
    bounds: list[tuple[int, ...]],
    notes: list[str],
    *,
    fresh: list[str],
    pp: int,
    costs: Sequence[float],
    num_microbatches: int,
    max_workers: int,
    policy: str,
    memory: StageMemory = COMPUTE_ONLY,
) -> None:
    """Place the ``fresh`` workers (in join order), extending ``groups``, ``bounds`` and
    ``notes`` in place: under ``policy="reshard"`` they first refill replicas short of ``pp``
    stages (appended as the last stage, layers re-cut moving the fewest), then form new full
    replicas, while the job stays within ``max_workers`` and has a micro-batch per replica.
    Those left over wait as standbys."""
    admitted = len({w for g in groups for w in g})
    queue = deque(fresh)  # popped from the front: a list would shift all the rest each time
    if policy == "recycle":  # a stage rerouted to another replica's worker gets its own again
        seen: set[str] = set()
        for d, group in enumerate(groups):
            for s, w in enumerate(group):
                if w in seen and queue and admitted < max_workers:
                    group[s] = queue.popleft()
                    admitted += 1
                    notes.append(f"replica {d} stage {s} on a newcomer (was rerouted)")
                seen.add(group[s])
    if policy == "reshard":  # refill short replicas first
        for d, group in enumerate(groups):
            while len(group) < pp and queue and admitted < max_workers:
                group.append(queue.popleft())
                admitted += 1
                current = _assignment(bounds[d]) if len(group) > 1 else None
                part = memory.cut(costs, [1.0] * len(group), current=current)
                bounds[d] = part.bounds
                notes.append(f"replica {d} refilled to {len(group)} stages")
    full: tuple[int, ...] = ()  # cut once, when a new replica forms
    while len(queue) >= pp and admitted + pp <= max_workers and len(groups) < num_microbatches:
        full = full or memory.cut(costs, [1.0] * pp).bounds
        groups.append([queue.popleft() for _ in range(pp)])
        bounds.append(full)
        admitted += pp


def stage_speeds(plan: Plan, speeds: Mapping[str, float]) -> list[list[float]]:
    """The speed of every replica's stages, in stage order (1.0 for a worker not in ``speeds``)."""
    return [[speeds.get(plan.workers[r], 1.0) for r in ranks] for ranks in plan.replicas]


def predicted_step(
    bounds: Sequence[Sequence[int]],
    shares: Sequence[int],
    speeds: Sequence[Sequence[float]],
    *,
    costs: Sequence[float],
) -> float:
    """Predicted 1F1B step time (cost units) of a layout: its slowest replica, where replica
    ``d`` with ``S`` stages takes ``(shares[d] + S - 1) · max_s(cost of stage s / speed s)``.
    A replica without micro-batches takes no time."""
    times = [
        (m + len(v) - 1) * _bottleneck(costs, b, v)
        for b, m, v in zip(bounds, shares, speeds, strict=True)
        if m > 0
    ]
    return max(times, default=0.0)


def respeed_pipeline_plan(
    current: Plan,
    speeds: Mapping[str, float],
    costs: Sequence[float],
    *,
    store: str,
    now: float,
    cause: str = "",
    memory: StageMemory = COMPUTE_ONLY,
) -> Plan | None:
    """The plan that fits ``current``'s layout to its workers' speeds, or ``None`` if it fits.

    A layout with rerouted stages (``stage_loss: recycle``) is kept as it is. Same workers,
    ranks and replicas; ``speeds[w]`` is how fast worker ``w`` computes relative
    to a nominal one (missing: 1.0). Each replica's layers are re-cut by the minimax partition
    over its stages' speeds, moving the fewest layers among near-optimal cuts, and the replicas'
    shares are re-balanced for their predicted step times with those speeds. The global batch
    (the sum of the shares) never changes.
    """
    if not current.is_pipeline:
        raise ValueError("not a pipeline plan")
    if current.rerouted:  # the ReCycle baseline keeps its replicas' cuts alike
        return None
    per_stage = stage_speeds(current, speeds)
    bounds, bottlenecks = [], []
    recut: dict[tuple[tuple[int, ...], tuple[float, ...]], Partition] = {}  # replicas alike
    for cut, v in zip(current.bounds, per_stage, strict=True):
        key = (tuple(cut), tuple(v))
        if key not in recut:
            recut[key] = memory.cut(costs, v, current=_assignment(cut))
        bounds.append(recut[key].bounds)
        bottlenecks.append(recut[key].bottleneck)
    total = sum(current.shares)
    shares = balanced_shares(total, bottlenecks, [len(v) for v in per_stage])
    plan_bounds = tuple(bounds)
    if plan_bounds == current.bounds and shares == current.shares:
        return None
    epoch = current.epoch + 1
    moved = [
        f"replica {d}: layers {list(old)} → {list(new)}"
        for d, (old, new) in enumerate(zip(current.bounds, plan_bounds, strict=True))
        if old != new
    ]
    reason = f"epoch {epoch}: stages re-cut for speed, micro-batches {total} → {listed(shares)}" + (
        " (" + "; ".join(capped(moved)) + ")" if moved else ""
    )
    if cause:
        reason = f"{cause} → {reason}"
    return Plan(
        epoch=epoch,
        workers=current.workers,
        hosts=current.hosts,
        racks=current.racks,
        microbatches=tuple(shares[current.position(r)[0]] for r in range(current.world_size)),
        store=store,
        reason=reason,
        created=now,
        replicas=current.replicas,
        bounds=plan_bounds,
        shares=shares,
    )


def balanced_shares(
    total: int, bottlenecks: Sequence[float], stages: Sequence[int]
) -> tuple[int, ...]:
    """Micro-batches per replica that minimise the predicted step time (the slowest replica).

    A 1F1B replica with ``S`` stages whose slowest stage takes ``b`` per micro-batch runs ``m``
    micro-batches in ``(m + S - 1) · b``. Handing out micro-batches one at a time, each to the
    replica that would finish it soonest, minimises the maximum of these increasing functions.
    Ties go to the lower replica index; a replica of infinite bottleneck gets nothing.

    At scale (200,000 micro-batches over 6,250 replicas) the hand-out starts from the
    micro-batches it surely gives (:func:`_sure_counts`) and a heap of (finish time of a
    replica's next micro-batch, replica) hands out the rest, one in O(log replicas) each.
    """
    if not bottlenecks or len(bottlenecks) != len(stages):
        raise ValueError("need one bottleneck and one stage count per replica")
    counts = _sure_counts(total, bottlenecks, stages)
    heap = [((counts[d] + stages[d]) * bottlenecks[d], d) for d in range(len(counts))]
    heapify(heap)
    for _ in range(total - sum(counts)):
        finish, best = heap[0]
        if finish == float("inf"):
            raise ValueError("no replica can run micro-batches")
        counts[best] += 1
        heapreplace(heap, ((counts[best] + stages[best]) * bottlenecks[best], best))
    return tuple(counts)


def _sure_counts(total: int, bottlenecks: Sequence[float], stages: Sequence[int]) -> list[int]:
    """Micro-batches that :func:`balanced_shares` surely gives each replica: those that finish
    before a level where, over all replicas, at most ``total`` do.

    The hand-out takes finish times ``(k + stages[d]) · bottlenecks[d]`` in increasing order (a
    replica's only grow with ``k``), so those all come first, whatever the ties. The level is
    where the replicas' finish times would share ``total`` evenly, less one micro-batch each;
    the count is checked exactly, and with any doubt (a zero or infinite bottleneck, a count
    too high) nothing is sure and the heap hands out everything."""
    nothing = [0] * len(bottlenecks)
    if total <= 0 or not all(0.0 < b < math.inf for b in bottlenecks):
        return nothing
    rate = sum(1.0 / b for b in bottlenecks)
    for extra in (sum(stages), 0):  # the level if every replica is busy, then a safe one
        level = (total - len(stages) + extra) / rate
        counts = [
            _finished_below(level, b, s, cap=total)
            for b, s in zip(bottlenecks, stages, strict=True)
        ]
        if all(c >= 0 for c in counts) and sum(counts) <= total:
            return counts
    return nothing


def _finished_below(level: float, bottleneck: float, stages: int, *, cap: int) -> int:
    """How many ``k >= 0`` have ``(k + stages) · bottleneck < level``, as floats compute it;
    -1 when that is clearly more than ``cap`` (or no number at all)."""
    estimate = level / bottleneck
    if not estimate <= cap + stages + 1:
        return -1
    k = max(0, math.floor(estimate) - stages)
    while k > 0 and (k - 1 + stages) * bottleneck >= level:
        k -= 1
    while (k + stages) * bottleneck < level:
        k += 1
    return k


def serving_shares(
    plan: Plan, serving: Sequence[bool], costs: Sequence[float], *, total: int | None = None
) -> tuple[int, ...]:
    """Shares while some replicas are out of service (migrating): the global batch (or
    ``total`` micro-batches, e.g. those a partial redo runs again) spread over the serving
    replicas only, balanced the same way."""
    if not any(serving):
        raise ValueError("no replica left in service")
    bottlenecks = [
        _bottleneck(costs, b) if serving[d] else float("inf") for d, b in enumerate(plan.bounds)
    ]
    total = sum(plan.shares) if total is None else total
    return balanced_shares(total, bottlenecks, [len(b) - 1 for b in plan.bounds])


def _assignment(bounds: Sequence[int]) -> list[int]:
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def _bounds(assignment: Sequence[int], stages: int) -> tuple[int, ...]:
    cuts = [0]
    for s in range(stages):
        cuts.append(cuts[-1] + sum(1 for a in assignment if a == s))
    return tuple(cuts)


def _bottleneck(
    costs: Sequence[float], bounds: Sequence[int], speeds: Sequence[float] | None = None
) -> float:
    """The slowest stage's time per micro-batch: its layers' cost over its speed (1.0 each
    without ``speeds``)."""
    return max(
        sum(costs[bounds[s] : bounds[s + 1]]) / (speeds[s] if speeds else 1.0)
        for s in range(len(bounds) - 1)
    )
