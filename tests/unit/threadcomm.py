"""An in-process group for strategy unit tests: N ranks are N threads, collectives meet at a
barrier. It implements the part of ``Communicator`` the strategies use; sums are taken in rank
order, so results are deterministic."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from elaswave.runtime.comm.communicator import Communicator


class Hub:
    """What the N ranks of one group share."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list[Any] = [None] * world
        self.mail: dict[tuple[int, int, int], deque[torch.Tensor]] = {}
        self.mail_ready = threading.Condition()

    def comms(self) -> list[ThreadComm]:
        return [ThreadComm(self, r) for r in range(self.world)]


class ThreadComm:
    """One rank's view of a :class:`Hub` (every group name is the same group)."""

    broadcast_json = Communicator.broadcast_json
    device = torch.device("cpu")
    backend = "gloo"

    def __init__(self, hub: Hub, rank: int) -> None:
        self.hub, self.me = hub, rank
        self.broken = False

    def rank(self, name: str) -> int:
        return self.me

    def size(self, name: str) -> int:
        return self.hub.world

    def mark_broken(self) -> None:
        self.broken = True

    def _meet(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (a copy each rank may read)."""
        hub = self.hub
        hub.slots[self.me] = value
        hub.barrier.wait()
        seen = list(hub.slots)
        hub.barrier.wait()
        return seen

    def allreduce(self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]) -> None:
        parts = self._meet(tensor.clone())
        total = parts[0].clone()
        for p in parts[1:]:
            total += p
        tensor.copy_(total)

    def allreduce_many(
        self, items: list[tuple[str, torch.Tensor]], abort: Callable[[], bool]
    ) -> None:
        for name, tensor in items:  # every rank lists them in the same order
            self.allreduce(name, tensor, abort)

    def allgather(
        self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]
    ) -> list[torch.Tensor]:
        return [p.clone() for p in self._meet(tensor.clone())]

    def allgather_into(
        self, name: str, out: torch.Tensor, part: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        out.copy_(torch.cat(self._meet(part.clone())))

    def broadcast(
        self, name: str, tensor: torch.Tensor, root: int, *, abort: Callable[[], bool]
    ) -> None:
        tensor.copy_(self._meet(tensor.clone())[root])

    def reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, *, abort: Callable[[], bool]
    ) -> None:
        every = self._meet([p.clone() for p in parts])
        total = every[0][self.me].clone()
        for theirs in every[1:]:
            total += theirs[self.me]
        out.copy_(total)

    # Posted collectives run at once (every rank posts the same ones in the same order).
    def start_allgather(
        self, name: str, out: torch.Tensor, part: torch.Tensor, *, abort: Callable[[], bool]
    ) -> object:
        self.allgather_into(name, out, part, abort=abort)
        return object()

    def start_reduce_scatter(
        self, name: str, parts: list[torch.Tensor], out: torch.Tensor, *, abort: Callable[[], bool]
    ) -> object:
        self.reduce_scatter(name, parts, out, abort=abort)
        return object()

    def start_allreduce(self, name: str, tensor: torch.Tensor, abort: Callable[[], bool]) -> object:
        self.allreduce(name, tensor, abort)
        return object()

    def wait(self, started: list[object], abort: Callable[[], bool]) -> None:
        pass

    def abandon(self, started: list[object]) -> None:
        pass

    def exchange(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor]],
        recvs: list[tuple[int, torch.Tensor]],
        *,
        abort: Callable[[], bool],
        tag: int = 0,
    ) -> None:
        self.p2p(
            name, [(p, t, tag) for p, t in sends], [(p, t, tag) for p, t in recvs], abort=abort
        )

    def p2p(
        self,
        name: str,
        sends: list[tuple[int, torch.Tensor, int]],
        recvs: list[tuple[int, torch.Tensor, int]],
        *,
        abort: Callable[[], bool],
    ) -> None:
        hub = self.hub
        with hub.mail_ready:
            for peer, t, tag in sends:  # the k-th message of a pair and tag: in order
                hub.mail.setdefault((self.me, peer, tag), deque()).append(t.clone())
            hub.mail_ready.notify_all()
        for peer, t, tag in recvs:
            key = (peer, self.me, tag)
            with hub.mail_ready:
                if not hub.mail_ready.wait_for(lambda key=key: hub.mail.get(key), timeout=30):
                    raise TimeoutError(f"rank {self.me}: no message {key}")
                t.copy_(hub.mail[key].popleft())


def run_ranks(world: int, body: Callable[[int, ThreadComm], Any]) -> list[Any]:
    """Run ``body(rank, comm)`` on ``world`` threads; their results in rank order (the first
    exception is raised)."""
    comms = Hub(world).comms()
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = body(r, comms[r])
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller
            errors.append(exc)
            comms[r].hub.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results
