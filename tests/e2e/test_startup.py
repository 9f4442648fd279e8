"""Start-up through the worker template: workers forked from one process that imported torch
once, the rendezvous store beside them, and what happens when either dies.

Forking must change nothing a run computes (the same bits as executed workers), must leave no
process behind, and a template that dies only makes later workers slower to start.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml
from conftest import (
    ROOT,
    Run,
    assert_clean_run,
    assert_no_orphans,
    elaswave_cmd,
    launch,
    paced,
    start,
    wait_for,
)

from elaswave.events import read_jsonl

pytestmark = pytest.mark.e2e


def test_workers_are_forked_from_the_template(reference: Run) -> None:
    """The reference run started every worker from the template, and its store and template
    are gone with it."""
    (ready,) = reference.of("template_ready")
    (store,) = reference.of("store_started")  # every plan was built over it
    spawned = reference.of("worker_spawned")
    assert len(spawned) == 4 and all(e["forked"] for e in spawned), spawned
    assert ready["t"] <= min(e["t"] for e in spawned)
    assert_no_orphans(reference)  # the template and the store included


def test_executed_workers_train_the_same_bits(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """``elastic.worker_start: exec``: a new interpreter per worker, the same losses and final
    state, bit for bit (a fork inherits nothing the run computes with)."""
    env = dict(state_env, ELASWAVE_ELASTIC__WORKER_START="exec")
    r = launch(tmp_path / "run", "--job-id", "executed", env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert not any(e["forked"] for e in run.of("worker_spawned"))
    assert not run.of("template_ready")
    assert run.losses == reference.losses
    ours = {f["params_sha256"] for f in run.of("final_state")}
    assert ours == {f["params_sha256"] for f in reference.of("final_state")}
    assert_no_orphans(run)


def test_template_lost_mid_run_executes_the_respawn(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """The template SIGKILLed while the job trains: nothing stops, and the worker respawned
    after a crash is executed instead of forked. An executed worker imports torch itself (some
    5 s with three workers training on two cores, more on a busy machine): the job's steps are
    paced so that the 50 left after the kill take at least 12 s."""
    run_dir = tmp_path / "run"
    env = paced(state_env, 0.04)  # three workers: at least 0.24 s a step
    proc = start(run_dir, env, "--job-id", "notemplate", "--steps", "60",
                 "--max-restarts", "1", "--fault", "kill,rank=2,at_step=10")  # fmt: skip
    try:
        ready = wait_for(lambda: _event(run_dir, "template_ready"), timeout=60, interval=0.05)
        wait_for(lambda: _committed(run_dir) >= 3, timeout=60, interval=0.05)
        os.kill(ready["pid"], signal.SIGKILL)
        assert proc.wait(timeout=180) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    run = Run(run_dir)
    assert_clean_run(run, 60, reference)
    (respawn,) = run.of("worker_respawned")
    (spawn,) = [e for e in run.of("worker_spawned") if e["worker"] == respawn["worker"]]
    assert spawn["forked"] is False
    assert [p["world"] for p in run.of("plan_published")] == [4, 3, 4]


def test_rendezvous_store_lost_ends_this_host_with_one_line(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """The store is part of the daemon: its death ends the host's part of the job, as the
    daemon's own death would, with one line and nothing left running."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, state_env, "--job-id", "nostore", "--steps", "400")
    try:
        store = wait_for(lambda: _event(run_dir, "store_started"), timeout=60, interval=0.05)
        wait_for(lambda: _committed(run_dir) >= 2, timeout=60, interval=0.05)
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        assert "libtorch" not in maps, "the daemon must not load torch (the template has it)"
        os.kill(store["pid"], signal.SIGKILL)
        code = proc.wait(timeout=60)
        err = proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 1 and len(lines) == 1, (code, err)
    assert "rendezvous store" in lines[0] and "SIGKILL" in lines[0], lines
    assert_no_orphans(Run(run_dir))


def test_a_workload_that_cannot_train_is_refused_before_any_worker(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """What needs the model built (a user workload's own data set) is checked in the template:
    one line, exit 2, no worker started, nothing left running."""
    config = tmp_path / "job.yaml"
    model = {"source": "module", "factory": "examples.mlp_classifier:mlp_classifier",
             "args": {"num_samples": 100}}  # fmt: skip
    config.write_text(yaml.safe_dump({"model": model, "data": {"eval_samples": 100}}))
    run_dir = tmp_path / "run"
    r = subprocess.run(
        elaswave_cmd("launch", str(config), "--run-dir", str(run_dir), "--quiet",
                     "--job-id", "refused"),
        env=state_env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, r.stderr)
    assert "leaves none of the data set's 100 samples for training" in lines[0], lines
    run = Run(run_dir)
    assert not run.of("worker_spawned")
    assert run.of("template_ready")
    assert_no_orphans(run)


def test_a_launch_refused_on_its_command_line_leaves_no_template(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """``launch`` starts its template before it reads its flags: refused at once, it takes the
    template and its temporary log with it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen(
        elaswave_cmd("launch", str(ROOT / "configs" / "gpt-tiny.yaml"), "--steps", "0"),
        env=dict(state_env, TMPDIR=str(scratch)), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "train.steps must be > 0" in err, err
    assert not list(scratch.iterdir())
    mine = f"--parent {proc.pid}"
    left = [
        p for p in psutil.process_iter(["cmdline"]) if mine in " ".join(p.info["cmdline"] or [])
    ]
    assert not [p for p in left if p.status() != psutil.STATUS_ZOMBIE], left


def _event(run_dir: Path, kind: str) -> dict | None:
    for e in read_jsonl(run_dir / "events.jsonl"):
        if e["kind"] == kind:
            return e
    return None


def _committed(run_dir: Path) -> int:
    return sum(1 for _ in read_jsonl(run_dir / "metrics.jsonl"))
