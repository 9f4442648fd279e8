"""Preemption (``--preempt-signal``, SIGTERM by default): the job checkpoints its newest
committed step whatever ``durable_every`` says, every launch exits 75 within the grace period,
and launching the job again trains the steps after it, each once, bit for bit on the fault-free
curve (float64 mode). A preemption that comes while the job recovers from a fault waits for the
recovery: the survivors redo the step under the next plan, checkpoint it and leave."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from elaswave.errors import EXIT_PREEMPTED
from elaswave.events import read_jsonl
from tests.e2e.conftest import F64, Float64Runs, Run, assert_no_orphans, launch, start, wait_for

pytestmark = pytest.mark.e2e

STEPS = 24  # the float64 reference the rotten-checkpoint test uses too
PREEMPT_AFTER = 15  # committed steps before the signal
GRACE = 20.0


def _committed(run_dir: Path) -> int:
    return max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=0)


# SIGTERM, the default, preempts three hosts at once in test_relaunch.py and a Slurm job in
# test_slurm.py; here a signal of the job's choosing, and ZeRO-3's checkpoint (every rank writes
# the pieces it owns), bit for bit. The signal comes while rank 1 hangs in the step after
# PREEMPT_AFTER: the step cannot commit (so it cannot carry the preemption to every rank) until
# the hang detector kills rank 1 and the leader plans the three others, respawning nothing.
@pytest.mark.parametrize(
    ("name", "args", "sig"),
    [("usr1-zero3", ("--preempt-signal", "USR1", "--zero", "3"), signal.SIGUSR1)],
    ids=["usr1-zero3"],
)
def test_a_preempted_job_checkpoints_its_last_step_and_resumes_with_none_lost(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs, name: str,
    args: tuple[str, ...], sig: signal.Signals,
) -> None:  # fmt: skip
    reference = float64_runs(STEPS)
    run_dir, env = tmp_path / "run", {**state_env, **F64}
    common = ("--job-id", f"preempt-{name}", "--steps", str(STEPS), "--durable-every", "1000",
              "--preempt-grace", str(GRACE), *args)  # fmt: skip
    hang = f"hang,rank=1,at_step={PREEMPT_AFTER + 1}"
    proc = start(run_dir, env, *common, "--fault", hang)
    try:
        wait_for(lambda: Run(run_dir).of("fault_injected") or proc.poll() is not None,
                 timeout=120, interval=0.02)  # fmt: skip
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        signalled = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=GRACE + 10)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert took < GRACE, f"the launch took {took:.1f} s to leave"
    run = Run(run_dir)
    (fault,) = run.of("fault_injected")
    (hung,) = run.of("hang_detected")
    assert hung["worker"] == fault["worker"]
    assert not run.of("worker_respawned"), "a preempted host respawned a worker"
    assert [e["worker"] for e in run.of("worker_exit")] == [fault["worker"]]
    members = run.of("plan_published")[-1]["workers"]  # three, or fewer after a straggler
    assert fault["worker"] not in members
    preempted = run.of("preempted")
    assert sorted(e["worker"] for e in preempted) == sorted(members), preempted
    assert len({e["step"] for e in preempted}) == 1, preempted
    step = preempted[0]["step"]
    assert step == _committed(run_dir) == PREEMPT_AFTER + 1, "the hung step is not redone"
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [
        f"error: job 'preempt-{name}' preempted by {sig.name}: step {step} is checkpointed in "
        f"{run_dir / 'checkpoints'}; launch it again to resume"
    ], lines
    assert (run_dir / "checkpoints" / f"step-{step:08d}").is_dir()
    assert_no_orphans(run)

    r = launch(run_dir, *common, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(run_dir)
    committed = [m["step"] for m in run.metrics]
    assert committed == list(range(1, STEPS + 1)), f"steps lost or recorded twice: {committed}"
    (again,) = run.of("relaunched")
    assert again["resume_step"] == step and again["lost_steps"] == 0, again
    assert run.losses == reference.losses  # bit for bit
    finals = [f for f in run.of("final_state") if f["t"] > again["t"]]
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in finals} == {f[key] for f in reference.of("final_state")}
    assert_no_orphans(run)
