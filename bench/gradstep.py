"""Step time of a pipeline whose layers' gradients are summed among their holders, against the
whole model's gradient all-reduced over every rank (what pipelines did before, and still do
while an asynchronous migration runs): a ~60 M-parameter Llama-style model, 4 workers, pp = 2
and 4, fault-free.

Both modes train the same model bit for bit (``grad_reduce: holders`` or ``all``; the e2e tests
check both against data parallelism); only the bytes each rank sends differ. Per run: the
median seconds per committed step after the first two (start-up), the gradient bytes each rank
sends per step (``state_synced``'s ``grad_sent_bytes``: what a ring all-reduce sends for the
groups it reduces in, computed, not counted on the wire) and the final loss (the table says
whether every run of both modes ended on the same one). The two modes of one pp run back to
back, alternating, ``--repeat`` times. The model is fixed (``--config`` is not used).
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
    print_table,
    read_jsonl,
)
from bench.stagemem import MODEL, WORLD, job_config

DESCRIPTION = "pipeline step time: gradients among each layer's holders vs the whole model's"
DEFAULT_REPEAT = 3
STEPS = 8
WARM = 2  # steps left out of the median (start-up, first allocations)
PPS = (2, 4)
MODES = ("holders", "all")


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-gradstep-"))
    env = bench_env(tmp / "state", {"ELASWAVE_VERIFY_EVERY": "0"})  # the step alone
    cfg = job_config(tmp / "config.yaml", STEPS)
    cells: dict[str, list[dict[str, float]]] = {}
    for pp in PPS:
        for i in range(1, repeat + 1):
            for mode in MODES:
                run_dir = tmp / f"pp{pp}-{mode}-{i}"
                job = f"bench-gradstep-{os.getpid()}-{pp}-{mode}-{i}"
                elaswave_launch(
                    cfg, run_dir, job, env={**env, "ELASWAVE_GRAD_REDUCE": mode},
                    extra_args=("--pp", str(pp)), timeout=1800,
                )  # fmt: skip
                cell = _cell(run_dir)
                cells.setdefault(f"{pp}/{mode}", []).append(cell)
                console.print(
                    f"pp={pp} {mode} run {i}/{repeat}: {cell['step_s']:.3f} s/step, "
                    f"{cell['grad_sent_mb']:.1f} MB sent/rank/step"
                )
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": "gradstep",
        "command": "python -m bench gradstep",
        "world": WORLD,
        "steps": STEPS,
        "model": MODEL,
        "cells": cells,
    }


def _cell(run_dir: Path) -> dict[str, float]:
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "kind" not in m]
    if [m["step"] for m in steps] != list(range(1, STEPS + 1)):
        raise BenchError(f"{run_dir}: committed {[m['step'] for m in steps]}")
    synced = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "state_synced"]
    sent = statistics.median(e["grad_sent_bytes"] for e in synced)
    return {
        "step_s": statistics.median(m["step_seconds"] for m in steps[WARM:]),
        "grad_sent_mb": sent / 2**20,
        "final_loss": steps[-1]["loss"],
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for pp in PPS:
        med = {
            mode: {k: statistics.median(c[k] for c in result["cells"][f"{pp}/{mode}"])
                   for k in ("step_s", "grad_sent_mb", "final_loss")}
            for mode in MODES
        }  # fmt: skip
        h, a = med["holders"], med["all"]
        losses = {c["final_loss"] for mode in MODES for c in result["cells"][f"{pp}/{mode}"]}
        rows.append(
            (str(pp), f"{h['step_s']:.3f}", f"{a['step_s']:.3f}",
             f"{a['step_s'] / h['step_s']:.2f}",
             f"{h['grad_sent_mb']:.1f}", f"{a['grad_sent_mb']:.1f}",
             "yes" if len(losses) == 1 else "no")
        )  # fmt: skip
    print_table(
        f"Seconds per step, {result['world']} workers (median of runs; each run's median step)",
        ("pp", "holders s/step", "whole s/step", "whole / holders", "holders MB sent",
         "whole MB sent", "one final loss (all runs)"),
        rows,
    )  # fmt: skip
