"""A user's own loop: wall time per step of ``elaswave launch --script`` vs the same loop under
plain DDP, interleaved rounds (``bench/ownloop_script.py`` is both).

Per round: ElasWave's script mode, then DDP, on ``WORLD`` workers (2: one core each here), each
training ``STEPS`` fault-free steps; the metric is the median interval between step ends after
``WARMUP`` steps (ElasWave: the ``time`` of consecutive commits in ``metrics.jsonl``; DDP: rank
0's step ends). The goal: the script mode within 1.05 × DDP.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from bench.common import (
    REPO_ROOT,
    bench_env,
    console,
    diffs,
    elaswave_launch,
    free_port,
    ms,
    print_table,
    read_jsonl,
    summarize,
)

DESCRIPTION = "a user's own loop: elaswave launch --script vs the same loop under DDP"
DEFAULT_REPEAT = 3
STEPS, WARMUP = 60, 10
WORLD = int(os.environ.get("OWNLOOP_WORLD", "2"))
# 8 micro-batches of 32 samples: a step of about 0.15 s here. OWNLOOP_BATCH=64 (16 a
# micro-batch) shows a 35 ms step, where the reduction's fixed cost weighs more.
GLOBAL_BATCH = int(os.environ.get("OWNLOOP_BATCH", "256"))
MICRO = GLOBAL_BATCH // 8
GOAL_RATIO = 1.05
SCRIPT = REPO_ROOT / "bench" / "ownloop_script.py"


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-ownloop-"))
    cfg = tmp / "job.yaml"  # the job's shape; the model and data are the script's
    cfg.write_text(f"elastic: {{nproc_per_node: {WORLD}}}\ntrain: {{threads_per_worker: 1}}\n")
    rounds = []
    for r in range(1, repeat + 1):
        row = {"elaswave": _elaswave(cfg, tmp / f"r{r}", r), "ddp": _ddp(tmp / f"r{r}-ddp.json")}
        rounds.append(row)
        console.print(
            f"round {r}/{repeat}: script mode {ms(row['elaswave'])} ms/step, "
            f"DDP {ms(row['ddp'])} ms/step, ratio {row['elaswave'] / row['ddp']:.3f}"
        )
    shutil.rmtree(tmp, ignore_errors=True)
    paired = summarize(row["elaswave"] / row["ddp"] for row in rounds)
    medians = {k: summarize(row[k] for row in rounds) for k in ("elaswave", "ddp")}
    ratio = medians["elaswave"]["median"] / medians["ddp"]["median"]
    return {
        "scenario": "ownloop",
        "commands": {
            "elaswave": "elaswave launch JOB.yaml --script bench/ownloop_script.py "
            f"--steps {STEPS} --global-batch {GLOBAL_BATCH} --micro-batch-size {MICRO} "
            f"--nproc-per-node {WORLD}",
            "ddp": f"bench.ownloop_script.ddp_worker (torch.multiprocessing.spawn, {WORLD} ranks)",
        },
        "repeat": repeat, "steps": STEPS, "warmup_steps": WARMUP, "world": WORLD,
        "global_batch": GLOBAL_BATCH, "micro_batch_size": MICRO,
        "rounds": rounds, "summary_s": medians, "ratio_vs_ddp": ratio, "ratio_paired": paired,
        "goal": {"ratio_max": GOAL_RATIO, "met": ratio <= GOAL_RATIO},
    }  # fmt: skip


def _elaswave(cfg: Path, out: Path, r: int) -> float:
    env = bench_env(out / "state")
    args = ["--script", str(SCRIPT), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH),
            "--micro-batch-size", str(MICRO)]  # fmt: skip
    elaswave_launch(cfg, out / "run", f"bench-own-{os.getpid()}-{r}", env=env, extra_args=args)
    metrics = [m for m in read_jsonl(out / "run" / "metrics.jsonl") if "kind" not in m]
    ends = [m["time"] for m in sorted(metrics, key=lambda m: m["step"])]
    assert len(ends) == STEPS
    return float(summarize(diffs(ends[WARMUP - 1 :]))["median"])


def _ddp(out: Path) -> float:
    from bench.ownloop_script import ddp_worker

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        args = (WORLD, free_port(), STEPS, GLOBAL_BATCH, MICRO, str(out))
        mp.spawn(ddp_worker, args=args, nprocs=WORLD)
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    ends = json.loads(out.read_text())["step_ends"]
    return float(summarize(diffs(ends[WARMUP:]))["median"])


def show(result: dict[str, Any]) -> None:
    s = result["summary_s"]
    rows = [
        ("elaswave launch --script", ms(s["elaswave"]["median"]),
         f"{ms(s['elaswave']['min'])}–{ms(s['elaswave']['max'])}", f"{result['ratio_vs_ddp']:.3f}"),
        ("the same loop under DDP", ms(s["ddp"]["median"]),
         f"{ms(s['ddp']['min'])}–{ms(s['ddp']['max'])}", "1.000"),
    ]  # fmt: skip
    print_table(
        f"A user's own loop, {result['world']} workers, {result['repeat']} interleaved rounds "
        f"(median of per-round medians, steps {result['warmup_steps'] + 1}–{result['steps']}), ms",
        ("variant", "ms/step", "spread", "vs DDP"),
        rows,
    )
    p = result["ratio_paired"]
    console.print(f"paired ratio: median {p['median']:.3f}, range {p['min']:.3f}–{p['max']:.3f}")
    verdict = "[green]met[/green]" if result["goal"]["met"] else "[red]NOT met[/red]"
    console.print(f"goal ≤ {result['goal']['ratio_max']} × DDP: {verdict}")


if __name__ == "__main__":
    sys.exit("run it as: python -m bench ownloop")
