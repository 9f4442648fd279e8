"""A pipeline stage's recovery on a new layout: the resume step agreed and ranks rolled back, a
whole state adopted, and (stages without ZeRO; ZeRO's are :mod:`stagezero`'s) the layers moved
to their new holders, before training resumes or as an asynchronous migration whose messages
land, and whose missed steps are replayed, at a step boundary. The stage runner
(:class:`~elaswave.runtime.strategies.pipeline.stage.Pipeline`) calls these with itself (a
:class:`RecoveringStage`); they are kept apart from its step so that each reads on its own.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave.planning.pipeplan import serving_shares
from elaswave.planning.plan import Plan
from elaswave.planning.schedule import LayerTransfer, plan_layer_transfers, transfer_stats
from elaswave.planning.stageshards import gather_plan, holder_blocks, moment_duty, part_keepers
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.optim import update_
from elaswave.runtime.strategies.pipeline.stagestate import (
    Migration,
    Undo,
    bounds_of,
    hull,
    range_of,
    unpack_into,
)
from elaswave.runtime.strategies.pipeline.stagezero import ZeroStage

if TYPE_CHECKING:
    from elaswave.runtime.comm.communicator import Communicator
    from elaswave.runtime.state import TrainState

MIG = "mig"  # the process group asynchronous migrations run on, beside the training group
TAG_STATE = 3  # layer state moving to a new holder (activations and gradients: 1, 2)


class RecoveringStage(ZeroStage, Protocol):
    """What a layout change reads and changes of a rank's stage beside what ZeRO's does: the
    undo copy of its last update, what each layer's state weighs, and whether ZeRO is on."""

    undo: Undo | None
    sizes: list[int]
    zero: bool


def sync(
    pipe: RecoveringStage,
    plan: Plan,
    broken: Callable[[], bool],
    *,
    asynchronous: bool,
    start_from: Callable[[], DurableState | None] | None,
) -> dict[str, Any]:
    """A stage without ZeRO (``Pipeline.sync``): agree on the resume step, roll back ranks
    that updated the failed step, and start (or do) the layer transfers the new layout needs.
    When every rank is fresh, the job starts from the whole state ``start_from`` returns."""
    e = pipe.e
    rank = e.comm.rank("dp")
    pipe.migration = None  # a migration cut short by this change is void
    undo_held = pipe.undo.held if pipe.undo else None
    mine = torch.tensor(
        [float(e.state.step), float(pipe.fresh), *bounds_of(pipe.held), *bounds_of(undo_held)],
        dtype=torch.float64,
        device=e.state.device,
    )
    rows = [r.tolist() for r in e.comm.allgather("dp", mine, broken)]
    veterans = [int(r[0]) for r in rows if not r[1]]
    fresh = start_from() if not veterans and start_from is not None else None
    if fresh is not None:
        return pipe.restore_whole(plan, fresh)
    resume = min(veterans) if veterans else 0  # everyone fresh: the job starts
    holdings: list[range | None] = []
    rolled_back = []
    for i, r in enumerate(rows):
        step = int(r[0])
        if r[1] and resume > 0:
            holdings.append(None)  # a newcomer: its initial state is not the job's
        elif step > resume:  # it updated the failed step: back to its undo copy
            rolled_back.append(i)
            holdings.append(range_of(r[4], r[5]))
        else:
            holdings.append(range_of(r[2], r[3]))
    if rank in rolled_back:
        pipe.roll_back(resume)
    targets, info = pipe.begin_layout(plan, resume, rolled_back)
    # At step 0 every layer is its initial value, which any rank builds alone.
    transfers = plan_layer_transfers(holdings, targets, pipe.sizes) if resume else []
    receivers = sorted({x.dst for x in transfers})
    serving = [all(r not in receivers for r in ranks) for ranks in plan.replicas]
    info.update(
        layer_transfers=[x.to_dict() for x in transfers],
        **transfer_stats(transfers, pipe.sizes),
    )
    if not transfers:
        pipe.held = pipe.target
        pipe.serving, pipe.shares = [True] * len(plan.replicas), plan.shares
        pipe.fit_window()
        return info
    if asynchronous and any(serving):
        pipe.held = holdings[rank]
        pipe.serving = serving
        pipe.shares = serving_shares(plan, serving, pipe.costs)
        pipe.fit_window()  # the layers it holds and those it takes over, until the switch
        sends, recvs, regions = _messages(pipe, transfers)
        m = Migration(transfers, [(r, True) for r in regions], len(receivers), holdings)
        pipe.start_migration(m, sends, recvs, lands=[partial(_land, pipe, r) for r in regions])
        info.update(migration="async", serving=serving, shares=list(pipe.shares))
        return info
    start = time.perf_counter()
    e.state.set_window(hull(holdings[rank], pipe.target))
    nbytes = _move_now(pipe, transfers, broken)
    pipe.held = pipe.target
    pipe.serving, pipe.shares = [True] * len(plan.replicas), plan.shares
    pipe.fit_window()
    info.update(
        migration="blocking",
        migration_seconds=round(time.perf_counter() - start, 6),
        bytes_received=nbytes,
    )
    return info


def begin_layout(
    pipe: RecoveringStage, plan: Plan, resume: int, *, rolled_back: list[int]
) -> tuple[list[range], dict[str, Any]]:
    """Once the resume step is agreed: every rank's layers under ``plan``, this rank's
    target, and the common part of the ``state_synced`` details."""
    targets = [plan.stage_layers(r) for r in range(plan.world_size)]
    pipe.target = targets[pipe.e.comm.rank("dp")]
    pipe.fresh = False
    pipe.undo = None  # older than the resume step, which no rank will go back before
    pipe.e.state.step = resume
    info = {
        "resume_step": resume,
        "rolled_back": rolled_back,
        "layers": [pipe.target.start, pipe.target.stop],
    }
    return targets, info


def restore_whole(pipe: RecoveringStage, plan: Plan, state: DurableState) -> dict[str, Any]:
    """Adopt ``plan``'s layout from the whole training state (a durable checkpoint, read by
    every rank): every rank takes its layers and, with ZeRO, the moment parts it keeps."""
    e = pipe.e
    rank = e.comm.rank("dp")
    targets = [plan.stage_layers(r) for r in range(plan.world_size)]
    pipe.held = pipe.target = targets[rank]
    pipe.migration, pipe.undo, pipe.fresh = None, None, False
    pipe.fit_window()
    flat = e.state.flat
    window = slice(flat.base, flat.base + flat.numel)
    e.state.params[window].copy_(state.params[window])
    pipe.stale = False  # every held layer's parameters are in the window
    if pipe.zero:
        blocks = holder_blocks(targets, pipe.offsets, plan.domains)
        store = pipe.new_store(moment_duty(blocks, plan.world_size)[rank])
        whole = (state.params, state.exp_avg, state.exp_avg_sq)[-len(store.arrays) :]
        for a, b in store.intervals:
            store.unpack(a, b, torch.cat([t[a:b] for t in whole]))
        pipe.store = store
        pipe.parts = part_keepers(blocks)
        pipe.gather = [p for p in gather_plan(blocks) if rank in (p.src, p.dst)]
    else:
        e.state.exp_avg[window].copy_(state.exp_avg[window])
        e.state.exp_avg_sq[window].copy_(state.exp_avg_sq[window])
    pipe.serving, pipe.shares = [True] * len(plan.replicas), plan.shares
    e.state.step, e.state.last_loss = state.step, state.loss
    return {
        "resume_step": state.step,
        "layers": [pipe.target.start, pipe.target.stop],
        "durable": str(state.path),
    }


def roll_back(pipe: RecoveringStage, resume: int) -> None:
    """Undo this rank's update of step ``resume + 1`` (it applied a step not every rank did)."""
    undo = pipe.undo
    assert undo is not None and undo.step == resume, "no undo copy for the failed step"
    e = pipe.e
    undo.restore()
    if undo.store is not None:
        pipe.store = undo.store
    pipe.held = undo.held
    pipe.undo = None
    pipe.stale = pipe.zero3  # the store went back; the window is gathered again
    e.state.step, e.state.last_loss = resume, undo.loss


def _payload(pipe: RecoveringStage, t: LayerTransfer) -> torch.Tensor:
    st = pipe.e.state
    r = pipe.span(range(t.start, t.stop))
    return torch.cat([st.params[r], st.exp_avg[r], st.exp_avg_sq[r]])


def _messages(
    pipe: RecoveringStage, transfers: list[LayerTransfer]
) -> tuple[list[Any], list[Any], list[slice]]:
    """This rank's part of ``transfers``: sends (a copy of the layers now), receive buffers,
    and the flat regions the receives land in."""
    rank = pipe.e.comm.rank("dp")
    sends = [(t.dst, _payload(pipe, t), TAG_STATE) for t in transfers if t.src == rank]
    regions = [pipe.span(range(t.start, t.stop)) for t in transfers if t.dst == rank]
    srcs = [t.src for t in transfers if t.dst == rank]
    recvs = [
        (src, pipe.e.state.flat.data.new_empty(3 * (r.stop - r.start)), TAG_STATE)
        for src, r in zip(srcs, regions, strict=True)
    ]
    return sends, recvs, regions


def _move_now(
    pipe: RecoveringStage, transfers: list[LayerTransfer], broken: Callable[[], bool]
) -> int:
    sends, recvs, regions = _messages(pipe, transfers)
    received = pipe.exchange(sends, recvs, broken)
    pipe.link_pause(received)
    for region, payload in zip(regions, received, strict=True):
        _land(pipe, region, payload)
    return sum(p.numel() * p.element_size() for p in received)


def _land(pipe: RecoveringStage, region: slice, payload: torch.Tensor) -> None:
    st = pipe.e.state
    unpack_into(payload, (st.params[region], st.exp_avg[region], st.exp_avg_sq[region]))


def post_migration(
    comm: Communicator,
    m: Migration,
    *,
    sends: list[Any],
    recvs: list[Any],
    lands: list[Callable[[torch.Tensor], object]],
    link_pause: Callable[[Sequence[torch.Tensor]], None],
) -> None:
    """Post a migration's messages on the migration group; a thread waits for them and queues
    each received payload in ``m`` with where it lands (applied at a step boundary)."""
    m.nbytes = sum(p.numel() * p.element_size() for _, p, _ in recvs)
    works = comm.post(MIG, sends, recvs)

    def wait() -> None:  # gloo progresses point-to-point work only inside wait()
        try:
            comm.wait_done(works)
            link_pause([p for _, p, _ in recvs])
            m.landed.extend(zip(lands, (p for _, p, _ in recvs), strict=True))
        except BaseException as exc:  # a fault: the next plan voids this migration
            m.error.append(exc)
        finally:
            m.done.set()

    threading.Thread(target=wait, name="migration", daemon=True).start()


def catch_up(m: Migration, state: TrainState) -> None:
    """A migration's messages have landed: apply them, replay the steps its snapshot missed."""
    for land, payload in m.landed:
        land(payload)
    for step, grads in m.pending:  # replay the steps the snapshot missed, in order
        replay_step(m, step, grads, state=state)
    m.pending.clear()
    m.landed.clear()
    m.caught_up = True


def replay_step(
    m: Migration, step: int, grads: Sequence[torch.Tensor], *, state: TrainState
) -> None:
    """One optimizer step on the regions a migration brings up to date."""
    for (region, own), g in zip(m.replay, grads, strict=True):
        if m.store is None:
            moments = (state.exp_avg[region], state.exp_avg_sq[region])
        else:
            moments = m.store.view(region.start, region.stop)
        params = state.params[region] if own else state.params[region].clone()
        h = state.opt.hyper
        update_(
            params, g, moments[0], exp_avg_sq=moments[1], step=step, h=h, groups=h.groups_of(region)
        )
