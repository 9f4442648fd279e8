"""Plans: the layout every worker follows during one epoch, and the pure function that makes them.

A plan is a pure function of (previous plan, live membership, config). The leader daemon computes
it on every membership change, bumps the epoch and publishes it with a compare-and-set; workers
apply it at a step boundary (or at once, after a collective error). Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from heapq import heapify, heappop, heappush
from itertools import accumulate, groupby
from typing import Any

LISTED = 16  # a reason lists at most this many values (or runs of equal values, or notes)


@dataclass(frozen=True, kw_only=True)
class Member:
    """A live worker as registered in etcd."""

    worker_id: str
    host: str
    order: int  # etcd create revision of its registration: earlier joiners get lower ranks
    rack: str = ""  # its host's tier above hosts (``launch --rack``; empty: none)

    @classmethod
    def from_dict(cls, data: dict) -> Member:
        return cls(
            worker_id=data["worker_id"], host=data["host"], order=int(data["order"]),
            rack=str(data.get("rack") or ""),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Plan:
    """Who does what during one epoch.

    ``workers[r]`` is the worker with rank ``r``; ``microbatches[r]`` how many of the step's
    micro-batches it computes (contiguous ids, in rank order). The sum is always the configured
    number of micro-batches, so the global batch never changes.

    Lookups by worker, rank or replica (:meth:`rank_of`, :meth:`position`,
    :meth:`microbatch_range`) use indexes built on first use and kept on the instance (not
    fields: equality, hashing and the wire format ignore them), so that a host that looks up
    all its ranks of a 100,000-rank plan does not scan the plan each time.
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
    # The tier above hosts: (host, rack) of every host of the plan that has one, sorted by host
    # (empty: no host was launched with ``--rack``).
    racks: tuple[tuple[str, str], ...] = field(default=())

    @property
    def world_size(self) -> int:
        return len(self.workers)

    def rank_of(self, worker_id: str) -> int | None:
        return self._ranks.get(worker_id)

    def host_place(self, host: str) -> int:
        """Where ``host`` comes in the plan's hosts, ordered by their first rank; a host with
        no rank comes after all of them."""
        return self._host_places.get(host, len(self._host_places))

    def rack_of(self, host: str) -> str:
        """``host``'s rack ("" when it has none)."""
        return self._racks.get(host, "")

    @cached_property
    def domains(self) -> tuple[str, ...]:
        """Per rank, what one fault can take with it: its rack when the ranks span two or more
        racks, else its host. A copy kept for a rank goes to another domain where one exists
        (ZeRO snapshots, pipeline keepers), so one host's, or one rack's, loss never takes a
        part and its copy together."""
        racks = tuple(self.rack_of(h) for h in self.hosts)
        return racks if len(set(racks)) > 1 else self.hosts

    @property
    def is_pipeline(self) -> bool:
        return bool(self.replicas)

    def position(self, rank: int) -> tuple[int, int]:
        """(replica, stage) of a rank; pure data parallelism is one stage per replica."""
        if not self.replicas:
            return rank, 0
        return self.roles(rank)[0]  # the first replica that lists it

    def roles(self, rank: int) -> tuple[tuple[int, int], ...]:
        """Every (replica, stage) a pipeline rank runs, in replica order: one, but for a rank
        that also runs a lost rank's stage for another replica (``stage_loss: recycle``). All of
        a rank's roles are the same stage of replicas cut alike: the same layers."""
        if not self.replicas:
            return ((rank, 0),)
        roles = self._roles.get(rank)
        if roles is None:
            raise ValueError(f"rank {rank} is in no pipeline replica of epoch {self.epoch}")
        return roles

    @property
    def rerouted(self) -> bool:
        """Whether some rank runs a stage for more than one replica (``stage_loss: recycle``)."""
        return any(len(roles) > 1 for roles in self._roles.values())

    def stage_layers(self, rank: int) -> range:
        """The layers a pipeline rank owns."""
        d, s = self.position(rank)
        return range(self.bounds[d][s], self.bounds[d][s + 1])

    def replica_range(self, d: int) -> range:
        """The micro-batch ids pipeline replica ``d`` runs."""
        return range(self._starts[d], self._starts[d] + self.shares[d])

    def microbatch_range(self, rank: int) -> range:
        if self.replicas:  # every stage of a replica runs the replica's micro-batches
            return self.replica_range(self.position(rank)[0])
        rank = range(self.world_size)[rank]  # IndexError and negative ranks as a tuple has them
        return range(self._starts[rank], self._starts[rank] + self.microbatches[rank])

    @cached_property
    def _ranks(self) -> dict[str, int]:
        """Worker id → its rank (the first, should a plan list a worker twice)."""
        ranks: dict[str, int] = {}
        for r, w in enumerate(self.workers):
            ranks.setdefault(w, r)
        return ranks

    @cached_property
    def _racks(self) -> dict[str, str]:
        return dict(self.racks)

    @cached_property
    def _host_places(self) -> dict[str, int]:
        return {h: i for i, h in enumerate(dict.fromkeys(self.hosts))}

    @cached_property
    def _roles(self) -> dict[int, tuple[tuple[int, int], ...]]:
        """Rank → every (replica, stage) that lists it."""
        roles: dict[int, tuple[tuple[int, int], ...]] = {}
        for d, ranks in enumerate(self.replicas):
            for s, r in enumerate(ranks):
                roles[r] = (*roles.get(r, ()), (d, s))
        return roles

    @cached_property
    def _starts(self) -> list[int]:
        """The first micro-batch id of every replica (pipelines) or rank (data parallelism)."""
        return list(accumulate(self.shares if self.replicas else self.microbatches, initial=0))


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
    _one_each(counts, [r for r, w in enumerate(weights) if w > 0 and counts[r] == 0])
    return tuple(counts)


def _one_each(counts: list[int], needy: Sequence[int]) -> None:
    """Give each rank of ``needy`` (in order) one micro-batch from the rank that has the most at
    that moment (the lowest such rank on ties), while that one has more than one.

    A heap of (-count, rank) finds that rank in O(log n), where a scan per needy rank made the
    split quadratic. A donor's count only falls, so an entry whose count is not the rank's count
    now is stale and skipped."""
    if not needy:
        return
    heap = [(-c, i) for i, c in enumerate(counts)]
    heapify(heap)
    for r in needy:
        while -heap[0][0] != counts[heap[0][1]]:
            heappop(heap)
        most, donor = -heap[0][0], heap[0][1]
        if most <= 1:
            return  # counts never rise above 1 again: nobody can give any more
        counts[donor] -= 1
        counts[r] += 1
        heappush(heap, (-counts[donor], donor))
        heappush(heap, (-counts[r], r))


def order_members(prev: Plan | None, members: Sequence[Member]) -> list[Member]:
    """Rank order: survivors keep their relative order, newcomers follow in join order."""
    live = {m.worker_id: m for m in members}
    kept = [live[w] for w in (prev.workers if prev else ()) if w in live]
    kept_ids = {m.worker_id for m in kept}
    newcomers = sorted((m for m in members if m.worker_id not in kept_ids), key=lambda m: m.order)
    return kept + newcomers


def by_host(members: Sequence[Member]) -> list[Member]:
    """Ranks rack by rack, host by host: the racks in the order their first member comes, in
    each rack its hosts in the order their first member comes, each host's members in the order
    they come (no racks: host by host). A ring over these ranks crosses between hosts once per
    host and between racks once per rack; in registration order the hosts can interleave, and a
    ring that crosses at every hop sends twice the bytes between hosts."""
    rack: dict[str, int] = {}
    host: dict[str, int] = {}
    for m in members:
        rack.setdefault(m.rack, len(rack))
        host.setdefault(m.host, len(host))
    return sorted(members, key=lambda m: (rack[m.rack], host[m.host]))


def racks_of(members: Iterable[Member]) -> tuple[tuple[str, str], ...]:
    """The plan's ``racks``: (host, rack) of every member's host that has one, sorted."""
    return tuple(sorted({(m.host, m.rack) for m in members if m.rack}))


def next_plan(
    prev: Plan | None,
    members: Sequence[Member],
    *,
    num_microbatches: int,
    max_workers: int,
    store: str,
    now: float,
    cause: str = "",
    epoch_floor: int = 0,
    per_rank: int | None = None,
) -> Plan | None:
    """The plan that follows ``prev`` for this membership, or ``None`` if nothing changes.

    At most ``max_workers`` are admitted (extra workers wait as standbys). The reason string says
    what changed and why, for ``status`` and the report. A job relaunched under its id starts
    past the epochs it recorded (``epoch_floor``), so that its epochs only grow. ``per_rank``
    (``train.batch: shrink``): each rank trains that many micro-batches, and a smaller world
    fewer of the step's ``num_microbatches``; else the world shares all of them.
    """
    ordered = by_host(order_members(prev, members)[: min(max_workers, num_microbatches)])
    if not ordered:
        return None
    workers = tuple(m.worker_id for m in ordered)
    if prev is not None and workers == prev.workers:
        return None
    if per_rank is not None:
        num_microbatches = min(num_microbatches, per_rank * len(workers))
    counts = assign_microbatches(num_microbatches, [1.0] * len(workers))
    departed = gone(prev.workers if prev else (), workers)
    epoch = max(prev.epoch if prev else 0, epoch_floor) + 1
    if prev is None:
        change = f"start: dp {len(workers)}"
    else:
        change = f"dp {prev.world_size}→{len(workers)}"
    reason = f"epoch {epoch}: {change}, micro-batches {num_microbatches} → {listed(counts)}"
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
        racks=racks_of(ordered),
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
    leaving = set(evict)
    workers = tuple(w for w in prev.workers if w not in leaving)
    if len(microbatches) != len(workers) or sum(microbatches) != sum(prev.microbatches):
        raise ValueError(
            f"shares {listed(microbatches)} do not fit {len(workers)} ranks and "
            f"{sum(prev.microbatches)} micro-batches"
        )
    if not workers:
        raise ValueError("cannot evict every worker")
    hosts = tuple(h for w, h in zip(prev.workers, prev.hosts, strict=True) if w not in leaving)
    kept_hosts = set(hosts)
    epoch = prev.epoch + 1
    change = f"dp {prev.world_size}→{len(workers)}" if evict else f"dp {len(workers)}"
    reason = (
        f"epoch {epoch}: {change}, micro-batches {listed(prev.microbatches)} → "
        f"{listed(microbatches)}"
    )
    if cause:
        reason = f"{cause} → {reason}"
    departed = tuple(w for w in prev.workers if w in leaving)
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
        racks=tuple(p for p in prev.racks if p[0] in kept_hosts),
    )


def moved_store(prev: Plan, store: str, *, leader: str, now: float, epoch_floor: int = 0) -> Plan:
    """``prev`` again under its next epoch (after ``epoch_floor``, as :func:`next_plan`) with the
    rendezvous store at ``store``: a new leader's first plan when membership did not change. The
    store lives in the leader's daemon, and the one ``prev`` names may have left with its host
    (a host whose workers were all evicted goes away, and nothing in the membership says so):
    the ranks would wait for it forever."""
    epoch = max(prev.epoch, epoch_floor) + 1
    return replace(
        prev,
        epoch=epoch,
        store=store,
        reason=f"leader {leader} → epoch {epoch}: the rendezvous store moved to its daemon",
        created=now,
        departed=(),
        evicted=(),
    )


def gone(before: Sequence[str], after: Sequence[str]) -> tuple[str, ...]:
    """The workers of ``before`` (in its order) that ``after`` lacks; a set, not a scan of
    ``after`` per worker, so that it stays linear at 100,000 ranks."""
    kept = set(after)
    return tuple(w for w in before if w not in kept)


def listed(values: Sequence[object], *, limit: int = LISTED) -> str:
    """``values`` for a reason, short at any scale: as Python prints a list while there are at
    most ``limit`` (``[6, 5, 5]``), else as runs ``count×value`` of equal values
    (``[16×3, 99976×2]``), the first ``limit`` of them and then how many more."""
    if len(values) <= limit:
        return str(list(values))
    runs = [f"{n}×{v}" if n > 1 else f"{v}" for v, n in run_lengths(values)]
    more = [f"… {len(runs) - limit} more runs"] if len(runs) > limit else []
    return "[" + ", ".join(runs[:limit] + more) + "]"


def capped(notes: Sequence[str], *, limit: int = LISTED) -> list[str]:
    """The first ``limit`` of ``notes``, then ``… and N more`` for the rest."""
    if len(notes) <= limit:
        return list(notes)
    return [*notes[:limit], f"… and {len(notes) - limit} more"]


def run_lengths(values: Iterable[Any]) -> list[tuple[Any, int]]:
    """``values`` as (value, how many times in a row): ``[3, 3, 2] → [(3, 2), (2, 1)]``."""
    return [(v, sum(1 for _ in run)) for v, run in groupby(values)]
