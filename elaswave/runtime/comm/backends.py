"""What the communicator needs to know of a backend, apart from running collectives: whether
collectives issued before a fault have finished, what a member said when groups were agreed,
whether and how a group can be shrunk in place, and how an accelerator's group is made."""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch.distributed as dist

DEVICE_POLL_S = 0.0005  # how often an accelerator's work is checked for completion

__all__ = [
    "DEVICE_POLL_S",
    "accelerator_group",
    "completed_by",
    "finished",
    "said_count",
    "shrink_exclusions",
    "shrinkable",
]


def finished(works: list[dist.Work], *, poll: bool, timeout: float = 60.0) -> bool:
    """Wait for collectives every member issued; whether all completed. (One that fails leaves
    this rank rebuilding a group its peers keep: their next collective on it times out, and
    the plan after that rebuilds it everywhere.) ``poll``: an accelerator's ``wait()`` returns
    once the work is queued, so its device event is polled until it completes (or
    ``timeout``)."""
    deadline = time.monotonic() + timeout
    try:
        for work in works:
            if poll and not completed_by(work, deadline):
                return False
            work.wait()
    except Exception:
        return False
    return True


def completed_by(work: dist.Work, deadline: float) -> bool:
    """Poll an accelerator's ``work`` until its device event completes; False at ``deadline``
    (``time.monotonic()``)."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            return False
        time.sleep(DEVICE_POLL_S)
    return True


def said_count(said: str) -> int:
    """A member's collective count as the agreement exchange carries it (-1: cannot keep)."""
    try:
        return int(said)
    except ValueError:
        return -1


def shrink_exclusions(old: tuple[str, ...], new: tuple[str, ...]) -> list[int] | None:
    """The ranks of ``old`` a shrink excludes to get ``new``, when ``new`` is ``old`` without
    some members, the rest in the same order (a shrink renumbers the survivors in order);
    ``None`` when it is not (a member added, reordered, or none removed)."""
    if len(new) >= len(old) or not new:
        return None
    kept = [i for i, m in enumerate(old) if m in set(new)]
    if [old[i] for i in kept] != list(new):
        return None
    return [i for i in range(len(old)) if i not in set(kept)]


def shrinkable(pg: Any) -> bool:
    """Whether the backend can shrink this communicator in place (found at run time: NCCL
    2.27 and a PyTorch whose ProcessGroupNCCL has ``shrink``). ``elaswave doctor`` asks it too."""
    return bool(getattr(pg, "supports_shrinking", False)) and hasattr(pg, "shrink")


def accelerator_group(
    backend: str, store: dist.Store, rank: int, *, size: int, timeout: datetime.timedelta
) -> Any:
    """A process group of ``backend`` (nccl, or hccl through torch_npu) over ``store``."""
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, opts)
    if backend == "hccl":  # Ascend: torch_npu registers it (untested without the hardware)
        import importlib

        c10d = importlib.import_module("torch_npu._C._distributed_c10d")
        opts = c10d.ProcessGroupHCCL.Options()
        opts._timeout = timeout
        return c10d.ProcessGroupHCCL(store, rank, size, opts)
    raise ValueError(f"no process group for backend {backend!r}")
