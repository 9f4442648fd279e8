"""A small asyncio etcd v3 client for what ElasWave needs: leases, CAS, prefix reads and watches.

Wraps ``aetcd`` (the maintained asyncio fork of python-etcd3). Every call has a timeout; failing
to reach etcd raises :class:`EtcdUnavailable` with a one-line message.

A connection is bound to one job's key prefix: any key outside it is refused here, before it
reaches etcd, and with etcd auth a job's user holds a role on that prefix only (docs: Security).
How it connects (TLS and credentials, endpoint order) is :mod:`elaswave.daemon.etcd_connect`.

An aetcd client talks to one endpoint. Given several (the members of a cluster), a call or watch
whose member stops answering fails over to the next member that does, and a watch resumes from
the revision after the last event it delivered, so a dead etcd member loses no event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Set before grpc is imported, as etcd_connect does (whichever of the two is imported first):
# gRPC's fork handlers are not safe in a daemon that forks workers while gRPC threads run.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import aetcd  # noqa: E402
import grpc  # noqa: E402
from aetcd.client import _handle_errors  # noqa: E402

from elaswave.daemon.aio import wait_for  # noqa: E402
from elaswave.daemon.etcd_connect import (  # noqa: E402
    MEMBER_LOST,
    RECONNECT,
    EtcdSecurity,
    TLSClient,
    access_denied,
    close_quietly,
    explain,
    failover_order,
    parse_endpoints,
    start_order,
)
from elaswave.errors import EtcdUnavailable, LeaseExpired  # noqa: E402

log = logging.getLogger(__name__)

PROBE = "probe/"  # read (never written) under a job's prefix to test access and get the revision


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


# How a kept stream fails when its member goes away (or the channel under it is closed).
_STREAM_LOST = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.DEADLINE_EXCEEDED,
)


Opener = Callable[[str, float], Awaitable[aetcd.Client]]


class Etcd:
    """A connection to an etcd cluster, bound to one key prefix: to the first endpoint that
    answers, failing over to the others when it stops answering.

    Every key this connection reads, writes, deletes or watches must lie under ``prefix`` (a
    job's :class:`~elaswave.keys.JobKeys` prefix); anything else is a bug and raises at once.
    """

    def __init__(
        self,
        client: aetcd.Client,
        endpoint: str,
        op_timeout: float,
        *,
        prefix: str,
        endpoints: list[str],
        opener: Opener,
    ) -> None:
        self._client = client
        self.endpoint = endpoint
        self.op_timeout = op_timeout
        self.prefix = prefix
        self.endpoints = endpoints
        self._open = opener
        self._switch = asyncio.Lock()
        self._refreshing = asyncio.Lock()  # one refresh at a time on the kept stream
        self._keepalive: tuple[aetcd.Client, Any] | None = None  # (client, its open stream)

    @classmethod
    async def connect(
        cls,
        endpoints: str | list[str],
        *,
        prefix: str,
        timeout: float = 5.0,
        security: EtcdSecurity | None = None,
        client: str = "",
    ) -> Etcd:
        """Connect to the first of ``endpoints`` that answers, in :func:`start_order` for a
        client named ``client`` (a host id)."""
        security = security or EtcdSecurity()
        credentials = None
        if security.tls:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=security.cacert,
                private_key=security.key,
                certificate_chain=security.cert,
            )
        if not prefix.startswith("/") or not prefix.endswith("/"):
            raise ValueError(f"etcd key prefix must look like /a/b/, got {prefix!r}")

        async def opener(name: str, wait: float) -> aetcd.Client:
            host, port = parse_endpoints([name])[0]
            client = TLSClient(
                credentials=credentials,
                host=host,
                port=port,
                username=security.user,
                password=security.password,
                timeout=max(1, int(wait)),
                options=RECONNECT,
            )
            try:
                # A read under the prefix: all that a user confined to the prefix may do.
                await wait_for(client.get((prefix + PROBE).encode()), wait)
            except BaseException:
                await close_quietly(client)
                raise
            return client

        names = start_order([f"{h}:{p}" for h, p in parse_endpoints(endpoints)], client)
        errors = []
        for name in names:
            try:
                return cls(
                    await opener(name, timeout),
                    name,
                    timeout,
                    prefix=prefix,
                    endpoints=names,
                    opener=opener,
                )
            except asyncio.TimeoutError:
                errors.append(f"{name} (no answer within {timeout:g}s)")
            except (aetcd.exceptions.ClientError, OSError) as exc:
                if explain(exc) == "permission denied":
                    raise access_denied(name, prefix) from None
                errors.append(f"{name} ({explain(exc)})")
        raise EtcdUnavailable(f"cannot reach etcd at {', '.join(errors)}")

    def _own(self, key: str) -> bytes:
        if not key.startswith(self.prefix):
            raise ValueError(f"etcd key {key!r} is outside this connection's prefix {self.prefix}")
        return key.encode()

    async def _failover(self, failed: aetcd.Client) -> bool:
        """Move to the next member that answers (once per failure). False: none does."""
        async with self._switch:
            if self._client is not failed:
                return True  # another call already moved on
            for name in failover_order(self.endpoints, self.endpoint):
                try:
                    client = await self._open(name, self.op_timeout)
                except (asyncio.TimeoutError, aetcd.exceptions.ClientError, OSError):
                    continue
                log.warning("etcd at %s stopped answering; now using %s", self.endpoint, name)
                old, self._client, self.endpoint = self._client, client, name
                await close_quietly(old)
                return True
            return False

    def _closed_under(self, client: aetcd.Client) -> bool:
        """A call on ``client`` ended because a failover closed it (gRPC reports the call
        locally cancelled), not because this task is being cancelled."""
        task = asyncio.current_task()
        return self._client is not client and (task is None or not task.cancelling())

    async def _call(self, op: Callable[[aetcd.Client], Awaitable[Any]]) -> Any:
        """Run ``op(client)``; if the member does not answer, retry once on another member."""
        for attempt in (0, 1):
            client = self._client
            try:
                return await wait_for(op(client), self.op_timeout)
            except asyncio.CancelledError:
                # Another call's failover closed the channel this one was waiting on: the
                # member it was sent to did not answer either, so it goes to the new one.
                if not self._closed_under(client):
                    raise
                if attempt == 0:
                    continue
                raise EtcdUnavailable(f"lost the connection to etcd at {self.endpoint}") from None
            except MEMBER_LOST as exc:
                endpoint = self.endpoint
                if attempt == 0 and len(self.endpoints) > 1 and await self._failover(client):
                    continue
                if isinstance(exc, asyncio.TimeoutError):
                    raise EtcdUnavailable(
                        f"etcd at {endpoint} did not answer within {self.op_timeout:g}s"
                    ) from None
                raise EtcdUnavailable(f"lost the connection to etcd at {endpoint}") from None
            except aetcd.exceptions.ClientError as exc:
                if explain(exc) == "permission denied":
                    raise access_denied(self.endpoint, self.prefix) from None
                if "lease not found" in str(exc):
                    raise LeaseExpired(f"etcd has no such lease ({explain(exc)})") from None
                raise
        raise AssertionError("unreachable")

    async def get(self, key: str) -> KV | None:
        k = self._own(key)
        r = await self._call(lambda c: c.get(k))
        if r is None:
            return None
        return KV(key, r.value, r.create_revision, r.mod_revision)

    async def get_prefix(self, prefix: str) -> list[KV]:
        return (await self.get_prefix_at(prefix))[0]

    async def get_prefix_at(self, prefix: str) -> tuple[list[KV], int]:
        """The keys under ``prefix`` and the store revision they were read at (a watch from the
        one after continues exactly where this read ends)."""
        p = self._own(prefix)
        r = await self._call(lambda c: c.get_prefix(p))
        kvs = [KV(kv.key.decode(), kv.value, kv.create_revision, kv.mod_revision) for kv in r]
        return kvs, int(r.header.revision)

    async def put(self, key: str, value: bytes | str, *, lease: Any = None) -> int:
        data = value.encode() if isinstance(value, str) else value
        k = self._own(key)
        r = await self._call(lambda c: c.put(k, data, lease=lease))
        return int(r.header.revision)

    async def put_json(self, key: str, value: Any, *, lease: Any = None) -> int:
        return await self.put(key, json.dumps(value, sort_keys=True), lease=lease)

    async def delete(self, key: str) -> None:
        k = self._own(key)
        await self._call(lambda c: c.delete(k))

    async def delete_prefix(self, prefix: str) -> None:
        p = self._own(prefix)
        await self._call(lambda c: c.delete_prefix(p))

    async def delete_prefix_but(self, prefix: str, keep: str) -> None:
        """Delete every key under ``prefix`` except ``keep`` (a key under it)."""
        p, k = self._own(prefix), self._own(keep)
        end = aetcd.utils.prefix_range_end(p)
        await self._call(lambda c: c.delete_range(p, k))
        await self._call(lambda c: c.delete_range(k + b"\0", end))

    async def create(self, key: str, value: bytes | str, *, lease: Any = None) -> bool:
        """Put ``key`` only if it does not exist. True if this call created it."""
        data = value.encode() if isinstance(value, str) else value
        k = self._own(key)

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            return c.transaction(
                compare=[tx.create(k) == 0], success=[tx.put(k, data, lease=lease)], failure=[]
            )

        ok, _ = await self._call(op)
        return bool(ok)

    async def create_or_get(
        self, key: str, value: bytes | str, *, lease: Any = None
    ) -> tuple[bool, KV | None]:
        """:meth:`create`, and when the key existed, the key as it is, in one round trip."""
        data = value.encode() if isinstance(value, str) else value
        k = self._own(key)

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            return c.transaction(
                compare=[tx.create(k) == 0],
                success=[tx.put(k, data, lease=lease)],
                failure=[tx.get(k)],
            )

        ok, responses = await self._call(op)
        if ok:
            return True, None
        found = next((r for r in responses if isinstance(r, list) and r), [])
        if not found:
            return False, None
        got, meta = found[0]
        return False, KV(key, got, meta.create_revision, meta.mod_revision)

    async def compare_and_put(
        self,
        key: str,
        value: bytes | str,
        *,
        mod_revision: int,
        holder: tuple[str, str] | None = None,
        also: dict[str, bytes | str] | None = None,
    ) -> bool:
        """Put ``key`` only if its mod revision is still ``mod_revision`` (0: key absent) and,
        given ``holder = (key, value)``, that key still holds that value (a leader's key); the
        keys of ``also`` are put in the same transaction."""
        data = value.encode() if isinstance(value, str) else value
        k = self._own(key)
        hk = self._own(holder[0]) if holder else b""
        more = [(self._own(ak), v.encode() if isinstance(v, str) else v) for ak, v in
                (also or {}).items()]  # fmt: skip

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            compare = [tx.mod(k) == mod_revision]
            if holder:
                compare.append(tx.value(hk) == holder[1].encode())
            puts = [tx.put(k, data), *(tx.put(ak, v) for ak, v in more)]
            return c.transaction(compare=compare, success=puts, failure=[])

        ok, _ = await self._call(op)
        return bool(ok)

    async def compare_and_put_get(
        self, key: str, value: bytes | str, *, mod_revision: int
    ) -> tuple[bool, KV | None]:
        """:meth:`compare_and_put`, and the key as it is right after, in one round trip: the
        value just written when the compare held, the value that made it fail otherwise."""
        data = value.encode() if isinstance(value, str) else value
        k = self._own(key)

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            return c.transaction(
                compare=[tx.mod(k) == mod_revision],
                success=[tx.put(k, data), tx.get(k)],
                failure=[tx.get(k)],
            )

        ok, responses = await self._call(op)
        ranges = [r for r in responses if isinstance(r, list)]
        found = ranges[-1] if ranges else []
        if not found:
            return bool(ok), None
        got, meta = found[0]
        return bool(ok), KV(key, got, meta.create_revision, meta.mod_revision)

    async def put_all_if(
        self, puts: Mapping[str, bytes | str], *, key: str, mod_revision: int, lease: Any = None
    ) -> bool:
        """Put every key of ``puts`` (under ``lease``) at once, only if ``key``'s mod revision is
        still ``mod_revision`` (0: absent)."""
        k = self._own(key)
        items = [(self._own(pk), v.encode() if isinstance(v, str) else v) for pk, v in puts.items()]

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            return c.transaction(
                compare=[tx.mod(k) == mod_revision],
                success=[tx.put(pk, v, lease=lease) for pk, v in items],
                failure=[],
            )

        ok, _ = await self._call(op)
        return bool(ok)

    async def put_and_delete(
        self,
        put_key: str,
        value: bytes | str,
        delete_key: str,
        *,
        lease: Any = None,
        also: tuple[tuple[str, str], ...] = (),
    ) -> None:
        """Put one key (and those in ``also``, under the same lease) and delete another in one
        transaction (watchers see all of it at once)."""
        data = value.encode() if isinstance(value, str) else value
        puts = [(self._own(put_key), data), *((self._own(k), v.encode()) for k, v in also)]
        dk = self._own(delete_key)

        def op(c: aetcd.Client) -> Awaitable[Any]:
            tx = c.transactions
            ops = [tx.put(k, v, lease=lease) for k, v in puts] + [tx.delete(dk)]
            return c.transaction(compare=[], success=ops, failure=[])

        await self._call(op)

    async def lease(self, ttl: int) -> Any:
        return await self._call(lambda c: c.lease(ttl))

    async def refresh_lease(self, lease: Any) -> int:
        """Refresh ``lease`` once (through whichever member answers); its remaining TTL (0 or
        less: etcd dropped it).

        Refreshes go over one LeaseKeepAlive stream kept open between them, as etcd's own
        clients do: a new stream per refresh costs this process (and etcd) about three times the
        CPU (docs/benchmarks.md, "Measurements behind design choices"). A stream
        that fails or is abandoned (its member went away, the refresh timed out) is dropped; the
        next refresh opens one on the member the connection uses then."""
        async with self._refreshing:
            r = await self._call(lambda c: self._refresh_on(c, int(lease.id)))
        return int(r.TTL)

    @_handle_errors
    async def _refresh_on(self, client: aetcd.Client, lease_id: int) -> Any:
        kept = self._keepalive
        if kept is None or kept[0] is not client:
            self._drop_keepalive()
            await client.connect()
            kept = self._keepalive = (
                client,
                client.leasestub.LeaseKeepAlive(metadata=client.metadata),
            )
        try:
            await kept[1].write(aetcd.rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await kept[1].read()
        except asyncio.CancelledError:
            self._drop_keepalive()  # never reuse a stream a refresh gave up on
            raise
        except grpc.aio.AioRpcError as exc:
            self._drop_keepalive()
            if exc.code() in _STREAM_LOST:
                raise aetcd.exceptions.ConnectionFailedError(str(exc.details())) from None
            raise  # translated by _handle_errors (lease not found, permission denied)
        except Exception as exc:  # gRPC could not even send on it: the member is gone
            self._drop_keepalive()
            raise aetcd.exceptions.ConnectionFailedError(str(exc)) from None
        if reply is grpc.aio.EOF:  # the member closed it
            self._drop_keepalive()
            raise aetcd.exceptions.ConnectionFailedError("the lease keep-alive stream ended")
        return reply

    def _drop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive[1].cancel()
            self._keepalive = None

    async def revoke_lease(self, lease: Any) -> None:
        """Revoke ``lease`` (deleting its keys); a lease etcd already dropped is fine."""
        with contextlib.suppress(aetcd.exceptions.ClientError):
            await self._call(lambda c: c.revoke_lease(lease.id))

    async def values(self, key: str) -> AsyncGenerator[bytes, None]:
        """The value of ``key`` now (if it has one), then every value put under it."""
        revision = await self.revision()
        kv = await self.get(key)
        if kv is not None:
            yield kv.value
        async for ev in self.watch_prefix(key, start_revision=revision + 1):
            if ev.key == key and ev.kind == "put":
                yield ev.value

    async def watch_prefix(
        self, prefix: str, *, start_revision: int | None = None
    ) -> AsyncGenerator[WatchEvent, None]:
        """Yield put/delete events under ``prefix`` (from ``start_revision`` if given).

        If the member serving the watch goes away, the watch is re-opened on another member from
        the revision after the last event delivered.
        """

        def open_watch(c: aetcd.Client, rev: int | None) -> Awaitable[Any]:
            return c.watch_prefix(self._own(prefix), start_revision=rev)

        next_rev = start_revision
        while True:
            client = self._client
            watch = await self._call(functools.partial(open_watch, rev=next_rev))
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
                if not self._closed_under(client):
                    return
                # A failover closed the channel under this watch (its stream just ends): go on
                # on the new member from the next revision.
            except aetcd.exceptions.ClientError as exc:
                lost = isinstance(exc, MEMBER_LOST) and len(self.endpoints) > 1
                if not (lost and await self._failover(client)):
                    raise EtcdUnavailable(
                        f"lost the watch on etcd at {self.endpoint} ({exc})"
                    ) from None
            finally:
                # Bounded: this runs while the owning task is being cancelled, and an unanswered
                # cancel request must not keep the daemon from shutting down.
                with contextlib.suppress(Exception, asyncio.TimeoutError):
                    await wait_for(watch.cancel(), 1.0)

    async def first_put_after(
        self, key: str, revision: int, *, timeout: float = 5.0
    ) -> bytes | None:
        """The value of the first put on ``key`` after ``revision``, from etcd's history (None:
        not changed since, deleted first, or the history is compacted). After a write whose
        answer was lost (the member went away, the call was retried elsewhere) this tells whether
        the write landed."""

        async def first() -> bytes | None:
            async for ev in self.watch_prefix(key, start_revision=revision + 1):
                if ev.key == key:
                    return ev.value if ev.kind == "put" else None
            return None

        try:
            now = await self.get(key)
            if now is None or now.mod_revision <= revision:
                return None  # not changed since (a deleted key's history is not needed here)
            return await wait_for(first(), timeout)
        except (asyncio.TimeoutError, EtcdUnavailable, aetcd.exceptions.ClientError):
            return None

    async def revision(self) -> int:
        # A range that holds no key: its answer's header carries the store's revision.
        probe = self._own(self.prefix + PROBE)
        r = await self._call(lambda c: c.get_prefix(probe, keys_only=True))
        return int(r.header.revision)

    async def close(self) -> None:
        self._drop_keepalive()
        await close_quietly(self._client)
