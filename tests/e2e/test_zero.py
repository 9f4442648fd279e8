"""ZeRO-1: a crash takes a unique optimizer shard with it; it comes back from its buddy."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Run, assert_clean_run, launch

pytestmark = pytest.mark.e2e


def _synced(run: Run, epoch: int) -> list[dict]:
    return [e for e in run.of("state_synced") if e["epoch"] == epoch]


@pytest.mark.parametrize("phase", ["reduce", "optimizer"])
def test_zero_kill_restores_the_shard_from_its_buddy(
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
    assert all(e["transfers"] > 0 and e["bytes"] > 0 for e in synced)
    assert {e["pairs"] for e in synced} == {2}, "the lost shard moves only from its buddy"


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
    assert a.losses == b.losses
    assert {f["state_sha256"] for f in a.of("final_state")} == {
        f["state_sha256"] for f in b.of("final_state")
    }


def test_losing_a_rank_and_its_buddy_is_a_clear_failure(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Both copies of one shard gone: no durable checkpoint to fall back on yet, so the job
    stops with a one-line reason instead of training on a wrong state."""
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

    common = ("--zero", "1", "--job-id", "zero2h", "--nproc-per-node", "2", "--nnodes", "2:2",
              "--quiet", str(CONFIG))  # fmt: skip
    first = subprocess.Popen(
        elaswave_cmd("launch", *common, "--run-dir", str(tmp_path / "h1"), "--host-id", "h1",
                     "--fault", "kill,rank=0,at_step=10"),
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
    (shift,) = {e["buddy_shift"] for e in synced}
    assert all(hosts[r] != hosts[(r + shift) % 4] for r in range(4)), (hosts, shift)
    metrics = runs[0].metrics + runs[1].metrics
    assert sorted({m["step"] for m in metrics}) == list(range(1, 41))
    for m in metrics:
        ref = reference.losses[m["step"]]
        assert abs(m["loss"] - ref) <= 1e-6 * abs(ref)
    finals = runs[0].of("final_state") + runs[1].of("final_state")
    assert len(finals) == 3 and len({f["params_sha256"] for f in finals}) == 1
