"""The in-worker training engine: step loop, step commit, and in-place recovery.

One step, on every rank of the plan's data-parallel group:

1. ``begin_step`` — if a newer plan is pending, apply it first (step boundary).
2. Forward/backward over this rank's micro-batches (global ids from the plan), each with RNG
   keyed by (seed, step, micro-batch), loss scaled by 1/B; gradients summed in ``reduce_dtype``.
3. One SUM all-reduce of [gradients | loss sum | newest epoch seen]. It is interruptible: if the
   daemon publishes a plan without one of our peers, we stop waiting at once.
4. ``commit_step`` — optimizer update; rank 0 reports the commit; if any rank had seen a newer plan
   (the epoch sum says so, identically on every rank) everyone switches at this boundary.

A collective error or interrupt *latches*: the step's partial work is dropped, the worker waits
for the next plan, rebuilds only the groups it must, agrees with its peers on the resume step
(ranks behind — a newcomer, or a rank whose reduction failed — receive the state from the most
advanced one) and redoes the step. Survivors are never restarted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.errors import EXIT_STATE_LOST
from elaswave.planning.plan import Plan
from elaswave.planning.shards import ShardLayout
from elaswave.planning.stageshards import LayersLost
from elaswave.runtime.comm.communicator import CommError, Communicator, Interrupted
from elaswave.runtime.comm.control_client import ControlClient
from elaswave.runtime.durable import checkpoints as durable
from elaswave.runtime.integrity import stageverify
from elaswave.runtime.integrity.inject import FaultInjector
from elaswave.runtime.integrity.rollback import NONE, KnownGood, rollback_verdict
from elaswave.runtime.integrity.verify import flip_bit, judge
from elaswave.runtime.state import RankContext, TrainState
from elaswave.runtime.strategies.pipeline.stage import MIG, Pipeline
from elaswave.runtime.strategies.zero import (
    ShardLost,
    ZeroState,
    digest,
    fast_checksum,
    host_bytes,
)
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.data import microbatches

log = logging.getLogger(__name__)

DP = "dp"
EXIT_OK = 0
EXIT_NO_PLAN = 4
EXIT_SHARD_LOST = EXIT_STATE_LOST  # both copies of a shard or layer are gone, no durable one


class NoPlan(RuntimeError):
    pass


class Stopped(RuntimeError):
    """The daemon asked us to stop (the job is over, or it is shutting down)."""


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    # This rank's forward+backward seconds per micro-batch (a pipeline rank: of its stage's
    # layers only; the leader compares it with ranks that run the same layers). None: it
    # computed nothing.
    compute_per_mb: float | None = None


class Engine:
    def __init__(self, cfg: JobConfig, control: ControlClient, *, worker_id: str, host_addr: str):
        self.cfg = cfg
        self.control = control
        self.me = worker_id
        t = cfg.train
        torch.set_num_threads(t.threads_per_worker)
        self.state = TrainState.build(cfg)
        st = self.state
        self.zero: ZeroState | None = None
        if cfg.zero and cfg.pp == 1:  # the shards live in ``self.zero``; with pipelines, in
            self.zero = ZeroState(st.flat, st.opt.hyper, st.segments)  # ``self.pipe.store``
            self.zero.snapshot_every = cfg.snapshot_every
        self.durable = (
            durable.DurableCheckpoints(cfg.resolved_durable_dir) if cfg.durable_every else None
        )
        self.num_samples = len(st.dataset)
        dtype = torch.float64 if t.reduce_dtype == "float64" else torch.float32
        # [gradients | loss sum | newest epoch seen | pipeline: migrations ready]
        self.buffer = torch.zeros(self.state.flat.numel + 3, dtype=dtype)
        self.comm = Communicator(
            me=worker_id,
            host_addr=host_addr,
            rendezvous_timeout=cfg.timeouts.rendezvous,
            collective_timeout=cfg.timeouts.collective,
            waker=control.wake_on_message,
        )
        self.ctx = RankContext(st, cfg, self.comm, control.event, self._enter)
        self.pipe = Pipeline(self.ctx) if cfg.pp > 1 else None
        self.replan = True  # apply a (newer) plan before the next step
        self.phase, self.phase_since = "idle", time.monotonic()
        self.faults = FaultInjector(
            control, worker_id=worker_id, rank=lambda: self.comm.rank(DP),
            sharded=bool(cfg.zero),  # ZeRO, alone or inside stages: an optimizer phase
        )  # fmt: skip
        # Silent corruption (see rollback.py): the whole state after the last clean check, the
        # CRC of the parameters as last committed, and whether they changed at rest since.
        self.good: KnownGood | None = None
        self._seal: int | None = None
        self._tainted = False
        control.start_heartbeat(cfg.timeouts.heartbeat, self._heartbeat)

    @property
    def plan(self) -> Plan | None:
        """The plan this rank runs (None before the first)."""
        return self.ctx.plan

    def _enter(self, phase: str) -> None:
        """compute | collective | idle: what the daemon's hang detector sees."""
        self.phase, self.phase_since = phase, time.monotonic()

    def _heartbeat(self) -> dict[str, object]:
        return {
            "step": self.state.step,
            "phase": self.phase,
            "phase_age": round(time.monotonic() - self.phase_since, 3),
        }

    # ---- main loop --------------------------------------------------------------------------
    def run(self) -> int:
        total = self.cfg.train.steps
        while self.state.step < total:
            if self.control.stop_requested:
                return EXIT_OK
            try:
                self.begin_step()
                result = self.train_step(self.state.step + 1)
                self.commit_step(result)
                self._after_commit(result.step)
            except (CommError, Interrupted) as exc:
                self.control.event(
                    "step_aborted", worker=self.me, step=self.state.step + 1, reason=str(exc)[:300]
                )
                # An abandoned collective may still be running and write into its tensor (a
                # peer cut off by a partition is not an error until TCP gives up): redo the
                # step in a fresh buffer, never in the one gloo still holds.
                self.buffer = torch.zeros_like(self.buffer)
                self.replan = True
            except NoPlan as exc:
                log.error("%s", exc)
                return EXIT_NO_PLAN
            except Stopped:
                return EXIT_OK
            except (ShardLost, LayersLost) as exc:
                self.control.event("shard_lost", worker=self.me, reason=str(exc))
                log.error("unrecoverable: %s", exc)
                return EXIT_SHARD_LOST
        self._farewell()
        return EXIT_OK

    def begin_step(self) -> None:
        if self._seal_broken():
            self._tainted = True  # changed at rest: the next check rolls everyone back
        if self.replan:
            self._recover()
            self._reseal()

    def commit_step(self, result: StepResult) -> None:
        assert self.plan is not None
        if result.compute_per_mb is not None:  # every rank: the straggler detector's input
            self.control.send(
                {
                    "type": "compute",
                    "step": result.step,
                    "epoch": self.plan.epoch,
                    "per_mb": result.compute_per_mb,
                }
            )
        if self.pipe is not None and self.cfg.layer_costs == "online":
            self._report_layer_costs(result.step)
        if self.comm.rank(DP) == 0:
            self.control.send(
                {
                    "type": "commit",
                    "step": result.step,
                    "loss": result.loss,
                    "epoch": self.plan.epoch,
                    "world": self.plan.world_size,
                    "samples": result.step * self.cfg.train.global_batch,
                    "step_seconds": result.seconds,
                    "t": time.time(),
                }
            )

    def _report_layer_costs(self, step: int) -> None:
        """Every ``cost_every`` committed steps: this stage's measured seconds per layer, for the
        leader's next plan (``layer_costs: online``)."""
        assert self.pipe is not None and self.plan is not None
        if step % self.cfg.cost_every:
            return
        seconds = self.pipe.timer.snapshot()
        if seconds:
            self.control.send(
                {
                    "type": "layer_costs",
                    "step": step,
                    "epoch": self.plan.epoch,
                    "layer_seconds": {str(i): x for i, x in seconds.items()},
                }
            )

    # ---- one step ---------------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        assert self.plan is not None
        start, mark = time.perf_counter(), busy_mark()
        t = self.cfg.train
        plan, rank = self.plan, self.comm.rank(DP)
        n = self.state.flat.numel
        buf = self.buffer
        buf.zero_()
        self._enter("compute")
        self.faults.fire(step, "forward")
        every = microbatches(t.seed, step, t.global_batch, t.micro_batch_size, self.num_samples)
        if self.pipe is not None:
            return self._pipeline_step(step, every, start)
        mine = plan.microbatch_range(rank)
        slow = self.faults.slowdown(step) * plan.world_size / len(every)  # per micro-batch
        for mb in (every[i] for i in mine):
            inputs, targets = self.state.microbatch(mb.sample_ids)
            loss = self.state.loss(
                self.state.model(inputs, step, mb.id), targets, len(mb.sample_ids)
            )
            (loss / t.global_batch).backward()
            if t.device_time:
                time.sleep(t.device_time)  # emulated accelerator time (benchmarks)
            grad = self.state.flat.collect_grads()
            buf[:n].add_(grad)
            buf[n] += loss.item()
            grad.zero_()
            if slow:
                time.sleep(slow)
        # Time this rank needed, without the time its thread sat waiting for a CPU: on a shared
        # host that measures the neighbours, not this rank (sleeps and stalls still count).
        per_mb = busy_since(mark) / max(len(mine), 1)
        buf[n + 1] = self.control.latest_epoch
        self.faults.fire(step, "reduce")
        self._enter("collective")
        if self.zero is not None:
            return self._finish_zero_step(step, buf, start, per_mb)
        self.comm.allreduce(DP, buf, self._group_broken)
        self._enter("compute")
        # -- the reduction succeeded: every rank now holds the identical full-batch gradient.
        grad = buf[:n] if buf.dtype == torch.float32 else buf[:n].to(torch.float32)
        self.state.opt.step(self.state.flat.data, grad)
        self.state.step = step
        self.state.last_loss = float(buf[n]) / t.global_batch
        self._enter("idle")
        if int(round(float(buf[n + 1]))) != plan.world_size * plan.epoch:
            self.replan = True  # some rank has seen a newer plan: switch at this boundary
        return StepResult(step, self.state.last_loss, time.perf_counter() - start, per_mb)

    def _pipeline_step(self, step: int, every: list[Any], start: float) -> StepResult:
        """One 1F1B step of this rank's stage, then the all-reduce of every layer's gradient."""
        pipe, buf, n, t = self.pipe, self.buffer, self.state.flat.numel, self.cfg.train
        assert pipe is not None and self.plan is not None
        self.state.flat.grad.zero_()
        slow = self.faults.slowdown(step) * len(self.plan.replicas) / len(every)  # per micro-batch
        per_mb = pipe.run_step(step, buf, every, self._group_broken, slow=slow)
        buf[n + 1] = self.control.latest_epoch
        buf[n + 2] = pipe.ready_flag
        self.faults.fire(step, "reduce")
        self._enter("collective")
        self.comm.allreduce(DP, buf, self._group_broken)
        self._enter("compute")
        grad = buf[:n] if buf.dtype == torch.float32 else buf[:n].to(torch.float32)
        pipe.update(step, grad, self._group_broken, lambda: self.faults.fire(step, "optimizer"))
        self.state.step = step
        self.state.last_loss = float(buf[n]) / t.global_batch
        switched = pipe.after_step(step, float(buf[n + 2]))
        if switched is not None:
            if self.comm.rank(DP) == 0:
                self.control.event("migration_done", epoch=self.plan.epoch, **switched)
            self._set_clocks()
        self._enter("idle")
        if int(round(float(buf[n + 1]))) != self.plan.world_size * self.plan.epoch:
            self.replan = True
        return StepResult(step, self.state.last_loss, time.perf_counter() - start, per_mb)

    def _set_clocks(self) -> None:
        assert self.pipe is not None and self.plan is not None
        clocks = self.pipe.set_clocks()
        if clocks is not None:
            self.control.event("dvfs_applied", epoch=self.plan.epoch, worker=self.me, **clocks)

    def _finish_zero_step(
        self, step: int, buf: torch.Tensor, start: float, per_mb: float
    ) -> StepResult:
        """ZeRO-1: stage the shard update, replicate it, then the commit barrier."""
        z = self.zero
        assert z is not None
        t, n = self.cfg.train, self.state.flat.numel
        z.stage(
            self.comm,
            buf[:n],
            step,
            self._group_broken,
            before_update=lambda: self.faults.fire(step, "optimizer"),
        )
        assert z.staged is not None
        z.staged.reached_barrier = True
        tail = buf[n:].to(torch.float64)
        self.comm.allreduce(DP, tail, self._group_broken)
        self.state.last_loss = float(tail[0]) / t.global_batch
        z.commit(self.state.last_loss)  # every rank staged (and replicated) this step: committed
        self.state.step = step
        assert self.plan is not None
        if int(round(float(tail[1]))) != self.plan.world_size * self.plan.epoch:
            self.replan = True
        self._enter("idle")
        return StepResult(step, self.state.last_loss, time.perf_counter() - start, per_mb)

    def _group_broken(self) -> bool:
        return self.plan is not None and self.control.removes_any(self.plan.workers)

    def _after_commit(self, step: int) -> None:
        """Silent-corruption faults land on committed state; verification looks for them."""
        self._reseal()
        self.faults.corrupt(step, self._corrupt)
        every = self.cfg.verify_every
        if every and step % every == 0:
            self._enter("collective")
            tainted = self._tainted or self._seal_broken()  # before a repair rewrites anything
            found = self._verify_stages(step) if self.pipe is not None else self._verify(step)
            rolled_back = self._settle_check(step, found, tainted)
            self._enter("idle")
            if rolled_back:
                return  # the main loop redoes the steps since the known-good state
        if self.durable is not None and step % self.cfg.durable_every == 0:
            self._enter("collective")
            self._save_durable(step)
            self._enter("idle")

    def _save_durable(self, step: int) -> None:
        """Rank 0 writes the full state in the background (ZeRO gathers the moments first,
        pipelines assemble the whole model from the stages)."""
        assert self.durable is not None
        params = self.state.flat.data
        if self.pipe is not None:
            whole, _ = self.pipe.assemble(self._group_broken)
            params, exp_avg, exp_avg_sq = whole.chunk(3)
        else:
            exp_avg, exp_avg_sq = self._whole_moments()
        if self.comm.rank(DP) != 0:
            return

        def saved(path: Path, seconds: float) -> None:
            self.control.event(
                "durable_saved", step=step, path=str(path), seconds=round(seconds, 4)
            )

        self.durable.save_async(step, self.state.last_loss, params, exp_avg, exp_avg_sq, saved)

    def _whole_moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Adam's moments for the whole model: replicated, or all-gathered from the shards."""
        if self.zero is not None:
            return self.zero.full_state(self.comm, self._group_broken)
        return self.state.opt.exp_avg, self.state.opt.exp_avg_sq

    def _start_over(self, plan: Plan, broken: Callable[[], bool]) -> tuple[Path, int, str] | None:
        """Where a plan whose ranks all hold no state starts (every rank calls it together):
        ``--resume``'s checkpoint; for a job that has committed steps, its newest durable
        checkpoint; ``None`` for a new job (step 0). Never step 0 once the job has committed
        steps: with no checkpoint the state is lost, and the job stops saying so."""
        if self.cfg.resume:
            return self._resume_path(), 0, "resume"
        if not plan.committed:
            return None
        why = f"every worker holding the job's state is gone (step {plan.committed} committed)"
        chosen = self._newest_durable(broken)
        if not chosen:
            raise ShardLost(
                f"{why} and there is no durable checkpoint: the job will not start over from "
                "step 0 (configure durable_every to fall back to one)"
            )
        return Path(chosen), plan.committed, why

    def _restore(
        self, plan: Plan, broken: Callable[[], bool], path: Path, lost_from: int, reason: str
    ) -> dict[str, Any]:
        """Load a durable checkpoint into this rank (any world size) and report it."""
        state = self._load_durable(path, lost_from, reason)
        self._adopt_whole(state, plan, broken)
        return {"resume_step": state.step, "source_rank": -1, "bytes": 0, "durable": str(path)}

    def _adopt_whole(
        self, state: durable.DurableState, plan: Plan, broken: Callable[[], bool]
    ) -> None:
        """Take the whole training state (a durable checkpoint, the known-good state) into this
        rank: data parallelism keeps all of it, ZeRO its shard in a fresh even layout."""
        self.state.flat.data.copy_(state.params)
        if self.zero is not None:
            self.zero.restore_full(
                self.comm, plan.workers, self.comm.rank(DP), state.step,
                state.exp_avg, state.exp_avg_sq, plan.epoch, broken, plan.hosts, state.loss,
            )  # fmt: skip
        else:
            self.state.opt.exp_avg.copy_(state.exp_avg)
            self.state.opt.exp_avg_sq.copy_(state.exp_avg_sq)
            self.state.opt.step_count = state.step
        self.state.step, self.state.last_loss = state.step, state.loss

    def _load_durable(self, path: Path, lost_from: int, reason: str) -> durable.DurableState:
        """Read a durable checkpoint (every rank reads all of it) and report the restore."""
        state = durable.load(path, self.state.flat.numel)
        if self.comm.rank(DP) == 0:
            self.control.event(
                "durable_restored",
                path=str(path),
                step=state.step,
                recomputed_steps=max(0, lost_from - state.step),
                reason=reason,
            )
        return state

    def _corrupt(self, target: str, step: int) -> str:
        z = self.zero
        pipe = self.pipe
        if pipe is not None and pipe.held:  # a pipeline stage: what this rank keeps current
            held = pipe.span(pipe.held)
            if target != "snapshot":
                tensor, name = self.state.flat.data[held], "parameters"
            elif pipe.zero:
                tensor, name = pipe.store.exp_avg, "optimizer state (exp_avg)"
            else:
                tensor, name = self.state.opt.exp_avg[held], "optimizer state (exp_avg)"
        elif target == "snapshot" and z is not None and z.own is not None:
            tensor, name = z.corrupt_target()
        elif target == "snapshot":
            tensor, name = self.state.opt.exp_avg, "optimizer state (exp_avg)"
        else:
            tensor, name = self.state.flat.data, "parameters"
        index = (step * 7919) % tensor.numel()
        flip_bit(tensor, index)
        return f"{name}[{index}]"

    def _verify(self, step: int) -> bool:
        """Compare checksums of replicated data across ranks; repair any disagreeing copy.
        True when something was found."""
        broken = self._group_broken
        z = self.zero
        parts = (
            [self.state.flat.data]
            if z
            else [self.state.flat.data, self.state.opt.exp_avg, self.state.opt.exp_avg_sq]
        )
        own_ok = z is None or z.verify_own()
        replica_ok = z is None or z.verify_replicas()
        mine = torch.tensor([digest(*parts), int(own_ok), int(replica_ok)], dtype=torch.int64)
        rows = [r.tolist() for r in self.comm.allgather(DP, mine, broken)]
        verdict = judge([r[0] for r in rows])
        workers = self.plan.workers if self.plan else ()
        say = self.control.event if self.comm.rank(DP) == 0 else (lambda *a, **k: None)
        if verdict.bad:
            say(
                "sdc_detected",
                step=step,
                what="replicated state",
                ranks=list(verdict.bad),
                workers=[workers[r] for r in verdict.bad],
                source_rank=verdict.source,
                tie=verdict.unanimous_loss,
            )
            for part in parts:
                self.comm.broadcast(DP, part, verdict.source, broken)
            say("sdc_repaired", step=step, what="replicated state")
        if z is not None:
            bad_own = [r for r, row in enumerate(rows) if not row[1]]
            bad_replica = [r for r, row in enumerate(rows) if not row[2]]
            if bad_own or bad_replica:
                names = [workers[r] for r in bad_own + bad_replica]
                say(
                    "sdc_detected", step=step, what="zero shard copy",
                    ranks=bad_own + bad_replica, workers=names,
                )  # fmt: skip
                z.repair(self.comm, bad_own, bad_replica, broken)
                say("sdc_repaired", step=step, what="zero shard copy")
                return True
        return bool(verdict.bad)

    def _verify_stages(self, step: int) -> bool:
        """Pipelines: every layer's and moment part's copies compared, bad ones repaired."""
        assert self.pipe is not None and self.plan is not None
        findings = stageverify.verify(self.pipe, step, self._group_broken)
        if self.comm.rank(DP) != 0:
            return bool(findings)
        workers = self.plan.workers
        for f in findings:
            named = [workers[r] for r in f["ranks"]]
            self.control.event("sdc_detected", step=step, workers=named, **f)
            if f["source_rank"] is not None:
                self.control.event("sdc_repaired", step=step, what=f["what"], ranks=f["ranks"])
        return bool(findings)

    # ---- silent corruption: the seal, the known-good state, the rollback ---------------------
    def _rest_checksum(self) -> int:
        """CRC of the parameters this rank computes with (a pipeline stage: its held layers)."""
        if self.pipe is not None:
            held = self.pipe.span(self.pipe.held) if self.pipe.held else slice(0, 0)
            return fast_checksum(self.state.flat.data[held])
        return fast_checksum(self.state.flat.data)

    def _seal_broken(self) -> bool:
        return self._seal is not None and self._rest_checksum() != self._seal

    def _reseal(self) -> None:
        if self.cfg.verify_every and self.plan is not None:
            self._seal = self._rest_checksum()

    def _settle_check(self, step: int, found: bool, tainted: bool) -> bool:
        """After a check at ``step`` (``found``: copies disagreed on some rank; ``tainted``: this
        rank's parameters changed at rest): keep the state as known good when every rank is
        clean; otherwise roll every rank back to the known-good state (True) so that the steps
        since are redone."""
        assert self.plan is not None
        broken = self._group_broken
        good = self.good.step if self.good is not None else NONE
        mine = torch.tensor([int(tainted), int(found), good], dtype=torch.int64)
        rows = [r.tolist() for r in self.comm.allgather(DP, mine, broken)]
        hit = [r for r, row in enumerate(rows) if row[0]]
        rank0 = self.comm.rank(DP) == 0
        found_any = any(row[1] for row in rows)
        if hit and rank0 and not found_any:  # only the seal saw it (the copies agree again)
            self.control.event(
                "sdc_detected", step=step, what="parameters changed at rest", ranks=hit,
                workers=[self.plan.workers[r] for r in hit], source_rank=None,
            )  # fmt: skip
        if not hit and not found_any:
            self._capture_good(step)
            return False
        verdict = rollback_verdict([row[2] for row in rows], step)
        if verdict.target is None:
            if rank0:  # the in-place repair stands; the steps since the flip keep its trace
                self.control.event("sdc_not_rolled_back", step=step, reason=verdict.reason)
            self._tainted = False
            self._reseal()
            return False
        assert verdict.source is not None
        self._roll_back(step, verdict.target, verdict.source, [row[2] for row in rows])
        return True

    def _capture_good(self, step: int) -> None:
        """Every rank keeps the whole state of ``step`` (a collective: ZeRO gathers the moments,
        pipelines assemble the layers)."""
        if self.pipe is not None:
            whole, _ = self.pipe.assemble(self._group_broken)
        else:
            exp_avg, exp_avg_sq = self._whole_moments()
            whole = torch.cat([self.state.flat.data, exp_avg, exp_avg_sq])  # a copy
        self.good = KnownGood(step, self.state.last_loss, whole)
        self._tainted = False

    def _roll_back(self, step: int, target: int, source: int, kept: list[int]) -> None:
        """Every rank restores the known-good state of ``target``; steps ``target + 1 .. step``
        are redone by the main loop."""
        assert self.plan is not None
        broken, start = self._group_broken, time.perf_counter()
        if any(k != target for k in kept):  # newcomers receive it from a rank that keeps it
            n = self.state.flat.numel
            meta = torch.tensor([float(target), math.nan], dtype=torch.float64)
            whole = torch.empty(3 * n)
            if self.good is not None and self.good.step == target:
                meta[1], whole = self.good.loss, self.good.whole
            self.comm.broadcast(DP, meta, source, broken)
            self.comm.broadcast(DP, whole, source, broken)
            self.good = KnownGood(target, float(meta[1]), whole)
        assert self.good is not None
        params, exp_avg, exp_avg_sq = self.good.parts()
        state = durable.DurableState(
            target, self.good.loss, params, exp_avg, exp_avg_sq, Path(f"known-good@{target}")
        )
        if self.pipe is not None:
            if self.pipe.migration is not None:
                self.comm.mark_broken()  # its posted messages are void: fresh groups next plan
            self.pipe.restore_whole(self.plan, state)
            stageverify.record(self.pipe, target)  # what the next check compares with
        else:
            self._adopt_whole(state, self.plan, broken)
        self._tainted = False
        self._reseal()
        if self.comm.rank(DP) != 0:
            return
        if self.durable is not None:
            self.durable.discard_after(target)  # saved from a state the check did not pass
        self.control.event(
            "sdc_rolled_back", step=step, to_step=target, redone_steps=step - target,
            seconds=round(time.perf_counter() - start, 6),
        )  # fmt: skip
        self.control.send({"type": "rollback", "step": target})

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

        timeout = self.cfg.timeouts.plan_wait if self.plan else self.cfg.timeouts.rendezvous * 10
        if not self.control.wait_for(lambda: ready() or self.control.stop_requested, timeout):
            raise NoPlan(f"no plan newer than epoch {current} within {timeout:g}s")
        if self.control.stop_requested:
            raise Stopped("stop requested by the daemon")
        plan = self.control.latest_plan
        assert plan is not None
        return plan

    def _apply(self, plan: Plan) -> None:
        def newer() -> bool:
            return self.control.latest_epoch > plan.epoch or self.control.stop_requested

        groups = {DP: plan.workers}
        if self.pipe is not None:
            groups[MIG] = plan.workers  # asynchronous migrations run beside the training group
        stats = self.comm.configure(groups, store=plan.store, epoch=plan.epoch, abort=newer)
        rank = self.comm.rank(DP)
        self.control.event(
            "comm_rebuilt",
            worker=self.me,
            rank=rank,
            epoch=plan.epoch,
            rebuilt=stats.rebuilt,
            kept=stats.kept,
            seconds=round(stats.seconds, 6),
        )
        broken = lambda: self.control.removes_any(plan.workers)  # noqa: E731
        start = time.perf_counter()
        if self.pipe is not None:
            sync = self._sync_pipeline(plan, broken)
        elif self.zero is None:
            sync = self._sync_replicated(plan, broken)
        else:
            sync = self._sync_zero(plan, broken)
        self.control.event(
            "state_synced",
            worker=self.me,
            rank=rank,
            epoch=plan.epoch,
            seconds=round(time.perf_counter() - start, 6),
            **sync,
        )
        self.ctx.plan = plan
        if self.pipe is not None:
            self._set_clocks()
        if self.cfg.verify_every and self.state.step == 0:
            self._capture_good(0)  # the initial state: every rank built the same one
        if rank == 0 and self.state.step > 0 and "durable" not in sync:
            # Re-report the resume step: if the previous rank 0 died before reporting it, this is
            # its only record (the daemon drops duplicates). A step restored from a durable
            # checkpoint was committed by an earlier run or is about to be recomputed: not here.
            self.commit_step(StepResult(self.state.step, self.state.last_loss, 0.0))

    def _sync_pipeline(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Pipelines: the stage takeover; ``--resume`` and the durable fallback when every
        holder of some layer is gone."""
        assert self.pipe is not None

        def start_from() -> durable.DurableState | None:
            start = self._start_over(plan, broken)
            return self._load_durable(*start) if start is not None else None

        try:
            return self.pipe.sync(plan, broken, self.cfg.migration == "async", start_from)
        except LayersLost as exc:
            chosen = self._newest_durable(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            state = self._load_durable(Path(chosen), self.state.step, str(exc))
            return self.pipe.restore_whole(plan, state)

    def _sync_replicated(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Replicated state: ranks behind (a newcomer, a failed reduction) copy the most
        advanced one."""
        rank = self.comm.rank(DP)
        mine = torch.tensor([float(self.state.step)], dtype=torch.float64)
        steps = [int(x.item()) for x in self.comm.allgather(DP, mine, broken)]
        start = self._start_over(plan, broken) if max(steps) == 0 else None
        if start is not None:
            return {"steps": steps, **self._restore(plan, broken, *start)}
        target = max(steps)
        moved = 0
        source = steps.index(target)
        if min(steps) != target:
            state = torch.cat(
                [self.state.flat.data, self.state.opt.exp_avg, self.state.opt.exp_avg_sq]
            )
            meta = torch.tensor(
                [float(self.state.step), float(self.state.opt.step_count), self.state.last_loss],
                dtype=torch.float64,
            )
            self.comm.broadcast(DP, meta, source, broken)
            self.comm.broadcast(DP, state, source, broken)
            if self.state.step != target:
                n = self.state.flat.numel
                self.state.flat.data.copy_(state[:n])
                self.state.opt.exp_avg.copy_(state[n : 2 * n])
                self.state.opt.exp_avg_sq.copy_(state[2 * n :])
                self.state.step = int(meta[0].item())
                self.state.opt.step_count = int(meta[1].item())
                self.state.last_loss = float(meta[2].item())
            moved = state.numel() * state.element_size() + meta.numel() * meta.element_size()
        return {
            "resume_step": target,
            "source_rank": source,
            "steps": steps,
            "bytes": moved if rank != source else 0,
        }

    def _sync_zero(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """ZeRO: agree on the resume step, settle staged state, move shards to the new layout."""
        z = self.zero
        assert z is not None
        rank = self.comm.rank(DP)
        committed, staged = z.info()
        loss = z.snap_loss if z.keeps_params else self.state.last_loss  # K > 1: the snapshot's
        mine = torch.tensor(
            [committed, staged, float(z.layout_epoch), loss, float(self.state.step)],
            dtype=torch.float64,
        )
        rows = [r.tolist() for r in self.comm.allgather(DP, mine, broken)]
        with_state = [i for i, r in enumerate(rows) if r[0] >= 0]
        if not with_state:  # a fresh start: nobody holds optimizer state yet
            start = self._start_over(plan, broken)
            if start is not None:
                return self._restore(plan, broken, *start)
            stats = z.reshard(
                self.comm, (), None, plan.workers, rank, 0, plan.epoch, broken,
                new_hosts=plan.hosts,
            )  # fmt: skip
            return {
                "resume_step": 0,
                "source_rank": 0,
                "steps": [0] * len(rows),
                "replica_holders": _holders_of(z),
                **stats,
            }
        resume = int(max(rows[i][0] for i in with_state))
        try:
            if len({int(rows[i][2]) for i in with_state}) > 1:
                raise ShardLost("ranks hold shards of different layouts (a fault while resharding)")
            source = next(i for i in with_state if int(rows[i][0]) == resume)
            z.settle(resume)
            layout = z.layout.to_json() if z.layout is not None else []
            old = self._broadcast_json(
                {"workers": z.workers, "ranges": layout, "hosts": z.hosts}, source, broken
            )
            if len(with_state) < len(rows) and not z.keeps_params:
                # newcomers: full parameters from the source (K > 1 rebuilds them from chunks)
                self.comm.broadcast(DP, self.state.flat.data, source, broken)
            stats = z.reshard(
                self.comm, tuple(old["workers"]), ShardLayout.from_json(z.segments, old["ranges"]),
                plan.workers, rank, resume, plan.epoch, broken,
                old_hosts=tuple(old["hosts"]), new_hosts=plan.hosts,
            )  # fmt: skip
        except ShardLost as exc:  # both in-memory copies gone: the durable checkpoint, if any
            chosen = self._newest_durable(broken)
            if not chosen:  # every rank sees the same choice, so all raise together
                raise
            newest = int(max(rows[i][4] for i in with_state))  # committed, incl. rolled back
            return self._restore(plan, broken, Path(chosen), newest, str(exc))
        self.state.step, self.state.last_loss = resume, float(rows[source][3])
        z.snap_loss = self.state.last_loss
        return {
            "replica_holders": _holders_of(z),
            "resume_step": resume,
            # committed steps rolled back to the snapshot (K > 1), to be redone
            "redone_steps": int(max(rows[i][4] for i in with_state)) - resume,
            "source_rank": source,
            "steps": [int(r[0]) for r in rows],
            **stats,
        }

    def _newest_durable(self, broken: Callable[[], bool]) -> str:
        """The newest complete durable checkpoint as rank 0 sees it, the same on every rank
        ("" when there is none, or durable checkpoints are off)."""
        if self.durable is None:
            return ""
        self.durable.flush()  # a write still in flight is the newest checkpoint
        newest = durable.latest(self.cfg.resolved_durable_dir) if self.comm.rank(DP) == 0 else None
        return self._broadcast_json(str(newest) if newest else "", 0, broken)

    def _resume_path(self) -> Path:
        assert self.cfg.resume is not None
        path = durable.latest(self.cfg.resume)
        if path is None:
            raise ShardLost(f"no durable checkpoint to resume from in {self.cfg.resume}")
        return path

    def _broadcast_json(self, obj: Any, source: int, broken: Callable[[], bool]) -> Any:
        """Send a small JSON document from ``source`` to every rank (length, then bytes)."""
        data = json.dumps(obj).encode() if self.comm.rank(DP) == source else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self.comm.broadcast(DP, size, source, broken)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8)
        if data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.comm.broadcast(DP, buf, source, broken)
        return json.loads(bytes(buf.tolist()).decode())

    def _farewell(self) -> None:
        """Final best-effort barrier so no rank exits while a peer still reads its last bytes."""
        if self.plan is None:
            return
        params, exp_avg, exp_avg_sq = (
            self.state.flat.data,
            self.state.opt.exp_avg,
            self.state.opt.exp_avg_sq,
        )
        agree: dict[str, bool] = {}
        try:
            if self.pipe is not None:  # stages hold different layers: assemble the whole model
                whole, agree["holders_agree"] = self.pipe.assemble(self._group_broken)
                params, exp_avg, exp_avg_sq = whole.chunk(3)
            else:
                exp_avg, exp_avg_sq = self._whole_moments()  # whole states compare across ranks
            token = torch.zeros(1)
            self.comm.allreduce(DP, token, self._group_broken)
        except (CommError, Interrupted):
            pass
        if self.durable is not None:
            self.durable.flush()  # the last checkpoint must be on disk before we report done
        digest = hashlib.sha256(host_bytes(params))
        digest.update(host_bytes(exp_avg))
        digest.update(host_bytes(exp_avg_sq))
        self.control.event(
            "final_state",
            worker=self.me,
            rank=self.comm.rank(DP),
            step=self.state.step,
            pid=os.getpid(),
            params_sha256=hashlib.sha256(host_bytes(params)).hexdigest(),
            state_sha256=digest.hexdigest(),
            **agree,
        )
        self.control.send({"type": "done", "step": self.state.step, "worker_id": self.me})


def _holders_of(z: ZeroState) -> dict[str, list[int]]:
    """Owner rank -> ranks that keep pieces of its replica (for events and tests)."""
    out: dict[str, set[int]] = {}
    for p in z.placement:
        out.setdefault(str(p.owner), set()).add(p.holder)
    return {owner: sorted(holders) for owner, holders in out.items()}
