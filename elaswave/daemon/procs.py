"""Process hygiene: children die with their parent; stopping is terminate → wait → kill."""

from __future__ import annotations

import signal
import time

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


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until all ``pids`` are gone; return the ones still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and not _is_zombie(p)]
        if alive:
            time.sleep(0.05)
    return alive
