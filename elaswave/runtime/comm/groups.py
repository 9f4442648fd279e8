"""The named process groups of one rank, edited from plan to plan, not recreated: one group per
named member set, on the backend of the worker's device (gloo on the CPU, NCCL on CUDA, HCCL on
Ascend NPUs). :class:`ProcessGroups` keeps, shrinks, builds and gives up groups and waits for
their blocking calls interruptibly; the operations run on them (collectives, point-to-point) are
:class:`~elaswave.runtime.comm.communicator.Communicator`'s, kept apart so that what a new plan
does to the groups reads on its own.

Each plan names its groups (``{"dp": (w0, w1, w2)}``). :meth:`ProcessGroups.configure` keeps a
group whose member tuple is unchanged and whose members agree it is sound, and builds only the
others, over the epoch's rendezvous store. Abandoned groups are parked (never destroyed while a
gloo thread may still block in them).

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
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from elaswave.runtime.comm.backends import (
    accelerator_group,
    finished,
    said_count,
    shrink_exclusions,
    shrinkable,
)
from elaswave.runtime.comm.staging import StagedGroup
from elaswave.runtime.device import backend_for, stages_through_host

log = logging.getLogger(__name__)
_T = TypeVar("_T")


STORE_GRACE_S = 5.0  # a store connection is waited for this much past its own timeout


class CommError(RuntimeError):
    """A collective failed (a peer died or the transport broke) or timed out."""


class Interrupted(RuntimeError):
    """A newer plan made the blocked operation pointless; go and apply it."""


@dataclass
class GroupStats:
    """What one :meth:`ProcessGroups.configure` did to this rank's groups, and how long it took."""

    rebuilt: list[str] = field(default_factory=list)  # built (new, changed or broken before)
    kept: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)  # held before, gone or replaced now
    shrunk: list[str] = field(default_factory=list)  # accelerators: shrunk in place
    seconds: float = 0.0
    abort_seconds: float = 0.0  # accelerators: aborting the old epoch's groups
    shrink_seconds: float = 0.0


@dataclass
class HeldGroup:
    """A named group this rank holds: its members, its rank in it, the backend's group, and what
    decides whether it can be kept."""

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


# (wake event registration, abort predicate): supplied by the engine from its control channel.
Waker = Callable[[threading.Event], Callable[[], None]]


class ProcessGroups:
    """One rank's named process groups, the store connection they are built over, and the
    interruptible wait every blocking call on them goes through."""

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
        self._groups: dict[str, HeldGroup] = {}
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
            self._configure(groups, aside, stats, store=store, epoch=epoch, abort=abort)
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
        aside: dict[str, HeldGroup],
        stats: GroupStats,
        *,
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
        keep, shrink = self._agree(groups, aside, conn, epoch=epoch, abort=abort)
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
                pg = self._shrink(name, aside[name].pg, shrink[name], abort=abort)
                self._groups[name] = HeldGroup(members, members.index(self.me), pg)
                stats.shrunk.append(name)
                stats.dropped.remove(name)  # changed in place, not dropped
        stats.shrink_seconds = time.perf_counter() - t
        for name, members in groups.items():
            if name in keep or name in shrink or self.me not in members:
                continue
            rank = members.index(self.me)
            pg = self._build(name, members, rank, store=conn, epoch=epoch, abort=abort)
            self._groups[name] = HeldGroup(members, rank, pg)
            stats.rebuilt.append(name)

    def _agree(
        self,
        groups: dict[str, tuple[str, ...]],
        aside: dict[str, HeldGroup],
        store: dist.Store,
        *,
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

        return self._aside(
            exchange, abort, self.rendezvous_timeout, what="agreeing on groups to keep"
        )

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
                pg = accelerator_group(
                    self.backend, prefix, rank, size=len(members), timeout=timeout
                )
                # NCCL (and HCCL) build the communicator at the first collective: do it here,
                # so that a failed rendezvous fails this configure, not the next step.
                one = torch.zeros(1, device=self.device)
                pg.allreduce([one]).get_future().wait()
                return pg

        return self._aside(
            make, abort, self.rendezvous_timeout, what=f"rendezvous of group {name!r}"
        )

    def _shrink(
        self, name: str, parent: Any, excluded: list[int], *, abort: Callable[[], bool]
    ) -> Any:
        """A new communicator of ``parent``'s members without the ``excluded`` ranks, made in
        place by the backend (operations still running on the parent are aborted first)."""
        flags = getattr(dist.distributed_c10d, "SHRINK_ABORT", 1)
        return self._aside(
            lambda: parent.shrink(excluded, flags, None),
            abort,
            self.rendezvous_timeout,
            what=f"shrinking group {name!r}",
        )

    def _abort_all(self, groups: list[HeldGroup]) -> None:
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
                    log.warning("aborting a process group failed: %s", first_line(exc))
        finally:
            if end is not None:
                end()

    def _aside(
        self, fn: Callable[[], _T], abort: Callable[[], bool], timeout: float, *, what: str
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
            self._wait(done.is_set, wake, abort, timeout=timeout, what=what)
        except (Interrupted, CommError):
            self._graveyard.append(thread)
            raise
        if "error" in result:
            raise CommError(f"{what} failed: {first_line(result['error'])}")
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
                what=f"connecting to the rendezvous store {address}",
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

    def _wait(
        self,
        ready: Callable[[], bool],
        wake: threading.Event,
        abort: Callable[[], bool],
        *,
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


def first_line(exc: object) -> str:
    """An error's first line (at most 300 characters), or its type where it says nothing."""
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__
