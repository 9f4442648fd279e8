"""Writes to etcd that must land even if etcd is away for a while.

The daemon never waits on etcd where a worker waits on the daemon. What it must tell etcd (a
worker registered, a worker departed, a step's record, the job done) goes into an :class:`Outbox`:
one task writes the items in order, and an item that fails because etcd does not answer stays at
the head until etcd answers again. If etcd never does, the daemon's last act runs each item's
fallback (a step's record is then written locally).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from elaswave.daemon.aio import wait_for
from elaswave.errors import EtcdUnavailable

log = logging.getLogger(__name__)

Write = Callable[[], Awaitable[Any]]
Fallback = Callable[[], Any]


class Outbox:
    """An ordered queue of etcd writes, retried while etcd is unreachable.

    ``up`` is set while etcd answers (the daemon's lease keep-alive sets and clears it); a write
    that raises :class:`EtcdUnavailable` clears it and waits for it. Any other error is a bad
    write (a key whose lease is gone, say): logged and dropped, never retried forever.
    """

    def __init__(self, up: asyncio.Event, on_unreachable: Callable[[str], None]) -> None:
        self.up = up
        self._on_unreachable = on_unreachable
        self._queue: collections.deque[tuple[str, Write, Fallback | None]] = collections.deque()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    def put(self, what: str, write: Write, fallback: Fallback | None = None) -> None:
        """Queue ``write`` (a coroutine factory, called when its turn comes); ``fallback`` is
        what to do instead if etcd never answers again (:meth:`abandon`)."""
        self._queue.append((what, write, fallback))
        self._idle.clear()
        self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                what, write, _ = self._queue[0]
                if not await self._attempt(what, write):
                    await self.up.wait()
                    continue
                self._queue.popleft()
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
            await wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def abandon(self) -> None:
        """etcd is gone for good (the daemon is leaving): run the fallbacks of what is still
        queued, in order, and forget the rest."""
        for _, _, fallback in self._queue:
            if fallback is not None:
                fallback()
        self._queue.clear()
