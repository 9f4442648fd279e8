"""Process helpers shared by the daemon and the runtime."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


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
