"""Miscomputed gradients (``replay_every``): a rank whose device computes a gradient wrongly is
outvoted on a replayed micro-batch before the reduction, evicted, and the step is redone without
it; the run ends bit-identical to a fault-free one, and a fault-free run finds nothing."""

from __future__ import annotations

from pathlib import Path

from elaswave.report import build_report
from elaswave.report_text import render
from tests.e2e.conftest import F64, Float64Runs, Run, assert_no_orphans, launch

STEPS = 12
BAD_STEP = 9


def test_a_miscomputed_gradient_is_outvoted_its_rank_evicted_and_the_step_redone(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs
) -> None:
    reference = float64_runs(STEPS)
    r = launch(
        tmp_path / "run", "--job-id", "replay-grad", "--steps", str(STEPS), "--replay-every", "1",
        "--fault", f"corrupt,target=grad,rank=2,at_step={BAD_STEP}", env={**state_env, **F64},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))  # each committed once
    (found,) = run.of("replay_mismatch")
    assert found["step"] == BAD_STEP and found["verdict"] == "evict"
    assert found["odd_ranks"] == [2]
    plans = run.of("plan_published")
    first, second = plans[0], plans[1]
    (bad,) = found["odd_workers"]
    assert bad == first["workers"][2] and second["evicted"] == [bad]
    assert second["world"] == 3 and bad not in second["workers"]
    assert len(plans) == 2, "the evicted worker came back"
    assert run.losses == reference.losses
    finals = run.of("final_state")
    assert len(finals) == 3
    assert {f["params_sha256"] for f in finals} == {
        f["params_sha256"] for f in reference.of("final_state")
    }, "the parameters differ from the fault-free run"
    (inc,) = build_report(run.dir)["incidents"]  # the eviction is no crash of its own
    assert inc["kind"] == "grad_sdc" and inc["fault_step"] == inc["first_commit_step"] == BAD_STEP
    assert inc["evicted"] == [bad] and inc["world_after"] == 3 and inc["mttr_s"] > 0
    assert "miscomputed gradient" in inc["reason"]
    assert "grad_sdc" in render(build_report(run.dir), "md")
    assert_no_orphans(run)


def test_a_fault_free_float32_run_that_replays_finds_nothing(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Two healthy CPUs compute a micro-batch's float32 gradient to the same bits. (In float64
    the test above replays every step but step 9 and finds nothing there.)"""
    steps = 4
    r = launch(
        tmp_path / "run", "--job-id", "replay-clean", "--steps", str(steps), "--replay-every", "1",
        env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert run.of("replay_mismatch") == [] and len(run.of("plan_published")) == 1
    assert [m["step"] for m in run.metrics] == list(range(1, steps + 1))
