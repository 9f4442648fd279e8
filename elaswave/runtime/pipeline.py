"""Pipeline parallelism inside a worker: the 1F1B schedule, one step of a stage, and the moves of
layer state that a new layout needs.

Layout. Every rank of a pipeline plan belongs to one replica and runs one stage of it: a
contiguous range of the layer list. It *holds* (keeps current) the parameters and Adam moments
of those layers only; the rest of its flat buffers is stale. Gradients are reduced with one SUM
all-reduce over all ranks of a buffer the size of the whole model, in which each rank fills its
own layers: every layer's gradient is then summed over the replicas that ran it, whatever their
partitions are (replicas may be cut differently after a loss).

Commit and rollback. Before a rank updates its layers it keeps a copy of them (the local
snapshot). If the step fails on some rank after others updated, every rank that updated rolls
back to that copy, so all ranks resume from the same step and redo the in-flight one.

New layouts. After a membership change a rank may have to own layers it does not hold. They come
from ranks that hold them (data-parallel peers in other replicas), planned as disjoint transfers
(`plan_layer_transfers`). *Blocking* migration moves them before training resumes.
*Asynchronous* migration takes the replicas that need layers out of service, lets the others run
the whole global batch, and copies a snapshot of the layers in the background; a receiver then
replays the gradients of the steps it missed (it gets every layer's gradient from the all-reduce)
and raises a flag in the all-reduce; when every receiver has, all ranks switch to the new layout
at the same step boundary.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave.dvfs import DvfsError, SimActuator, frequency_plan, make_actuator
from elaswave.pipeplan import layer_costs, serving_shares
from elaswave.plan import Plan
from elaswave.runtime import stageverify
from elaswave.runtime.data import MicroBatch, batch
from elaswave.runtime.model import per_sample_loss
from elaswave.runtime.optim import adamw_
from elaswave.runtime.rng import MicrobatchRng
from elaswave.runtime.stageshards import (
    Interval,
    LayersLost,
    Piece,
    gather_plan,
    holder_blocks,
    merge,
    moment_duty,
    part_keepers,
    piece_stats,
    plan_piece_transfers,
    subtract,
)
from elaswave.runtime.stagetimes import StageTimer
from elaswave.runtime.stagezero import (
    TAG_MOMENT,
    TAG_PARAM,
    MomentStore,
    gather_messages,
    moment_messages,
)
from elaswave.runtime.zero import digest

if TYPE_CHECKING:
    from elaswave.runtime.engine import Engine

MIG = "mig"  # the process group asynchronous migrations run on, beside the training group
TAG_ACT, TAG_GRAD, TAG_STATE = 1, 2, 3


# ---- the schedule (pure) ------------------------------------------------------------------------
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


# ---- the stage runner ----------------------------------------------------------------------------
@dataclass
class _Migration:
    """An asynchronous migration in progress on this rank."""

    transfers: list[Any]  # LayerTransfer, or Piece with ZeRO (for the event)
    # Flat regions this rank brings up to date by replaying the missed updates, and whether it
    # owns their parameters (False: ZeRO moments of layers it holds already; the parameters
    # come from the gather, so the replay updates a scratch copy).
    replay: list[tuple[slice, bool]]
    receivers: int  # ranks that receive something (every rank knows the same number)
    started: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    error: list[BaseException] = field(default_factory=list)
    pending: list[tuple[int, list[torch.Tensor]]] = field(default_factory=list)  # (step, grads)
    landed: list[tuple[Callable[[torch.Tensor], None], torch.Tensor]] = field(
        default_factory=list
    )  # (where it goes, payload)
    store: MomentStore | None = None  # ZeRO: the moments being brought up to date
    switch: Callable[[], None] | None = None  # ZeRO: adopt the new layout's duties
    caught_up: bool = False
    nbytes: int = 0


@dataclass
class _Undo:
    """The local snapshot taken before an update: what rolling the step back restores."""

    step: int
    loss: float
    held: range | None
    saved: list[tuple[torch.Tensor, torch.Tensor]]  # (live view, its pre-update copy)
    store: MomentStore | None = None  # ZeRO: the moments it saved (a switch replaces the store)

    def restore(self) -> None:
        for live, copy in self.saved:
            live.copy_(copy)


class WholeState(Protocol):
    """The whole model's training state (what a durable checkpoint holds)."""

    step: int
    loss: float
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    path: Path


class Pipeline:
    """One rank's stage: runs the 1F1B step, keeps its layers, moves them on a new layout."""

    def __init__(self, engine: Engine) -> None:
        self.e = engine
        self.num_layers = len(engine.model.layers)
        self.offsets = [(off, off + length) for off, length in engine.segments]
        self.sizes = [length * 3 * 4 for _, length in engine.segments]  # params + 2 moments, f32
        self.held: range | None = range(self.num_layers)  # at step 0 everyone holds the init
        self.fresh = True  # no plan applied yet: a newcomer's step-0 state is not the job's
        self.target: range = range(0)
        self.serving: list[bool] = []
        self.shares: tuple[int, ...] = ()
        self.undo: _Undo | None = None
        self.migration: _Migration | None = None
        m = engine.cfg.model
        self.costs = layer_costs(
            vocab_size=m.vocab_size, seq_len=m.seq_len, d_model=m.d_model, n_layer=m.n_layer
        )
        self.actuator = make_actuator(engine.cfg.dvfs, **_actuator_options(engine.cfg.dvfs))
        self.clocks = _clock_range(self.actuator)
        self.stage_key = 0  # what the actuator clocks: this worker's device
        # ZeRO-1 inside the stages: moments of the kept intervals only (engine.opt is empty),
        # and the parameter pieces this rank sends or receives after every update.
        self.zero = bool(engine.cfg.zero)
        self.store = MomentStore()
        self.gather: list[Piece] = []
        self.parts: list[tuple[Interval, tuple[int, ...]]] = []  # (part, its keepers)
        self.timer = StageTimer()  # what this stage's layers cost in real steps
        self.recorded: dict[stageverify.Unit, int] = {}  # CRC per kept unit, as last written
        self.recorded_step = -1

    def profile_layers(self, repeats: int = 3) -> list[float]:
        """Seconds of forward + backward per layer for one micro-batch (median of ``repeats``).

        Runs before the first plan on a throw-away micro-batch; gradients are discarded and no
        parameter changes, so training is unaffected."""
        e, t = self.e, self.e.cfg.train
        tokens, _ = batch(e.dataset, tuple(range(t.micro_batch_size)))
        runs: list[list[float]] = []
        for _ in range(repeats + 1):  # the first run warms up kernels and allocator; dropped
            h: torch.Tensor = tokens
            times = []
            for layer in e.model.layers:
                x = h.detach().requires_grad_(h.is_floating_point())
                start = time.perf_counter()
                h = layer(x, MicrobatchRng(t.seed, 0, 0))
                h.float().sum().backward()
                times.append(time.perf_counter() - start)
            runs.append(times)
        e.flat.grad.zero_()
        return [sorted(col)[len(col) // 2] for col in zip(*runs[1:], strict=True)]

    def cost_share(self, layers: range) -> float:
        return sum(self.costs[i] for i in layers) / sum(self.costs)

    def device_pause(self, layers: range, backward: bool) -> None:
        """Emulated accelerator time (``train.device_time``): a forward is a third of a
        micro-batch's forward + backward, a backward two thirds; a simulated clock stretches it."""
        seconds = self.e.cfg.train.device_time
        if seconds <= 0:
            return
        part = (2.0 if backward else 1.0) / 3.0
        scale = (
            self.actuator.time_scale(self.stage_key)
            if isinstance(self.actuator, SimActuator)
            else 1.0
        )
        time.sleep(seconds * self.cost_share(layers) * part * scale)

    def set_clocks(self) -> dict[str, Any] | None:
        """After a layout change: the frequency plan of this rank's replica (pure policy), applied
        to this rank's device. Returns the plan's summary (for the replica's first stage)."""
        e = self.e
        plan = e.plan
        if e.cfg.dvfs == "off" or plan is None:
            return None
        d, s = plan.position(e.comm.rank("dp"))
        if not self.serving[d]:
            return None
        cut = plan.bounds[d]
        times = [self.cost_share(range(cut[i], cut[i + 1])) for i in range(len(cut) - 1)]
        f_min, f_nominal, f_max = self.clocks
        fp = frequency_plan(
            times,
            microbatches=max(1, self.shares[d]),
            f_nominal=f_nominal,
            f_min=f_min,
            f_max=f_max,
        )
        self.actuator.apply({self.stage_key: fp.targets[s]})
        if s != 0:
            return None
        return {
            "replica": d,
            "targets": list(fp.targets),
            "step_time_before": fp.step_time_before,
            "step_time_after": fp.step_time_after,
            "energy_ratio": round(fp.energy_ratio, 4),
            "summary": fp.describe(),
        }

    def span(self, layers: range) -> slice:
        if not layers:
            return slice(0, 0)
        return slice(self.offsets[layers.start][0], self.offsets[layers.stop - 1][1])

    # ---- one step --------------------------------------------------------------------------
    def run_step(
        self, step: int, buf: torch.Tensor, everyone: list[MicroBatch], broken: Callable[[], bool]
    ) -> None:
        """Forward/backward of this rank's stage over its replica's micro-batches; the layer
        gradients (scaled by 1/B) and the loss sum (last stage) land in ``buf``."""
        e = self.e
        plan = e.plan
        assert plan is not None
        rank = e.comm.rank("dp")
        d, s = plan.position(rank)
        if not self.serving[d]:
            return  # out of service while its layers migrate: only reduce and update
        ranks = plan.replicas[d]
        stages = len(ranks)
        layers = plan.stage_layers(rank)
        start = sum(self.shares[:d])
        mbs = everyone[start : start + self.shares[d]]
        cfg, t = e.cfg, e.cfg.train
        prev_rank = ranks[s - 1] if s > 0 else None
        next_rank = ranks[s + 1] if s + 1 < stages else None
        first, last = layers.start == 0, layers.stop == self.num_layers
        region = self.span(layers)
        n = e.flat.numel
        shape = (t.micro_batch_size, cfg.model.seq_len, cfg.model.d_model)
        inputs: dict[int, torch.Tensor] = {}
        outputs: dict[int, torch.Tensor] = {}
        grads_in: dict[int, torch.Tensor] = {}
        loss_sum = 0.0
        timer = self.timer
        timer.begin(layers)

        def forward(i: int) -> None:
            nonlocal loss_sum
            mb = mbs[i]
            rng = MicrobatchRng(t.seed, step, mb.id)
            # Only the first stage needs the tokens and only the last the targets.
            tokens, targets = batch(e.dataset, mb.sample_ids) if first or last else (None, None)
            h = tokens if first else inputs[i]
            for index in layers:
                with timer.forward(index):
                    h = e.model.layers[index](h, rng)
            with timer.pause():
                self.device_pause(layers, backward=False)
            if last:
                loss = per_sample_loss(h, targets).sum()
                loss_sum += loss.item()
                outputs[i] = loss / t.global_batch
            else:
                outputs[i] = h

        def backward(i: int) -> None:
            out = outputs.pop(i)
            with timer.backward():
                if last:
                    out.backward()
                else:
                    out.backward(grads_in.pop(i))
            with timer.pause():
                self.device_pause(layers, backward=True)
            grad = e.flat.collect_grads()
            buf[region].add_(grad[region])
            grad[region].zero_()

        def message(kind: str, i: int, sending: bool) -> tuple[int, torch.Tensor, int]:
            if kind == "act":
                peer = next_rank if sending else prev_rank
                if sending:
                    tensor = outputs[i].detach()
                else:
                    tensor = inputs[i] = torch.empty(shape)
                return peer, tensor, TAG_ACT  # type: ignore[return-value]
            peer = prev_rank if sending else next_rank
            if sending:
                tensor = inputs.pop(i).grad
                assert tensor is not None
            else:
                tensor = grads_in[i] = torch.empty(shape)
            return peer, tensor, TAG_GRAD  # type: ignore[return-value]

        for item in schedule_1f1b(s, stages, len(mbs)):
            if isinstance(item, Compute):
                e._enter("compute")
                if item.kind == "F":
                    forward(item.mb)
                else:
                    backward(item.mb)
                continue
            sends = [message(k, i, True) for k, i in item.sends]
            recvs = [message(k, i, False) for k, i in item.recvs]
            e._enter("collective")
            e.comm.p2p("dp", sends, recvs, broken)
            for kind, i in item.recvs:
                if kind == "act":
                    inputs[i].requires_grad_(True)
        if last:
            buf[n] += loss_sum
        timer.end(len(mbs), [self.cost_share(range(i, i + 1)) for i in layers])

    def update(
        self,
        step: int,
        grad: torch.Tensor,
        broken: Callable[[], bool],
        before_gather: Callable[[], None] = lambda: None,
    ) -> None:
        """Apply step ``step``'s summed gradient to the held layers (and to layers being taken
        over once caught up); keep the undo copy; queue gradients a migration still needs.

        With ZeRO, only the kept moments are updated and the other parameters of the held layers
        arrive from their keepers; if that gather fails this rank restores its undo copy at once,
        so it either applied the step completely or not at all."""
        e = self.e
        if self.zero:
            held = self.span(self.held) if self.held else slice(0, 0)
            self.undo = _Undo(
                step=e.step,
                loss=e.last_loss,
                held=self.held,
                saved=_saved(e.flat.data[held], self.store.exp_avg, self.store.exp_avg_sq),
                store=self.store,
            )
            self.store.update(e.flat.data, grad, step, e.opt.hyper)
            before_gather()  # where an ``phase=optimizer`` fault lands
            try:
                self._gather(broken)
            except BaseException:
                self.undo.restore()
                raise
            m = self.migration
            if m is not None and m.replay:
                grads = [grad[r] for r, _ in m.replay]
                if m.caught_up:
                    self._replay_step(m, step, grads)
                else:
                    m.pending.append((step, [g.clone() for g in grads]))
            self._written(step)
            return
        regions = [self.span(self.held)] if self.held else []
        m = self.migration
        if m is not None and m.caught_up:
            regions += [r for r, _ in m.replay]
        self.undo = _Undo(
            step=e.step,
            loss=e.last_loss,
            held=self.held,
            saved=[
                pair
                for r in regions
                for pair in _saved(e.flat.data[r], e.opt.exp_avg[r], e.opt.exp_avg_sq[r])
            ],
        )
        for r in regions:
            adamw_(
                e.flat.data[r], grad[r], e.opt.exp_avg[r], e.opt.exp_avg_sq[r], step, e.opt.hyper
            )
        if m is not None and not m.caught_up and m.replay:
            m.pending.append((step, [grad[r].clone() for r, _ in m.replay]))
        self._written(step)

    def _written(self, step: int) -> None:
        """After an update: record what was written, for online verification."""
        if self.e.cfg.verify_every:
            stageverify.record(self, step)

    def _exchange(
        self, sends: list[Any], recvs: list[Any], broken: Callable[[], bool]
    ) -> list[torch.Tensor]:
        """Point-to-point on the training group; the received buffers (fresh tensors, never live
        state: an abandoned receive may still write after a fault)."""
        self.e.comm.p2p("dp", sends, recvs, broken)
        return [t for _, t, _ in recvs]

    def _gather(self, broken: Callable[[], bool]) -> None:
        """ZeRO: the parameters of the held layers this rank does not keep, from their keepers."""
        params = self.e.flat.data
        sends, recvs, mine = gather_messages(self.gather, self.e.comm.rank("dp"), params)
        for piece, got in zip(mine, self._exchange(sends, recvs, broken), strict=True):
            params[piece.start : piece.stop].copy_(got)

    def after_step(self, step: int, ready_sum: float) -> dict[str, Any] | None:
        """At the step boundary: finish a landed migration, switch when every receiver is ready.
        Returns the switch's details (the same on every rank) when the layout changed."""
        m = self.migration
        if m is None:
            return None
        if not m.caught_up and m.replay and m.done.is_set():
            if m.error:  # the replica stays out of service; the next plan retries from scratch
                self.e.control.event("migration_failed", step=step, reason=str(m.error[0])[:300])
                m.replay = []  # its flag never rises, so nobody switches
            else:
                self._catch_up(m)
        if int(round(ready_sum)) < m.receivers:
            return None
        # Every receiver holds its new layers at this step: switch, everyone at this boundary.
        self.held = self.target
        if m.switch is not None:
            m.switch()
        self.migration = None
        self.serving = [True] * len(self.serving)
        plan = self.e.plan
        assert plan is not None
        self.shares = plan.shares
        return {
            "step": step,
            "seconds": round(time.perf_counter() - m.started, 6),
            "moves" if self.zero else "layer_transfers": [x.to_dict() for x in m.transfers],
            "bytes_received": m.nbytes,
        }

    @property
    def ready_flag(self) -> float:
        m = self.migration  # raised by a receiver once its new layers are current
        return 1.0 if m is not None and m.replay and m.caught_up else 0.0

    def _catch_up(self, m: _Migration) -> None:
        for land, payload in m.landed:
            land(payload)
        for step, grads in m.pending:  # replay the steps the snapshot missed, in order
            self._replay_step(m, step, grads)
        m.pending.clear()
        m.landed.clear()
        m.caught_up = True

    def _replay_step(self, m: _Migration, step: int, grads: Sequence[torch.Tensor]) -> None:
        """One optimizer step on the regions a migration brings up to date."""
        e = self.e
        for (region, own), g in zip(m.replay, grads, strict=True):
            if m.store is None:
                moments = (e.opt.exp_avg[region], e.opt.exp_avg_sq[region])
            else:
                moments = m.store.view(region.start, region.stop)
            params = e.flat.data[region] if own else e.flat.data[region].clone()
            adamw_(params, g, *moments, step, e.opt.hyper)

    def assemble(self, broken: Callable[[], bool]) -> tuple[torch.Tensor, bool]:
        """The whole model's [params | exp_avg | exp_avg_sq] on every rank (each layer from its
        lowest-rank holder), and whether all holders of every layer agree bit for bit."""
        if self.zero:
            return self._assemble_sharded(broken)
        e = self.e
        n = e.flat.numel
        rank = e.comm.rank("dp")
        sums = torch.full((self.num_layers,), -1, dtype=torch.int64)
        for layer in self.held or ():
            r = self.span(range(layer, layer + 1))
            sums[layer] = digest(e.flat.data[r], e.opt.exp_avg[r], e.opt.exp_avg_sq[r])
        rows = [x.tolist() for x in e.comm.allgather("dp", sums, broken)]
        agree = all(
            len({row[layer] for row in rows if row[layer] >= 0}) == 1
            for layer in range(self.num_layers)
        )
        whole = torch.zeros(3 * n, dtype=torch.float32)
        for layer in range(self.num_layers):
            first = next((i for i, row in enumerate(rows) if row[layer] >= 0), None)
            if first == rank:
                r = self.span(range(layer, layer + 1))
                whole[r.start : r.stop] = e.flat.data[r]
                whole[n + r.start : n + r.stop] = e.opt.exp_avg[r]
                whole[2 * n + r.start : 2 * n + r.stop] = e.opt.exp_avg_sq[r]
        e.comm.allreduce("dp", whole, broken)
        return whole, agree

    def _assemble_sharded(self, broken: Callable[[], bool]) -> tuple[torch.Tensor, bool]:
        """ZeRO: as :meth:`assemble`, with each moment part from its lowest-rank keeper, and
        both keepers of every part compared as well as every layer's holders."""
        e = self.e
        n = e.flat.numel
        rank = e.comm.rank("dp")
        units = [self.span(range(layer, layer + 1)) for layer in range(self.num_layers)]
        sums = torch.full((len(units) + len(self.parts),), -1, dtype=torch.int64)
        for layer in self.held or ():
            sums[layer] = digest(e.flat.data[units[layer]])
        for j, ((a, b), keepers) in enumerate(self.parts):
            if rank in keepers:
                sums[len(units) + j] = digest(*self.store.view(a, b))
        rows = [x.tolist() for x in e.comm.allgather("dp", sums, broken)]
        agree = all(len({row[u] for row in rows if row[u] >= 0}) == 1 for u in range(len(sums)))
        whole = torch.zeros(3 * n, dtype=torch.float32)
        for u in range(len(sums)):
            if next((i for i, row in enumerate(rows) if row[u] >= 0), None) != rank:
                continue
            if u < len(units):
                whole[units[u]] = e.flat.data[units[u]]
            else:
                (a, b), _ = self.parts[u - len(units)]
                m, v = self.store.view(a, b)
                whole[n + a : n + b] = m
                whole[2 * n + a : 2 * n + b] = v
        e.comm.allreduce("dp", whole, broken)
        return whole, agree

    # ---- recovery ----------------------------------------------------------------------------
    def sync(
        self,
        plan: Plan,
        broken: Callable[[], bool],
        asynchronous: bool,
        start_from: Callable[[], WholeState] | None = None,
    ) -> dict[str, Any]:
        """Agree on the resume step, roll back ranks that updated the failed step, and start (or
        do) the transfers the new layout needs. When every rank is fresh and ``start_from`` is
        given (``--resume``), the job starts from the whole state it returns instead."""
        if self.zero:
            return self._sync_sharded(plan, broken, asynchronous, start_from)
        e = self.e
        rank = e.comm.rank("dp")
        self.migration = None  # a migration cut short by this change is void
        undo_held = self.undo.held if self.undo else None
        mine = torch.tensor(
            [float(e.step), float(self.fresh), *_bounds_of(self.held), *_bounds_of(undo_held)],
            dtype=torch.float64,
        )
        rows = [r.tolist() for r in e.comm.allgather("dp", mine, broken)]
        veterans = [int(r[0]) for r in rows if not r[1]]
        if not veterans and start_from is not None:
            return self.restore_whole(plan, start_from())
        resume = min(veterans) if veterans else 0  # everyone fresh: the job starts
        holdings: list[range | None] = []
        rolled_back = []
        for i, r in enumerate(rows):
            step = int(r[0])
            if r[1] and resume > 0:
                holdings.append(None)  # a newcomer: its initial state is not the job's
            elif step > resume:  # it updated the failed step: back to its undo copy
                rolled_back.append(i)
                holdings.append(_range_of(r[4], r[5]))
            else:
                holdings.append(_range_of(r[2], r[3]))
        if rank in rolled_back:
            self._roll_back(resume)
        targets = [plan.stage_layers(r) for r in range(plan.world_size)]
        transfers = plan_layer_transfers(holdings, targets, self.sizes)
        receivers = sorted({x.dst for x in transfers})
        serving = [all(r not in receivers for r in ranks) for ranks in plan.replicas]
        self.target = targets[rank]
        self.fresh = False
        e.step = resume
        info: dict[str, Any] = {
            "resume_step": resume,
            "rolled_back": rolled_back,
            "layers": [self.target.start, self.target.stop],
            "layer_transfers": [x.to_dict() for x in transfers],
            **transfer_stats(transfers, self.sizes),
        }
        if not transfers:
            self.held = self.target
            self.serving, self.shares = [True] * len(plan.replicas), plan.shares
            return info
        if asynchronous and any(serving):
            self.held = holdings[rank]
            self.serving = serving
            self.shares = serving_shares(plan, serving, self.costs)
            sends, recvs, regions = self._messages(transfers)
            m = _Migration(transfers, [(r, True) for r in regions], len(receivers))
            self._start_migration(m, sends, recvs, [partial(self._land, r) for r in regions])
            info.update(migration="async", serving=serving, shares=list(self.shares))
            return info
        start = time.perf_counter()
        nbytes = self._move_now(transfers, broken)
        self.held = self.target
        self.serving, self.shares = [True] * len(plan.replicas), plan.shares
        info.update(
            migration="blocking",
            migration_seconds=round(time.perf_counter() - start, 6),
            bytes_received=nbytes,
        )
        return info

    def _sync_sharded(
        self,
        plan: Plan,
        broken: Callable[[], bool],
        asynchronous: bool,
        start_from: Callable[[], WholeState] | None,
    ) -> dict[str, Any]:
        """ZeRO recovery: agree on the resume step and roll back; then every rank says what it
        has (held layers, kept moment intervals) and the parameters and moments the new layout
        needs move from ranks that have them, as disjoint pieces: before training resumes
        (blocking) or in the background (asynchronous, see :meth:`_start_sharded_migration`)."""
        e = self.e
        rank = e.comm.rank("dp")
        self.migration = None  # a migration cut short by this change is void
        mine = torch.tensor([float(e.step), float(self.fresh)], dtype=torch.float64)
        rows = [r.tolist() for r in e.comm.allgather("dp", mine, broken)]
        veterans = [int(r[0]) for r in rows if not r[1]]
        if not veterans and start_from is not None:
            return self.restore_whole(plan, start_from())
        resume = min(veterans) if veterans else 0  # everyone fresh: the job starts
        rolled_back = [i for i, r in enumerate(rows) if int(r[0]) > resume]
        if rank in rolled_back:
            self._roll_back(resume)
        newcomer = self.fresh and resume > 0  # its initial state is not the job's
        held = None if newcomer else self.held
        kept = [] if newcomer else self.store.intervals
        row = torch.full((3 + 4 * self.num_layers,), -1.0, dtype=torch.float64)
        row[0:2] = torch.tensor(_bounds_of(held))
        row[2] = len(kept)
        for i, (a, b) in enumerate(kept):
            row[3 + 2 * i : 5 + 2 * i] = torch.tensor([float(a), float(b)])
        rows = [r.tolist() for r in e.comm.allgather("dp", row, broken)]
        have_params = [_spans(self.span, _range_of(r[0], r[1])) for r in rows]
        have_moments = [
            [(int(r[3 + 2 * i]), int(r[4 + 2 * i])) for i in range(int(r[2]))] for r in rows
        ]
        targets = [plan.stage_layers(r) for r in range(plan.world_size)]
        blocks = holder_blocks(targets, self.offsets)
        duty = moment_duty(blocks, plan.world_size)
        param_pieces = plan_piece_transfers(have_params, [_spans(self.span, t) for t in targets])
        self.target = targets[rank]
        self.fresh = False
        e.step = resume
        info: dict[str, Any] = {
            "resume_step": resume,
            "rolled_back": rolled_back,
            "layers": [self.target.start, self.target.stop],
            "held_elements": self.span(self.target).stop - self.span(self.target).start,
        }

        def adopt(store: MomentStore) -> None:  # the new layout's duties
            self.store = store
            self.parts = part_keepers(blocks)
            self.gather = [p for p in gather_plan(blocks) if rank in (p.src, p.dst)]

        if resume == 0:  # before the first update every moment is zero: nothing to move
            self.held = self.target
            self.serving, self.shares = [True] * len(plan.replicas), plan.shares
            adopt(MomentStore(duty[rank]))
            return {**info, "moment_bytes": self.store.nbytes, "gather_bytes": self._gather_bytes()}
        # Asynchronously, a rank brings up to date the layers it newly holds (parameters and
        # both moments, to replay their updates) and the parts it newly keeps.
        newly = [
            subtract(_spans(self.span, t), h) for t, h in zip(targets, have_params, strict=True)
        ]
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
            self.held = _range_of(rows[rank][0], rows[rank][1])
            self.serving = serving
            self.shares = serving_shares(plan, serving, self.costs)
            # Until the switch every rank keeps its old duties; the parameters it holds but does
            # not keep come from any surviving keeper.
            interim = plan_piece_transfers(have_moments, have_params)
            self.gather = [p for p in interim if rank in (p.src, p.dst)]
            self._start_sharded_migration(
                param_pieces, moment_pieces, newly[rank], wanted[rank], duty[rank], adopt,
                receivers=len({p.dst for p in param_pieces + moment_pieces}),
            )  # fmt: skip
            return {**info, "migration": "async", "serving": serving, "shares": list(self.shares)}
        start = time.perf_counter()
        store = MomentStore(duty[rank])
        store.fill_from(self.store)
        sends_p, recvs_p, got_p = gather_messages(param_pieces, rank, e.flat.data)
        sends_m, recvs_m, got_m = moment_messages(moment_pieces, rank, self.store)
        received = self._exchange(sends_p + sends_m, recvs_p + recvs_m, broken)
        for piece, payload in zip(got_p, received[: len(got_p)], strict=True):
            e.flat.data[piece.start : piece.stop].copy_(payload)
        for piece, payload in zip(got_m, received[len(got_p) :], strict=True):
            store.unpack(piece.start, piece.stop, payload)
        self.held = self.target
        self.serving, self.shares = [True] * len(plan.replicas), plan.shares
        adopt(store)
        return {
            **info,
            "migration": "blocking",
            "migration_seconds": round(time.perf_counter() - start, 6),
            "bytes_received": sum(t.numel() * t.element_size() for t in received),
            "moment_bytes": store.nbytes,  # vs 8 bytes per held element when replicated
            "gather_bytes": self._gather_bytes(),
        }

    def _gather_bytes(self) -> int:
        rank = self.e.comm.rank("dp")
        return 4 * sum(p.stop - p.start for p in self.gather if p.dst == rank)

    def _start_sharded_migration(
        self,
        param_pieces: list[Piece],
        moment_pieces: list[Piece],
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
        e = self.e
        rank = e.comm.rank("dp")
        mine = subtract(wanted, self.store.intervals)  # moments this rank has to receive
        replay = [
            (slice(a, b), any(c <= a and b <= d for c, d in newly)) for a, b in _cut(mine, newly)
        ]
        m = _Migration([*param_pieces, *moment_pieces], replay, receivers, store=MomentStore(mine))

        def switch() -> None:
            store = MomentStore(duty)
            store.fill_from(self.store)
            assert m.store is not None
            store.fill_from(m.store)
            adopt(store)

        m.switch = switch
        params = e.flat.data
        sends = [(p.dst, params[p.start : p.stop].clone(), TAG_PARAM) for p in param_pieces
                 if p.src == rank]  # fmt: skip
        sends += [(p.dst, self.store.packed(p.start, p.stop), TAG_MOMENT) for p in moment_pieces
                  if p.src == rank]  # fmt: skip
        recvs: list[Any] = []
        lands: list[Callable[[torch.Tensor], None]] = []
        for p in param_pieces:
            if p.dst == rank:
                recvs.append((p.src, torch.empty(p.stop - p.start), TAG_PARAM))
                lands.append(partial(_copy_into, params[p.start : p.stop]))
        for p in moment_pieces:
            if p.dst == rank:
                recvs.append((p.src, torch.empty(2 * (p.stop - p.start)), TAG_MOMENT))
                lands.append(partial(m.store.unpack, p.start, p.stop))
        self._start_migration(m, sends, recvs, lands)

    def restore_whole(self, plan: Plan, state: WholeState) -> dict[str, Any]:
        """Adopt ``plan``'s layout from the whole training state (a durable checkpoint, read by
        every rank): every rank takes its layers and, with ZeRO, the moment parts it keeps."""
        e = self.e
        rank = e.comm.rank("dp")
        targets = [plan.stage_layers(r) for r in range(plan.world_size)]
        e.flat.data.copy_(state.params)
        if self.zero:
            blocks = holder_blocks(targets, self.offsets)
            store = MomentStore(moment_duty(blocks, plan.world_size)[rank])
            for a, b in store.intervals:
                store.unpack(a, b, torch.cat([state.exp_avg[a:b], state.exp_avg_sq[a:b]]))
            self.store = store
            self.parts = part_keepers(blocks)
            self.gather = [p for p in gather_plan(blocks) if rank in (p.src, p.dst)]
        else:
            e.opt.exp_avg.copy_(state.exp_avg)
            e.opt.exp_avg_sq.copy_(state.exp_avg_sq)
        self.held = self.target = targets[rank]
        self.migration, self.undo, self.fresh = None, None, False
        self.serving, self.shares = [True] * len(plan.replicas), plan.shares
        e.step, e.last_loss = state.step, state.loss
        return {
            "resume_step": state.step,
            "layers": [self.target.start, self.target.stop],
            "durable": str(state.path),
        }

    def _roll_back(self, resume: int) -> None:
        undo = self.undo
        assert undo is not None and undo.step == resume, "no undo copy for the failed step"
        e = self.e
        undo.restore()
        if undo.store is not None:
            self.store = undo.store
        self.held = undo.held
        self.undo = None
        e.step, e.last_loss = resume, undo.loss

    def _payload(self, t: LayerTransfer) -> torch.Tensor:
        e = self.e
        r = self.span(range(t.start, t.stop))
        return torch.cat([e.flat.data[r], e.opt.exp_avg[r], e.opt.exp_avg_sq[r]])

    def _messages(self, transfers: list[LayerTransfer]) -> tuple[list[Any], list[Any], list[slice]]:
        """This rank's part of ``transfers``: sends (a copy of the layers now), receive buffers,
        and the flat regions the receives land in."""
        rank = self.e.comm.rank("dp")
        sends = [(t.dst, self._payload(t), TAG_STATE) for t in transfers if t.src == rank]
        regions = [self.span(range(t.start, t.stop)) for t in transfers if t.dst == rank]
        srcs = [t.src for t in transfers if t.dst == rank]
        recvs = [
            (src, torch.empty(3 * (r.stop - r.start)), TAG_STATE)
            for src, r in zip(srcs, regions, strict=True)
        ]
        return sends, recvs, regions

    def _move_now(self, transfers: list[LayerTransfer], broken: Callable[[], bool]) -> int:
        sends, recvs, regions = self._messages(transfers)
        received = self._exchange(sends, recvs, broken)
        for region, payload in zip(regions, received, strict=True):
            self._land(region, payload)
        return sum(p.numel() * p.element_size() for p in received)

    def _land(self, region: slice, payload: torch.Tensor) -> None:
        e = self.e
        k = region.stop - region.start
        e.flat.data[region].copy_(payload[:k])
        e.opt.exp_avg[region].copy_(payload[k : 2 * k])
        e.opt.exp_avg_sq[region].copy_(payload[2 * k :])

    def _start_migration(
        self,
        m: _Migration,
        sends: list[Any],
        recvs: list[Any],
        lands: list[Callable[[torch.Tensor], None]],
    ) -> None:
        """Post the snapshot's messages on the migration group; a thread waits for them and
        queues each received payload with where it lands (applied at a step boundary)."""
        m.nbytes = sum(p.numel() * p.element_size() for _, p, _ in recvs)
        works = self.e.comm.post(MIG, sends, recvs)

        def wait() -> None:  # gloo progresses point-to-point work only inside wait()
            try:
                for w in works:
                    w.wait()
                m.landed.extend(zip(lands, (p for _, p, _ in recvs), strict=True))
            except BaseException as exc:  # a fault: the next plan voids this migration
                m.error.append(exc)
            finally:
                m.done.set()

        threading.Thread(target=wait, name="migration", daemon=True).start()
        self.migration = m


SIM_CLOCKS = (0.6, 1.0, 1.3)  # relative min / nominal / max clocks of the simulated actuator


def _actuator_options(kind: str) -> dict[str, Any]:
    return {"f_nominal": SIM_CLOCKS[1]} if kind == "sim" else {}


def _clock_range(actuator: Any) -> tuple[float, float, float]:
    """(min, nominal, max) clocks in the actuator's unit."""
    if hasattr(actuator, "clock_range"):  # NVML: the device's own range, in MHz
        return tuple(actuator.clock_range(0))  # type: ignore[return-value]
    if hasattr(actuator, "time_scale") or not hasattr(actuator, "f_nominal"):
        return SIM_CLOCKS
    raise DvfsError("this DVFS actuator has no clock range the engine can plan with")


def _saved(*live: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(t, t.clone()) for t in live]


def _bounds_of(layers: range | None) -> tuple[float, float]:
    return (float(layers.start), float(layers.stop)) if layers is not None else (-1.0, -1.0)


def _copy_into(live: torch.Tensor, payload: torch.Tensor) -> None:
    live.copy_(payload)


def _cut(intervals: list[Interval], at: list[Interval]) -> list[Interval]:
    """``intervals`` cut at every boundary of ``at`` (so each piece lies inside or outside)."""
    marks = sorted({x for iv in at for x in iv})
    out = []
    for a, b in intervals:
        inner = [x for x in marks if a < x < b]
        out += list(zip([a, *inner], [*inner, b], strict=True))
    return out


def _spans(span: Callable[[range], slice], layers: range | None) -> list[Interval]:
    """The flat interval of a layer range (none for ``None``)."""
    if not layers:
        return []
    s = span(layers)
    return [(s.start, s.stop)]


def _range_of(start: float, stop: float) -> range | None:
    return range(int(start), int(stop)) if start >= 0 else None
