"""Steady-state overhead: wall time per step of ElasWave vs plain DDP on the same job.

Per round, in this order: ElasWave (default float32 gradient reduction), DDP, ElasWave in its
deterministic mode ``ELASWAVE_TRAIN__REDUCE_DTYPE=float64``. Interleaving rounds lets slow drift
on a shared machine hit every variant alike. Each run trains ``STEPS`` fault-free steps on
``OVERHEAD_WORLD`` workers (default 4); the metric is the median of the per-step wall intervals
after ``WARMUP`` steps:

* ElasWave: differences of consecutive ``time`` fields in ``metrics.jsonl`` (rank 0's wall clock
  when it reports the commit, so the commit report and plan check are included);
* DDP: differences of consecutive step ends on rank 0 (all ranks meet in the all-reduce).

``in-step`` is the part spent inside the step (forward/backward, all-reduce, optimizer):
ElasWave's ``step_seconds``, DDP's timer around the same work.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    bench_env,
    console,
    diffs,
    elaswave_launch,
    launch_command,
    ms,
    print_table,
    read_jsonl,
    summarize,
)
from bench.ddp_baseline import run_ddp

DESCRIPTION = (
    "steady-state step time: ElasWave (float32 / deterministic float64) vs plain DDP, interleaved"
)
DEFAULT_REPEAT = 3
STEPS = 40
WARMUP = 5  # steps whose intervals are skipped (first-touch allocations, DDP bucket rebuild)
WORLD = int(os.environ.get("OVERHEAD_WORLD", "4"))  # workers (2: one core each here)
GOAL_RATIO = 1.05
VARIANTS = {
    "elaswave": "ElasWave, float32 reduce (default)",
    "ddp": "PyTorch DDP, float32 reduce",
    "elaswave_fp64": "ElasWave, float64 reduce (deterministic)",
    "elaswave_replay": "ElasWave, float32 reduce, --replay-every 1",
}
ELASWAVE = ("elaswave", "elaswave_fp64", "elaswave_replay")


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.config import load_config

    cfg = load_config(config, env={})
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-overhead-"))
    if cfg.elastic.nproc_per_node != WORLD:  # the same job on WORLD workers
        data = yaml.safe_load(config.read_text())
        data.setdefault("elastic", {})["nproc_per_node"] = WORLD
        config = tmp / f"{config.stem}-{WORLD}w.yaml"
        config.write_text(yaml.safe_dump(data))
    rounds: list[dict[str, Any]] = []
    for r in range(1, repeat + 1):
        row = {}
        for name in VARIANTS:
            began = time.perf_counter()
            row[name] = _run_variant(name, config, tmp / f"r{r}-{name}", job=f"{r}-{name}")
            console.print(
                f"round {r}/{repeat} {name:>13}: {ms(row[name]['step_median_s'])} ms/step "
                f"(in-step {ms(row[name]['in_step_median_s'])} ms; "
                f"run {time.perf_counter() - began:.0f} s)"
            )
        rounds.append(row)
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {name: _summary(rounds, name) for name in VARIANTS}
    ddp = summary["ddp"]["step_s"]["median"]
    ratios = {name: summary[name]["step_s"]["median"] / ddp for name in ELASWAVE}
    per_round = [
        {name: row[name]["step_median_s"] / row["ddp"]["step_median_s"] for name in ELASWAVE}
        for row in rounds
    ]  # fmt: skip
    ref = rounds[0]["elaswave"]["loss"]
    loss_gap = max(
        abs(a - b)
        for row in rounds
        for name in VARIANTS
        for a, b in zip(ref, row[name]["loss"], strict=True)
    )
    return {
        "scenario": "overhead",
        "commands": {
            "elaswave": launch_command(config, ["--steps", str(STEPS)]),
            "elaswave_fp64": "ELASWAVE_TRAIN__REDUCE_DTYPE=float64 "
            + launch_command(config, ["--steps", str(STEPS)]),
            "elaswave_replay": launch_command(
                config, ["--steps", str(STEPS), "--replay-every", "1"]
            ),
            "ddp": f"bench.ddp_baseline.run_ddp (torch.multiprocessing.spawn, {WORLD} gloo ranks)",
        },
        "repeat": repeat,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "world": WORLD,
        "variants": VARIANTS,
        "rounds": rounds,
        "summary": summary,
        "ratio_vs_ddp": ratios,
        "ratio_vs_ddp_per_round": per_round,
        "ratio_vs_ddp_paired": {n: summarize(p[n] for p in per_round) for n in per_round[0]},
        "max_abs_loss_diff_vs_first_elaswave_run": loss_gap,
        "goal": {"ratio_max": GOAL_RATIO, "met": ratios["elaswave"] <= GOAL_RATIO},
    }


def _run_variant(name: str, config: Path, out: Path, job: str) -> dict[str, Any]:
    out.mkdir()
    if name == "ddp":
        return measure(run_ddp(config, steps=STEPS, world=WORLD, out_dir=out))
    dtype = "float64" if name == "elaswave_fp64" else "float32"
    env = bench_env(out.parent / "state", {"ELASWAVE_TRAIN__REDUCE_DTYPE": dtype})
    job_id = f"bench-ovh-{os.getpid()}-{job.replace('_', '-')}"
    replay = ["--replay-every", "1"] if name == "elaswave_replay" else []
    began, ended = elaswave_launch(
        config, out / "run", job_id, env=env, extra_args=["--steps", str(STEPS), *replay]
    )
    result = measure_elaswave(out / "run")
    # Not part of the comparison; recorded because launch time varies a lot on a busy machine.
    result["launch_s"] = round(ended - began, 3)
    result["launch_to_first_commit_s"] = round(result.pop("first_end") - began, 3)
    result["last_commit_to_exit_s"] = round(ended - result.pop("last_end"), 3)
    return result


def measure_elaswave(run_dir: Path, steps: int = STEPS, warmup: int = WARMUP) -> dict[str, Any]:
    """Step timings of a finished ElasWave run (see the module docstring)."""
    metrics = sorted(read_jsonl(run_dir / "metrics.jsonl"), key=lambda m: m["step"])
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)), f"{run_dir}: steps missing"
    ends = [m["time"] for m in metrics]
    raw = {"step_ends": ends, "step_seconds": [m["step_seconds"] for m in metrics]}
    raw["loss"] = [m["loss"] for m in metrics]
    timed = measure(raw, first_end_is_step=1, steps=steps, warmup=warmup)
    return {**timed, "first_end": ends[0], "last_end": ends[-1]}


def measure(
    raw: dict[str, Any], first_end_is_step: int = 0, steps: int = STEPS, warmup: int = WARMUP
) -> dict[str, Any]:
    """Median of the intervals ending at steps warmup+1..steps (and of in-step times alike)."""
    ends = raw["step_ends"][warmup - first_end_is_step :]
    steady = diffs(ends)
    inner = raw["step_seconds"][warmup:]
    assert len(steady) == len(inner) == steps - warmup
    s, i = summarize(steady), summarize(inner)
    between = summarize(a - b for a, b in zip(steady, inner, strict=True))
    return {
        "step_median_s": s["median"],
        "step_min_s": s["min"],
        "step_max_s": s["max"],
        "in_step_median_s": i["median"],
        "between_steps_median_s": between["median"],
        "intervals_s": steady,
        "loss": raw["loss"],
    }


def _summary(rounds: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return {
        "step_s": summarize(r[name]["step_median_s"] for r in rounds),
        "in_step_s": summarize(r[name]["in_step_median_s"] for r in rounds),
        "between_steps_s": summarize(r[name]["between_steps_median_s"] for r in rounds),
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, label in result["variants"].items():
        s = result["summary"][name]
        ratio = result["ratio_vs_ddp"].get(name, 1.0)
        spread = f"{ms(s['step_s']['min'])}–{ms(s['step_s']['max'])}"
        rows.append(
            (label, ms(s["step_s"]["median"]), spread, ms(s["in_step_s"]["median"]),
             ms(s["between_steps_s"]["median"]), f"{ratio:.3f}")
        )  # fmt: skip
    print_table(
        f"Steady-state step time, {result['world']} workers, {result['repeat']} interleaved rounds "
        f"(median of per-round medians, steps {result['warmup_steps'] + 1}–{result['steps']}), ms",
        ("variant", "ms/step", "spread", "in-step", "between", "vs DDP"),
        rows,
    )
    for name, s in result["ratio_vs_ddp_paired"].items():
        console.print(
            f"paired (same-round) ratio {name}/ddp: median {s['median']:.3f}, "
            f"range {s['min']:.3f}–{s['max']:.3f}"
        )
    goal = result["goal"]
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(
        f"goal: ElasWave/DDP <= {goal['ratio_max']:g} — {verdict} "
        f"({result['ratio_vs_ddp']['elaswave']:.3f}); max |loss difference| between variants "
        f"{result['max_abs_loss_diff_vs_first_elaswave_run']:.2e}"
    )
