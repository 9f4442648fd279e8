"""Crashes survived in place: the test model (gpt-test.yaml), 4 gloo workers, real etcd, real
SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    CONFIG,
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
from elaswave.report import build_report

pytestmark = pytest.mark.e2e


def test_fault_free_reference_is_consistent(reference: Run) -> None:
    finals = reference.of("final_state")
    assert len(finals) == 4
    assert len({f["params_sha256"] for f in finals}) == 1
    losses = reference.losses
    assert losses[40] < 0.8 * losses[1], "the synthetic task should visibly learn"


def test_kill_one_worker_at_step_15(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    # Emulated device time (20 ms per micro-batch, four per rank): the 14 steps before the kill
    # last over a second however fast the CPU, so progress lines (every 0.2 s) show epoch 1.
    r = launch(
        tmp_path / "run", "--job-id", "kill15", "--fault", "kill,rank=1,at_step=15",
        "--progress-every", "0.2", env=paced(state_env, 0.02), quiet=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    # Not on a terminal: plain progress lines, the incident and its MTTR as they happen.
    lines = r.stdout.splitlines()
    progress = [ln for ln in lines if ln.startswith("step ")]
    assert (
        progress and progress[-1].startswith("step 40/40 ") and "world 3  epoch 2" in progress[-1]
    )
    assert any("world 4  epoch 1" in ln for ln in progress), progress
    (incident,) = [i for i, ln in enumerate(lines) if ln.startswith("incident: ")]
    assert "(rank 1) killed by SIGKILL" in lines[incident] and "epoch 2" in lines[incident]
    (recovered,) = [ln for ln in lines[incident:] if ln.startswith("recovered: ")]
    assert re.fullmatch(r"recovered: epoch 2, step 15 committed; MTTR \d+ ms", recovered)

    (fault,) = run.of("fault_injected")
    assert fault["step"] == 15 and fault["rank"] == 1
    (exit_ev,) = run.of("worker_exit")
    assert exit_ev["worker"] == fault["worker"] and exit_ev["exit_code"] == -9
    plans = run.of("plan_published")
    assert [p["epoch"] for p in plans] == [1, 2]
    assert plans[1]["departed"] == [fault["worker"]] and plans[1]["world"] == 3
    assert sum(plans[1]["microbatches"]) == 16, "global batch must not change"
    assert {e["rank"] for e in run.of("comm_rebuilt") if e["epoch"] == 2} == {0, 1, 2}
    # train.device: auto on a host without an accelerator is the CPU, and gloo carries it all
    assert {e["backend"] for e in run.of("comm_rebuilt")} == {"gloo"}
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert {e["resume_step"] for e in synced} == {14}, "only the in-flight step is redone"
    assert_redid_only(run, 2, {fault["worker"]})  # and of it only the dead rank's 4 micro-batches
    assert [m["world_size"] for m in run.metrics] == [4] * 14 + [3] * 26
    assert all(m["samples"] == 32 * m["step"] for m in run.metrics)

    report = build_report(run.dir)
    (inc,) = report["incidents"]
    assert inc["rank"] == 1 and inc["fault_step"] == 15 and inc["first_commit_step"] == 15
    for phase in ("detection_s", "plan_s", "comm_s", "state_s", "redo_s", "mttr_s"):
        assert inc[phase] is not None, phase
    assert 0 < inc["mttr_s"] < 30
    assert (inc["kept_microbatches"], inc["redone_microbatches"]) == (12, 4)
    assert report["totals"]["duplicate_steps"] == [] and report["totals"]["missing_steps"] == []


def test_two_crashes(tmp_path: Path, state_env: dict[str, str], reference: Run) -> None:
    r = launch(
        tmp_path / "run",
        "--job-id", "two-crashes",
        "--fault", "kill,rank=1,at_step=10",
        "--fault", "kill,rank=2,at_step=25",
        env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    assert len(run.of("worker_exit")) == 2
    assert [p["world"] for p in run.of("plan_published")] == [4, 3, 2]
    assert len(build_report(run.dir)["incidents"]) == 2
    assert len(run.of("final_state")) == 2


def test_crash_then_replacement_grows_back(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    r = launch(
        tmp_path / "run",
        "--job-id", "regrow",
        "--steps", "80",
        "--max-restarts", "1",
        "--fault", "kill,rank=1,at_step=8",
        env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 80, reference)
    (respawn,) = run.of("worker_respawned")
    (spawn,) = [e for e in run.of("worker_spawned") if e["worker"] == respawn["worker"]]
    assert spawn["forked"], "a respawned worker is forked from the template"
    worlds = [p["world"] for p in run.of("plan_published")]
    assert worlds == [4, 3, 4], worlds
    assert run.metrics[-1]["world_size"] == 4
    joined = [e for e in run.of("state_synced") if e["worker"] == respawn["worker"]]
    assert joined and joined[-1]["bytes"] > 0, "the newcomer must receive the state from a peer"
    assert len(run.of("final_state")) == 4


def test_worker_lost_before_ready_does_not_stall_the_start(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """A worker SIGKILLed while still importing torch: the job starts on the others at once."""
    run_dir = tmp_path / "run"
    env = dict(state_env, ELASWAVE_TIMEOUTS__RENDEZVOUS="60")
    started = time.monotonic()
    proc = subprocess.Popen(
        elaswave_cmd("launch", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
                     "--job-id", "early", "--steps", "10"),
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        victim = wait_for(lambda: _spawned(run_dir, "w3"), timeout=60, interval=0.01)
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(timeout=120) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.monotonic() - started < 45, "the leader waited for a worker that was already gone"
    run = Run(run_dir)
    first = run.of("plan_published")[0]
    assert first["epoch"] == 1 and first["world"] == 3
    assert "SIGKILL" in first["reason"]
    assert [m["step"] for m in run.metrics] == list(range(1, 11))
    for step, loss in run.losses.items():
        assert abs(loss - reference.losses[step]) <= 1e-6 * abs(reference.losses[step])


def _spawned(run_dir: Path, slot: str) -> int | None:
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e["kind"] == "worker_spawned" and e["worker"].endswith("." + slot):
            return int(e["pid"])
    return None


def test_deterministic_mode_is_bit_identical_to_the_fault_free_run(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs
) -> None:
    """float64 reduction: a crash changes nothing, to the last bit of every loss and parameter."""
    env = dict(state_env, ELASWAVE_TRAIN__REDUCE_DTYPE="float64")
    faulty = launch(tmp_path / "faulty", "--job-id", "det-fault", "--steps", "16",
                    "--fault", "kill,rank=2,at_step=9", env=env)  # fmt: skip
    assert faulty.returncode == 0, faulty.stderr[-2000:]
    a, b = float64_runs(16), Run(tmp_path / "faulty")
    assert b.metrics[-1]["world_size"] == 3
    (fault,) = b.of("fault_injected")
    assert_redid_only(b, 2, {fault["worker"]})
    assert a.losses == b.losses
    assert {f["params_sha256"] for f in a.of("final_state")} == {
        f["params_sha256"] for f in b.of("final_state")
    }


def test_hang_is_detected_and_recovered_within_the_timeout(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """SIGSTOP one worker mid-step: peers block on it until the daemon's heartbeat check kills
    it; then the ordinary in-place recovery runs. The default hang timeout (``auto``) judges
    silence on the heartbeat alone: the hang is detected within 2 s however long the steps.
    Before the kill the worker writes its threads' stacks, from where it froze: the injector's
    signal in the step's reduce phase. Bound: 2 s (the issue's for 0.1 s steps)."""
    r = launch(tmp_path / "run", "--job-id", "hang", "--fault", "hang,rank=1,at_step=12",
               env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    (detected,) = run.of("hang_detected")
    (fault,) = run.of("fault_injected")
    assert detected["worker"] == fault["worker"] and "heartbeat" in detected["reason"]
    assert "auto" in detected["reason"], detected  # the bound and how it was derived
    assert detected["t"] - fault["t"] <= 2.0, (detected, fault)
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "hang" and "hung" in inc["reason"]
    assert_redid_only(run, 2, {fault["worker"]})
    assert inc["mttr_s"] <= 2.0, inc
    (taken,) = run.of("hang_stacks")
    assert taken["worker"] == fault["worker"] and taken["seconds"] < 0.5
    assert inc["stacks_file"] == taken["path"]
    assert taken["path"].startswith(f"stacks/{fault['worker']}-")
    assert (run.dir / taken["path"]).read_text() == inc["stacks"] == taken["stacks"]
    main_thread = inc["stacks"].split("Current thread")[1]  # the main thread wrote them
    assert "in fire" in main_thread and "in reduce_step" in main_thread, inc["stacks"]
    assert "in beat" in inc["stacks"]  # every thread's: the heartbeat's too
    assert sorted(p.name for p in (run.dir / "stacks").iterdir()) == [Path(taken["path"]).name]
    assert not list((run.dir / "logs").glob("*.stacks"))  # the unused ones are gone
