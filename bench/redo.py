"""Partial redo: crash MTTR when survivors keep their finished micro-batches, against redoing the
whole interrupted step, at 4 and 8 workers with emulated devices.

Each worker sleeps ``train.device_time`` per micro-batch, chosen so that a fault-free step lasts
about one second at every size (16 micro-batches: 0.25 s each over 4 workers, 0.5 s over 8): a
step's length then matters more than this machine's two cores. One rank is SIGKILLed after its
compute of step ``FAULT_STEP``; the survivors' reduction fails. With ``train.partial_redo`` (the
default) they compute only the dead rank's micro-batches, shared by speed; without it, the whole
step. The goal: redo ≤ (lost micro-batches / survivors + 1) × micro-batch time.

Every run is checked like ``bench mttr`` (one incident, no step lost or committed twice); the
report's ``redone_microbatches`` says what was computed again.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    bench_env,
    console,
    elaswave_launch,
    launch_command,
    ms,
    print_table,
    summarize,
    write_config,
)
from bench.mttr import _check as check_recovered  # one recovered incident, no step lost

DESCRIPTION = "partial vs whole-step redo: crash MTTR at 4 and 8 workers, ~1 s steps (N each)"
DEFAULT_REPEAT = 3
MICROBATCHES = 16
STEP_S = 1.0  # fault-free step time the emulated devices aim at
STEPS, FAULT_STEP = 8, 5
WORLDS = (4, 8)
MODES = ("partial", "whole")


def _device_time(world: int) -> float:
    return STEP_S * world / MICROBATCHES


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-redo-"))
    env = bench_env(tmp / "state")
    extra = ["--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
    cells: dict[str, Any] = {}
    for world in WORLDS:
        for mode in MODES:
            changes = {
                "train": {
                    "steps": STEPS,
                    "global_batch": 2 * MICROBATCHES,
                    "micro_batch_size": 2,
                    "device_time": _device_time(world),
                    "partial_redo": mode == "partial",
                },
                "elastic": {"nproc_per_node": world},
            }
            cfg = write_config(tmp / f"config-{world}-{mode}.yaml", config, changes)
            runs = []
            for i in range(1, repeat + 1):
                run_dir = tmp / f"run-{world}-{mode}-{i}"
                job_id = f"bench-redo-{os.getpid()}-{world}-{mode}-{i}"
                began, ended = elaswave_launch(cfg, run_dir, job_id, env=env, extra_args=extra)
                runs.append(check_recovered(run_dir, STEPS, ended - began))
                inc = runs[-1]
                console.print(
                    f"{world} workers, {mode}: run {i}/{repeat}: MTTR {ms(inc['mttr_s'])} ms, "
                    f"redo {ms(inc['redo_s'])} ms ({inc['redone_microbatches']} micro-batches)"
                )
            cells[f"{world}/{mode}"] = {
                "world": world,
                "mode": mode,
                "device_time": _device_time(world),
                "runs": runs,
                "redo_s": summarize(r["redo_s"] for r in runs),
                "mttr_s": summarize(r["mttr_s"] for r in runs),
            }
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    goals = {}
    for world in WORLDS:
        survivors, lost = world - 1, MICROBATCHES // world
        bound = (lost / survivors + 1) * _device_time(world)
        worst = cells[f"{world}/partial"]["redo_s"]["max"]
        goals[str(world)] = {
            "redo_bound_s": round(bound, 4),
            "met": worst is not None and worst <= bound,
        }
    return {
        "scenario": "redo",
        "command": launch_command(config, [*extra, "(train.partial_redo true|false)"]),
        "repeat": repeat,
        "steps": STEPS,
        "fault_step": FAULT_STEP,
        "microbatches": MICROBATCHES,
        "cells": cells,
        "goal": goals,
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for world in WORLDS:
        whole = result["cells"][f"{world}/whole"]
        for mode in MODES:
            cell = result["cells"][f"{world}/{mode}"]
            redone = sorted({r["redone_microbatches"] for r in cell["runs"]})
            ratio = cell["redo_s"]["median"] / whole["redo_s"]["median"]
            rows.append(
                (str(world), mode, f"{cell['device_time']:g}",
                 ",".join(map(str, redone)), ms(cell["redo_s"]["median"]),
                 f"{ms(cell['redo_s']['min'])}–{ms(cell['redo_s']['max'])}",
                 ms(cell["mttr_s"]["median"]), f"{ratio:.2f}")
            )  # fmt: skip
    print_table(
        f"Crash MTTR, partial vs whole-step redo ({result['repeat']} runs each, "
        f"{result['microbatches']} micro-batches, ~1 s steps), milliseconds",
        ("workers", "redo", "s/mb", "mb redone", "redo median", "redo range", "MTTR median",
         "redo vs whole"),
        rows,
    )  # fmt: skip
    for world, goal in result["goal"].items():
        verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
        console.print(
            f"{world} workers: redo <= (lost/survivors + 1) x mb time = "
            f"{ms(goal['redo_bound_s'])} ms — {verdict}"
        )
