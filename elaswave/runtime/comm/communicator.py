"""The operations run on one rank's process groups: collectives and point-to-point messages,
every one interruptible and latching every transport error. The groups themselves, and what a new
plan does to them, are :mod:`~elaswave.runtime.comm.groups`'s.

Every collective returns when its work completes, or raises
:class:`~elaswave.runtime.comm.groups.Interrupted` as soon as the control channel says a member
of the group is gone, instead of waiting for a transport timeout. Each one is counted on its
group (see :meth:`~elaswave.runtime.comm.groups.ProcessGroups.configure` for why).
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elaswave.runtime.comm.backends import DEVICE_POLL_S, completed_by
from elaswave.runtime.comm.groups import (
    CommError,
    HeldGroup,
    Interrupted,
    ProcessGroups,
    first_line,
)

_T = TypeVar("_T")

__all__ = ["Communicator", "Pending"]


# A collective posted and not yet waited for: its group, its work, what it is (for errors).
Pending = tuple[HeldGroup, dist.Work, str]


class Communicator(ProcessGroups):
    """Collectives and point-to-point messages on the named groups of
    :class:`~elaswave.runtime.comm.groups.ProcessGroups`."""

    # ---- collectives ------------------------------------------------------------------------
    def allreduce(self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        self._not_aborted(abort, f"allreduce on {name!r}")
        self._collective("allreduce", name, abort, start=lambda pg: pg.allreduce([tensor]))

    def allreduce_many(
        self, items: list[tuple[str, torch.Tensor]], abort: Callable[[], bool]
    ) -> None:
        """SUM-reduce each ``(group, tensor)`` in place: all are started, then all are waited
        for, so ranks that share several groups never wait on each other in a cycle. Ranks that
        share a group must list its items in the same order."""
        self._not_aborted(abort, "allreduce")

        def start(t: torch.Tensor, pg: Any) -> dist.Work:
            return pg.allreduce([t])

        started = [
            self._issue(name, f"allreduce on {name!r}", functools.partial(start, tensor))
            for name, tensor in items
        ]
        self._await_all(started, abort)

    def allgather(
        self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]
    ) -> list[torch.Tensor]:
        self._pg(name)  # a group whose rebuild failed is a CommError, not a KeyError
        out = [torch.empty_like(tensor) for _ in range(self.size(name))]
        self._collective("allgather", name, abort, start=lambda pg: pg.allgather([out], [tensor]))
        return out

    def broadcast(
        self, name: str, tensor: torch.Tensor, root: int, *, abort: Callable[[], bool]
    ) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._collective("broadcast", name, abort, start=lambda pg: pg.broadcast([tensor], opts))

    def broadcast_json(self, name: str, obj: Any, root: int, *, abort: Callable[[], bool]) -> Any:
        """Send a small JSON document from ``root`` to every rank of the group (length, then
        bytes); every rank returns the root's document."""
        data = json.dumps(obj).encode() if self.rank(name) == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(name, size, root, abort=abort)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(name, buf, root, abort=abort)
        return json.loads(bytes(buf.tolist()).decode())

    def reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        """SUM-reduce ``parts[r]`` across the group into rank ``r``'s ``out``."""
        self._collective(
            "reduce_scatter", name, abort, start=lambda pg: pg.reduce_scatter([out], [parts])
        )

    def allgather_into(
        self, name: str, out: torch.Tensor, part: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        """Concatenate every rank's equally sized ``part`` into ``out`` (rank order)."""
        self._collective("allgather", name, abort, start=lambda pg: pg._allgather_base(out, part))

    def start_allgather(
        self, name: str, out: torch.Tensor, part: torch.Tensor, *, abort: Callable[[], bool]
    ) -> Pending:
        """Post :meth:`allgather_into` and return at once (the work runs in the backend while
        this thread computes); :meth:`wait` for it."""
        self._not_aborted(abort, f"allgather on {name!r}")
        return self._issue(name, f"allgather on {name!r}", lambda pg: pg._allgather_base(out, part))

    def start_reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, *, abort: Callable[[], bool]
    ) -> Pending:
        """Post :meth:`reduce_scatter` and return at once; :meth:`wait` for it."""
        self._not_aborted(abort, f"reduce_scatter on {name!r}")
        return self._issue(
            name, f"reduce_scatter on {name!r}", lambda pg: pg.reduce_scatter([out], [parts])
        )

    def start_allreduce(
        self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]
    ) -> Pending:
        """Post :meth:`allreduce` and return at once; :meth:`wait` for it."""
        self._not_aborted(abort, f"allreduce on {name!r}")
        return self._issue(name, f"allreduce on {name!r}", lambda pg: pg.allreduce([tensor]))

    def wait(self, started: list[Pending], abort: Callable[[], bool]) -> None:
        """Wait for posted collectives, in order (interruptibly, like every collective)."""
        self._await_all(list(started), abort)

    def abandon(self, started: list[Pending]) -> None:
        """Posted collectives nobody will wait for (the step was dropped): noted on their groups,
        which are agreed on again before reuse (see :meth:`configure`)."""
        for group, work, _ in started:
            group.pending.append(work)

    def exchange(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        *,
        abort: Callable[[], bool],
        tag: int = 0,
    ) -> None:
        """Point-to-point: post every send and receive (peer ranks in group ``name``), wait all."""
        # Gloo matches by (peer, tag): the k-th message between two ranks carries tag + k, so
        # both sides must list a pair's messages in the same order.
        works = self.post(
            name,
            [(peer, t, tag + k) for peer, t, k in _numbered(sends)],
            [(peer, t, tag + k) for peer, t, k in _numbered(recvs)],
        )
        self._wait_p2p(works, abort, f"send/recv on {name!r}")

    def post(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor, int]],
        recvs: list[tuple[int, torch.Tensor, int]],
    ) -> list[dist.Work]:
        """Post point-to-point ``(peer, tensor, tag)`` sends and receives; the caller waits.

        Gloo writes to a peer's socket while posting a send: if that peer has died, the post
        itself raises (``Connection closed by peer``), before any wait. That is a
        :class:`CommError` like a failed wait."""
        pg = self._pg(name)
        self._groups[name].p2p = True

        def post_all() -> list[dist.Work]:
            # Receives first. Two ranks that both post their sends first take turns, one
            # direction after the other (twice the time across a slow link: docs/benchmarks.md,
            # "Measurements behind design choices"): gloo holds a send until the peer's receive
            # is posted, and its I/O thread then writes it whole before reading more.
            works = [pg.recv([t], peer, tag) for peer, t, tag in recvs]
            return works + [pg.send([t], peer, tag) for peer, t, tag in sends]

        def post_coalesced() -> list[dist.Work]:
            # NCCL runs a communicator's operations in order on one stream: a send waits for
            # its receive, so two ranks that both send first would wait on each other. One
            # NCCL group call posts every message of the batch together.
            if not sends and not recvs:
                return []
            pg._start_coalescing()
            for peer, t, tag in sends:
                pg.send([t], peer, tag)
            for peer, t, tag in recvs:
                pg.recv([t], peer, tag)
            work = pg._end_coalescing()
            return [work] if work is not None else []

        post = post_all if self.backend == "gloo" else post_coalesced
        return self._call(f"send/recv on {name!r}", post)

    def p2p(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor, int]],
        recvs: list[tuple[int, torch.Tensor, int]],
        *,
        abort: Callable[[], bool],
    ) -> None:
        """Post sends and receives together, then wait for all of them (interruptibly)."""
        self._not_aborted(abort, f"send/recv on {name!r}")
        self._wait_p2p(self.post(name, sends, recvs), abort, f"send/recv on {name!r}")

    def _wait_p2p(self, works: list[dist.Work], abort: Callable[[], bool], what: str) -> None:
        """Wait for posted point-to-point work: gloo progresses it only inside ``wait()`` (a
        helper thread); an accelerator's completes on the device (its future)."""
        if self.backend == "gloo":
            self._wait_in_thread(works, abort, what)
            return
        for work in works:
            self._finish(work, abort, what)

    def _collective(
        self,
        op: str,
        name: str,
        abort: Callable[[], bool],
        *,
        start: Callable[[Any], dist.Work],
    ) -> None:
        """Start a collective on group ``name`` and wait for it; any failure is a CommError."""
        what = f"{op} on {name!r}"
        self._await_all([self._issue(name, what, start)], abort)

    def _issue(
        self, name: str, what: str, start: Callable[[Any], dist.Work]
    ) -> tuple[HeldGroup, dist.Work, str]:
        """Start a collective on group ``name``, counted (see :meth:`configure`)."""
        pg = self._pg(name)
        group = self._groups[name]
        work = self._call(what, lambda: start(pg))
        group.collectives += 1
        return group, work, what

    def _await_all(
        self, started: list[tuple[HeldGroup, dist.Work, str]], abort: Callable[[], bool]
    ) -> None:
        """Wait for started collectives in order. Interrupted: the unfinished ones are noted on
        their groups; failed: that group is unusable."""
        for i, (group, work, what) in enumerate(started):
            try:
                self._finish(work, abort, what)
            except Interrupted:
                for g, w, _ in started[i:]:
                    g.pending.append(w)
                raise
            except CommError:
                group.healthy = False
                for g, w, _ in started[i + 1 :]:
                    g.pending.append(w)
                raise

    def _pg(self, name: str) -> Any:
        group = self._groups.get(name)
        if group is None:  # a rebuild of this group failed: nothing to run it on
            raise CommError(f"group {name!r} is not built (its rendezvous failed)")
        return group.pg

    def _call(self, what: str, fn: Callable[[], _T]) -> _T:
        """Run ``fn`` (posting work to the transport, or connecting to the store). Whatever it
        raises is a transport error: the groups are suspect and the step's error latches."""
        try:
            return fn()
        except Exception as exc:
            self.mark_broken()
            raise CommError(f"{what} failed: {first_line(exc)}") from None

    def _not_aborted(self, abort: Callable[[], bool], what: str) -> None:
        """Never start a collective with a group a newer plan has already broken: a member that
        was removed alive (an evicted straggler) would otherwise complete its peers' abandoned
        collective late."""
        if abort():
            self.mark_broken()
            raise Interrupted(f"{what} interrupted by a newer plan")

    def _finish(self, work: dist.Work, abort: Callable[[], bool], what: str) -> None:
        if self.backend != "gloo":
            self._finish_on_device(work, abort, what)
            return
        done, wake = threading.Event(), threading.Event()

        def on_done(_: object) -> None:
            done.set()
            wake.set()

        try:
            future = work.get_future()
        except RuntimeError:  # point-to-point work has no future in gloo
            self._wait_in_thread([work], abort, what)
            return
        future.add_done_callback(on_done)
        self._wait(done.is_set, wake, abort, timeout=self.collective_timeout, what=what)
        self._call(what, work.wait)

    def _finish_on_device(self, work: dist.Work, abort: Callable[[], bool], what: str) -> None:
        """An accelerator's work: its future completes once the work is queued, not done, so
        this polls ``is_completed()`` (the device's event), interruptibly; then ``wait()``
        orders this thread's stream after it and raises the error it ended with, if any."""
        ready = lambda: self._call(what, work.is_completed)  # noqa: E731
        self._wait(
            ready,
            threading.Event(),
            abort,
            timeout=self.collective_timeout,
            what=what,
            poll=DEVICE_POLL_S,
        )
        self._call(what, work.wait)

    def wait_done(self, works: list[dist.Work]) -> None:
        """Block until posted work has completed (a background thread's wait: a migration's
        messages). Gloo progresses point-to-point work inside ``wait()`` (bounded by the
        group's timeout); an accelerator's is polled until its device event completes, at most
        the collective timeout (then :class:`CommError`: the next plan voids the migration)."""
        deadline = time.monotonic() + self.collective_timeout
        for work in works:
            if self.backend != "gloo" and not completed_by(work, deadline):
                raise CommError(f"point-to-point work timed out after {self.collective_timeout:g}s")
            work.wait()

    def _wait_in_thread(self, works: list[dist.Work], abort: Callable[[], bool], what: str) -> None:
        """Gloo point-to-point work progresses only inside ``wait()``: run those waits in one
        helper thread (all of a batch, in order) and keep this one interruptible."""
        done, wake = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def run() -> None:
            try:
                for work in works:
                    work.wait()
            except BaseException as exc:  # handed to the waiting thread
                errors.append(exc)
            finally:
                done.set()
                wake.set()

        thread = threading.Thread(target=run, name="p2p-wait", daemon=True)
        thread.start()
        try:
            self._wait(done.is_set, wake, abort, timeout=self.collective_timeout, what=what)
        except (Interrupted, CommError):
            self._graveyard.append(thread)
            raise
        if errors:
            self.mark_broken()
            raise CommError(f"{what} failed: {first_line(errors[0])}")


def _numbered(items: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor, int]]:
    """Number each message by how many went to (or came from) the same peer before it."""
    seen: dict[int, int] = {}
    out = []
    for peer, tensor in items:
        out.append((peer, tensor, seen.get(peer, 0)))
        seen[peer] = seen.get(peer, 0) + 1
    return out
