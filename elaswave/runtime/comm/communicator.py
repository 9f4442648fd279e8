"""Process groups that are edited, not recreated: one group per named member set, on the
backend of the worker's device (gloo on the CPU, NCCL on CUDA, HCCL on Ascend NPUs).

Each plan names its groups (``{"dp": (w0, w1, w2)}``). :meth:`Communicator.configure` keeps a
group whose member tuple is unchanged and whose members agree it is sound, and builds only the
others, over the epoch's rendezvous store. Every collective is interruptible: it returns when its
work completes, or raises :class:`Interrupted` as soon as the control channel says a member of
the group is gone, instead of waiting for a transport timeout. Abandoned groups are parked (never
destroyed while a gloo thread may still block in them).

Keeping a group across a fault. An interrupted step leaves each group in one of two states: every
member issued the same collectives on it (those still running will complete: every member is
alive and took part), or some member issued fewer (its peers wait in a collective it will never
join). So before a group with unchanged members is reused, its members compare how many
collectives each issued on it, through the epoch's store; equal counts keep it (after its
unfinished collectives complete), anything else rebuilds it. A group with point-to-point messages
abandoned in it, or an operation that failed on it, is always rebuilt.

Accelerators. An NCCL collective whose peer died never completes on the device, and a new group
cannot be trusted to run while it spins; so every group of the old epoch that is not kept is
aborted, all of them inside one NCCL group call (aborting communicators one by one can deadlock
them), before new ones are built. Where the backend can shrink a communicator in place (NCCL
2.27 and a PyTorch with ``shrink``, found at run time), a group whose new members are its old
ones minus the lost ones, in the same order, is shrunk instead of rebuilt. On gloo, abandoned
groups are parked instead (destroying one may block in a gloo thread). Workers sharing a device
run gloo groups on host copies of their tensors (:mod:`staging`).
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elaswave.runtime.comm.backends import (
    DEVICE_POLL_S,
    accelerator_group,
    completed_by,
    finished,
    said_count,
    shrink_exclusions,
    shrinkable,
)
from elaswave.runtime.comm.staging import StagedGroup
from elaswave.runtime.device import backend_for, stages_through_host

log = logging.getLogger(__name__)
_T = TypeVar("_T")

__all__ = [
    "CommError",
    "Communicator",
    "GroupStats",
    "Interrupted",
    "Pending",
    "accelerator_group",
    "shrink_exclusions",
    "shrinkable",
]


STORE_GRACE_S = 5.0  # a store connection is waited for this much past its own timeout


class CommError(RuntimeError):
    """A collective failed (a peer died or the transport broke) or timed out."""


class Interrupted(RuntimeError):
    """A newer plan made the blocked operation pointless; go and apply it."""


@dataclass
class GroupStats:
    """What one :meth:`Communicator.configure` did to this rank's groups, and how long it took."""

    rebuilt: list[str] = field(default_factory=list)  # built (new, changed or broken before)
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # held before, gone or replaced now
    shrunk: list[str] = field(default_factory=list)  # accelerators: shrunk in place
    seconds: float = 0.0
    abort_seconds: float = 0.0  # accelerators: aborting the old epoch's groups
    shrink_seconds: float = 0.0


@dataclass
class _Group:
    members: tuple[str, ...]
    rank: int
    pg: Any  # a gloo, NCCL or HCCL process group
    healthy: bool = True  # no operation failed on it
    suspect: bool = False  # interrupted somewhere since its members last agreed on it
    collectives: int = 0  # collectives this rank issued on it
    p2p: bool = False  # point-to-point messages posted on it since its members last agreed
    pending: list[dist.Work] = field(default_factory=list)  # interrupted: maybe unfinished
    given_up: bool = False  # aborted (accelerators) or parked (gloo): never used again

    def standing(self) -> int:
        """What this rank tells the other members when they decide whether to keep the group:
        the collectives it issued on it, or -1 when it cannot be kept."""
        if not self.healthy or (self.suspect and self.p2p):
            return -1
        return self.collectives


# A collective posted and not yet waited for: its group, its work, what it is (for errors).
Pending = tuple[_Group, dist.Work, str]

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
        backend: str | None = None,  # default: the device's (workers sharing one: gloo)
        staged: bool | None = None,  # gloo through host memory; default: on an accelerator
    ) -> None:
        self.me = me
        self.device = device or torch.device("cpu")  # where the tensors it makes itself live
        self.host_addr = host_addr
        self.rendezvous_timeout = rendezvous_timeout
        self.collective_timeout = collective_timeout
        self._waker = waker
        self._groups: dict[str, _Group] = {}
        self._store: tuple[str, dist.TCPStore] | None = None  # (address, connection)
        self._graveyard: list[object] = []  # abandoned groups/threads, kept alive on purpose
        self.backend = backend or backend_for(self.device)  # gloo | nccl | hccl
        auto = stages_through_host(self.device, self.backend)  # gloo groups only (_build)
        self.staged = self.backend == "gloo" and (auto if staged is None else staged)
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
        """Make the named groups match ``groups``: keep a group whose members are unchanged
        and agree it is sound, build the others, drop what this rank no longer belongs to."""
        stats = GroupStats()
        start = time.perf_counter()
        aside = {}  # changed or gone: shrunk if the backend can, else given up below
        for name, group in list(self._groups.items()):
            if groups.get(name) != group.members:
                aside[name] = self._groups.pop(name)
                stats.dropped.append(name)
        try:
            self._configure(groups, aside, stats, store, epoch, abort)
        except (Interrupted, CommError):
            # An abandoned rendezvous may still block in the store connection, and must not
            # hold up the next plan's (TCPStore clients serialise calls): a fresh one then.
            self._store = None
            raise
        finally:  # what was put aside is never used again, whatever happened
            self._abort_all(list(aside.values()))
        stats.seconds = time.perf_counter() - start
        return stats

    def _configure(
        self,
        groups: dict[str, tuple[str, ...]],
        aside: dict[str, _Group],
        stats: GroupStats,
        store: str,
        epoch: int,
        abort: Callable[[], bool],
    ) -> None:
        # One store connection, kept from plan to plan while the store stays where it is and
        # nothing was abandoned in it (a connection costs a round trip or more). The store lives
        # in the plan's first host's daemon: if that host died it refuses the connection, which
        # is a transport error like any other (the next plan moves the store).
        if self._store is None or self._store[0] != store:
            self._store = (store, self._connect_store(store, abort))
        conn = self._store[1]
        # Every rank takes part, a newcomer too: a worker respawned under its old id is in
        # groups its peers still hold, and must tell them it does not.
        keep, shrink = self._agree(groups, aside, conn, epoch, abort)
        for name, group in list(self._groups.items()):
            if name in keep:
                group.suspect, group.p2p, group.pending = False, False, []
                stats.kept.append(name)
            else:  # unsound: built again below, under the same name
                aside[name] = self._groups.pop(name)
        t = time.perf_counter()  # the old epoch's groups, together (a shrink keeps its parent)
        self._abort_all([g for name, g in aside.items() if name not in shrink])
        stats.abort_seconds = time.perf_counter() - t
        t = time.perf_counter()
        for name in groups:  # in the plan's order on every rank: a shrink is collective
            if name in shrink:
                members = groups[name]
                pg = self._shrink(name, aside[name].pg, shrink[name], abort)
                self._groups[name] = _Group(members, members.index(self.me), pg)
                stats.shrunk.append(name)
                stats.dropped.remove(name)  # changed in place, not dropped
        stats.shrink_seconds = time.perf_counter() - t
        for name, members in groups.items():
            if name in keep or name in shrink or self.me not in members:
                continue
            rank = members.index(self.me)
            pg = self._build(name, members, rank, store=conn, epoch=epoch, abort=abort)
            self._groups[name] = _Group(members, rank, pg)
            stats.rebuilt.append(name)

    def _agree(
        self,
        groups: dict[str, tuple[str, ...]],
        aside: dict[str, _Group],
        store: dist.Store,
        epoch: int,
        abort: Callable[[], bool],
    ) -> tuple[set[str], dict[str, list[int]]]:
        """Which of this rank's groups every member can keep, and which it can shrink (with the
        old ranks each excludes). Each member publishes, for every group of the plan it belongs
        to, how many collectives it issued on it (-1: it does not hold it, or cannot keep it),
        then reads the other members' counts of the groups it holds. Equal counts: kept, once
        the collectives this rank left unfinished have completed (every member issued them, so
        they do). A group whose members changed can be shrunk when the backend can and every new
        member holds the old group with the same members (they say so in the same exchange)."""
        held = {**self._groups, **aside}
        mine = {name: m.index(self.me) for name, m in groups.items() if self.me in m}
        can_shrink = {
            name: excluded
            for name, rank in mine.items()
            if name in held
            and shrinkable(held[name].pg)
            and (excluded := shrink_exclusions(held[name].members, groups[name])) is not None
        }

        agree = dist.PrefixStore(f"epoch{epoch}/agree", store)

        def exchange() -> tuple[set[str], dict[str, list[int]]]:
            for name, rank in mine.items():  # publish every count before waiting for any
                g = held.get(name)
                if g is not None and g.members != groups[name]:
                    said = "shrink:" + "/".join(g.members) if name in can_shrink else "-1"
                else:
                    said = str(g.standing() if g is not None else -1)
                agree.set(f"{name}/{rank}", said)
            keep, shrink = set(), {}
            for name, g in held.items():
                members = groups.get(name)
                if members is None or self.me not in members:
                    continue  # this rank leaves the group
                if members != g.members and name not in can_shrink:
                    continue  # changed, and no shrink: built again
                heard = {agree.get(f"{name}/{r}").decode() for r in range(len(members))}
                if members != g.members:
                    if heard == {"shrink:" + "/".join(g.members)}:
                        shrink[name] = can_shrink[name]
                elif (
                    len(heard) == 1
                    and said_count(min(heard)) >= 0
                    and finished(g.pending, poll=self.backend != "gloo")
                ):
                    keep.add(name)
            return keep, shrink

        return self._aside(exchange, abort, self.rendezvous_timeout, "agreeing on groups to keep")

    def _build(
        self,
        name: str,
        members: tuple[str, ...],
        rank: int,
        *,
        store: dist.Store,
        epoch: int,
        abort: Callable[[], bool],
    ) -> Any:
        prefix = dist.PrefixStore(f"epoch{epoch}/{name}", store)
        timeout = datetime.timedelta(seconds=self.collective_timeout)
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit ProcessGroupGloo._Options
            opts._devices = [self._gloo_device]
            opts._timeout = timeout

            def make() -> Any:
                pg = dist.ProcessGroupGloo(prefix, rank, len(members), opts)
                return StagedGroup(pg) if self.staged else pg

        else:

            def make() -> Any:
                pg = accelerator_group(self.backend, prefix, rank, len(members), timeout)
                # NCCL (and HCCL) build the communicator at the first collective: do it here,
                # so that a failed rendezvous fails this configure, not the next step.
                one = torch.zeros(1, device=self.device)
                pg.allreduce([one]).get_future().wait()
                return pg

        return self._aside(make, abort, self.rendezvous_timeout, f"rendezvous of group {name!r}")

    def _shrink(
        self, name: str, parent: Any, excluded: list[int], abort: Callable[[], bool]
    ) -> Any:
        """A new communicator of ``parent``'s members without the ``excluded`` ranks, made in
        place by the backend (operations still running on the parent are aborted first)."""
        flags = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)
        return self._aside(
            lambda: parent.shrink(excluded, flags, None),
            abort,
            self.rendezvous_timeout,
            f"shrinking group {name!r}",
        )

    def _abort_all(self, groups: list[_Group]) -> None:
        """Give up the old epoch's groups that are not kept. On an accelerator every one is
        aborted (its collectives stuck on a dead peer stop spinning on the device), all inside
        one group call; on gloo they are parked (see the module docstring)."""
        groups = [g for g in groups if not g.given_up]
        for g in groups:
            g.given_up = True
        if not groups:
            return
        if self.backend == "gloo":
            self._graveyard.extend(groups)
            return
        # One NCCL group call around every abort (a backend without one, HCCL, aborts in turn).
        start = getattr(groups[0].pg, "_group_start", None)
        end = getattr(groups[0].pg, "_group_end", None)
        if start is not None:
            start()
        try:
            for g in groups:
                try:
                    g.pg.abort()
                except Exception as exc:  # an abort that fails leaves a dead communicator
                    log.warning("aborting a process group failed: %s", _one_line(exc))
        finally:
            if end is not None:
                end()

    def _aside(
        self, fn: Callable[[], _T], abort: Callable[[], bool], timeout: float, what: str
    ) -> _T:
        """Run ``fn`` (a blocking rendezvous) in a helper thread and wait for it interruptibly;
        whatever it raises is a :class:`CommError`."""
        result: dict[str, Any] = {}
        done, wake = threading.Event(), threading.Event()

        def run() -> None:
            try:
                result["value"] = fn()
            except Exception as exc:  # reported to the waiting thread below
                result["error"] = exc
            finally:
                done.set()
                wake.set()

        thread = threading.Thread(target=run, name=what, daemon=True)
        thread.start()
        try:
            self._wait(done.is_set, wake, abort, timeout, what)
        except (Interrupted, CommError):
            self._graveyard.append(thread)
            raise
        if "error" in result:
            raise CommError(f"{what} failed: {_one_line(result['error'])}")
        return result["value"]

    def _connect_store(self, address: str, abort: Callable[[], bool]) -> dist.TCPStore:
        """A client of the plan's store. Aside, so that a newer plan interrupts it: a store
        whose host went away refuses connections, and the client retries them until its
        timeout (the newer plan names another store). The wait outlasts the client's own
        timeout, so that without a newer plan the client gives up first and its thread ends."""
        host, _, port = address.rpartition(":")
        try:
            store = self._aside(
                lambda: dist.TCPStore(
                    host,
                    int(port),
                    is_master=False,
                    timeout=datetime.timedelta(seconds=self.rendezvous_timeout),
                    wait_for_workers=False,
                ),
                abort,
                self.rendezvous_timeout + STORE_GRACE_S,
                f"connecting to the rendezvous store {address}",
            )
        except CommError:
            self.mark_broken()  # a transport error like any other: the groups are suspect
            raise
        self._graveyard.append(store)  # kept alive with the groups built on it
        return store

    def mark_broken(self) -> None:
        """After an error or interrupt every current group is suspect: its members agree on it
        before it is used again (:meth:`configure`)."""
        for group in self._groups.values():
            group.suspect = True

    def rank(self, name: str) -> int:
        return self._groups[name].rank

    def size(self, name: str) -> int:
        return len(self._groups[name].members)

    # ---- collectives ------------------------------------------------------------------------
    def allreduce(self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        self._not_aborted(abort, f"allreduce on {name!r}")
        self._collective("allreduce", name, abort, lambda pg: pg.allreduce([tensor]))

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

    def start_allgather(
        self, name: str, out: torch.Tensor, part: torch.Tensor, abort: Callable[[], bool]
    ) -> Pending:
        """Post :meth:`allgather_into` and return at once (the work runs in the backend while
        this thread computes); :meth:`wait` for it."""
        self._not_aborted(abort, f"allgather on {name!r}")
        return self._issue(name, f"allgather on {name!r}", lambda pg: pg._allgather_base(out, part))

    def start_reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, abort: Callable[[], bool]
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
        start: Callable[[Any], dist.Work],
    ) -> None:
        """Start a collective on group ``name`` and wait for it; any failure is a CommError."""
        what = f"{op} on {name!r}"
        self._await_all([self._issue(name, what, start)], abort)

    def _issue(
        self, name: str, what: str, start: Callable[[Any], dist.Work]
    ) -> tuple[_Group, dist.Work, str]:
        """Start a collective on group ``name``, counted (see :meth:`configure`)."""
        pg = self._pg(name)
        group = self._groups[name]
        work = self._call(what, lambda: start(pg))
        group.collectives += 1
        return group, work, what

    def _await_all(
        self, started: list[tuple[_Group, dist.Work, str]], abort: Callable[[], bool]
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
            raise CommError(f"{what} failed: {_one_line(exc)}") from None

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
        self._wait(done.is_set, wake, abort, self.collective_timeout, what)
        self._call(what, work.wait)

    def _finish_on_device(self, work: dist.Work, abort: Callable[[], bool], what: str) -> None:
        """An accelerator's work: its future completes once the work is queued, not done, so
        this polls ``is_completed()`` (the device's event), interruptibly; then ``wait()``
        orders this thread's stream after it and raises the error it ended with, if any."""
        ready = lambda: self._call(what, work.is_completed)  # noqa: E731
        self._wait(ready, threading.Event(), abort, self.collective_timeout, what, DEVICE_POLL_S)
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
            self._wait(done.is_set, wake, abort, self.collective_timeout, what)
        except (Interrupted, CommError):
            self._graveyard.append(thread)
            raise
        if errors:
            self.mark_broken()
            raise CommError(f"{what} failed: {_one_line(errors[0])}")

    def _wait(
        self,
        ready: Callable[[], bool],
        wake: threading.Event,
        abort: Callable[[], bool],
        timeout: float,
        what: str,
        poll: float | None = None,
    ) -> None:
        """Wait until ``ready()``. ``wake`` is set by completion and by every control message, so
        that ``abort()`` is re-checked the moment a new plan arrives; ``poll``: also check
        ``ready()`` this often (what nothing signals: an accelerator's device event)."""
        unregister = self._waker(wake)
        deadline = time.monotonic() + timeout
        try:
            while not ready():
                if abort():
                    self.mark_broken()
                    raise Interrupted(f"{what} interrupted by a newer plan")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.mark_broken()
                    raise CommError(f"{what} timed out after {timeout:g}s")
                wake.wait(remaining if poll is None else min(poll, remaining))
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
