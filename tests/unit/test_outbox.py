"""The daemon's outbox: writes to etcd land in order, survive an outage, and never pile up."""

from __future__ import annotations

import asyncio

from elaswave.daemon.outbox import Outbox
from elaswave.errors import EtcdUnavailable


class FlakyStore:
    """A store that refuses ``down`` calls (etcd away), then takes every write."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.log: list[str] = []

    def write(self, what: str):  # noqa: ANN201 - a coroutine factory
        async def go() -> None:
            if self.down > 0:
                self.down -= 1
                raise EtcdUnavailable("connection refused")
            self.log.append(what)

        return go


def test_writes_land_in_order_after_an_outage() -> None:
    async def main() -> tuple[list[str], list[str], int]:
        up = asyncio.Event()
        up.set()
        lost: list[str] = []
        box = Outbox(up, lost.append)
        store = FlakyStore(down=3)
        task = asyncio.create_task(box.run())
        for what in ("ready w0", "ready w1", "departure w0"):
            box.put(what, store.write(what))
        for step in range(1, 6):  # only the newest progress record is ever written
            box.latest("progress", store.write(f"progress {step}"))
        await asyncio.sleep(0.05)
        assert store.log == [] and not up.is_set()  # etcd away: nothing lands, nothing lost
        up.set()  # the keep-alive saw etcd answer; the head is tried again
        await asyncio.sleep(0.01)
        up.set()
        await asyncio.sleep(0.01)
        up.set()
        assert await box.drain(1.0)
        task.cancel()
        return store.log, lost, box.pending

    log, lost, pending = asyncio.run(main())
    assert log == ["ready w0", "ready w1", "departure w0", "progress 5"]
    assert lost and pending == 0


def test_a_write_etcd_refuses_is_dropped_not_retried_forever() -> None:
    async def main() -> list[str]:
        up = asyncio.Event()
        up.set()
        box = Outbox(up, lambda why: None)
        landed: list[str] = []

        async def refused() -> None:
            raise RuntimeError("requested lease not found")

        async def fine() -> None:
            landed.append("next")

        task = asyncio.create_task(box.run())
        box.put("under an expired lease", refused)
        box.put("next", fine)
        assert await box.drain(1.0)
        task.cancel()
        return landed

    assert asyncio.run(main()) == ["next"]
