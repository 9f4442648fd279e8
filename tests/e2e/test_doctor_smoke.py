"""``elaswave doctor`` on this host, as a user runs it: a real smoke run (two gloo workers, an
embedded etcd, a real SIGKILL), and nothing left running afterwards, also when it is stopped."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import elaswave_cmd

pytestmark = pytest.mark.e2e


def _env(tmp_path: Path) -> dict[str, str]:
    """The caller's environment with no ELASWAVE_* (the doctor leaves them out anyway) and a
    TMPDIR of this test's: whatever the doctor and its launch make lies under ``tmp_path``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    env["TMPDIR"] = str(tmp_path)
    return env


def _ours(tmp_path: Path) -> list[str]:
    """Processes still running that belong to the test's doctor: their working directory or
    command line is under ``tmp_path`` (the launch runs in its temporary directory, etcd's data
    directory is there, the workers inherit both)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "cwd", "status"]):
        info = proc.info
        if info["status"] == psutil.STATUS_ZOMBIE:
            continue
        where = " ".join([info["cwd"] or "", *(info["cmdline"] or [])])
        if str(tmp_path) in where:
            found.append(f"{info['pid']}: {' '.join(info['cmdline'] or [])[:120]}")
    return found


def _settled(tmp_path: Path, within: float = 5.0) -> list[str]:
    deadline = time.monotonic() + within
    while (left := _ours(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.timeout(400)
def test_doctor_on_this_host(tmp_path: Path) -> None:
    done = subprocess.run(
        elaswave_cmd("doctor", "--json"), env=_env(tmp_path), capture_output=True, text=True,
        timeout=380,
    )  # fmt: skip
    doc = json.loads(done.stdout)
    checks = {c["name"]: c for c in doc["checks"]}
    assert done.returncode == doc["exit_code"] == 0, (doc, done.stderr[-2000:])
    assert all(c["status"] != "FAIL" for c in checks.values())
    assert checks["cpu/gloo"]["status"] == "PASS"
    assert "gloo all-reduce ok" in checks["cpu/gloo"]["reason"]
    if not torch.cuda.is_available():  # this host: CPU only
        assert checks["cuda"]["reason"].startswith("no CUDA device"), checks["cuda"]
        assert checks["nccl"]["reason"] == "not used: no CUDA device"
        assert checks["device auto"]["reason"] == "--device auto picks cpu (gloo)"
    assert checks["etcd"]["status"] == "PASS"

    smoke = checks["smoke run"]
    assert smoke["status"] == "PASS", smoke
    assert smoke["detail"]["exit_code"] == 0 and smoke["detail"]["leftover_pids"] == []
    assert 0 < smoke["detail"]["mttr_s"] < 30
    assert f"MTTR {smoke['detail']['mttr_s'] * 1000:.0f} ms" in smoke["reason"]
    assert smoke["detail"]["device"] == "cpu" and smoke["detail"]["workers"] == 2
    # nothing left behind: no process, and the passing run's directory was removed
    assert _settled(tmp_path) == []
    assert not list(tmp_path.glob("elaswave-doctor-*"))


@pytest.mark.timeout(200)
def test_a_smoke_run_past_its_timeout_fails_and_is_stopped(tmp_path: Path) -> None:
    """Stopped mid-start (no launch finishes in 2 s): FAIL, exit 1, its run kept for a look,
    and every process it started is gone."""
    done = subprocess.run(
        elaswave_cmd("doctor", "--json", "--smoke-timeout", "2"), env=_env(tmp_path),
        capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    doc = json.loads(done.stdout)
    smoke = doc["checks"][-1]
    assert (done.returncode, smoke["status"]) == (1, "FAIL"), smoke
    assert smoke["reason"].startswith("did not finish within 2 s"), smoke["reason"]
    kept = Path(smoke["detail"]["kept"])
    assert kept.parent == tmp_path and f"run kept in {kept}" in smoke["reason"]
    assert _settled(tmp_path) == []
