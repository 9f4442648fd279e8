"""The pure parts of a pipeline step and of a layout change: the 1F1B order of one stage, and
which surviving rank sends which layers to whom.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from elaswave.planning.stageshards import LayersLost


# ---- the schedule ------------------------------------------------------------------------
@dataclass(frozen=True)
class Compute:
    kind: str  # "F" (forward) or "B" (backward)
    mb: int  # index into the replica's micro-batches


@dataclass(frozen=True)
class Comm:
    """Messages posted together and waited for together (a send and a receive may pair up)."""

    sends: tuple[tuple[str, int], ...] = ()  # ("act", i) to the next stage, ("grad", i) to prev
    recvs: tuple[tuple[str, int], ...] = ()  # ("act", i) from the previous, ("grad", i) from next


def schedule_1f1b(stage: int, stages: int, microbatches: int) -> list[Compute | Comm]:
    """The non-interleaved 1F1B order of one stage: warm-up forwards, one-forward-one-backward,
    cool-down backwards. Messages to stages that do not exist are left out."""
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} out of range for {stages} stages")
    first, last = stage == 0, stage == stages - 1
    out: list[Compute | Comm] = []

    def comm(sends: Sequence[tuple[str, int]] = (), recvs: Sequence[tuple[str, int]] = ()) -> None:
        sends = tuple(m for m in sends if not (m[0] == "act" and last or m[0] == "grad" and first))
        recvs = tuple(m for m in recvs if not (m[0] == "act" and first or m[0] == "grad" and last))
        if sends or recvs:
            out.append(Comm(sends, recvs))

    warm = min(stages - stage - 1, microbatches)
    steady = microbatches - warm
    for i in range(warm):
        comm(recvs=[("act", i)])
        out.append(Compute("F", i))
        comm(sends=[("act", i)])
    if steady:
        comm(recvs=[("act", warm)])
    for j in range(steady):
        f = warm + j
        out.append(Compute("F", f))
        comm(sends=[("act", f)], recvs=[("grad", j)])
        out.append(Compute("B", j))
        if j == steady - 1:
            comm(sends=[("grad", j)])
        else:
            comm(sends=[("grad", j)], recvs=[("act", f + 1)])
    for k in range(warm):
        b = steady + k
        comm(recvs=[("grad", b)])
        out.append(Compute("B", b))
        comm(sends=[("grad", b)])
    return out


def schedule_roles(stage: int, stages: int, replicas: Sequence[int]) -> list[Compute | Comm]:
    """The order of a stage rank whose micro-batch ``i`` belongs to replica ``replicas[i]``: one
    replica's micro-batches after another's (runs of equal values, in ascending replica order),
    each run its own 1F1B schedule. A rank that runs one stage for several replicas (``stage_loss:
    recycle``) can deadlock in one 1F1B order over all of them: its warm-up would be one
    replica's, where each neighbour's is its own. Run after run, it cannot: every rank takes its
    replicas in the same ascending order, so the lowest replica not yet done runs a plain 1F1B
    over ranks that all work on it."""
    if list(replicas) != sorted(replicas):
        raise ValueError(f"micro-batches must come replica by replica: {list(replicas)}")
    out: list[Compute | Comm] = []
    start = 0
    for _, run in groupby(replicas):
        n = len(list(run))
        for item in schedule_1f1b(stage, stages, n):
            if isinstance(item, Compute):
                out.append(Compute(item.kind, item.mb + start))
            else:
                out.append(Comm(tuple((k, i + start) for k, i in item.sends),
                                tuple((k, i + start) for k, i in item.recvs)))  # fmt: skip
        start += n
    return out


# ---- transfers of layer state (pure) -----------------------------------------------------------
@dataclass(frozen=True)
class LayerTransfer:
    src: int
    dst: int
    start: int  # layers start:stop
    stop: int

    def to_dict(self) -> dict[str, int]:
        return {"src": self.src, "dst": self.dst, "start": self.start, "stop": self.stop}


def plan_layer_transfers(
    held: Sequence[range | None], targets: Sequence[range], sizes: Sequence[int]
) -> list[LayerTransfer]:
    """Who sends which layers to whom so that rank r ends up holding ``targets[r]``.

    ``held[r]`` is what rank r holds now (``None``: nothing, a newcomer). Each missing layer comes
    from exactly one holder; among holders the one with the least bytes to send so far is chosen
    (ties: lowest rank), which spreads the load over the peers. Adjacent layers with the same
    source and destination travel as one message. Raises :class:`LayersLost` for a layer that
    nobody holds.
    """
    load = [0] * len(held)
    pieces: list[LayerTransfer] = []
    for dst, want in enumerate(targets):
        mine = held[dst] or range(0)
        for layer in want:
            if layer in mine:
                continue
            holders = [r for r, h in enumerate(held) if h is not None and layer in h]
            if not holders:
                raise LayersLost(f"layer {layer} is held by no surviving rank")
            src = min(holders, key=lambda r: (load[r], r))
            load[src] += sizes[layer]
            last = pieces[-1] if pieces else None
            if last and (last.src, last.dst, last.stop) == (src, dst, layer):
                pieces[-1] = LayerTransfer(src, dst, last.start, layer + 1)
            else:
                pieces.append(LayerTransfer(src, dst, layer, layer + 1))
    return pieces


def transfer_stats(transfers: Sequence[LayerTransfer], sizes: Sequence[int]) -> dict[str, Any]:
    """Totals for the report: bytes, transfers, rank pairs, and the busiest rank's volume (sent +
    received) over the mean of the ranks that take part (1.0: perfectly balanced)."""
    volume: dict[int, int] = {}
    total = 0
    for t in transfers:
        n = sum(sizes[t.start : t.stop])
        total += n
        volume[t.src] = volume.get(t.src, 0) + n
        volume[t.dst] = volume.get(t.dst, 0) + n
    mean = sum(volume.values()) / len(volume) if volume else 0.0
    return {
        "bytes": total,
        "transfers": len(transfers),
        "pairs": len({(t.src, t.dst) for t in transfers}),
        "max_over_mean": round(max(volume.values()) / mean, 3) if volume else 1.0,
    }
