"""The daemon's end of the control channel: a Unix socket (0600, in a 0700 directory).

Reachable only by processes of the same user on the same host. Each connection belongs to one
worker once it says ``hello``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
from collections.abc import Awaitable, Callable

from elaswave import wire
from elaswave.daemon.aio import wait_for
from elaswave.owneddirs import new_owned_dir

log = logging.getLogger(__name__)


class WorkerConn:
    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        self.worker_id: str | None = None

    def send(self, msg: wire.DaemonMessage) -> None:
        if self.writer.is_closing():
            return
        try:
            self.writer.write(wire.encode(msg))
        except (ConnectionError, RuntimeError):
            pass

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


Handler = Callable[[WorkerConn, wire.WorkerMessage], Awaitable[None]]


CONTROL_PREFIX = "elaswave-ctl-"


class ControlServer:
    def __init__(self, on_message: Handler, on_disconnect: Callable[[WorkerConn], None]) -> None:
        self._on_message = on_message
        self._on_disconnect = on_disconnect
        # the socket's directory names this daemon: one SIGKILLed leaves it, the next sweeps it
        self._dir = str(new_owned_dir(CONTROL_PREFIX))
        self.path = os.path.join(self._dir, "control.sock")
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        old_umask = os.umask(0o177)
        try:
            self._server = await asyncio.start_unix_server(
                self._serve, path=self.path, limit=wire.MAX_LINE
            )
        finally:
            os.umask(old_umask)
        os.chmod(self.path, 0o600)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = WorkerConn(writer)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ConnectionError, ValueError):
                    break
                if not line:
                    break
                try:
                    msg = wire.decode(line)
                except wire.WireError as exc:
                    log.warning("dropped a control message from %s: %s", conn.worker_id, exc)
                    continue
                if not isinstance(msg, wire.WorkerMessage):
                    log.warning("dropped a %r message from a worker", msg.TYPE)
                    continue
                if isinstance(msg, wire.Hello):
                    conn.worker_id = msg.worker_id
                await self._on_message(conn, msg)
        finally:
            self._on_disconnect(conn)
            conn.close()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await wait_for(self._server.wait_closed(), 1.0)
        shutil.rmtree(self._dir, ignore_errors=True)
