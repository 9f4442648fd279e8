"""Warm spares (``launch --spares K``): a lost rank's place goes to a spare built ahead, in one
plan, and the run is bit-identical to the fault-free one."""

from __future__ import annotations

from pathlib import Path

from elaswave.report import build_report
from tests.e2e.conftest import F64, Float64Runs, Run, assert_no_orphans, launch

STEPS = 12
KILL_AT = 6


def test_a_spare_takes_the_lost_rank_in_one_plan(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs
) -> None:
    """Rank 1 is SIGKILLed: the plan after its death holds 4 workers, the spare among them (no
    shrink, then grow), a new spare is started, every step is committed once, and the losses
    and final parameters equal the fault-free run's to the last bit. The job's end stops the
    spare that still waits: no process is left."""
    env = {**state_env, **F64}
    r = launch(tmp_path / "run", "--job-id", "spares", "--steps", str(STEPS), "--spares", "1",
               "--max-restarts", "1", "--fault", f"kill,rank=1,at_step={KILL_AT}",
               env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    (death,) = run.of("worker_exit")
    (activated,) = run.of("spare_activated")
    spare = activated["worker"]
    assert activated["replaces"] == death["worker"] and activated["registered"]
    assert [e["worker"] for e in run.of("spare_ready")][:1] == [spare]
    assert not run.of("worker_respawned")  # the spare, not a respawn
    plans = run.of("plan_published")
    after = [p for p in plans if p["t"] > death["t"]]
    assert after and len(after[0]["workers"]) == 4 and spare in after[0]["workers"], after[:1]
    assert death["worker"] not in after[0]["workers"]
    assert all(len(p["workers"]) == 4 for p in plans)  # never a plan of 3
    spawned = [e for e in run.of("worker_spawned") if e.get("spare")]
    assert len(spawned) == 2 and spawned[1]["t"] > activated["t"]  # a new spare in its stead
    assert run.metrics[-1]["world_size"] == 4
    reference = float64_runs(STEPS)
    assert reference.losses == run.losses
    assert {f["params_sha256"] for f in reference.of("final_state")} == {
        f["params_sha256"] for f in run.of("final_state")
    }
    (incident,) = build_report(run.dir)["incidents"]
    assert incident["kind"] == "kill" and incident["worker"] == death["worker"], incident
    assert incident["spare"] == spare and incident["world_after"] == 4, incident
    assert incident["mttr_s"] is not None and incident["first_commit_step"] == KILL_AT
    assert_no_orphans(run)
