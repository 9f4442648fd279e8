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

The sums are the same sums as the flat ring's, in another order, divided once by the global count
afterwards (never an average of averages); in the float64 reduction mode the losses are bit for
bit the flat ones (the tests check it).

    >>> t = tiers_of(["a", "a", "b", "b", "b"], "auto")
    >>> t.hosts, t.lanes, t.lane_groups()
    (((0, 1), (2, 3, 4)), 3, ((0, 2), (1, 3), (0, 4)))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

MODES = ("auto", "flat")
HOST = "dp.host"  # group names: the host's ranks, ``dp.host<h>``; a lane's, ``dp.lane<j>``
LANE = "dp.lane"


@dataclass(frozen=True)
class Tiers:
    """The ranks of each host (hosts in the order of their first rank) and the lanes."""

    hosts: tuple[tuple[int, ...], ...]

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

    def groups(self, workers: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """The process groups of the tiers, by name, members in rank order (a host of one rank
        needs no host group)."""
        out = {
            f"{HOST}{h}": tuple(workers[r] for r in ranks)
            for h, ranks in enumerate(self.hosts)
            if len(ranks) > 1
        }
        for j, ranks in enumerate(self.lane_groups()):
            out[f"{LANE}{j}"] = tuple(workers[r] for r in ranks)
        return out


def tiers_of(hosts: Sequence[str], mode: str) -> Tiers | None:
    """The tiers of a plan whose rank ``r`` runs on ``hosts[r]``, or None for a flat reduction:
    ``mode`` flat, one host, or no host with two ranks (tiers would only add hops)."""
    if mode not in MODES:
        raise ValueError(f"hierarchy must be one of {', '.join(MODES)}, got {mode!r}")
    ranks: dict[str, list[int]] = {}
    for r, host in enumerate(hosts):
        ranks.setdefault(host, []).append(r)
    if mode == "flat" or len(ranks) < 2 or all(len(v) < 2 for v in ranks.values()):
        return None
    return Tiers(tuple(tuple(v) for v in ranks.values()))


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
