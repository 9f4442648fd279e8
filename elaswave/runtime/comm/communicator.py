"""Process groups that are edited, not recreated: one gloo group per named member set.

Each plan names its groups (``{"dp": (w0, w1, w2)}``). :meth:`Communicator.configure` keeps a
group whose member tuple is unchanged and healthy, and builds only the others, over the epoch's
rendezvous store. Every collective is interruptible: it returns when its work completes, or raises
:class:`Interrupted` as soon as the control channel says a member of the group is gone, instead of
waiting for a transport timeout. Abandoned groups are parked (never destroyed while a gloo thread
may still block in them).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
_T = TypeVar("_T")


class CommError(RuntimeError):
    """A collective failed (a peer died or the transport broke) or timed out."""


class Interrupted(RuntimeError):
    """A newer plan made the blocked operation pointless; go and apply it."""


@dataclass
class GroupStats:
    rebuilt: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Group:
    members: tuple[str, ...]
    rank: int
    pg: dist.ProcessGroupGloo
    healthy: bool = True


# (wake event registration, abort predicate): supplied by the engine from its control channel.
Waker = Callable[[threading.Event], Callable[[], None]]


class Communicator:
    def __init__(
        self,
        *,
        me: str,
        host_addr: str,
        rendezvous_timeout: float,
        collective_timeout: float,
        waker: Waker,
        device: torch.device | None = None,
    ) -> None:
        self.me = me
        self.device = device or torch.device("cpu")  # where the tensors it makes itself live
        self.host_addr = host_addr
        self.rendezvous_timeout = rendezvous_timeout
        self.collective_timeout = collective_timeout
        self._waker = waker
        self._groups: dict[str, _Group] = {}
        self._graveyard: list[object] = []  # abandoned groups/threads, kept alive on purpose
        self._gloo_device = dist.ProcessGroupGloo.create_device(hostname=host_addr)

    # ---- groups -----------------------------------------------------------------------------
    def configure(
        self,
        groups: dict[str, tuple[str, ...]],
        *,
        store: str,
        epoch: int,
        abort: Callable[[], bool],
    ) -> GroupStats:
        """Make the named groups match ``groups``; rebuild only what changed or broke."""
        stats = GroupStats()
        start = time.perf_counter()
        for name in list(self._groups):
            if name not in groups:
                self._bury(name)
        for name, members in groups.items():
            current = self._groups.get(name)
            if current is not None and current.healthy and current.members == members:
                stats.kept.append(name)
                continue
            if current is not None:
                self._bury(name)
            if self.me not in members:
                continue
            rank = members.index(self.me)
            pg = self._build(name, members, rank, store=store, epoch=epoch, abort=abort)
            self._groups[name] = _Group(members, rank, pg)
            stats.rebuilt.append(name)
        stats.seconds = time.perf_counter() - start
        return stats

    def _build(
        self,
        name: str,
        members: tuple[str, ...],
        rank: int,
        *,
        store: str,
        epoch: int,
        abort: Callable[[], bool],
    ) -> dist.ProcessGroupGloo:
        # A fresh store connection per build: an abandoned rendezvous may still block in its
        # own connection, and must not hold up the next one (TCPStore clients serialise calls).
        # The store lives in the plan's first host's daemon: if that host died it refuses the
        # connection, which is a transport error like any other (the next plan moves the store).
        prefix = dist.PrefixStore(f"epoch{epoch}/{name}", self._connect_store(store))
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [self._gloo_device]
        opts._timeout = datetime.timedelta(seconds=self.collective_timeout)
        result: dict[str, object] = {}
        done, wake = threading.Event(), threading.Event()

        def connect() -> None:
            try:
                result["pg"] = dist.ProcessGroupGloo(prefix, rank, len(members), opts)
            except Exception as exc:  # reported to the waiting thread below
                result["error"] = exc
            finally:
                done.set()
                wake.set()

        thread = threading.Thread(target=connect, name=f"rendezvous-{name}", daemon=True)
        thread.start()
        self._wait(done, wake, abort, self.rendezvous_timeout, f"rendezvous of group {name!r}")
        if "error" in result:
            raise CommError(f"rendezvous of group {name!r} failed: {_one_line(result['error'])}")
        return result["pg"]  # type: ignore[return-value]

    def _connect_store(self, address: str) -> dist.TCPStore:
        host, _, port = address.rpartition(":")
        store = self._call(
            f"connecting to the rendezvous store {address}",
            lambda: dist.TCPStore(
                host,
                int(port),
                is_master=False,
                timeout=datetime.timedelta(seconds=self.rendezvous_timeout),
                wait_for_workers=False,
            ),
        )
        self._graveyard.append(store)  # kept alive with the groups built on it
        return store

    def _bury(self, name: str) -> None:
        group = self._groups.pop(name)
        self._graveyard.append(group)

    def mark_broken(self) -> None:
        """After an error or interrupt every current group is suspect: rebuild on next configure."""
        for group in self._groups.values():
            group.healthy = False

    def rank(self, name: str) -> int:
        return self._groups[name].rank

    def size(self, name: str) -> int:
        return len(self._groups[name].members)

    # ---- collectives ------------------------------------------------------------------------
    def allreduce(self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        self._not_aborted(abort, f"allreduce on {name!r}")
        self._collective("allreduce", name, abort, lambda pg: pg.allreduce([tensor]))

    def allgather(
        self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]
    ) -> list[torch.Tensor]:
        self._pg(name)  # a group whose rebuild failed is a CommError, not a KeyError
        out = [torch.empty_like(tensor) for _ in range(self.size(name))]
        self._collective("allgather", name, abort, lambda pg: pg.allgather([out], [tensor]))
        return out

    def broadcast(
        self, name: str, tensor: torch.Tensor, root: int, abort: Callable[[], bool]
    ) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._collective("broadcast", name, abort, lambda pg: pg.broadcast([tensor], opts))

    def broadcast_json(self, name: str, obj: Any, root: int, abort: Callable[[], bool]) -> Any:
        """Send a small JSON document from ``root`` to every rank of the group (length, then
        bytes); every rank returns the root's document."""
        data = json.dumps(obj).encode() if self.rank(name) == root else b""
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        self.broadcast(name, size, root, abort)
        buf = torch.zeros(int(size.item()), dtype=torch.uint8, device=self.device)
        if data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(name, buf, root, abort)
        return json.loads(bytes(buf.tolist()).decode())

    def reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, abort: Callable[[], bool]
    ) -> None:
        """SUM-reduce ``parts[r]`` across the group into rank ``r``'s ``out``."""
        self._collective(
            "reduce_scatter", name, abort, lambda pg: pg.reduce_scatter([out], [parts])
        )

    def allgather_into(
        self, name: str, out: torch.Tensor, part: torch.Tensor, abort: Callable[[], bool]
    ) -> None:
        """Concatenate every rank's equally sized ``part`` into ``out`` (rank order)."""
        self._collective("allgather", name, abort, lambda pg: pg._allgather_base(out, part))

    def exchange(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
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
        self._wait_in_thread(works, abort, f"send/recv on {name!r}")

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

        def post_all() -> list[dist.Work]:
            works = [pg.send([t], peer, tag) for peer, t, tag in sends]
            return works + [pg.recv([t], peer, tag) for peer, t, tag in recvs]

        return self._call(f"send/recv on {name!r}", post_all)

    def p2p(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor, int]],
        recvs: list[tuple[int, torch.Tensor, int]],
        abort: Callable[[], bool],
    ) -> None:
        """Post sends and receives together, then wait for all of them (interruptibly)."""
        self._not_aborted(abort, f"send/recv on {name!r}")
        self._wait_in_thread(self.post(name, sends, recvs), abort, f"send/recv on {name!r}")

    def _collective(
        self,
        op: str,
        name: str,
        abort: Callable[[], bool],
        start: Callable[[dist.ProcessGroupGloo], dist.Work],
    ) -> None:
        """Start a collective on group ``name`` and wait for it; any failure is a CommError."""
        what = f"{op} on {name!r}"
        pg = self._pg(name)
        self._finish(self._call(what, lambda: start(pg)), abort, what)

    def _pg(self, name: str) -> dist.ProcessGroupGloo:
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
            raise CommError(f"{what} failed: {_one_line(exc)}") from None

    def _not_aborted(self, abort: Callable[[], bool], what: str) -> None:
        """Never start a collective with a group a newer plan has already broken: a member that
        was removed alive (an evicted straggler) would otherwise complete its peers' abandoned
        collective late."""
        if abort():
            self.mark_broken()
            raise Interrupted(f"{what} interrupted by a newer plan")

    def _finish(self, work: dist.Work, abort: Callable[[], bool], what: str) -> None:
        done, wake = threading.Event(), threading.Event()

        def finished(_: object) -> None:
            done.set()
            wake.set()

        try:
            future = work.get_future()
        except RuntimeError:  # point-to-point work has no future in gloo
            self._wait_in_thread([work], abort, what)
            return
        future.add_done_callback(finished)
        self._wait(done, wake, abort, self.collective_timeout, what)
        self._call(what, work.wait)

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
            self._wait(done, wake, abort, self.collective_timeout, what)
        except (Interrupted, CommError):
            self._graveyard.append(thread)
            raise
        if errors:
            self.mark_broken()
            raise CommError(f"{what} failed: {_one_line(errors[0])}")

    def _wait(
        self,
        done: threading.Event,
        wake: threading.Event,
        abort: Callable[[], bool],
        timeout: float,
        what: str,
    ) -> None:
        """Wait for ``done``. ``wake`` is set by completion and by every control message, so that
        ``abort()`` is re-checked the moment a new plan arrives."""
        unregister = self._waker(wake)
        deadline = time.monotonic() + timeout
        try:
            while not done.is_set():
                if abort():
                    self.mark_broken()
                    raise Interrupted(f"{what} interrupted by a newer plan")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.mark_broken()
                    raise CommError(f"{what} timed out after {timeout:g}s")
                wake.wait(remaining)
                wake.clear()
        finally:
            unregister()


def _numbered(items: list[tuple[int, torch.Tensor]]) -> list[tuple[int, torch.Tensor, int]]:
    """Number each message by how many went to (or came from) the same peer before it."""
    seen: dict[int, int] = {}
    out = []
    for peer, tensor in items:
        out.append((peer, tensor, seen.get(peer, 0)))
        seen[peer] = seen.get(peer, 0) + 1
    return out


def _one_line(exc: object) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
