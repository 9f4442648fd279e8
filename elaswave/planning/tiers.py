"""Hierarchical reduction over hosts: which ranks reduce together on each tier. Pure, no I/O.

A flat ring all-reduce over ``N`` ranks sends ``2 (N - 1) / N × M`` bytes per rank; with ranks
host by host, one rank per host sends that much across the slow inter-host link (about 2 M per
host, whatever the host's size; with ranks interleaved, every one does). Reduced by tiers:

1. inside each host, every rank's buffer is summed (the fast tier);
2. the buffer is cut into ``lanes`` contiguous slices; lane ``j`` is all-reduced between the
   hosts by one rank per host (``lane_groups``), so a host sends ``2 (H - 1) / H × M`` in all,
   spread over its ranks;
3. inside each host, each lane's owner shares the reduced slice with the others.

``lanes`` is the most ranks any host has; on a host with fewer ranks, rank ``j mod k`` owns lane
``j`` (so every lane group has one rank per host, whatever the hosts' sizes: a host that lost a
worker hands its lanes to its survivors). Every rank takes its lanes in lane order, so ranks that
share several lane groups never wait on each other in a cycle.

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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

MODES = ("auto", "flat")
HOST = "dp.host"  # group names: the host's ranks, ``dp.host<h>``; a lane's, ``dp.lane<j>``
LANE = "dp.lane"
RACK_LANE = "dp.rlane"  # with racks: lane j inside rack r, ``dp.rlane<j>.<r>``; slice q of lane
CROSS = "dp.xlane"  # j between the racks, ``dp.xlane<j>.<q>``


@dataclass(frozen=True)
class Tiers:
    """The ranks of each host (hosts in the order of their first rank) and the lanes; with
    racks, the hosts (indices into ``hosts``) of each rack, racks in the order of their first
    host (empty: no rack level)."""

    hosts: tuple[tuple[int, ...], ...]
    racks: tuple[tuple[int, ...], ...] = ()

    @cached_property
    def lanes(self) -> int:
        return max(len(h) for h in self.hosts)

    def lane_owner(self, host: int, lane: int) -> int:
        """The rank of host ``host`` that carries lane ``lane`` between the hosts."""
        ranks = self.hosts[host]
        return ranks[lane % len(ranks)]

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
        h, i = self.place(rank)
        k = len(self.hosts[h])
        return [j for j in range(self.lanes) if j % k == i]

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

    def groups(self, workers: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The process groups of the tiers, by name, members in rank order (a host of one rank
        needs no host group, a rack of one host no rack group)."""
        out = {
            f"{HOST}{h}": tuple(workers[r] for r in ranks)
            for h, ranks in enumerate(self.hosts)
            if len(ranks) > 1
        }
        if not self.racks:
            for j, ranks in enumerate(self.lane_groups()):
                out[f"{LANE}{j}"] = tuple(workers[r] for r in ranks)
            return out
        for j in range(self.lanes):
            for r, ranks in enumerate(self.rack_lane_groups(j)):
                if len(ranks) > 1:
                    out[f"{RACK_LANE}{j}.{r}"] = tuple(workers[x] for x in ranks)
            for q in range(self.sublanes):
                out[f"{CROSS}{j}.{q}"] = tuple(workers[x] for x in self.cross_group(j, q))
        return out


def tiers_of(
    hosts: Sequence[str], mode: str, racks: Mapping[str, str] | None = None
) -> Tiers | None:
    """The tiers of a plan whose rank ``r`` runs on ``hosts[r]``, or None for a flat reduction:
    ``mode`` flat, one host, or no host with two ranks and no rack with two hosts (tiers would
    only add hops). ``racks``: each host's rack (the plan's ``--rack`` labels); the rack level
    is used when every host has one, there are two racks or more and one has two hosts."""
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
    return Tiers(tuple(tuple(v) for v in ranks.values()), tuple(tuple(v) for v in by_rack.values()))


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
