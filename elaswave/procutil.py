"""Process helpers shared by the daemon and the runtime."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


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
