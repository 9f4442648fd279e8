"""Plans: the layout every worker follows during one epoch, and the pure function that makes them.

A plan is a pure function of (previous plan, live membership, config). The leader daemon computes
it on every membership change, bumps the epoch and publishes it with a compare-and-set; workers
apply it at a step boundary (or at once, after a collective error). Nothing here does I/O.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, kw_only=True)
class Member:
    """A live worker as registered in etcd."""

    worker_id: str
    host: str
    order: int  # etcd create revision of its registration: earlier joiners get lower ranks

    @classmethod
    def from_dict(cls, data: dict) -> Member:
        return cls(worker_id=data["worker_id"], host=data["host"], order=int(data["order"]))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Who does what during one epoch.

    ``workers[r]`` is the worker with rank ``r``; ``microbatches[r]`` how many of the step's
    micro-batches it computes (contiguous ids, in rank order). The sum is always the configured
    number of micro-batches, so the global batch never changes.
    """

    epoch: int
    workers: tuple[str, ...]
    hosts: tuple[str, ...]
    microbatches: tuple[int, ...]
    store: str  # host:port of the rendezvous store for this epoch's process groups
    reason: str = ""
    created: float = 0.0
    departed: tuple[str, ...] = field(default=())  # workers of the previous plan not in this one
    # Pipeline parallelism (empty for pure data parallelism): ``replicas[d]`` lists the ranks of
    # replica d's stages in stage order, ``bounds[d]`` its layer boundaries (stage s of replica d
    # owns layers ``bounds[d][s]:bounds[d][s+1]``) and ``shares[d]`` its micro-batches per step.
    replicas: tuple[tuple[int, ...], ...] = field(default=())
    bounds: tuple[tuple[int, ...], ...] = field(default=())
    shares: tuple[int, ...] = field(default=())
    evicted: tuple[str, ...] = field(default=())  # departed because too slow: stop, do not respawn
    # The job's newest committed step when this plan was made (its progress record in etcd): a
    # plan whose ranks all hold no state must not start the job over (the engine's state check).
    committed: int = 0

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def rank_of(self, worker_id: str) -> int | None:
        try:
            return self.workers.index(worker_id)
        except ValueError:
            return None

    @property
    def is_pipeline(self) -> bool:
        return bool(self.replicas)

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a rank; pure data parallelism is one stage per replica."""
        for d, ranks in enumerate(self.replicas):
            if rank in ranks:
                return d, ranks.index(rank)
        if self.replicas:
            raise ValueError(f"rank {rank} is in no pipeline replica of epoch {self.epoch}")
        return rank, 0

    def stage_layers(self, rank: int) -> range:
        """The layers a pipeline rank owns."""
        d, s = self.position(rank)
        return range(self.bounds[d][s], self.bounds[d][s + 1])

    def microbatch_range(self, rank: int) -> range:
        if self.replicas:  # every stage of a replica runs the replica's micro-batches
            d, _ = self.position(rank)
            start = sum(self.shares[:d])
            return range(start, start + self.shares[d])
        start = sum(self.microbatches[:rank])
        return range(start, start + self.microbatches[rank])

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        d = json.loads(text)
        return cls(
            epoch=int(d["epoch"]),
            workers=tuple(d["workers"]),
            hosts=tuple(d["hosts"]),
            microbatches=tuple(int(x) for x in d["microbatches"]),
            store=d["store"],
            reason=d.get("reason", ""),
            created=float(d.get("created", 0.0)),
            departed=tuple(d.get("departed", ())),
            replicas=tuple(tuple(int(r) for r in rep) for rep in d.get("replicas", ())),
            bounds=tuple(tuple(int(b) for b in bs) for bs in d.get("bounds", ())),
            shares=tuple(int(x) for x in d.get("shares", ())),
            evicted=tuple(d.get("evicted", ())),
            committed=int(d.get("committed", 0)),
        )


def assign_microbatches(total: int, weights: Sequence[float]) -> tuple[int, ...]:
    """Split ``total`` micro-batches over ranks proportionally to ``weights`` (largest remainder).

    Deterministic: ties go to the lower rank. Every rank with a positive weight gets at least one
    micro-batch when ``total`` allows it.
    """
    if not weights:
        raise ValueError("no ranks to assign micro-batches to")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be >= 0 with a positive sum, got {list(weights)}")
    scale = sum(weights)
    exact = [total * w / scale for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda r: (-(exact[r] - counts[r]), r))
    for r in by_remainder[: total - sum(counts)]:
        counts[r] += 1
    # Guarantee a share to every positive-weight rank, taking from the largest (stable).
    for r, w in enumerate(weights):
        if w > 0 and counts[r] == 0:
            donor = max(range(len(counts)), key=lambda i: (counts[i], -i))
            if counts[donor] > 1:
                counts[donor] -= 1
                counts[r] += 1
    return tuple(counts)


def order_members(prev: Plan | None, members: Sequence[Member]) -> list[Member]:
    """Rank order: survivors keep their relative order, newcomers follow in join order."""
    live = {m.worker_id: m for m in members}
    kept = [live[w] for w in (prev.workers if prev else ()) if w in live]
    kept_ids = {m.worker_id for m in kept}
    newcomers = sorted((m for m in members if m.worker_id not in kept_ids), key=lambda m: m.order)
    return kept + newcomers


def next_plan(
    prev: Plan | None,
    members: Sequence[Member],
    *,
    num_microbatches: int,
    max_workers: int,
    store: str,
    now: float,
    cause: str = "",
) -> Plan | None:
    """The plan that follows ``prev`` for this membership, or ``None`` if nothing changes.

    At most ``max_workers`` are admitted (extra workers wait as standbys). The reason string says
    what changed and why, for ``status`` and the report.
    """
    ordered = order_members(prev, members)[: min(max_workers, num_microbatches)]
    if not ordered:
        return None
    workers = tuple(m.worker_id for m in ordered)
    if prev is not None and workers == prev.workers:
        return None
    counts = assign_microbatches(num_microbatches, [1.0] * len(workers))
    departed = tuple(w for w in (prev.workers if prev else ()) if w not in workers)
    epoch = (prev.epoch if prev else 0) + 1
    if prev is None:
        change = f"start: dp {len(workers)}"
    else:
        change = f"dp {prev.world_size}→{len(workers)}"
    reason = f"epoch {epoch}: {change}, micro-batches {num_microbatches} → {list(counts)}"
    if cause:
        reason = f"{cause} → {reason}"
    return Plan(
        epoch=epoch,
        workers=workers,
        hosts=tuple(m.host for m in ordered),
        microbatches=counts,
        store=store,
        reason=reason,
        created=now,
        departed=departed,
    )


def reshared_plan(
    prev: Plan,
    microbatches: Sequence[int],
    *,
    evict: Sequence[str] = (),
    store: str,
    now: float,
    cause: str = "",
) -> Plan:
    """The plan that follows ``prev`` with new micro-batch shares and without ``evict``.

    Same ranks (in the same order) otherwise: a straggler decision changes the dataflow, not the
    membership. ``microbatches`` are the shares of the remaining ranks; their sum must stay the
    configured number of micro-batches.
    """
    workers = tuple(w for w in prev.workers if w not in evict)
    if len(microbatches) != len(workers) or sum(microbatches) != sum(prev.microbatches):
        raise ValueError(
            f"shares {list(microbatches)} do not fit {len(workers)} ranks and "
            f"{sum(prev.microbatches)} micro-batches"
        )
    if not workers:
        raise ValueError("cannot evict every worker")
    hosts = tuple(h for w, h in zip(prev.workers, prev.hosts, strict=True) if w not in evict)
    epoch = prev.epoch + 1
    change = f"dp {prev.world_size}→{len(workers)}" if evict else f"dp {len(workers)}"
    reason = (
        f"epoch {epoch}: {change}, micro-batches {list(prev.microbatches)} → {list(microbatches)}"
    )
    if cause:
        reason = f"{cause} → {reason}"
    departed = tuple(w for w in prev.workers if w in evict)
    return Plan(
        epoch=epoch,
        workers=workers,
        hosts=hosts,
        microbatches=tuple(microbatches),
        store=store,
        reason=reason,
        created=now,
        departed=departed,
        evicted=departed,
    )
