"""A whole job SIGKILLed (daemon, workers, etcd: what a node failure, a scheduler's kill or a
power cut does) and launched again under the same job id, as a scheduler's requeue or a person
would: it resumes from its newest durable checkpoint on the fault-free curve, every step
recorded once, or, with nothing to resume from, stops with one line and never trains from step 0
again unless told to (``--fresh``).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    F64,
    REL_TOL,
    Float64Runs,
    Run,
    assert_no_orphans,
    launch,
    paced,
    start,
    wait_for,
)
from netbed import netbed_fixture  # noqa: F401 - provides the netbed_factory fixture

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.errors import EXIT_PREEMPTED
from elaswave.events import read_jsonl
from elaswave.keys import JobKeys
from elaswave.report import build_report
from elaswave.runtime.durable.layout import check, newest_intact

pytestmark = pytest.mark.e2e

STEPS = 40
KILL_AFTER = 17  # committed steps before the whole job is killed


def _kill_whole_job(run_dir: Path, env: dict[str, str], *args: str, after: int = KILL_AFTER) -> int:
    """Start the job, SIGKILL its launch once ``after`` steps are committed (its workers, worker
    template, store and embedded etcd die with it); the steps committed by then."""
    proc = start(run_dir, env, *args)
    try:
        wait_for(lambda: _committed(run_dir) >= after or proc.poll() is not None, timeout=120,
                 interval=0.02)  # fmt: skip
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return _committed(run_dir)


def _committed(run_dir: Path) -> int:
    return max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in (r.stderr + r.stdout).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def _spawned_after(run: Run, t: float) -> list[dict[str, Any]]:
    return [e for e in run.of("worker_spawned") if e["t"] > t]


def _assert_on_the_curve(run: Run, steps: int, reference: Run) -> None:
    committed = [m["step"] for m in run.metrics]
    assert committed == list(range(1, steps + 1)), f"steps lost or recorded twice: {committed}"
    ref = reference.losses
    for step, loss in run.losses.items():
        if step in ref:
            assert abs(loss - ref[step]) <= REL_TOL * abs(ref[step]), (step, loss, ref[step])


def test_relaunch_resumes_from_the_newest_checkpoint(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    run_dir = tmp_path / "run"
    args = ("--job-id", "requeued", "--durable-every", "5")
    committed = _kill_whole_job(run_dir, state_env, *args)
    assert KILL_AFTER <= committed < STEPS
    killed_at = max(e["t"] for e in read_jsonl(run_dir / "events.jsonl"))

    r = launch(run_dir, *args, env=state_env)  # the same command again
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(run_dir)
    _assert_on_the_curve(run, STEPS, reference)
    (again,) = run.of("relaunched")
    checkpoint = committed - committed % 5
    assert (again["committed"], again["resume_step"]) == (committed, checkpoint)
    assert again["lost_steps"] == committed - checkpoint
    (restored,) = run.of("durable_restored")
    assert restored["step"] == checkpoint
    finals = [f for f in run.of("final_state") if f["t"] > killed_at]
    assert len(finals) == 4 and len({f["params_sha256"] for f in finals}) == 1
    plans = [p["epoch"] for p in run.of("plan_published")]
    assert plans == sorted(set(plans)), f"an epoch planned twice across the relaunch: {plans}"
    report = build_report(run_dir)
    (inc,) = [i for i in report["incidents"] if i["kind"] == "relaunch"]
    assert inc["recomputed_steps"] == committed - checkpoint
    assert inc["first_commit_step"] == committed + 1 and inc["mttr_s"] > 0
    assert report["totals"]["duplicate_steps"] == [] and report["totals"]["missing_steps"] == []
    assert_no_orphans(run)

    # Launched once more: nothing left to train, one line, exit 0, no worker started.
    before = max(e["t"] for e in run.events)
    r = launch(run_dir, *args, env=state_env)
    assert r.returncode == 0, r.stderr
    assert f"already committed all {STEPS} steps" in _one_line(r)
    assert not _spawned_after(Run(run_dir), before)
    # With more steps: it trains on from its final state.
    r = launch(run_dir, *args, "--steps", "48", env=state_env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in Run(run_dir).metrics] == list(range(1, 49))
    assert_no_orphans(Run(run_dir))


ROT_STEPS = 24  # the rotten-checkpoint test's run: a kill, then three relaunches of 4 steps each


@pytest.fixture(scope="module")
def f64_reference(float64_runs: Float64Runs) -> Run:
    return float64_runs(ROT_STEPS)


def _rot(newest: Path, how: str) -> str:
    """Spoil checkpoint ``newest`` as a disk or a person would; what its check must say."""
    data = max(newest.rglob("*.distcp"), key=lambda p: p.stat().st_size)
    name = data.relative_to(newest).as_posix()
    if how == "truncated":
        size = data.stat().st_size
        with data.open("r+b") as f:
            f.truncate(size - 100)
        return f"{name} has {size - 100} of its {size} bytes"
    if how == "flipped":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 3] ^= 0x10
        data.write_bytes(bytes(raw))
        return f"{name} does not match its checksum"
    (newest / ".metadata").unlink()
    return ".metadata is missing"


def test_a_rotten_checkpoint_is_never_loaded(
    tmp_path: Path, state_env: dict[str, str], f64_reference: Run
) -> None:
    """The newest checkpoint truncated, then changed by one bit, then missing its metadata:
    each relaunch resumes from the checkpoint before it and says which file failed, and the
    job ends bit for bit where the fault-free run ends, every step recorded once."""
    run_dir, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    env = {**state_env, **F64}
    args = ("--job-id", "rotten", "--durable-every", "4")
    _kill_whole_job(run_dir, env, *args, "--steps", str(ROT_STEPS), after=10)
    for steps, how in ((16, "truncated"), (20, "flipped"), (ROT_STEPS, "metadata")):
        newest = newest_intact(ckpts)
        assert newest.path is not None and newest.step is not None and not newest.skipped
        why = _rot(newest.path, how)
        assert check(newest.path) == why
        before = newest_intact(ckpts).step
        assert before is not None and before < newest.step
        started = max(e["t"] for e in read_jsonl(run_dir / "events.jsonl"))
        r = launch(run_dir, *args, "--steps", str(steps), env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        (again,) = [e for e in Run(run_dir).of("relaunched") if e["t"] > started]
        assert again["resume_step"] == before, (how, again)
        assert f"{newest.path.name}: {why}" in again["reason"]
        assert f"{again['lost_steps']} step(s) trained again" in again["reason"]
        (restored,) = [e for e in Run(run_dir).of("durable_restored") if e["t"] > started]
        assert restored["step"] == before
    run = Run(run_dir)
    committed = [m["step"] for m in run.metrics]
    assert committed == list(range(1, ROT_STEPS + 1)), f"steps lost or recorded twice: {committed}"
    assert run.losses == {s: f64_reference.losses[s] for s in committed}  # bit for bit
    last = max(e["t"] for e in run.of("relaunched"))
    finals = [f for f in run.of("final_state") if f["t"] > last]
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in finals} == {f[key] for f in f64_reference.of("final_state")}
    assert_no_orphans(run)

    # An explicit --resume of a checkpoint that fails its check: one line naming the file.
    newest = newest_intact(ckpts)
    assert newest.path is not None
    why = _rot(newest.path, "truncated")
    before = max(e["t"] for e in run.events)
    r = launch(tmp_path / "elsewhere", "--job-id", "from-rot", "--resume", str(ckpts), env=env)
    assert r.returncode != 0
    line = _one_line(r)
    assert why in line and line.startswith("error: --resume: the checkpoint"), line
    assert not _spawned_after(Run(run_dir), before)


def test_relaunch_without_a_checkpoint_refuses_then_fresh_starts_over(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    run_dir = tmp_path / "run"
    args = ("--job-id", "lost")
    committed = _kill_whole_job(run_dir, state_env, *args, after=8)
    first_run = (run_dir / "metrics.jsonl").read_text()
    trained = (run_dir / "config.json").read_text()

    # Another model under this job id: refused, and the run's config stays what it trained.
    r = launch(run_dir, *args, env=dict(state_env, ELASWAVE_MODEL__N_LAYER="3"))
    assert r.returncode == 5, r.stderr
    assert "ran before with other settings (model.n_layer: it had 2, this host 3)" in _one_line(r)
    assert (run_dir / "config.json").read_text() == trained

    before = max(e["t"] for e in read_jsonl(run_dir / "events.jsonl"))
    r = launch(run_dir, *args, env=state_env)
    assert r.returncode == 5, r.stderr
    line = _one_line(r)
    assert f"committed {committed} steps" in line and "will not train from step 0" in line
    assert "--fresh" in line and "--job-id" in line
    run = Run(run_dir)
    assert not _spawned_after(run, before), "nothing may start"
    assert [m["step"] for m in run.metrics] == list(range(1, committed + 1))  # untouched
    assert_no_orphans(run)

    r = launch(run_dir, *args, "--fresh", env=state_env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(run_dir)
    _assert_on_the_curve(run, STEPS, reference)
    (fresh,) = run.of("fresh_start")
    assert (Path(fresh["moved_to"]) / "metrics.jsonl").read_text() == first_run
    assert not run.of("relaunched")


def test_relaunch_reads_the_records_etcd_kept(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """On an external etcd the job's progress outlives it: relaunched at once into a new run
    directory (a node's local disk gone with it), under the same host id (a node's name, still
    registered until its lease expires), the job resumes from the shared checkpoints. The new run
    directory starts with the line of the step etcd's progress record kept (the killed launch may
    have moved that record and died before writing the step's line): across both directories
    every step is recorded once."""
    etcd = EmbeddedEtcd().start()
    try:
        env = dict(state_env, ELASWAVE_TIMEOUTS__LEASE_TTL="2")
        shared = tmp_path / "shared-checkpoints"
        args = ("--job-id", "external", "--etcd", etcd.endpoint, "--host-id", "node1",
                "--durable-every", "5", "--durable-dir", str(shared))  # fmt: skip
        committed = _kill_whole_job(tmp_path / "first", env, *args)
        r = launch(tmp_path / "second", *args, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
    finally:
        etcd.stop()
    first, second = Run(tmp_path / "first"), Run(tmp_path / "second")
    (again,) = second.of("relaunched")
    kept = again["committed"]  # a kill between the two writes leaves the file one step behind
    assert committed <= kept <= committed + 1 and "etcd" in again["reason"]
    assert again["line_from_etcd"] == kept
    assert [m["step"] for m in second.metrics] == list(range(kept, STEPS + 1))
    _assert_on_the_curve(Run(tmp_path / "first", tmp_path / "second"), STEPS, reference)
    assert_no_orphans(second)
    assert first.of("host_joined")[0]["host"] == second.of("host_joined")[0]["host"] == "node1"


@pytest.mark.netns
def test_three_hosts_killed_and_relaunched_resume(
    netbed_factory: Any, state_env: dict[str, str], reference: Run
) -> None:
    """Every host of a three-host job SIGKILLed at once, then relaunched (same host ids, run
    directories and shared checkpoint directory): one host decides to resume, the others join,
    and the hosts' merged records hold every step once."""
    bed = netbed_factory(hosts=3)
    env = dict(state_env, ELASWAVE_TIMEOUTS__LEASE_TTL="2", ELASWAVE_TIMEOUTS__ETCD_CONNECT="2")
    args = ("--job-id", "mh-relaunch", "--nproc-per-node", "2", "--nnodes", "3:3",
            "--steps", "30", "--durable-every", "5",
            "--durable-dir", str(bed.workdir / "checkpoints"))  # fmt: skip

    def step() -> int:
        return max((_committed(bed.run_dirs[h]) for h in bed.hosts), default=0)

    for host in bed.hosts:
        bed.launch(host, *args, env=env)
    wait_for(lambda: step() >= 12, timeout=120, interval=0.05)
    for host in bed.hosts:
        bed.kill_host(host)
    assert all(c == -9 for c in bed.wait(timeout=30).values())
    committed = step()
    # Relaunched at once, whatever is still registered: each host waits for the keys of the run
    # it was part of to go (its id is in that run's plan), then one resumes the job.
    for host in bed.hosts:
        bed.launch(host, *args, env=env)
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = Run(*(bed.run_dirs[h] for h in bed.hosts))
    _assert_on_the_curve(run, 30, reference)
    (again,) = run.of("relaunched")
    assert again["committed"] >= committed
    assert again["resume_step"] == again["committed"] - again["committed"] % 5
    epochs = [p["epoch"] for p in run.of("plan_published")]
    assert epochs == sorted(set(epochs))
    assert_no_orphans(run)


def test_a_refusal_keeps_the_records_in_etcd(tmp_path: Path, state_env: dict[str, str]) -> None:
    """Refused against an external etcd, the job's records there stay: a second launch from
    another disk is refused the same way (nothing trains from step 0 by trying twice)."""
    etcd = EmbeddedEtcd().start()
    try:
        env = dict(state_env, ELASWAVE_TIMEOUTS__LEASE_TTL="2")
        args = ("--job-id", "kept", "--etcd", etcd.endpoint, "--host-id", "node1")
        committed = _kill_whole_job(tmp_path / "run", env, *args, after=5)
        recorded = _progress(etcd.endpoint, "kept")["step"]
        lines = []
        for where in ("elsewhere", "again"):  # no records on these disks
            r = launch(tmp_path / where, *args, env=env)
            assert r.returncode == 5, r.stderr
            lines.append(_one_line(r))
    finally:
        etcd.stop()
    # A step's progress record is written before its metrics line: the kill may fall between.
    assert recorded in (committed, committed + 1)
    assert f"committed {recorded} steps (its progress record in etcd)" in lines[0]
    assert lines[0] == lines[1].replace("/again/", "/elsewhere/")
    assert not Run(tmp_path / "again").of("worker_spawned")


def test_a_host_relaunched_beside_a_dead_hosts_key_resumes_the_job(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """A requeue where the hosts go unevenly: h1 SIGKILLed (its key stays until its lease
    expires), h0 stopped with SIGTERM (its key gone, its id still in the plan; SIGTERM is no
    preemption here, so no checkpoint of its own), h0 launched again at once. The key it finds
    is no running job's: it waits for it to go and resumes the job from its checkpoint as a
    relaunch, rather than joining a job nobody runs."""
    ttl = 10  # h0 is back long before h1's key goes
    env = dict(paced(state_env, 0.01), ELASWAVE_TIMEOUTS__LEASE_TTL=str(ttl))
    with EmbeddedEtcd() as etcd:
        args = ("--job-id", "uneven", "--etcd", etcd.endpoint, "--nnodes", "1:2",
                "--nproc-per-node", "2", "--durable-every", "5", "--preempt-signal", "none",
                "--durable-dir", str(tmp_path / "checkpoints"))  # fmt: skip
        procs = {h: start(tmp_path / h, env, *args, "--host-id", h) for h in ("h0", "h1")}
        try:
            wait_for(lambda: _committed(tmp_path / "h0") + _committed(tmp_path / "h1") >= 12,
                     timeout=120, interval=0.05)  # fmt: skip
            procs["h1"].send_signal(signal.SIGKILL)
            procs["h0"].send_signal(signal.SIGTERM)
            for proc in procs.values():
                proc.wait(timeout=60)
            assert "h1" in _registered_in(etcd.endpoint, "uneven"), "h1's key went too soon"
            r = launch(tmp_path / "h0", *args, "--host-id", "h0", env=env)
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "h0", tmp_path / "h1")
    _assert_on_the_curve(run, STEPS, reference)
    (again,) = run.of("relaunched")
    assert again["resume_step"] == again["committed"] - again["committed"] % 5
    assert not [e for e in run.of("host_lost") if e["t"] > again["t"]], "joined a dead job"
    report = build_report(tmp_path / "h0", tmp_path / "h1")
    assert [i["kind"] for i in report["incidents"]].count("relaunch") == 1
    assert_no_orphans(run)


def _registered_in(endpoint: str, job_id: str) -> list[str]:
    kvs = _read(endpoint, job_id, lambda db, keys: db.get_prefix(keys.hosts))
    return [kv.key.rsplit("/", 1)[-1] for kv in kvs]


def _progress(endpoint: str, job_id: str) -> dict[str, Any]:
    kv = _read(endpoint, job_id, lambda db, keys: db.get(keys.progress))
    assert kv is not None, "no progress record"
    return dict(kv.json())


def _read(endpoint: str, job_id: str, query: Callable[[Etcd, JobKeys], Awaitable[Any]]) -> Any:
    """One read of ``job_id``'s keys in the etcd at ``endpoint``."""

    async def read() -> Any:
        keys = JobKeys(job_id)
        db = await Etcd.connect([endpoint], prefix=keys.prefix, timeout=5.0)
        try:
            return await query(db, keys)
        finally:
            await db.close()

    return asyncio.run(read())


def test_hosts_stopped_and_relaunched_together_resume_once(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Three hosts of a job on an external etcd preempted with SIGTERM (a scheduler's requeue or
    scancel: nothing of theirs is left registered), each launch exiting 75 once the job
    checkpointed its newest step, whatever durable_every says, and launched again at the same
    moment (srun starts every node's launch at once): one of them decides that the job resumes
    from that step and starts it, the others join it; no step is trained again, the relaunch is
    one incident, every step is recorded once. A fourth host, beyond ``--nnodes``' three, waits
    as a standby: preempted, its worker (in no plan, holding nothing) leaves at once, and its
    launch exits 75 too, without waiting out the grace period for a plan."""
    etcd = EmbeddedEtcd().start()
    hosts = ("h0", "h1", "h2")
    try:
        shared = tmp_path / "checkpoints"
        args = ("--job-id", "together", "--etcd", etcd.endpoint, "--nnodes", "3:3",
                "--nproc-per-node", "1", "--steps", "30", "--durable-every", "5",
                "--durable-dir", str(shared), "--preempt-grace", "30")  # fmt: skip

        def start_all(env: dict[str, str]) -> dict[str, subprocess.Popen[str]]:
            return {h: start(tmp_path / h, env, *args, "--host-id", h) for h in hosts}

        slow = paced(state_env, 0.05)  # 0.3 s a step: h3 has time to start
        procs = start_all(slow)
        try:
            wait_for(lambda: max(_committed(tmp_path / h) for h in hosts) >= 1, timeout=120,
                     interval=0.05)  # fmt: skip
            procs["h3"] = start(tmp_path / "h3", slow, *args, "--host-id", "h3")
            wait_for(lambda: Run(tmp_path / "h3").of("worker_ready"), timeout=60, interval=0.05)
            assert max(_committed(tmp_path / h) for h in hosts) < 30, "the job ended first"
        finally:
            signalled = time.monotonic()
            for proc in procs.values():
                proc.send_signal(signal.SIGTERM)
            errs = {h: proc.communicate(timeout=60)[1] for h, proc in procs.items()}
        took = time.monotonic() - signalled
        codes = {h: p.returncode for h, p in procs.items()}
        assert codes == dict.fromkeys([*hosts, "h3"], EXIT_PREEMPTED), errs
        assert took < 20, f"the launches took {took:.1f} s to leave"
        assert errs["h3"].strip().splitlines() == [
            "error: job 'together' preempted by SIGTERM: host h3's workers had not joined it "
            "yet and held no state; launch it again to resume"
        ], errs["h3"]
        standby = Run(tmp_path / "h3")
        assert [e["worker"] for e in standby.of("preempt_left")] == ["h3.w0"]
        assert not standby.of("preempted") and not standby.of("worker_respawned")
        assert not build_report(tmp_path / "h3")["incidents"], "a standby leaving is no incident"
        assert_no_orphans(standby)
        procs = start_all(state_env)
        outs = {h: p.communicate(timeout=180) for h, p in procs.items()}
        codes = {h: p.returncode for h, p in procs.items()}
        assert codes == dict.fromkeys(hosts, 0), {h: o[1][-2000:] for h, o in outs.items()}
    finally:
        etcd.stop()
    run = Run(*(tmp_path / h for h in hosts))
    _assert_on_the_curve(run, 30, reference)
    (again,) = run.of("relaunched")
    preempted = {e["step"] for e in run.of("preempted") if e["t"] < again["t"]}
    assert preempted == {again["resume_step"]} == {again["committed"]}, (preempted, again)
    assert again["lost_steps"] == 0
    report = build_report(*(tmp_path / h for h in hosts))
    assert [i["kind"] for i in report["incidents"]].count("relaunch") == 1
    assert_no_orphans(run)
