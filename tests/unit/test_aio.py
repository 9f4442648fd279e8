"""The daemon's bounded waits never lose a cancellation."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from elaswave.daemon.aio import wait_for

DAEMON = Path(__file__).resolve().parents[2] / "elaswave" / "daemon"


async def _cancelled_as_result_arrives(wait: Callable[[Awaitable[Any], float], Any]) -> str:
    """A task waits on a future with a timeout; the future's result and a cancellation of the
    task arrive in the same loop iteration (a lease refresh answered while the host shuts
    down)."""
    fut = asyncio.get_running_loop().create_future()

    async def waiter() -> str:
        await wait(fut, 10.0)
        return "ran on"

    task = asyncio.create_task(waiter())
    for _ in range(2):
        await asyncio.sleep(0)
    fut.set_result(None)
    task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        return "cancelled"


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Task.cancelling() is Python 3.11+")
def test_a_cancellation_that_arrives_with_the_result_is_raised() -> None:
    assert asyncio.run(_cancelled_as_result_arrives(wait_for)) == "cancelled"


def test_the_result_and_the_timeout_are_those_of_asyncio() -> None:
    async def main() -> None:
        assert await wait_for(asyncio.sleep(0, "x"), 1.0) == "x"
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(asyncio.sleep(5), 0.01)

    asyncio.run(main())


def test_the_daemon_waits_only_through_the_helper() -> None:
    users = [p.name for p in DAEMON.glob("*.py") if p.name != "aio.py"
             and "asyncio.wait_for(" in p.read_text()]  # fmt: skip
    assert users == []
