"""Pipelines after a stage loss: ElasWave's reshard vs dropping the replica, async vs blocking.

dp=2 × pp=2 (4 workers), rank 1 (replica 0's last stage) SIGKILLed mid-run. Variants, run
interleaved in each repetition on the same model, data and batch:

- ``healthy``: no fault (the original throughput);
- ``reshard-async``: replica 0's surviving stage takes over every layer, copied in the
  background while replica 1 runs the whole batch (ElasWave's default);
- ``reshard-blocking``: the same layout, layers copied before training resumes;
- ``drop``: replica 0 is taken out of service (TorchFT's policy) and replica 1 runs it all;
- ``recycle``: ReCycle's rerouting (``--stage-loss recycle``): replica 1's last stage runs
  replica 0's micro-batches of that stage too, every cut and share kept.

Throughput: 4 processes on 2 cores would share the CPU, so a dead worker would *free* capacity
instead of removing it. Each worker therefore emulates its device with ``train.device_time``
(seconds of accelerator time per micro-batch, slept in proportion to its layers' cost), which
makes 4 workers behave like 4 devices; real compute and communication still run. Post-change
throughput is the global batch over the median step time of the steps after the migration.

The runtime reroutes as ReCycle does, but runs the rerouted micro-batches in its own 1F1B
order: ReCycle's two schedule changes (Decoupled BackProp, the Staggered Optimizer) are not in
the runtime. :mod:`bench.recycle` gives the whole of ReCycle's throughput, with ElasWave's,
drop's and the ideal, from the device model of :mod:`bench.pipesim`, whose one free number (a
step's fixed cost) is fitted to this run's ``healthy`` step; the model's ``reshard``, ``drop``
and rerouting alone are then checked against what this run measured. The same model runs the
dp × pp grid (dp = 2, 3, 4 × pp = 2, 4, one and two failures) on a 10-layer model; dp = 3 ×
pp = 2 with one and two failures is also measured (``cells``), beside the model's numbers.

Migration MTTR (async vs blocking) uses a wider model so that the moved state is large enough
to matter (≈40 MB), over loopback as it is and over an emulated slower link
(``train.state_bandwidth``: a receiver waits bytes / bandwidth after its copy lands), where the
copy takes several steps as moving a large model's state does on a real cluster.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import yaml

from bench import recycle
from bench.common import (
    RESULTS_DIR,
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

DESCRIPTION = "dp×pp stage loss: reshard vs drop-the-replica throughput, async vs blocking MTTR"
DEFAULT_REPEAT = 3
STEPS = 30
FAULT_STEP = 8
DEVICE_TIME = 0.15  # emulated accelerator seconds per micro-batch (forward + backward, 4 layers)
VARIANTS = {
    "healthy": [],
    "reshard-async": ["--migration", "async"],
    "reshard-blocking": ["--migration", "blocking"],
    "drop": ["--stage-loss", "drop"],
    "recycle": ["--stage-loss", "recycle"],
}
# dp = 3 × pp = 2, measured: the model's lost slots (replica 0's last stage, then replica 1's
# first: ranks 1 and 2), each policy
CELL_DP = 3
CELL_FAULTS = {1: ("kill,rank=1",), 2: ("kill,rank=1", "kill,rank=2")}
CELL_POLICIES = {"reshard": ["--migration", "async"], "recycle": ["--stage-loss", "recycle"],
                 "drop": ["--stage-loss", "drop"]}  # fmt: skip
WIDE = {"model": {"d_model": 384, "n_layer": 4}, "train": {"global_batch": 8, "steps": 12}}
LINKS = {"loopback": 0.0, "40 MB/s": 40.0}  # train.state_bandwidth of the wide runs (0: off)
LINK_STEPS = 20  # room after the fault for a copy of ~1 s to land and switch
GOAL_VS_DROP = 1.4
GOAL_VS_IDEAL = 0.9
GOAL_VS_RECYCLE = 1.35  # the paper's
GRID = {"dp": (2, 3, 4), "pp": (2, 4), "failures": (1, 2), "per_replica": (8, 32)}
GRID_MODEL = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "n_layer": 8}  # 10 layers


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-pipeline-"))
    env = bench_env(tmp / "state")
    tput_cfg = write_config(
        tmp / "throughput.yaml", config, {"train": {"steps": STEPS, "device_time": DEVICE_TIME}}
    )
    model_input = _model_input(tput_cfg)
    wide_cfgs = {}
    for j, (link, mb_s) in enumerate(LINKS.items()):
        slow = {"state_bandwidth": mb_s, "steps": LINK_STEPS} if mb_s else {}
        train = {**WIDE["train"], **slow}
        wide_cfgs[link] = write_config(tmp / f"wide-{j}.yaml", config, {**WIDE, "train": train})
    fault = ["--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    mttr: dict[str, list[dict[str, Any]]] = {_mode(m, link): [] for link in LINKS
                                             for m in ("async", "blocking")}  # fmt: skip
    cells: dict[str, list[dict[str, Any]]] = {"healthy": []}
    for i in range(1, repeat + 1):
        _run_cells(tput_cfg, tmp, env, i, cells)
        for name, args in VARIANTS.items():
            run_dir = tmp / f"{name}-{i}"
            extra = ["--pp", "2", *args, *([] if name == "healthy" else fault)]
            elaswave_launch(
                tput_cfg, run_dir, f"bench-pp-{name}-{os.getpid()}-{i}", env=env, extra_args=extra
            )
            runs[name].append(_throughput(run_dir, faulted=name != "healthy"))
            console.print(
                f"run {i}/{repeat} {name}: {runs[name][-1]['samples_per_s']:.1f} samples/s"
            )
        for j, link in enumerate(LINKS):
            for mode in ("async", "blocking"):
                run_dir = tmp / f"wide-{mode}-{j}-{i}"
                extra = ["--pp", "2", "--migration", mode, "--fault", "kill,rank=1,at_step=6"]
                elaswave_launch(
                    wide_cfgs[link],
                    run_dir,
                    f"bench-pp-wide-{mode}-{j}-{os.getpid()}-{i}",
                    env=env,
                    extra_args=extra,
                )
                key = _mode(mode, link)
                mttr[key].append(migration_incident(run_dir))
                console.print(f"run {i}/{repeat} wide {key}: MTTR {ms(mttr[key][-1]['mttr_s'])} ms")
    model = _model(model_input, {v: statistics.median(r["median_step_s"] for r in rs)
                                 for v, rs in runs.items()})  # fmt: skip
    cell_table = _cells(cells, model_input, model["overhead_s"])
    shutil.rmtree(tmp, ignore_errors=True)
    tput = {v: summarize(r["samples_per_s"] for r in rs) for v, rs in runs.items()}
    # fault → the first step committed on the new layout, per policy (the throughput runs)
    loss_mttr = {v: summarize(r["mttr_s"] for r in rs) for v, rs in runs.items() if v != "healthy"}
    healthy = tput["healthy"]["median"]
    reshard, drop = tput["reshard-async"]["median"], tput["drop"]["median"]
    rerouted = tput["recycle"]["median"]
    ideal = healthy * 3 / 4 if healthy else None
    ratio_drop = reshard / drop if reshard and drop else None
    ratio_ideal = reshard / ideal if reshard and ideal else None
    mttr_summary = {
        m: {
            k: summarize(r[k] for r in rs)
            for k in ("mttr_s", "migration_s", "state_s", "redo_s", "full_layout_s")
        }
        for m, rs in mttr.items()
    }
    change = {}  # per link: async MTTR / blocking MTTR - 1, by medians
    for link in LINKS:
        a = mttr_summary[_mode("async", link)]["mttr_s"]["median"]
        b = mttr_summary[_mode("blocking", link)]["mttr_s"]["median"]
        change[link] = (a / b - 1.0) if a and b else None
    return {
        "scenario": "pipeline",
        "command": launch_command(
            config, ["--pp", "2", "--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
        ),
        "repeat": repeat,
        "device_time": DEVICE_TIME,
        "runs": runs,
        "mttr_runs": mttr,
        "throughput": tput,
        "ideal_samples_per_s": ideal,
        "reshard_over_drop": ratio_drop,
        "reshard_over_ideal": ratio_ideal,
        "reshard_over_rerouted": reshard / rerouted if reshard and rerouted else None,
        "loss_mttr": loss_mttr,
        "cells": cell_table,
        "mttr": mttr_summary,
        "links_mb_s": LINKS,
        "async_mttr_change": change,
        "model": model,
        "plots": [str(_plot(runs, model, RESULTS_DIR / "pipeline_recycle.png"))],
        "goal": {
            "reshard_over_drop": GOAL_VS_DROP,
            "reshard_over_ideal": GOAL_VS_IDEAL,
            "reshard_over_recycle": GOAL_VS_RECYCLE,
            "met": bool(
                ratio_drop
                and ratio_ideal
                and ratio_drop >= GOAL_VS_DROP
                and ratio_ideal >= GOAL_VS_IDEAL
            ),
        },
    }


def _run_cells(
    config: Path, tmp: Path, env: dict[str, str], i: int, cells: dict[str, list[dict[str, Any]]]
) -> None:
    """One round of the measured dp = 3 × pp = 2 cells: fault-free, then each policy after one
    and after two losses (both at ``FAULT_STEP``)."""
    workers = ["--pp", "2", "--nproc-per-node", str(2 * CELL_DP)]
    jobs: list[tuple[str, list[str]]] = [("healthy", [])]
    for n, kills in CELL_FAULTS.items():
        faults = [a for f in kills for a in ("--fault", f"{f},at_step={FAULT_STEP}")]
        jobs += [(f"{policy} {n}", [*args, *faults]) for policy, args in CELL_POLICIES.items()]
    for name, args in jobs:
        tag = name.replace(" ", "-")
        elaswave_launch(config, tmp / f"cell-{tag}-{i}", f"bench-pp-cell-{tag}-{os.getpid()}-{i}",
                        env=env, extra_args=[*workers, *args])  # fmt: skip
        run_dir = tmp / f"cell-{tag}-{i}"
        cells.setdefault(name, []).append(_throughput(run_dir, faulted=name != "healthy"))
        console.print(f"run {i} dp {CELL_DP} × pp 2 {name}: "
                      f"{cells[name][-1]['samples_per_s']:.1f} samples/s")  # fmt: skip


def _cells(
    cells: dict[str, list[dict[str, Any]]], kw: dict[str, Any], overhead: float
) -> list[dict[str, Any]]:
    """The measured dp = 3 × pp = 2 cells beside the device model's numbers for them (the
    model's fixed cost: the one fitted to dp = 2's healthy step)."""
    healthy = statistics.median(r["samples_per_s"] for r in cells["healthy"])
    out = []
    for n in CELL_FAULTS:
        model = recycle.compare(CELL_DP, 2, n, overhead=overhead, **kw)
        measured = {p: statistics.median(r["samples_per_s"] for r in cells[f"{p} {n}"])
                    for p in CELL_POLICIES}  # fmt: skip
        out.append({
            "dp": CELL_DP, "pp": 2, "failures": n, "healthy": healthy,
            "ideal": healthy * (2 * CELL_DP - n) / (2 * CELL_DP),
            "measured": measured,
            "model": {"reshard": model["samples_per_s"]["reshard"],
                      "reroute": model["recycle_parts_samples_per_s"]["reroute"],
                      "recycle": model["samples_per_s"]["recycle"],
                      "drop": model["samples_per_s"]["drop"]},
            "reshard_over_rerouted": measured["reshard"] / measured["recycle"],
            "reshard_over_recycle_model": measured["reshard"] / model["samples_per_s"]["recycle"],
            "reshard_over_drop": measured["reshard"] / measured["drop"],
        })  # fmt: skip
    return out


def _show_model(result: dict[str, Any]) -> None:
    model, tput = result["model"], result["throughput"]
    here = model["here"]
    rows = [(v, f"{c['measured_s']:.3f}", f"{c['model_s']:.3f}", f"{c['error']:+.1%}")
            for v, c in model["check"].items()]  # fmt: skip
    print_table(f"Device model vs this run (median step, s; fixed cost fitted to healthy: "
                f"{model['overhead_s'] * 1000:.0f} ms)", ("variant", "measured", "model", "error"),
                rows)  # fmt: skip
    parts = here["recycle_parts_samples_per_s"]
    rows = [("ElasWave reshard (measured)", f"{tput['reshard-async']['median']:.1f}"),
            ("ReCycle, reroute only (measured: --stage-loss recycle)",
             f"{tput['recycle']['median']:.1f}"),
            ("drop (measured)", f"{tput['drop']['median']:.1f}")]  # fmt: skip
    rows += [(f"ReCycle {k} (model)", f"{v:.1f}") for k, v in parts.items() if v]
    rows.append(("ideal", f"{here['samples_per_s']['ideal']:.1f}"))
    print_table("After the stage loss, this run's dp=2 × pp=2 (samples/s)", ("policy", "samples/s"),
                rows)  # fmt: skip
    console.print(
        f"ElasWave measured / ReCycle model = "
        f"{model['reshard_measured_over_recycle']:.2f} (goal ≥ {GOAL_VS_RECYCLE})"
    )
    rows = [
        (str(c["failures"]), f"{c['healthy']:.1f}", f"{c['ideal']:.1f}",
         *(f"{c['measured'][p]:.1f} / {c['model'][m]:.1f}"
           for p, m in (("reshard", "reshard"), ("recycle", "reroute"), ("drop", "drop"))),
         f"{c['model']['recycle']:.1f}", f"{c['reshard_over_rerouted']:.2f}",
         f"{c['reshard_over_recycle_model']:.2f}", f"{c['reshard_over_drop']:.2f}")
        for c in result["cells"]
    ]  # fmt: skip
    print_table(f"dp={CELL_DP} × pp=2 measured / model (samples/s)",
                ("lost", "free", "ideal", "ElasWave", "reroute", "drop", "ReCycle (model)",
                 "E / reroute", "E / ReCycle model", "E / drop"), rows)  # fmt: skip
    rows = []
    for g in model["grid"]:
        t, ret = g["samples_per_s"], g["retained"]
        rows.append((
            f"{g['microbatches'] // g['dp']}", f"{g['dp']}×{g['pp']}", str(g["failures"]),
            *(f"{t[k]:.1f}" if t[k] else "—" for k in ("healthy", "reshard", "recycle", "drop",
                                                       "ideal")),
            *(f"{x:.2f}" if x else "—" for x in (g["reshard_over_recycle"],
                                                 g["reshard_over_drop"], ret["reshard"],
                                                 ret["recycle"])),
        ))  # fmt: skip
    print_table("Device model over the grid (10-layer GPT, samples/s after the losses; mb: per "
                "replica, free: fault-free, E: ElasWave reshard, R: ReCycle, D: drop, kept: "
                "over its own fault-free schedule)",
                ("mb", "dp×pp", "lost", "free", "E", "R", "D", "ideal", "E/R", "E/D", "E kept",
                 "R kept"),
                rows)  # fmt: skip


def _model_input(config: Path) -> dict[str, Any]:
    """The job's layer costs (the built-in GPT's estimate), global batch and micro-batches, as
    :func:`bench.recycle.compare` takes them; read before the runs, so a config the model cannot
    take fails at once."""
    from elaswave.runtime.workload.gpt import gpt_layer_costs

    data = yaml.safe_load(config.read_text())
    model, train = data.get("model", {}), data.get("train", {})
    shape = ("vocab_size", "seq_len", "d_model", "n_layer")
    if any(k not in model for k in shape):
        raise BenchError(f"{config}: the model comparison needs the built-in GPT's {shape}")
    batch, size = int(train["global_batch"]), int(train["micro_batch_size"])
    return {"costs": gpt_layer_costs(**{k: int(model[k]) for k in shape}),
            "device_time": DEVICE_TIME, "microbatches": batch // size, "batch": batch}  # fmt: skip


def _model(kw: dict[str, Any], measured: dict[str, float]) -> dict[str, Any]:
    """ReCycle and the grid from the device model: its step's fixed cost fitted to the measured
    ``healthy`` step (median), its ``reshard`` and ``drop`` checked against the measured ones."""
    from elaswave.runtime.workload.gpt import gpt_layer_costs

    batch = kw["batch"]
    size = batch // kw["microbatches"]
    shape = {k: kw[k] for k in ("costs", "device_time", "microbatches")}
    overhead = max(measured["healthy"] - recycle.fault_free_step(2, 2, **shape), 0.0)
    here = recycle.compare(2, 2, 1, overhead=overhead, **kw)
    check = {
        variant: {"model_s": here["step_s"][key], "measured_s": measured[variant],
                  "error": here["step_s"][key] / measured[variant] - 1.0}
        for variant, key in (("reshard-async", "reshard"), ("drop", "drop"),
                             ("recycle", "recycle reroute"))
    }  # fmt: skip
    grid_costs = gpt_layer_costs(**GRID_MODEL)
    grid = [
        recycle.compare(dp, pp, f, costs=grid_costs, device_time=DEVICE_TIME,
                        microbatches=m * dp, batch=m * dp * size, overhead=overhead)
        for m in GRID["per_replica"] for pp in GRID["pp"] for dp in GRID["dp"]
        for f in GRID["failures"]
    ]  # fmt: skip
    measured_reshard = batch / measured["reshard-async"]
    return {
        "batch": batch,
        "overhead_s": overhead,
        "here": here,
        "check": check,
        "reshard_measured_over_recycle": measured_reshard / here["samples_per_s"]["recycle"],
        "grid_model": GRID_MODEL,
        "grid": grid,
    }


def _plot(runs: dict[str, list[dict[str, Any]]], model: dict[str, Any], out: Path) -> Path:
    """Samples/s per step through the fault: the median run of each measured variant, and
    ReCycle's modelled throughput after the fault (before it, the healthy run's)."""
    from bench.crash_plots import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    batch = model["batch"]
    labels = {"healthy": "fault-free", "reshard-async": "ElasWave reshard (async)",
              "recycle": "ReCycle, reroute only (--stage-loss recycle)",
              "drop": "drop the replica (TorchFT's policy)"}  # fmt: skip
    for name, label in labels.items():
        rs = sorted(runs[name], key=lambda r: r["samples_per_s"])
        series = rs[len(rs) // 2]["series"]
        ax.plot([s for s, _ in series], [batch / t if t > 0 else None for _, t in series],
                marker="o", ms=3, lw=1, label=label)  # fmt: skip
    healthy = sorted(runs["healthy"], key=lambda r: r["samples_per_s"])[len(runs["healthy"]) // 2]
    before = [(s, batch / t) for s, t in healthy["series"] if s < FAULT_STEP and t > 0]
    after = model["here"]["samples_per_s"]["recycle"]
    xs = [s for s, _ in before] + [FAULT_STEP + 1, STEPS]
    ax.plot(xs, [v for _, v in before] + [after, after], ls="--", lw=1.5,
            label="ReCycle, all of it (device model after the fault)")  # fmt: skip
    ideal = model["here"]["samples_per_s"]["ideal"]
    ax.axhline(ideal, color="grey", ls=":", lw=1, label="ideal: fault-free × 3/4")
    ax.axvline(FAULT_STEP, color="grey", ls="--", lw=1)
    ax.set_xlabel(f"step (SIGKILL of replica 0's last stage at step {FAULT_STEP})")
    ax.set_ylabel("samples / s")
    ax.set_title("dp=2 × pp=2 through a stage loss (emulated devices)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    return save_figure(fig, plt, out)


def _mode(migration: str, link: str) -> str:
    return migration if link == "loopback" else f"{migration} @ {link}"


def _throughput(run_dir: Path, *, faulted: bool) -> dict[str, Any]:
    """Samples per second over the steps after the change (or after warm-up when healthy)."""
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    steps = [m["step"] for m in metrics]
    if steps != list(range(1, STEPS + 1)):
        raise BenchError(f"{run_dir}: steps lost or duplicated: {steps}")
    start = 4
    if faulted:
        done = [e["step"] for e in events if e["kind"] == "migration_done"]
        start = (max(done) if done else FAULT_STEP) + 2
    window = [m["step_seconds"] for m in metrics if m["step"] >= start and m["step_seconds"] > 0]
    series = [(m["step"], m["step_seconds"]) for m in metrics]
    if len(window) < 5:
        raise BenchError(f"{run_dir}: only {len(window)} steps after the change to measure")
    batch = metrics[-1]["samples"] // metrics[-1]["step"]
    step_s = statistics.median(window)
    return {"from_step": start, "median_step_s": step_s, "samples_per_s": batch / step_s,
            "world_after": metrics[-1]["world_size"], "series": series,
            "mttr_s": migration_incident(run_dir)["mttr_s"] if faulted else None}  # fmt: skip


def migration_incident(*run_dirs: Path) -> dict[str, Any]:
    """The first incident of a stage loss, from a job's run directories (one per host): the
    report's MTTR and phases, the bytes moved, and the fault (``fault_t``) to the full layout."""
    from elaswave.report import build_report

    report = build_report(*run_dirs)
    if report["totals"]["missing_steps"] or report["totals"]["duplicate_steps"]:
        raise BenchError(f"{run_dirs[0]}: steps lost or duplicated")
    inc = report["incidents"][0]
    events = [e for d in run_dirs for e in read_jsonl(d / "events.jsonl")]
    t0 = min(e["t"] for e in events if e["kind"] == "fault_injected")
    done = [e["t"] for e in events if e["kind"] == "migration_done"]
    synced = [e["t"] for e in events if e["kind"] == "state_synced" and e["epoch"] == inc["epoch"]]
    # Fault → every replica back in service on the new layout (async: the switch-over).
    full = (min(done) if done else max(synced)) - t0
    keys = ("mttr_s", "migration_s", "state_s", "redo_s", "state_bytes")
    return {**{k: inc.get(k) for k in keys}, "full_layout_s": round(full, 6), "fault_t": t0}


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, s in result["throughput"].items():
        rows.append((name, f"{s['median']:.1f}", f"{s['min']:.1f}", f"{s['max']:.1f}"))
    rows.append(("ideal (3/4 × healthy)", f"{result['ideal_samples_per_s']:.1f}", "", ""))
    print_table(
        f"Throughput after losing replica 0's stage 1 (dp=2 × pp=2, samples/s, "
        f"{result['repeat']} runs, device_time {result['device_time']} s)",
        ("variant", "median", "min", "max"),
        rows,
    )
    print_table("Crash MTTR of each policy (the same runs), milliseconds",
                ("variant", "median", "min", "max"),
                [(v, ms(m["median"]), ms(m["min"]), ms(m["max"]))
                 for v, m in result.get("loss_mttr", {}).items()])  # fmt: skip
    mrows = []
    for mode, s in result["mttr"].items():
        mrows.append((mode, ms(s["mttr_s"]["median"]), ms(s["state_s"]["median"]),
                      ms(s["migration_s"]["median"]), ms(s["redo_s"]["median"]),
                      ms(s["full_layout_s"]["median"])))  # fmt: skip
    print_table("Migration MTTR (wide model), milliseconds (median)",
                ("migration", "MTTR", "state", "migration", "redo", "fault → full layout"),
                mrows)  # fmt: skip
    _show_model(result)
    goal, r = result["goal"], result
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(
        f"reshard / drop = {r['reshard_over_drop']:.2f} (goal ≥ {goal['reshard_over_drop']}), "
        f"reshard / ideal = {r['reshard_over_ideal']:.2f} (goal ≥ {goal['reshard_over_ideal']}) "
        f"— {verdict}; async MTTR vs blocking: "
        + ", ".join(
            f"{c:+.0%} ({link})" for link, c in r["async_mttr_change"].items() if c is not None
        )
    )
