"""The etcd client's failover against a real three-member cluster on loopback.

A member is frozen with SIGSTOP (it keeps its sockets open but never answers, like a hung host).
Several calls and a watch are in flight on it at once: the first call to time out moves the
connection to another member and closes the old channel under the others. None of them may fail
for that, and the watch must go on from where it stopped, losing and repeating no event.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EtcdCluster

PREFIX = "/elaswave/failover/"
# Above a loaded 2-core machine's commit latency: a call to a slow but live member must not
# time out and be retried there (a put it already applied would be applied twice).
OP_TIMEOUT = 3.0


@pytest.fixture
def cluster() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    """Three etcd members on 127.0.0.1: [(client endpoint, process)]."""
    with EtcdCluster(3) as members:
        yield [(m.endpoint, m.proc) for m in members.members if m.proc is not None]
        for m in members.members:  # a frozen member must wake to be stopped
            if m.proc is not None:
                m.proc.send_signal(signal.SIGCONT)


def _stopped(pid: int, timeout: float = 5.0) -> None:
    """Wait until the kernel has stopped ``pid``: a signal is delivered asynchronously, and a
    member still running forwards the first put to the leader (applied) and then freezes before
    its answer, so the client's retry elsewhere applies it a second time."""
    deadline = time.monotonic() + timeout
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"etcd member {pid} did not stop"
        time.sleep(0.01)


def test_calls_and_a_watch_in_flight_survive_a_frozen_member(
    cluster: list[tuple[str, subprocess.Popen[bytes]]],
) -> None:
    endpoints = [ep for ep, _ in cluster]

    async def scenario() -> tuple[list[str], list[Any], str]:
        db = await Etcd.connect(endpoints, prefix=PREFIX, timeout=OP_TIMEOUT)
        seen: list[str] = []
        arrived = asyncio.Event()

        async def watch(start: int) -> None:
            async for ev in db.watch_prefix(PREFIX + "k/", start_revision=start):
                seen.append(ev.key.removeprefix(PREFIX + "k/"))
                arrived.set()

        watcher = asyncio.create_task(watch(await db.revision() + 1))
        try:
            await db.put(PREFIX + "k/1", "a")
            await asyncio.wait_for(arrived.wait(), 5)
            cluster[0][1].send_signal(signal.SIGSTOP)  # the member this connection talks to
            _stopped(cluster[0][1].pid)  # else it may still pass a put on, then never answer
            # Staggered calls, all sent to the frozen member: the first to time out fails over
            # and closes the old channel while the others are still waiting on it.
            calls = []
            for i in range(4):
                calls.append(asyncio.create_task(db.put(PREFIX + f"k/{i + 2}", "b")))
                await asyncio.sleep(0.15)
            calls.append(asyncio.create_task(db.get(PREFIX + "k/1")))
            results = await asyncio.gather(*calls, return_exceptions=True)
            await db.put(PREFIX + "k/6", "c")  # after the switch
            deadline = time.monotonic() + 5
            while len(seen) < 6 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not watcher.done(), watcher
            return seen, results, db.endpoint
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await db.close()

    seen, results, now_using = asyncio.run(scenario())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"calls in flight on the frozen member failed: {failed!r}"
    assert now_using != endpoints[0]
    # Every put once, in the order etcd committed them (the retried puts race each other).
    committed = sorted(zip(results[:4], ["2", "3", "4", "5"], strict=True))
    assert seen == ["1", *[k for _, k in committed], "6"], (seen, results)


def test_a_write_whose_answer_was_lost_is_found_in_the_history(
    cluster: list[tuple[str, subprocess.Popen[bytes]]],
) -> None:
    """The daemon's check after a compare-and-set whose answer it never got: etcd's history
    says whether the write landed, even after the key moved on."""
    key = PREFIX + "progress"

    async def scenario() -> tuple[bytes | None, bytes | None, bytes | None, float]:
        db = await Etcd.connect([ep for ep, _ in cluster], prefix=PREFIX, timeout=OP_TIMEOUT)
        try:
            await db.put(key, "step 5")
            before = (await db.get(key)).mod_revision  # type: ignore[union-attr]
            await db.put(key, "step 6, mine")  # the write whose answer the daemon never got
            await db.put(key, "step 7, another host")
            landed = await db.first_put_after(key, before)
            newest = (await db.get(key)).mod_revision  # type: ignore[union-attr]
            start = time.monotonic()
            unchanged = await db.first_put_after(key, newest, timeout=30.0)  # nothing after
            waited = time.monotonic() - start
            absent = await db.first_put_after(PREFIX + "never", 0)
            return landed, unchanged, absent, waited
        finally:
            await db.close()

    landed, unchanged, absent, waited = asyncio.run(scenario())
    assert landed == b"step 6, mine"
    assert unchanged is None and absent is None
    assert waited < 10.0  # answered from one read, not by waiting out the 30 s watch
