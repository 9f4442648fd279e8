"""ZeRO-1: a crash takes a unique optimizer shard with it; the survivors promote the replica
pieces they keep of it, so nothing moves over the network and every survivor does the same share.
ZeRO-3 (below): the parameters are sharded too, and come back the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    CONFIG,
    F64,
    Float64Runs,
    Run,
    assert_clean_run,
    assert_redid_only,
    elaswave_cmd,
    launch,
    paced,
    wait_for,
)

from elaswave.events import read_jsonl
from elaswave.runtime.durable.checkpoints import PIECES


def _two_hosts(
    tmp_path: Path, env: dict[str, str], job_id: str, *args: str
) -> tuple[int, str, subprocess.CompletedProcess[str]]:
    """Two launches of ``job_id`` on one machine acting as hosts h1 and h2 (h2 joins h1's
    embedded etcd): h1's exit code and stderr, and h2's completed launch."""
    common = ("--job-id", job_id, "--nproc-per-node", "2", "--nnodes", "2:2", *args, "--quiet")
    first = subprocess.Popen(
        elaswave_cmd("launch", *common, str(CONFIG), "--run-dir", str(tmp_path / "h1"),
                     "--host-id", "h1"),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        record = Path(env["ELASWAVE_STATE_DIR"]) / "jobs" / f"{job_id}.json"
        wait_for(record.exists, timeout=60)
        time.sleep(0.2)
        etcd = ",".join(json.loads(record.read_text())["etcd"])
        second = launch(tmp_path / "h2", *common[:-1], "--host-id", "h2", "--etcd", etcd, env=env)
        code = first.wait(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    return code, first.stderr.read() if first.stderr else "", second


def _racked_hosts(
    tmp_path: Path, env: dict[str, str], job_id: str, racks: dict[str, str], *args: str
) -> tuple[dict[str, int], str]:
    """Launches of ``job_id`` on one machine acting as the hosts of ``racks`` (host → its
    ``--rack``), one worker each. The first starts the embedded etcd; the others join once its
    worker registered, so ranks follow ``racks``' order rack by rack. Each host's exit code, and
    every stderr."""
    n = len(racks)
    common = ("--job-id", job_id, "--nproc-per-node", "1", "--nnodes", f"{n}:{n}", *args)

    def start(host: str, *extra: str) -> subprocess.Popen[str]:
        return subprocess.Popen(
            elaswave_cmd("launch", *common, str(CONFIG), "--run-dir", str(tmp_path / host),
                         "--host-id", host, "--rack", racks[host], "--quiet", *extra),
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    first, *others = racks
    procs = {first: start(first)}
    try:
        record = Path(env["ELASWAVE_STATE_DIR"]) / "jobs" / f"{job_id}.json"
        wait_for(record.exists, timeout=60)
        time.sleep(0.2)
        etcd = ",".join(json.loads(record.read_text())["etcd"])
        events = tmp_path / first / "events.jsonl"
        wait_for(lambda: any(e["kind"] == "worker_ready" for e in read_jsonl(events)), 60)
        procs |= {host: start(host, "--etcd", etcd) for host in others}
        codes = {host: proc.wait(timeout=120) for host, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    return codes, "".join(proc.stderr.read() for proc in procs.values() if proc.stderr)


pytestmark = pytest.mark.e2e


def _synced(run: Run, epoch: int) -> list[dict]:
    return [e for e in run.of("state_synced") if e["epoch"] == epoch]


@pytest.mark.parametrize("phase", ["reduce", "optimizer"])
def test_zero_kill_restores_the_shard_from_the_replica_pieces(
    tmp_path: Path, state_env: dict[str, str], reference: Run, phase: str
) -> None:
    r = launch(tmp_path / "run", "--job-id", f"zero-{phase}", "--zero", "1",
               "--fault", f"kill,rank=1,at_step=15,phase={phase}", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)  # losses vs the replicated fault-free run, ≤1e-6
    (fault,) = run.of("fault_injected")
    assert fault["phase"] == phase
    synced = _synced(run, 2)
    assert {e["resume_step"] for e in synced} == {14}, "a step not committed by all is redone"
    assert all(e["transfers"] == 0 and e["bytes"] == 0 for e in synced), "nothing is sent"
    (promoted,) = {e["promoted_bytes"] for e in synced}
    assert promoted > 0 and all(e["max_over_mean"] < 1.001 for e in synced), "balanced"
    # Even after the reduction (phase optimizer) the survivors' own sums are intact.
    assert_redid_only(run, 2, {fault["worker"]})


def test_zero_deterministic_mode_matches_the_replicated_run_bit_for_bit(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs
) -> None:
    """float64 reduction: ZeRO with a crash ends with the very parameters *and* optimizer
    state (gathered from the shards) of a replicated fault-free run."""
    env = dict(state_env, ELASWAVE_TRAIN__REDUCE_DTYPE="float64")
    zero = launch(tmp_path / "zero", "--job-id", "zdet-zero", "--steps", "16", "--zero", "1",
                  "--fault", "kill,rank=3,at_step=7,phase=optimizer", env=env)  # fmt: skip
    assert zero.returncode == 0, zero.stderr[-2000:]
    a, b = float64_runs(16), Run(tmp_path / "zero")
    (fault,) = b.of("fault_injected")
    assert_redid_only(b, 2, {fault["worker"]})
    assert a.losses == b.losses
    assert {f["state_sha256"] for f in a.of("final_state")} == {
        f["state_sha256"] for f in b.of("final_state")
    }


def test_losing_a_rank_and_its_buddy_is_a_clear_failure(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Both copies of (part of) one shard gone — rank 2 keeps a piece of rank 1's replica: no
    durable checkpoint to fall back on yet, so the job stops with a one-line reason instead of
    training on a wrong state."""
    r = launch(tmp_path / "run", "--job-id", "zero-both", "--zero", "1",
               "--fault", "kill,rank=1,at_step=10", "--fault", "kill,rank=2,at_step=10",
               env=state_env)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot recover" in lines[0] and "replica" in lines[0], r.stderr
    run = Run(tmp_path / "run")
    assert run.of("shard_lost")
    assert max(m["step"] for m in run.metrics) < 10


def test_two_hosts_keep_every_replica_on_the_other_host(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Two launches on one etcd act as two hosts of two workers each."""
    # Config faults are submitted by whichever daemon wins the election: both hosts carry it.
    code, _, second = _two_hosts(
        tmp_path, state_env, "zero2h", "--zero", "1", "--fault", "kill,rank=0,at_step=10"
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert code == 0
    runs = [Run(tmp_path / "h1"), Run(tmp_path / "h2")]
    plans = runs[0].of("plan_published") + runs[1].of("plan_published")
    first_plan = next(p for p in plans if p["epoch"] == 1)
    hosts = [w.split(".")[0] for w in first_plan["workers"]]
    synced = [e for r in runs for e in r.of("state_synced") if e["epoch"] == 1]
    (holders,) = {json.dumps(e["replica_holders"], sort_keys=True) for e in synced}
    for owner, kept_by in json.loads(holders).items():
        assert kept_by and all(hosts[h] != hosts[int(owner)] for h in kept_by), (hosts, holders)
    metrics = runs[0].metrics + runs[1].metrics
    assert sorted({m["step"] for m in metrics}) == list(range(1, 41))
    for m in metrics:
        ref = reference.losses[m["step"]]
        assert abs(m["loss"] - ref) <= 1e-6 * abs(ref)
    finals = runs[0].of("final_state") + runs[1].of("final_state")
    assert len(finals) == 3 and len({f["params_sha256"] for f in finals}) == 1


def test_snapshots_every_three_steps_roll_back_and_redo(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """``--snapshot-every 3``: rank 1 dies in step 11 (step 10 committed, last snapshot at 9).
    Everybody rolls back to step 9 — parameters rebuilt from the snapshot's chunks — and redoes
    step 10 with the same losses; the report counts the redone step."""
    from elaswave.report import build_report

    r = launch(tmp_path / "run", "--job-id", "zero-k3", "--zero", "1", "--steps", "20",
               "--snapshot-every", "3", "--fault", "kill,rank=1,at_step=11",
               env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 20, reference)  # losses ≤1e-6, no step missing, params bit-identical
    synced = _synced(run, 2)
    assert {e["resume_step"] for e in synced} == {9}, "back to the last snapshot step"
    assert {e["redone_steps"] for e in synced} == {1}
    assert all(e["bytes"] == 0 and e["promoted_bytes"] > 0 for e in synced)
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["recomputed_steps"] == 1 and "rolled back to snapshot step 9" in inc["reason"]


def test_a_respawned_worker_takes_an_even_share_by_disjoint_transfers(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Shrink then grow with snapshots every 2 steps: the loss moves nothing over the network;
    the joiner receives its share (and the snapshot's parameter chunks it now owns) from the
    survivors, and every rank ends with the same parameters and optimizer state."""
    r = launch(tmp_path / "run", "--job-id", "zero-regrow", "--zero", "1", "--steps", "80",
               "--snapshot-every", "2", "--max-restarts", "1",
               "--fault", "kill,rank=1,at_step=8", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 80, reference)
    assert [p["world"] for p in run.of("plan_published")] == [4, 3, 4]
    shrink, grow = _synced(run, 2), _synced(run, 3)
    assert all(e["bytes"] == 0 and e["promoted_bytes"] > 0 for e in shrink)
    assert len(grow) == 4 and all(e["bytes"] > 0 and e["promoted_bytes"] == 0 for e in grow)
    assert {e["resume_step"] % 2 for e in shrink + grow} == {0}, "rolled back to snapshots"


# ---- ZeRO-3: parameters, gradients and optimizer state sharded --------------------------------
#
# Every run below is in the deterministic mode (float64 reduction), so ZeRO-3 must reproduce the
# very bits of replicated data parallelism whatever its membership history: one fault-free
# replicated run is the reference of them all.

Z3_STEPS = 12


def _f64(base: Path) -> dict[str, str]:
    return {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}


@pytest.fixture(scope="module")
def gpt64(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Replicated data parallelism, fault-free, 16 steps, checkpoints at steps 8 and 16."""
    base = tmp_path_factory.mktemp("z3-ref")
    r = launch(base / "run", "--job-id", "z3-ref", "--steps", "16", "--durable-every", "8",
               env=_f64(base))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(base / "run")


@pytest.fixture(scope="module")
def z3_faults(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """ZeRO-3 on 4 workers through a SIGKILL in step 3 (the worker is respawned and joins), then,
    once it has joined (plan epoch 3), a hang from step 8 on (the daemon kills it after 1.5 s; no
    restart left): 4 → 3 → 4 → 3 ranks. A durable checkpoint every 6 steps, written per shard.
    Emulated device time (0.2 s a step) leaves the respawn the job's last nine steps to join."""
    base = tmp_path_factory.mktemp("z3-faults")
    r = launch(base / "run", "--job-id", "z3-faults", "--zero", "3", "--steps", str(Z3_STEPS),
               "--max-restarts", "1", "--fault", "kill,rank=1,at_step=3",
               "--fault", "hang,rank=2,at_step=8,epoch=3", "--hang-timeout", "1.5",
               "--durable-every", "6",
               env=paced(_f64(base), 0.05))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(base / "run")


def _same_bits(run: Run, reference: Run, steps: range) -> None:
    """Each of ``steps`` committed once, with the reference's very loss."""
    assert [m["step"] for m in run.metrics] == list(steps)
    assert {s: run.losses[s] for s in steps} == {s: reference.losses[s] for s in steps}


def test_zero3_survives_a_kill_a_respawn_and_a_hang_bit_identical(
    z3_faults: Run, gpt64: Run
) -> None:
    """Each loss is replicated data parallelism's; a lost shard comes back from the replica
    pieces its peers hold (nothing over the network), the newcomer receives its share by
    transfers, every rank holds about a quarter (a third) of the parameters."""
    run = z3_faults
    assert_clean_run(run, Z3_STEPS, gpt64)
    _same_bits(run, gpt64, range(1, Z3_STEPS + 1))
    assert [p["world"] for p in run.of("plan_published")] == [4, 3, 4, 3]
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9, -9]
    (hang,) = run.of("hang_detected")
    assert "heartbeat" in hang["reason"]
    kill, hung = (e["step"] for e in run.of("fault_injected"))
    assert kill == 3 and hung >= 8
    for epoch, step in ((2, kill), (4, hung)):  # a loss: promoted, the step redone whole
        synced = _synced(run, epoch)
        assert len(synced) == 3 and all(e["bytes"] == 0 and e["transfers"] == 0 for e in synced)
        assert all(e["promoted_bytes"] > 0 and e["max_over_mean"] < 1.01 for e in synced)
        assert {e["redo_step"] for e in synced} == {step}
    grown = _synced(run, 3)
    assert len(grown) == 4 and all(e["bytes"] > 0 for e in grown), "the newcomer's share is sent"
    total = sum(e["param_bytes"] for e in run.of("memory") if e["epoch"] == 1)
    for e in run.of("memory"):
        world = {1: 4, 2: 3, 3: 4, 4: 3}[e["epoch"]]
        assert e["param_bytes"] <= 1.1 * total / world and e["gathered_bytes"] > 0


def test_a_zero3_checkpoint_resumes_replicated_on_two_workers_and_exports(
    z3_faults: Run, gpt64: Run, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Every rank wrote its own shard of the step-12 checkpoint; two replicated workers resume
    from it and end where the reference ends, bit for bit. ``elaswave export`` reads it too."""
    import hashlib

    from safetensors.torch import load_file

    from elaswave.export import run_config
    from elaswave.runtime.durable.checkpoints import latest
    from elaswave.runtime.workload.base import build_layers
    from elaswave.runtime.workload.load import load_workload

    path = latest(z3_faults.dir / "checkpoints")
    assert path is not None and path.name == f"step-{Z3_STEPS:08d}"
    index = json.loads((path / PIECES).read_text())
    assert len({rank for _, _, rank in index["pieces"]}) == 3, "one part per rank of the plan"
    r = launch(tmp_path / "run", "--job-id", "z3-resumed", "--steps", "16", "--nproc-per-node",
               "2", "--resume", str(z3_faults.dir / "checkpoints"),
               env={**state_env, **F64})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    resumed = Run(tmp_path / "run")
    _same_bits(resumed, gpt64, range(Z3_STEPS + 1, 17))
    _same_final(resumed, gpt64)
    out = tmp_path / "model.safetensors"
    r = subprocess.run(elaswave_cmd("export", "--run-dir", str(z3_faults.dir), "--out", str(out)),
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0 and f"exported step {Z3_STEPS}" in r.stdout, r.stderr[-2000:]
    tensors = load_file(str(out))
    model = build_layers(load_workload(run_config(z3_faults.dir)), 1234)
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # the flat order
    assert sorted(names) == sorted(tensors)
    params = b"".join(tensors[n].reshape(-1).numpy().tobytes() for n in names)
    (digest,) = {f["params_sha256"] for f in z3_faults.of("final_state")}
    assert hashlib.sha256(params).hexdigest() == digest, "the exported weights are the final ones"


def test_a_replicated_checkpoint_resumes_as_zero3_on_three_workers(
    gpt64: Run, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """The reference's step-8 checkpoint (whole tensors, written by rank 0) into ZeRO-3 on
    three workers: each takes its shard of it, and the run ends where the reference does."""
    from elaswave.runtime.durable.layout import LATEST

    step8 = gpt64.dir / "checkpoints" / "step-00000008"
    assert step8.is_dir()
    ck = tmp_path / "ck"
    shutil.copytree(step8, ck / step8.name)
    (ck / LATEST).write_text(step8.name)
    r = launch(tmp_path / "run", "--job-id", "z3-from-dp", "--zero", "3", "--steps", "16",
               "--nproc-per-node", "3", "--resume", str(ck), env={**state_env, **F64})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    _same_bits(run, gpt64, range(9, 17))
    _same_final(run, gpt64)


def _same_final(run: Run, reference: Run) -> None:
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in reference.of("final_state")
        }


@pytest.mark.parametrize("durable", [True, False], ids=["durable", "none"])
def test_zero3_two_ranks_lost_at_once_on_one_host(
    tmp_path: Path, state_env: dict[str, str], gpt64: Run, durable: bool
) -> None:
    """Ranks 1 and 2 of four die in step 6: on one host every peer holds a piece of every shard,
    so part of each lost shard was only on the other. With a durable checkpoint (step 4) the job
    falls back to it and goes on, bit for bit; without one it stops with one line naming what
    was lost. Never a hang."""
    flags = ["--durable-every", "4"] if durable else []
    r = launch(tmp_path / "run", "--job-id", "z3-two", "--zero", "3", "--steps", "8", *flags,
               "--fault", "kill,rank=1,at_step=6", "--fault", "kill,rank=2,at_step=6",
               env={**state_env, **F64}, timeout=150)  # fmt: skip
    run = Run(tmp_path / "run")
    if durable:
        assert r.returncode == 0, r.stderr[-3000:]
        _same_bits(run, gpt64, range(1, 9))
        (restored,) = run.of("durable_restored")
        assert restored["step"] == 4 and "replica" in restored["reason"]
        assert len({f["state_sha256"] for f in run.of("final_state")}) == 1
        return
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot recover" in lines[0] and "replica" in lines[0], r.stderr
    assert run.of("shard_lost") and max(m["step"] for m in run.metrics) < 6


def test_zero3_loses_a_whole_host_and_recovers_from_the_other_hosts_pieces(
    tmp_path: Path, state_env: dict[str, str], gpt64: Run
) -> None:
    """Two launches on one etcd act as two hosts of two workers each; replica pieces live on
    the other host only. Both workers of one host die in step 6: the other host holds every
    piece of their shards, so it goes on at once, nothing sent, bit for bit."""
    code, first_err, second = _two_hosts(
        tmp_path, {**state_env, **F64}, "z3-2h", "--zero", "3", "--steps", "10",
        "--fault", "kill,rank=2,at_step=6", "--fault", "kill,rank=3,at_step=6",
    )  # fmt: skip
    codes = {"h1": code, "h2": second.returncode}
    run = Run(tmp_path / "h1", tmp_path / "h2")
    lost = next(p for p in run.of("plan_published") if p["epoch"] == 1)["workers"][2]
    # the host whose workers all died ends with that line; the job goes on on the other
    assert codes == {lost.split(".")[0]: 1, ({"h1", "h2"} - {lost.split(".")[0]}).pop(): 0}
    assert "every worker was lost" in second.stderr + first_err
    assert sorted(m["step"] for m in run.metrics) == list(range(1, 11))
    assert run.losses == {s: gpt64.losses[s] for s in range(1, 11)}
    plans = run.of("plan_published")
    first_plan = next(p for p in plans if p["epoch"] == 1)
    hosts = [w.split(".")[0] for w in first_plan["workers"]]
    assert hosts[2] == hosts[3] != hosts[0], "ranks 2 and 3 are one host's"
    # the two deaths are one plan or two (as the daemon sees them); the survivors recover once,
    # into the last
    recovered = max(e["epoch"] for e in run.of("state_synced"))
    assert recovered in (2, 3)
    synced = [e for e in run.of("state_synced") if e["epoch"] == recovered]
    assert len(synced) == 2 and all(e["bytes"] == 0 and e["promoted_bytes"] > 0 for e in synced)
    finals = run.of("final_state")
    assert len(finals) == 2 and len({f["state_sha256"] for f in finals}) == 1


def test_zero3_loses_a_whole_rack_and_recovers_from_the_other_racks_copies(
    tmp_path: Path, state_env: dict[str, str], gpt64: Run
) -> None:
    """Hosts h1 and h2 in rack A, h3 in rack B (``--rack``), one worker each: ranks go rack by
    rack and the copies of A's shards all sit in B (by host alone, half of h1's would be on h2).
    Both of A's workers die in step 6: h3 holds every piece of their shards and goes on alone,
    nothing sent, bit for bit."""
    racks = {"h1": "A", "h2": "A", "h3": "B"}
    codes, err = _racked_hosts(
        tmp_path, {**state_env, **F64}, "z3-racks", racks, "--zero", "3", "--steps", "10",
        "--fault", "kill,rank=0,at_step=6", "--fault", "kill,rank=1,at_step=6",
    )  # fmt: skip
    assert codes == {"h1": 1, "h2": 1, "h3": 0}, err[-3000:]
    assert "every worker was lost" in err
    run = Run(*(tmp_path / h for h in racks))
    first = next(p for p in run.of("plan_published") if p["epoch"] == 1)
    assert [w.split(".")[0] for w in first["workers"]] == ["h1", "h2", "h3"]
    assert first["racks"] == racks
    (holders,) = {
        json.dumps(e["replica_holders"], sort_keys=True)
        for e in run.of("state_synced") if e["epoch"] == 1
    }  # fmt: skip
    assert json.loads(holders) == {"0": [2], "1": [2], "2": [0, 1]}
    assert sorted(m["step"] for m in run.metrics) == list(range(1, 11))
    assert run.losses == {s: gpt64.losses[s] for s in range(1, 11)}
    recovered = max(e["epoch"] for e in run.of("state_synced"))
    (synced,) = [e for e in run.of("state_synced") if e["epoch"] == recovered]
    assert synced["bytes"] == 0 and synced["promoted_bytes"] > 0
