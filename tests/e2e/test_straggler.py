"""Stragglers, faults during recovery and the restart-loop breaker: the test model, 4 gloo workers,
real etcd, real slow-downs and real SIGKILLs."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from conftest import (
    Run,
    assert_clean_run,
    assert_no_orphans,
    cli,
    launch,
    paced,
    start,
    status_json,
    wait_for,
)

from elaswave.daemon.etcd import Etcd
from elaswave.daemon.etcd_server import EmbeddedEtcd
from elaswave.errors import JobStopped
from elaswave.keys import JobKeys
from elaswave.report import build_report
from elaswave.report_text import render_markdown

pytestmark = pytest.mark.e2e


def test_slow_rank_gets_fewer_microbatches(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """A moderately slow rank keeps its place but computes less; the batch and losses hold.
    Emulated device time (0.04 s a step at four micro-batches) makes the 0.05 s delay about
    2× slower, whatever the CPU: under the eviction threshold (6×), well over a re-share's gain."""
    r = launch(tmp_path / "run", "--job-id", "slow", "--straggler-threshold", "6",
               "--fault", "slow,rank=3,at_step=3,delay=0.05",
               env=paced(state_env, 0.01))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    (fault,) = run.of("fault_injected")
    slow = fault["worker"]
    assert fault["rank"] == 3 and fault["step"] == 3 and fault["delay"] == 0.05
    plans = run.of("plan_published")
    reshared = [p for p in plans if p["reason"].startswith("straggler:")]
    assert reshared, f"no straggler plan: {[p['reason'] for p in plans]}"
    first = reshared[0]
    assert first["workers"] == plans[0]["workers"], "a re-share keeps every rank"
    assert first["departed"] == [] and first["evicted"] == []
    assert sum(first["microbatches"]) == 16, "global batch must not change"
    assert first["microbatches"][first["workers"].index(slow)] < 4
    assert not run.of("worker_evicted") and not run.of("worker_exit")
    assert len(run.of("final_state")) == 4
    # the communicator and the state stay where they are: only the dataflow changed
    assert all(e["rebuilt"] == [] for e in run.of("comm_rebuilt") if e["epoch"] > 1)
    assert all(e["bytes"] == 0 for e in run.of("state_synced") if e["epoch"] > 1)
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "slow" and inc["reason"] == first["reason"]
    assert inc["detection_s"] is not None and inc["first_commit_step"] is not None


def test_very_slow_rank_is_evicted(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """inject-fault --kind slow: past the threshold the rank is stopped cleanly, not respawned."""
    steps = 90  # the fault lands while most of them are left, however slow the status call:
    state_env = paced(state_env, 0.01)  # ≥ 0.04 s a step, 3.6 s in all, on any CPU
    proc = start(tmp_path / "run", state_env, "--job-id", "evict", "--straggler-threshold", "3",
                 "--max-restarts", "2", "--steps", str(steps))  # fmt: skip
    try:
        wait_for(lambda: (status_json("evict", state_env) or {}).get("progress"), timeout=120)
        # 1 s a step is over 10 times the others' compute per micro-batch: evicted
        inject = cli("inject-fault", "--job-id", "evict", "--kind", "slow", "--rank", "2",
                     "--delay", "1", env=state_env)  # fmt: skip
        assert inject.returncode == 0, inject.stderr
        st = wait_for(
            lambda: (
                (s := status_json("evict", state_env))
                and any("evicted" in i["reason"] for i in s["incidents"])
                and s
            ),
            timeout=120,
        )
        assert st["world_size"] == 3
        _, stderr = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, steps, reference)
    (fault,) = run.of("fault_injected")
    (evicted,) = run.of("worker_evicted")
    assert evicted["worker"] == fault["worker"]
    assert not run.of("worker_exit") and not run.of("worker_respawned"), "eviction is no crash"
    plan = next(p for p in run.of("plan_published") if p["evicted"])
    assert plan["evicted"] == [fault["worker"]] and plan["world"] == 3
    assert "threshold 3×" in plan["reason"] and "evicted" in plan["reason"]
    assert len(run.of("final_state")) == 3
    report = build_report(run.dir)
    (inc,) = report["incidents"]
    assert inc["kind"] == "slow" and inc["reason"] == plan["reason"] and inc["world_after"] == 3
    assert report["totals"]["evicted"] == [fault["worker"]]
    assert "Evicted as stragglers" in render_markdown(report)


def test_fault_during_recovery_is_superseded_by_a_newer_plan(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Rank 1 dies at step 8; rank 2 dies as it starts applying the plan that answers it."""
    r = launch(tmp_path / "run", "--job-id", "cascade",
               "--fault", "kill,rank=1,at_step=8",
               "--fault", "kill,rank=2,at_step=8,phase=recovery", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    first, second = sorted(run.of("fault_injected"), key=lambda e: e["t"])
    assert first["phase"] == "reduce" and second["phase"] == "recovery"
    assert [p["world"] for p in run.of("plan_published")] == [4, 3, 2]
    assert {m["epoch"] for m in run.metrics} == {1, 3}, "epoch 2 was superseded before any step"
    assert [m["world_size"] for m in run.metrics] == [4] * 7 + [2] * 33
    assert len(run.of("final_state")) == 2
    assert len(build_report(run.dir)["incidents"]) == 2


def test_restart_loop_stops_the_job(tmp_path: Path, state_env: dict[str, str]) -> None:
    """Whoever holds rank 1 dies at step 3, every time: the breaker stops the job with a verdict,
    every process ends and no key is left in etcd but the job's records (its progress and what
    it trains: what a relaunch of the job id would resume from, or be refused by)."""
    with EmbeddedEtcd() as etcd:
        r = launch(tmp_path / "run", "--job-id", "storm", "--etcd", etcd.endpoint,
                   "--max-restarts", "3", "--loop-breaker", "3",
                   "--fault", "kill,rank=1,at_step=3,repeat", env=state_env)  # fmt: skip
        assert r.returncode == JobStopped.exit_code, r.stderr[-3000:]
        lines = r.stderr.strip().splitlines()
        assert lines == [
            "elaswave: job stopped: restart loop (3 failures without a committed step since step 2)"
        ], r.stderr
        keys = JobKeys("storm")
        left = asyncio.run(_keys_under(etcd.endpoint, keys.prefix))
        assert sorted(left) == sorted([keys.config, keys.progress]), f"keys left behind: {left}"
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert len(run.of("worker_exit")) == 3
    (breaker,) = run.of("loop_breaker")
    assert breaker["reason"].startswith("restart loop (3 failures")
    assert run.of("job_stopped")
    assert build_report(run.dir)["totals"]["stopped"] == breaker["reason"]
    assert_no_orphans(run)


async def _keys_under(endpoint: str, prefix: str) -> list[str]:
    db = await Etcd.connect([endpoint], prefix=prefix, timeout=5.0)
    try:
        return [kv.key for kv in await db.get_prefix(prefix)]
    finally:
        await db.close()
