"""The CLI against live jobs in other processes: status, inject-fault, signals, bad input."""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import (
    Run,
    assert_no_orphans,
    cli,
    launch,
    paced,
    start,
    status_json,
    wait_for,
)

from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.report import build_report

pytestmark = pytest.mark.e2e


def step_of(job_id: str, env: dict[str, str], *extra: str) -> int:
    st = status_json(job_id, env, *extra)
    return int(((st or {}).get("progress") or {}).get("step", 0))


def test_status_and_inject_fault_through_etcd(tmp_path: Path, state_env: dict[str, str]) -> None:
    proc = start(tmp_path / "run", state_env, "--job-id", "live", "--steps", "400")
    try:
        wait_for(lambda: step_of("live", state_env) >= 3, timeout=90)
        st = status_json("live", state_env)
        assert st is not None and st["world_size"] == 4 and st["epoch"] == 1
        assert [m["rank"] for m in st["members"]] == [0, 1, 2, 3]
        assert all(m["alive"] and m["pid"] for m in st["members"])
        # Each rank says what it holds: replicated data parallelism, the whole model each.
        held = {(m["param_bytes"], m["optimizer_bytes"], m["replica_bytes"]) for m in st["members"]}
        ((params, moments, replicas),) = held
        assert params > 0 and moments == 2 * params and replicas == 0
        assert all(m["grad_bytes"] >= 2 * params for m in st["members"])  # autograd's + buffer
        victim = st["members"][2]

        bad = cli(
            "inject-fault", "--job-id", "live", "--kind", "kill", "--rank", "9", env=state_env
        )
        assert bad.returncode != 0
        assert "out of range" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1

        # A partition needs a host that is a network namespace here; this one is not.
        host = st["hosts"][0]["host"]
        for target, fragment in ((host, "network namespace"), ("nohost", "no live host")):
            part = ("inject-fault", "--job-id", "live", "--kind", "partition", "--host", target)
            refused = cli(*part, env=state_env)
            assert refused.returncode != 0 and fragment in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr

        inject = ("inject-fault", "--job-id", "live", "--kind", "kill", "--rank", "2", "--json")
        ok = cli(*inject, env=state_env)
        assert ok.returncode == 0, ok.stderr
        assert json.loads(ok.stdout)["target"] == victim["worker"]

        # The leader records the incident right after it publishes the plan: wait for both.
        after = wait_for(
            lambda: (s := status_json("live", state_env)) and s["epoch"] == 2
            and any("SIGKILL" in inc["reason"] for inc in s["incidents"]) and s,
            timeout=60,
        )  # fmt: skip
        assert after["world_size"] == 3
        assert victim["worker"] not in [m["worker"] for m in after["members"]]
        text = cli("status", "--job-id", "live", env=state_env)
        assert text.returncode == 0 and "epoch 2" in text.stdout
        # A rank reports what it holds after its first step under a plan: let the three
        # survivors train one before the job is stopped.
        wait_for(
            lambda: len({e["worker"] for e in Run(tmp_path / "run").of("memory")
                         if e["epoch"] == 2}) == 3,
            timeout=60,
        )  # fmt: skip
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    run = Run(tmp_path / "run")
    report = build_report(run.dir)
    (inc,) = report["incidents"]
    assert inc["worker"] == victim["worker"] and inc["mttr_s"] is not None
    memory = report["totals"]["memory"]
    assert set(memory) == {m["worker"] for m in st["members"]}
    assert {m["epoch"] for w, m in memory.items() if w != victim["worker"]} == {2}
    assert_no_orphans(run)
    assert not (Path(state_env["ELASWAVE_STATE_DIR"]) / "jobs" / "live.json").exists()
    # The job is gone: the CLI says so in one line.
    gone = cli("status", "--job-id", "live", env=state_env)
    assert gone.returncode != 0 and len(gone.stderr.strip().splitlines()) == 1


def test_sigterm_leaves_only_the_jobs_records_on_an_external_etcd(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    with EmbeddedEtcd() as etcd:
        proc = start(
            tmp_path / "a",
            state_env,
            "--job-id",
            "again",
            "--etcd",
            etcd.endpoint,
            "--steps",
            "400",
            "--preempt-signal",  # SIGTERM stops this host's part, no checkpoint of its own
            "none",
        )
        try:
            wait_for(lambda: step_of("again", state_env, "--etcd", etcd.endpoint) >= 2, timeout=90)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        assert proc.returncode == 128 + signal.SIGTERM
        assert_no_orphans(Run(tmp_path / "a"))
        committed = max(m["step"] for m in Run(tmp_path / "a").metrics)
        # Same job id, same etcd: its records say it trained, and it has no checkpoint: the
        # same command is refused (it would train from step 0 again), in one line.
        args = ("--job-id", "again", "--etcd", etcd.endpoint)
        r = launch(tmp_path / "b", *args, "--steps", "400", env=state_env)
        assert r.returncode == 5, r.stderr[-2000:]
        (line,) = [x for x in r.stderr.splitlines() if x.strip()]
        assert f"committed {committed} steps (its progress record in etcd)" in line
        # Started over on purpose: from epoch 1 and step 1, nothing stale in the way.
        r = launch(tmp_path / "b", *args, "--steps", "5", "--fresh", env=state_env)
        assert r.returncode == 0, r.stderr[-2000:]
        run = Run(tmp_path / "b")
        assert [m["step"] for m in run.metrics] == [1, 2, 3, 4, 5]
        assert [p["epoch"] for p in run.of("plan_published")] == [1]


def test_unreachable_etcd_is_a_one_line_error(tmp_path: Path, state_env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # bound, never listening: connections are refused
        started = time.monotonic()
        r = launch(
            tmp_path / "run", "--job-id", "noetcd", "--etcd", f"127.0.0.1:{dead}", env=state_env
        )
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach etcd" in lines[0], r.stderr
    assert time.monotonic() - started < 30
    workers = list((tmp_path / "run" / "logs").glob("*.w*.log"))
    assert not workers, "no worker may start without etcd"


def test_busy_etcd_port_is_a_one_line_error(tmp_path: Path, state_env: dict[str, str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = launch(tmp_path / "run", "--job-id", "busy", "--etcd-port", str(port), env=state_env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "already in use" in lines[0], r.stderr


def test_second_host_joins_and_the_plan_grows(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Two launches on one machine act as two hosts; the second joins mid-run (--nnodes 1:2)."""
    env = paced(state_env, 0.02)  # 0.16 s a step on h1 alone: h2 joins long before the end
    first = start(
        tmp_path / "h1", env,
        "--job-id", "grow", "--nproc-per-node", "2", "--nnodes", "1:2", "--host-id", "h1",
        "--steps", "100",
    )  # fmt: skip
    try:
        wait_for(lambda: step_of("grow", env) >= 5, timeout=90)
        record = json.loads((Path(env["ELASWAVE_STATE_DIR"]) / "jobs" / "grow.json").read_text())
        endpoint = ",".join(record["etcd"])
        host2 = ("--job-id", "grow", "--nproc-per-node", "2", "--nnodes", "1:2", "--host-id", "h2")
        mismatch = launch(tmp_path / "bad", *host2, "--etcd", endpoint, env=env)
        assert mismatch.returncode != 0
        assert "train.steps: job has 100, this host 40" in mismatch.stderr
        assert len(mismatch.stderr.strip().splitlines()) == 1
        second = launch(tmp_path / "h2", *host2, "--steps", "100", "--etcd", endpoint, env=env)
        assert second.returncode == 0, second.stderr[-2000:]
        assert first.wait(timeout=120) == 0, first.stderr.read() if first.stderr else ""
    finally:
        if first.poll() is None:
            first.kill()
    h1 = Run(tmp_path / "h1")
    worlds = [p["world"] for p in h1.of("plan_published")]
    assert worlds[0] == 2 and worlds[-1] == 4, worlds
    committed = [m["step"] for m in h1.metrics]
    assert committed == list(range(1, 101))
    assert h1.metrics[-1]["world_size"] == 4
    ref = reference.losses
    for step, loss in h1.losses.items():
        if step > 40:
            break  # the reference run has 40 steps; later ones are checked by the replicas below
        assert abs(loss - ref[step]) <= 1e-6 * abs(ref[step]), step
    finals = h1.of("final_state") + Run(tmp_path / "h2").of("final_state")
    assert len(finals) == 4 and len({f["params_sha256"] for f in finals}) == 1


def test_the_leader_host_leaves_with_its_last_worker_and_the_store_moves(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Three hosts of one worker (an external etcd); the leader's host h1 runs the slow one.
    The leader evicts its own worker as a straggler and publishes the plan without it, whose
    rendezvous store is h1's daemon's; then h1 goes away, every worker of its gone. The
    membership did not change, the store did: the new leader publishes the same layout with
    its own store (the ranks would otherwise wait for the old one for ever), and the job
    trains to the end on h2 and h3."""
    steps = 100  # long enough for the joins and the eviction to land before the end:
    env = paced(state_env, 0.02)  # 0.11 s a step on three workers, 0.32 s on h1 alone
    hosts = ("h1", "h2", "h3")
    procs = {}
    with EmbeddedEtcd() as etcd:
        common = ("--job-id", "moved", "--nnodes", "1:3", "--etcd", etcd.endpoint, "--steps",
                  str(steps), "--nproc-per-node", "1", "--straggler-threshold", "3")  # fmt: skip

        def world(size: int) -> dict | None:
            st = status_json("moved", env, "--etcd", etcd.endpoint)
            return st if st and st["world_size"] == size and st.get("progress") else None

        try:
            procs["h1"] = start(tmp_path / "h1", env, *common, "--host-id", "h1")
            wait_for(lambda: world(1), timeout=90)  # h1 leads: it started alone
            for host in hosts[1:]:
                procs[host] = start(tmp_path / host, env, *common, "--host-id", host)
            st = wait_for(lambda: world(3), timeout=90)
            (rank,) = [m["rank"] for m in st["members"] if m["worker"] == "h1.w0"]
            slow = cli("inject-fault", "--job-id", "moved", "--kind", "slow", "--rank", str(rank),
                       "--delay", "2", "--etcd", etcd.endpoint, env=env)  # fmt: skip
            assert slow.returncode == 0, slow.stderr
            # every worker of h1 evicted: it leaves in one line, and the job goes on
            assert procs["h1"].wait(timeout=120) == 0
            left = procs["h1"].stderr.read() if procs["h1"].stderr else ""
            assert "host h1 leaves job 'moved': every worker it ran was evicted (h1.w0)" in left
            for host in hosts[1:]:
                proc = procs[host]
                assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
    runs = {h: Run(tmp_path / h) for h in hosts}
    run = Run(*(tmp_path / h for h in hosts))
    assert [m["step"] for m in run.metrics] == list(range(1, steps + 1))
    (evicted,) = runs["h1"].of("worker_evicted")
    assert evicted["worker"] == "h1.w0"
    plans = run.of("plan_published")
    moved = [p for p in plans if "rendezvous store moved" in p["reason"]]
    assert len(moved) == 1, [p["reason"] for p in plans]
    before = next(p for p in plans if p["epoch"] == moved[0]["epoch"] - 1)
    assert before["evicted"] == ["h1.w0"]
    assert moved[0]["workers"] == before["workers"] and moved[0]["world"] == 2
    for step, ref in reference.losses.items():  # the 40 steps of the reference
        assert abs(run.losses[step] - ref) <= 1e-6 * abs(ref), step
    finals = run.of("final_state")
    assert len(finals) == 2 and len({f["params_sha256"] for f in finals}) == 1
    for r in runs.values():
        assert_no_orphans(r)
