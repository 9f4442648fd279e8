"""The daemon's side of its host's worker template (:mod:`elaswave.runtime.template`) and of the
processes forked from it.

``launch`` starts the template first of all (:meth:`Template.start`), so that its imports run
while etcd starts and the daemon joins the job; the daemon then asks it for the preflight check,
the rendezvous store and every worker. A process forked from the template is adopted by the
daemon (a child subreaper): :class:`Adopted` waits for it through a pidfd and reads its exit
status with ``waitpid``, so a death is seen as soon as with a child the daemon started itself.

If the template cannot start (no subreaper or pidfd on this platform), is turned off
(``elastic.worker_start: exec``), or dies, workers are executed as new interpreters
(``python -m elaswave.worker``): slower to start, the same otherwise.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from elaswave.daemon.aio import wait_for
from elaswave.procutil import become_subreaper

log = logging.getLogger(__name__)

# Imported by the template when the workers will need it (a job that resumes from a checkpoint,
# or writes them every durable_every steps): a worker otherwise needs it only to write its final
# one, and imports it then (over a second); importing it always would delay the first workers.
WARM = ("torch.distributed.checkpoint",)


class TemplateGone(RuntimeError):
    """The template is not running (it exited, or never answered): execute instead."""


# What autograd imports the first time a backward is handed a gradient (ZeRO-3 backpropagates
# layer by layer, see runtime/strategies/gather.py): most of a second, once per process. A
# pipeline stage imports it too, but only a stage that receives a gradient, beside its peers'
# compute: preloading it for pipelines delays every launch more than it saves.
BACKWARD_PRELOADS = ("torch.fx.experimental.symbolic_shapes",)
# What torch.optim's Optimizer constructor imports the first time (the compiler stack, which
# includes the above): a second or more, once per process.
OPTIM_PRELOADS = ("torch._dynamo",)


def preloads(
    model_source: str,
    zero: int = 0,
    model_type: str = "",
    *,
    torch_optim: bool = False,
) -> list[str]:
    """What the template imports before it is ready, beyond the runtime: the module of the
    job's workload source that every worker imports at start (for a Hugging Face model, its
    family's modeling module too: transformers imports it on the first use, seconds of work
    every worker would repeat; for a model by name, its library: timm alone imports for a
    second), what ZeRO-3 workers import at start (``BACKWARD_PRELOADS``),
    and what building a ``torch.optim`` optimizer imports when the workers build one
    (``torch_optim``: a script's own loop, an optimizer or scheduler class;
    ``OPTIM_PRELOADS``). Each worker would otherwise import these itself, all at once. Pure."""
    out = ["elaswave.runtime.workload.hf"] if model_source == "hf" else []
    if model_source in ("torchvision", "timm"):
        out = ["elaswave.runtime.workload.module", model_source]
    family = model_type.replace("-", "_")
    if out and re.fullmatch(r"[a-z][a-z0-9_]*", family):
        out.append(f"transformers.models.{family}.modeling_{family}")
    if zero == 3:
        out += BACKWARD_PRELOADS
    return out + (list(OPTIM_PRELOADS) if torch_optim else [])


def builds_torch_optimizers(*, script: bool, optimizer: str, lr_schedule: str) -> bool:
    """Whether a job's workers build ``torch.optim`` optimizers: a script's own loop does, and
    so do an optimizer class and a scheduler class (dotted names) the runtime replays. Pure."""
    return script or "." in optimizer or "." in lr_schedule


def hf_model_type(hf: dict[str, Any], pretrained: str | None) -> str:
    """The ``model_type`` of a job's Hugging Face model: its ``hf`` config's, or the one a
    ``pretrained`` directory's ``config.json`` names ('' when neither says)."""
    if pretrained:
        try:
            return str(json.loads((Path(pretrained) / "config.json").read_text())["model_type"])
        except (OSError, ValueError, KeyError, TypeError):
            pass  # the config's, if it names one
    return str(hf.get("model_type") or "")


def adoption_supported() -> bool:
    """Whether processes forked by the template can be adopted and watched here (Linux: a
    child subreaper and pidfds)."""
    return hasattr(os, "pidfd_open") and sys.platform.startswith("linux")


_prestarted: Template | None = None


def prestart(env: dict[str, str]) -> None:
    """Start this process's template before anything else (``elaswave launch``'s first act,
    before the command line is parsed): its imports then overlap the launch's own. The launch
    takes it with :func:`take_prestarted`; unused, it dies with this process."""
    global _prestarted
    fd, path = tempfile.mkstemp(prefix="elaswave-template-", suffix=".log")
    os.close(fd)
    _prestarted = Template.start(env=env, log_path=Path(path))
    if _prestarted is None:
        os.unlink(path)
    else:
        atexit.register(_discard_prestarted)


def _discard_prestarted() -> None:
    """At exit, a template nobody took (the launch ended first): stopped, its log removed."""
    template = take_prestarted()
    if template is not None:
        with contextlib.suppress(OSError):
            template.proc.kill()
            template.proc.wait()
        template.log_path.unlink(missing_ok=True)


def take_prestarted() -> Template | None:
    """The template :func:`prestart` started, if any (once)."""
    global _prestarted
    template, _prestarted = _prestarted, None
    return template


class Template:
    """A running template and the requests made to it, one at a time."""

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.log_path = log_path
        self.device_env: dict[str, str] = {}  # set in every worker (NCCL's, on an accelerator)
        self._owed = 0  # answers to requests sent before the event loop ran
        self.ready_seconds: float | None = None
        self._reader: asyncio.StreamReader | None = None
        self._lock: asyncio.Lock | None = None
        self._gone: str | None = None

    @classmethod
    def start(cls, *, env: dict[str, str], log_path: Path) -> Template | None:
        """Start a template (None where adoption is not supported, or the kernel refuses to
        make this process a subreaper). Call before any other thread of the launch exists;
        what the job needs of it (:meth:`configure`) can follow while it imports."""
        if not adoption_supported() or not become_subreaper():
            return None
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "elaswave.runtime.template", "--parent", str(os.getpid())]
        for module in WARM:
            argv += ["--warm", module]
        with open(log_path, "ab") as logf:
            proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf, env=env
            )
        return cls(proc, log_path)

    def configure(
        self,
        *,
        model_source: str,
        log_path: Path,
        device_env: dict[str, str],
        zero: int = 0,
        model_type: str = "",
        torch_optim: bool = False,
    ) -> None:
        """What this job needs of the template, sent at once (answered after its imports): its
        log file (a template started before the run directory was known moves to it), the
        modules to import (:func:`preloads`: the workload's, and ZeRO-3's), and the environment
        a worker on the job's device gets."""
        self.device_env = dict(device_env)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._send({"op": "log", "path": str(log_path)})
        modules = preloads(model_source, zero, model_type, torch_optim=torch_optim)
        self._send({"op": "preload", "modules": modules})
        if log_path != self.log_path:
            with contextlib.suppress(OSError):
                self.log_path.unlink()  # the template holds it open until it moves
        self.log_path = log_path

    def _send(self, doc: dict[str, Any]) -> None:
        """Write a request whose answer :meth:`ready` collects (before the event loop runs)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError, OSError):
            self.proc.stdin.write((json.dumps(doc) + "\n").encode())
            self.proc.stdin.flush()
            self._owed += 1

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self._gone is None and self.proc.poll() is None

    async def _attach(self) -> asyncio.StreamReader:
        if self._reader is None:
            loop = asyncio.get_running_loop()
            reader = asyncio.StreamReader(limit=2**20)
            assert self.proc.stdout is not None
            await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), self.proc.stdout
            )
            self._reader = reader
            self._lock = asyncio.Lock()
        return self._reader

    async def _line(self, timeout: float) -> dict[str, Any]:
        reader = await self._attach()
        try:
            raw = await wait_for(reader.readline(), timeout)
        except asyncio.TimeoutError:
            raw = b""
            self._gone = f"no answer within {timeout:g} s"
        if not raw:
            self._gone = self._gone or self._exit_reason()
            raise TemplateGone(f"the worker template {self._gone}")
        return dict(json.loads(raw))

    def _exit_reason(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "closed its output"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code} (see {self.log_path})"

    async def ready(self, timeout: float) -> float:
        """Wait until the template's imports are done; returns how long they took."""
        if self.ready_seconds is None:
            await self._attach()
            assert self._lock is not None
            async with self._lock:
                if self.ready_seconds is None:
                    first = await self._line(timeout)
                    for _ in range(self._owed):  # what configure() asked, in order
                        answer = await self._line(timeout)
                        if "error" in answer:
                            raise TemplateGone(f"the worker template: {answer['error']}")
                    self._owed = 0
                    self.ready_seconds = float(first.get("seconds", 0.0))
        return self.ready_seconds

    async def request(self, doc: dict[str, Any], timeout: float) -> dict[str, Any]:
        """One request and its answer (after the template is ready)."""
        await self.ready(timeout)
        assert self._lock is not None and self.proc.stdin is not None
        async with self._lock:
            if not self.alive:
                raise TemplateGone(f"the worker template {self._gone or self._exit_reason()}")
            try:
                self.proc.stdin.write((json.dumps(doc) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._gone = self._exit_reason()
                raise TemplateGone(f"the worker template {self._gone}") from None
            return await self._line(timeout)

    async def preflight(self, config: dict[str, Any], timeout: float) -> str | None:
        """The preflight check of ``config`` (a :meth:`JobConfig.to_dict`): None if the model
        builds and its data fits, else the one-line reason."""
        answer = await self.request({"op": "preflight", "config": config}, timeout)
        return None if answer.get("ok") else str(answer.get("error", "preflight failed"))

    async def spawn(
        self, entry: str, argv: list[str], log_path: Path, *, timeout: float
    ) -> tuple[Adopted, dict[str, Any]]:
        """Fork ``entry`` (worker | store) with ``argv``, its output to ``log_path``; returns
        the adopted process and the template's answer (a store's ``port``)."""
        doc = {
            "op": "spawn", "entry": entry, "argv": argv, "log": str(log_path),
            "parent": os.getpid(), "env": self.device_env,
        }  # fmt: skip
        answer = await self.request(doc, timeout)
        if "error" in answer:
            raise TemplateGone(f"the worker template could not start a {entry}: "
                               f"{answer['error']}")  # fmt: skip
        return Adopted(int(answer["pid"])), answer

    async def warm(self, timeout: float) -> None:
        """Let the template import the modules later workers need (see ``WARM``)."""
        await self.request({"op": "warm"}, timeout)

    async def close(self, grace: float) -> None:
        """End of input: the template exits; killed if it has not after ``grace`` seconds."""
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        loop = asyncio.get_running_loop()
        try:
            await wait_for(loop.run_in_executor(None, self.proc.wait), grace)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await loop.run_in_executor(None, self.proc.wait)


class Adopted:
    """A process this daemon adopted: what the pool uses of ``asyncio.subprocess.Process``
    (``pid``, ``returncode``, ``wait``, ``send_signal``, ``terminate``, ``kill``).

    Its exit is seen through a pidfd in the event loop and its status read with ``waitpid``
    (it is our child, so its pid cannot be reused before that)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._exited = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._fd: int | None = os.pidfd_open(pid)
        self._loop.add_reader(self._fd, self._reap)
        self._reap()  # it may have died already

    def _reap(self) -> None:
        if self.returncode is not None:
            return
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:  # not ours after all (never adopted): it is gone
            pid, status = self.pid, 0
            log.warning("process %d was not adopted by this daemon", self.pid)
        if pid == 0:
            return
        self.returncode = os.waitstatus_to_exitcode(status)
        if self._fd is not None:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
