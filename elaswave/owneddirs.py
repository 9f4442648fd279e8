"""Temporary directories that name the process owning them.

A process killed with SIGKILL never runs its cleanup, so what it made in the temporary directory
stays there. Each such directory holds an ``owner`` file (the owner's pid and start time); the
next process that makes one with the same prefix first removes those whose owner has exited.
A pid reused by another process counts as exited (its start time differs); a directory
without a readable owner is left alone.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import psutil

__all__ = ["OWNER", "new_owned_dir", "sweep_owned_dirs"]

OWNER = "owner"  # in the directory: "pid start-time" of the process that made it


def new_owned_dir(prefix: str, root: str | None = None) -> Path:
    """A fresh private directory (mode 0700) under ``root`` (default: the temporary directory),
    marked with this process; stale ones of the same prefix are removed first."""
    sweep_owned_dirs(prefix, root)
    home = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    os.chmod(home, 0o700)
    me = psutil.Process()
    (home / OWNER).write_text(f"{me.pid} {me.create_time()}")
    return home


def sweep_owned_dirs(prefix: str, root: str | None = None) -> list[Path]:
    """Remove the directories ``prefix*`` under ``root`` whose owner process has exited.
    Returns what was removed."""
    removed = []
    for home in Path(root or tempfile.gettempdir()).glob(prefix + "*"):
        try:
            pid, started = (home / OWNER).read_text().split()
            alive = _running(int(pid), float(started))
        except (OSError, ValueError):
            continue
        if not alive:
            shutil.rmtree(home, ignore_errors=True)
            removed.append(home)
    return removed


def _running(pid: int, started: float) -> bool:
    try:
        return psutil.Process(pid).create_time() == started
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True  # someone else's process: not ours to judge
