"""The daemon's outbox: writes to etcd land in order and survive an outage; if etcd never comes
back, the fallbacks run in order."""

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
        for what in ("ready w0", "ready w1", "departure w0", "record 5"):
            box.put(what, store.write(what))
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
    assert log == ["ready w0", "ready w1", "departure w0", "record 5"]
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


def test_etcd_gone_for_good_runs_the_fallbacks_in_order() -> None:
    async def main() -> list[str]:
        up = asyncio.Event()
        up.set()
        box = Outbox(up, lambda why: None)
        store = FlakyStore(down=10**6)
        local: list[str] = []
        task = asyncio.create_task(box.run())
        for step in (7, 8, 9):
            note = f"record {step} written locally"
            box.put(f"record {step}", store.write(f"record {step}"), lambda n=note: local.append(n))
        box.put("done", store.write("done"))  # no fallback: dropped
        assert not await box.drain(0.1)
        box.abandon()
        task.cancel()
        assert box.pending == 0 and store.log == []
        return local

    assert asyncio.run(main()) == [f"record {s} written locally" for s in (7, 8, 9)]
