"""The all-reduce by tiers (:mod:`elaswave.planning.tiers`): summed inside each host, each lane
all-reduced between the hosts by one rank per host (as int8 with ``train.grad_compress: int8``:
:mod:`~elaswave.runtime.comm.compress`), each lane shared back inside the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from elaswave.planning.tiers import HOST, LANE, Tiers, lane_bounds
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
            if cut:
                allreduce_int8(comm, f"{LANE}{j}", lane[:cut], abort)
            if cut < lane.numel():
                comm.allreduce(f"{LANE}{j}", lane[cut:], abort)
    if host:
        k = len(tiers.hosts[h])
        for j in range(tiers.lanes):
            if bounds[j] < bounds[j + 1]:
                comm.broadcast(host, values[bounds[j] : bounds[j + 1]], j % k, abort)
