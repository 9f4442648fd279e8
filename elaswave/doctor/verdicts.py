"""What ``elaswave doctor`` makes of each finding: PASS, WARN or FAIL with a one-line reason.

Every function here is pure: it takes what a probe found (versions, device counts, an error's
first line, a finished smoke run's report) and returns a :class:`Check`. The probing itself is in
:mod:`elaswave.doctor.probes` and :mod:`elaswave.doctor.smoke`; the tables that test these
decisions need no torch, no etcd and no GPU.

FAIL means a job will not run (or not recover) here; WARN means it runs, but something is worth
knowing (a slower recovery path, an optional piece missing where it looks wanted, a check that
was skipped); PASS says what was found.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PASS, WARN, FAIL = "PASS", "WARN", "FAIL"
STATUSES = (PASS, WARN, FAIL)

MIN_PYTHON = (3, 10)
MIN_ETCD = (3, 5)
SMOKE_WORKERS = 2


@dataclass(frozen=True)
class Check:
    """One finding: which check, in which section, its status and why (one line); ``detail``
    holds the structured facts behind it for ``--json``."""

    name: str
    section: str  # versions | devices | network | smoke
    status: str  # PASS | WARN | FAIL
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if "\n" in self.reason or not self.reason.strip():
            raise ValueError(f"a reason is one non-empty line, got {self.reason!r}")

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "section": self.section,
            "status": self.status,
            "reason": self.reason,
            "detail": self.detail,
        }


def exit_code(checks: Sequence[Check]) -> int:
    """0 if nothing FAILs, else 1."""
    return 1 if any(c.status == FAIL for c in checks) else 0


def first_line(text: str) -> str:
    """The first non-empty line of an error's text (the whole of a one-line error)."""
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()
    return ""


# -- versions ---------------------------------------------------------------------------------


def python_verdict(version: tuple[int, int, int]) -> Check:
    text = ".".join(map(str, version))
    if version[:2] < MIN_PYTHON:
        need = ".".join(map(str, MIN_PYTHON))
        return Check("python", "versions", FAIL, f"{text}: elaswave needs Python ≥ {need}")
    return Check("python", "versions", PASS, text, {"version": text})


def torch_verdict(
    version: str, cuda_build: str | None, nvidia_driver: bool, wanted: str, meets: bool | None
) -> Check:
    """torch: its version against elaswave's requirement (``meets`` None: not checked), and a
    CPU build on a host whose NVIDIA driver is loaded (the constraints file was kept on a GPU
    host)."""
    build = f"CUDA {cuda_build}" if cuda_build else "CPU build"
    detail = {"version": version, "cuda": cuda_build, "wanted": wanted}
    if meets is False:
        return Check("torch", "versions", FAIL, f"{version}: elaswave needs torch{wanted}", detail)
    if cuda_build is None and nvidia_driver:
        reason = (
            f"{version} is a CPU build on a host with an NVIDIA driver: install torch without "
            "-c constraints-cpu.txt to train on the GPUs"
        )
        return Check("torch", "versions", WARN, reason, detail)
    return Check("torch", "versions", PASS, f"{version} ({build})", detail)


def transformers_verdict(version: str | None, wanted: str, meets: bool | None) -> Check:
    """transformers is the optional ``hf`` extra: absent is fine, a version outside the extra's
    range is not (``model.source: hf`` would fail)."""
    detail = {"version": version, "wanted": wanted}
    if version is None:
        reason = "not installed (optional: model.source hf needs it, pip install 'elaswave[hf]')"
        return Check("transformers", "versions", PASS, reason, detail)
    if meets is False:
        reason = f"{version}: model.source hf needs transformers{wanted}"
        return Check("transformers", "versions", WARN, reason, detail)
    return Check("transformers", "versions", PASS, version, detail)


_ETCD_VERSION = re.compile(r"etcd Version:\s*(\d+)\.(\d+)\.(\d+)")


def etcd_version(output: str) -> tuple[int, int, int] | None:
    """The version ``etcd --version`` printed, or None if it printed none."""
    m = _ETCD_VERSION.search(output)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def etcd_verdict(path: str | None, error: str | None, output: str | None) -> Check:
    """The etcd binary an embedded etcd would run (``error``: why there is none, or why it did not
    run) and what its ``--version`` printed."""
    detail: dict[str, Any] = {"path": path}
    if path is None:
        return Check("etcd", "versions", FAIL, error or "no etcd binary", detail)
    if error is not None:
        return Check("etcd", "versions", FAIL, f"{path}: etcd --version failed: {error}", detail)
    version = etcd_version(output or "")
    if version is None:
        said = first_line(output or "") or "nothing"
        reason = f"{path}: not an etcd binary? it printed {said}"
        return Check("etcd", "versions", FAIL, reason, detail)
    text = ".".join(map(str, version))
    detail["version"] = text
    if version[:2] < MIN_ETCD:
        need = ".".join(map(str, MIN_ETCD))
        return Check("etcd", "versions", FAIL, f"{text} at {path}: elaswave needs {need}+", detail)
    return Check("etcd", "versions", PASS, f"{text} at {path}", detail)


# -- devices and backends ---------------------------------------------------------------------


def gloo_verdict(available: bool, cpus: int, error: str | None) -> Check:
    """The CPU and gloo: a one-rank gloo group all-reduced a tensor (``error``: why not)."""
    detail = {"cpus": cpus, "gloo": available}
    if not available:
        return Check("cpu/gloo", "devices", FAIL, "this torch has no gloo backend", detail)
    if error is not None:
        return Check("cpu/gloo", "devices", FAIL, f"gloo all-reduce failed: {error}", detail)
    return Check("cpu/gloo", "devices", PASS, f"{cpus} CPU cores; gloo all-reduce ok", detail)


def _devices(names: Sequence[str]) -> str:
    """``["A", "A", "B"]`` → ``"2 × A, 1 × B"`` (in order of first appearance)."""
    counts: dict[str, int] = {}
    for name in names:
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} × {name}" for name, n in counts.items())


def cuda_verdict(
    cuda_build: str | None, names: Sequence[str], nvidia_driver: bool, warning: str | None
) -> Check:
    """CUDA devices torch sees (``names``), against whether this torch is built for CUDA and the
    host has an NVIDIA driver; ``warning``: what torch said when it looked, if anything."""
    detail = {"cuda": cuda_build, "devices": list(names), "nvidia_driver": nvidia_driver}
    if names:
        return Check("cuda", "devices", PASS, f"{_devices(names)} (CUDA {cuda_build})", detail)
    if not nvidia_driver:
        build = f"torch built for CUDA {cuda_build}" if cuda_build else "CPU build of torch"
        return Check("cuda", "devices", PASS, f"no CUDA device (no NVIDIA driver; {build})", detail)
    if cuda_build is None:
        reason = "no CUDA device seen: NVIDIA driver present, but torch is a CPU build"
        return Check("cuda", "devices", WARN, reason, detail)
    why = warning or "check CUDA_VISIBLE_DEVICES and that the driver supports this CUDA"
    reason = f"NVIDIA driver present, torch sees no device: {why}"
    return Check("cuda", "devices", WARN, reason, detail)


def nccl_verdict(
    devices: int,
    available: bool,
    version: str | None,
    can_shrink: bool | None,
    error: str | None,
) -> Check:
    """NCCL for CUDA workers: present, its version, and whether a communicator can be shrunk in
    place after a fault (``can_shrink`` None with ``error``: could not be asked)."""
    detail = {"available": available, "version": version, "can_shrink": can_shrink}
    if devices == 0:
        return Check("nccl", "devices", PASS, "not used: no CUDA device", detail)
    if not available:
        reason = "this torch has no NCCL: CUDA workers cannot reduce gradients"
        return Check("nccl", "devices", FAIL, reason, detail)
    if can_shrink is None:
        reason = f"NCCL {version}: could not tell whether it shrinks in place: {error}"
        return Check("nccl", "devices", WARN, reason, detail)
    if can_shrink:
        reason = f"NCCL {version}; shrinks communicators in place after a fault"
        return Check("nccl", "devices", PASS, reason, detail)
    reason = (
        f"NCCL {version}: no in-place shrink (needs NCCL ≥ 2.27 and a PyTorch whose "
        "ProcessGroupNCCL has shrink); communicators are rebuilt after a fault"
    )
    return Check("nccl", "devices", WARN, reason, detail)


def npu_verdict(version: str | None, devices: int | None, error: str | None) -> Check:
    """Ascend NPUs through torch_npu (``version`` None: not installed; ``error``: it is
    installed but did not import, which every launch's device probe would meet too)."""
    detail = {"torch_npu": version, "devices": devices}
    if version is None:
        reason = "torch_npu not installed (needed for Ascend NPUs only)"
        return Check("ascend/hccl", "devices", PASS, reason, detail)
    if error is not None:
        reason = f"torch_npu {version} is installed but fails to import: {error}"
        return Check("ascend/hccl", "devices", FAIL, reason, detail)
    if not devices:
        reason = f"torch_npu {version} installed, but no NPU is visible"
        return Check("ascend/hccl", "devices", WARN, reason, detail)
    reason = f"{devices} NPU(s), HCCL through torch_npu {version} (not yet run on hardware)"
    return Check("ascend/hccl", "devices", PASS, reason, detail)


def auto_device_verdict(kind: str | None, devices: int, backend: str, error: str | None) -> Check:
    """Which device ``--device auto`` picks on this host (``error``: the probe failed)."""
    if kind is None:
        return Check("device auto", "devices", FAIL, f"probing the devices failed: {error}")
    detail = {"kind": kind, "devices": devices, "backend": backend}
    where = f"; {devices} device(s), one worker each" if devices else ""
    reason = f"--device auto picks {kind} ({backend}{where})"
    return Check("device auto", "devices", PASS, reason, detail)


# -- the network ------------------------------------------------------------------------------


def ports_verdict(
    ephemeral: tuple[int, int], candidates: range, port: int | None, error: str | None
) -> Check:
    """Loopback ports: ``port`` was found free (where an embedded etcd looks for its ports,
    ``candidates``) and bound again; ``ephemeral`` is the kernel's range for outgoing
    connections, which a listening port should stay out of."""
    lo, hi = ephemeral
    detail = {"ephemeral": [lo, hi], "port": port, "candidates": [candidates[0], candidates[-1]]}
    if port is None:
        reason = f"cannot bind on 127.0.0.1: {error}"
        return Check("loopback ports", "network", FAIL, reason, detail)
    if lo <= port <= hi:
        reason = (
            f"bound 127.0.0.1:{port}, but it is inside the ephemeral range {lo}–{hi}: an "
            "outgoing connection may take an embedded etcd's port while it restarts"
        )
        return Check("loopback ports", "network", WARN, reason, detail)
    reason = f"bound 127.0.0.1:{port}, outside the ephemeral range {lo}–{hi}"
    return Check("loopback ports", "network", PASS, reason, detail)


LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class EtcdAnswer:
    """What one etcd endpoint (``host:port``) did: refused a TCP connection (``connect_error``),
    or accepted it and answered ``GET /version`` as etcd (``version``), as a TLS server
    (``tls``: not checked further, the doctor takes no certificates), or as something else
    (``http_error``)."""

    endpoint: str
    connect_error: str | None = None
    version: str | None = None
    tls: bool = False
    http_error: str | None = None


def host_address_verdict(
    answers: Sequence[EtcdAnswer], address: str | None, error: str | None
) -> Check:
    """The address other hosts would reach this one on (the one its traffic to the first etcd
    endpoint leaves from; ``error``: no route), and what each etcd endpoint answered."""
    endpoints = [a.endpoint for a in answers]
    detail = {
        "etcd": {
            a.endpoint: a.version or a.connect_error or ("tls" if a.tls else a.http_error)
            for a in answers
        },
        "address": address,
    }
    if not answers:
        reason = "no --etcd given (--etcd H:P checks the address other hosts reach)"
        return Check("host address", "network", PASS, reason, detail)
    if address is None:
        reason = f"no route to {endpoints[0]}: {error}"
        return Check("host address", "network", FAIL, reason, detail)
    refused = [f"{a.endpoint}: {a.connect_error}" for a in answers if a.connect_error]
    if refused:
        reason = f"etcd cannot be reached at {'; '.join(refused)}"
        return Check("host address", "network", FAIL, reason, detail)
    other = [f"{a.endpoint}: {a.http_error}" for a in answers if a.http_error]
    if other:
        reason = f"not etcd (GET /version) at {'; '.join(other)}"
        return Check("host address", "network", FAIL, reason, detail)
    served = ", ".join(f"{a.endpoint} ({f'etcd {a.version}' if a.version else 'TLS'})"
                       for a in answers)  # fmt: skip
    if endpoints[0].rpartition(":")[0] in LOOPBACK:
        reason = f"etcd on loopback, {served}: peers reach {address}, so one host only"
        return Check("host address", "network", WARN, reason, detail)
    reason = f"other hosts reach this one at {address}; etcd answers at {served}"
    if any(a.tls for a in answers):
        reason += " (TLS endpoints: reached, not queried)"
    return Check("host address", "network", PASS, reason, detail)


# -- the smoke run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class SmokeRun:
    """What a finished (or stopped) smoke run left: ``exit_code`` None if it ran past its
    ``timeout_s``; ``error`` the last line it printed on stderr; ``report`` the MTTR report of
    its run directory (None: there was none); ``leftover`` the pids still running after it."""

    steps: int
    kill_rank: int
    kill_step: int
    device: str
    exit_code: int | None
    timeout_s: float
    wall_s: float
    error: str
    report: dict[str, Any] | None
    leftover: tuple[int, ...] = ()


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def smoke_problems(run: SmokeRun) -> list[str]:
    """Everything wrong with a smoke run, each one clause; empty when it passed: it exited 0,
    every step committed exactly once, the kill was answered by a new plan on the survivor
    whose first committed step was the interrupted one (recovered in place, nothing rolled
    back), and no process of it is left running."""
    problems = []
    if run.exit_code is None:
        problems.append(f"did not finish within {run.timeout_s:.0f} s")
    elif run.exit_code != 0:
        problems.append(f"launch exited {run.exit_code}: {run.error or 'no message'}")
    if run.report is None:
        problems.append("no run record to check")
    else:
        totals = run.report["totals"]
        problems += _steps_problems(run, totals)
        if run.exit_code == 0 or totals["last_step"] >= run.kill_step:  # else: not got that far
            problems += _recovery_problems(run, run.report["incidents"])
    if run.leftover:
        pids = ", ".join(map(str, run.leftover))
        problems.append(f"{len(run.leftover)} process(es) left running (pids {pids})")
    return problems


def _steps_problems(run: SmokeRun, totals: dict[str, Any]) -> list[str]:
    out = []
    if totals["committed_steps"] != run.steps or totals["last_step"] != run.steps:
        out.append(f"{totals['committed_steps']} of {run.steps} steps committed")
    if totals["duplicate_steps"]:
        out.append(f"steps committed twice: {totals['duplicate_steps']}")
    if totals["missing_steps"]:
        out.append(f"steps missing: {totals['missing_steps']}")
    return out


def kill_incident(run: SmokeRun, incidents: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The report's incident of the smoke run's kill (control-plane incidents, e.g. a daemon
    paused by a loaded machine, are other rows)."""
    for inc in incidents:
        if inc["kind"] == "kill" and inc["rank"] == run.kill_rank:
            return inc
    return None


def _recovery_problems(run: SmokeRun, incidents: Sequence[dict[str, Any]]) -> list[str]:
    inc = kill_incident(run, incidents)
    if inc is None:
        return [f"no incident recorded for the kill of rank {run.kill_rank}"]
    if inc["mttr_s"] is None:
        return [f"the kill at step {run.kill_step} was not recovered (no step committed after it)"]
    out = []
    if inc["world_after"] != SMOKE_WORKERS - 1:
        out.append(f"world after the kill is {inc['world_after']}, not {SMOKE_WORKERS - 1}")
    if inc.get("recomputed_steps"):
        out.append(f"rolled back {inc['recomputed_steps']} committed step(s) to recover")
    if inc["first_commit_step"] != inc["fault_step"]:
        out.append(
            f"first step after the kill was {inc['first_commit_step']}, not the interrupted "
            f"step {inc['fault_step']}"
        )
    return out


def smoke_verdict(run: SmokeRun) -> Check:
    """PASS with the MTTR, or FAIL with every problem found."""
    detail: dict[str, Any] = {
        "device": run.device,
        "workers": SMOKE_WORKERS,
        "steps": run.steps,
        "fault": f"kill,rank={run.kill_rank},at_step={run.kill_step}",
        "exit_code": run.exit_code,
        "wall_s": round(run.wall_s, 3),
        "leftover_pids": list(run.leftover),
    }
    inc = kill_incident(run, run.report["incidents"]) if run.report else None
    if inc is not None:
        detail["mttr_s"] = inc["mttr_s"]
        detail["phases_s"] = {k: inc.get(k) for k in ("detection_s", "plan_s", "comm_s",
                                                      "state_s", "redo_s")}  # fmt: skip
    problems = smoke_problems(run)
    if problems:
        return Check("smoke run", "smoke", FAIL, "; ".join(problems), detail)
    assert inc is not None  # no problems: the kill's incident is there and was recovered
    reason = (
        f"{SMOKE_WORKERS} {run.device} workers, {run.steps} steps each committed once; rank "
        f"{run.kill_rank} killed at step {run.kill_step}, recovered in place: MTTR "
        f"{_ms(inc['mttr_s'])} ({run.wall_s:.1f} s in all)"
    )
    return Check("smoke run", "smoke", PASS, reason, detail)


def smoke_not_run(status: str, why: str) -> Check:
    """The smoke run skipped (``--skip-smoke``, a device it cannot run two workers on) or
    refused (a device that is not there)."""
    return Check("smoke run", "smoke", status, f"not run: {why}")
