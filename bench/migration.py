"""Migration over a real link: a pipeline re-cut whose layers cross a shaped link between hosts.

Two hosts × two workers, each host a network namespace of the multi-host test bed
(:mod:`elaswave.testing.netbed`: real etcd, real daemons, gloo over veths), each host's egress
shaped by ``tc`` (a token bucket, as in :mod:`bench.hier`). The job is the built-in GPT at
dp 2 × pp 2 with AdamW: one replica on each host. Rank 1, replica 0's last stage, is SIGKILLed
at ``FAULT_STEP``; its replica's first stage takes over every layer, and the layers it lacks (their
parameters and AdamW moments) come from the other replica's last stage, on the other host: the
bytes cross the shaped link, with no emulated bandwidth (``train.state_bandwidth`` stays off).

The sweep varies the model's width (the bytes to copy) and the link (100 and 400 Mbit/s), so
that the copy takes from about half a step to several steps. For each cell, blocking migration
(the copy lands before training resumes) and async migration (the surviving replica trains the
whole batch while the copy runs; the new layout is switched in at a step boundary) each run
``repeat`` times, and the bench reports, median over the runs:

- **MTTR**: the fault to the first step committed after it (``elaswave report``'s);
- **fault → full layout**: to the step boundary where every replica trains again (async: the
  switch-over, ``migration_done``; blocking: the plan's state sync);
- **samples/s in the window**: the samples committed from the fault to the full layout, over
  that time;
- **copy / step**: the blocking run's state phase (the copy, nothing else) over the fault-free
  steps' median time on the same link.

Each worker emulates its device's compute with ``train.device_time`` (seconds per micro-batch,
scaled by its layers' cost), so that four workers on two cores behave like four devices; the
gradients and the copy are real bytes on the shaped link.
"""

from __future__ import annotations

import itertools
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
    print_table,
    read_jsonl,
    wait_until,
    write_config,
)
from bench.hier import counting, sent_between, shape, tx_bytes
from bench.pipeline import migration_incident
from elaswave.testing import netbed

DESCRIPTION = "pipeline migration over a tc-shaped link between netns hosts: async vs blocking"
DEFAULT_REPEAT = 3
FAULT_STEP = 6
STEPS = 20  # room after the fault for a copy of several steps to land and switch
DEVICE_TIME = 0.08  # emulated accelerator seconds per micro-batch (the whole model)
LINKS = ("400mbit", "100mbit")
WIDTHS = (128, 256, 384)  # d_model: the stage's parameters and AdamW moments to copy
MODES = ("async", "blocking")
GOAL_RATIO = 0.5  # async MTTR / blocking MTTR where a copy takes two steps or more
GOAL_FROM = 2.0


def run(repeat: int, config: Path) -> dict[str, Any]:
    reason = netbed.skip_reason()
    if reason:
        raise BenchError(f"the migration bench needs the netns bed: {reason}")
    widths = [int(w) for w in os.environ.get("MIGRATION_WIDTHS", "").split(",") if w] or WIDTHS
    links = [x for x in os.environ.get("MIGRATION_LINKS", "").split(",") if x] or LINKS
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-migration-"))
    runs: dict[str, list[dict[str, Any]]] = {}
    try:
        for i, link, width, mode in itertools.product(range(1, repeat + 1), links, widths, MODES):
            key = _key(link, width, mode)  # modes interleaved: the machine's drift hits both
            out = _one_job(tmp / f"{link}-{width}-{mode}-{i}", config, link, width, mode)
            runs.setdefault(key, []).append(out)
            console.print(
                f"run {i}/{repeat} {key}: MTTR {out['mttr_s']:.2f} s, full layout "
                f"{out['full_layout_s']:.2f} s, {out['state_bytes'] / 1e6:.1f} MB"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cells, goal = summarize_cells(runs, links, widths)
    return {
        "scenario": "migration",
        "command": "python -m bench migration --repeat N",
        "repeat": repeat,
        "device_time": DEVICE_TIME,
        "fault_step": FAULT_STEP,
        "steps": STEPS,
        "runs": runs,
        "cells": cells,
        "goal": goal,
    }


def summarize_cells(
    runs: dict[str, list[dict[str, Any]]], links: list[str], widths: list[int]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per (link, width): each mode's medians, the copy over a step (blocking's state phase over
    its fault-free step), async MTTR over blocking's; and the goal's verdict: async MTTR at most
    ``GOAL_RATIO`` × blocking's in every cell whose copy takes ``GOAL_FROM`` steps or more (not
    met when no cell does)."""
    cells = []
    for link in links:
        for width in widths:
            cell: dict[str, Any] = {"link": link, "d_model": width}
            for mode in MODES:
                rs = runs[_key(link, width, mode)]
                cell[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            blocking = cell["blocking"]
            cell["copy_over_step"] = blocking["state_s"] / blocking["step_s"]
            cell["async_over_blocking"] = cell["async"]["mttr_s"] / blocking["mttr_s"]
            cells.append(cell)
    far = [c for c in cells if c["copy_over_step"] >= GOAL_FROM]
    goal = {
        "async_over_blocking": GOAL_RATIO,
        "from_copy_over_step": GOAL_FROM,
        "cells": len(far),
        "met": bool(far) and all(c["async_over_blocking"] <= GOAL_RATIO for c in far),
    }
    return cells, goal


def _key(link: str, width: int, mode: str) -> str:
    return f"{link} d{width} {mode}"


def _one_job(tmp: Path, config: Path, link: str, width: int, mode: str) -> dict[str, Any]:
    """One dp 2 × pp 2 job on two shaped hosts, rank 1 SIGKILLed at ``FAULT_STEP``."""
    tmp.mkdir(parents=True)
    cfg = write_config(tmp / "job.yaml", config, {
        "model": {"d_model": width, "n_layer": 4},
        "train": {"steps": STEPS, "global_batch": 8, "micro_batch_size": 2,
                  "device_time": DEVICE_TIME, "optimizer": "adamw"},
        "elastic": {"nproc_per_node": 2, "nnodes": "2:2", "max_restarts": 0},
    })  # fmt: skip
    bed = netbed.NetBed(tmp, config=cfg, hosts=2)
    job = f"migration-{width}-{mode}-{os.getpid()}"
    try:
        bed.start()
        for host in bed.hosts:
            shape(bed.ns(host), link)
        env = bench_env(tmp / "state", {"ELASWAVE_TIMEOUTS__RENDEZVOUS": "120"})
        args = ("--job-id", job, "--pp", "2", "--migration", mode,
                "--fault", f"kill,rank=1,at_step={FAULT_STEP}")  # fmt: skip
        with counting(lambda: [tx_bytes(bed.ns(h)) for h in bed.hosts]) as samples:
            # Replicas form in join order: the first host's workers ready first make replica 0,
            # so each replica is one host and the lost layers' only holder is on the other.
            bed.launch(bed.hosts[0], *args, env=env)
            wait_until(lambda: _ready(bed.run_dirs[bed.hosts[0]]) == 2, 120, "h0's workers")
            bed.launch(bed.hosts[1], *args, env=env)
            codes = bed.wait(timeout=900)
        if any(codes.values()):
            raise BenchError(f"{job}: exit codes {codes}: {bed.output(bed.hosts[0])[-500:]}")
        out = _measure([bed.run_dirs[h] for h in bed.hosts])
        sent = sent_between(samples, out.pop("t0"), out.pop("t_full"))
        return {**out, "crossed_bytes": sum(sent)}
    finally:
        bed.close()


def _ready(run_dir: Path) -> int:
    return sum(e["kind"] == "worker_ready" for e in read_jsonl(run_dir / "events.jsonl"))


def _measure(dirs: list[Path]) -> dict[str, Any]:
    """The fault's incident (MTTR, the state phase, the bytes, the full layout's time:
    :func:`bench.pipeline.migration_incident`), the window's samples/s, and the fault-free
    steps' median time, from every host's records."""
    inc = migration_incident(*dirs)
    t0, full = inc["fault_t"], inc["full_layout_s"]
    first = next(e for d in dirs for e in read_jsonl(d / "events.jsonl")
                 if e["kind"] == "plan_published")  # fmt: skip
    hosts = [{first["workers"][r].split(".")[0] for r in replica} for replica in first["replicas"]]
    if hosts != [{"h0"}, {"h1"}]:
        raise BenchError(f"{dirs[0].parent}: replicas on hosts {hosts}, not one host each")
    if not inc["state_bytes"]:
        raise BenchError(f"{dirs[0].parent}: the incident moved no state")
    metrics: dict[int, dict[str, Any]] = {}
    for d in dirs:
        for m in read_jsonl(d / "metrics.jsonl"):
            metrics.setdefault(m["step"], m)
    window = [m for m in metrics.values() if t0 < m["time"] <= t0 + full]
    samples = sum(m["samples"] - metrics[m["step"] - 1]["samples"] for m in window)
    healthy = [metrics[s]["step_seconds"] for s in range(2, FAULT_STEP)]
    return {
        "mttr_s": inc["mttr_s"],
        "state_s": inc["state_s"] or 0.0,
        "migration_s": inc["migration_s"] or 0.0,
        "state_bytes": inc["state_bytes"],
        "full_layout_s": full,
        "window_samples_per_s": samples / full if full > 0 else 0.0,
        "step_s": statistics.median(healthy),
        "t0": t0,
        "t_full": t0 + full,
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for c in result["cells"]:
        a, b = c["async"], c["blocking"]
        rows.append((
            c["link"], str(c["d_model"]), f"{b['state_bytes'] / 1e6:.1f}",
            f"{a['crossed_bytes'] / 1e6:.1f} / {b['crossed_bytes'] / 1e6:.1f}",
            f"{b['step_s']:.2f}", f"{c['copy_over_step']:.1f}",
            f"{a['mttr_s']:.2f} / {b['mttr_s']:.2f}", f"{c['async_over_blocking']:.2f}",
            f"{a['full_layout_s']:.2f} / {b['full_layout_s']:.2f}",
            f"{a['window_samples_per_s']:.1f} / {b['window_samples_per_s']:.1f}",
        ))  # fmt: skip
    print_table(
        f"Migration across a shaped link (dp 2 × pp 2 on 2 netns hosts, rank 1 killed at step "
        f"{result['fault_step']}; medians of {result['repeat']}; async / blocking)",
        ("link", "d_model", "MB of state", "MB crossed in the window", "step s", "copy/step",
         "MTTR s", "async/blocking", "fault → full layout s", "window samples/s"),
        rows,
    )  # fmt: skip
    goal = result["goal"]
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(
        f"async MTTR ≤ {goal['async_over_blocking']} × blocking where copy/step ≥ "
        f"{goal['from_copy_over_step']} ({goal['cells']} cells): {verdict}"
    )
