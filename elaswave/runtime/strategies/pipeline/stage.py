"""Pipeline parallelism inside a worker: the 1F1B schedule, one step of a stage, and the moves of
layer state that a new layout needs.

Layout. Every rank of a pipeline plan belongs to one replica and runs one stage of it: a
contiguous range of the layer list. It *holds* (keeps current) the parameters and Adam moments
of those layers only, and allocates only them (its state's *window*,
:meth:`~elaswave.runtime.state.TrainState.set_window`): other layers stay on the meta device.
Offsets everywhere are the whole model's flat offsets; the state translates them into its
window. Each layer's gradient is summed among the ranks that hold it
(:mod:`~elaswave.planning.gradgroups`), whatever the replicas' partitions are (replicas may be
cut differently after a loss).

The window is the held layers, the layers being taken over while a migration runs, and the
layers the undo copy would restore (for one step after a re-cut they differ); every layer with
``grad_reduce: all``. It changes only where nothing points into the old buffers: at a step's
start (:meth:`Pipeline.fit_window`) and in a sync.

Commit and rollback. Before a rank updates its layers it keeps a copy of them (the local
snapshot). If the step fails on some rank after others updated, every rank that updated rolls
back to that copy, so all ranks resume from the same step and redo the in-flight one.

New layouts. After a membership change a rank may have to own layers it does not hold. They come
from ranks that hold them (data-parallel peers in other replicas), planned as disjoint transfers
(`plan_layer_transfers`). *Blocking* migration moves them before training resumes.
*Asynchronous* migration takes the replicas that need layers out of service, lets the others run
the whole global batch, and copies a snapshot of the layers in the background; a receiver then
replays the gradients of the steps it missed (while a migration runs, every layer's gradient is
summed over every rank, a bounded chunk at a time) and raises a flag in the all-reduce; when
every receiver has, all ranks switch to the new layout at the same step boundary.

Beside this module: the pure schedule and transfer plans (:mod:`~elaswave.planning.schedule`),
the recovery on a new layout and the migrations' moves
(:mod:`~elaswave.runtime.strategies.pipeline.stagesync`), ZeRO-1 inside the stages
(:mod:`~elaswave.runtime.strategies.pipeline.stagezero`, layout in
:mod:`~elaswave.planning.stageshards`), online verification
(:mod:`~elaswave.runtime.strategies.pipeline.stageverify`) and layer timing
(:mod:`~elaswave.runtime.strategies.pipeline.stagetimes`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.dvfs import DvfsError, frequency_plan
from elaswave.planning.plan import Plan
from elaswave.planning.redo import StageRedo
from elaswave.planning.stageshards import Interval, Piece
from elaswave.runtime.device import nvml_index
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.integrity.checksums import digest
from elaswave.runtime.optim import update_
from elaswave.runtime.strategies.pipeline import stagesync, stageverify, stagezero
from elaswave.runtime.strategies.pipeline.clocks import SimActuator, make_actuator
from elaswave.runtime.strategies.pipeline.stageredo import StageKept
from elaswave.runtime.strategies.pipeline.stagestate import Migration, MomentStore, Undo, hull
from elaswave.runtime.strategies.pipeline.stagestep import StageStep, StageTools
from elaswave.runtime.strategies.pipeline.stagetimes import StageTimer
from elaswave.runtime.strategies.pipeline.stagezero import Contribution, gather_messages
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.timing import clock
from elaswave.runtime.workload.base import EVAL_STEP
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

TAG_EVAL = 7  # an evaluation's activations (ZeRO's pieces: 4, 5; repairs: 6)


def estimated_costs(costs: Sequence[float] | None, layers: int) -> tuple[float, ...]:
    """The workload's cost per layer, or equal costs when it gives none (or the wrong number)."""
    if costs is None or len(costs) != layers:
        return (1.0,) * layers
    return tuple(float(c) for c in costs)


# ---- the stage runner ----------------------------------------------------------------------------
class Pipeline:
    """One rank's stage: runs the 1F1B step, keeps its layers, moves them on a new layout."""

    def __init__(self, ctx: RankContext) -> None:
        self.e = ctx  # the train state, config, communicator and plan of this rank
        self.num_layers = len(ctx.state.model)
        self.offsets = [(off, off + length) for off, length in ctx.state.segments]
        self.sizes = [length * 3 * 4 for _, length in ctx.state.segments]  # params + 2 moments, f32
        # what holding a layer costs a stage: its parameters, their gradient and two moments
        self.layer_bytes = [length * 4 * 4 for _, length in ctx.state.segments]
        self.held: range | None = range(self.num_layers)  # at step 0 everyone holds the init
        self.fresh = True  # no plan applied yet: a newcomer's step-0 state is not the job's
        self.target: range = range(0)
        self.serving: list[bool] = []
        self.shares: tuple[int, ...] = ()
        self.undo: Undo | None = None
        self.migration: Migration | None = None
        self.costs = estimated_costs(ctx.state.workload.layer_costs(), self.num_layers)
        self.actuator = make_actuator(ctx.cfg.dvfs, **_actuator_options(ctx.cfg.dvfs))
        self.stage_key = nvml_index(ctx.state.device)  # what the actuator clocks: this device
        self.clocks = _clock_range(self.actuator, self.stage_key)
        # ZeRO inside the stages: moments of the kept intervals only (the state has none),
        # and the parameter pieces this rank sends or receives after every update (ZeRO-1) or
        # before every step (ZeRO-3: the store keeps the intervals' parameters too, and the
        # window's buffers are freed between steps; ``stale`` while they do not hold them).
        self.zero = bool(ctx.cfg.zero)
        self.zero3 = ctx.cfg.zero == 3
        self.stale = False
        self.store = self.new_store(())
        self.gather: list[Piece] = []
        self.parts: list[tuple[Interval, tuple[int, ...]]] = []  # (part, its keepers)
        self.timer = StageTimer()  # what this stage's layers cost in real steps
        self.recorded: dict[stageverify.Unit, int] = {}  # CRC per kept unit, as last written
        self.recorded_step = -1

    def new_store(self, intervals: Sequence[Interval]) -> MomentStore:
        """A store of ``intervals`` (with their parameters under ZeRO-3), zeroed."""
        return MomentStore(intervals, self.e.state.device, params=self.zero3)

    def profile_layers(self, repeats: int = 3) -> list[float]:
        """Seconds of forward + backward per layer for one micro-batch (median of ``repeats``).

        Runs before the first plan on a throw-away micro-batch, one layer allocated at a time
        (its initial values); gradients are discarded, so training is unaffected."""
        e, t = self.e, self.e.cfg.train
        h, _ = e.state.microbatch(range(t.micro_batch_size))
        out = []
        for index in range(self.num_layers):
            e.state.set_window(range(index, index + 1))
            times = []
            for _ in range(repeats + 1):  # the first run warms up kernels and allocator; dropped
                x = h.detach().requires_grad_(h.is_floating_point())
                start = clock().now()  # an accelerator's clock waits for its queued work
                y = e.state.model.run_layer(index, x, 0, microbatch=0)
                y.float().sum().backward()
                times.append(clock().now() - start)
            h = y
            out.append(sorted(times[1:])[repeats // 2])
        e.state.set_window(range(0))
        return out

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

    def link_pause(self, received: Sequence[torch.Tensor]) -> None:
        """Emulated link (``train.state_bandwidth``): the time migrated state would take to
        arrive over a link of that bandwidth."""
        mb_per_s = self.e.cfg.train.state_bandwidth
        if mb_per_s > 0:
            time.sleep(sum(t.numel() * t.element_size() for t in received) / (mb_per_s * 1e6))

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

    def fit_window(self) -> None:
        """Allocate exactly the layers this rank needs now (see the module's docstring); constant
        while a migration runs (held, target and the undo copy's layers do not change)."""
        if self.e.cfg.grad_reduce == "all":
            self.e.state.set_window(range(self.num_layers))
        else:
            undo = self.undo.held if self.undo else None
            self.e.state.set_window(hull(self.held, self.target, undo))
        self.e.state.flat.reserve()  # a ZeRO-3 stage's window, freed after the last update

    def fill(self, broken: Callable[[], bool]) -> None:
        """ZeRO-3, before a step or an evaluation: the held layers' parameters into the window,
        the kept intervals from the store and the rest from their keepers (the same pieces a
        ZeRO-1 stage gathers after its update)."""
        if not self.stale:
            return
        self.e.state.flat.reserve()
        params = self.e.state.params
        for a, b in self.store.intervals:
            params[a:b].copy_(self.store.views(a, b)[0])
        self._gather(broken)
        self.stale = False

    def release(self) -> None:
        """ZeRO-3, after an update: free the window's parameters and gradients (the store keeps
        this rank's intervals of them; :meth:`fill` brings the rest back)."""
        self.e.state.flat.release()
        self.stale = True

    # ---- one step --------------------------------------------------------------------------
    def run_step(
        self,
        step: int,
        sums: StepSums,
        everyone: list[MicroBatch],
        *,
        broken: Callable[[], bool],
        kept: StageKept,
        acc: torch.Tensor | None = None,
        redo: StageRedo | None = None,
        slow: float = 0.0,
    ) -> float | None:
        """Forward/backward of this rank's stage over its replica's micro-batches; the layer
        gradients and the loss sum and count (last stage) land in ``sums``.

        Returns the stage's busy seconds per micro-batch: forward, backward and emulated device
        time, without the point-to-point waits and the time the thread sat waiting for a CPU
        (the straggler detector's input); ``None`` when the rank computed nothing. ``slow`` (a
        ``slow`` fault) is extra seconds per micro-batch of the whole model: the stage sleeps
        its layers' cost share of it, as a slower device would. ``kept`` and ``acc``: the
        accumulator's record and float64 buffer (:class:`StageStep`); ``redo``: the step is an
        interrupted one's partial redo, the replica computes its share of it."""
        plan = self.e.plan
        assert plan is not None
        # the replicas this rank runs its stage for: its own, and under ``stage_loss: recycle``
        # those whose rank of the same stage was lost
        roles = [d for d, _ in plan.roles(self.e.comm.rank("dp")) if self.serving[d]]
        if not roles:
            return None  # out of service while its layers migrate: only reduce and update
        runs: list[list[MicroBatch]] = []
        for d in roles:
            if redo is not None:
                runs.append([everyone[i] for i in redo.shares[d]])
            else:
                start = sum(self.shares[:d])
                runs.append(everyone[start : start + self.shares[d]])
        masks = {j: redo.kept[j] for j in self.target} if redo is not None else {}
        mbs = [mb for run in runs for mb in run]  # one replica's after another's
        replicas = [d for d, run in zip(roles, runs, strict=True) for _ in run]
        tools = StageTools(
            self.num_layers, self.span, self.timer, self.cost_share, self.device_pause
        )
        return StageStep(
            self.e,
            tools,
            step,
            sums=sums,
            mbs=mbs,
            broken=broken,
            kept=kept,
            acc=acc,
            masks=masks,
            replicas=replicas,
        ).run(slow)

    def update(
        self,
        step: int,
        grad: torch.Tensor,
        broken: Callable[[], bool],
        *,
        before_gather: Callable[[], None] = lambda: None,
        finish: Callable[[], None] = lambda: None,
    ) -> None:
        """Apply step ``step``'s summed gradient to the held layers (and to layers being taken
        over once caught up); keep the undo copy; queue gradients a migration still needs.

        With ZeRO, only the kept moments are updated and the other parameters of the held layers
        arrive from their keepers (ZeRO-1: now; ZeRO-3: the store keeps the updated intervals,
        the window is freed, and the next step's :meth:`fill` gathers it). ``finish`` runs on
        the updated layers (pruning: a collective too). If the gather or ``finish`` fails this
        rank restores its undo copy at once, so it either applied the step completely or not
        at all."""
        e = self.e
        st = e.state
        held = self.span(self.held) if self.held else slice(0, 0)
        params, grads = st.params, st.flat.at(grad)
        store = self.store
        live: list[Callable[[], torch.Tensor]]
        if self.zero3:  # the store is all this rank keeps
            live = [partial(getattr, store, name) for name in ("params", "exp_avg", "exp_avg_sq")]
        elif self.zero:
            live = [lambda: st.params[held], lambda: store.exp_avg, lambda: store.exp_avg_sq]
        else:
            live = [lambda: st.params[held], lambda: st.exp_avg[held], lambda: st.exp_avg_sq[held]]
        self.undo = Undo(
            step=st.step,
            loss=st.last_loss,
            held=self.held,
            saved=_saved(*live),
            store=store if self.zero else None,
        )
        if self.zero:
            self.store.update(params, grads, step, hyper=st.opt.hyper)
            before_gather()  # where an ``phase=optimizer`` fault lands
        else:
            h = st.opt.hyper
            update_(
                params[held], grads[held], st.exp_avg[held], exp_avg_sq=st.exp_avg_sq[held],
                step=step, h=h, groups=h.groups_of(held),
            )  # fmt: skip
        try:
            if self.zero and not self.zero3:
                self._gather(broken)
            finish()
        except BaseException:
            self.undo.restore()
            raise
        if self.zero3:
            self.release()
        m = self.migration  # regions a migration brings up to date: replayed once caught up
        if m is not None and m.replay:
            missed = [grads[r] for r, _ in m.replay]
            if m.caught_up:
                stagesync.replay_step(m, step, missed, state=self.e.state)
            else:
                m.pending.append((step, [g.clone() for g in missed]))
        self._written(step)

    def skip(self, step: int) -> None:
        """Step ``step`` is not applied (its reduced values are not finite, or it is one of
        ``train.skip_steps``): the held layers stand as they were, and that is what the step
        wrote. ZeRO-3 frees its window as after an update (the next step gathers it again)."""
        if self.zero3:
            self.release()
        self._written(step)

    def _written(self, step: int) -> None:
        """After an update: record what was written, for online verification."""
        if self.e.cfg.verify_every:
            stageverify.record(self, step)

    def exchange(
        self, sends: list[Any], recvs: list[Any], broken: Callable[[], bool]
    ) -> list[torch.Tensor]:
        """Point-to-point on the training group; the received buffers (fresh tensors, never live
        state: an abandoned receive may still write after a fault)."""
        self.e.comm.p2p("dp", sends, recvs, abort=broken)
        return [t for _, t, _ in recvs]

    def _gather(self, broken: Callable[[], bool]) -> None:
        """ZeRO: the parameters of the held layers this rank does not keep, from their keepers.
        A wait on peers: the hang detector sees a collective (a rank waiting for a lost or cut
        off peer is not hung itself), then computing again."""
        params = self.e.state.params
        sends, recvs, mine = gather_messages(self.gather, self.e.comm.rank("dp"), params)
        self.e.enter("collective")
        received = self.exchange(sends, recvs, broken)
        self.e.enter("compute")
        for piece, got in zip(mine, received, strict=True):
            params[piece.start : piece.stop].copy_(got)

    def after_step(self, step: int, ready_sum: int) -> dict[str, Any] | None:
        """At the step boundary: finish a landed migration, switch when every receiver is ready.
        Returns the switch's details (the same on every rank) when the layout changed."""
        m = self.migration
        if m is None:
            return None
        if not m.caught_up and m.replay and m.done.is_set():
            if m.error:  # the replica stays out of service; the next plan retries from scratch
                self.e.event("migration_failed", step=step, reason=str(m.error[0])[:300])
                m.replay = []  # its flag never rises, so nobody switches
            else:
                stagesync.catch_up(m, self.e.state)
        if ready_sum < m.receivers:
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

    def assemble(self, broken: Callable[[], bool]) -> tuple[torch.Tensor, bool]:
        """The whole model's [params | exp_avg | exp_avg_sq] on every rank (each layer from its
        lowest-rank holder), and whether all holders of every layer agree bit for bit."""
        pieces, agree = self.contributions(broken)
        n = self.e.state.flat.total
        whole = self.e.state.flat.data.new_zeros(3 * n)
        for part, a, b, tensor in pieces:
            whole[part * n + a : part * n + b] = tensor
        self.e.comm.allreduce("dp", whole, broken)
        return whole, agree

    def score(
        self, batches: Sequence[Sequence[int]], slots: torch.Tensor, broken: Callable[[], bool]
    ) -> None:
        """Held-out evaluation through this rank's replica (see ``PipelineStages.score``): each
        micro-batch's activations arrive from the previous stage and go to the next one, one
        micro-batch at a time; the last stage fills the slots."""
        e = self.e
        plan, st = e.plan, e.state
        assert plan is not None
        rank = e.comm.rank("dp")
        serving = [r for r, on in enumerate(self.serving) if on]
        layers = plan.stage_layers(rank)
        first, last = layers.start == 0, layers.stop == self.num_layers
        # batch i goes through replica serving[i % len(serving)]; a rank that runs its stage for
        # several replicas takes their batches in the order of i, as each neighbour sends them
        mine = {d: s for d, s in plan.roles(rank) if d in serving}
        for i in range(len(batches)):
            d = serving[i % len(serving)]
            if d not in mine:
                continue
            s, ranks = mine[d], plan.replicas[d]
            inputs, targets = st.microbatch(batches[i]) if first or last else (None, None)
            if first:
                h = inputs
            else:
                spec = st.workload.boundary(layers.start - 1, len(batches[i]))
                h = torch.empty(spec.shape, dtype=spec.dtype, device=st.device)
                e.comm.p2p("dp", [], [(ranks[s - 1], h, TAG_EVAL)], abort=broken)
            h = st.model(h, EVAL_STEP, i, layers.start, layers.stop)
            if last:
                slots[3 * i : 3 * i + 3] = torch.tensor(st.score(h, targets), dtype=slots.dtype)
            else:
                e.comm.p2p("dp", [(ranks[s + 1], h, TAG_EVAL)], [], abort=broken)

    def contributions(self, broken: Callable[[], bool]) -> tuple[list[Contribution], bool]:
        """What this rank brings to the whole state: ``(part, start, stop, tensor)``, part 0
        the parameters and 1, 2 the moments, each layer from its lowest-rank holder; and
        whether all holders of every layer agree bit for bit (a collective)."""
        if self.zero:
            return stagezero.contributions(self, broken)
        e = self.e
        st = e.state
        rank = e.comm.rank("dp")
        sums = torch.full((self.num_layers,), -1, dtype=torch.int64, device=e.state.device)
        for layer in self.held or ():
            r = self.span(range(layer, layer + 1))
            sums[layer] = digest(st.params[r], st.exp_avg[r], st.exp_avg_sq[r])
        rows = [x.tolist() for x in e.comm.allgather("dp", sums, broken)]
        agree = all(
            len({row[layer] for row in rows if row[layer] >= 0}) == 1
            for layer in range(self.num_layers)
        )
        out: list[Contribution] = []
        for layer in range(self.num_layers):
            first = next((i for i, row in enumerate(rows) if row[layer] >= 0), None)
            if first == rank:
                r = self.span(range(layer, layer + 1))
                out += [
                    (0, r.start, r.stop, st.params[r]),
                    (1, r.start, r.stop, st.exp_avg[r]),
                    (2, r.start, r.stop, st.exp_avg_sq[r]),
                ]
        return out, agree

    # ---- recovery ----------------------------------------------------------------------------
    def sync(
        self,
        plan: Plan,
        broken: Callable[[], bool],
        asynchronous: bool,
        *,
        start_from: Callable[[], DurableState | None] | None = None,
    ) -> dict[str, Any]:
        """Agree on the resume step, roll back ranks that updated the failed step, and start (or
        do) the transfers the new layout needs. When every rank is fresh, the job starts from
        the whole state ``start_from`` returns, if any (``--resume``, or the newest durable
        checkpoint of a job that has committed steps)."""
        if self.zero:
            return stagezero.sync(
                self, plan, broken, asynchronous=asynchronous, start_from=start_from
            )
        return stagesync.sync(self, plan, broken, asynchronous=asynchronous, start_from=start_from)

    def begin_layout(
        self, plan: Plan, resume: int, rolled_back: list[int]
    ) -> tuple[list[range], dict[str, Any]]:
        """Once the resume step is agreed: every rank's layers under ``plan``, this rank's
        target, and the common part of the ``state_synced`` details."""
        return stagesync.begin_layout(self, plan, resume, rolled_back=rolled_back)

    def restore_whole(self, plan: Plan, state: DurableState) -> dict[str, Any]:
        """Adopt ``plan``'s layout from the whole training state (a durable checkpoint, read by
        every rank): every rank takes its layers and, with ZeRO, the moment parts it keeps."""
        return stagesync.restore_whole(self, plan, state)

    def roll_back(self, resume: int) -> None:
        """Undo this rank's update of step ``resume + 1`` (it applied a step not every rank did)."""
        stagesync.roll_back(self, resume)

    def start_migration(
        self,
        m: Migration,
        sends: list[Any],
        recvs: list[Any],
        *,
        lands: list[Callable[[torch.Tensor], object]],
    ) -> None:
        """Post the snapshot's messages on the migration group; a thread waits for them and
        queues each received payload with where it lands (applied at a step boundary)."""
        stagesync.post_migration(
            self.e.comm, m, sends=sends, recvs=recvs, lands=lands, link_pause=self.link_pause
        )
        self.migration = m


SIM_CLOCKS = (0.6, 1.0, 1.3)  # relative min / nominal / max clocks of the simulated actuator


def _actuator_options(kind: str) -> dict[str, Any]:
    return {"f_nominal": SIM_CLOCKS[1]} if kind == "sim" else {}


def _clock_range(actuator: Any, device: int) -> tuple[float, float, float]:
    """(min, nominal, max) clocks in the actuator's unit."""
    if hasattr(actuator, "clock_range"):  # NVML: the device's own range, in MHz
        return tuple(actuator.clock_range(device))
    if hasattr(actuator, "time_scale") or not hasattr(actuator, "f_nominal"):
        return SIM_CLOCKS
    raise DvfsError("this DVFS actuator has no clock range the engine can plan with")


def _saved(
    *live: Callable[[], torch.Tensor],
) -> list[tuple[Callable[[], torch.Tensor], torch.Tensor]]:
    """(where each tensor lives, found again when restoring: the window may have moved since;
    its copy now)."""
    return [(where, where().clone()) for where in live]
