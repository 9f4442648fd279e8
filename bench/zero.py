"""ZeRO-1: what the spread snapshots and verification cost per step, and what a shard recovery
moves.

**Overhead** (fault-free, ``STEPS`` steps, 4 workers; per round in this order): replicated DP
(``--zero 0``), ZeRO-1 without snapshots, with a snapshot every step, every 4 steps, with
snapshots + checksum verification every 10 steps (the ``--zero 1`` defaults), and plain DDP.
Metric as in :mod:`bench.overhead`: median wall interval per step after ``WARMUP`` steps; the
mean too, as a median skips verification (1 step in 10). **Shard recovery** (per round, W in
``WORLDS``): rank 1 SIGKILLed at step 10. From the ``state_synced`` events of the epoch that
answered the fault (each rank reports the plan's totals): bytes moved over the network, bytes
promoted locally (replica pieces that become owned), pairs, transfers, ``max_over_mean``
(largest per-rank recovery volume — sent + received + promoted — over the mean; 1.0 =
balanced), the slowest rank's ``transfer_s``; and MTTR.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
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

DESCRIPTION = "ZeRO-1: snapshot + verification step cost vs DDP; shard recovery at 2/4/8 workers"
DEFAULT_REPEAT = 3
STEPS = 40
WARMUP = 5  # step intervals skipped, as in bench.overhead
WORLD = 4
GOAL_RATIO = 1.05  # snapshots + verification vs ZeRO-1 without them
RECOVERY_STEPS = 20
FAULT = "kill,rank=1,at_step=10"
WORLDS = (2, 4, 8)
VARIANTS: dict[str, tuple[str, list[str] | None]] = {
    "replicated": ("ElasWave replicated DP (--zero 0)", ["--zero", "0"]),
    "zero": ("ZeRO-1, no snapshots, no verification",
             ["--zero", "1", "--snapshot-every", "0", "--verify-every", "0"]),
    "zero_snap": ("ZeRO-1 + snapshots", ["--zero", "1", "--snapshot-every", "1",
                                         "--verify-every", "0"]),
    "zero_snap4": ("ZeRO-1 + snapshots every 4 steps", ["--zero", "1", "--snapshot-every", "4",
                                                        "--verify-every", "0"]),
    "zero_snap_verify": ("ZeRO-1 + snapshots + verify/10 (defaults)", ["--zero", "1"]),
    "ddp": ("PyTorch DDP", None),
}  # fmt: skip
PAIRS = (("zero_snap_verify", "zero"), ("zero_snap", "zero"), ("zero_snap4", "zero"),
         ("zero_snap_verify", "ddp"), ("zero", "replicated"))  # same-round ratios  # fmt: skip
RECOVERY_FIELDS = ("bytes", "promoted_bytes", "lost_shard_bytes", "pairs", "transfers",
                   "max_over_mean", "transfer_max_s", "sync_max_s", "state_s",
                   "mttr_s")  # fmt: skip


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.config import load_config

    workers = load_config(config, env={}).elastic.nproc_per_node
    assert workers == WORLD, f"{config}: expected {WORLD} workers"
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-zero-"))
    env = bench_env(tmp / "state")
    rounds: list[dict[str, Any]] = []
    for r in range(1, repeat + 1):
        row = {}
        for name, (_, args) in VARIANTS.items():
            began = time.perf_counter()
            row[name] = _step_times(name, args, config, tmp / f"r{r}-{name}", env, r)
            console.print(
                f"round {r}/{repeat} {name:>16}: {ms(row[name]['step_median_s'])} ms/step "
                f"(mean {ms(row[name]['step_mean_s'])}; run {time.perf_counter() - began:.0f} s"
                f"{'; ranks killed at exit' if row[name]['exit_code'] else ''})"
            )
        ref = row["replicated"]["loss"]
        for name in VARIANTS:
            pairs = zip(ref, row[name]["loss"], strict=True)
            row[name]["loss_diff_vs_replicated"] = max(abs(a - b) for a, b in pairs)
        rounds.append(row)
    recoveries: dict[str, list[dict[str, Any]]] = {str(w): [] for w in WORLDS}
    for r in range(1, repeat + 1):
        for world in WORLDS:
            rec = _recovery(config, world, tmp / f"rec{r}-w{world}", env, r)
            recoveries[str(world)].append(rec)
            console.print(
                f"recovery round {r}/{repeat} W={world}: {rec['bytes']} B in "
                f"{rec['transfers']} transfers, {rec['promoted_bytes']} B promoted, "
                f"max/mean {rec['max_over_mean']:.3f}, "
                f"MTTR {ms(rec['mttr_s'])} ms"
            )
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    keys = ("step_median", "step_mean", "in_step_median")
    summary = {n: {k: summarize(x[n][f"{k}_s"] for x in rounds) for k in keys} for n in VARIANTS}
    med = {name: summary[name]["step_median"]["median"] for name in VARIANTS}
    mean = {name: summary[name]["step_mean"]["median"] for name in VARIANTS}
    paired = {
        f"{a}/{b}": summarize(row[a]["step_median_s"] / row[b]["step_median_s"] for row in rounds)
        for a, b in PAIRS
    }
    snap_ratio = med["zero_snap_verify"] / med["zero"]
    commands = {n: launch_command(config, ["--steps", str(STEPS), *a])
                for n, (_, a) in VARIANTS.items() if a is not None}  # fmt: skip
    commands["ddp"] = "bench.ddp_baseline.run_ddp (torch.multiprocessing.spawn, 4 gloo ranks)"
    commands["recovery"] = launch_command(config, _recovery_args("W"))
    return {
        "scenario": "zero",
        "commands": commands,
        "repeat": repeat,
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "world": WORLD,
        "variants": {name: label for name, (label, _) in VARIANTS.items()},
        "rounds": rounds,
        "summary": summary,
        "ratios": {
            "snap_verify_vs_zero": snap_ratio,
            "snap_verify_vs_ddp": med["zero_snap_verify"] / med["ddp"],
            "snap_verify_vs_zero_mean": mean["zero_snap_verify"] / mean["zero"],
            "snap_verify_vs_ddp_mean": mean["zero_snap_verify"] / mean["ddp"],
        },
        "ratios_paired": paired,
        "max_abs_loss_diff_vs_replicated": max(
            row[n]["loss_diff_vs_replicated"] for row in rounds for n in VARIANTS
        ),
        "recovery": {
            "steps": RECOVERY_STEPS,
            "fault": FAULT,
            "runs": recoveries,
            "summary": {
                w: {f: summarize(x[f] for x in runs) for f in RECOVERY_FIELDS}
                for w, runs in recoveries.items()
            },
        },
        "goal": {"snap_verify_vs_zero_max": GOAL_RATIO, "met": snap_ratio <= GOAL_RATIO},
    }


def _step_times(
    name: str, args: list[str] | None, config: Path, out: Path, env: dict[str, str], r: int
) -> dict[str, Any]:
    out.mkdir()
    exit_code = 0  # an ElasWave launch that fails raises
    if args is None:
        raw = _ddp(config, out)
        ends, inner, loss = raw["step_ends"][WARMUP:], raw["step_seconds"], raw["loss"]
        exit_code = raw["exit_code"]  # -9: ranks killed after writing results (see _ddp)
    else:
        job_id = f"bench-zero-{os.getpid()}-{r}-{name.replace('_', '-')}"
        extra = ["--steps", str(STEPS), *args]
        elaswave_launch(config, out / "run", job_id, env=env, extra_args=extra)
        metrics = sorted(read_jsonl(out / "run" / "metrics.jsonl"), key=lambda m: m["step"])
        if [m["step"] for m in metrics] != list(range(1, STEPS + 1)):
            raise BenchError(f"{out}: steps missing or duplicated")
        _check_mode(out / "run", zero=args[1] == "1")
        ends = [m["time"] for m in metrics][WARMUP - 1 :]  # metrics start at step 1
        inner, loss = [m["step_seconds"] for m in metrics], [m["loss"] for m in metrics]
    steady = diffs(ends)
    assert len(steady) == STEPS - WARMUP
    return {
        "step_median_s": statistics.median(steady),
        "step_mean_s": statistics.fmean(steady),
        "in_step_median_s": statistics.median(inner[WARMUP:]),
        "intervals_s": steady,
        "loss": loss,
        "exit_code": exit_code,
    }


def _ddp(config: Path, out: Path, timeout: float = 300.0, grace: float = 20.0) -> dict[str, Any]:
    """:func:`run_ddp` in its own process group. Its ranks can deadlock at exit (gloo's process
    group destructor joins a thread that waits for the GIL): ``grace`` s after the results are
    written, ranks still running are killed; without results after ``timeout`` s, the run fails."""
    code = "import sys; from pathlib import Path; from bench.ddp_baseline import run_ddp; " + (
        f"run_ddp(Path(sys.argv[1]), steps={STEPS}, world={WORLD}, out_dir=Path(sys.argv[2]))"
    )
    result, log = out / "ddp.json", out / "ddp.log"
    with log.open("w") as fh:
        cmd = [sys.executable, "-c", code, str(config), str(out)]
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, start_new_session=True, stdout=fh, stderr=fh)
        deadline, written = time.monotonic() + timeout, 0.0
        while proc.poll() is None:
            written = written or (time.monotonic() if result.exists() else 0.0)
            if time.monotonic() > (written + grace if written else deadline):
                os.killpg(proc.pid, signal.SIGKILL)  # the spawned ranks too
                proc.wait()
            time.sleep(0.2)
    if not result.exists():
        raise BenchError(f"DDP baseline in {out}: no results (exit {proc.returncode}); see {log}")
    return {**json.loads(result.read_text()), "exit_code": proc.returncode}


def _check_mode(run_dir: Path, zero: bool) -> None:
    """The launch really ran the asked optimizer mode (ZeRO's sync reports ``max_over_mean``)."""
    synced = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "state_synced"]
    if not synced or any(("max_over_mean" in e) != zero for e in synced):
        raise BenchError(f"{run_dir}: expected zero={zero}, events say otherwise")


def _recovery_args(world: int | str) -> list[str]:
    return ["--steps", str(RECOVERY_STEPS), "--zero", "1", "--nproc-per-node", str(world),
            "--fault", FAULT]  # fmt: skip


def _recovery(config: Path, world: int, out: Path, env: dict[str, str], r: int) -> dict[str, Any]:
    from elaswave.report import build_report

    job_id = f"bench-zero-{os.getpid()}-rec{r}-w{world}"
    began, ended = elaswave_launch(config, out, job_id, env=env, extra_args=_recovery_args(world))
    report = build_report(out)
    totals, incidents = report["totals"], report["incidents"]
    complete = totals["last_step"] == RECOVERY_STEPS
    if totals["duplicate_steps"] or totals["missing_steps"] or not complete:
        raise BenchError(f"{out}: steps lost or duplicated: {totals}")
    if len(incidents) != 1 or incidents[0]["mttr_s"] is None:
        raise BenchError(f"{out}: expected one recovered incident, got {incidents}")
    inc = incidents[0]
    events = read_jsonl(out / "events.jsonl")
    synced = [e for e in events if e["kind"] == "state_synced" and e.get("epoch") == inc["epoch"]]
    if len(synced) != world - 1 or len({(e["bytes"], e["transfers"]) for e in synced}) != 1:
        raise BenchError(f"{out}: expected {world - 1} agreeing state_synced events, got {synced}")
    first = synced[0]
    return {
        "bytes": first["bytes"],
        "promoted_bytes": first["promoted_bytes"],
        "lost_shard_bytes": _lost_shard_bytes(config, world),
        "pairs": first["pairs"],
        "transfers": first["transfers"],
        "max_over_mean": first["max_over_mean"],
        "transfer_max_s": max(e.get("transfer_s", 0.0) for e in synced),
        "sync_max_s": max(e["seconds"] for e in synced),
        "state_s": inc["state_s"],
        "mttr_s": inc["mttr_s"],
        "resume_step": first["resume_step"],
        "launch_s": round(ended - began, 3),
    }


def _lost_shard_bytes(config: Path, world: int) -> int:
    """Size of old rank 1's shard (both Adam moments): what the dead worker held."""
    from elaswave.config import load_config
    from elaswave.planning.shards import ShardLayout
    from elaswave.runtime.workload.load import build_model

    segments = build_model(load_config(config, env={})).segments()
    return ShardLayout.even(segments, world).shard_size(1) * 8


def show(result: dict[str, Any]) -> None:
    rows = []
    for name in VARIANTS:
        s, label = result["summary"][name], result["variants"][name]
        spread = f"{ms(s['step_median']['min'])}–{ms(s['step_median']['max'])}"
        rows.append((label, ms(s["step_median"]["median"]), spread,
                     ms(s["step_mean"]["median"]), ms(s["in_step_median"]["median"])))  # fmt: skip
    print_table(
        f"ZeRO-1 step time, {result['world']} workers, {result['repeat']} interleaved rounds "
        f"(median of per-round medians, steps {result['warmup_steps'] + 1}–{result['steps']}), ms",
        ("variant", "ms/step", "spread", "mean", "in-step"),
        rows,
    )
    for a, b in PAIRS:
        s = result["ratios_paired"][f"{a}/{b}"]
        console.print(f"paired (same-round) ratio {a}/{b}: median {s['median']:.3f}, "
                      f"range {s['min']:.3f}–{s['max']:.3f}")  # fmt: skip
    ratios, goal = result["ratios"], result["goal"]
    verdict = "[green]met[/green]" if goal["met"] else "[red]NOT met[/red]"
    console.print(
        f"goal: snapshots + verification / without <= {goal['snap_verify_vs_zero_max']:g} — "
        f"{verdict} ({ratios['snap_verify_vs_zero']:.3f}; on means "
        f"{ratios['snap_verify_vs_zero_mean']:.3f}); vs DDP {ratios['snap_verify_vs_ddp']:.3f} "
        f"(means {ratios['snap_verify_vs_ddp_mean']:.3f}); max |loss diff| vs replicated "
        f"{result['max_abs_loss_diff_vs_replicated']:.2e}"
    )
    rec = result["recovery"]
    rows = []
    for world in WORLDS:
        s = rec["summary"][str(world)]
        mttr = s["mttr_s"]
        rows.append(
            (f"{world}→{world - 1}", f"{s['bytes']['median'] / 1e6:.2f}",
             f"{s['promoted_bytes']['median'] / 1e6:.2f}",
             f"{s['lost_shard_bytes']['median'] / 1e6:.2f}", f"{s['pairs']['median']:g}",
             f"{s['transfers']['median']:g}", f"{s['max_over_mean']['median']:.3f}",
             ms(s["transfer_max_s"]["median"]), ms(mttr["median"]),
             f"{ms(mttr['min'], 0)}–{ms(mttr['max'], 0)}")
        )  # fmt: skip
    print_table(
        f"ZeRO-1 shard recovery ({rec['fault']}, {rec['steps']} steps), medians over "
        f"{result['repeat']} runs",
        ("W", "moved\nMB", "promoted\nMB", "lost\nMB", "pairs", "xfers", "max/\nmean",
         "xfer\nms", "MTTR\nms", "spread"),
        rows,
    )  # fmt: skip
