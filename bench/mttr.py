"""Crash MTTR: kill one rank mid-run and measure how long until the job commits a step again.

Each repetition is one fault-injected ``elaswave launch`` (4 workers, rank 1 SIGKILLed while
step 15 is in flight), analysed with :func:`elaswave.report.build_report`. MTTR runs from the
fault to the first step committed under the plan without the dead worker; its phases are
detection, plan, comm (group rebuild), state (resume-step agreement) and redo (the in-flight
step, recomputed by the survivors).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    bench_env,
    console,
    elaswave_launch,
    launch_command,
    ms,
    print_table,
    summarize,
)

DESCRIPTION = "crash MTTR and its phases: kill rank 1 at step 15, recover in place (N launches)"
DEFAULT_REPEAT = 5
FAULT = "kill,rank=1,at_step=15"
PHASES = ("detection_s", "plan_s", "comm_s", "state_s", "redo_s", "mttr_s")
GOAL_MTTR_S = 1.0


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.config import load_config

    steps = load_config(config, env={}).train.steps
    extra = ["--fault", FAULT]
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-mttr-"))
    env = bench_env(tmp / "state")
    runs = []
    for i in range(1, repeat + 1):
        run_dir = tmp / f"run{i}"
        job_id = f"bench-mttr-{os.getpid()}-{i}"
        began, ended = elaswave_launch(config, run_dir, job_id, env=env, extra_args=extra)
        wall = ended - began
        runs.append(_check(run_dir, steps, wall))
        inc = runs[-1]
        console.print(
            f"run {i}/{repeat}: MTTR {ms(inc['mttr_s'])} ms "
            f"(detection {ms(inc['detection_s'])} ms, redo {ms(inc['redo_s'])} ms); "
            f"launch {wall:.1f} s"
        )
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    summary = {p: summarize(r[p] for r in runs) for p in PHASES}
    worst = summary["mttr_s"]["max"]
    return {
        "scenario": "mttr",
        "command": launch_command(config, extra),
        "repeat": repeat,
        "fault": FAULT,
        "runs": runs,
        "summary": summary,
        "goal": {"mttr_max_s": GOAL_MTTR_S, "met": worst is not None and worst <= GOAL_MTTR_S},
    }


def _check(run_dir: Path, steps: int, wall: float) -> dict[str, Any]:
    """The run's single incident, after checking that no step was lost or committed twice."""
    from elaswave.report import build_report

    report = build_report(run_dir)
    totals = report["totals"]
    problems = []
    if totals["duplicate_steps"]:
        problems.append(f"duplicate steps {totals['duplicate_steps']}")
    if totals["missing_steps"]:
        problems.append(f"missing steps {totals['missing_steps']}")
    if totals["last_step"] != steps:
        problems.append(f"last step {totals['last_step']} != {steps}")
    if len(report["incidents"]) != 1 or report["incidents"][0]["mttr_s"] is None:
        problems.append(f"expected one recovered incident, got {report['incidents']}")
    if problems:
        raise BenchError(f"{run_dir}: " + "; ".join(problems))
    inc = report["incidents"][0]
    return {
        **{p: inc[p] for p in PHASES},
        "world_after": inc["world_after"],
        "first_commit_step": inc["first_commit_step"],
        "state_bytes": inc["state_bytes"],
        "kept_microbatches": inc["kept_microbatches"],
        "redone_microbatches": inc["redone_microbatches"],
        "redone_by": inc["redone_by"],
        "comm_rebuild_max_s": inc["comm_rebuild_max_s"],
        "committed_steps": totals["committed_steps"],
        "duplicate_steps": totals["duplicate_steps"],
        "missing_steps": totals["missing_steps"],
        "final_loss": totals["final_loss"],
        "run_wall_s": totals["wall_s"],
        "launch_s": round(wall, 3),
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for phase in PHASES:
        s = result["summary"][phase]
        name = phase.removesuffix("_s")
        rows.append(
            (f"[bold]{name.upper()}[/bold]" if phase == "mttr_s" else name, ms(s["median"]),
             ms(s["min"]), ms(s["max"]))
        )  # fmt: skip
    print_table(
        f"Crash MTTR over {result['repeat']} runs ({result['fault']}), milliseconds",
        ("phase", "median", "min", "max"),
        rows,
    )
    goal = result["goal"]
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(f"goal: every MTTR <= {goal['mttr_max_s']:g} s — {verdict}; no lost or "
                  "duplicated steps in any run")  # fmt: skip
