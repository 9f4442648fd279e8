"""The doctor's smoke run: a real two-worker job with a real kill, checked from its run directory.

``elaswave launch`` runs as a subprocess (this interpreter, ``-m elaswave``) with the
built-in tiny GPT, an embedded etcd, ``--nproc-per-node 2`` and the fault
``kill,rank=1,at_step=8``, in a temporary directory that holds its run directory and a private
``ELASWAVE_STATE_DIR``; the caller's ``ELASWAVE_*`` settings are left out, so the run is the same
on every host. The launch starts a process session of its own, which every process it starts
(daemon threads, workers, etcd) belongs to: after it exits, whatever is still running in that
session was left behind. The verdict (:func:`elaswave.doctor.verdicts.smoke_verdict`) reads the
run through the MTTR report (:func:`elaswave.report.build_report`).

A run that passes (or is interrupted) is deleted; one that fails is kept and its directory named
in the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from elaswave.doctor.verdicts import (
    FAIL,
    PASS,
    SMOKE_WORKERS,
    WARN,
    Check,
    SmokeRun,
    first_line,
    smoke_not_run,
    smoke_verdict,
)

if TYPE_CHECKING:
    from elaswave.runtime.device import Accelerators

SMOKE_STEPS = 20
KILL_RANK = 1
KILL_STEP = 8
SMOKE_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0  # SIGTERM to the launch → its own clean shutdown → SIGKILL what is left
LEFTOVER_GRACE_S = 3.0  # processes of the session still exiting when the launch returned


def smoke_device(requested: str, found: Accelerators | None) -> tuple[str | None, Check | None]:
    """The device kind the smoke run's workers use for ``--device requested`` on a host with
    ``found``, or the check that says why it does not run: FAIL where the device asked for is
    absent (or the devices could not be probed), WARN where there are too few of them for two
    workers (a launch runs one worker per accelerator)."""
    from elaswave.errors import ConfigError
    from elaswave.runtime.device import place, workers_per_host

    if found is None:
        return None, smoke_not_run(FAIL, "the devices could not be probed")
    try:
        placement = place(requested, found)
    except ConfigError as exc:
        return None, smoke_not_run(FAIL, str(exc))
    try:
        workers_per_host(placement, SMOKE_WORKERS, cpu_default=SMOKE_WORKERS)
    except ConfigError as exc:
        return None, smoke_not_run(WARN, f"{exc}; --device cpu runs it on gloo")
    return placement.kind, None


def smoke_command(run_dir: Path, device: str, job_id: str) -> list[str]:
    """The ``elaswave launch`` command line of the smoke run."""
    return [
        sys.executable, "-m", "elaswave", "launch",
        "--device", device,
        "--nproc-per-node", str(SMOKE_WORKERS),
        "--steps", str(SMOKE_STEPS),
        "--max-restarts", "0",
        "--fault", f"kill,rank={KILL_RANK},at_step={KILL_STEP}",
        "--job-id", job_id,
        "--run-dir", str(run_dir),
        "--quiet",
    ]  # fmt: skip


def smoke_environment(environ: Mapping[str, str], state_dir: Path) -> dict[str, str]:
    """``environ`` without the caller's ``ELASWAVE_*`` settings, with a private state dir."""
    env = {k: v for k, v in environ.items() if not k.startswith("ELASWAVE_")}
    env["ELASWAVE_STATE_DIR"] = str(state_dir)
    return env


def session_members(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    import psutil

    found = []
    for proc in psutil.process_iter(["status"]):
        if proc.info["status"] == psutil.STATUS_ZOMBIE or proc.pid == os.getpid():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or not ours to look at
            if os.getsid(proc.pid) == sid:
                found.append(proc.pid)
    return sorted(found)


def leftovers(sid: int, grace: float = LEFTOVER_GRACE_S) -> tuple[int, ...]:
    """The processes of session ``sid`` still running ``grace`` seconds after it should have
    ended (those exiting at that moment are not counted)."""
    deadline = time.monotonic() + grace
    while True:
        alive = session_members(sid)
        if not alive or time.monotonic() >= deadline:
            return tuple(alive)
        time.sleep(0.1)


def stop_session(proc: subprocess.Popen[str], grace: float = STOP_GRACE_S) -> str:
    """Stop a launch that runs too long (or on Ctrl-C): SIGTERM, its own clean shutdown for up
    to ``grace`` seconds, then SIGKILL every process of its session still running. Returns what
    it wrote on stderr."""
    from elaswave.daemon.procs import terminate_then_kill

    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    stderr: str | None
    try:
        _, stderr = proc.communicate(timeout=grace)
    except subprocess.TimeoutExpired:
        stderr = None
    for pid in session_members(proc.pid):
        terminate_then_kill(pid, grace=1.0, sig=signal.SIGKILL)
    if stderr is None:
        _, stderr = proc.communicate()
    return stderr or ""


def run_smoke(device: str, timeout: float = SMOKE_TIMEOUT_S) -> Check:
    """Run the smoke job on ``device`` (a kind :func:`smoke_device` chose) and judge it."""
    from elaswave.events import EVENTS_FILE
    from elaswave.report import build_report

    base = Path(tempfile.mkdtemp(prefix="elaswave-doctor-"))
    run_dir = base / "run"
    cmd = smoke_command(run_dir, device, f"doctor-{os.getpid()}")
    env = smoke_environment(os.environ, base / "state")
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=base, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    code: int | None
    try:
        _, stderr = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        stderr, code = stop_session(proc), None
    except BaseException:  # Ctrl-C: leave nothing behind the doctor either
        stop_session(proc)
        shutil.rmtree(base, ignore_errors=True)
        raise
    wall = time.monotonic() - start
    left = leftovers(proc.pid)
    if left:  # reported below; stopped here, so that the doctor itself leaves nothing
        from elaswave.daemon.procs import terminate_then_kill

        for pid in left:
            terminate_then_kill(pid, grace=STOP_GRACE_S)
    lines = [ln for ln in (stderr or "").splitlines() if ln.strip()]
    error = first_line(lines[-1]) if lines and code != 0 else ""
    report = build_report(run_dir) if (run_dir / EVENTS_FILE).exists() else None
    run = SmokeRun(
        steps=SMOKE_STEPS, kill_rank=KILL_RANK, kill_step=KILL_STEP, device=device,
        exit_code=code, timeout_s=timeout, wall_s=wall, error=error, report=report,
        leftover=left,
    )  # fmt: skip
    check = smoke_verdict(run)
    if check.status == PASS:
        shutil.rmtree(base, ignore_errors=True)
        return check
    detail = {**check.detail, "kept": str(base)}
    return dataclasses.replace(check, reason=f"{check.reason}; run kept in {base}", detail=detail)
