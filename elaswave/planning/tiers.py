"""Hierarchical reduction over hosts: which ranks reduce together on each tier. Pure, no I/O.

A flat ring all-reduce over ``N`` ranks sends ``2 (N - 1) / N × M`` bytes per rank; with ranks
host by host, one rank per host sends that much across the slow inter-host link (about 2 M per
host, whatever the host's size; with ranks interleaved, every one does). Reduced by tiers:

1. inside each host, every rank's buffer is summed (the fast tier);
2. the buffer is cut into ``lanes`` contiguous slices; lane ``j`` is all-reduced between the
   hosts by one rank per host (``lane_groups``), so a host sends ``2 (H - 1) / H × M`` in all,
   spread over its ranks;
3. inside each host, each lane's owner shares the reduced slice with the others.

``lanes`` is the most ranks any host has. A worker carries the lane of its slot on the host (the
``w<slot>`` of its id, which a respawn keeps), so a plan that loses or regains a worker changes
only the lanes of that slot; lanes without a worker of their slot go round robin to the host's
ranks, fewest lanes first (:func:`lane_owners`). Without slots (ids of another form) rank ``i``
of a host stands in slot ``i``: on a host of ``k`` ranks, rank ``j mod k`` carries lane ``j``.
Every lane group has one rank per host whatever the hosts' sizes, and every rank takes its lanes
in lane order, so ranks that share several lane groups never wait on each other in a cycle.

With racks (``launch --rack``, every host of the plan labelled, two racks or more, one of them
with two hosts or more), step 2 has two levels: lane ``j`` is first all-reduced inside each rack by
its owners there (``rack_lane_groups``); then the lane is cut into ``sublanes`` slices (the most
hosts any rack has), slice ``q`` all-reduced between the racks by one lane owner per rack, the one
on the rack's host ``q mod n`` (``cross_group``); each slice is then shared back inside the rack's
lane group by its carrier. A rack sends ``2 (R - 1) / R × M`` between racks in all, spread over its
hosts, where each lane's ring over all the hosts would send ``2 (H - 1) / H × M``.

The sums are the same sums as the flat ring's, in another order, divided once by the global count
afterwards (never an average of averages); in the float64 reduction mode the losses are bit for
bit the flat ones (the tests check it).

    >>> t = tiers_of(["a", "a", "b", "b", "b"], "auto")
    >>> t.hosts, t.lanes, t.lane_groups()
    (((0, 1), (2, 3, 4)), 3, ((0, 2), (1, 3), (0, 4)))
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

MODES = ("auto", "flat")


@dataclass(frozen=True)
class Tiers:
    """The ranks of each host (hosts in the order of their first rank) and the lanes; with
    racks, the hosts (indices into ``hosts``) of each rack, racks in the order of their first
    host (empty: no rack level)."""

    hosts: tuple[tuple[int, ...], ...]
    racks: tuple[tuple[int, ...], ...] = ()
    slots: tuple[int | None, ...] = ()  # each rank's slot on its host (empty: its position)
    # The groups' names start with it: data parallelism's ``dp``; a pipeline's holder group
    # has its own (:func:`~elaswave.planning.gradgroups.group_name`)
    prefix: str = "dp"

    # ---- the groups' names ----------------------------------------------------------------
    def host_group(self, h: int) -> str:
        """Host ``h``'s ranks: ``dp.host<h>``."""
        return f"{self.prefix}.host{h}"

    def lane_group(self, j: int) -> str:
        """Lane ``j``'s ranks between the hosts: ``dp.lane<j>``."""
        return f"{self.prefix}.lane{j}"

    def rack_lane_group(self, j: int, r: int) -> str:
        """With racks, lane ``j``'s owners inside rack ``r``: ``dp.rlane<j>.<r>``."""
        return f"{self.prefix}.rlane{j}.{r}"

    def cross_group_name(self, j: int, q: int) -> str:
        """With racks, slice ``q`` of lane ``j`` between the racks: ``dp.xlane<j>.<q>``."""
        return f"{self.prefix}.xlane{j}.{q}"

    @cached_property
    def lanes(self) -> int:
        return max(len(h) for h in self.hosts)

    @cached_property
    def owners(self) -> tuple[tuple[int, ...], ...]:
        """``owners[h][j]``: the rank of host ``h`` that carries lane ``j``."""
        out = []
        for ranks in self.hosts:
            slots = [self.slots[r] for r in ranks] if self.slots else list(range(len(ranks)))
            out.append(lane_owners(ranks, slots, self.lanes))
        return tuple(out)

    def lane_owner(self, host: int, lane: int) -> int:
        """The rank of host ``host`` that carries lane ``lane`` between the hosts."""
        return self.owners[host][lane]

    def lane_groups(self) -> tuple[tuple[int, ...], ...]:
        """Lane ``j``'s ranks: one per host, in host order."""
        return tuple(
            tuple(self.lane_owner(h, j) for h in range(len(self.hosts))) for j in range(self.lanes)
        )

    @cached_property
    def _place(self) -> dict[int, tuple[int, int]]:
        return {r: (h, i) for h, ranks in enumerate(self.hosts) for i, r in enumerate(ranks)}

    def place(self, rank: int) -> tuple[int, int]:
        """(its host's index, its index among the host's ranks)."""
        return self._place[rank]

    def my_lanes(self, rank: int) -> list[int]:
        """The lanes ``rank`` carries, ascending."""
        h, _ = self.place(rank)
        return [j for j, owner in enumerate(self.owners[h]) if owner == rank]

    def owner_index(self, host: int, lane: int) -> int:
        """The lane's carrier as a rank of its host's group (the broadcast's root)."""
        return self.hosts[host].index(self.owners[host][lane])

    # ---- the rack level ------------------------------------------------------------------
    @cached_property
    def sublanes(self) -> int:
        """Slices of a lane between the racks: the most hosts any rack has (0: no racks)."""
        return max((len(r) for r in self.racks), default=0)

    @cached_property
    def _rack_of(self) -> dict[int, tuple[int, int]]:
        return {h: (r, i) for r, hosts in enumerate(self.racks) for i, h in enumerate(hosts)}

    def rack_place(self, rank: int) -> tuple[int, int]:
        """(its rack's index, its host's index in the rack)."""
        return self._rack_of[self.place(rank)[0]]

    def rack_lane_groups(self, lane: int) -> tuple[tuple[int, ...], ...]:
        """Per rack, the owners of ``lane`` on its hosts (in the rack's host order)."""
        return tuple(tuple(self.lane_owner(h, lane) for h in hosts) for hosts in self.racks)

    def cross_group(self, lane: int, sub: int) -> tuple[int, ...]:
        """Slice ``sub`` of ``lane``'s carriers between the racks: per rack, the lane's owner on
        its host ``sub mod n`` (rack order)."""
        return tuple(self.lane_owner(hosts[sub % len(hosts)], lane) for hosts in self.racks)

    def my_sublanes(self, rank: int) -> list[int]:
        """The slices of each of its lanes that ``rank`` carries between the racks, ascending."""
        r, i = self.rack_place(rank)
        n = len(self.racks[r])
        return [q for q in range(self.sublanes) if q % n == i]

    def secondary(self, rank: int) -> tuple[str, int, int] | None:
        """ZeRO-3's host-local secondary partition (hpZ) for ``rank``: (its host's group, its
        index in it, the host's ranks); None when some host of the plan has a single rank (it
        would keep whole layers), so that every rank gathers alike.

            >>> Tiers(((0, 1), (2, 3, 4))).secondary(3)
            ('dp.host1', 1, 3)
            >>> Tiers(((0, 1), (2,))).secondary(0) is None
            True
        """
        if min(len(ranks) for ranks in self.hosts) < 2:
            return None
        h, i = self.place(rank)
        return self.host_group(h), i, len(self.hosts[h])

    def groups(self, workers: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The process groups of the tiers, by name, members in rank order (a host of one rank
        needs no host group, a rack of one host no rack group)."""
        out = {
            self.host_group(h): tuple(workers[r] for r in ranks)
            for h, ranks in enumerate(self.hosts)
            if len(ranks) > 1
        }
        if not self.racks:
            for j, ranks in enumerate(self.lane_groups()):
                out[self.lane_group(j)] = tuple(workers[r] for r in ranks)
            return out
        for j in range(self.lanes):
            for r, ranks in enumerate(self.rack_lane_groups(j)):
                if len(ranks) > 1:
                    out[self.rack_lane_group(j, r)] = tuple(workers[x] for x in ranks)
            for q in range(self.sublanes):
                members = tuple(workers[x] for x in self.cross_group(j, q))
                out[self.cross_group_name(j, q)] = members
        return out


def lane_owners(ranks: Sequence[int], slots: Sequence[int | None], lanes: int) -> tuple[int, ...]:
    """Lane ``j``'s carrier among one host's ``ranks`` (``slots``: each one's slot on the host,
    None where unknown): the rank of slot ``j`` where there is one; each other lane to the rank
    that carries the fewest so far (the first in ``ranks`` among equals).

        >>> lane_owners([5, 6, 7], [0, 2, 3], 4)  # slot 1's worker was lost: its lane moves
        (5, 5, 6, 7)
        >>> lane_owners([0, 1], [0, 1], 3)  # a host of two among hosts of three: j mod 2
        (0, 1, 0)
    """
    owner: dict[int, int] = {}
    for rank, slot in zip(ranks, slots, strict=True):
        if slot is not None and 0 <= slot < lanes and slot not in owner:
            owner[slot] = rank
    load = dict.fromkeys(ranks, 0)
    for rank in owner.values():
        load[rank] += 1
    for j in range(lanes):
        if j not in owner:
            rank = min(ranks, key=lambda r: load[r])  # min keeps the first among equals
            owner[j] = rank
            load[rank] += 1
    return tuple(owner[j] for j in range(lanes))


def worker_slot(worker: str) -> int | None:
    """A worker's slot on its host, from its id (``<host>.w<slot>``, ``.r<n>`` after a respawn:
    :func:`elaswave.daemon.workers.worker_id`); None for an id of another form."""
    match = _WORKER_ID.fullmatch(worker)
    return int(match.group(1)) if match else None


_WORKER_ID = re.compile(r".+\.w(\d+)(?:\.r\d+)?")


def tiers_of(
    hosts: Sequence[str],
    mode: str,
    racks: Mapping[str, str] | None = None,
    *,
    workers: Sequence[str] = (),
    prefix: str = "dp",
) -> Tiers | None:
    """The tiers of a plan whose rank ``r`` runs on ``hosts[r]``, or None for a flat reduction:
    ``mode`` flat, one host, or no host with two ranks and no rack with two hosts (tiers would
    only add hops). ``racks``: each host's rack (the plan's ``--rack`` labels); the rack level
    is used when every host has one, there are two racks or more and one has two hosts.
    ``workers``: the ranks' ids, whose slots keep each worker on its lanes from plan to plan
    (a host's ranks stand in their positions' slots without them). ``prefix``: the groups'
    names start with it."""
    if mode not in MODES:
        raise ValueError(f"hierarchy must be one of {', '.join(MODES)}, got {mode!r}")
    ranks: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        ranks.setdefault(host, []).append(r)
    names = list(ranks)
    by_rack: dict[str, list[int]] = {}
    if racks and all(racks.get(h) for h in names):
        for h, name in enumerate(names):
            by_rack.setdefault(racks[name], []).append(h)
    if len(by_rack) < 2 or all(len(v) < 2 for v in by_rack.values()):
        by_rack = {}
    if mode == "flat" or len(ranks) < 2:
        return None
    if all(len(v) < 2 for v in ranks.values()) and not by_rack:
        return None
    slots = tuple(worker_slot(w) for w in workers) if len(workers) == len(hosts) else ()
    return Tiers(
        tuple(tuple(v) for v in ranks.values()),
        tuple(tuple(v) for v in by_rack.values()),
        slots,
        prefix,
    )


def lane_bounds(n: int, lanes: int) -> list[int]:
    """Where each of ``lanes`` contiguous slices of ``n`` elements starts, and ``n`` at the end;
    sizes differ by at most one, the first ones larger.

        >>> lane_bounds(10, 3)
        [0, 4, 7, 10]
    """
    if lanes < 1:
        raise ValueError(f"need at least one lane, got {lanes}")
    size, extra = divmod(n, lanes)
    out = [0]
    for j in range(lanes):
        out.append(out[-1] + size + (1 if j < extra else 0))
    return out
