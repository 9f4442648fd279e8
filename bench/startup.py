"""How long a job takes to start, and a respawned worker to join: workers forked from the
worker template vs executed (a new interpreter each), and optionally an earlier checkout.

Two runs per mode and round, the modes interleaved so that they share the machine's state:

- *start*: ``elaswave launch`` of gpt-tiny (4 workers, 10 steps): launch → the first committed
  step (wall clock from just before the command, so the CLI's own start counts), the workers'
  spawn → all ready, and launch → exit;
- *respawn*: 100 steps, ``--max-restarts 1``, rank 1 SIGKILLed in step 10: the death seen by its
  daemon (``worker_exit``) → the respawned worker ready → admitted (the first plan that holds
  it) → the first step committed with it. Mode *spares* (the template, ``elastic.spares: 1``):
  the same, the place taken by the warm spare (ready: its activation, it was built before).

Goals (issue: gpt-tiny, 4 workers, 2 cores): launch → first step ≤ 4 s; respawn admitted ≤ 1 s
after the death is seen; with a warm spare, admitted ≤ 0.2 s. ``--tree DIR`` adds the same runs
from another checkout of ElasWave (an earlier commit, for the before/after comparison; its launch
runs with ``PYTHONPATH=DIR``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
    bench_env,
    console,
    earlier_tree,
    print_table,
    read_jsonl,
    summarize,
)

DESCRIPTION = (
    "launch → first step, and a respawned worker's admission: template vs exec vs a warm spare"
)
DEFAULT_REPEAT = 5
START_STEPS = 10
RESPAWN_STEPS = 100  # long enough that a slow-starting respawn is admitted before the end
KILL_AT = 10
GOALS = {"first_step_s": 4.0, "admitted_s": 1.0}
SPARE_GOALS = {"admitted_s": 0.2}  # mode "spares"


def run(repeat: int, config: Path, tree: Path | None = None) -> dict[str, Any]:
    modes: dict[str, dict[str, Any]] = {
        "template": {"env": {"ELASWAVE_ELASTIC__WORKER_START": "template"}, "root": REPO_ROOT},
        "exec": {"env": {"ELASWAVE_ELASTIC__WORKER_START": "exec"}, "root": REPO_ROOT},
        "spares": {
            "env": {"ELASWAVE_ELASTIC__WORKER_START": "template", "ELASWAVE_ELASTIC__SPARES": "1"},
            "root": REPO_ROOT,
        },
    }
    if tree is not None:
        modes["before"] = earlier_tree(tree)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="elaswave-bench-startup-") as tmp:
        for i in range(repeat):
            for name, mode in modes.items():
                work = Path(tmp) / f"{name}-{i}"
                start = _start_run(work / "start", config, mode, f"startup-{name}-{i}")
                respawn = _respawn_run(work / "respawn", config, mode, f"respawn-{name}-{i}")
                rounds.append({"mode": name, "round": i, **start, **respawn})
                console.print(
                    f"round {i + 1}/{repeat} {name}: first step {start['first_step_s']:.2f} s, "
                    f"admitted {respawn['admitted_s']:.2f} s after the death"
                )
    keys = ("first_step_s", "spawn_to_ready_s", "exit_s", "respawn_ready_s", "admitted_s",
            "rejoined_step_s")  # fmt: skip
    summary = {
        name: {k: summarize(r[k] for r in rounds if r["mode"] == name) for k in keys}
        for name in modes
    }
    ours, spares = summary["template"], summary["spares"]
    return {
        "scenario": "startup",
        "config": os.path.relpath(config, REPO_ROOT),
        "repeat": repeat,
        "tree": str(tree.resolve()) if tree is not None else None,
        "rounds": rounds,
        "summary": summary,
        "goals": GOALS,
        "goals_met": {k: (ours[k]["median"] or 1e9) <= v for k, v in GOALS.items()},
        "spare_goals": SPARE_GOALS,
        "spare_goals_met": {k: (spares[k]["median"] or 1e9) <= v for k, v in SPARE_GOALS.items()},
        "command": f"python -m bench startup --repeat {repeat}"
        + (" --tree DIR" if tree is not None else ""),
    }


def _launch(
    run_dir: Path, config: Path, mode: dict[str, Any], job_id: str, *args: str
) -> tuple[float, float]:
    state = run_dir.parent / "state"
    env = bench_env(state, mode["env"])
    module = mode.get("module", "elaswave")  # an earlier checkout: its command module
    cmd = [sys.executable, "-m", module, "launch", str(config), "--run-dir", str(run_dir),
           "--job-id", job_id, "--quiet", *args]  # fmt: skip
    start = time.time()
    proc = subprocess.run(cmd, cwd=mode["root"], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    end = time.time()
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return start, end


def _start_run(run_dir: Path, config: Path, mode: dict[str, Any], job_id: str) -> dict[str, Any]:
    start, end = _launch(run_dir, config, mode, job_id, "--steps", str(START_STEPS))
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    spawned = [e["t"] for e in events if e["kind"] == "worker_spawned" and not e.get("spare")]
    ready = [e["t"] for e in events if e["kind"] == "worker_ready"]
    if not metrics or len(ready) < len(spawned):
        raise BenchError(f"{run_dir}: no committed step, or a worker never ready")
    return {
        "first_step_s": metrics[0]["time"] - start,
        "spawn_to_ready_s": max(ready) - min(spawned),
        "exit_s": end - start,
    }


def _respawn_run(run_dir: Path, config: Path, mode: dict[str, Any], job_id: str) -> dict[str, Any]:
    _launch(run_dir, config, mode, job_id, "--steps", str(RESPAWN_STEPS), "--max-restarts", "1",
            "--fault", f"kill,rank=1,at_step={KILL_AT}")  # fmt: skip
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    if [m["step"] for m in metrics] != list(range(1, RESPAWN_STEPS + 1)):
        raise BenchError(f"{run_dir}: steps lost or duplicated")
    (death,) = [e for e in events if e["kind"] == "worker_exit"]
    (successor,) = [e for e in events if e["kind"] in ("worker_respawned", "spare_activated")]
    new = successor["worker"]
    ready = (
        successor  # a spare was ready before: its activation is when it could be registered
        if successor["kind"] == "spare_activated"
        else next(e for e in events if e["kind"] == "worker_ready" and e["worker"] == new)
    )
    admitted = next(
        (e for e in events if e["kind"] == "plan_published" and new in e["workers"]), None
    )
    if admitted is None:
        raise BenchError(f"{run_dir}: the respawned worker was not admitted before the end")
    rejoined = next(m for m in metrics if m["epoch"] >= admitted["epoch"])
    return {
        "respawn_ready_s": ready["t"] - death["t"],
        "admitted_s": admitted["t"] - death["t"],
        "rejoined_step_s": rejoined["time"] - death["t"],
    }


def show(result: dict[str, Any]) -> None:
    labels = {
        "first_step_s": "launch → first committed step",
        "spawn_to_ready_s": "workers spawned → all ready",
        "exit_s": f"launch → exit ({START_STEPS} steps)",
        "respawn_ready_s": "death seen → respawned worker ready",
        "admitted_s": "death seen → respawned worker admitted",
        "rejoined_step_s": "death seen → first step with it",
    }
    modes = list(result["summary"])
    rows = []
    for key, label in labels.items():
        cells = []
        for mode in modes:
            s = result["summary"][mode][key]
            cells.append("–" if s["median"] is None
                         else f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})")  # fmt: skip
        rows.append([label, *cells])
    print_table(
        f"start-up, seconds: median (min–max) of {result['repeat']} runs",
        ["", *modes], rows,
    )  # fmt: skip
    for key, goal in result["goals"].items():
        met = "met" if result["goals_met"][key] else "NOT met"
        console.print(f"goal {labels[key]} ≤ {goal:g} s (template): {met}")
    for key, goal in result.get("spare_goals", {}).items():
        met = "met" if result["spare_goals_met"][key] else "NOT met"
        console.print(f"goal {labels[key]} ≤ {goal:g} s (spares): {met}")
