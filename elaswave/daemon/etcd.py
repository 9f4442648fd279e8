"""A small asyncio etcd v3 client for what ElasWave needs: leases, CAS, prefix reads and watches.

Wraps ``aetcd`` (the maintained asyncio fork of python-etcd3). Every call has a timeout; failing
to reach etcd raises :class:`EtcdUnavailable` with a one-line message.

An aetcd client talks to one endpoint. Given several (the members of a cluster), a call or watch
whose member stops answering fails over to the next member that does, and a watch resumes from
the revision after the last event it delivered, so a dead etcd member loses no event.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

# The daemon forks worker processes while gRPC threads run; gRPC's fork handlers are not safe
# there (and only print noise), so they are turned off before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import aetcd  # noqa: E402

from elaswave.errors import EtcdUnavailable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KV:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int

    def json(self) -> Any:
        return json.loads(self.value)


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" | "delete"
    key: str
    value: bytes
    create_revision: int
    mod_revision: int


def parse_endpoints(text: str | list[str]) -> list[tuple[str, int]]:
    """``"h1:2379,h2:2379"`` (or a list) → ``[(h1, 2379), (h2, 2379)]``."""
    items = text if isinstance(text, list) else [t for t in text.split(",") if t.strip()]
    out = []
    for item in items:
        item = item.strip().removeprefix("http://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EtcdUnavailable(f"bad etcd endpoint {item!r}: expected host:port")
        out.append((host, int(port)))
    if not out:
        raise EtcdUnavailable("no etcd endpoint given")
    return out


# A member that stops answering: try the next one.
_MEMBER_LOST = (
    asyncio.TimeoutError,
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)


def failover_order(endpoints: list[str], current: str) -> list[str]:
    """The other endpoints to try after ``current`` failed, starting with the one after it."""
    if current not in endpoints:
        return list(endpoints)
    i = endpoints.index(current)
    return endpoints[i + 1 :] + endpoints[:i]


async def _open(endpoint: str, timeout: float) -> aetcd.Client:
    host, port = parse_endpoints([endpoint])[0]
    client = aetcd.Client(host=host, port=port, timeout=max(1, int(timeout)))
    try:
        await asyncio.wait_for(client.get(b"/elaswave/ping"), timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await client.close()
        raise
    return client


class Etcd:
    """A connection to an etcd cluster: to the first endpoint that answers, failing over to the
    others when it stops answering."""

    def __init__(
        self,
        client: aetcd.Client,
        endpoint: str,
        op_timeout: float,
        endpoints: list[str] | None = None,
    ) -> None:
        self._client = client
        self.endpoint = endpoint
        self.op_timeout = op_timeout
        self.endpoints = endpoints or [endpoint]
        self._switch = asyncio.Lock()

    @classmethod
    async def connect(cls, endpoints: str | list[str], *, timeout: float = 5.0) -> Etcd:
        errors = []
        names = [f"{h}:{p}" for h, p in parse_endpoints(endpoints)]
        for name in names:
            try:
                return cls(await _open(name, timeout), name, timeout, names)
            except (asyncio.TimeoutError, aetcd.exceptions.ClientError, OSError) as exc:
                errors.append(f"{name} ({type(exc).__name__})")
        raise EtcdUnavailable(f"cannot reach etcd at {', '.join(errors)} within {timeout:g}s")

    async def _failover(self, failed: aetcd.Client) -> bool:
        """Move to the next member that answers (once per failure). False: none does."""
        async with self._switch:
            if self._client is not failed:
                return True  # another call already moved on
            for name in failover_order(self.endpoints, self.endpoint):
                try:
                    client = await _open(name, self.op_timeout)
                except (asyncio.TimeoutError, aetcd.exceptions.ClientError, OSError):
                    continue
                log.warning("etcd at %s stopped answering; now using %s", self.endpoint, name)
                old, self._client, self.endpoint = self._client, client, name
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(old.close(), 1.0)
                return True
            return False

    async def _call(self, op: Any) -> Any:
        """Run ``op(client)``; if the member does not answer, retry once on another member."""
        for attempt in (0, 1):
            client = self._client
            try:
                return await asyncio.wait_for(op(client), self.op_timeout)
            except _MEMBER_LOST as exc:
                endpoint = self.endpoint
                if attempt == 0 and len(self.endpoints) > 1 and await self._failover(client):
                    continue
                if isinstance(exc, asyncio.TimeoutError):
                    raise EtcdUnavailable(
                        f"etcd at {endpoint} did not answer within {self.op_timeout:g}s"
                    ) from None
                raise EtcdUnavailable(f"lost the connection to etcd at {endpoint}") from None
        raise AssertionError("unreachable")

    async def get(self, key: str) -> KV | None:
        r = await self._call(lambda c: c.get(key.encode()))
        if r is None:
            return None
        return KV(key, r.value, r.create_revision, r.mod_revision)

    async def get_prefix(self, prefix: str) -> list[KV]:
        r = await self._call(lambda c: c.get_prefix(prefix.encode()))
        return [KV(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision) for kv in r]

    async def put(self, key: str, value: bytes | str, *, lease: Any = None) -> int:
        data = value.encode() if isinstance(value, str) else value
        r = await self._call(lambda c: c.put(key.encode(), data, lease=lease))
        return int(r.header.revision)

    async def put_json(self, key: str, value: Any, *, lease: Any = None) -> int:
        return await self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    async def delete(self, key: str) -> None:
        await self._call(lambda c: c.delete(key.encode()))

    async def delete_prefix(self, prefix: str) -> None:
        await self._call(lambda c: c.delete_prefix(prefix.encode()))

    async def create(self, key: str, value: bytes | str, *, lease: Any = None) -> bool:
        """Put ``key`` only if it does not exist. True if this call created it."""
        data = value.encode() if isinstance(value, str) else value
        tx = self._client.transactions
        ok, _ = await self._call(
            lambda c: c.transaction(
                compare=[tx.create(key.encode()) == 0],
                success=[tx.put(key.encode(), data, lease=lease)],
                failure=[],
            )
        )
        return bool(ok)

    async def compare_and_put(self, key: str, value: bytes | str, *, mod_revision: int) -> bool:
        """Put ``key`` only if its mod revision is still ``mod_revision`` (0: key absent)."""
        data = value.encode() if isinstance(value, str) else value
        tx = self._client.transactions
        ok, _ = await self._call(
            lambda c: c.transaction(
                compare=[tx.mod(key.encode()) == mod_revision],
                success=[tx.put(key.encode(), data)],
                failure=[],
            )
        )
        return bool(ok)

    async def put_and_delete(
        self, put_key: str, value: bytes | str, delete_key: str, *, lease: Any = None
    ) -> None:
        """Put one key and delete another in one transaction (watchers see both at once)."""
        data = value.encode() if isinstance(value, str) else value
        tx = self._client.transactions
        await self._call(
            lambda c: c.transaction(
                compare=[],
                success=[
                    tx.put(put_key.encode(), data, lease=lease),
                    tx.delete(delete_key.encode()),
                ],
                failure=[],
            )
        )

    async def lease(self, ttl: int) -> Any:
        return await self._call(lambda c: c.lease(ttl))

    async def refresh_lease(self, lease: Any) -> int:
        """Refresh ``lease`` once (through whichever member answers); its remaining TTL."""
        r = await self._call(lambda c: c.refresh_lease(lease.id))
        return int(r.TTL)

    async def revoke_lease(self, lease: Any) -> None:
        """Revoke ``lease`` (deleting its keys); a lease etcd already dropped is fine."""
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self._call(lambda c: c.revoke_lease(lease.id))

    async def keep_alive(self, lease: Any, ttl: int, on_lost: Any = None) -> None:
        """Refresh ``lease`` every ttl/3 seconds until cancelled; call ``on_lost`` if it expires."""
        while True:
            await asyncio.sleep(max(0.2, ttl / 3))
            try:
                r = await self._call(lambda c: c.refresh_lease(lease.id))
                if getattr(r, "TTL", 1) <= 0 and on_lost is not None:
                    on_lost()
                    return
            except EtcdUnavailable as exc:
                log.warning("lease keep-alive failed: %s", exc)

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncIterator[WatchEvent]:
        """Yield put/delete events under ``prefix`` (from ``start_revision`` if given).

        If the member serving the watch goes away, the watch is re-opened on another member from
        the revision after the last event delivered.
        """
        next_rev = start_revision
        while True:
            client = self._client
            watch = await self._call(
                lambda c, rev=next_rev: c.watch_prefix(prefix.encode(), start_revision=rev)
            )
            try:
                async for ev in watch:
                    kind = "put" if str(ev.kind).upper().endswith("PUT") else "delete"
                    next_rev = ev.kv.mod_revision + 1
                    yield WatchEvent(
                        kind,
                        ev.kv.key.decode(),
                        ev.kv.value,
                        ev.kv.create_revision,
                        ev.kv.mod_revision,
                    )
                return
            except aetcd.exceptions.ClientError as exc:
                lost = isinstance(exc, _MEMBER_LOST) and len(self.endpoints) > 1
                if not (lost and await self._failover(client)):
                    raise EtcdUnavailable(
                        f"lost the watch on etcd at {self.endpoint} ({exc})"
                    ) from None
            finally:
                # Bounded: this runs while the owning task is being cancelled, and an unanswered
                # cancel request must not keep the daemon from shutting down.
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await asyncio.wait_for(watch.cancel(), 1.0)

    async def revision(self) -> int:
        r = await self._call(lambda c: c.get_prefix(b"/elaswave/ping", keys_only=True))
        return int(r.header.revision)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.close()
