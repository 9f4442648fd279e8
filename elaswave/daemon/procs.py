"""Process hygiene: children die with their parent; stopping is terminate → wait → kill."""

from __future__ import annotations

import signal

import psutil


def terminate_then_kill(pid: int, *, grace: float, sig: int = signal.SIGTERM) -> bool:
    """Send ``sig``, wait up to ``grace`` seconds, then SIGKILL. True if the process is gone.

    Tolerates processes that are already dead.
    """
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return True
    try:
        proc.send_signal(sig)
        proc.wait(timeout=grace)
        return True
    except psutil.NoSuchProcess:
        return True
    except psutil.TimeoutExpired:
        pass
    try:
        proc.kill()
        proc.wait(timeout=grace)
    except (psutil.NoSuchProcess, psutil.TimeoutExpired):
        pass
    return not psutil.pid_exists(pid) or _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
