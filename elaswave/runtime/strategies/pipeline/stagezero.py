"""ZeRO-1 inside pipeline stages: the tensors that move.

The layout is pure (:mod:`elaswave.planning.stageshards`): the layers a group of data-parallel
ranks holds form a *block*; its Adam moments are cut into one part per holder and every part is
kept, and updated, by two holders. This module moves the tensors (the moments of exactly the
kept intervals live in a :class:`~elaswave.runtime.strategies.pipeline.stagestate.MomentStore`:
compact, a rank allocates ~2/k of its stage's moments, not the whole model's): the messages of
the per-step parameter gather, and what the pipeline calls with itself (a :class:`ZeroStage`) on
a layout change (:func:`sync`: blocking or asynchronous) and at the end (:func:`contributions`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave.planning.pipeplan import serving_shares
from elaswave.planning.plan import Plan
from elaswave.planning.stageshards import (
    Interval,
    Piece,
    coverage,
    gather_plan,
    holder_blocks,
    merge,
    moment_duty,
    part_keepers,
    piece_stats,
    plan_piece_transfers,
    subtract,
)
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.integrity.checksums import digest
from elaswave.runtime.optim import Spans
from elaswave.runtime.strategies.pipeline.stagestate import (
    Migration,
    MomentStore,
    bounds_of,
    hull,
    range_of,
)
from elaswave.runtime.workload.base import initial_params

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext, TrainState

TAG_PARAM, TAG_MOMENT = 4, 5
Message = tuple[int, torch.Tensor, int]  # (peer, tensor, tag)
# A piece of the whole state a rank brings: (part: 0 parameters, 1 exp_avg, 2 exp_avg_sq,
# start, stop, its values)
Contribution = tuple[int, int, int, torch.Tensor]


class ZeroStage(Protocol):
    """What a layout change under ZeRO reads and changes of a rank's stage (the pipeline's
    runner, ``Pipeline``, is one): its layers and parts, and the moves it makes."""

    e: RankContext
    num_layers: int
    offsets: list[tuple[int, int]]
    costs: tuple[float, ...]
    held: range | None
    target: range
    fresh: bool
    zero3: bool
    stale: bool
    serving: list[bool]
    shares: tuple[int, ...]
    migration: Migration | None
    store: MomentStore
    gather: list[Piece]
    parts: list[tuple[Interval, tuple[int, ...]]]

    def span(self, layers: range) -> slice: ...

    def new_store(self, intervals: Sequence[Interval]) -> MomentStore: ...

    def fit_window(self) -> None: ...

    def exchange(
        self, sends: list[Any], recvs: list[Any], broken: Callable[[], bool]
    ) -> list[torch.Tensor]: ...

    def link_pause(self, received: Sequence[torch.Tensor]) -> None: ...

    def begin_layout(
        self, plan: Plan, resume: int, rolled_back: list[int]
    ) -> tuple[list[range], dict[str, Any]]: ...

    def restore_whole(self, plan: Plan, state: DurableState) -> dict[str, Any]: ...

    def roll_back(self, resume: int) -> None: ...

    def start_migration(
        self,
        m: Migration,
        sends: list[Any],
        recvs: list[Any],
        *,
        lands: list[Callable[[torch.Tensor], object]],
    ) -> None: ...


def gather_messages(
    pieces: Sequence[Piece], rank: int, params: Spans
) -> tuple[list[Message], list[Message], list[Piece]]:
    """This rank's sends and receive buffers of a parameter gather, and the pieces received."""
    sends = [(p.dst, params[p.start : p.stop], TAG_PARAM) for p in pieces if p.src == rank]
    mine = [p for p in pieces if p.dst == rank]
    recvs = [(p.src, params.new_empty(p.stop - p.start), TAG_PARAM) for p in mine]
    return sends, recvs, mine


def moment_messages(
    pieces: Sequence[Piece], rank: int, store: MomentStore
) -> tuple[list[Message], list[Message], list[Piece]]:
    """This rank's sends (copies of kept moments) and receive buffers of a moment relayout."""
    sends = [(p.dst, store.packed(p.start, p.stop), TAG_MOMENT) for p in pieces if p.src == rank]
    mine = [p for p in pieces if p.dst == rank]
    width = len(store.arrays)  # ZeRO-3: the parameters travel with their moments
    recvs = [(p.src, store.exp_avg.new_empty(width * (p.stop - p.start)), TAG_MOMENT) for p in mine]
    return sends, recvs, mine


# ---- recovery and checks (the pipeline calls these with itself) ---------------------------
def sync(
    pipe: ZeroStage,
    plan: Plan,
    broken: Callable[[], bool],
    *,
    asynchronous: bool,
    start_from: Callable[[], DurableState | None] | None,
) -> dict[str, Any]:
    """ZeRO recovery: agree on the resume step and roll back; then every rank says what it
    has (held layers, kept moment intervals) and the parameters and moments the new layout
    needs move from ranks that have them, as disjoint pieces: before training resumes
    (blocking) or in the background (asynchronous, see :func:`_start_migration`).

    ZeRO-3 keeps no layer whole between steps: what a rank has, and what it needs, is its
    intervals' parameters and moments (they move together, blocking); the held layers' other
    parameters come with the next step's gather."""
    e = pipe.e
    rank = e.comm.rank("dp")
    pipe.migration = None  # a migration cut short by this change is void
    agreed = _agree_resume(pipe, plan, broken, start_from=start_from)
    if isinstance(agreed, dict):
        return agreed  # every rank was fresh: the whole state from a checkpoint
    resume, rolled_back = agreed
    held_bounds, have_params, have_moments = _what_ranks_have(pipe, resume, broken)
    targets, info = pipe.begin_layout(plan, resume, rolled_back)
    info["held_elements"] = pipe.span(pipe.target).stop - pipe.span(pipe.target).start
    blocks = holder_blocks(targets, pipe.offsets, plan.domains)
    duty = moment_duty(blocks, plan.world_size)
    if pipe.zero3:
        have_params, param_pieces = have_moments, []
    else:
        param_pieces = plan_piece_transfers(have_params, [spans(pipe.span, t) for t in targets])

    def adopt(store: MomentStore) -> None:  # the new layout's duties
        pipe.store = store
        pipe.parts = part_keepers(blocks)
        pipe.gather = [p for p in gather_plan(blocks) if rank in (p.src, p.dst)]

    if resume == 0:  # before the first update every moment is zero: nothing to move
        pipe.held = pipe.target
        pipe.serving, pipe.shares = [True] * len(plan.replicas), plan.shares
        pipe.fit_window()  # the parameters are their initial values, which any rank builds
        store = pipe.new_store(duty[rank])
        if pipe.zero3:
            _initial_params(pipe, store)
            pipe.stale = True
        adopt(store)
        return {**info, "moment_bytes": pipe.store.nbytes, "gather_bytes": _gather_bytes(pipe)}
    # Asynchronously, a rank brings up to date the layers it newly holds (parameters and
    # both moments, to replay their updates) and the parts it newly keeps.
    newly = [subtract(spans(pipe.span, t), h) for t, h in zip(targets, have_params, strict=True)]
    wanted = [merge([*d, *n]) for d, n in zip(duty, newly, strict=True)]
    takers = {p.dst for p in param_pieces}
    serving = [all(r not in takers for r in ranks) for ranks in plan.replicas]
    if asynchronous and any(serving):
        moment_pieces = plan_piece_transfers(have_moments, [
            merge([*h, *w]) for h, w in zip(have_moments, wanted, strict=True)
        ])  # fmt: skip
    else:
        moment_pieces = plan_piece_transfers(have_moments, duty)
    info.update(
        param_moves=[x.to_dict() for x in param_pieces],
        moment_moves=[x.to_dict() for x in moment_pieces],
        **{f"param_{k}": v for k, v in piece_stats(param_pieces).items()},
        **{f"moment_{k}": v for k, v in piece_stats(moment_pieces).items()},
    )
    if asynchronous and any(serving) and (param_pieces or moment_pieces):
        pipe.held = range_of(*held_bounds)
        pipe.serving = serving
        pipe.shares = serving_shares(plan, serving, pipe.costs)
        # Until the switch every rank keeps its old duties; the parameters it holds but does
        # not keep come from any surviving keeper.
        interim = plan_piece_transfers(have_moments, have_params)
        pipe.parts = coverage(have_moments)  # what verification and assembly see meanwhile
        pipe.gather = [p for p in interim if rank in (p.src, p.dst)]
        pipe.fit_window()  # the layers it holds and those it takes over, until the switch
        receivers = len({p.dst for p in param_pieces + moment_pieces})
        _start_migration(
            pipe, param_pieces, moment_pieces, newly=newly[rank], wanted=wanted[rank],
            duty=duty[rank], adopt=adopt, receivers=receivers,
        )  # fmt: skip
        return {**info, "migration": "async", "serving": serving, "shares": list(pipe.shares)}
    store = pipe.new_store(duty[rank])
    if not pipe.zero3:  # ZeRO-3 moves no parameter into the window: it is gathered next step
        e.state.set_window(hull(range_of(*held_bounds), pipe.target))
    moved = _move_blocking(pipe, param_pieces, moment_pieces, store=store, broken=broken)
    pipe.held = pipe.target
    pipe.serving, pipe.shares = [True] * len(plan.replicas), plan.shares
    pipe.fit_window()
    pipe.stale = pipe.zero3  # the window is gathered at the next step
    adopt(store)
    return {**info, **moved, "gather_bytes": _gather_bytes(pipe)}


def _initial_params(pipe: ZeroStage, store: MomentStore) -> None:
    """ZeRO-3 at step 0: the store's parameters are their initial values (each layer that
    meets the store's intervals built alone, as every rank builds it)."""
    st = pipe.e.state
    assert store.params is not None
    for layer, (lo, hi) in enumerate(pipe.offsets):
        meets = [(max(a, lo), min(b, hi)) for a, b in store.intervals if max(a, lo) < min(b, hi)]
        if not meets:
            continue
        values = initial_params(st.workload, st.model.seed, layer)
        for a, b in meets:
            store.views(a, b)[0].copy_(values[a - lo : b - lo])


def _agree_resume(
    pipe: ZeroStage,
    plan: Plan,
    broken: Callable[[], bool],
    *,
    start_from: Callable[[], DurableState | None] | None,
) -> tuple[int, list[int]] | dict[str, Any]:
    """The resume step (the oldest step a veteran rank holds) and the ranks rolled back to it;
    when every rank is fresh and there is a checkpoint to start from, the restore's details."""
    e = pipe.e
    mine = torch.tensor(
        [float(e.state.step), float(pipe.fresh)], dtype=torch.float64, device=e.state.device
    )
    rows = [r.tolist() for r in e.comm.allgather("dp", mine, broken)]
    veterans = [int(r[0]) for r in rows if not r[1]]
    fresh = start_from() if not veterans and start_from is not None else None
    if fresh is not None:
        return pipe.restore_whole(plan, fresh)
    resume = min(veterans) if veterans else 0  # everyone fresh: the job starts
    rolled_back = [i for i, r in enumerate(rows) if int(r[0]) > resume]
    if e.comm.rank("dp") in rolled_back:
        pipe.roll_back(resume)
    return resume, rolled_back


def _what_ranks_have(
    pipe: ZeroStage, resume: int, broken: Callable[[], bool]
) -> tuple[tuple[float, float], list[list[Interval]], list[list[Interval]]]:
    """Every rank's held layers and kept moment intervals, gathered: this rank's held bounds,
    then per rank the parameter intervals it holds and the moment intervals it keeps."""
    e = pipe.e
    newcomer = pipe.fresh and resume > 0  # its initial state is not the job's
    held = None if newcomer else pipe.held
    kept = [] if newcomer else pipe.store.intervals
    row = torch.full((3 + 4 * pipe.num_layers,), -1.0, dtype=torch.float64, device=e.state.device)
    row[0:2] = torch.tensor(bounds_of(held))
    row[2] = len(kept)
    for i, (a, b) in enumerate(kept):
        row[3 + 2 * i : 5 + 2 * i] = torch.tensor([float(a), float(b)])
    rows = [r.tolist() for r in e.comm.allgather("dp", row, broken)]
    have_params = [spans(pipe.span, range_of(r[0], r[1])) for r in rows]
    have_moments = [
        [(int(r[3 + 2 * i]), int(r[4 + 2 * i])) for i in range(int(r[2]))] for r in rows
    ]
    mine = rows[e.comm.rank("dp")]
    return (mine[0], mine[1]), have_params, have_moments


def _move_blocking(
    pipe: ZeroStage,
    param_pieces: list[Piece],
    moment_pieces: list[Piece],
    *,
    store: MomentStore,
    broken: Callable[[], bool],
) -> dict[str, Any]:
    """Move the new layout's pieces before training resumes: parameters into the flat buffer,
    moments into ``store`` (the new duties, filled first from what this rank keeps)."""
    e = pipe.e
    rank = e.comm.rank("dp")
    start = time.perf_counter()
    store.fill_from(pipe.store)
    sends_p, recvs_p, got_p = gather_messages(param_pieces, rank, e.state.params)
    sends_m, recvs_m, got_m = moment_messages(moment_pieces, rank, pipe.store)
    received = pipe.exchange(sends_p + sends_m, recvs_p + recvs_m, broken)
    pipe.link_pause(received)
    for piece, payload in zip(got_p, received[: len(got_p)], strict=True):
        e.state.params[piece.start : piece.stop].copy_(payload)
    for piece, payload in zip(got_m, received[len(got_p) :], strict=True):
        store.unpack(piece.start, piece.stop, payload)
    return {
        "migration": "blocking",
        "migration_seconds": round(time.perf_counter() - start, 6),
        "bytes_received": sum(t.numel() * t.element_size() for t in received),
        "moment_bytes": store.nbytes,  # vs 8 bytes per held element when replicated
    }


def _gather_bytes(pipe: ZeroStage) -> int:
    rank = pipe.e.comm.rank("dp")
    return 4 * sum(p.stop - p.start for p in pipe.gather if p.dst == rank)


def _start_migration(
    pipe: ZeroStage,
    param_pieces: list[Piece],
    moment_pieces: list[Piece],
    *,
    newly: list[Interval],
    wanted: list[Interval],
    duty: list[Interval],
    adopt: Callable[[MomentStore], None],
    receivers: int,
) -> None:
    """ZeRO, asynchronous: snapshot copies of the pieces travel on the migration group. A
    receiver replays the missed updates on what it received: the layers it newly holds
    (parameters and moments) and the parts it newly keeps of layers it already holds (their
    moments; the parameters keep arriving by the gather). At the switch every rank keeps
    exactly its new duty."""
    e = pipe.e
    rank = e.comm.rank("dp")
    mine = subtract(wanted, pipe.store.intervals)  # moments this rank has to receive
    replay = [(slice(a, b), any(c <= a and b <= d for c, d in newly)) for a, b in cut(mine, newly)]
    m = Migration(
        [*param_pieces, *moment_pieces], replay, receivers, store=MomentStore(mine, e.state.device)
    )

    def switch() -> None:
        store = MomentStore(duty, e.state.device)
        store.fill_from(pipe.store)
        assert m.store is not None
        store.fill_from(m.store)
        adopt(store)

    m.switch = switch
    sends_p, recvs_p, got_p = gather_messages(param_pieces, rank, e.state.params)
    sends_m, recvs_m, got_m = moment_messages(moment_pieces, rank, pipe.store)
    # Parameters are sent as a copy: training goes on while the message is in flight.
    sends = [(dst, t.clone(), tag) for dst, t, tag in sends_p] + sends_m
    lands: list[Callable[[torch.Tensor], object]] = [
        partial(_land_params, e.state, p.start, p.stop) for p in got_p
    ]
    assert m.store is not None  # the migration was made with its store
    lands += [partial(m.store.unpack, p.start, p.stop) for p in got_m]
    pipe.start_migration(m, sends, recvs_p + recvs_m, lands=lands)


def _land_params(state: TrainState, start: int, stop: int, payload: torch.Tensor) -> None:
    state.params[start:stop].copy_(payload)


def contributions(pipe: ZeroStage, broken: Callable[[], bool]) -> tuple[list[Contribution], bool]:
    """ZeRO: as the pipeline's ``contributions``, with each moment part from its lowest-rank
    keeper, and both keepers of every part compared as well as every layer's holders."""
    e = pipe.e
    params = e.state.params
    rank = e.comm.rank("dp")
    # ZeRO-3 holds no layer whole between steps: its parts carry their parameters
    units = [] if pipe.zero3 else [pipe.span(range(n, n + 1)) for n in range(pipe.num_layers)]
    sums = torch.full((len(units) + len(pipe.parts),), -1, dtype=torch.int64, device=e.state.device)
    for layer in (pipe.held or ()) if units else ():
        sums[layer] = digest(params[units[layer]])
    for j, ((a, b), keepers) in enumerate(pipe.parts):
        if rank in keepers:
            sums[len(units) + j] = digest(*pipe.store.views(a, b))
    rows = [x.tolist() for x in e.comm.allgather("dp", sums, broken)]
    agree = all(len({row[u] for row in rows if row[u] >= 0}) == 1 for u in range(len(sums)))
    out: list[Contribution] = []
    for u in range(len(sums)):
        if next((i for i, row in enumerate(rows) if row[u] >= 0), None) != rank:
            continue
        if u < len(units):
            out.append((0, units[u].start, units[u].stop, params[units[u]]))
        else:
            (a, b), _ = pipe.parts[u - len(units)]
            kept = pipe.store.views(a, b)
            out += [(part, a, b, t) for part, t in zip((0, 1, 2)[-len(kept) :], kept, strict=True)]
    return out, agree


def cut(intervals: list[Interval], at: list[Interval]) -> list[Interval]:
    """``intervals`` cut at every boundary of ``at`` (so each piece lies inside or outside)."""
    marks = sorted({x for iv in at for x in iv})
    out = []
    for a, b in intervals:
        inner = [x for x in marks if a < x < b]
        out += list(zip([a, *inner], [*inner, b], strict=True))
    return out


def spans(span: Callable[[range], slice], layers: range | None) -> list[Interval]:
    """The flat interval of a layer range (none for ``None``)."""
    if not layers:
        return []
    s = span(layers)
    return [(s.start, s.stop)]
