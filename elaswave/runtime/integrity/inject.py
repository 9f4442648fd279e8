"""Faults aimed at this rank (from the job config or ``elaswave inject-fault``), landed where they
act: a signal at a phase of the step (forward, reduce, optimizer, recovery), extra compute time
(``slow``), a flipped bit in committed state (``corrupt``) or in a gradient as it is computed
(``corrupt,target=grad``: a device that miscomputes), a loss and gradient that turn NaN
(``nan``). Every fault is announced with a
``fault_injected`` event before it lands: the MTTR report starts its incident there.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from elaswave.faults import FaultKind, FaultSpec
from elaswave.runtime.comm.control_client import ControlClient

__all__ = ["FaultInjector"]


class FaultInjector:
    """``sharded``: ZeRO (alone or inside pipeline stages) has an optimizer phase of its own;
    without it every step fault lands before the gradient reduction."""

    def __init__(
        self,
        control: ControlClient,
        *,
        worker_id: str,
        rank: Callable[[], int],
        epoch: Callable[[], int],
        sharded: bool,
    ) -> None:
        self.control = control
        self.worker_id = worker_id
        self.rank = rank
        self.epoch = epoch  # the plan epoch this worker runs (0 before its first)
        self.sharded = sharded
        self._slow_started: list[FaultSpec] = []  # slow faults already announced

    def fire(self, step: int, phase: str) -> None:
        """Signal faults due at ``step`` that aim at ``phase``: announce, flush, then the signal."""
        for fault in list(self.control.faults):
            if not fault.armed(self.epoch(), step):
                continue
            if fault.kind.signal is None:
                continue  # corruption lands after the commit (see corrupt); slow: compute
            own_phase = self.sharded or fault.phase in ("recovery", "forward")
            aimed_at = fault.phase if own_phase else "reduce"
            if aimed_at != phase:
                continue
            self.control.faults.remove(fault)
            self.injected(fault, step, phase=phase)
            self.control.flush(timeout=5.0)  # the record is out before the signal lands
            os.kill(os.getpid(), fault.kind.signal)

    def slowdown(self, step: int) -> float:
        """Extra compute seconds per step (at an even share) from ``slow`` faults in force."""
        total = 0.0
        for fault in list(self.control.faults):
            if fault.kind is not FaultKind.SLOW or not fault.armed(self.epoch(), step):
                continue
            if fault not in self._slow_started:
                self._slow_started.append(fault)
                self.injected(fault, step, delay=fault.delay)
            total += fault.delay or 0.0
        return total

    def poison(self, step: int, loss: torch.Tensor, grads: torch.Tensor) -> None:
        """``nan`` faults due at ``step``: this rank's loss sum (a one-element view of the
        step's tail) and the gradient sums it brings to the reduction turn NaN, as a bad
        sample's would."""
        for fault in list(self.control.faults):
            if fault.kind is FaultKind.NAN and fault.armed(self.epoch(), step):
                self.control.faults.remove(fault)
                self.injected(fault, step)
                loss.fill_(float("nan"))
                grads.fill_(float("nan"))

    def corrupt(self, step: int, flip: Callable[[str, int], str]) -> None:
        """``corrupt`` faults due at ``step``: ``flip(target, step)`` flips a bit of committed
        state and says where."""
        for fault in list(self.control.faults):
            if (
                fault.kind is FaultKind.CORRUPT
                and fault.target != "grad"
                and fault.armed(self.epoch(), step)
            ):
                self.control.faults.remove(fault)
                self.injected(fault, step, corrupted=flip(fault.target, step))

    def miscomputes(self, step: int) -> bool:
        """``corrupt,target=grad`` faults due at ``step``: whether this rank computes the
        gradients of the step's replayed micro-batches with one bit wrong (the whole-model data
        path asks once per step; the fault is spent and announced here)."""
        hit = False
        for fault in list(self.control.faults):
            if fault.kind is FaultKind.CORRUPT and fault.target == "grad":
                if fault.armed(self.epoch(), step):
                    self.control.faults.remove(fault)
                    self.injected(fault, step, corrupted="gradient")
                    hit = True
        return hit

    def injected(self, fault: FaultSpec, step: int, **detail: object) -> None:
        """The event the MTTR report starts an incident from (sent before the fault lands)."""
        self.control.event(
            "fault_injected",
            fault=fault.to_dict(),
            worker=self.worker_id,
            rank=self.rank(),
            step=step,
            pid=os.getpid(),
            **detail,
        )
