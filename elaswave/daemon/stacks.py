"""A hung worker's stacks, taken as the daemon kills it.

Every worker opens a stacks file of its own as it starts (``logs/<worker>.stacks``, passed by
:func:`~elaswave.daemon.workers.spawn`; the forked ones open theirs after the fork) and, on
:data:`~elaswave.procutil.STACKS_SIGNAL`, writes every thread's Python stack to it and dies
(:func:`~elaswave.procutil.stacks_on_signal`). :func:`kill_with_stacks` sends that signal to the
worker's main thread, then SIGCONT (a worker stopped by SIGSTOP writes its stacks as it
continues, before its main thread runs anything else), waits until the worker is dead or its
file has stopped growing, at most ``STACKS_WAIT_S``, then SIGKILLs it whatever happened.
:func:`keep` moves the file into the run directory as ``stacks/<worker>-<date>-<time>.txt``
(when it was found hung: the step in its last heartbeat may be a few behind a fast job's). A
file nobody wrote to is removed when its worker exits (:func:`discard_unused`).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import signal
import time
from pathlib import Path

from elaswave.daemon.workers import WorkerProc
from elaswave.procutil import STACKS_SIGNAL, signal_main_thread

__all__ = ["STACKS_DIR", "STACKS_WAIT_S", "discard_unused", "keep", "kill_with_stacks"]

STACKS_DIR = "stacks"  # in the run directory
STACKS_WAIT_S = 0.5  # the longest the stacks may delay a hung worker's kill
POLL_S = 0.02  # how often the file's size is looked at meanwhile
STEADY_POLLS = 2  # a file that has not grown for this many looks is written


async def kill_with_stacks(w: WorkerProc, *, wait_s: float = STACKS_WAIT_S) -> None:
    """Ask ``w`` for its stacks, then kill it: SIGKILL within ``wait_s`` whatever it does. It
    awaits only sleeps: the daemon's event loop runs on meanwhile."""
    try:
        if w.proc.returncode is None:
            signal_main_thread(w.pid, STACKS_SIGNAL)
            w.proc.send_signal(signal.SIGCONT)
        await _written(w, wait_s)
    except ProcessLookupError:
        pass
    finally:
        with contextlib.suppress(ProcessLookupError):
            w.proc.kill()


async def _written(w: WorkerProc, wait_s: float) -> None:
    """Until ``w`` is dead (it writes its stacks first) or its stacks file has stopped growing
    (a main thread stuck in C code never ends it), at most ``wait_s``."""
    end = time.monotonic() + wait_s
    size, steady = 0, 0
    while w.proc.returncode is None and time.monotonic() < end:
        await asyncio.sleep(POLL_S)
        now = _size(w.stacks_path)
        steady = steady + 1 if now and now == size else 0
        if steady >= STEADY_POLLS:
            return
        size = now


def _size(path: Path | None) -> int:
    try:
        return path.stat().st_size if path is not None else 0
    except OSError:
        return 0


def keep(w: WorkerProc, run_dir: Path, at: float) -> tuple[str, str] | None:
    """Move the stacks ``w`` wrote into ``run_dir``'s ``stacks/``, named by the worker and the
    wall-clock time ``at`` it was found hung: (its path there, relative to ``run_dir``; the
    stacks), or ``None`` if it wrote none."""
    src = w.stacks_path
    try:
        text = src.read_text(errors="replace") if src is not None else ""
    except OSError:
        return None
    if src is None or not text:
        return None
    folder = run_dir / STACKS_DIR
    name = f"{w.worker_id}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(at))}"
    dst = folder / f"{name}.txt"
    n = 1
    while dst.exists():  # worker ids start over when the job is launched again here
        n += 1
        dst = folder / f"{name}-{n}.txt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dst)
    except OSError:
        return str(src.relative_to(run_dir)) if src.is_relative_to(run_dir) else str(src), text
    return str(dst.relative_to(run_dir)), text


def discard_unused(w: WorkerProc) -> None:
    """Remove ``w``'s stacks file if it holds nothing (it exited without being asked for them)."""
    if w.stacks_path is not None and _size(w.stacks_path) == 0:
        with contextlib.suppress(OSError):
            w.stacks_path.unlink()
