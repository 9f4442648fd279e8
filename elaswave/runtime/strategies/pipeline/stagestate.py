"""What a pipeline rank keeps between steps besides its tensors: an asynchronous migration in
progress, the undo copy of its last update, and the small encodings of layer ranges that ranks
exchange when they agree on a new layout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from elaswave.runtime.strategies.pipeline.stagezero import MomentStore


@dataclass
class Migration:
    """An asynchronous migration in progress on this rank."""

    transfers: list[Any]  # LayerTransfer, or Piece with ZeRO (for the event)
    # Flat regions this rank brings up to date by replaying the missed updates, and whether it
    # owns their parameters (False: ZeRO moments of layers it holds already; the parameters
    # come from the gather, so the replay updates a scratch copy).
    replay: list[tuple[slice, bool]]
    receivers: int  # ranks that receive something (every rank knows the same number)
    # The layers each rank holds and keeps current until the switch (replicated stage state:
    # what a durable checkpoint taken meanwhile is written from)
    held_by: list[range | None] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)
    pending: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)  # (step, grads)
    landed: list[tuple[Callable[[torch.Tensor], object], torch.Tensor]] = field(
        default_factory=list
    )  # (where it goes, payload)
    store: MomentStore | None = None  # ZeRO: the moments being brought up to date
    switch: Callable[[], None] | None = None  # ZeRO: adopt the new layout's duties
    caught_up: bool = False
    nbytes: int = 0


@dataclass
class Undo:
    """The local snapshot taken before an update: what rolling the step back restores."""

    step: int
    loss: float
    held: range | None
    # (where the live tensor is, looked up when restoring; its pre-update copy)
    saved: list[tuple[Callable[[], torch.Tensor], torch.Tensor]]
    store: MomentStore | None = None  # ZeRO: the moments it saved (a switch replaces the store)

    def restore(self) -> None:
        for live, copy in self.saved:
            live().copy_(copy)


def hull(*layers: range | None) -> range:
    """The smallest range of layers that contains every one given (empty if none is)."""
    given = [r for r in layers if r]
    if not given:
        return range(0)
    return range(min(r.start for r in given), max(r.stop for r in given))


def bounds_of(layers: range | None) -> tuple[float, float]:
    return (float(layers.start), float(layers.stop)) if layers is not None else (-1.0, -1.0)


def range_of(start: float, stop: float) -> range | None:
    return range(int(start), int(stop)) if start >= 0 else None


def unpack_into(payload: torch.Tensor, targets: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``payload`` (``torch.cat`` of tensors shaped like
    ``targets``) into ``targets``."""
    offset = 0
    for t in targets:
        t.copy_(payload[offset : offset + t.numel()])
        offset += t.numel()
