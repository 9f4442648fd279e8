"""Workers sharing a device (``--workers-per-device 2``), on the CPU: the collectives run over
gloo on host copies of the workers' tensors (``comm/staging.py``), the very code four workers
sharing one GPU run, minus the device copies. Every fault run must end bit-identical (losses,
parameters, optimizer state) to a fault-free unshared run in the deterministic mode (float64
reduction), through each kind of operation the strategies use: all-reduce (data parallelism),
reduce-scatter / all-gather / point-to-point exchanges (ZeRO-1), and point-to-point messages
posted and waited for by a background thread (a pipeline's asynchronous layer migration).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import F64, Float64Runs, Run, assert_clean_run, assert_redid_only, launch

pytestmark = pytest.mark.e2e

STEPS = 12
SHARED = ("--workers-per-device", "2", "--steps", str(STEPS))


@pytest.fixture(scope="module")
def f64_reference(float64_runs: Float64Runs) -> Run:
    run = float64_runs(STEPS)
    assert {e.get("staged", False) for e in run.of("comm_rebuilt")} == {False}
    return run


def _shared_run(tmp_path: Path, *args: str) -> Run:
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state"), **F64}
    r = launch(tmp_path / "run", *SHARED, *args, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    rebuilt = run.of("comm_rebuilt")
    assert rebuilt and all(e["backend"] == "gloo" and e["staged"] for e in rebuilt), rebuilt
    return run


def _bit_identical(run: Run, reference: Run) -> None:
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in reference.of("final_state")
        }, key


def test_a_crash_with_shared_devices_recovers_bit_identical(
    tmp_path: Path, f64_reference: Run
) -> None:
    run = _shared_run(tmp_path, "--job-id", "shared-kill", "--fault", "kill,rank=1,at_step=6")
    _bit_identical(run, f64_reference)
    (fault,) = run.of("fault_injected")
    assert_redid_only(run, 2, {fault["worker"]})
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert len(after) == 3 and all(e["rebuilt"] == ["dp"] for e in after), after


def test_zero_with_shared_devices_restores_the_lost_shard_bit_identical(
    tmp_path: Path, f64_reference: Run
) -> None:
    """ZeRO-1: the gradient is reduce-scattered, the parameters all-gathered, the shard
    replicas exchanged point to point, all staged."""
    run = _shared_run(
        tmp_path, "--job-id", "shared-zero", "--zero", "1",
        "--fault", "kill,rank=3,at_step=7,phase=optimizer",
    )  # fmt: skip
    _bit_identical(run, f64_reference)
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert synced and all(e["promoted_bytes"] > 0 for e in synced), synced


def test_a_stage_migrating_in_the_background_with_shared_devices(
    tmp_path: Path, f64_reference: Run
) -> None:
    """dp=2 × pp=2: a stage dies; its layers move to the survivor by messages posted on the
    migration group and waited for by a background thread (results copied back there)."""
    run = _shared_run(
        tmp_path, "--job-id", "shared-pp", "--pp", "2", "--migration", "async",
        "--fault", "kill,rank=1,at_step=4",
    )  # fmt: skip
    _bit_identical(run, f64_reference)
    plans = [p for p in run.of("plan_published") if "bounds" in p]
    synced = [e for e in run.of("state_synced") if e["epoch"] == plans[1]["epoch"]]
    assert {e["migration"] for e in synced} == {"async"}
    done = [e for e in run.of("migration_done") if e["epoch"] == plans[1]["epoch"]]
    assert len(done) == 1 and done[0]["step"] < STEPS and done[0]["bytes_received"] > 0, done
