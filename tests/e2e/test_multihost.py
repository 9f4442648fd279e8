"""Host-level faults on three hosts × two workers, each host a network namespace (tests/e2e/netbed).

Every test checks the run-wide properties on the hosts' merged logs: the job completes, every step
is committed exactly once and in order (one committer at a time: no split brain), epochs only grow
and none is planned twice, losses equal the fault-free run, no process is left behind.
"""

from __future__ import annotations

import time
from itertools import groupby
from typing import Any

import pytest
from conftest import (
    F64,
    Float64Runs,
    Run,
    assert_clean_run,
    assert_redid_only,
    paced,
    wait_for,
)
from netbed import NetBed, netbed_fixture  # noqa: F401 - provides the netbed_factory fixture

from elaswave.daemon.etcd_connect import start_order
from elaswave.events import read_jsonl
from elaswave.report import build_report

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

STEPS = 30
LEASE_TTL = 2


def _env(state_env: dict[str, str]) -> dict[str, str]:
    return dict(
        state_env,
        ELASWAVE_TIMEOUTS__LEASE_TTL=str(LEASE_TTL),
        ELASWAVE_TIMEOUTS__ETCD_CONNECT="2",
        ELASWAVE_TIMEOUTS__RENDEZVOUS="60",
    )


def _start(bed: NetBed, job: str, env: dict[str, str], steps: int = STEPS) -> None:
    for host in bed.hosts:
        bed.launch(
            host, "--job-id", job, "--nproc-per-node", "2", "--nnodes", "3:3",
            "--steps", str(steps), env=env,
        )  # fmt: skip


def _events(bed: NetBed, host: str) -> list[dict[str, Any]]:
    return list(read_jsonl(bed.run_dirs[host] / "events.jsonl"))


def _step(bed: NetBed) -> int:
    return max(
        (m["step"] for h in bed.hosts for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")),
        default=0,
    )


def _leader(bed: NetBed) -> str:
    def find() -> str | None:
        for h in bed.hosts:
            if any(e["kind"] == "leader_elected" for e in _events(bed, h)):
                return h
        return None

    return wait_for(find, timeout=60)


def _merged(bed: NetBed) -> Run:
    return Run(*(bed.run_dirs[h] for h in bed.hosts))


def assert_one_plan_per_epoch(run: Run) -> list[dict[str, Any]]:
    plans = run.of("plan_published")
    epochs = [p["epoch"] for p in plans]
    assert epochs == list(range(1, len(plans) + 1)), f"epochs planned twice or skipped: {epochs}"
    committed = [m["epoch"] for m in run.metrics]
    assert committed == sorted(committed), f"a step committed under an older epoch: {committed}"
    for plan in plans:  # ranks host by host: a ring crosses between hosts once per host
        hosts = [w.rsplit(".", 1)[0] for w in plan["workers"]]
        assert [h for h, _ in groupby(hosts)] == list(dict.fromkeys(hosts)), plan["workers"]
    return plans


def test_fault_free_three_hosts(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    bed = netbed_factory(hosts=3)
    _start(bed, "mh-free", _env(state_env), steps=10)
    codes = bed.wait(timeout=120)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = _merged(bed)
    assert_clean_run(run, 10, reference)
    assert [p["world"] for p in assert_one_plan_per_epoch(run)] == [6]


def _wait_step(bed: NetBed, step: int) -> None:
    wait_for(lambda: _step(bed) >= step, timeout=120, interval=0.1)


def test_host_loss(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    """A non-leader host dies (daemon and workers SIGKILLed): its lease expires, the leader
    re-plans on the two survivors."""
    bed = netbed_factory(hosts=3)
    env = _env(state_env)
    _start(bed, "mh-host", env)
    victim = next(h for h in reversed(bed.hosts) if h != _leader(bed))
    _wait_step(bed, 6)
    r = bed.cli("inject-fault", "--job-id", "mh-host", "--kind", "host", "--host", victim,
                "--etcd", bed.endpoints, env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    codes = bed.wait(timeout=150)
    assert codes[victim] == -9 and all(c == 0 for h, c in codes.items() if h != victim), codes
    run = _merged(bed)
    assert_clean_run(run, STEPS, reference)
    (fault,) = run.of("fault_injected")
    (lost,) = run.of("host_lost")
    assert fault["host"] == lost["host"] == victim
    # Detection is the lease expiring: about one TTL (plus a keep-alive period) after the kill.
    assert 0.5 * LEASE_TTL <= lost["t"] - fault["t"] <= LEASE_TTL + 3
    plans = assert_one_plan_per_epoch(run)
    assert [p["world"] for p in plans] == [6, 4]
    assert f"host {victim} lost" in plans[1]["reason"]
    assert all(m["world_size"] == 4 for m in run.metrics if m["time"] > lost["t"])
    gone = {w for w in plans[0]["workers"] if w.startswith(victim + ".")}
    assert len(gone) == 2 and set(plans[1]["departed"]) == gone
    assert_redid_only(run, 2, gone, may_have_committed=True)  # both ranks' micro-batches
    records = run.of("fault_injected") + run.of("fault_requested")  # the victim's, the leader's
    t0 = min(e["t"] for e in records if e["fault"]["kind"] == "host")
    _assert_host_incident(bed, "host", victim, t0, lost["t"])


def _assert_host_incident(bed: NetBed, kind: str, victim: str, t0: float, lost_t: float) -> None:
    """The report of the hosts' run directories times the loss from the fault to the leader's
    detection, and to the first step committed after it."""
    report = build_report(*(bed.run_dirs[h] for h in bed.hosts))
    incidents = [i for i in report["incidents"] if i["kind"] == kind]
    assert len(incidents) == 1, report["incidents"]
    (inc,) = incidents
    assert inc["host"] == victim
    assert abs(inc["detection_s"] - (lost_t - t0)) < 1e-3
    assert inc["plan_s"] is not None and inc["mttr_s"] > inc["detection_s"]
    assert inc["first_commit_step"] is not None


def test_leader_host_killed(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    """The leader's host dies: another daemon wins the election and plans the next epoch (once)."""
    bed = netbed_factory(hosts=3)
    env = _env(state_env)
    _start(bed, "mh-leader", env)
    leader = _leader(bed)
    _wait_step(bed, 6)
    killed_at = time.time()
    bed.kill_host(leader)
    codes = bed.wait(timeout=150)
    assert codes[leader] == -9 and all(c == 0 for h, c in codes.items() if h != leader), codes
    run = _merged(bed)
    assert_clean_run(run, STEPS, reference)
    done = min(e["t"] for e in run.of("job_done"))
    elected = [e for e in run.of("leader_elected") if e["t"] < done]
    assert [e["host"] for e in elected][0] == leader and len(elected) == 2
    assert elected[1]["host"] != leader and elected[1]["t"] - killed_at <= LEASE_TTL + 3
    plans = assert_one_plan_per_epoch(run)
    assert [p["world"] for p in plans] == [6, 4]
    assert all(leader not in w for w in plans[1]["workers"])
    assert [e["host"] for e in run.of("host_lost")] == [leader]


def test_etcd_member_killed(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    """One member of a three-member etcd cluster dies (the one the leader's daemon talks to:
    each daemon starts on the member its host id picks): the daemons on it fail over to the
    others and training is not interrupted."""
    bed = netbed_factory(hosts=3, etcd_members=3)
    env = _env(state_env)
    _start(bed, "mh-etcd", env)
    _wait_step(bed, 6)
    first = start_order(bed.endpoints.split(","), _leader(bed))[0]
    bed.kill_etcd(next(m for m in bed.members if first.startswith(bed.addr[m] + ":")))
    codes = bed.wait(timeout=150)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = _merged(bed)
    assert_clean_run(run, STEPS, reference)
    assert [p["world"] for p in assert_one_plan_per_epoch(run)] == [6]
    assert not run.of("host_fenced") and not run.of("worker_exit") and not run.of("host_lost")
    assert not run.of("step_aborted"), "a step was interrupted"


def test_partition_then_heal(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    """A host is cut off: the majority re-plans without it while its workers, which cannot
    commit a step without the others, wait. After the heal its daemon reads the newer plan that
    dropped them, fences them (killed, never in a plan again) and replaces them with new
    workers, admitted by a later plan."""
    steps = 100
    bed = netbed_factory(hosts=3)
    env = _env(state_env)
    _start(bed, "mh-part", env, steps=steps)
    victim = next(h for h in reversed(bed.hosts) if h != _leader(bed))
    _wait_step(bed, 5)
    r = bed.cli("inject-fault", "--job-id", "mh-part", "--kind", "partition", "--host", victim,
                "--etcd", bed.endpoints, "--json", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr
    others = [h for h in bed.hosts if h != victim]
    wait_for(
        lambda: any(e["kind"] == "host_lost" for h in others for e in _events(bed, h)), timeout=30
    )
    _wait_step(bed, _step(bed) + 2)  # the majority trains on without it
    assert not [e for e in _events(bed, victim) if e["kind"] == "host_fenced"], "fenced too early"
    healed_at = time.time()
    bed.heal(victim)
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = _merged(bed)
    assert_clean_run(run, steps, reference)
    plans = assert_one_plan_per_epoch(run)
    (lost,) = run.of("host_lost")
    assert lost["host"] == victim
    requested = [e for e in run.of("fault_requested") if e["fault"]["kind"] == "partition"]
    assert len(requested) == 2 and {e["host"] for e in requested} == {victim}  # the other two
    _assert_host_incident(bed, "partition", victim, min(e["t"] for e in requested), lost["t"])
    dropped = next(p for p in plans if f"host {victim} lost" in p["reason"])
    assert dropped["world"] == 4
    # Fenced by the plan, once the heal let it read it: the old workers were killed and never
    # appear in a plan again; their replacements joined.
    (fenced,) = run.of("host_fenced")
    assert fenced["host"] == victim and fenced["t"] > healed_at
    assert fenced["epoch"] >= dropped["epoch"] and len(fenced["killed"]) == 2
    old = set(fenced["workers"])
    later = [p for p in plans if p["epoch"] >= dropped["epoch"]]
    assert not any(w in p["workers"] for p in later for w in old)
    assert plans[-1]["world"] == 6, "the replacements were not admitted"
    # Every step committed after the cut came from the majority's epochs (no split brain).
    assert all(m["epoch"] >= dropped["epoch"] for m in run.metrics if m["time"] > lost["t"])


def test_single_etcd_stopped_for_two_lease_ttls(
    netbed_factory: Any,
    state_env: dict[str, str],
    reference: Run,
) -> None:
    """The job's only etcd dies and comes back 2 × TTL later (on its data dir: leases survive):
    no host is fenced, no worker lost, no plan made, and training goes on meanwhile."""
    steps = 60
    bed = netbed_factory(hosts=3, etcd_members=1)
    env = paced(_env(state_env), 0.05)  # ≥ 0.15 s a step: the job outlives the outage
    _start(bed, "mh-etcd-down", env, steps=steps)
    _wait_step(bed, 6)
    down_at = time.time()
    bed.kill_etcd(bed.members[0])
    time.sleep(2 * LEASE_TTL)
    up_at = time.time()
    bed.restart_etcd(bed.members[0])
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = _merged(bed)
    assert_clean_run(run, steps, reference)
    assert [p["world"] for p in assert_one_plan_per_epoch(run)] == [6]
    assert not run.of("host_fenced") and not run.of("worker_exit") and not run.of("host_lost")
    assert not run.of("step_aborted") and not run.of("lease_expired")
    during = [m["step"] for m in run.metrics if down_at + 0.5 < m["time"] < up_at]
    assert len(during) >= 3, "training waited for etcd"
    assert {e["host"] for e in run.of("etcd_reachable")} == set(bed.hosts)
    report = build_report(*(bed.run_dirs[h] for h in bed.hosts))
    (outage,) = [i for i in report["incidents"] if i["kind"] == "control plane"]
    assert outage["downtime_s"] >= 2 * LEASE_TTL - 0.5 and outage["steps_trained"] >= 3


def test_a_host_whose_workers_were_evicted_leaves_and_comes_back_when_launched_again(
    netbed_factory: Any, state_env: dict[str, str], float64_runs: Float64Runs
) -> None:
    """Replays outvote both workers of the second host, one after the other (each a device
    that miscomputes a gradient): each is evicted for good, and the host, with nothing left to
    run, leaves the job in one line and exits 0 while the first host trains on. Launched again,
    as an operator does once the devices are fixed, its new workers take the host's worker ids
    again: a new process under an evicted id is a newcomer, admitted by the next plan. The run
    ends bit-identical in float64 to the fault-free one."""
    steps = 60
    bed = netbed_factory(hosts=2)
    env = paced({**_env(state_env), **F64}, 0.06)  # runs on while the host comes back
    args = ("--job-id", "mh-evict", "--nproc-per-node", "2", "--nnodes", "1:2",
            "--steps", str(steps), "--replay-every", "1")  # fmt: skip
    for host in bed.hosts:
        bed.launch(host, *args, env=env)
    victim = next(h for h in bed.hosts if h != _leader(bed))

    def published() -> list[dict[str, Any]]:
        return [e for h in bed.hosts for e in _events(bed, h) if e["kind"] == "plan_published"]

    def miscompute(plan: dict[str, Any]) -> str:
        """A gradient fault on the victim's first worker in ``plan``; that worker."""
        rank = next(r for r, w in enumerate(plan["workers"]) if w.startswith(victim + "."))
        r = bed.cli("inject-fault", "--job-id", "mh-evict", "--kind", "corrupt", "--target",
                    "grad", "--rank", str(rank), "--etcd", bed.endpoints, env=env)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return str(plan["workers"][rank])

    # the job may start on the first host ready (--nnodes 1:2): the fault waits for both
    full = wait_for(lambda: next((p for p in published() if p["world"] == 4), None), timeout=60)
    bad = [miscompute(full)]
    three = wait_for(lambda: next((p for p in published() if p["world"] == 3), None), timeout=60)
    bad.append(miscompute(three))
    assert bed.daemons[victim].wait(timeout=60) == 0, bed.output(victim)
    assert "every worker it ran was evicted" in bed.output(victim)
    bed.launch(victim, *args, env=env)
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]

    run = _merged(bed)
    reference = float64_runs(steps)
    assert [m["step"] for m in run.metrics] == list(range(1, steps + 1))
    assert run.losses == reference.losses
    assert [e["odd_workers"] for e in run.of("replay_mismatch")] == [[b] for b in bad]
    (drained,) = run.of("host_drained")
    assert drained["host"] == victim and drained["evicted"] == sorted(bad)
    plans = assert_one_plan_per_epoch(run)
    worlds = [p["world"] for p in plans]
    start = worlds.index(4)  # before: the job started on the first host alone
    assert worlds[start:] == [4, 3, 2, 4], worlds
    assert [p["evicted"] for p in plans[start + 1 : start + 3]] == [[b] for b in bad]
    assert set(bad) <= set(plans[-1]["workers"]), "an evicted worker's id was never admitted again"
    finals = run.of("final_state")
    assert len(finals) == 4 and set(bad) <= {f["worker"] for f in finals}
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in finals} == {f[key] for f in reference.of("final_state")}, key
