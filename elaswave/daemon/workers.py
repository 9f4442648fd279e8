"""Worker processes as the daemon sees them: spawn, watch for exit, stop."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elaswave import wire
from elaswave.daemon.template import Adopted, Template, TemplateGone
from elaswave.planning.hanglimits import phase_ended
from elaswave.runtime.device import nccl_environment
from elaswave.wire_etcd import WorkerInfo

log = logging.getLogger(__name__)


@dataclass
class WorkerProc:
    worker_id: str
    slot: int  # local device index on this host
    incarnation: int
    proc: asyncio.subprocess.Process | Adopted  # executed, or forked from the template
    log_path: Path
    ready: bool = False
    done: bool = False
    stopping: bool = False
    evicted: bool = False  # the leader evicted it (a straggler, a miscomputing device)
    unjoined: bool = False  # its host was preempted before any plan took it: it held nothing
    exit_code: int | None = None
    stacks_path: Path | None = None  # where it writes its stacks when killed as hung
    spare: bool = False  # a warm spare: built, never planned nor registered until activated
    last_beat: float | None = None  # daemon's monotonic clock at the last heartbeat
    phase: str = "idle"
    phase_age: float = 0.0  # how long the worker had been in ``phase`` at that heartbeat
    step: int = 0  # its last committed step, as its newest heartbeat said
    ended: list[tuple[str, float]] = field(default_factory=list)  # judged phases it ended
    info: WorkerInfo | None = None  # its worker key's value in etcd (set when ready)
    kill_reason: str | None = None  # set when the daemon kills it (hang)
    detect_delay: float = 0.0  # a kill fault sent to it asks for its death to be reported late
    shield: int | None = None  # a signal it ignores: the preemption signal (the daemon's)
    waiter: asyncio.Task[None] | None = field(default=None, repr=False)
    # While its heartbeats are late: its CPU time at the last look, and when that last grew.
    cpu_seen: float | None = field(default=None, repr=False)
    cpu_moved: float | None = field(default=None, repr=False)
    _ps: psutil.Process | None = field(default=None, repr=False)

    def terminate(self) -> None:
        """End it now: SIGTERM, or SIGKILL where it ignores SIGTERM (the preemption signal:
        a scheduler sends it to every process of the job, and the daemon answers it for the
        worker). A worker keeps SIGTERM's default action, so the two end it alike."""
        sig = signal.SIGKILL if self.shield == signal.SIGTERM else signal.SIGTERM
        self.proc.send_signal(sig)

    def heard(self, msg: wire.Heartbeat, at: float) -> None:
        """A heartbeat, read at ``at`` (the daemon's monotonic clock): the compute phase or
        evaluation it shows ended goes into :attr:`ended` (the hang detector's phase times)."""
        done = phase_ended((self.phase, self.phase_age), (msg.phase, msg.phase_age))
        if done is not None:
            self.ended.append(done)
        self.last_beat = at
        self.phase, self.phase_age, self.step = msg.phase, msg.phase_age, msg.step
        self.cpu_seen = self.cpu_moved = None

    def still(self, now: float) -> float | None:
        """While its heartbeats are late: how long since it last beat or used CPU time, as the
        looks so far tell (called every half heartbeat, it takes one look each call); ``None``
        when its CPU time cannot be read. A frozen process (stopped, deadlocked) uses none; one
        whose main thread holds the interpreter in a long call does."""
        if self.last_beat is None:
            return None
        try:
            if self._ps is None:
                self._ps = psutil.Process(self.pid)
            times = self._ps.cpu_times()
        except (psutil.Error, OSError):
            return None
        used = times.user + times.system
        if self.cpu_seen is not None and used > self.cpu_seen:
            self.cpu_moved = now
        self.cpu_seen = used
        return now - max(self.last_beat, self.cpu_moved or self.last_beat)

    def sent(self, detect_delay: float | None) -> None:
        """A fault was sent to this worker: one that asks for a slow detector delays the report
        of its death."""
        self.detect_delay = max(self.detect_delay, detect_delay or 0.0)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe_exit(self) -> str:
        if self.kill_reason:
            return f"hung ({self.kill_reason}), killed"
        return describe_exit(self.exit_code)


def describe_exit(code: int | None) -> str:
    """A process's exit status in words (``code`` as asyncio gives it: -N for signal N)."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def worker_id(host_id: str, slot: int, incarnation: int) -> str:
    base = f"{host_id}.w{slot}"
    return base if incarnation == 0 else f"{base}.r{incarnation}"


def spare_id(host_id: str, n: int) -> str:
    """The id of this host's ``n``-th warm spare (it keeps it once activated)."""
    return f"{host_id}.s{n}"


def base_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the worker template and of every worker, whatever its device: one
    OpenMP thread unless the user says otherwise, and no etcd credentials (workers never talk
    to etcd: they stay in the daemon)."""
    env = dict(os.environ if base is None else base)
    env.setdefault("OMP_NUM_THREADS", "1")
    for secret in ("ELASWAVE_ETCD_USER", "ELASWAVE_ETCD_PASSWORD"):
        env.pop(secret, None)
    return env


def device_environment(device: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """What a worker on ``device`` (the resolved ``train.device``) gets beyond the base:
    NCCL's settings the user has not set, on cuda (or auto, which may be; they are inert
    without NCCL)."""
    if device == "cpu":
        return {}
    env = dict(os.environ if base is None else base)
    return {k: v for k, v in nccl_environment(env).items() if k not in env}


def worker_environment(device: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an executed worker on ``device``."""
    return base_environment(base) | device_environment(device, base)


async def spawn(
    *,
    host_id: str,
    slot: int,
    incarnation: int,
    control_path: str,
    log_dir: Path,
    device: str = "cpu",
    template: Template | None = None,
    timeout: float = 60.0,
    shield: int | None = None,
    spare: str | None = None,
) -> WorkerProc:
    """Start worker ``slot`` (its ``incarnation``-th life) on ``device`` (the resolved
    ``train.device``): an accelerator worker takes the slot-th device. Forked from the
    ``template`` while it runs (milliseconds), else executed (a new interpreter imports torch).
    ``shield``: a signal the worker ignores from its start (the preemption signal). ``spare``:
    start a warm spare of that id instead (no slot until it is activated)."""
    wid = spare or worker_id(host_id, slot, incarnation)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{wid}.log"
    stacks = log_dir / f"{wid}.stacks"  # moved to the run's stacks/ if it is killed as hung
    argv = ["--control", control_path, "--worker-id", wid, "--slot", str(slot),
            "--stacks", str(stacks)]  # fmt: skip
    if shield is not None:
        argv += ["--shield", str(shield)]
    if spare:
        argv.append("--spare")
    proc: asyncio.subprocess.Process | Adopted | None = None
    if template is not None and template.alive:
        try:
            proc, _ = await template.spawn("worker", argv, log_path, timeout=timeout)
        except TemplateGone as exc:
            log.warning("%s; executing %s instead", exc, wid)
    if proc is None:
        with open(log_path, "ab") as logf:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "elaswave.worker", *argv,
                stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=logf,
                env=worker_environment(device),
            )  # fmt: skip
    return WorkerProc(
        worker_id=wid, slot=slot, incarnation=incarnation, proc=proc, log_path=log_path,
        shield=shield,
        stacks_path=stacks, spare=bool(spare),
    )  # fmt: skip


async def stop_all(workers: list[WorkerProc], grace: float) -> None:
    """Terminate everyone, wait up to ``grace``, SIGKILL the rest; tolerate the already dead."""
    live = [w for w in workers if w.proc.returncode is None]
    for w in live:
        w.stopping = True
        try:
            w.terminate()
        except ProcessLookupError:
            pass
    if not live:
        return
    done, pending = await asyncio.wait(
        [asyncio.ensure_future(w.proc.wait()) for w in live], timeout=grace
    )
    for w in live:
        if w.proc.returncode is None:
            try:
                w.proc.kill()
            except ProcessLookupError:
                pass
    if pending:
        await asyncio.wait(pending, timeout=grace)
