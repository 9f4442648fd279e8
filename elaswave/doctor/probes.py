"""The probes of ``elaswave doctor``: thin code that looks at this host and hands what it found to
the verdicts in :mod:`elaswave.doctor.verdicts`.

Devices are found the way a launch finds them (:func:`elaswave.runtime.device.probe`), the
etcd binary the way an embedded etcd does (:func:`elaswave.daemon.etcd_server.etcd_binary`), the
address peers reach the way the daemon does (:func:`elaswave.daemon.supervisor.host_address_for`),
and whether NCCL shrinks in place the way the communicator decides it
(:func:`elaswave.runtime.comm.backends.shrinkable`, asked of a one-rank NCCL group).

Probing CUDA initialises it in this process. That is safe here: the doctor is a process of its
own, and its smoke run starts ``elaswave launch`` through fork and exec, never a bare fork.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
import warnings
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elaswave.doctor.verdicts import (
    PASS,
    Check,
    EtcdAnswer,
    auto_device_verdict,
    cuda_verdict,
    etcd_verdict,
    first_line,
    gloo_verdict,
    host_address_verdict,
    nccl_verdict,
    npu_verdict,
    ports_verdict,
    python_verdict,
    torch_verdict,
    transformers_verdict,
)

if TYPE_CHECKING:
    from elaswave.runtime.device import Accelerators

PACKAGE = "elaswave"
ETCD_VERSION_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 2.0
GLOO_TIMEOUT_S = 20.0


def package_version() -> str:
    """elaswave's installed version (its package metadata; the source's own without one)."""
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        from elaswave import __version__

        return __version__


def _error(exc: BaseException) -> str:
    return first_line(str(exc)) or type(exc).__name__


def requirement(
    name: str, version: str | None, extra: str | None = None
) -> tuple[str, bool | None]:
    """What elaswave's metadata asks of package ``name`` (in ``extra``, else the base install),
    and whether ``version`` meets it; None where it cannot be told (no metadata, no
    ``packaging`` to read it with, no version)."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        return "", None
    try:
        lines = importlib.metadata.requires(PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        return "", None
    for line in lines:
        req = Requirement(line)
        if req.name.lower() != name:
            continue
        if extra is None:
            wanted_here = req.marker is None
        else:
            wanted_here = req.marker is not None and req.marker.evaluate({"extra": extra})
        if not wanted_here:
            continue
        spec = str(req.specifier)
        if version is None:
            return spec, None
        return spec, req.specifier.contains(version.split("+")[0], prereleases=True)
    return "", None


def nvidia_driver() -> bool:
    """Whether an NVIDIA driver is loaded on this host (whatever torch makes of it)."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


# -- versions ---------------------------------------------------------------------------------


def versions() -> list[Check]:
    import torch

    elaswave = package_version()
    checks = [Check("elaswave", "versions", PASS, elaswave, {"version": elaswave})]
    checks.append(python_verdict(sys.version_info[:3]))
    wanted, meets = requirement("torch", torch.__version__)
    checks.append(torch_verdict(torch.__version__, torch.version.cuda, nvidia_driver(), wanted,
                                meets))  # fmt: skip
    try:
        hf: str | None = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        hf = None
    checks.append(transformers_verdict(hf, *requirement("transformers", hf, extra="hf")))
    checks.append(etcd_check())
    return checks


def etcd_check() -> Check:
    """The binary an embedded etcd would run, and what its ``--version`` says."""
    from elaswave.daemon import etcd_server
    from elaswave.errors import ElasWaveError

    try:
        path = etcd_server.etcd_binary()
    except ElasWaveError as exc:
        return etcd_verdict(None, str(exc), None)
    try:
        done = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=ETCD_VERSION_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return etcd_verdict(path, _error(exc), None)
    if done.returncode != 0:
        said = first_line(done.stderr) or first_line(done.stdout)
        return etcd_verdict(path, f"exit {done.returncode}: {said}", None)
    return etcd_verdict(path, None, done.stdout)


# -- devices and backends ---------------------------------------------------------------------


def devices() -> tuple[list[Check], Accelerators | None]:
    """The device checks, and the accelerators found (None: the probe failed) for the smoke
    run to be placed on."""
    import torch.distributed as dist

    from elaswave.runtime.device import BACKENDS, place, probe

    checks = [gloo_check()]
    driver = nvidia_driver()
    names, warning = cuda_devices()
    checks.append(cuda_verdict(torch_cuda(), names, driver, warning))
    version, can_shrink, error = nccl_facts() if names else (None, None, None)
    checks.append(nccl_verdict(len(names), dist.is_nccl_available(), version, can_shrink, error))
    npu_version = _npu_version()
    found: Accelerators | None
    probe_error: str | None
    try:
        found = probe()  # imports torch_npu where it is installed, as every launch does
    except Exception as exc:  # a broken torch_npu, a driver that fails: the doctor says so
        found, probe_error = None, _error(exc)
    else:
        probe_error = None
    checks.append(npu_verdict(npu_version, found.npu if found else None, probe_error))
    if found is None:
        checks.append(auto_device_verdict(None, 0, "", probe_error))
    else:
        placement = place("auto", found)
        checks.append(auto_device_verdict(placement.kind, placement.devices,
                                          BACKENDS[placement.kind], None))  # fmt: skip
    return checks, found


def torch_cuda() -> str | None:
    import torch

    return torch.version.cuda


def cuda_devices() -> tuple[list[str], str | None]:
    """The CUDA devices torch sees, by name, and the first warning torch gave while looking
    (a driver too old for this build, say)."""
    import torch

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        names = [torch.cuda.get_device_name(i) for i in range(count)]
    said = [first_line(str(w.message)) for w in caught]
    return names, next((s for s in said if s), None)


def nccl_facts() -> tuple[str | None, bool | None, str | None]:
    """NCCL's version and whether a communicator of it shrinks in place (the communicator's own
    test, asked of a one-rank group on this process's first CUDA device), or why not known."""
    import torch
    import torch.distributed as dist

    from elaswave.runtime.comm.backends import accelerator_group, shrinkable

    if not dist.is_nccl_available():
        return None, None, None
    try:
        raw = torch.cuda.nccl.version()
        version = ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)
    except Exception as exc:  # a build without NCCL's version call
        version = f"unknown ({_error(exc)})"
    try:
        pg = accelerator_group("nccl", dist.HashStore(), 0, size=1, timeout=timedelta(seconds=30))
    except Exception as exc:
        return version, None, _error(exc)
    try:
        return version, shrinkable(pg), None
    finally:
        shutdown = getattr(pg, "shutdown", None)
        if callable(shutdown):
            try:
                shutdown()
            except Exception:  # nothing was built on it: whatever it says changes no verdict
                pass


def _npu_version() -> str | None:
    """torch_npu's version if it is installed (found without importing it), else None."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    try:
        return importlib.metadata.version("torch_npu")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"


def gloo_check() -> Check:
    """Two gloo ranks (two threads of this process) all-reduce a tensor over loopback TCP."""
    import torch
    import torch.distributed as dist

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if not dist.is_gloo_available():
        return gloo_verdict(False, cpus or 0, None)
    store = dist.HashStore()
    results: list[Any] = [None, None]

    def rank(r: int) -> None:
        try:
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stubs omit ProcessGroupGloo._Options
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            opts._timeout = timedelta(seconds=GLOO_TIMEOUT_S)
            pg = dist.ProcessGroupGloo(store, r, 2, opts)
            t = torch.full((4,), float(r + 1))
            pg.allreduce([t]).wait()  # type: ignore[attr-defined]  # torch's stubs omit Backend.allreduce
            results[r] = t
        except Exception as exc:
            results[r] = exc

    other = threading.Thread(target=rank, args=(1,), daemon=True)
    other.start()
    rank(0)
    other.join(GLOO_TIMEOUT_S)
    error = next((_error(r) for r in results if isinstance(r, Exception)), None)
    if error is None and not all(isinstance(r, torch.Tensor) and r.eq(3.0).all() for r in results):
        error = f"all-reduce of 1 + 2 gave {results}"
    return gloo_verdict(True, cpus or 0, error)


# -- the network ------------------------------------------------------------------------------


def ports_check() -> Check:
    """A port where an embedded etcd would look for one is free and can be bound."""
    from elaswave.daemon import etcd_server
    from elaswave.errors import ElasWaveError

    ephemeral = etcd_server.ephemeral_range()
    candidates = etcd_server.port_candidates(ephemeral)
    try:
        port = etcd_server.free_port("127.0.0.1")
        etcd_server.check_port_free(port)
    except (OSError, ElasWaveError) as exc:
        return ports_verdict(ephemeral, candidates, None, _error(exc))
    return ports_verdict(ephemeral, candidates, port, None)


def host_address_check(endpoints: list[str]) -> Check:
    """The address this host's daemon would give its peers with these etcd endpoints
    (``host:port`` each), and what each endpoint answers."""
    from elaswave.daemon.supervisor import host_address_for

    if not endpoints:
        return host_address_verdict([], None, None)
    try:
        address: str | None = host_address_for(endpoints[0])
        error = None
    except OSError as exc:
        address, error = None, _error(exc)
    return host_address_verdict([etcd_answer(e) for e in endpoints], address, error)


def etcd_answer(endpoint: str) -> EtcdAnswer:
    """Whether ``host:port`` accepts a TCP connection, and what it is: a plain-HTTP etcd (its
    ``GET /version``), a TLS server (not queried further: the doctor takes no certificates), or
    something else."""
    host, _, port = endpoint.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        return EtcdAnswer(endpoint, connect_error=_error(exc))
    try:
        with urllib.request.urlopen(f"http://{endpoint}/version", timeout=CONNECT_TIMEOUT_S) as r:
            return EtcdAnswer(endpoint, version=str(json.loads(r.read(4096))["etcdserver"]))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        if speaks_tls(host, int(port)):
            return EtcdAnswer(endpoint, tls=True)
        return EtcdAnswer(endpoint, http_error=_error(exc) if str(exc) else "not etcd")


def speaks_tls(host: str, port: int) -> bool:
    """Whether the server at ``host:port`` answers a TLS handshake (completes it, or refuses
    this client with a TLS alert, as an etcd with ``--client-cert-auth`` does)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except ssl.SSLError as exc:
        return "ALERT" in str(exc.reason or "").upper()
    except OSError:
        return False
