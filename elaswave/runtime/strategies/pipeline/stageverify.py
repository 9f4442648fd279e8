"""Online verification inside pipeline stages: copies of the same layer state must agree.

A *unit* is an element range of one kind: the parameters of a layer (kept by every rank that
holds the layer), and Adam's moments of a layer (replicated stages) or of a moment part (ZeRO,
its two keepers; under ZeRO-3 the part's parameters too, and no layer is a unit: none is held
whole between steps). After each update a rank records a CRC of every unit it keeps; every
``verify_every`` committed steps the ranks all-gather their current CRCs and whether each unit
still matches its record. A copy that no longer matches its own record was hit after it was
written (a bit flip in memory) and is bad for sure, which decides the otherwise undecidable
case of two copies; the remaining copies vote
(:func:`~elaswave.runtime.integrity.verify.judge_copies`). Bad copies are repaired
point-to-point from a good one before the next step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave.runtime.integrity.checksums import fast_checksum
from elaswave.runtime.integrity.verify import judge_copies
from elaswave.runtime.strategies.pipeline.stagestate import Migration, MomentStore, unpack_into

if TYPE_CHECKING:
    from elaswave.planning.stageshards import Interval
    from elaswave.runtime.state import RankContext

Unit = tuple[str, int, int]  # ("p" parameters | "m" moments, start, stop)
TAG_REPAIR = 6
MOMENTS = {False: "optimizer moments", True: "parameters and optimizer moments"}


class VerifiedStage(Protocol):
    """What the checks read of a rank's stage (the pipeline's runner, ``Pipeline``, is one):
    the layers it holds, the moment parts it keeps, the CRCs it recorded (written here)."""

    e: RankContext
    num_layers: int
    zero: bool
    zero3: bool
    held: range | None
    parts: list[tuple[Interval, tuple[int, ...]]]
    store: MomentStore
    migration: Migration | None
    recorded: dict[Unit, int]
    recorded_step: int

    def span(self, layers: range) -> slice: ...

    def exchange(
        self, sends: list[Any], recvs: list[Any], broken: Callable[[], bool]
    ) -> list[torch.Tensor]: ...


def universe(pipe: VerifiedStage) -> list[Unit]:
    """Every unit of the current layout, in the same order on every rank."""
    layers = [] if pipe.zero3 else [pipe.span(range(i, i + 1)) for i in range(pipe.num_layers)]
    out: list[Unit] = [("p", r.start, r.stop) for r in layers]
    if pipe.zero:
        out += [("m", a, b) for (a, b), _ in pipe.parts]
    else:
        out += [("m", r.start, r.stop) for r in layers]
    return out


def kept(pipe: VerifiedStage) -> set[Unit]:
    """The units this rank keeps current."""
    rank = pipe.e.comm.rank("dp")
    out: set[Unit] = set()
    layers = () if pipe.zero3 else pipe.held or ()  # ZeRO-3: no layer is a unit
    for layer in layers:
        r = pipe.span(range(layer, layer + 1))
        out.add(("p", r.start, r.stop))
        if not pipe.zero:
            out.add(("m", r.start, r.stop))
    if pipe.zero:
        out |= {("m", a, b) for (a, b), keepers in pipe.parts if rank in keepers}
    return out


def tensors(pipe: VerifiedStage, unit: Unit) -> list[torch.Tensor]:
    kind, a, b = unit
    e = pipe.e
    if kind == "p":
        return [e.state.params[a:b]]
    if pipe.zero:  # the part's moments (ZeRO-3: after its parameters)
        return list(pipe.store.views(a, b))
    return [e.state.exp_avg[a:b], e.state.exp_avg_sq[a:b]]


def record(pipe: VerifiedStage, step: int) -> None:
    """The CRC of every kept unit as written by the update of ``step``."""
    pipe.recorded = {u: fast_checksum(*tensors(pipe, u)) for u in kept(pipe)}
    pipe.recorded_step = step


def verify(pipe: VerifiedStage, step: int, broken: Callable[[], bool]) -> list[dict[str, Any]]:
    """Compare every unit's copies, repair the bad ones; the findings (same on every rank).
    Skipped (by every rank alike) while a migration is in progress."""
    if pipe.migration is not None:
        return []
    e = pipe.e
    rank = e.comm.rank("dp")
    units = universe(pipe)
    mine = kept(pipe)
    valid = pipe.recorded_step == step
    row = torch.full((2 * len(units),), -1, dtype=torch.int64, device=pipe.e.state.device)
    for i, u in enumerate(units):
        if u in mine:
            crc = fast_checksum(*tensors(pipe, u))
            row[i] = crc
            row[len(units) + i] = int(valid and pipe.recorded.get(u, crc) != crc)
    rows = [r.tolist() for r in e.comm.allgather("dp", row, broken)]
    findings: list[dict[str, Any]] = []
    sends: list[Any] = []
    recvs: list[Any] = []
    lands: list[Unit] = []
    for i, u in enumerate(units):
        verdict = judge_copies(
            [r[i] if r[i] >= 0 else None for r in rows], [r[len(units) + i] == 1 for r in rows]
        )
        if not verdict.bad:
            continue
        findings.append({
            "what": "parameters" if u[0] == "p" else MOMENTS[pipe.zero3],
            "elements": [u[1], u[2]],
            "ranks": list(verdict.bad),
            "source_rank": verdict.source,
            "tie": verdict.unanimous_loss,
        })  # fmt: skip
        if verdict.source is None:
            continue  # no trustworthy copy: reported, not repaired
        if rank == verdict.source:
            payload = torch.cat(tensors(pipe, u))
            sends += [(bad, payload, TAG_REPAIR) for bad in verdict.bad]
        elif rank in verdict.bad:
            size = sum(t.numel() for t in tensors(pipe, u))
            recvs.append((verdict.source, pipe.e.state.flat.data.new_empty(size), TAG_REPAIR))
            lands.append(u)
    if sends or recvs:
        for u, got in zip(lands, pipe.exchange(sends, recvs, broken), strict=True):
            unpack_into(got, tensors(pipe, u))
        record(pipe, step)
    return findings
