"""Pipelines after a stage loss: ElasWave's reshard vs dropping the replica, async vs blocking.

dp=2 × pp=2 (4 workers), rank 1 (replica 0's last stage) SIGKILLed mid-run. Variants, run
interleaved in each repetition on the same model, data and batch:

- ``healthy``: no fault (the original throughput);
- ``reshard-async``: replica 0's surviving stage takes over every layer, copied in the
  background while replica 1 runs the whole batch (ElasWave's default);
- ``reshard-blocking``: the same layout, layers copied before training resumes;
- ``drop``: replica 0 is taken out of service (TorchFT's policy) and replica 1 runs it all.

Throughput: 4 processes on 2 cores would share the CPU, so a dead worker would *free* capacity
instead of removing it. Each worker therefore emulates its device with ``train.device_time``
(seconds of accelerator time per micro-batch, slept in proportion to its layers' cost), which
makes 4 workers behave like 4 devices; real compute and communication still run. Post-change
throughput is the global batch over the median step time of the steps after the migration.

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
}
WIDE = {"model": {"d_model": 384, "n_layer": 4}, "train": {"global_batch": 8, "steps": 12}}
LINKS = {"loopback": 0.0, "40 MB/s": 40.0}  # train.state_bandwidth of the wide runs (0: off)
LINK_STEPS = 20  # room after the fault for a copy of ~1 s to land and switch
GOAL_VS_DROP = 1.4
GOAL_VS_IDEAL = 0.9


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-pipeline-"))
    env = bench_env(tmp / "state")
    tput_cfg = write_config(
        tmp / "throughput.yaml", config, {"train": {"steps": STEPS, "device_time": DEVICE_TIME}}
    )
    wide_cfgs = {}
    for j, (link, mb_s) in enumerate(LINKS.items()):
        slow = {"state_bandwidth": mb_s, "steps": LINK_STEPS} if mb_s else {}
        train = {**WIDE["train"], **slow}
        wide_cfgs[link] = write_config(tmp / f"wide-{j}.yaml", config, {**WIDE, "train": train})
    fault = ["--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    mttr: dict[str, list[dict[str, Any]]] = {_mode(m, link): [] for link in LINKS
                                             for m in ("async", "blocking")}  # fmt: skip
    for i in range(1, repeat + 1):
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
                mttr[key].append(_incident(run_dir))
                console.print(f"run {i}/{repeat} wide {key}: MTTR {ms(mttr[key][-1]['mttr_s'])} ms")
    shutil.rmtree(tmp, ignore_errors=True)
    tput = {v: summarize(r["samples_per_s"] for r in rs) for v, rs in runs.items()}
    healthy = tput["healthy"]["median"]
    reshard, drop = tput["reshard-async"]["median"], tput["drop"]["median"]
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
        "mttr": mttr_summary,
        "links_mb_s": LINKS,
        "async_mttr_change": change,
        "goal": {
            "reshard_over_drop": GOAL_VS_DROP,
            "reshard_over_ideal": GOAL_VS_IDEAL,
            "met": bool(
                ratio_drop
                and ratio_ideal
                and ratio_drop >= GOAL_VS_DROP
                and ratio_ideal >= GOAL_VS_IDEAL
            ),
        },
    }


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
    if len(window) < 5:
        raise BenchError(f"{run_dir}: only {len(window)} steps after the change to measure")
    batch = metrics[-1]["samples"] // metrics[-1]["step"]
    step_s = statistics.median(window)
    return {"from_step": start, "median_step_s": step_s, "samples_per_s": batch / step_s,
            "world_after": metrics[-1]["world_size"]}  # fmt: skip


def _incident(run_dir: Path) -> dict[str, Any]:
    from elaswave.report import build_report

    report = build_report(run_dir)
    if report["totals"]["missing_steps"] or report["totals"]["duplicate_steps"]:
        raise BenchError(f"{run_dir}: steps lost or duplicated")
    inc = report["incidents"][0]
    events = read_jsonl(run_dir / "events.jsonl")
    t0 = min(e["t"] for e in events if e["kind"] == "fault_injected")
    done = [e["t"] for e in events if e["kind"] == "migration_done"]
    synced = [e["t"] for e in events if e["kind"] == "state_synced" and e["epoch"] == inc["epoch"]]
    # Fault → every replica back in service on the new layout (async: the switch-over).
    full = (min(done) if done else max(synced)) - t0
    keys = ("mttr_s", "migration_s", "state_s", "redo_s", "state_bytes")
    return {**{k: inc.get(k) for k in keys}, "full_layout_s": round(full, 6)}


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
    mrows = []
    for mode, s in result["mttr"].items():
        mrows.append((mode, ms(s["mttr_s"]["median"]), ms(s["state_s"]["median"]),
                      ms(s["migration_s"]["median"]), ms(s["redo_s"]["median"]),
                      ms(s["full_layout_s"]["median"])))  # fmt: skip
    print_table("Migration MTTR (wide model), milliseconds (median)",
                ("migration", "MTTR", "state", "migration", "redo", "fault → full layout"),
                mrows)  # fmt: skip
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
