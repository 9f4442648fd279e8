"""A straggler inside a pipeline: its stage is re-cut to fewer layers or its replica computes
fewer micro-batches. Real etcd, real worker processes, a real slow-down (the ``slow`` fault)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import (
    Run,
    assert_clean_run,
    assert_groups_edited,
    launch,
    paced,
    pipeline_groups,
)

from elaswave.report import build_report

pytestmark = pytest.mark.e2e

STEPS = 30
# Emulated device time per micro-batch (each stage sleeps its layers' share): the busy times the
# straggler detector compares are then the devices', not a CPU's few noisy milliseconds, where
# a healthy stage can read 1.27x its peer and be named a straggler beside the slow one. At 10 ms
# a healthy first stage once read 1.26x (a slower machine, its CPU share of the step larger):
# 30 ms keeps the CPU's part small however slow the machine.
DEVICE_TIME = 0.03


def test_slow_pipeline_stage_is_re_cut(tmp_path: Path, state_env: dict, reference: Run) -> None:
    """dp=2 × pp=2, rank 1 (replica 0's last stage) slow from step 2: the leader names it and
    publishes a layout with the same ranks that gives it less work; nothing is rolled back,
    every step is committed once and the losses are those of the fault-free run."""
    r = launch(tmp_path / "run", "--job-id", "pp-slow", "--pp", "2", "--steps", str(STEPS),
               "--straggler-threshold", "0",
               "--fault", "slow,rank=1,at_step=2,delay=1.0",
               env=paced(state_env, DEVICE_TIME))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, reference)
    (fault,) = run.of("fault_injected")
    slow = fault["worker"]
    assert fault["rank"] == 1
    detected = run.of("straggler_detected")
    assert detected, f"no straggler verdict: {[p['reason'] for p in run.of('plan_published')]}"
    first = detected[0]
    assert first["stragglers"] == [slow] and first["evict"] == []
    assert first["slowdown"][slow] > 1.25
    plans = run.of("plan_published")
    start = plans[0]
    recut = next(p for p in plans if p["reason"].startswith("straggler:"))
    assert recut["workers"] == start["workers"] and recut["replicas"] == start["replicas"]
    assert recut["departed"] == [] and recut["evicted"] == []
    assert sum(recut["microbatches"][r[0]] for r in recut["replicas"]) == 16, "same global batch"
    assert recut["bounds"] == first["bounds"]
    old, new = start["bounds"][0], recut["bounds"][0]
    fewer_layers = new[2] - new[1] < old[2] - old[1]
    smaller_share = recut["microbatches"][1] < start["microbatches"][1]
    assert fewer_layers or smaller_share, (start, recut)
    assert not run.of("worker_exit") and not run.of("worker_evicted")
    # Nobody died: no rank is fresh or rolled back, only the layout moves.
    synced = [e for e in run.of("state_synced") if e["epoch"] == recut["epoch"]]
    assert len(synced) == 4
    assert all(e["rolled_back"] == [] for e in synced), synced
    (resume,) = {e["resume_step"] for e in synced}
    assert resume > 0, "the ranks carried on from their committed state"
    assert all(f["holders_agree"] for f in run.of("final_state"))
    # The communicator was edited, not rebuilt: a holder set that is in both layouts keeps its
    # group, only the sets the re-cut created are built, and the training groups stay.
    assert_groups_edited(run, start, recut)
    before, after = pipeline_groups(start), pipeline_groups(recut)
    if fewer_layers:  # replica 0 re-cut, replica 1 not: one new set, the layer where they differ
        assert len(after - before) == 1 and len(before & after) == 4 and before <= after
        edits = [e for e in run.of("comm_rebuilt") if e["epoch"] == recut["epoch"]]
        assert sum(len(e["rebuilt"]) for e in edits) == 2  # its two members built it
    # Each rank reduces only its layers' gradients: together, one model's worth per replica.
    synced_bytes = [e["grad_reduce_bytes"] for e in synced]
    first_bytes = [e["grad_reduce_bytes"] for e in run.of("state_synced") if e["epoch"] == 1]
    assert sum(first_bytes) == sum(synced_bytes) and max(synced_bytes) < sum(synced_bytes) / 2
    inc = build_report(run.dir)["incidents"][0]
    assert inc["kind"] == "slow" and inc["reason"] == recut["reason"]
    assert inc["world_after"] == 4 and inc["first_commit_step"] is not None


def test_very_slow_pipeline_stage_is_evicted_and_taken_over(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """Past `--straggler-threshold` a pipeline rank is evicted, not re-cut: it is stopped
    cleanly (no crash, no respawn) and its replica's surviving stage takes over its layers, on
    the fault-free curve."""
    r = launch(tmp_path / "run", "--job-id", "pp-evict", "--pp", "2", "--steps", str(STEPS),
               "--straggler-threshold", "3", "--max-restarts", "2",
               "--fault", "slow,rank=1,at_step=2,delay=2.0",
               env=paced(state_env, DEVICE_TIME))  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, reference)
    (fault,) = run.of("fault_injected")
    (evicted,) = run.of("worker_evicted")
    assert evicted["worker"] == fault["worker"]
    assert not run.of("worker_exit") and not run.of("worker_respawned"), "eviction is no crash"
    plans = run.of("plan_published")
    last = plans[-1]
    assert any(p["evicted"] == [fault["worker"]] for p in plans)
    assert fault["worker"] not in last["workers"] and last["world"] == 3
    assert sorted(len(r) for r in last["replicas"]) == [1, 2], "the replica kept its survivor"
    assert all(f["holders_agree"] for f in run.of("final_state"))
