"""The all-reduce by tiers (:mod:`elaswave.planning.tiers`): summed inside each host, each lane
all-reduced between the hosts by one rank per host (as int8 with ``train.grad_compress: int8``:
:mod:`~elaswave.runtime.comm.compress`), each lane shared back inside the host. With racks, a
lane is summed inside each rack, its slices all-reduced between the racks (int8 there, the slowest
hop, when compressed) and shared back inside the rack."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from elaswave.planning.tiers import CROSS, HOST, LANE, RACK_LANE, Tiers, lane_bounds
from elaswave.runtime.comm.compress import allreduce_int8

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator


def allreduce_tiered(
    comm: Communicator,
    flat: str,
    tiers: Tiers | None,
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
    host = f"{HOST}{h}" if len(tiers.hosts[h]) > 1 else None
    if host:
        comm.allreduce(host, tensor, abort)
    values = tensor.view(-1)
    bounds = lane_bounds(values.numel(), tiers.lanes)
    for j in tiers.my_lanes(rank):  # ascending on every rank: no cycle between lane groups
        if bounds[j] < bounds[j + 1]:
            lane = values[bounds[j] : bounds[j + 1]]
            cut = max(0, min(lane.numel(), compressed - bounds[j]))
            if tiers.racks:
                _across_racks(comm, tiers, rank, j, lane, cut, abort)
            else:
                _allreduce_lane(comm, f"{LANE}{j}", lane, cut, abort)
    if host:
        for j in range(tiers.lanes):
            if bounds[j] < bounds[j + 1]:
                root = tiers.owner_index(h, j)
                comm.broadcast(host, values[bounds[j] : bounds[j + 1]], root, abort)


def _allreduce_lane(
    comm: Communicator, group: str, values: torch.Tensor, cut: int, abort: Callable[[], bool]
) -> None:
    """All-reduce ``values`` over ``group``, its first ``cut`` elements as int8."""
    if cut:
        allreduce_int8(comm, group, values[:cut], abort)
    if cut < values.numel():
        comm.allreduce(group, values[cut:], abort)


def _across_racks(
    comm: Communicator,
    tiers: Tiers,
    rank: int,
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
    inside = f"{RACK_LANE}{lane}.{r}" if n > 1 else None
    if inside:
        comm.allreduce(inside, values, abort)
    subs = lane_bounds(values.numel(), tiers.sublanes)
    for q in tiers.my_sublanes(rank):
        a, b = subs[q], subs[q + 1]
        if a < b:
            part_cut = max(0, min(b - a, cut - a))
            _allreduce_lane(comm, f"{CROSS}{lane}.{q}", values[a:b], part_cut, abort)
    if inside:
        for q in range(tiers.sublanes):
            if subs[q] < subs[q + 1]:
                comm.broadcast(inside, values[subs[q] : subs[q + 1]], q % n, abort)
