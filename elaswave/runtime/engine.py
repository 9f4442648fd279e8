"""The in-worker training engine: the step loop, the step commit, and in-place recovery.

The engine drives one :class:`~elaswave.runtime.strategies.base.Strategy` (replicated data
parallelism, ZeRO-1, or pipeline stages) and never branches on which. One step, on every rank of
the plan:

1. ``begin_step`` — if a newer plan is pending, apply it first (step boundary).
2. ``strategy.compute`` — forward/backward over this rank's share of the fixed global batch's
   micro-batches (global ids from the plan), RNG keyed by (seed, step, micro-batch, layer), loss
   scaled by 1/B; gradients land in the step's sums (``reduce_dtype``), the loss sum and count in
   their tail (float64, :mod:`~elaswave.runtime.strategies.sums`).
3. ``strategy.reduce_update`` — the reduction of the gradients and the tail (it is
   interruptible: if the daemon publishes a plan without one of our peers, we stop waiting at
   once), then the update.
4. ``commit_step`` — rank 0 reports the commit; if any rank had seen a newer plan (the epoch sum
   says so, identically on every rank) everyone switches at this boundary. Then the corruption
   check (:mod:`~elaswave.runtime.integrity.checker`) and the durable checkpoint, when due.

A collective error or interrupt *latches*: the step's partial work is dropped, the worker waits
for the next plan, rebuilds only the groups it must, and ``strategy.sync`` brings every rank to
the resume step (ranks behind — a newcomer, or a rank whose reduction failed — receive the state
from peers, else from a durable checkpoint); the step is redone. Survivors are never restarted.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import torch

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.errors import (
    EXIT_PREEMPTED,
    EXIT_STATE_LOST,
    ShardLost,
    VerdictStop,
)
from elaswave.planning.plan import Plan
from elaswave.planning.stageshards import LayersLost
from elaswave.runtime.checkpointer import Checkpointer
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.comm.control_client import ControlClient
from elaswave.runtime.comm.groups import CommError, Interrupted
from elaswave.runtime.device import backend_for, stages_through_host
from elaswave.runtime.durable.checkpoints import DurableCheckpoints
from elaswave.runtime.durable.restore import DurableSource
from elaswave.runtime.evaluate import evaluate, training_samples
from elaswave.runtime.integrity.checker import Integrity
from elaswave.runtime.integrity.inject import FaultInjector
from elaswave.runtime.integrity.replay import Miscomputed
from elaswave.runtime.nonfinite import NonFiniteSteps
from elaswave.runtime.optim import freed
from elaswave.runtime.prunehook import PruneFactory
from elaswave.runtime.state import RankContext, TrainState
from elaswave.runtime.strategies.base import (
    DP,
    Final,
    Strategy,
    nbytes,
    reduction_buffer,
    state_digests,
    step_sums,
)
from elaswave.runtime.strategies.select import strategy_for
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.telemetry import Telemetry
from elaswave.runtime.timing import DeviceClock, set_clock
from elaswave.runtime.workload.data import MicroBatch, microbatches

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_NO_PLAN = 4
EXIT_SHARD_LOST = EXIT_STATE_LOST  # both copies of a shard or layer are gone, no durable one


class NoPlan(RuntimeError):
    pass


class Stopped(RuntimeError):
    """The daemon asked us to stop (the job is over, or it is shutting down)."""


class PreemptedUnjoined(RuntimeError):
    """This rank's host is preempted before any plan took it: it holds no state to
    checkpoint, and it leaves (the job's members checkpoint the newest step)."""


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    # This rank's forward+backward seconds per micro-batch (a pipeline rank: of its stage's
    # layers only; the leader compares it with ranks that run the same layers). None: it
    # computed nothing.
    compute_per_mb: float | None = None
    skipped: str | None = None  # "nonfinite" | "configured": the step counted, not applied
    preempt: bool = False  # some rank's host is preempted: every rank checkpoints and leaves


class Engine:
    def __init__(
        self,
        cfg: JobConfig,
        control: ControlClient,
        *,
        worker_id: str,
        host_addr: str,
        device: torch.device | None = None,
        state: TrainState | None = None,
        pruning: PruneFactory | None = None,
    ):
        """``state``: what a user's own loop registered (default: the config's workload, with
        the pruning hook ``pruning`` builds)."""
        self.cfg = cfg
        self.control = control
        self.me = worker_id
        t = cfg.train
        torch.set_num_threads(t.threads_per_worker)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL and the caching allocator use the current one
        elif device is not None and device.type == "npu":
            torch.npu.set_device(device)  # type: ignore[attr-defined]  # HCCL, likewise
        if device is not None and device.type != "cpu":
            set_clock(DeviceClock(device))  # compute times wait for the queued compute
            if t.reduce_dtype == "float64":  # the deterministic mode: deterministic kernels
                # where they exist (SDPA's memory-efficient backward sums with atomics else)
                torch.use_deterministic_algorithms(True, warn_only=True)
        self.state = TrainState.build(cfg, device, pruning=pruning) if state is None else state
        self.num_samples = training_samples(len(self.state.dataset), cfg.data.eval_samples)
        # [gradient sums | loss sum, newest epoch seen, a strategy's flag, loss count]
        self.sums = step_sums(self.state, t.reduce_dtype)
        shared = cfg.elastic.workers_per_device  # > 1: workers share devices, gloo via host
        backend = backend_for(self.state.device, shared)
        self.comm = Communicator(
            me=worker_id,
            host_addr=host_addr,
            rendezvous_timeout=cfg.timeouts.rendezvous,
            collective_timeout=cfg.timeouts.collective,
            waker=control.wake_on_message,
            device=self.state.device,
            backend=backend,
            staged=stages_through_host(self.state.device, backend, shared),
        )
        self.ctx = RankContext(
            self.state, cfg, self.comm, worker_id, control.event, control.send, self._enter,
            control.removes_any,
        )  # fmt: skip
        every = cfg.durable_every
        # One writer for the periodic checkpoints and the final state (train.save_final);
        # recovery reads checkpoints only when periodic ones are on.
        store = (
            DurableCheckpoints(cfg.resolved_durable_dir) if every or cfg.train.save_final else None
        )
        self.durable = DurableSource(self.ctx, store if every else None)
        self.strategy: Strategy = strategy_for(self.ctx, self.durable)
        self.checkpoints = Checkpointer(self.ctx, self.strategy, store)
        self.nonfinite = NonFiniteSteps(cfg, control.event, num_samples=self.num_samples)
        self.replan = True  # apply a (newer) plan before the next step
        self.phase, self.phase_since = "idle", time.monotonic()
        self._evaluating = False  # the strategy's "compute" is an evaluation's ("eval")
        self.faults = FaultInjector(
            control, worker_id=worker_id, rank=lambda: self.comm.rank(DP),
            epoch=lambda: self.plan.epoch if self.plan is not None else 0,
            sharded=self.strategy.sharded,
        )  # fmt: skip
        self.ctx.miscomputes = self.faults.miscomputes
        self.integrity = Integrity(self.ctx, self.strategy, self.durable, faults=self.faults)
        self.telemetry = Telemetry(control, worker_id=worker_id, interval=cfg.timeouts.heartbeat)
        self._writer_busy = False  # a checkpoint write ran when this step began
        control.start_heartbeat(cfg.timeouts.heartbeat, self._heartbeat)

    @property
    def store(self) -> DurableCheckpoints | None:
        """Where this rank's durable checkpoints go (None: none is written)."""
        return self.checkpoints.store

    @property
    def plan(self) -> Plan | None:
        """The plan this rank runs (None before the first)."""
        return self.ctx.plan

    def _enter(self, phase: str) -> None:
        """compute | collective | idle, and eval for the compute of an evaluation (the hang
        detector gives it a bound of its own): what the daemon's hang detector sees."""
        if phase == "compute" and self._evaluating:
            phase = "eval"
        self.phase, self.phase_since = phase, time.monotonic()

    def _heartbeat(self) -> wire.Heartbeat:
        return wire.Heartbeat(
            step=self.state.step,
            phase=self.phase,
            phase_age=round(time.monotonic() - self.phase_since, 3),
        )

    # ---- main loop --------------------------------------------------------------------------
    # What ends a step or its recovery: the step is redone under the next plan (a lost peer),
    # or the worker leaves (:meth:`failed` says which).
    FAILURES = (
        CommError, Interrupted, Miscomputed, NoPlan, Stopped, PreemptedUnjoined, ShardLost,
        LayersLost, VerdictStop,
    )  # fmt: skip

    def run(self) -> int:
        total = self.cfg.train.steps
        while self.state.step < total:
            if self.control.stop_requested:
                return EXIT_OK
            during = "recovery"  # what a fault interrupts: the sync before a step, the step
            try:  # (its compute and reduction), or the checks after its commit
                self.begin_step()
                during = "step"
                result = self.train_step(self.state.step + 1)
                during = "checks"
                self.commit_step(result)
                self.after_commit(result.step)
                if result.preempt:
                    return self.leave_preempted()
            except self.FAILURES as exc:
                code = self.failed(exc, during)
                if code is not None:
                    return code
        self._farewell()
        return EXIT_OK

    def failed(self, exc: BaseException, during: str) -> int | None:
        """After one of :attr:`FAILURES` ``during`` recovery, a step or its checks: None when
        the step is redone under the next plan, else the worker's exit code."""
        if isinstance(exc, (CommError, Interrupted, Miscomputed)):
            self.control.event(
                "step_aborted", worker=self.me, step=self.state.step + 1, during=during,
                reason=str(exc)[:300],
            )  # fmt: skip
            # An abandoned collective may still be running and write into its tensor (a peer
            # cut off by a partition is not an error until TCP gives up): redo the step in a
            # fresh buffer, never in the one gloo still holds.
            self.sums = StepSums(torch.zeros_like(self.sums.grads), self.sums.tail.fresh())
            self.replan = True
            return None
        if isinstance(exc, NoPlan):
            log.error("%s", exc)
            return EXIT_NO_PLAN
        if isinstance(exc, Stopped):
            return EXIT_OK
        if isinstance(exc, PreemptedUnjoined):  # a departure for the leader, never respawned
            self.control.event("preempt_left", worker=self.me, signal=str(exc))
            self.control.flush(timeout=5.0)
            return EXIT_PREEMPTED
        if isinstance(exc, VerdictStop):  # every rank alike: the job stops, with the reason
            self.control.event(exc.event, worker=self.me, reason=str(exc))
            log.error("%s", exc)
            return exc.exit_code
        self.control.event("shard_lost", worker=self.me, reason=str(exc))
        log.error("unrecoverable: %s", exc)
        return EXIT_SHARD_LOST

    def begin_step(self) -> None:
        self.integrity.before_step()
        if self.replan:
            self._recover()
            self.integrity.reseal()

    def commit_step(self, result: StepResult) -> None:
        assert self.plan is not None
        # Every rank: the straggler detector's input.
        writing = self._writer_busy or (self.store is not None and self.store.writing())
        self.telemetry.computed(
            result.step, result.compute_per_mb, epoch=self.plan.epoch, writing=writing
        )
        self.strategy.after_commit(result.step)
        if self.comm.rank(DP) == 0:
            self.control.send(
                wire.Commit(
                    step=result.step,
                    loss=result.loss,
                    epoch=self.plan.epoch,
                    world=self.plan.world_size,
                    samples=result.step * self.cfg.train.global_batch,
                    t=time.time(),
                    step_seconds=result.seconds,
                    lr=self.state.opt.hyper.lr_at(result.step),
                    grad_norm=self.state.last_grad_norm,  # None unless measured
                    prune=dict(self.state.prune.last) if self.state.prune is not None else {},
                    skipped=result.skipped,
                )
            )

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """Compute, reduce and update through the strategy; faults fire at their phases."""
        every, sums, start = self.prepare_step(step)
        per_mb = self.strategy.compute(step, every, sums, slowdown=self.faults.slowdown(step))
        return self.reduce_step(step, sums, start, per_mb=per_mb)

    def prepare_step(self, step: int) -> tuple[list[MicroBatch], StepSums, float]:
        """Before a step's compute: its micro-batches, its zeroed sums and its start time."""
        assert self.plan is not None
        start = time.perf_counter()
        self._writer_busy = self.store is not None and self.store.writing()
        self.strategy.before_step()  # a pipeline rank may change which layers it allocates
        t, n = self.cfg.train, self.state.flat.numel
        sums = self.sums
        if sums.grads.numel() != n or freed(sums.grads):  # ZeRO-3 stages free it
            sums.grads = reduction_buffer(self.state, t.reduce_dtype)
        elif not self.strategy.fills_gradients:
            sums.grads.zero_()
        sums.tail.zero()
        self._enter("compute")
        self.faults.fire(step, "forward")
        every = microbatches(
            t.seed,
            step,
            t.global_batch,
            micro_batch_size=t.micro_batch_size,
            num_samples=self.num_samples,
        )
        return every, sums, start

    def reduce_step(
        self, step: int, sums: StepSums, start: float, *, per_mb: float | None
    ) -> StepResult:
        """After a step's compute: the reduction and the update (the step is applied when this
        returns; a lost peer raises)."""
        plan = self.plan
        assert plan is not None
        self.state.tie_gradients(sums.grads)
        sums.tail.epoch = self.control.latest_epoch
        self.faults.fire(step, "reduce")
        mine = self.strategy.local_gradient(sums)
        self.faults.poison(step, sums.tail.values[sums.tail.LOSS : sums.tail.LOSS + 1], mine)
        sums.tail.preempt = self.control.preempt_requested is not None
        configured = step in self.cfg.train.skip_steps
        bad = sums.tail.judge(mine, skip=configured)  # this rank's own values (no host sync)
        # which micro-batches this rank holds, before the reduction forgets them (the norm
        # statistics' rows; a non-finite step's record names them)
        covered = self.strategy.covered(step) if self.state.stats is not None else {}
        self._enter("collective")
        stats, rows = self.state.stats, None
        if stats is not None:  # each micro-batch's norm statistics, from the rank that ran it
            rows = stats.contribution(step, covered)
            self.comm.allreduce(DP, rows, self.ctx.broken)
        try:
            epochs = self.strategy.reduce_update(
                step, sums, self.ctx.broken,
                before_update=lambda: self.faults.fire(step, "optimizer"),
            )  # fmt: skip
        finally:
            if not configured and bool(bad):  # read once the reduction is on its way
                self.nonfinite.name(step, covered, rank=self.comm.rank(DP), plan=plan)
        skipped = None
        if sums.tail.nonfinite:  # not applied, on every rank
            skipped = self.nonfinite.not_applied(
                step, sums.tail.nonfinite, configured=configured,
                reporter=self.comm.rank(DP) == 0, loss=self.state.last_loss,
            )  # fmt: skip
        elif stats is not None and rows is not None:  # applied: fold them in (rows iff stats)
            stats.commit(step, rows)
        if skipped is None:
            self.nonfinite.applied()
        self._enter("idle")
        if epochs != plan.world_size * plan.epoch:
            self.replan = True  # some rank has seen a newer plan: switch at this boundary
        seconds = time.perf_counter() - start
        return StepResult(
            step, self.state.last_loss, seconds, per_mb, skipped=skipped,
            preempt=bool(sums.tail.preempt),
        )  # fmt: skip

    def leave_preempted(self) -> int:
        """Some rank's host is being preempted, and every rank read it in the same step's tail:
        every rank checkpoints the newest committed step durably (unless the periodic
        checkpoint just did), waits for it to be on disk, and leaves with
        :data:`EXIT_PREEMPTED`. Launching the job again resumes from it: no step is lost."""
        step, every = self.state.step, self.cfg.durable_every
        store = self.checkpoints.ensure_store()  # owed whatever durable_every says
        if not (self.durable.checkpoints is not None and step % every == 0):
            self.checkpoints.checkpoint(step, "preempt_saved")
        store.flush()
        self.control.event(
            "preempted", worker=self.me, rank=self.comm.rank(DP), step=step,
            signal=self.control.preempt_requested,
        )  # fmt: skip
        self.control.flush(timeout=5.0)
        return EXIT_PREEMPTED

    def after_commit(self, step: int) -> None:
        """Corruption checks (they may roll every rank back), then the durable checkpoint, then
        the held-out evaluation, when due. Before them, under each plan and whenever it changed
        (a pipeline rank frees the layers it gave away): what this rank holds."""
        assert self.plan is not None
        self.telemetry.memory(self.plan.epoch, self.memory())
        if self.integrity.after_commit(step):
            return  # the main loop redoes the steps since the known-good state
        if self.durable.checkpoints is not None and step % self.cfg.durable_every == 0:
            self.checkpoints.checkpoint(step, "durable_saved")
        if self.cfg.train.eval_every and step % self.cfg.train.eval_every == 0:
            self._evaluating = True
            try:
                self._enter("compute")
                loss, samples, accuracy = evaluate(self.ctx, self.strategy, self.ctx.broken)
            finally:
                self._evaluating = False
            self._enter("idle")
            if self.comm.rank(DP) == 0:
                self.control.send(
                    wire.Eval(
                        step=step, loss=loss, samples=samples, t=time.time(), accuracy=accuracy
                    )
                )

    # ---- recovery ---------------------------------------------------------------------------
    def _recover(self) -> None:
        """Apply the newest plan that includes us; retry while newer plans supersede it."""
        while True:
            self._enter("idle")
            plan = self._await_plan()
            if self.plan is not None:
                self.faults.fire(self.state.step + 1, "recovery")  # a fault while re-planning
            self._enter("collective")
            try:
                self._apply(plan)
                self._enter("idle")
                self.replan = False
                return
            except (CommError, Interrupted) as exc:
                self.control.event(
                    "recovery_retry", worker=self.me, epoch=plan.epoch, reason=str(exc)[:300]
                )
                self.comm.mark_broken()

    def _await_plan(self) -> Plan:
        """The newest plan that contains us and is newer than the one we run (if any)."""
        current = self.plan.epoch if self.plan else 0

        def ready() -> bool:
            p = self.control.latest_plan
            return p is not None and p.epoch > current and self.me in p.workers

        def unjoined_preempted() -> bool:  # a member waits: its state is the checkpoint's
            return self.plan is None and self.control.preempt_requested is not None

        timeout = self.cfg.timeouts.plan_wait if self.plan else self.cfg.timeouts.rendezvous * 10
        if not self.control.wait_for(
            lambda: ready() or self.control.stop_requested or unjoined_preempted(), timeout
        ):
            raise NoPlan(f"no plan newer than epoch {current} within {timeout:g}s")
        if self.control.stop_requested:
            raise Stopped("stop requested by the daemon")
        if not ready() and unjoined_preempted():
            raise PreemptedUnjoined(self.control.preempt_requested)
        plan = self.control.latest_plan
        assert plan is not None
        return plan

    def _apply(self, plan: Plan) -> None:
        """Rebuild the groups the plan changes, sync the state through the strategy, adopt."""

        def newer() -> bool:
            return self.control.latest_epoch > plan.epoch or self.control.stop_requested

        groups = self.strategy.groups(plan)
        stats = self.comm.configure(groups, store=plan.store, epoch=plan.epoch, abort=newer)
        rank = self.comm.rank(DP)
        self.control.event(
            "comm_rebuilt",
            worker=self.me,
            rank=rank,
            epoch=plan.epoch,
            rebuilt=stats.rebuilt,
            kept=stats.kept,
            dropped=stats.dropped,
            seconds=round(stats.seconds, 6),
            backend=self.comm.backend,
            **({"staged": True} if self.comm.staged else {}),  # gloo through host memory
            **(
                {
                    "shrunk": stats.shrunk,  # in place, instead of aborted and rebuilt
                    "shrink_seconds": round(stats.shrink_seconds, 6),
                    "abort_seconds": round(stats.abort_seconds, 6),
                }
                if self.comm.backend != "gloo"
                else {}
            ),
        )
        broken = lambda: self.control.removes_any(plan.workers)  # noqa: E731
        start = time.perf_counter()
        sync = self.strategy.sync(plan, broken)
        if self.state.prune is not None:  # the redundant set, to a newcomer
            prune = self.state.prune.share(
                self.comm, self.state.step, broken, device=self.state.device
            )
            sync["prune_partition_step"] = prune
        if self.state.stats is not None:  # the running statistics, to a newcomer
            sync["stats_source_rank"] = self.state.stats.share(self.comm, self.state.step, broken)
        if self.state.script is not None:  # a script's own state, to a newcomer
            sync["script_state_source_rank"] = self.state.script.share(
                self.comm, self.state.step, broken
            )
        self.control.event(
            "state_synced",
            worker=self.me,
            rank=rank,
            epoch=plan.epoch,
            seconds=round(time.perf_counter() - start, 6),
            **sync,
        )
        self.ctx.plan = plan
        self.strategy.after_apply(plan)
        self.integrity.after_apply()
        if rank == 0 and self.state.step > 0 and "durable" not in sync:
            # Re-report the resume step: if the previous rank 0 died before reporting it, this is
            # its only record (the daemon drops duplicates). A step restored from a durable
            # checkpoint was committed by an earlier run or is about to be recomputed: not here.
            self.commit_step(StepResult(self.state.step, self.state.last_loss, 0.0))

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds by purpose (the strategy's, plus the step's reduction buffer
        as gradient bytes and the known-good state ``verify_every`` keeps for a rollback)."""
        out = self.strategy.memory()
        out["grad_bytes"] += nbytes(self.sums.grads)
        out["verify_bytes"] = self.integrity.good_bytes
        return out

    def close(self) -> None:
        """Before the process exits: wait for this rank's checkpoint writes (a stop may come
        while one runs in the background; a finished run flushed them already)."""
        if self.store is not None:
            self.store.flush(commits=False)

    def _farewell(self) -> None:
        """Final best-effort barrier so no rank exits while a peer still reads its last bytes."""
        if self.plan is None:
            return
        try:  # the whole state compares across ranks (pipelines: assembled from the stages)
            final = self.strategy.final(self.ctx.broken)
            every = self.cfg.durable_every
            if self.cfg.train.save_final and not (every and self.state.step % every == 0):
                self.checkpoints.save_final(final)  # export reads it
            token = self.state.flat.data.new_zeros(1)
            self.comm.allreduce(DP, token, self.ctx.broken)
        except (CommError, Interrupted):  # what this rank holds, then
            final = Final(*state_digests(self.strategy.held_here()), {})
        if self.store is not None:
            self.store.flush()  # the last checkpoint is on disk before "done"
        self.control.event(
            "final_state",
            worker=self.me,
            rank=self.comm.rank(DP),
            step=self.state.step,
            pid=os.getpid(),
            params_sha256=final.params_sha256,
            state_sha256=final.state_sha256,
            **final.checks,
            **self.state.side_digests(),
        )
        self.control.send(wire.Done(step=self.state.step, worker_id=self.me))
