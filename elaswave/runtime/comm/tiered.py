"""The all-reduce by tiers (:mod:`elaswave.planning.tiers`): summed inside each host, each lane
all-reduced between the hosts by one rank per host (as int8 with ``train.grad_compress: int8``:
:mod:`~elaswave.runtime.comm.compress`), each lane shared back inside the host. With racks, a
lane is summed inside each rack, its slices all-reduced between the racks (int8 there, the slowest
hop, when compressed) and shared back inside the rack.

The all-gather by tiers: each host's parts gathered inside the host (its *block*), each lane of
every block gathered between the hosts by one rank per host, each lane shared back inside the
host. A host sends its own block across once per other host, ``(H - 1) / H × M`` in all, where a
flat ring's hosts send ``(N - 1) / N × M`` each."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from elaswave.planning.tiers import Tiers, lane_bounds

__all__ = ["allgather_tiered", "allreduce_tiered"]
from elaswave.runtime.comm.compress import allreduce_int8

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator


def allreduce_tiered(
    comm: Communicator,
    flat: str,
    tiers: Tiers | None,
    *,
    tensor: torch.Tensor,
    abort: Callable[[], bool],
    compressed: int = 0,
) -> None:
    """SUM-reduce the contiguous ``tensor`` in place over group ``flat`` (whose rank ``r`` is
    the tiers' rank ``r``): by tiers, or with one ring over every rank without them.
    ``compressed``: how many leading elements (the gradient, not the counts after it) cross
    between hosts as int8 (tiers only; 0: none)."""
    if tiers is None:
        comm.allreduce(flat, tensor, abort)
        return
    rank = comm.rank(flat)
    h, _ = tiers.place(rank)
    host = tiers.host_group(h) if len(tiers.hosts[h]) > 1 else None
    if host:
        comm.allreduce(host, tensor, abort)
    values = tensor.view(-1)
    bounds = lane_bounds(values.numel(), tiers.lanes)
    for j in tiers.my_lanes(rank):  # ascending on every rank: no cycle between lane groups
        if bounds[j] < bounds[j + 1]:
            lane = values[bounds[j] : bounds[j + 1]]
            cut = max(0, min(lane.numel(), compressed - bounds[j]))
            if tiers.racks:
                _across_racks(comm, tiers, rank, lane=j, values=lane, cut=cut, abort=abort)
            else:
                _allreduce_lane(comm, tiers.lane_group(j), lane, cut=cut, abort=abort)
    if host:
        for j in range(tiers.lanes):
            if bounds[j] < bounds[j + 1]:
                root = tiers.owner_index(h, j)
                comm.broadcast(host, values[bounds[j] : bounds[j + 1]], root, abort=abort)


def _allreduce_lane(
    comm: Communicator, group: str, values: torch.Tensor, *, cut: int, abort: Callable[[], bool]
) -> None:
    """All-reduce ``values`` over ``group``, its first ``cut`` elements as int8."""
    if cut:
        allreduce_int8(comm, group, values[:cut], abort=abort)
    if cut < values.numel():
        comm.allreduce(group, values[cut:], abort)


def _across_racks(
    comm: Communicator,
    tiers: Tiers,
    rank: int,
    *,
    lane: int,
    values: torch.Tensor,
    cut: int,
    abort: Callable[[], bool],
) -> None:
    """Lane ``lane`` (``values``, this host's sum) summed inside the rack, each of its slices
    all-reduced between the racks by its carrier (the first ``cut`` elements as int8), then
    shared back inside the rack. Every rank goes slice by slice in ascending order."""
    r, _ = tiers.rack_place(rank)
    n = len(tiers.racks[r])
    inside = tiers.rack_lane_group(lane, r) if n > 1 else None
    if inside:
        comm.allreduce(inside, values, abort)
    subs = lane_bounds(values.numel(), tiers.sublanes)
    for q in tiers.my_sublanes(rank):
        a, b = subs[q], subs[q + 1]
        if a < b:
            part_cut = max(0, min(b - a, cut - a))
            group = tiers.cross_group_name(lane, q)
            _allreduce_lane(comm, group, values[a:b], cut=part_cut, abort=abort)
    if inside:
        for q in range(tiers.sublanes):
            if subs[q] < subs[q + 1]:
                comm.broadcast(inside, values[subs[q] : subs[q + 1]], q % n, abort=abort)


def allgather_tiered(
    comm: Communicator,
    flat: str,
    tiers: Tiers | None,
    *,
    out: torch.Tensor,
    part: torch.Tensor,
    abort: Callable[[], bool],
) -> None:
    """Concatenate every rank's equally sized ``part`` into ``out`` (rank order) over group
    ``flat`` (whose rank ``r`` is the tiers' rank ``r``): by hosts and lanes, or with one ring
    over every rank without tiers (or with racks: the lanes' groups are the racks' then)."""
    if tiers is None or tiers.racks:
        comm.allgather_into(flat, out, part, abort=abort)
        return
    rank, size = comm.rank(flat), part.numel()
    if size == 0:
        return
    h, _ = tiers.place(rank)
    mine = tiers.hosts[h]
    host = tiers.host_group(h) if len(mine) > 1 else None
    block = part.new_empty(len(mine) * size)
    if host:
        comm.allgather_into(host, block, part, abort=abort)
    else:
        block.copy_(part)
    bounds = [lane_bounds(len(ranks) * size, tiers.lanes) for ranks in tiers.hosts]
    width = max(b[j + 1] - b[j] for b in bounds for j in range(tiers.lanes))
    hosts = len(tiers.hosts)
    lanes: dict[int, torch.Tensor] = {}
    for j in tiers.my_lanes(rank):  # ascending on every rank: no cycle between lane groups
        a, b = bounds[h][j], bounds[h][j + 1]
        piece = part.new_zeros(width)
        piece[: b - a] = block[a:b]
        lanes[j] = part.new_empty(hosts * width)
        comm.allgather_into(tiers.lane_group(j), lanes[j], piece, abort=abort)
    for j in range(tiers.lanes):
        if j not in lanes:
            lanes[j] = part.new_empty(hosts * width)
        if host:
            comm.broadcast(host, lanes[j], tiers.owner_index(h, j), abort=abort)
    for g, ranks in enumerate(tiers.hosts):
        pieces = [
            lanes[j][g * width : g * width + bounds[g][j + 1] - bounds[g][j]]
            for j in range(tiers.lanes)
        ]
        blk = torch.cat(pieces)
        for i, r in enumerate(ranks):
            out[r * size : (r + 1) * size] = blk[i * size : (i + 1) * size]
