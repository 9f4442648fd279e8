"""Plans for data × pipeline parallelism. Pure: the leader calls it on every membership change.

A pipeline plan says, for every replica, which ranks run its stages (in stage order), which
contiguous layers each stage owns, and how many of the step's micro-batches the replica runs.
When a stage's rank is lost, the replica is *not* taken out of service (TorchFT's policy): its
surviving stages take over the layers (minimax partition, fewest moved layers) and the replica's
share of the global batch follows its predicted speed. The global batch never changes.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from elaswave.partition import partition_layers, takeover
from elaswave.plan import Member, Plan

POLICIES = ("reshard", "drop")


def layer_costs(*, vocab_size: int, seq_len: int, d_model: int, n_layer: int) -> tuple[float, ...]:
    """Relative compute cost of each layer of the layer list [embedding, blocks..., head].

    A FLOP estimate per sample (the backward pass costs a constant multiple of the forward, so
    the ratio is what matters): a block is 24·T·d² (projections, MLP) + 4·T²·d (attention), the
    head 2·T·d·V, the embedding a gather (≈ 2·T·d).
    """
    t, d, v = seq_len, d_model, vocab_size
    block = 24.0 * t * d * d + 4.0 * t * t * d
    return (2.0 * t * d, *([block] * n_layer), 2.0 * t * d * v)


def measured_costs(
    profiles: Sequence[Sequence[float]], *, fallback: Sequence[float]
) -> tuple[float, ...]:
    """Per-layer costs from workers' start-up profiles: the median over workers of each layer's
    seconds (robust to one slow or busy worker). Profiles of the wrong length are ignored; with
    none left, ``fallback`` (the FLOP estimate)."""
    usable = [p for p in profiles if len(p) == len(fallback) and all(x > 0 for x in p)]
    if not usable:
        return tuple(fallback)
    return tuple(statistics.median(p[i] for p in usable) for i in range(len(fallback)))


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
) -> Plan | None:
    """The pipeline plan that follows ``prev`` for this membership, or ``None`` if none changes.

    - start: ``len(members) // pp`` full replicas (ranks in join order), layers cut by the
      minimax partition; leftover workers wait as standbys;
    - a replica that lost stages keeps its survivors, which take over the lost layers
      (``policy="reshard"``), or is dropped whole with its survivors put on standby
      (``policy="drop"``, the replica-dropping baseline); a replica with no survivor is gone;
    - newcomers first refill replicas short of ``pp`` stages (appended as the last stage), then
      form new full replicas;
    - shares of the global batch balance the replicas' predicted 1F1B step times
      (:func:`balanced_shares`).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown stage-loss policy {policy!r} (expected one of {POLICIES})")
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    live = {m.worker_id: m for m in members}
    prev_workers = set(prev.workers) if prev else set()
    groups: list[list[str]] = []
    bounds: list[tuple[int, ...]] = []
    notes: list[str] = []
    if prev is not None and prev.replicas:
        for d, ranks in enumerate(prev.replicas):
            stages = [prev.workers[r] for r in ranks]
            alive = [w for w in stages if w in live]
            if not alive:
                notes.append(f"replica {d} gone")
                continue
            if len(alive) < len(stages) and policy == "drop":
                notes.append(f"replica {d} dropped (lost {len(stages) - len(alive)} stage(s))")
                continue
            cut = prev.bounds[d]
            if len(alive) < len(stages):
                assignment = _assignment(cut)
                for s in reversed(range(len(stages))):  # highest first: indices stay valid
                    if stages[s] not in live:
                        speeds = [1.0] * (max(assignment) if assignment else 0)
                        assignment = list(takeover(assignment, s, costs, speeds).assignment())
                cut = _bounds(assignment, len(alive))
                notes.append(f"replica {d}: {len(stages)}→{len(alive)} stages, layers {list(cut)}")
            groups.append(alive)
            bounds.append(tuple(cut))
    admitted = sum(len(g) for g in groups)
    newcomers = sorted(
        (m for m in members if m.worker_id not in prev_workers), key=lambda m: m.order
    )
    fresh = [m.worker_id for m in newcomers]
    if policy == "reshard":  # refill short replicas first
        for d, group in enumerate(groups):
            while len(group) < pp and fresh and admitted < max_workers:
                group.append(fresh.pop(0))
                admitted += 1
                current = _assignment(bounds[d]) if len(group) > 1 else None
                part = partition_layers(costs, [1.0] * len(group), current=current)
                bounds[d] = part.bounds
                notes.append(f"replica {d} refilled to {len(group)} stages")
    full = partition_layers(costs, [1.0] * pp).bounds
    while len(fresh) >= pp and admitted + pp <= max_workers and len(groups) < num_microbatches:
        groups.append(fresh[:pp])
        bounds.append(full)
        del fresh[:pp]
        admitted += pp
    if not groups:
        return None
    workers = tuple(w for g in groups for w in g)
    replicas, start = [], 0
    for g in groups:
        replicas.append(tuple(range(start, start + len(g))))
        start += len(g)
    shares = balanced_shares(num_microbatches, [_bottleneck(costs, b) for b in bounds],
                             [len(b) - 1 for b in bounds])  # fmt: skip
    plan_bounds = tuple(bounds)
    if prev is not None and workers == prev.workers and plan_bounds == prev.bounds:
        return None
    epoch = (prev.epoch if prev else 0) + 1
    grid = "×".join(str(len(g)) for g in groups)
    change = f"start: dp {len(groups)} × pp {pp}" if prev is None else f"stages {grid}"
    reason = f"epoch {epoch}: {change}, micro-batches {num_microbatches} → {list(shares)}"
    if notes:
        reason += " (" + "; ".join(notes) + ")"
    if cause:
        reason = f"{cause} → {reason}"
    return Plan(
        epoch=epoch,
        workers=workers,
        hosts=tuple(live[w].host for w in workers),
        microbatches=tuple(shares[d] for d, g in enumerate(groups) for _ in g),
        store=store,
        reason=reason,
        created=now,
        departed=tuple(w for w in (prev.workers if prev else ()) if w not in workers),
        replicas=tuple(replicas),
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
    """
    if not bottlenecks or len(bottlenecks) != len(stages):
        raise ValueError("need one bottleneck and one stage count per replica")
    counts = [0] * len(bottlenecks)
    for _ in range(total):
        finish = [(counts[d] + stages[d]) * bottlenecks[d] for d in range(len(counts))]
        best = min(range(len(counts)), key=lambda d: (finish[d], d))
        if finish[best] == float("inf"):
            raise ValueError("no replica can run micro-batches")
        counts[best] += 1
    return tuple(counts)


def serving_shares(plan: Plan, serving: Sequence[bool], costs: Sequence[float]) -> tuple[int, ...]:
    """Shares while some replicas are out of service (migrating): the global batch is spread
    over the serving replicas only, balanced the same way."""
    if not any(serving):
        raise ValueError("no replica left in service")
    bottlenecks = [
        _bottleneck(costs, b) if serving[d] else float("inf") for d, b in enumerate(plan.bounds)
    ]
    return balanced_shares(sum(plan.shares), bottlenecks, [len(b) - 1 for b in plan.bounds])


def _assignment(bounds: Sequence[int]) -> list[int]:
    return [s for s in range(len(bounds) - 1) for _ in range(bounds[s], bounds[s + 1])]


def _bounds(assignment: Sequence[int], stages: int) -> tuple[int, ...]:
    cuts = [0]
    for s in range(stages):
        cuts.append(cuts[-1] + sum(1 for a in assignment if a == s))
    return tuple(cuts)


def _bottleneck(costs: Sequence[float], bounds: Sequence[int]) -> float:
    return max(sum(costs[bounds[s] : bounds[s + 1]]) for s in range(len(bounds) - 1))
