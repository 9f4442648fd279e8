"""Lease refreshes over one kept keep-alive stream, against a real etcd: the stream is reused
while it works, a member that goes away and comes back costs a failed refresh and a new stream,
and a lease etcd dropped reads as expired."""

from __future__ import annotations

import asyncio

import pytest

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.errors import EtcdUnavailable, LeaseExpired

PREFIX = "/elaswave/keepalive/"


def test_refreshes_reuse_one_stream_and_survive_a_restart() -> None:
    async def body(etcd: EmbeddedEtcd) -> None:
        db = await Etcd.connect([etcd.endpoint], prefix=PREFIX, timeout=2.0)
        try:
            lease = await db.lease(30)
            assert await db.refresh_lease(lease) > 0
            assert db._keepalive is not None
            stream = db._keepalive[1]
            for _ in range(3):
                assert await db.refresh_lease(lease) > 0
            assert db._keepalive[1] is stream  # the same stream all along
            etcd.kill()
            with pytest.raises((EtcdUnavailable, asyncio.TimeoutError)):
                await db.refresh_lease(lease)
            assert db._keepalive is None  # a failed stream is dropped
            etcd.spawn()  # same data directory: the lease survives (extended by its TTL)
            await asyncio.to_thread(etcd.wait_healthy)
            for _ in range(50):  # until gRPC has reconnected
                try:
                    remaining = await db.refresh_lease(lease)
                    break
                except (EtcdUnavailable, asyncio.TimeoutError):
                    await asyncio.sleep(0.1)
            assert remaining > 0
            assert db._keepalive is not None and db._keepalive[1] is not stream
        finally:
            await db.close()

    with EmbeddedEtcd() as etcd:
        asyncio.run(body(etcd))


def test_a_dropped_lease_reads_as_expired() -> None:
    async def body(endpoint: str) -> None:
        db = await Etcd.connect([endpoint], prefix=PREFIX, timeout=2.0)
        try:
            lease = await db.lease(30)
            assert await db.refresh_lease(lease) > 0
            await db.revoke_lease(lease)
            try:
                remaining = await db.refresh_lease(lease)
            except LeaseExpired:
                remaining = 0
            assert remaining <= 0
        finally:
            await db.close()

    with EmbeddedEtcd() as etcd:
        asyncio.run(body(etcd.endpoint))
