"""The worker's end of the control channel: plans and faults in, events and commits out.

A reader thread keeps the latest plan and wakes whatever the engine is blocked on (a collective, a
rendezvous) so that a fault seen by the daemon cuts a blocked collective short instead of waiting
for its timeout. If the daemon goes away the worker exits: it never outlives its supervisor.

Training never waits on the daemon: reports (commits, events, heartbeats) go into a queue that a
sender thread drains. A daemon that stops reading for a while (a long pause) fills the socket, not
the training loop; everything queued reaches it, in order, once it reads again.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from elaswave import wire
from elaswave.faults import FaultSpec
from elaswave.planning.plan import Plan

log = logging.getLogger(__name__)


class ControlClient:
    def __init__(self, path: str, worker_id: str) -> None:
        self.worker_id = worker_id
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.connect(path)
        self._outbox: collections.deque[bytes] = collections.deque()
        self._outbox_ready = threading.Condition()
        self._beat: bytes | None = None
        self._writing = False
        self._cond = threading.Condition()
        self._wakers: set[threading.Event] = set()
        self.latest_plan: Plan | None = None
        self.config: wire.Config | None = None
        self.faults: list[FaultSpec] = []
        self.stop_requested = False
        self.preempt_requested: str | None = None  # the signal that preempts this host
        self.activation: wire.Activate | None = None  # a warm spare: the place it took
        self._reader = threading.Thread(target=self._read_loop, name="control-reader", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._send_loop, name="control-sender", daemon=True)
        self._sender.start()
        self.send(wire.Hello(worker_id=worker_id, pid=os.getpid()))

    # ---- outgoing ---------------------------------------------------------------------------
    def send(self, msg: wire.WorkerMessage) -> None:
        """Queue ``msg`` for the daemon and return at once (the sender thread writes it)."""
        data = wire.encode(msg)
        with self._outbox_ready:
            if isinstance(msg, wire.Heartbeat):
                self._beat = data  # only the newest heartbeat matters: one slot, not a backlog
            else:
                self._outbox.append(data)
            self._outbox_ready.notify_all()

    def _send_loop(self) -> None:
        """Write queued messages in order, then the newest heartbeat. Best effort: if the daemon
        is gone the reader thread ends this process; a failed write must not end it first."""
        while True:
            with self._outbox_ready:
                self._outbox_ready.wait_for(lambda: bool(self._outbox) or self._beat is not None)
                batch = b"".join(self._outbox) + (self._beat or b"")
                self._outbox.clear()
                self._beat = None
                self._writing = True
            try:
                self._sock.sendall(batch)
            except OSError as exc:
                log.warning("control channel: could not send: %s", exc)
                return
            finally:
                with self._outbox_ready:
                    self._writing = False
                    self._outbox_ready.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until every queued message is written (``False``: not within ``timeout``)."""
        with self._outbox_ready:
            return self._outbox_ready.wait_for(
                lambda: not self._outbox and not self._writing, timeout
            )

    def start_heartbeat(self, interval: float, probe: Callable[[], wire.Heartbeat]) -> None:
        """Send ``probe()`` every ``interval`` seconds from a daemon thread.

        The daemon declares the worker hung when beats stop (the process is frozen) or when the
        probe reports one compute phase, or evaluation, lasting longer than its bound.
        """

        def beat() -> None:
            while True:
                self.send(probe())
                time.sleep(interval)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()

    def event(self, kind: str, **fields: Any) -> None:
        self.send(wire.Event({"t": time.time(), "kind": kind, **fields}))

    # ---- incoming ---------------------------------------------------------------------------
    def _read_loop(self) -> None:
        buf = b""
        while True:
            try:
                chunk = self._sock.recv(65536)
            except OSError:
                chunk = b""
            if not chunk:
                log.error("control channel closed by the daemon; exiting")
                os._exit(17)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                try:
                    msg = wire.decode(line)
                except wire.WireError as exc:
                    log.warning("dropped a control message from the daemon: %s", exc)
                    continue
                self._dispatch(msg)

    def _dispatch(self, msg: wire.Message) -> None:
        handler = HANDLERS.get(type(msg))
        if handler is None:
            log.warning("dropped a control message the worker does not take: %r", msg.TYPE)
            return
        with self._cond:
            handler(self, msg)
            self._cond.notify_all()
            for ev in self._wakers:
                ev.set()

    def _on_config(self, msg: wire.Config) -> None:
        self.config = msg

    def _on_plan(self, msg: wire.PlanUpdate) -> None:
        if self.latest_plan is None or msg.plan.epoch > self.latest_plan.epoch:
            self.latest_plan = msg.plan

    def _on_fault(self, msg: wire.Fault) -> None:
        self.faults.append(msg.fault)

    def _on_stop(self, msg: wire.Stop) -> None:
        self.stop_requested = True

    def _on_preempt(self, msg: wire.Preempt) -> None:
        self.preempt_requested = msg.signal

    def _on_activate(self, msg: wire.Activate) -> None:
        self.activation = msg

    # ---- waiting ----------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Block until ``predicate()`` holds (re-checked on every message) or ``timeout``
        (None: as long as it takes)."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    def wake_on_message(self, ev: threading.Event) -> Callable[[], None]:
        """Set ``ev`` whenever a message arrives; returns the function that unregisters it."""
        with self._cond:
            self._wakers.add(ev)

        def unregister() -> None:
            with self._cond:
                self._wakers.discard(ev)

        return unregister

    @property
    def latest_epoch(self) -> int:
        return self.latest_plan.epoch if self.latest_plan else 0

    def removes_any(self, members: tuple[str, ...]) -> bool:
        """True if a newer plan has dropped any of ``members`` (their group is broken)."""
        plan = self.latest_plan
        return plan is not None and any(m not in plan.workers for m in members)

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


# What each message from the daemon does on the worker.
HANDLERS: dict[type[wire.Message], Callable[[ControlClient, Any], None]] = {
    wire.Config: ControlClient._on_config,
    wire.PlanUpdate: ControlClient._on_plan,
    wire.Fault: ControlClient._on_fault,
    wire.Stop: ControlClient._on_stop,
    wire.Preempt: ControlClient._on_preempt,
    wire.Activate: ControlClient._on_activate,
}
