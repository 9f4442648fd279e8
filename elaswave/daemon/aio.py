"""asyncio helpers the daemon's loops rely on."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

_T = TypeVar("_T")

__all__ = ["wait_for"]


async def wait_for(aw: Awaitable[_T], timeout: float | None) -> _T:
    """``asyncio.wait_for`` that never swallows a cancellation.

    Before Python 3.12, ``asyncio.wait_for`` returns the inner result when the caller is
    cancelled just as that result arrives; the cancellation is then lost and a loop that
    should stop runs on (a host's lease keep-alive that never ends, and whoever awaits it with
    it). Here a cancellation that arrived while waiting is raised once the wait returns."""
    task = asyncio.current_task()
    counted = task is not None and hasattr(task, "cancelling")  # Python 3.11+
    before = task.cancelling() if counted and task is not None else 0
    result = await asyncio.wait_for(aw, timeout)
    if counted and task is not None and task.cancelling() > before:
        raise asyncio.CancelledError
    return result
