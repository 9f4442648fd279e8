"""A user's own training loop under ElasWave: ``elaswave.init()`` and what it returns.

``elaswave launch --script train.py -- ARGS`` runs ``train.py`` in every worker, under the same
daemon, etcd, faults and reports as a config job. The script keeps its loop::

    job = elaswave.init()
    job.register(model, optimizer, scheduler)
    for step in job.steps(dataset=ds):
        for mb in step.micro_batches():          # this rank's share of the fixed global batch
            loss = loss_fn(model(mb.inputs), mb.targets)     # summed over the micro-batch
            step.backward(loss, count=mb.size)
        step.commit()                            # reduce (sum / B), clip, optimizer, schedule
    job.finish()

It is the engine's step, driven from the script: :meth:`Step.micro_batches` is the strategy's
accumulation (:class:`~elaswave.runtime.strategies.replicated.Accumulation`) with the user's
forward and backward in the middle, :meth:`Step.commit` the engine's reduction, commit and
checks. A peer lost during a step ends the step: the micro-batches stop, ``commit`` returns
False, and ``steps()`` applies the next plan and yields the same step again (with partial redo,
only the micro-batches no survivor kept). The script writes no ``try``; survivors never restart.
A respawned or joining worker runs the script from the top: ``register`` gives the engine its
model, and the first plan's sync fills it (and the optimizer's state) from peers.

What the engine needs from the registered objects: the model's trainable parameters become
views of the flat buffers (the script's ``model`` is the object trained); the optimizer's class
and its group's values make the flat optimizer's rule (any element-wise ``torch.optim`` class,
probed as ``train.optimizer`` is; its ``step()`` is never called); the scheduler is replayed on
a one-element copy, so that step ``s`` always gets the same learning rate, on a newcomer too.

Randomness: before each micro-batch the default generators are seeded from (seed, step,
micro-batch), so ``nn.Dropout`` and ``torch.rand`` draw the same numbers for it on any rank,
after any fault; ``mb.generator`` is a stream of its own for explicit draws (augmentation).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import runpy
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.errors import EXIT_SCRIPT_FAILED, one_line
from elaswave.runtime.comm.groups import Interrupted
from elaswave.runtime.optimizers import ScheduleReplay, TorchRule
from elaswave.runtime.registered import ScriptError, ScriptState, ScriptWorkload, optimizer_rule
from elaswave.runtime.runningstats import norms_of
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.workload.base import Dataset, seed_generators
from elaswave.runtime.workload.data import MicroBatch
from elaswave.runtime.workload.rng import stream_seed

__all__ = ["Batch", "Job", "JobLeft", "ScriptError", "Session", "Step", "init"]

log = logging.getLogger(__name__)

_GENERATOR_SITE = 1  # mb.generator's stream; the default generators' is site 0


class JobLeft(SystemExit):
    """The job is over for this worker before the script's loop ended (the daemon stopped it,
    no plan came, state was lost): the script unwinds (its ``finally`` blocks run) and the
    worker exits with this code."""


@dataclass
class Session:
    """What the worker entry knows before the script runs."""

    cfg: JobConfig
    control: Any  # ControlClient
    worker_id: str
    host_addr: str
    device: torch.device
    job: Job | None = None


_SESSION: Session | None = None


def start(session: Session) -> None:
    """The worker entry's call before it runs the script."""
    global _SESSION
    _SESSION = session


def run_script(session: Session) -> int:
    """Run the job's script in this worker (as ``python FILE ARGS`` would, as ``__main__``);
    the worker's exit code. A script that raises, exits non-zero or returns before the job's
    last step fails the job: its traceback goes to this worker's log, an event names the rank
    and the reason, and the worker is not respawned (it would fail again)."""
    start(session)
    path = str(session.cfg.script)
    sys.argv = [path, *session.cfg.script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    why = None
    try:
        runpy.run_path(path, run_name="__main__")
    except JobLeft as exc:
        if session.job is not None:
            session.job.close()
        return int(exc.code or 0)
    except SystemExit as exc:  # the script's own sys.exit
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            why = f"the script exited with code {code}"
    except BaseException as exc:  # noqa: BLE001 - the script's own error: reported, not raised
        log.exception("the script raised")
        why = f"the script raised {one_line(exc)}"
    job = session.job
    if why is None:
        if job is None:
            why = "the script returned without calling elaswave.init()"
        elif job._engine is None:
            why = "the script returned before job.steps()"
        elif job.step < job.cfg.train.steps:
            why = f"the script returned at step {job.step} of {job.cfg.train.steps}"
    if why is not None:
        if job is not None:
            job.close()  # no checkpoint write of this rank left in flight
        rank = job.rank if job is not None else -1
        where = f"rank {rank} ({session.worker_id})" if rank >= 0 else session.worker_id
        session.control.event("script_failed", worker=session.worker_id, reason=f"{where}: {why}")
        log.error("%s", why)
        return EXIT_SCRIPT_FAILED
    assert job is not None
    job.finish()
    job.close()
    return 0


def init() -> Job:
    """Join the job this worker runs (the same object on a second call)."""
    session = _SESSION
    if session is None:
        raise ScriptError(
            "elaswave.init() joins a job: start the script with "
            "`elaswave launch --script FILE [-- ARGS]`"
        )
    if session.job is None:
        session.job = Job(session)
    return session.job


@dataclass
class Batch:
    """One micro-batch of the step, on this rank's device. ``batch`` is what the data set's
    items collate to; ``inputs`` and ``targets`` its two parts when items are pairs."""

    id: int  # within the step
    sample_ids: tuple[int, ...]
    batch: Any
    generator: torch.Generator  # keyed by (seed, step, micro-batch): explicit draws
    inputs: Any = None
    targets: Any = None
    backward_done: bool = False

    @property
    def size(self) -> int:
        return len(self.sample_ids)


class Job:
    """This worker's membership of the job (:func:`init`)."""

    def __init__(self, session: Session) -> None:
        self._s = session
        self.cfg = session.cfg
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._rule: tuple[TorchRule, ScheduleReplay | None, float] | None = None
        self._state: ScriptState | None = None
        self._good_state: tuple[int, torch.Tensor] | None = None  # (step, the state's bytes)
        self._engine: Any = None  # Engine, once steps() starts
        self._finished = False
        torch.set_num_threads(self.cfg.train.threads_per_worker)
        # Every rank builds the same model next, whatever the script seeds itself (a newcomer's
        # is overwritten from peers anyway).
        torch.manual_seed(self.cfg.train.seed)
        session.control.send(wire.Ready(worker_id=session.worker_id))

    # ---- who we are ---------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._s.device

    @property
    def rank(self) -> int:
        """This worker's rank in the plan it runs (-1 before its first plan)."""
        plan = self._plan()
        return plan.rank_of(self._s.worker_id) if plan is not None else -1

    @property
    def world_size(self) -> int:
        plan = self._plan()
        return plan.world_size if plan is not None else 0

    @property
    def total_steps(self) -> int:
        return self.cfg.train.steps

    @property
    def global_batch(self) -> int:
        """Samples per step, whatever the world size."""
        return self.cfg.train.global_batch

    @property
    def step(self) -> int:
        """The last committed step (0 before the first)."""
        return self._engine.state.step if self._engine is not None else 0

    def _plan(self) -> Any:
        if self._engine is not None and self._engine.plan is not None:
            return self._engine.plan
        plan = self._s.control.latest_plan
        return plan if plan is not None and self._s.worker_id in plan.workers else None

    # ---- what the job trains ------------------------------------------------------------------
    def register(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        state: dict[str, Any] | None = None,  # positional too: the public API as documented
    ) -> None:
        """The model the loop trains, its optimizer and schedule, and ``state``, a dict of the
        script's own (:class:`ScriptState`): what a newcomer gets from peers. Once, before
        :meth:`steps`."""
        if self._engine is not None:
            raise ScriptError("register() after steps(): register before the loop starts")
        if self._model is not None:
            raise ScriptError("register() called twice: a job trains one model")
        if not isinstance(model, nn.Module):
            raise ScriptError(f"register(model=...) takes an nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ScriptError(
                f"register(optimizer=...) takes a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        owned = {id(p) for p in model.parameters() if p.requires_grad}
        given = [p for g in optimizer.param_groups for p in g["params"]]
        if {id(p) for p in given} != owned or len(given) != len(owned):
            raise ScriptError(
                "the optimizer must hold exactly the model's trainable parameters, once each"
            )
        norms = norms_of(model)
        if norms:
            name, norm = norms[0]
            raise ScriptError(
                f"{name} ({type(norm).__name__}) keeps running statistics, which a script's own "
                "forward does not share across ranks yet: train the model as a config job "
                "(model.source: module), or use track_running_stats=False"
            )
        if state is not None and not isinstance(state, dict):
            raise ScriptError(f"register(state=...) takes a dict, got {type(state).__name__}")
        self._model, self._optimizer = model, optimizer
        self._rule = optimizer_rule(optimizer, scheduler, self.cfg.train.steps)
        self._state = ScriptState(state, self.device) if state is not None else None

    def steps(
        self,
        total: int | None = None,
        *,
        dataset: Dataset,
        global_batch: int | None = None,
        micro_batch_size: int | None = None,
        collate: Callable[[Sequence[Any]], Any] | None = None,
    ) -> Iterator[Step]:
        """The job's steps, from the one after the last committed (a newcomer: the job's
        current one). A step that a fault interrupted is yielded again. ``total``,
        ``global_batch`` and ``micro_batch_size`` are the job's (``launch --steps``,
        ``--global-batch``, ``--micro-batch-size`` or the config): given here, they must agree
        (every daemon plans the micro-batches before any script runs)."""
        t = self.cfg.train
        for what, given, job, flag in (
            ("total", total, t.steps, "--steps"),
            ("global_batch", global_batch, t.global_batch, "--global-batch"),
            ("micro_batch_size", micro_batch_size, t.micro_batch_size, "--micro-batch-size"),
        ):
            if given is not None and given != job:
                raise ScriptError(
                    f"steps({what}={given}) differs from the job's {job}: launch with "
                    f"{flag} {given} (or set it in the config)"
                )
        if self._model is None or self._rule is None:
            raise ScriptError("steps() before register(model, optimizer): register them first")
        if self._engine is not None:
            raise ScriptError("steps() called twice: the job has one loop")
        try:
            size = len(dataset)
        except TypeError:
            raise ScriptError(
                f"steps(dataset=...) takes a map-style data set (len and [i]), got "
                f"{type(dataset).__name__}"
            ) from None
        from elaswave.runtime.evaluate import training_samples

        if training_samples(size, self.cfg.data.eval_samples) < 1:
            raise ScriptError("steps(dataset=...): the data set is empty")
        default: Callable[[Sequence[Any]], Any] = torch.utils.data.default_collate  # type: ignore[assignment]  # torch types it for lists; any sequence works
        self._engine = self._build(dataset, collate or default)
        return self._loop()

    def _build(self, dataset: Dataset, collate: Callable[[Sequence[Any]], Any]) -> Any:
        from elaswave.runtime.engine import Engine
        from elaswave.runtime.state import TrainState

        assert self._model is not None and self._rule is not None
        s = self._s
        rule, replay, lr = self._rule
        cfg = self.cfg = dataclasses.replace(
            self.cfg, train=dataclasses.replace(self.cfg.train, lr=lr)
        )
        workload = ScriptWorkload(self._model, dataset, collate)
        state = TrainState.build(cfg, s.device, workload=workload, optimizer=(rule, replay))
        state.script = self._state
        return Engine(
            cfg, s.control, worker_id=s.worker_id, host_addr=s.host_addr, device=s.device,
            state=state,
        )  # fmt: skip

    def _loop(self) -> Iterator[Step]:
        engine = self._engine
        total = self.cfg.train.steps
        while engine.state.step < total:
            if engine.control.stop_requested:
                raise JobLeft(0)
            try:
                engine.begin_step()
            except engine.FAILURES as exc:
                self._failed(exc, "recovery")
                continue
            self._keep_good()
            step = Step(self, engine.state.step + 1)
            yield step
            if self._state is not None:  # the script's body for this step is done
                if step.committed and engine.state.step < step.index:  # the check rolled back
                    self._take_good(engine.state.step)
                else:
                    self._state.step = engine.state.step
            if not step._commit_called:
                raise ScriptError(f"step {step.index} ended without step.commit()")
            if step.error is not None:
                self._failed(step.error, step.failed_during)
            elif step.preempt:  # every rank: checkpoint this step (the script's state too), leave
                raise JobLeft(engine.leave_preempted())
        self._set_user_lr(total + 1)

    def _keep_good(self) -> None:
        """Where the corruption check keeps the state of the last committed step as known good,
        keep the script's state of that step too (its loop body for the step is done here)."""
        good, step = self._engine.integrity.good, self._engine.state.step
        if self._state is None or good is None or good.step != step:
            return
        if self._good_state is None or self._good_state[0] != step:
            self._good_state = (step, self._state.saved())

    def _take_good(self, step: int) -> None:
        """The check rolled every rank back to ``step``: the script's state of that step too,
        from a rank that kept it (one that joined after the capture has none)."""
        assert self._state is not None
        engine, good = self._engine, self._good_state
        holds = good is not None and good[0] == step
        saved = good[1] if good is not None and holds else self._state.saved()
        try:
            self._state.spread(engine.comm, saved, holds, step=step, broken=engine.ctx.broken)
        except engine.FAILURES as exc:  # a peer lost meanwhile: the next plan's sync shares it
            self._state.step = -1  # not of any step: this rank takes a peer's
            self._failed(exc, "checks")
            return
        self._state.step = step
        self._good_state = (step, self._state.saved())

    def _failed(self, exc: BaseException, during: str) -> None:
        """A failure inside a step: the step is redone under the next plan, or (no plan, a
        stop, lost state) the worker leaves the job."""
        code = self._engine.failed(exc, during)
        if code is not None:
            raise JobLeft(code)

    def _set_user_lr(self, step: int) -> None:
        """The script's optimizer shows the rate of ``step`` (what it would hold had it
        stepped itself)."""
        assert self._optimizer is not None and self._engine is not None
        hyper = self._engine.state.opt.hyper
        group = self._optimizer.param_groups[0]
        group.update(hyper.group_at(min(step, self.cfg.train.steps)))

    def log(self, **metrics: float) -> None:
        """Metrics of the last committed step, from rank 0 (other ranks' are dropped): a line
        of metrics.jsonl, the job's TensorBoard stream and Prometheus on rank 0's host."""
        if self.rank != 0:
            return
        values = {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ScriptError(f"job.log({k}=...) takes a number, got {type(v).__name__}")
            values[k] = float(v)
        self._s.control.send(wire.Log(step=self.step, metrics=values, t=time.time()))

    def finish(self) -> None:
        """After the last step: the final state (compared across ranks, saved when asked) and
        this worker's farewell. The worker entry calls it if the script does not."""
        if self._engine is None:
            raise ScriptError("finish() before steps(): the job has not trained")
        step, total = self._engine.state.step, self.cfg.train.steps
        if step < total:
            raise ScriptError(f"finish() at step {step} of {total}: the loop ended early")
        if not self._finished:
            self._finished = True
            self._engine._farewell()

    def close(self) -> None:
        """Before the process exits: no checkpoint write of this rank is left in flight."""
        if self._engine is not None:
            self._engine.close()


class Step:
    """One step of the job, as the script runs it."""

    def __init__(self, job: Job, index: int) -> None:
        self._job, self.index = job, index
        self.committed = False
        self.preempt = False  # committed, and the job is preempted after it
        self.loss: float | None = None  # the step's mean loss once committed (every rank's)
        self.error: BaseException | None = None  # what ended it uncommitted
        self.failed_during = "step"
        self._run: Any = None  # the strategy's Accumulation
        self._every: list[MicroBatch] = []
        self._sums: StepSums | None = None
        self._start = 0.0
        self._current: Batch | None = None
        self._computed = False
        self._commit_called = False

    def micro_batches(self) -> Iterator[Batch]:
        """This rank's micro-batches of the step (a redone step: only those nobody kept)."""
        if self._run is not None:
            raise ScriptError(f"step {self.index}: micro_batches() called twice")
        engine = self._job._engine
        self._every, self._sums, self._start = engine.prepare_step(self.index)
        self._run = engine.strategy.accumulation(self.index, self._sums)
        return self._iterate()

    def _iterate(self) -> Iterator[Batch]:
        engine, job = self._job._engine, self._job
        run, t, device = self._run, job.cfg.train, job.device
        from elaswave.runtime.state import to_device

        slow = engine.faults.slowdown(self.index) * run.world / len(self._every)
        data = engine.state.dataset
        for i in run.mine:
            if engine.ctx.broken():  # a peer is gone: the reduction cannot succeed
                self.error = Interrupted("a peer left the plan during the step")
                return
            mb = self._every[i]
            batch = to_device(engine.state.workload.collate([data[k] for k in mb.sample_ids]),
                              device)  # fmt: skip
            seed_generators(stream_seed(t.seed, self.index, mb.id, layer=0), device)
            generator = torch.Generator(device=device)
            generator.manual_seed(
                stream_seed(t.seed, self.index, mb.id, layer=0, site=_GENERATOR_SITE)
            )
            item = Batch(mb.id, mb.sample_ids, batch, generator)
            if isinstance(batch, (tuple, list)) and len(batch) == 2:
                item.inputs, item.targets = batch
            else:
                item.inputs = batch
            self._current = item
            yield item
            self._current = None
            if not item.backward_done:
                raise ScriptError(
                    f"step {self.index}: micro-batch {mb.id} ended without step.backward(loss)"
                )
            if t.device_time:
                time.sleep(t.device_time)  # emulated accelerator time (benchmarks, tests)
            if slow:
                time.sleep(slow)
        self._computed = True

    def backward(self, loss: torch.Tensor, count: int | None = None) -> None:
        """Backpropagate the micro-batch's loss, summed over its samples; ``count`` is how many
        terms it sums (default: the micro-batch's size; 1 for a mean). The step's gradient is
        the sum over every rank's micro-batches divided by the sum of their counts."""
        item = self._current
        if item is None:
            raise ScriptError(
                f"step {self.index}: backward() outside a micro-batch of step.micro_batches()"
            )
        if item.backward_done:
            raise ScriptError(f"step {self.index}: backward() twice for micro-batch {item.id}")
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ScriptError(
                f"step.backward() takes the micro-batch's scalar loss (summed over it), got {shape}"
            )
        if not loss.requires_grad:
            raise ScriptError("step.backward(): the loss does not depend on the model's parameters")
        n = item.size if count is None else int(count)
        if n < 0:
            raise ScriptError(f"step.backward(count={count}): must be >= 0")
        loss.backward()
        item.backward_done = True
        self._run.add(item.id, loss, n)

    def commit(self) -> bool:
        """Reduce the step's gradient over every rank (sum / count), clip, step the optimizer
        and the schedule. False: a peer was lost, nothing was applied, and ``steps()`` yields
        this step again under the next plan."""
        if self._commit_called:
            raise ScriptError(f"step {self.index}: commit() called twice")
        self._commit_called = True
        if self._run is None:
            raise ScriptError(f"step {self.index}: commit() before step.micro_batches()")
        if self.error is not None:
            return False
        if self._current is not None or not self._computed:
            raise ScriptError(f"step {self.index}: commit() before the step's last micro-batch")
        engine = self._job._engine
        try:
            per_mb = self._run.finish()
            result = engine.reduce_step(self.index, self._sums, self._start, per_mb=per_mb)
        except engine.FAILURES as exc:
            self.error = exc
            return False
        self.committed, self.loss = True, result.loss
        self.preempt = result.preempt
        try:
            engine.commit_step(result)
            engine.after_commit(result.step)
        except engine.FAILURES as exc:  # applied; the checks after it were cut short
            self.error, self.failed_during = exc, "checks"
        self._job._set_user_lr(self.index + 1)
        return True
