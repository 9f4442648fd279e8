"""ZeRO-1: a crash takes a unique optimizer shard with it; the survivors promote the replica
pieces they keep of it, so nothing moves over the network and every survivor does the same share."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Run, assert_clean_run, assert_redid_only, launch

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
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """float64 reduction: ZeRO with a crash ends with the very parameters *and* optimizer
    state (gathered from the shards) of a replicated fault-free run."""
    env = dict(state_env, ELASWAVE_TRAIN__REDUCE_DTYPE="float64")
    plain = launch(tmp_path / "plain", "--job-id", "zdet-plain", "--steps", "20", env=env)
    zero = launch(tmp_path / "zero", "--job-id", "zdet-zero", "--steps", "20", "--zero", "1",
                  "--fault", "kill,rank=3,at_step=7,phase=optimizer", env=env)  # fmt: skip
    assert plain.returncode == 0 and zero.returncode == 0, zero.stderr[-2000:]
    a, b = Run(tmp_path / "plain"), Run(tmp_path / "zero")
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
    import json
    import subprocess
    import time

    from conftest import CONFIG, elaswave_cmd, wait_for

    # Config faults are submitted by whichever daemon wins the election: both hosts carry it.
    common = ("--zero", "1", "--job-id", "zero2h", "--nproc-per-node", "2", "--nnodes", "2:2",
              "--fault", "kill,rank=0,at_step=10", "--quiet", str(CONFIG))  # fmt: skip
    first = subprocess.Popen(
        elaswave_cmd("launch", *common, "--run-dir", str(tmp_path / "h1"), "--host-id", "h1"),
        env=state_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        record = Path(state_env["ELASWAVE_STATE_DIR"]) / "jobs" / "zero2h.json"
        wait_for(record.exists, timeout=60)
        time.sleep(0.2)
        etcd = ",".join(json.loads(record.read_text())["etcd"])
        second = launch(tmp_path / "h2", *common[:-2], "--host-id", "h2", "--etcd", etcd,
                        env=state_env)  # fmt: skip
        assert second.returncode == 0, second.stderr[-2000:]
        assert first.wait(timeout=120) == 0
    finally:
        if first.poll() is None:
            first.kill()
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
