"""A host's workers' compute times, shared with the leader.

Workers report their seconds per micro-batch (straggler detection) and, with
``layer_costs: online``, their seconds per layer (the next pipeline plan). The daemon keeps the
newest of each and publishes them every ``COMPUTE_PUBLISH_S`` in per-host keys under the host
lease, apart from the worker keys: a late write never makes a dead worker look alive, and never
wakes the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from elaswave import wire
from elaswave.daemon.jobstore import JobStore
from elaswave.planning.verdicts import WINDOW
from elaswave.wire_etcd import LayerCostsReport, Speeds, WorkerLayerCosts, WorkerSpeed

COMPUTE_PUBLISH_S = 0.5  # how often a host shares its workers' compute times with the leader


class ComputeTimes:
    def __init__(self) -> None:
        # worker -> (plan epoch, its newest compute seconds per micro-batch under that epoch)
        self.per_mb: dict[str, tuple[int, list[float]]] = {}
        self.layer_costs: dict[str, WorkerLayerCosts] = {}  # worker -> its layers' seconds
        self._per_mb_dirty = False
        self._costs_dirty = False

    def measured(self, wid: str, msg: wire.Compute) -> None:
        """A worker's ``compute`` report: its seconds per micro-batch under a plan epoch, one
        step's or several (workers batch them), oldest first."""
        epoch, samples = self.per_mb.get(wid, (0, []))
        if msg.epoch != epoch:
            epoch, samples = msg.epoch, []  # speeds under another plan do not count
        samples = [*samples, *(float(x) for x in msg.per_mb)][-WINDOW:]
        self.per_mb[wid] = (epoch, samples)
        self._per_mb_dirty = True

    def measured_layers(self, wid: str, msg: wire.LayerCosts) -> None:
        """A worker's ``layer_costs`` report (pipelines, ``layer_costs: online``)."""
        self.layer_costs[wid] = WorkerLayerCosts(
            step=msg.step, epoch=msg.epoch, layer_seconds=dict(msg.layer_seconds)
        )
        self._costs_dirty = True

    async def publish(
        self,
        store: JobStore,
        host_id: str,
        *,
        lease: Callable[[], Any],
        alive: Callable[[], set[str]],
    ) -> None:
        """Share what changed every ``COMPUTE_PUBLISH_S``, for the workers ``alive`` says are
        running, under the host's current ``lease``. A write that fails is skipped: the next
        measurement is written again."""
        while True:
            await asyncio.sleep(COMPUTE_PUBLISH_S)
            if not (self._per_mb_dirty or self._costs_dirty):
                continue  # nothing new: no scan of the workers
            live = alive()
            if self._per_mb_dirty:
                self._per_mb_dirty = False
                speeds = Speeds(
                    {
                        wid: WorkerSpeed(epoch=epoch, per_mb=samples)
                        for wid, (epoch, samples) in self.per_mb.items()
                        if wid in live
                    }
                )
                with contextlib.suppress(Exception):
                    await store.share_speeds(host_id, speeds, lease=lease())
            if self._costs_dirty:
                self._costs_dirty = False
                costs = LayerCostsReport(
                    {wid: c for wid, c in self.layer_costs.items() if wid in live}
                )
                with contextlib.suppress(Exception):
                    await store.share_layer_costs(host_id, costs, lease=lease())
