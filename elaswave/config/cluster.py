"""Where it runs: membership and respawns, every timeout, TLS towards etcd."""

from __future__ import annotations

import dataclasses
import re
import signal
from dataclasses import dataclass
from typing import Literal, get_args

from elaswave.config.schema import positive
from elaswave.errors import ConfigError

# How workers start (``elastic.worker_start``).
WorkerStart = Literal["template", "exec"]


def preempt_signum(name: str) -> int | None:
    """The signal number ``elastic.preempt_signal`` names (TERM, SIGUSR1, 10, ...; None for
    "none"); a ConfigError for anything else, or a signal a process cannot catch."""
    if name.strip().lower() == "none":
        return None
    text = name.strip().upper()
    try:
        sig = (
            signal.Signals(int(text))
            if text.isdigit()
            else signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
        )
    except (KeyError, ValueError):
        raise ConfigError(
            f"elastic.preempt_signal must be a signal name (TERM, USR1, ...) or none, got {name!r}"
        ) from None
    why = {
        signal.SIGKILL: "it cannot be caught", signal.SIGSTOP: "it cannot be caught",
        signal.SIGINT: "SIGINT stops a launch",
        signal.SIGUSR2: "SIGUSR2 asks a hung worker for its stacks",
    }.get(sig)  # fmt: skip
    if why is not None:
        raise ConfigError(f"elastic.preempt_signal cannot be {sig.name}: {why}")
    return int(sig)


@dataclass(kw_only=True)
class ElasticConfig:
    """Membership: how many workers, how many hosts, and the respawn policy."""

    nproc_per_node: int = 4
    """Workers on each host (> 0)."""
    nnodes: str = "1:1"
    """MIN:MAX hosts; a single number means MIN=MAX."""
    max_restarts: int = 0
    """Respawns of crashed workers per host (0 = continue without them). A lost rank taken over
    by a warm spare counts as one: the budget bounds how many replacements a host makes."""
    spares: int = 0
    """Warm spares per host: workers forked, imported and built ahead (on the CPU the model and
    data too), never planned, waiting to take a lost rank's place at the next step boundary
    instead of a respawn (within max_restarts); each one used is replaced by a new spare."""
    min_workers: int = 1
    """Below this many live workers the job stops."""
    straggler_threshold: float = 3.0
    """A rank whose compute time per micro-batch exceeds this multiple of the median rank's is
    evicted (0: never evict; slower ranks still get fewer micro-batches)."""
    loop_breaker: int = 5
    """Stop the whole job after this many worker failures in a row without a new committed step
    (0: never)."""
    worker_start: WorkerStart = "template"
    """How workers start: forked from a "template" process per host that imported torch and the
    runtime once (milliseconds a worker), or "exec": a new interpreter each (seconds)."""
    workers_per_device: int = 1
    """Workers that may share one accelerator (1: one per device, NCCL/HCCL). K > 1: up to
    devices × K workers per host, slot s on device s // K, collectives over gloo through host
    memory (NCCL takes one rank per device). On the CPU no device is set, but K > 1 still runs
    the staged path (host-to-host copies)."""
    preempt_signal: str = "TERM"
    """The signal that tells a launch its allocation ends (Slurm's and Kubernetes' SIGTERM, or
    the one a batch script forwards, e.g. USR1): the job checkpoints its newest committed step
    durably within timeouts.preempt_grace and every launch exits 75, which a Slurm script
    requeues on; launching it again resumes with no step lost. "none": the signal stops this
    host's part only (the other hosts train on without it) and, as SIGINT does, keeps no
    checkpoint of its own."""

    def __post_init__(self) -> None:
        positive("elastic.nproc_per_node", self.nproc_per_node)
        preempt_signum(self.preempt_signal)  # validates
        positive("elastic.workers_per_device", self.workers_per_device)
        positive("elastic.min_workers", self.min_workers)
        if self.max_restarts < 0:
            raise ConfigError(f"elastic.max_restarts must be >= 0, got {self.max_restarts}")
        if self.spares < 0:
            raise ConfigError(f"elastic.spares must be >= 0, got {self.spares}")
        if not (self.straggler_threshold == 0 or 1 < self.straggler_threshold < float("inf")):
            raise ConfigError(
                "elastic.straggler_threshold must be 0 (off) or a finite number > 1, "
                f"got {self.straggler_threshold}"
            )
        if self.loop_breaker < 0:
            raise ConfigError(f"elastic.loop_breaker must be >= 0, got {self.loop_breaker}")
        if self.worker_start not in get_args(WorkerStart):
            raise ConfigError(
                f"elastic.worker_start must be template or exec, got {self.worker_start!r}"
            )
        self.nnodes_range  # validates  # noqa: B018

    @property
    def nnodes_range(self) -> tuple[int, int]:
        m = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(self.nnodes))
        if not m:
            raise ConfigError(f"elastic.nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if lo < 1 or hi < lo:
            raise ConfigError(f"elastic.nnodes needs 1 <= MIN <= MAX, got {self.nnodes!r}")
        return lo, hi


@dataclass(kw_only=True)
class Timeouts:
    """Every blocking call's limit, in seconds. Tests shorten them; nothing waits forever."""

    etcd_connect: float = 5.0
    """Connecting to etcd."""
    lease_ttl: int = 5
    """Host lease; a host silent this long is considered gone."""
    rendezvous: float = 60.0
    """Initial membership and each process-group build."""
    collective: float = 120.0
    """One collective (a hang is caught earlier by the daemon)."""
    plan_wait: float = 60.0
    """A worker waiting for the plan that follows an error."""
    shutdown_grace: float = 5.0
    """SIGTERM -> SIGKILL."""
    heartbeat: float = 0.2
    """Worker → daemon heartbeat interval."""
    preempt_grace: float = 30.0
    """A preempted launch waits this long for the checkpoint, then stops its workers anyway
    (Slurm's KillWait is 30 s by default)."""
    hang: float | Literal["auto"] = "auto"
    """No heartbeat, or one compute phase or evaluation, for this long = hung: killed. "auto"
    derives each bound from the job's own phase times (elaswave.planning.hanglimits): about a
    second of silence, a compute phase several times the recent ones' p99 (10 s at least)."""
    template: float = 120.0
    """The worker template's imports, and each of its answers."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name != "hang" and not getattr(self, f.name) > 0:  # also rejects NaN
                raise ConfigError(f"timeouts.{f.name} must be > 0, got {getattr(self, f.name)}")
        if self.hang == "auto":
            return
        if isinstance(self.hang, str) or not self.hang > 0:
            raise ConfigError(f"timeouts.hang must be auto or a number > 0, got {self.hang!r}")
        if self.hang < 2 * self.heartbeat:
            raise ConfigError(
                f"timeouts.hang ({self.hang:g}) must be at least twice timeouts.heartbeat "
                f"({self.heartbeat:g})"
            )


@dataclass(kw_only=True)
class EtcdTLSConfig:
    """TLS towards etcd: PEM file paths. User and password never live here: they come only from
    ``ELASWAVE_ETCD_USER`` / ``ELASWAVE_ETCD_PASSWORD`` (see :func:`etcd_credentials`)."""

    cacert: str | None = None
    """CA that signed etcd's server certificate; set = TLS on."""
    cert: str | None = None
    """Client certificate (etcd --client-cert-auth), with ``key``."""
    key: str | None = None
    """The client certificate's private key, with ``cert``."""
    server_cert: str | None = None
    """Embedded etcd only: serve TLS with this certificate, with ``server_key``; clients then
    need a cert signed by ``cacert``."""
    server_key: str | None = None
    """Embedded etcd only: the private key of ``server_cert``."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ConfigError(
                "etcd_tls: give the client cert and key together (--etcd-cert and --etcd-key)"
            )
        if bool(self.server_cert) != bool(self.server_key):
            raise ConfigError("etcd_tls: give server_cert and server_key together")
        if (self.cert or self.server_cert) and not self.cacert:
            raise ConfigError("etcd_tls: a certificate needs the CA too (--etcd-cacert)")
        if self.server_cert and not self.cert:
            raise ConfigError(
                "etcd_tls: an embedded etcd with TLS admits only client certificates; "
                "give --etcd-cert/--etcd-key for this host's daemon"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.cacert)
