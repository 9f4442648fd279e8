"""A job's discovery record, ``<state dir>/jobs/<job_id>.json``: it lets ``status``,
``inject-fault`` and ``report`` find a job launched on this machine by its id alone (``launch``
writes it, and removes it when it ends). Light to import: the commands that read it start
without the daemon's modules."""

from __future__ import annotations

import json
import os
from pathlib import Path

from elaswave.config import state_dir
from elaswave.errors import JobNotFound

__all__ = ["discovery_path", "find_job"]


def discovery_path(job_id: str) -> Path:
    return state_dir() / "jobs" / f"{job_id}.json"


def find_job(job_id: str) -> dict:
    """The discovery record of a job launched on this machine, if its launcher is alive."""
    path = discovery_path(job_id)
    if not path.exists():
        raise JobNotFound(
            f"no running job {job_id!r} on this machine (give --etcd to look elsewhere)"
        )
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):  # gone meanwhile, or not one (a write before they were atomic)
        raise JobNotFound(f"no readable record of job {job_id!r} on this machine") from None
    try:
        os.kill(int(record["pid"]), 0)
    except (ProcessLookupError, ValueError):
        path.unlink(missing_ok=True)
        raise JobNotFound(f"job {job_id!r} is no longer running (stale record removed)") from None
    except PermissionError:
        pass
    return record
