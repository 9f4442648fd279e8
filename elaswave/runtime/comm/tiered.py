"""The all-reduce by tiers (:mod:`elaswave.planning.tiers`): summed inside each host, each lane
all-reduced between the hosts by one rank per host, each lane shared back inside the host."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from elaswave.planning.tiers import HOST, LANE, Tiers, lane_bounds

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator


def allreduce_tiered(
    comm: Communicator,
    flat: str,
    tiers: Tiers | None,
    tensor: torch.Tensor,
    abort: Callable[[], bool],
) -> None:
    """SUM-reduce the contiguous ``tensor`` in place over group ``flat`` (whose rank ``r`` is
    the tiers' rank ``r``): by tiers, or with one ring over every rank without them."""
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
            comm.allreduce(f"{LANE}{j}", values[bounds[j] : bounds[j + 1]], abort)
    if host:
        k = len(tiers.hosts[h])
        for j in range(tiers.lanes):
            if bounds[j] < bounds[j + 1]:
                comm.broadcast(host, values[bounds[j] : bounds[j + 1]], j % k, abort)
