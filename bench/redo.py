"""Partial redo: crash MTTR when survivors keep their finished micro-batches, against redoing the
whole interrupted step, at 4 and 8 workers, and in pipelines (dp=2 x pp=2, dp=3 x pp=2), with
emulated devices.

Each worker sleeps ``train.device_time`` per micro-batch, chosen so that a fault-free step lasts
about one second at every size (16 micro-batches: 0.25 s each over 4 workers, 0.5 s over 8): a
step's length then matters more than this machine's two cores. One rank is SIGKILLed after its
compute of step ``FAULT_STEP``; the survivors' reduction fails. With ``train.partial_redo`` (the
default) they compute only the dead rank's micro-batches, shared by speed; without it, the whole
step. The goal: redo ≤ (lost micro-batches / survivors + 1) × micro-batch time.

In the pipelines the killed rank is replica 0's second stage: its replica's surviving stage takes
its layers over (a blocking migration), the intact replicas keep their sums, and replica 0's
micro-batches run again over every replica by speed. ``device_time`` is then one micro-batch's
time through the whole model (each stage sleeps its layers' share of it, forward and backward),
chosen so that the fault-free 1F1B step lasts about one second. The goals there: redo ≤
(lost micro-batches / surviving replicas + 1) × micro-batch time, and ≤ 0.5 × the whole-step
redo.

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
PIPELINES = ((2, 2), (3, 2))  # (dp, pp)
MODES = ("partial", "whole")


def _device_time(world: int, pp: int = 1) -> float:
    """Seconds per micro-batch (through the whole model) for ~``STEP_S`` fault-free steps: a
    replica of ``pp`` stages runs its ``m`` micro-batches in (m + pp - 1) stage slots."""
    if pp == 1:
        return STEP_S * world / MICROBATCHES
    per_replica = MICROBATCHES / (world // pp)
    return STEP_S * pp / (per_replica + pp - 1)


def _layouts() -> list[tuple[str, int, int]]:
    """(cell name, workers, stages) of every layout the scenario runs."""
    return [(str(w), w, 1) for w in WORLDS] + [(f"{d}x{p}", d * p, p) for d, p in PIPELINES]


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-redo-"))
    env = bench_env(tmp / "state")
    extra = ["--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
    cells: dict[str, Any] = {}
    for name, world, pp in _layouts():
        for mode in MODES:
            changes = {
                "train": {
                    "steps": STEPS,
                    "global_batch": 2 * MICROBATCHES,
                    "micro_batch_size": 2,
                    "device_time": _device_time(world, pp),
                    "partial_redo": mode == "partial",
                },
                "elastic": {"nproc_per_node": world},
            }
            cfg = write_config(tmp / f"config-{name}-{mode}.yaml", config, changes)
            runs = []
            for i in range(1, repeat + 1):
                run_dir = tmp / f"run-{name}-{mode}-{i}"
                job_id = f"bench-redo-{os.getpid()}-{name}-{mode}-{i}"
                stages = ["--pp", str(pp), "--migration", "blocking"] if pp > 1 else []
                began, ended = elaswave_launch(
                    cfg, run_dir, job_id, env=env, extra_args=[*extra, *stages]
                )
                runs.append(check_recovered(run_dir, STEPS, ended - began))
                inc = runs[-1]
                console.print(
                    f"{name} ({world} workers), {mode}: run {i}/{repeat}: MTTR "
                    f"{ms(inc['mttr_s'])} ms, redo {ms(inc['redo_s'])} ms "
                    f"({inc['redone_microbatches']} micro-batches)"
                )
            cells[f"{name}/{mode}"] = {
                "world": world,
                "stages": pp,
                "mode": mode,
                "device_time": _device_time(world, pp),
                "runs": runs,
                "redo_s": summarize(r["redo_s"] for r in runs),
                "mttr_s": summarize(r["mttr_s"] for r in runs),
            }
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    goals = {}
    for name, world, pp in _layouts():
        replicas = world // pp
        survivors, lost = (world - 1, MICROBATCHES // world) if pp == 1 else (
            replicas, MICROBATCHES // replicas)  # fmt: skip
        bound = (lost / survivors + 1) * _device_time(world, pp)
        partial, whole = cells[f"{name}/partial"]["redo_s"], cells[f"{name}/whole"]["redo_s"]
        worst = partial["max"]
        goals[name] = {
            "redo_bound_s": round(bound, 4),
            "met": worst is not None and worst <= bound,
            "vs_whole": round(partial["median"] / whole["median"], 3),
        }
    return {
        "scenario": "redo",
        "command": launch_command(
            config,
            [*extra, "(train.partial_redo true|false; pipelines: --pp 2 --migration blocking)"],
        ),  # fmt: skip
        "repeat": repeat,
        "steps": STEPS,
        "fault_step": FAULT_STEP,
        "microbatches": MICROBATCHES,
        "cells": cells,
        "goal": goals,
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, _, _ in _layouts():
        whole = result["cells"][f"{name}/whole"]
        for mode in MODES:
            cell = result["cells"][f"{name}/{mode}"]
            redone = sorted({r["redone_microbatches"] or MICROBATCHES for r in cell["runs"]})
            ratio = cell["redo_s"]["median"] / whole["redo_s"]["median"]
            rows.append(
                (name, mode, f"{cell['device_time']:.3g}",
                 ",".join(map(str, redone)), ms(cell["redo_s"]["median"]),
                 f"{ms(cell['redo_s']['min'])}–{ms(cell['redo_s']['max'])}",
                 ms(cell["mttr_s"]["median"]), f"{ratio:.2f}")
            )  # fmt: skip
    print_table(
        f"Crash MTTR, partial vs whole-step redo ({result['repeat']} runs each, "
        f"{result['microbatches']} micro-batches, ~1 s steps), milliseconds",
        ("workers (dp x pp)", "redo", "s/mb", "mb redone", "redo median", "redo range",
         "MTTR median", "redo vs whole"),
        rows,
    )  # fmt: skip
    for name, goal in result["goal"].items():
        verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
        console.print(
            f"{name}: redo <= (lost/survivors + 1) x mb time = "
            f"{ms(goal['redo_bound_s'])} ms — {verdict}; partial / whole {goal['vs_whole']:.2f}"
        )
