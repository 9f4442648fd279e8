"""The control plane's own failures never cost training: real etcd, real daemon, real signals.

The embedded etcd SIGKILLed mid-run (and one whose port is taken, so it cannot come back), an
external etcd killed with a worker killed while it is down, the daemon SIGSTOPped for longer than
the hang timeout and the lease TTL, every holder of the state lost at once, and a run directory
that fills up: the job's and, alone, its writers' (a real tmpfs, mounted for the test).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import Run, assert_clean_run, assert_no_orphans, launch_cmd, paced, wait_for

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.events import JsonlWriter, read_jsonl
from elaswave.report import build_report

pytestmark = pytest.mark.e2e

STEPS = 40


class Job:
    """A background ``launch`` whose stdout and stderr go to files (read while it runs)."""

    def __init__(
        self, tmp: Path, env: dict[str, str], *args: str, run_dir: Path | None = None
    ) -> None:
        self.run_dir = run_dir or tmp / "run"
        self.err_path = tmp / "launch.err"
        with open(tmp / "launch.out", "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen(
                launch_cmd(self.run_dir, *args), env=env, stdout=out, stderr=err, text=True
            )

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "events.jsonl") if e["kind"] == kind]

    def step(self) -> int:
        return max((m["step"] for m in read_jsonl(self.run_dir / "metrics.jsonl")), default=0)

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the workers of the first plan."""
        (plan,) = self.events("plan_published")[:1]
        spawned = {e["worker"]: e["pid"] for e in self.events("worker_spawned")}
        return {rank: spawned[w] for rank, w in enumerate(plan["workers"])}

    def wait(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"launch still running: {self.stderr()}") from None

    def stderr(self) -> str:
        return self.err_path.read_text()


def _assert_nothing_lost_to_the_control_plane(run: Run) -> None:
    assert not run.of("worker_exit"), "a healthy worker was lost"
    assert not run.of("hang_detected") and not run.of("host_fenced")
    assert not run.of("step_aborted"), "a step was interrupted"
    assert [p["epoch"] for p in run.of("plan_published")] == [1], "the job was re-planned"


def test_embedded_etcd_killed_mid_run(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """``launch`` restarts its etcd at once (same data dir and ports: keys, revisions and the
    lease survive); no worker notices, every step is committed once, on the fault-free curve."""
    job = Job(tmp_path, state_env, "--job-id", "etcdkill", "--steps", str(STEPS))
    wait_for(lambda: job.step() >= 8, timeout=120)
    (joined,) = job.events("host_joined")
    os.kill(joined["embedded_etcd_pid"], signal.SIGKILL)
    assert job.wait() == 0, job.stderr()
    run = Run(job.run_dir)
    assert_clean_run(run, STEPS, reference)
    _assert_nothing_lost_to_the_control_plane(run)
    (restarted,) = run.of("etcd_restarted")
    assert restarted["old_pid"] == joined["embedded_etcd_pid"] and restarted["pid"] != 0
    assert 0 < restarted["downtime"] < 10 and restarted["tries"] == 1
    assert not job.stderr().strip(), job.stderr()
    report = build_report(job.run_dir)
    (outage,) = [i for i in report["incidents"] if i["kind"] == "control plane"]
    assert outage["what"] == "embedded etcd restarted" and outage["downtime_s"] > 0


@pytest.fixture
def external_etcd() -> Iterator[EmbeddedEtcd]:
    """A single etcd the job does not own (``--etcd``), as an operator would run it."""
    etcd = EmbeddedEtcd().start()
    try:
        yield etcd
    finally:
        etcd.stop()


def test_worker_killed_while_etcd_is_down(
    tmp_path: Path,
    state_env: dict[str, str],
    reference: Run,
    external_etcd: EmbeddedEtcd,
) -> None:
    """etcd dies, then a worker dies while it is down: the survivors keep what they have, the
    departure waits in the daemon's outbox, and the recovery is planned the moment etcd is back
    (restarted on its data dir); the run stays on the fault-free curve."""
    env = dict(state_env, ELASWAVE_TIMEOUTS__ETCD_CONNECT="2")
    job = Job(
        tmp_path, env, "--job-id", "etcddown", "--steps", str(STEPS),
        "--etcd", external_etcd.endpoint, "--max-restarts", "1",
    )  # fmt: skip
    wait_for(lambda: job.step() >= 8, timeout=120)
    victim = job.worker_pids()[1]
    external_etcd.kill()
    wait_for(lambda: job.events("etcd_unreachable"), timeout=20)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.time()
    time.sleep(3.0)  # the worker's departure cannot reach etcd meanwhile
    assert not job.events("plan_published")[1:], "a plan was published without etcd"
    external_etcd.spawn()
    external_etcd.wait_healthy()
    assert job.wait() == 0, job.stderr()
    run = Run(job.run_dir)
    assert_clean_run(run, STEPS, reference)
    (exit_ev,) = run.of("worker_exit")
    assert exit_ev["pid"] == victim
    plans = run.of("plan_published")
    assert plans[1]["departed"] == [exit_ev["worker"]] and plans[1]["t"] > killed_at + 3.0
    back = run.of("etcd_reachable")
    assert back and back[0]["downtime"] > 3.0
    assert not run.of("host_fenced") and not run.of("hang_detected")


def test_daemon_paused_past_the_hang_timeout_and_the_lease(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """The daemon is SIGSTOPped for 3× the hang timeout (and longer than the lease TTL), as a
    long GC pause or a throttled container would: the workers train on meanwhile, none is
    declared hung, the host registers again in place, and no step is committed twice."""
    hang, ttl, steps = 2.0, 5, 150
    env = dict(state_env, ELASWAVE_TIMEOUTS__HANG=str(hang), ELASWAVE_TIMEOUTS__LEASE_TTL=str(ttl))
    job = Job(tmp_path, env, "--job-id", "paused", "--steps", str(steps))
    wait_for(lambda: job.step() >= 8, timeout=120)
    paused_at = time.time()
    os.kill(job.proc.pid, signal.SIGSTOP)
    time.sleep(3 * hang)
    resumed_at = time.time()
    os.kill(job.proc.pid, signal.SIGCONT)
    assert job.wait() == 0, job.stderr()
    run = Run(job.run_dir)
    assert_clean_run(run, steps, reference)
    _assert_nothing_lost_to_the_control_plane(run)
    during = [m["step"] for m in run.metrics if paused_at + 0.5 < m["time"] < resumed_at]
    assert len(during) >= 3, "training waited for the paused daemon"
    # The stop is seen as one pause of its length (a loaded machine may add short stalls of
    # the daemon's loop: those are recorded too, and are not this one).
    (paused,) = [p for p in run.of("daemon_paused") if p["seconds"] > hang]
    assert paused["seconds"] >= 3 * hang - 0.5
    assert run.of("lease_expired") and run.of("host_registered")
    assert not job.stderr().strip(), job.stderr()


def test_every_holder_of_the_state_lost_never_starts_over(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """All four workers die at once after steps were committed: the respawned ones hold no
    state, and without a durable checkpoint the job stops with one line that says what was lost
    (it used to start again from step 0, silently)."""
    job = Job(
        tmp_path, state_env, "--job-id", "alllost", "--steps", str(STEPS), "--max-restarts", "4"
    )
    wait_for(lambda: job.step() >= 8, timeout=120)
    for pid in job.worker_pids().values():
        os.kill(pid, signal.SIGKILL)
    code = job.wait()
    err = job.stderr().strip().splitlines()
    assert code != 0 and len(err) == 1, err
    assert "will not start over from step 0" in err[0] and "Traceback" not in job.stderr()
    run = Run(job.run_dir)
    steps = [m["step"] for m in run.metrics]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 8, steps
    assert_no_orphans(run)


def test_every_holder_lost_falls_back_to_the_durable_checkpoint(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """The same loss with durable checkpoints on: the job resumes from the newest one and ends
    on the fault-free curve, every step recorded once."""
    job = Job(
        tmp_path, state_env, "--job-id", "alllostd", "--steps", str(STEPS),
        "--max-restarts", "4", "--durable-every", "5",
    )  # fmt: skip
    wait_for(lambda: job.step() >= 12, timeout=120)
    for pid in job.worker_pids().values():
        os.kill(pid, signal.SIGKILL)
    assert job.wait() == 0, job.stderr()
    run = Run(job.run_dir)
    (restored,) = {(e["step"], e["reason"]) for e in run.of("durable_restored")}
    assert restored[0] >= 10 and "every worker holding the job's state is gone" in restored[1]
    committed = [m["step"] for m in run.metrics]
    assert committed == list(range(1, STEPS + 1)), committed
    ref = reference.losses
    assert all(abs(m["loss"] - ref[m["step"]]) <= 1e-6 * abs(ref[m["step"]]) for m in run.metrics)


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("1m")`` mounts a tmpfs of that size (root, as in CI): a disk that really fills up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], check=True
        )
        mounted.append(mnt)
        return mnt

    try:
        yield mount
    finally:
        for mnt in mounted:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


@pytest.fixture
def small_disk(tmpfs: Callable[[str], Path]) -> Path:
    """A 1 MiB disk for a run directory."""
    return tmpfs("1m")


def _fill(disk: Path) -> Path:
    """A filler file that takes every free block of ``disk`` (the run's files can still grow to
    the end of the blocks they hold: the next ones fail)."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    filler = disk / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * free)
    return filler


def _no_process_left(job: Job) -> None:
    pids = [e["pid"] for e in job.events("worker_spawned")]
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert not alive, alive


def test_run_directory_fills_up_and_space_returns(
    tmp_path: Path, state_env: dict[str, str], small_disk: Path, reference: Run
) -> None:
    """The run directory fills up mid-run: one line on stderr, training goes on with the
    records held in memory, and they are all written once space returns."""
    steps = 100
    # The final checkpoint (5.6 MB) goes elsewhere: on this 1 MiB disk it would fill the space
    # that returned, racing the records this test is about.
    # Paced: the job must outlive the full disk and the 2 s below (unpaced, 100 steps can end
    # before the space returns, and the records it held are then lost with exit 6).
    job = Job(
        tmp_path, paced(state_env, 0.03), "--job-id", "full", "--steps", str(steps),
        "--durable-dir", str(tmp_path / "checkpoints"), run_dir=small_disk / "run",
    )  # fmt: skip
    wait_for(lambda: job.step() >= 3, timeout=120)
    filler = _fill(small_disk)
    wait_for(lambda: "cannot write to the run directory" in job.stderr(), timeout=60)
    time.sleep(2.0)  # steps committed meanwhile wait in memory
    filler.unlink()
    assert job.wait() == 0, job.stderr()
    err = job.stderr().strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0], err
    run = Run(job.run_dir)
    assert_clean_run(run, steps, reference)


def test_run_directory_stays_full(
    tmp_path: Path, state_env: dict[str, str], small_disk: Path
) -> None:
    """A run directory that never gets space back: the job still ends (no hang, nothing left
    running), the file holds only whole lines, and the end says what was not written."""
    job = Job(
        tmp_path, state_env, "--job-id", "stayfull", "--steps", str(STEPS),
        "--durable-dir", str(tmp_path / "checkpoints"), run_dir=small_disk / "run",
    )  # fmt: skip
    wait_for(lambda: job.step() >= 3, timeout=120)
    _fill(small_disk)
    code = job.wait()
    err = job.stderr().strip().splitlines()
    assert code == 6, err
    assert len(err) == 2 and "Traceback" not in job.stderr(), err
    assert "cannot write to the run directory" in err[0] and "could not be written" in err[1]
    data = (job.run_dir / "metrics.jsonl").read_bytes()
    assert data.endswith(b"\n")
    steps = [m["step"] for m in read_jsonl(job.run_dir / "metrics.jsonl")]
    assert steps == list(range(1, len(steps) + 1)) and 3 <= len(steps) < STEPS
    _no_process_left(job)


def test_embedded_etcd_that_does_not_come_back(tmp_path: Path, capfd: Any) -> None:
    """The embedded etcd dies and its port is taken (something else listens there): after three
    failed restarts the user is told once that fault tolerance is off until etcd returns; the
    supervisor keeps trying, and etcd is back (same data) once the port is free again."""
    import asyncio
    import socket
    from types import SimpleNamespace

    from elaswave.daemon.controlplane import RESTART_TRIES, ControlPlane
    from elaswave.events import EventLog

    etcd = EmbeddedEtcd().start()
    log = EventLog(tmp_path / "events.jsonl")
    daemon = SimpleNamespace(host_id="h0", events=log)
    blocker = socket.socket()
    blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    async def main() -> bytes:
        db = await Etcd.connect([etcd.endpoint], prefix="/elaswave/t/")
        await db.put("/elaswave/t/kept", "across restarts")
        await db.close()
        task = asyncio.create_task(ControlPlane(daemon).supervise_etcd(etcd))  # type: ignore[arg-type]
        etcd.kill()
        blocker.bind((etcd.host, etcd.client_port))
        blocker.listen()
        await asyncio.to_thread(
            wait_for, lambda: [e for e in read_jsonl(log.path) if e["kind"] == "etcd_down"], 60
        )
        blocker.close()  # the port is free again: the next try brings etcd back
        await asyncio.to_thread(
            wait_for,
            lambda: [e for e in read_jsonl(log.path) if e["kind"] == "etcd_restarted"],
            60,
        )
        task.cancel()
        db = await Etcd.connect([etcd.endpoint], prefix="/elaswave/t/")
        kv = await db.get("/elaswave/t/kept")
        await db.close()
        return kv.value if kv else b""

    try:
        assert asyncio.run(main()) == b"across restarts", "the restarted etcd lost its data"
        events = list(read_jsonl(log.path))
        (restarted,) = [e for e in events if e["kind"] == "etcd_restarted"]
        assert restarted["tries"] > RESTART_TRIES and etcd.exit_code() is None
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "fault tolerance is off until etcd returns" in err[0], err
    finally:
        blocker.close()
        log.close()
        etcd.stop()


def _whole_lines(path: Path) -> list[dict]:
    data = path.read_bytes()
    assert not data or data.endswith(b"\n"), "a torn line was left in the file"
    return list(read_jsonl(path))


def test_a_full_disk_holds_records_back_and_writes_them_when_space_returns(
    tmpfs: Callable[[str], Path],
) -> None:
    """The run directory's writers on a real disk that fills: nothing lost, never a torn line,
    everything written in order once space returns."""
    small_disk = tmpfs("64k")
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 40_000)
    errors: list[OSError] = []
    writer = JsonlWriter(small_disk / "metrics.jsonl", on_error=lambda p, e: errors.append(e))
    for step in range(1, 301):
        writer.write({"step": step, "pad": "x" * 120})
    assert len(errors) == 1 and errors[0].errno == 28  # ENOSPC, reported once
    on_disk = _whole_lines(small_disk / "metrics.jsonl")
    assert writer.unwritten == 300 - len(on_disk) > 0
    assert [r["step"] for r in on_disk] == list(range(1, len(on_disk) + 1))

    filler.unlink()  # space returns: the next write takes the backlog first, in order
    writer.write({"step": 301, "pad": ""})
    assert writer.unwritten == 0
    writer.close()
    steps = [r["step"] for r in _whole_lines(small_disk / "metrics.jsonl")]
    assert steps == list(range(1, 302)), "records lost, duplicated or out of order"


def test_a_rollback_filters_held_back_records_too(tmpfs: Callable[[str], Path]) -> None:
    small_disk = tmpfs("64k")
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * 50_000)
    writer = JsonlWriter(small_disk / "metrics.jsonl", on_error=lambda p, e: None)
    for step in range(1, 201):
        writer.write({"step": step, "pad": "x" * 60})
    assert writer.unwritten > 0
    filler.unlink()
    writer.keep_only(lambda r: r["step"] <= 150)  # a rollback to step 150
    writer.write({"step": 151, "pad": "redone"})
    writer.close()
    records = _whole_lines(small_disk / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 152))
    assert records[-1]["pad"] == "redone"
