"""Silent data corruption: found by online verification within K steps, rolled back to the
last known-good state and redone, so that it leaves no trace in the trajectory."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import F64, Float64Runs, Run, assert_clean_run, launch

from elaswave.report import build_report

pytestmark = pytest.mark.e2e


def test_corrupt_parameters_are_detected_within_k_steps_and_repaired(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    r = launch(tmp_path / "run", "--job-id", "sdc", "--steps", "16", "--verify-every", "5",
               "--fault", "corrupt,rank=2,at_step=7", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(tmp_path / "run")
    (fault,) = run.of("fault_injected")
    (detected,) = run.of("sdc_detected")
    assert detected["step"] == 10 and detected["ranks"] == [2], "found at the next check"
    assert detected["workers"] == [fault["worker"]]
    assert run.of("sdc_repaired")
    finals = run.of("final_state")
    assert len(finals) == 4 and len({f["state_sha256"] for f in finals}) == 1, "repaired"
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "corrupt" and inc["detected_step"] == 10 and inc["mttr_s"] > 0


def test_corrupt_replica_is_repaired_before_it_is_needed(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """Rank 1 keeps rank 0's ZeRO replica; it is corrupted right after step 10 commits, the
    check at step 10 repairs it, and rank 0 dies in step 11, so its shard is rebuilt from exactly
    that (repaired) replica: the run stays on the fault-free curve."""
    r = launch(tmp_path / "run", "--job-id", "sdc-zero", "--zero", "1", "--verify-every", "5",
               "--fault", "corrupt,rank=1,at_step=10,target=snapshot",
               "--fault", "kill,rank=0,at_step=11", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(tmp_path / "run")
    (detected,) = run.of("sdc_detected")
    assert detected["what"] == "zero shard copy" and detected["step"] == 10
    assert_clean_run(run, 40, reference)


def test_a_corrupt_replica_is_never_used(tmp_path: Path, state_env: dict[str, str]) -> None:
    """Without verification the corruption is only caught when the replica is needed (its owner
    dies in the very next step, before a fresh replica is made): its checksum fails, and the job
    stops rather than training on a wrong state."""
    r = launch(tmp_path / "run", "--job-id", "sdc-never", "--zero", "1", "--verify-every", "0",
               "--fault", "corrupt,rank=1,at_step=6,target=snapshot",
               "--fault", "kill,rank=0,at_step=7", env=state_env)  # fmt: skip
    assert r.returncode != 0
    assert "checksum" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    run = Run(tmp_path / "run")
    assert max(m["step"] for m in run.metrics) == 6


@pytest.mark.parametrize(
    "flags",
    [("--nproc-per-node", "4"), ("--nproc-per-node", "6", "--zero", "1")],
    ids=["replicated", "zero"],
)
def test_pipeline_copies_are_verified_and_the_hit_copy_repaired(
    tmp_path: Path, state_env: dict[str, str], reference: Run, flags: tuple
) -> None:
    """dp × pp=2, checks after every step: a flipped parameter (rank 1) and a flipped Adam
    moment (rank 2) are found at once — the hit copy fails the CRC its rank recorded after its
    update, which decides between two copies — and repaired from a good one before the next
    step: every loss stays on the fault-free curve and all copies end identical."""
    r = launch(
        tmp_path / "run", "--job-id", "sdc-pp", "--pp", "2", *flags, "--steps", "12",
        "--verify-every", "1", "--fault", "corrupt,rank=1,at_step=5",
        "--fault", "corrupt,rank=2,at_step=8,target=snapshot", env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 12, reference)
    found = run.of("sdc_detected")
    assert [(d["step"], d["what"], d["ranks"], d["tie"]) for d in found] == [
        (5, "parameters", [1], False),
        (8, "optimizer moments", [2], False),
    ]
    assert all(d["source_rank"] is not None for d in found)
    assert len(run.of("sdc_repaired")) == 2
    assert all(f["holders_agree"] for f in run.of("final_state"))
    assert [i["kind"] for i in build_report(run.dir)["incidents"]] == ["corrupt", "corrupt"]


SDC_STEPS = 16


@pytest.fixture(scope="module")
def float64_reference(float64_runs: Float64Runs) -> Run:
    return float64_runs(SDC_STEPS)


@pytest.mark.parametrize(
    ("flags", "faults"),
    [
        ((), ("corrupt,rank=2,at_step=7",)),
        # ZeRO gathers every parameter after the update: a flip in a parameter another rank
        # owns is gone from the copies one step later, only its gradients stay. The seal finds it.
        (
            ("--zero", "1"),
            ("corrupt,rank=2,at_step=7", "corrupt,rank=1,at_step=11,target=snapshot"),
        ),
        (("--pp", "2"), ("corrupt,rank=1,at_step=7", "corrupt,rank=2,at_step=11,target=snapshot")),
        (("--pp", "2", "--zero", "1"), ("corrupt,rank=1,at_step=7",)),
        # ZeRO-3 keeps a stage's parameters only in its parts between steps: the flip lands in
        # the part, the next step gathers it to the other holders; the seal finds it
        (("--pp", "2", "--zero", "3"), ("corrupt,rank=1,at_step=7",)),
    ],
    ids=["data-parallel", "zero", "pipeline", "pipeline-zero", "pipeline-zero3"],
)
def test_corruption_is_rolled_back_bit_identical(
    tmp_path: Path, state_env: dict[str, str], float64_reference: Run, flags: tuple, faults: tuple
) -> None:
    """Checks every 5 steps; a bit flipped after step 7 is used by steps 8-10 before the check
    at step 10 finds it. Every rank rolls back to the known-good state of step 5 and redoes
    steps 6-10: every loss, the final parameters and the final optimizer state are bit-identical
    to the fault-free run, and each step is recorded once, with its fault-free loss."""
    args = [a for f in faults for a in ("--fault", f)]
    r = launch(tmp_path / "run", "--job-id", "sdc-roll", "--steps", str(SDC_STEPS), *flags,
               "--verify-every", "5", *args, env={**state_env, **F64})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, SDC_STEPS, float64_reference)
    assert run.losses == float64_reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in float64_reference.of("final_state")
        }
    rolled = run.of("sdc_rolled_back")
    assert [(e["step"], e["to_step"], e["redone_steps"]) for e in rolled][:1] == [(10, 5, 5)]
    assert not run.of("sdc_not_rolled_back")
    report = build_report(run.dir)
    first = report["incidents"][0]
    assert first["kind"] == "corrupt" and first["detected_step"] == 10
    assert first["recomputed_steps"] == 5 and first["first_commit_step"] == 10
    assert first["mttr_s"] > first["detection_s"] > 0
    assert report["totals"]["duplicate_steps"] == [] and report["totals"]["missing_steps"] == []
    # What each rank keeps for the rollback: the whole state with data parallelism; its own
    # layers (and their moments or moment parts) in a pipeline stage, never the whole model.
    (dp_params,) = {
        m["param_bytes"] for m in build_report(float64_reference.dir)["totals"]["memory"].values()
    }
    whole = 3 * dp_params
    for held in report["totals"]["memory"].values():
        if "--pp" in flags:
            assert 0 < held["verify_bytes"] <= held["param_bytes"] + held["optimizer_bytes"]
            assert held["verify_bytes"] < 0.8 * whole
        else:
            assert held["verify_bytes"] == whole
