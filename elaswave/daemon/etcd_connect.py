"""Connecting to an etcd cluster: credentials, the TLS channel, endpoint order and failures.

Security: aetcd 1.0 speaks user/password auth but only plaintext gRPC, so :class:`TLSClient`
opens the channel itself, with TLS (and a client certificate) when :class:`EtcdSecurity` asks
for it. The rest picks and orders a cluster's members (:func:`start_order`,
:func:`failover_order`), says which failures mean a member is gone (:data:`MEMBER_LOST`) and
turns a failed connection into one line (:func:`explain`).

Separate from :mod:`elaswave.daemon.etcd`, whose :class:`~elaswave.daemon.etcd.Etcd` runs the
key-value, lease and watch calls over these connections: the command line parses endpoints and
loads credentials from here without the client's calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The daemon forks worker processes while gRPC threads run; gRPC's fork handlers are not safe
# there (and only print noise), so they are turned off before grpc is imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
import aetcd  # noqa: E402
import grpc  # noqa: E402
from aetcd.client import _handle_errors  # noqa: E402

from elaswave.config import EtcdTLSConfig, etcd_credentials  # noqa: E402
from elaswave.daemon.aio import wait_for  # noqa: E402
from elaswave.errors import ConfigError, EtcdAccessDenied, EtcdUnavailable  # noqa: E402


@dataclass(frozen=True, repr=False)
class EtcdSecurity:
    """How to authenticate to etcd: TLS material (PEM bytes, read once) and user/password."""

    cacert: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = None
    user: str | None = None
    password: str | None = None

    @property
    def tls(self) -> bool:
        return self.cacert is not None

    def __repr__(self) -> str:  # never print key material or the password
        return (
            f"EtcdSecurity(tls={self.tls}, client_cert={self.cert is not None}, user={self.user})"
        )

    @classmethod
    def load(cls, tls: EtcdTLSConfig, env: Any = None) -> EtcdSecurity:
        """Read the PEM files of ``tls`` and the credentials from the environment.

        A missing or unreadable file, or one that is not PEM, is a one-line :class:`ConfigError`.
        """
        creds = etcd_credentials(env)
        return cls(
            cacert=_read_pem(tls.cacert, "--etcd-cacert", "CERTIFICATE"),
            cert=_read_pem(tls.cert, "--etcd-cert", "CERTIFICATE"),
            key=_read_pem(tls.key, "--etcd-key", "PRIVATE KEY"),
            user=creds[0] if creds else None,
            password=creds[1] if creds else None,
        )


def _read_pem(path: str | None, flag: str, kind: str) -> bytes | None:
    if not path:
        return None
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{flag}: file not found: {path}") from None
    except OSError as exc:
        raise ConfigError(f"{flag}: cannot read {path} ({exc.strerror})") from None
    if f"-----BEGIN {kind}".encode() not in data and not (
        kind == "PRIVATE KEY" and b"PRIVATE KEY-----" in data
    ):
        raise ConfigError(f"{flag}: {path} is not a PEM {kind.lower()}")
    return data


class TLSClient(aetcd.Client):
    """``aetcd.Client`` whose gRPC channel can be TLS (aetcd 1.0 only opens plaintext ones).

    ``connect`` mirrors aetcd 1.0's own, with the channel constructor swapped.
    """

    _is_connecting: bool  # set by aetcd.Client.__init__

    def __init__(self, *, credentials: grpc.ChannelCredentials | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._credentials = credentials

    @_handle_errors
    async def connect(self) -> None:
        if self._credentials is None:
            await super().connect()
            return
        if self._connected.is_set():
            return
        if self._is_connecting:
            await wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = grpc.aio.secure_channel(
                target, self._credentials, options=list(self._options.items())
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = aetcd.rpc.AuthStub(self.channel)
                resp = await self.auth_stub.Authenticate(
                    aetcd.rpc.AuthenticateRequest(name=self._username, password=self._password),
                    timeout=self._timeout,
                )
                self.metadata = (("token", resp.token),)
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(
                aetcd.rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False


def explain(exc: BaseException) -> str:
    """A short, actionable reason for a failed connection or call (one line)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    low = text.lower()
    if "authentication failed" in low:
        return "authentication failed: wrong ELASWAVE_ETCD_USER / ELASWAVE_ETCD_PASSWORD"
    if "user name is empty" in low or "invalid auth token" in low:
        return "etcd requires authentication: set ELASWAVE_ETCD_USER and ELASWAVE_ETCD_PASSWORD"
    if "permission denied" in low:
        return "permission denied"
    if "not in peer certificate" in low:
        return "TLS: etcd's certificate does not name the address given in --etcd (check its SAN)"
    if "certificate_verify_failed" in low or "unable to get local issuer" in low:
        return "TLS: etcd's server certificate is not signed by --etcd-cacert"
    if "bad_certificate" in low or "certificate_required" in low or "unknown_ca" in low:
        return "TLS: etcd refused this client's certificate: missing, or signed by another CA"
    if "handshake" in low or "wrong_version_number" in low:
        return f"TLS handshake failed ({text[-160:]})"
    if "socket closed" in low:
        return "connection closed by etcd: if it requires TLS, give --etcd-cacert"
    if "connection refused" in low:
        return "connection refused"
    return text[:200]


def access_denied(endpoint: str, prefix: str) -> EtcdAccessDenied:
    return EtcdAccessDenied(
        f"etcd at {endpoint} denied access to {prefix}: this user has no readwrite role on "
        "the job's prefix (see `elaswave etcd-access`)"
    )


CLOSE_S = 1.0  # how long closing a client may wait for its watcher before the channel goes


async def close_quietly(client: aetcd.Client) -> None:
    """Close ``client``, bounded: aetcd's close first hands its watcher's request queue a stop
    marker, and that queue (ten places) stays full once its stream is gone, so the close can
    wait forever; then the gRPC channel is closed directly (that never waits)."""
    try:
        await wait_for(client.close(), CLOSE_S)
    except (Exception, asyncio.TimeoutError):
        channel = getattr(client, "channel", None)
        if channel is not None:
            with contextlib.suppress(Exception):
                await channel.close()


def parse_endpoints(text: str | list[str]) -> list[tuple[str, int]]:
    """``"h1:2379,h2:2379"`` (or a list) → ``[(h1, 2379), (h2, 2379)]``."""
    items = text if isinstance(text, list) else [t for t in text.split(",") if t.strip()]
    out = []
    for item in items:
        item = item.strip().removeprefix("http://").removeprefix("https://")
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise EtcdUnavailable(f"bad etcd endpoint {item!r}: expected host:port")
        out.append((host, int(port)))
    if not out:
        raise EtcdUnavailable("no etcd endpoint given")
    return out


# A member that stops answering: try the next one.
MEMBER_LOST = (
    asyncio.TimeoutError,
    aetcd.exceptions.ConnectionFailedError,
    aetcd.exceptions.ConnectionTimeoutError,
)


def start_order(endpoints: list[str], client: str) -> list[str]:
    """The endpoints in the order a client named ``client`` tries them: rotated by a stable
    hash of the name, so that the hosts of a large job start on different members and their
    reads, watches and keep-alives spread over the cluster instead of all landing on the first
    endpoint ("" keeps the given order)."""
    if not client or len(endpoints) < 2:
        return list(endpoints)
    i = zlib.crc32(client.encode()) % len(endpoints)
    return endpoints[i:] + endpoints[:i]


def failover_order(endpoints: list[str], current: str) -> list[str]:
    """The other endpoints to try after ``current`` failed, starting with the one after it."""
    if current not in endpoints:
        return list(endpoints)
    i = endpoints.index(current)
    return endpoints[i + 1 :] + endpoints[:i]


# gRPC waits up to two minutes between reconnects to an endpoint that went away; an etcd that is
# restarted (or a partition that heals) must be seen again at once: it restores each lease with
# its TTL from the moment it is back, so a host must refresh within that TTL (2 s in the tests)
# although its reconnects backed off during the outage. Until a reconnect succeeds, every call
# fails at once.
RECONNECT = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 250,
}
