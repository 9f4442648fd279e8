"""Process helpers shared by the daemon and the runtime."""

from __future__ import annotations

import ctypes
import faulthandler
import logging
import os
import signal
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36

# A worker that gets it writes every thread's Python stack to its stacks file and dies by
# SIGKILL: the daemon's hang kill (:func:`stacks_on_signal`).
STACKS_SIGNAL = signal.SIGUSR2


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux; no-op elsewhere).

    Called by a child itself after exec, or as a ``preexec_fn`` for children started before any
    threads exist (forking a threaded process and running Python before exec is unsafe).
    """
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def become_subreaper() -> bool:
    """Make this process adopt its orphaned descendants (Linux ``PR_SET_CHILD_SUBREAPER``):
    a process forked by one of its children, whose parent then exits, becomes its child, to
    be waited for like any other. False where the kernel does not offer it."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def exit_now(code: int) -> NoReturn:
    """End this process with ``code`` once its output is flushed, without the interpreter's
    teardown: with torch imported, that takes seconds per process (a job's workers all exit at
    its end). Only for a process that has nothing left in flight (its writes flushed, its
    threads idle)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def stacks_on_signal(path: str | os.PathLike[str]) -> None:
    """From now on, :data:`STACKS_SIGNAL` makes this process write every thread's Python stack to
    ``path`` (truncated now) and then die by SIGKILL, as a hung worker killed by its daemon.

    The stacks are faulthandler's, written by the C signal handler of whichever thread takes
    the signal: while the main thread is blocked in C code too, and in a stopped process as soon
    as it is continued (the daemon sends the signal to the main thread, then SIGCONT: that thread
    writes them before it runs anything else). The handler then chains to a Python one that
    SIGKILLs the process once the main thread is back in Python; one stuck in C code is killed
    by the sender, which waits a bounded time for the stacks (``daemon/hangs.py``).
    """
    stacks = open(path, "w")  # noqa: SIM115 - kept open for the process's life by faulthandler
    signal.signal(STACKS_SIGNAL, _die)
    faulthandler.register(STACKS_SIGNAL, file=stacks, all_threads=True, chain=True)


def _die(signum: int, frame: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def signal_main_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to the main thread of process ``pid`` (Linux ``tgkill``; elsewhere, or once
    that thread is gone, to the process). A stopped process then takes it in its main thread
    first when it is continued, before that thread runs any code; sent to the process, any of
    its threads may take it, after the main one has moved on. Raises ``ProcessLookupError``
    when there is no such process."""
    try:
        tgkill = ctypes.CDLL("libc.so.6", use_errno=True).tgkill
    except (OSError, AttributeError):
        tgkill = None
    if tgkill is None or tgkill(pid, pid, int(sig)) != 0:
        os.kill(pid, sig)
