"""Stragglers: a rank that really computes slower, re-shared by speed or evicted.

Each round runs two ``elaswave launch`` jobs of 60 steps: rank 3 becomes slow at step 11
(``slow,rank=3,at_step=11,delay=D``). With a moderate delay and ``--straggler-threshold 0`` the
leader can only re-share micro-batches; with a large delay and the default threshold (3) it
evicts the rank. Per run: the step time before the fault (steps 2–10, fault-free), while slow
and not yet answered, and after the new plan (its first step, the redo, excluded); the detection
time (fault → the leader's verdict) and the slow steps it cost; the shares or the eviction; and
that no step was lost or committed twice.

On 2 shared cores a slow (sleeping) rank frees CPU for the others, so the gain of a re-share is
hidden. The ``emulated`` variants therefore make every worker emulate its device with
``train.device_time`` (seconds per micro-batch, slept), as the ``pipeline`` scenario does, and
slow one rank to about twice its time: data parallel (re-share micro-batches) and dp=2 × pp=2
(re-cut the slow rank's stage and re-share the replicas). Their "after / slow" is the gain.
"""

from __future__ import annotations

import os
import shutil
import statistics
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
    read_jsonl,
    summarize,
    write_config,
)

DESCRIPTION = (
    "a slow rank from step 11: re-share (moderate), eviction (large), and with emulated devices "
    "the data-parallel re-share and the pipeline re-cut"
)
DEFAULT_REPEAT = 2
STEPS = 60
AT_STEP = 11
SLOW = f"slow,rank=3,at_step={AT_STEP}"
DEVICE_TIME = 0.15  # emulated seconds per micro-batch through the whole model
EMULATED = {"train": {"device_time": DEVICE_TIME}}
# name -> (launch arguments, config changes). A slow fault's delay is seconds per step at an even
# share: rank 3 of 4 data-parallel ranks computes 4 × 0.15 s, rank 1 of dp=2 × pp=2 half of
# 8 × 0.15 s; the delays below double those.
VARIANTS: dict[str, tuple[list[str], dict[str, Any]]] = {
    "re-share": (["--straggler-threshold", "0", "--fault", f"{SLOW},delay=0.1"], {}),
    "evict": (["--fault", f"{SLOW},delay=1"], {}),
    "re-share, emulated": (
        ["--straggler-threshold", "0", "--fault", f"{SLOW},delay=0.6"], EMULATED
    ),
    "pipeline re-cut, emulated": (
        ["--pp", "2", "--straggler-threshold", "0",
         "--fault", f"slow,rank=1,at_step={AT_STEP},delay=1.2"],
        EMULATED,
    ),
}  # fmt: skip
METRICS = ("before_s", "slow_s", "after_s", "gain", "detection_s", "slow_steps")


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-straggler-"))
    env = bench_env(tmp / "state")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    configs = {
        name: write_config(tmp / f"config-{j}.yaml", config, changes) if changes else config
        for j, (name, (_, changes)) in enumerate(VARIANTS.items())
    }
    for i in range(1, repeat + 1):
        for j, (name, (args, _)) in enumerate(VARIANTS.items()):
            run_dir = tmp / f"variant{j}-{i}"
            job_id = f"bench-straggler-{os.getpid()}-{j}-{i}"
            elaswave_launch(
                configs[name], run_dir, job_id, env=env, extra_args=[*args, "--steps", str(STEPS)]
            )
            r = _measure(run_dir)
            runs[name].append(r)
            console.print(
                f"round {i}/{repeat}, {name}: step {ms(r['before_s'])} → slow {ms(r['slow_s'])} "
                f"→ after {ms(r['after_s'])} ms; detected in {r['detection_s']:.2f} s "
                f"({r['slow_steps']} slow steps); {r['microbatches']}; load "
                f"{os.getloadavg()[0]:.1f}"
            )  # fmt: skip
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    return {
        "scenario": "straggler",
        "repeat": repeat,
        "steps": STEPS,
        "runs": runs,
        "variants": {
            name: {
                "command": launch_command(config, [*args, "--steps", str(STEPS)]),
                "config_changes": changes,
                "summary": {m: summarize(r[m] for r in runs[name]) for m in METRICS},
            }
            for name, (args, changes) in VARIANTS.items()
        },
    }


def _measure(run_dir: Path) -> dict[str, Any]:
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    steps = [m["step"] for m in metrics]
    if steps != list(range(1, STEPS + 1)):
        raise BenchError(f"{run_dir}: steps lost or duplicated: {steps}")
    fault = next(e for e in events if e["kind"] == "fault_injected")
    verdicts = [e for e in events if e["kind"] == "straggler_detected"]
    if not verdicts:
        raise BenchError(f"{run_dir}: the slow rank was never detected")
    verdict = verdicts[0]
    plan = next(e for e in events if e["kind"] == "plan_published" and e["epoch"] > 1)
    answered = min(m["step"] for m in metrics if m["epoch"] >= plan["epoch"])

    def median(lo: int, hi: int) -> float | None:
        xs = [m["step_seconds"] for m in metrics if lo <= m["step"] < hi and m["step_seconds"]]
        return statistics.median(xs) if xs else None

    slow, after = median(AT_STEP, answered), median(answered + 1, STEPS + 1)
    return {
        "before_s": median(2, AT_STEP),
        "slow_s": slow,
        "after_s": after,
        "gain": slow / after if slow and after else None,  # the new plan's speed-up
        "detection_s": round(verdict["t"] - fault["t"], 3),
        "slow_steps": answered - AT_STEP,
        "microbatches": plan["microbatches"],
        "bounds": plan.get("bounds"),
        "reason": plan["reason"],
        "evicted": plan.get("evicted", []),
        "plans": sum(1 for e in events if e["kind"] == "plan_published"),
        "slowdown": verdict["slowdown"],
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, per in result["variants"].items():
        s = per["summary"]
        rows.append((
            name, ms(s["before_s"]["median"]), ms(s["slow_s"]["median"]),
            ms(s["after_s"]["median"]), f"{s['gain']['median']:.2f}",
            f"{s['detection_s']['median']:.2f}",
            f"{s['slow_steps']['median']:g}",
            ", ".join(str(r["microbatches"]) for r in result["runs"][name]),
        ))  # fmt: skip
    print_table(
        f"A slow rank from step {AT_STEP}, medians over {result['repeat']} runs",
        ("variant", "step before (ms)", "slow (ms)", "after (ms)", "slow / after", "detect (s)",
         "slow steps", "new shares"),
        rows,
    )  # fmt: skip
