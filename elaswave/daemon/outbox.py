"""Writes to etcd that must land even if etcd is away for a while.

The daemon never waits on etcd where a worker waits on the daemon. What it must tell etcd (a
worker registered, a worker departed, the job's progress, the job done) goes into an
:class:`Outbox`: one task writes the items in order, and an item that fails because etcd does not
answer stays at the head until etcd answers again. Items that only ever need their newest value
(the progress record) take one slot each, so an outage never builds a backlog of stale copies.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from elaswave.errors import EtcdUnavailable

log = logging.getLogger(__name__)

Write = Callable[[], Awaitable[Any]]


class Outbox:
    """An ordered queue of etcd writes, retried while etcd is unreachable.

    ``up`` is set while etcd answers (the daemon's lease keep-alive sets and clears it); a write
    that raises :class:`EtcdUnavailable` clears it and waits for it. Any other error is a bad
    write (a key whose lease is gone, say): logged and dropped, never retried forever.
    """

    def __init__(self, up: asyncio.Event, on_unreachable: Callable[[str], None]) -> None:
        self.up = up
        self._on_unreachable = on_unreachable
        self._queue: collections.deque[tuple[str, Write]] = collections.deque()
        self._latest: dict[str, Write] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, what: str, write: Write) -> None:
        """Queue ``write`` (a coroutine factory, called when its turn comes)."""
        self._queue.append((what, write))
        self._kick()

    def latest(self, slot: str, write: Write) -> None:
        """Replace whatever is pending under ``slot`` by ``write`` (written after the queue)."""
        self._latest[slot] = write
        self._kick()

    def drop(self, slot: str) -> None:
        """Forget what is pending under ``slot`` (a value that must not land any more)."""
        self._latest.pop(slot, None)

    def _kick(self) -> None:
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._latest)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue or self._latest:
                if self._queue:
                    what, write = self._queue[0]
                else:
                    what = next(iter(self._latest))
                    write = self._latest[what]
                if not await self._attempt(what, write):
                    await self.up.wait()
                    continue
                if self._queue and self._queue[0][1] is write:
                    self._queue.popleft()
                elif self._latest.get(what) is write:
                    del self._latest[what]
            self._idle.set()

    async def _attempt(self, what: str, write: Write) -> bool:
        """True once the write is done with (landed, or dropped as bad); False: etcd is away."""
        try:
            await write()
        except EtcdUnavailable as exc:
            self.up.clear()
            self._on_unreachable(str(exc))
            return False
        except Exception as exc:  # noqa: BLE001 - a write etcd refused: report it, go on
            log.warning("dropped an etcd write (%s): %s", what, exc)
        return True

    async def drain(self, timeout: float) -> bool:
        """Wait until everything queued has landed (``False``: not within ``timeout``)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True
