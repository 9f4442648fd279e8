"""What a rank tells its daemon about itself beside its commits: its compute seconds per
micro-batch (the leader's straggler detector compares them) and the bytes it holds by purpose
(``status`` and the report show them).

Apart from :mod:`~elaswave.runtime.engine`, which measures both: this decides when each is sent.
Compute times go in batches, at most one message per heartbeat interval, and a step a checkpoint
write ran beside is left out, up to :data:`SKIPPED_MAX` in a row; the memory goes once under each
plan and again whenever it changed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from elaswave import wire

if TYPE_CHECKING:
    from elaswave.runtime.comm.control_client import ControlClient

SKIPPED_MAX = 3  # compute times left unreported in a row while a checkpoint is written


def skipped_next(writing: bool, skipped: int) -> int:
    """How many compute times in a row are left unreported after this step's (0: this one is
    reported): one is while a checkpoint write runs beside it, up to ``SKIPPED_MAX`` in a row."""
    return skipped + 1 if writing and skipped < SKIPPED_MAX else 0


class Telemetry:
    """One rank's compute times and memory, to its daemon through ``control``."""

    def __init__(self, control: ControlClient, *, worker_id: str, interval: float) -> None:
        self.control = control
        self.me = worker_id
        self.interval = interval  # the heartbeat interval: at most one compute message in it
        self._speeds: list[float] = []  # compute seconds per micro-batch not yet reported
        self._speeds_epoch, self._speeds_sent = 0, 0.0
        self._skipped = 0  # compute times not reported in a row (a checkpoint write ran beside)
        self._memory: tuple[int, dict[str, int]] | None = None  # (epoch, bytes) reported last

    def computed(self, step: int, per_mb: float | None, *, epoch: int, writing: bool) -> None:
        """A committed step's compute seconds per micro-batch (None: it computed nothing) under
        the plan of ``epoch``; ``writing``: a checkpoint write ran beside it."""
        # Not a step this rank's checkpoint writer ran beside (that thread shares the process's
        # cores and interpreter lock: rank 0, which writes the whole state, would look slow for
        # its own write), unless it has run beside SKIPPED_MAX steps in a row (a writer that
        # never rests must not hide a straggler).
        self._skipped = skipped_next(writing, self._skipped)
        if per_mb is not None and not self._skipped:
            self._report_speed(step, per_mb, epoch)

    def _report_speed(self, step: int, per_mb: float, epoch: int) -> None:
        """Compute times go to the daemon in batches, at most one message per heartbeat interval
        (the daemon shares them with the leader every half second anyway); a new plan epoch
        sends what the old one measured first."""
        now = time.monotonic()
        if self._speeds and self._speeds_epoch != epoch:
            self._send_speeds(step - 1)
        self._speeds.append(per_mb)
        self._speeds_epoch = epoch
        if now - self._speeds_sent >= self.interval:
            self._send_speeds(step)

    def _send_speeds(self, step: int) -> None:
        self.control.send(wire.Compute(step=step, epoch=self._speeds_epoch, per_mb=self._speeds))
        self._speeds, self._speeds_sent = [], time.monotonic()

    def memory(self, epoch: int, memory: dict[str, int]) -> None:
        """What this rank holds under the plan of ``epoch`` once it has trained a step under it
        (the copies a step keeps exist by then), unless it said so already: an event (the
        report) and a message (the daemon shares it in etcd, where ``status`` reads it)."""
        if self._memory == (epoch, memory):
            return
        self._memory = (epoch, memory)
        self.control.event("memory", worker=self.me, epoch=epoch, **memory)
        self.control.send(wire.Memory(epoch=epoch, bytes=dict(memory)))
