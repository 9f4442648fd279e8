"""A user's own training loop (examples/own_loop.py: a plain PyTorch loop, a model with dropout,
AdamW with a cosine schedule, scikit-learn's digits) run by ``elaswave launch --script``.

In the deterministic mode (float64 reduction) a run whose rank 1 is SIGKILLed mid-step and
respawned, or frozen or slowed until the daemon kills it, gives the fault-free run's losses,
parameters and optimizer state bit for bit, replicated and under ZeRO-1; every step is committed
once and the survivors redo only the lost rank's micro-batches. Misuse of the API ends the job
with one line naming the rank, and nothing is left running.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from conftest import (
    F64,
    ROOT,
    Run,
    assert_clean_run,
    assert_no_orphans,
    assert_redid_only,
    elaswave_cmd,
    paced,
    wait_for,
)

from elaswave.errors import EXIT_PREEMPTED
from elaswave.report import build_report

SCRIPT = ROOT / "examples" / "own_loop.py"
MISUSE = Path(__file__).with_name("loop_misuse.py")
STEPS = 12
ARGS = ("--width", "32", "--lr", "0.03", "--t-max", str(STEPS))
SHAPE = ("--nproc-per-node", "3", "--steps", str(STEPS), "--global-batch", "48",
         "--micro-batch-size", "8")  # fmt: skip


def _launch(
    run_dir: Path, env: dict[str, str], *args: str, script: Path = SCRIPT, after: tuple = ()
) -> subprocess.CompletedProcess[str]:
    cmd = elaswave_cmd("launch", "--script", str(script), "--run-dir", str(run_dir), "--quiet",
                       *SHAPE, *args, "--", *after)  # fmt: skip
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("loop-ref")
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}
    r = _launch(base / "run", env, "--job-id", "loop-ref", "--max-restarts", "0",
                after=ARGS)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(base / "run")
    assert run.losses[STEPS] < 0.9 * run.losses[1], run.losses  # it learns
    assert [p["world"] for p in run.of("plan_published")] == [3]
    lines = [m for m in _lines(run) if m.get("kind") == "log"]  # job.log, from rank 0 only
    assert [m["step"] for m in lines] == list(range(1, STEPS + 1))
    assert all(m["train_loss"] == run.losses[m["step"]] for m in lines)
    assert len({f["script_state_sha256"] for f in run.of("final_state")}) == 1
    return run


def _same_final_state(finals: list[dict], reference: Run) -> None:
    """Every rank's parameters, optimizer state and script state are the reference's."""
    for key in ("params_sha256", "state_sha256", "script_state_sha256"):
        assert {f[key] for f in finals} == {f[key] for f in reference.of("final_state")}, key


def _lines(run: Run) -> list[dict]:
    from elaswave.events import read_jsonl

    return list(read_jsonl(run.dir / "metrics.jsonl"))


@pytest.mark.parametrize("strategy", [[], ["--zero", "1"]], ids=["replicated", "zero1"])
def test_a_plain_loop_survives_a_kill_and_a_respawn_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run, strategy: list[str]
) -> None:
    env = paced({**state_env, **F64}, 0.08)  # the respawn joins before the end
    r = _launch(tmp_path / "run", env, "--job-id", "loop-kill", *strategy, "--max-restarts", "1",
                "--fault", "kill,rank=1,at_step=4", after=ARGS)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]  # the kill, and no other
    (fault,) = run.of("fault_injected")
    assert len(run.of("worker_respawned")) == 1
    assert [p["world"] for p in run.of("plan_published")] == [3, 2, 3]  # the respawn joined
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, not only within tolerance
    (ref_final,) = {f["params_sha256"] for f in reference.of("final_state")}
    assert {f["params_sha256"] for f in run.of("final_state")} == {ref_final}
    (ref_state,) = {f["state_sha256"] for f in reference.of("final_state")}
    assert {f["state_sha256"] for f in run.of("final_state")} == {ref_state}
    (ref_script,) = {f["script_state_sha256"] for f in reference.of("final_state")}
    assert {f["script_state_sha256"] for f in run.of("final_state")} == {ref_script}  # from peers
    assert len(run.of("final_state")) == 3
    assert_redid_only(run, 2, {fault["worker"]})


def test_a_checkpoint_resumed_at_another_world_size_continues_the_loop_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """Half the steps on 3 workers, the rest from its final checkpoint on 2: the fault-free
    run's losses, parameters, optimizer state and script state."""
    env = {**state_env, **F64}
    half = STEPS // 2
    r = _launch(tmp_path / "a", env, "--job-id", "loop-a", "--steps", str(half), after=ARGS)
    assert r.returncode == 0, r.stderr[-3000:]
    assert Run(tmp_path / "a").losses == {s: reference.losses[s] for s in range(1, half + 1)}
    r = _launch(tmp_path / "b", env, "--job-id", "loop-b", "--nproc-per-node", "2",
                "--resume", str(tmp_path / "a" / "checkpoints"), after=ARGS)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "b")
    assert [p["world"] for p in run.of("plan_published")] == [2]
    assert run.losses == {s: reference.losses[s] for s in range(half + 1, STEPS + 1)}
    _same_final_state(run.of("final_state"), reference)


def test_a_preempted_loop_checkpoints_its_step_and_its_state_and_resumes_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """SIGTERM to the launch mid-run: the loop leaves after the step every rank was told in,
    with a checkpoint of it (the script's registered state too); launched again it trains the
    rest, nothing twice, to the fault-free run's state."""
    env = paced({**state_env, **F64}, 0.08)
    cmd = elaswave_cmd("launch", "--script", str(SCRIPT), "--run-dir", str(tmp_path / "run"),
                       "--quiet", *SHAPE, "--job-id", "loop-preempt", "--", *ARGS)  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(Run(tmp_path / "run").metrics) >= 4 or proc.poll() is not None,
                 timeout=120, interval=0.05)  # fmt: skip
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    (step,) = {e["step"] for e in Run(tmp_path / "run").of("preempted")}
    assert 4 <= step < STEPS
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    (again,) = run.of("relaunched")
    assert again["resume_step"] == step and again["lost_steps"] == 0
    assert run.losses == reference.losses
    _same_final_state([f for f in run.of("final_state") if f["t"] > again["t"]], reference)
    assert_no_orphans(run)


def test_silent_corruption_rolls_the_loop_back_with_its_state(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """A bit flipped in rank 1's parameters after step 5: the check at step 6 rolls every rank
    back to step 4 (model, optimizer and the script's state), the loop redoes steps 5 and 6,
    and the run ends as the fault-free one."""
    env = {**state_env, **F64}
    r = _launch(tmp_path / "run", env, "--job-id", "loop-sdc", "--verify-every", "2",
                "--fault", "corrupt,rank=1,at_step=5", after=ARGS)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    (rolled,) = run.of("sdc_rolled_back")
    assert (rolled["step"], rolled["to_step"]) == (6, 4)
    assert run.losses == reference.losses
    _same_final_state(run.of("final_state"), reference)


def test_a_second_host_joins_the_loop_mid_run_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """Two launches on one machine act as two hosts: h2's two workers run the script from the
    top and join h1's at a step boundary, the model, optimizer and script state from peers."""
    env = paced({**state_env, **F64}, 0.25)  # 0.75 s a step on h1 alone: h2 joins well before
    hosts = ("--nproc-per-node", "2", "--nnodes", "1:2", "--job-id", "loop-grow")
    cmd = elaswave_cmd("launch", "--script", str(SCRIPT), "--run-dir", str(tmp_path / "h1"),
                       "--quiet", *SHAPE, *hosts, "--host-id", "h1", "--", *ARGS)  # fmt: skip
    first = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        wait_for(lambda: len(Run(tmp_path / "h1").metrics) >= 2, timeout=60)  # h1 trains
        record = json.loads(
            (Path(env["ELASWAVE_STATE_DIR"]) / "jobs" / "loop-grow.json").read_text()
        )
        r = _launch(tmp_path / "h2", env, *hosts, "--host-id", "h2", "--nproc-per-node", "2",
                    "--etcd", ",".join(record["etcd"]), after=ARGS)  # fmt: skip
        assert r.returncode == 0, r.stderr[-2000:]
        assert first.wait(timeout=120) == 0, first.stderr.read() if first.stderr else ""
    finally:
        if first.poll() is None:
            first.kill()
    h1, h2 = Run(tmp_path / "h1"), Run(tmp_path / "h2")
    assert [p["world"] for p in h1.of("plan_published")] == [2, 4]
    (joined,) = {e["resume_step"] for e in h1.of("state_synced") if e["epoch"] == 2}
    assert 2 <= joined < STEPS  # mid-run: h2's workers took the state from h1's
    assert h1.losses == reference.losses
    finals = h1.of("final_state") + h2.of("final_state")
    assert len(finals) == 4
    _same_final_state(finals, reference)
    assert_no_orphans(h1)
    assert_no_orphans(h2)


def test_a_plain_loop_survives_a_hang_and_a_stuck_step_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """Rank 1 frozen in step 5, then (under the plan that followed) rank 1 slowed by 4 s in step
    8: with a hang timeout of 1.5 s the daemon kills both, the second as stuck computing, each
    once it wrote its stacks, which name where it was stuck: the user's loop, in the frozen
    step's commit and in the slowed step's micro-batches."""
    env = {**state_env, **F64}
    r = _launch(tmp_path / "run", env, "--job-id", "loop-hang", "--hang-timeout", "1.5",
                "--fault", "hang,rank=1,at_step=5",
                "--fault", "slow,rank=1,at_step=8,epoch=2,delay=4", after=ARGS)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    frozen, slowed = run.of("fault_injected")
    assert [e["worker"] for e in run.of("hang_detected")] == [frozen["worker"], slowed["worker"]]
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses
    assert_redid_only(run, 2, {frozen["worker"]})
    assert_redid_only(run, 3, {slowed["worker"]})
    hang, stuck = build_report(run.dir)["incidents"]
    assert "no heartbeat" in hang["reason"] and "(limit 1.5 s)" in hang["reason"]
    assert (stuck["kind"], stuck["worker"]) == ("slow", slowed["worker"])
    assert "stuck computing" in stuck["reason"] and stuck["epoch"] == 3, stuck
    for inc, where in ((hang, "in commit"), (stuck, "in _iterate")):
        main_thread = inc["stacks"].split("Current thread")[1]
        assert where in main_thread and "own_loop.py" in main_thread, inc["stacks"]
        assert (run.dir / inc["stacks_file"]).read_text() == inc["stacks"]


@pytest.mark.parametrize(
    "misuse, says",
    [
        ("raise", "the script raised ValueError: boom in the user's loop"),
        ("register-twice", "register() called twice"),
        ("no-commit", "step 1 ended without step.commit()"),
        ("vector-loss", "takes the micro-batch's scalar loss (summed over it), got (8,)"),
    ],
)
def test_misuse_ends_the_job_in_one_line_naming_the_rank(
    tmp_path: Path, state_env: dict, misuse: str, says: str
) -> None:
    r = _launch(tmp_path / "run", state_env, "--job-id", "loop-bad", "--max-restarts", "2",
                "--nproc-per-node", "1", script=MISUSE, after=("--misuse", misuse))  # fmt: skip
    assert r.returncode == 1, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert says in line, r.stderr[-2000:]
    # A misuse in the loop names the rank and its worker; one before job.steps() may come
    # before the first plan, when the worker has no rank yet: then it names the worker.
    named = re.search(r"cannot recover: (rank 0 \(\S+\.w0\)|\S+\.w0): ", line)
    assert named, line
    if misuse != "register-twice":
        assert named.group(1).startswith("rank 0 ("), line
    run = Run(tmp_path / "run")
    assert not run.of("worker_respawned")  # it would fail again
    assert_no_orphans(run)
    if misuse == "raise":  # the traceback is in the failing worker's log
        failed = run.of("script_failed")[0]["worker"]
        log = (run.dir / "logs" / f"{failed}.log").read_text()
        assert "Traceback" in log and "boom in the user's loop" in log


def test_a_missing_script_or_arguments_without_one_is_one_line(state_env: dict) -> None:
    for args, says in [
        (("--script", "no/such/train.py"), "--script no/such/train.py: no such file"),
        (
            ("--steps", "3", "--", "--width", "4"),
            "arguments after --: '--width 4' are a script's (--script FILE)",
        ),
    ]:
        r = subprocess.run(elaswave_cmd("launch", *args), env=state_env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 2 and r.stderr.strip() == f"error: {says}", r.stderr


def test_a_hugging_face_llama_loop_survives_a_kill_bit_identical(
    tmp_path: Path, state_env: dict
) -> None:
    """examples/own_loop_hf.py: a small LlamaForCausalLM in a plain loop (warm-up schedule, the
    loss summed over target tokens); rank 1 killed mid-step, the survivors' run is the
    fault-free run, bit for bit."""
    hf = ROOT / "examples" / "own_loop_hf.py"
    shape = ("--steps", "6", "--global-batch", "16", "--micro-batch-size", "4",
             "--nproc-per-node", "2")  # fmt: skip
    runs = {}
    for name, fault in (("free", ()), ("kill", ("--fault", "kill,rank=1,at_step=3"))):
        r = _launch(tmp_path / name, {**state_env, **F64}, "--job-id", f"loop-hf-{name}", *shape,
                    *fault, script=hf)  # fmt: skip
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = Run(tmp_path / name)
    free, kill = runs["free"], runs["kill"]
    assert free.losses[6] < free.losses[1], free.losses  # it learns
    assert kill.losses == free.losses and [m["step"] for m in kill.metrics] == list(range(1, 7))
    assert [p["world"] for p in kill.of("plan_published")] == [2, 1]
    assert {f["params_sha256"] for f in kill.of("final_state")} == {
        f["params_sha256"] for f in free.of("final_state")
    }
    assert_no_orphans(kill)
