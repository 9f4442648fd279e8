"""ZeRO-1 and ZeRO-3 inside pipeline stages vs replicated stage state, dp=3 × pp=2 (6 workers).

All variants run the same wide model, data and batch, with rank 1 (replica 0's last stage)
SIGKILLed mid-run; replicated and ZeRO state, each with asynchronous and blocking migration.
Per run:

- optimizer-state bytes a rank keeps current: ZeRO keeps two copies of every moment element
  among a layer's k = 3 holders (2/3 of its stage), replicated stages keep all of it;
- fault-free step time: the median of the steps before the fault (ZeRO adds the parameter
  gather after every update and saves the update of 1/3 of the elements);
- MTTR of the loss and the state bytes moved to recover;
- the cost of online verification (a CRC of every kept unit after each update, a check every
  10 steps): ZeRO async with and without it;
- ZeRO-3 (blocking: it moves only kept parts): the parameter bytes a rank keeps between steps
  (its parts', 2/3 of its stage) against ZeRO-1's (the whole stage), step time and MTTR.

Devices are emulated with ``train.device_time`` as in ``bench pipeline`` (6 workers share 2
cores), so the step time shows communication and update costs rather than CPU contention.
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

DESCRIPTION = "dp=3×pp=2: ZeRO-1/3 inside stages vs replicated — state bytes, step time, MTTR"
DEFAULT_REPEAT = 3
STEPS = 14
FAULT_STEP = 9
DEVICE_TIME = 0.05
WIDE = {
    "model": {"d_model": 384, "n_layer": 4},
    "train": {"global_batch": 12, "steps": STEPS, "device_time": DEVICE_TIME},
    "elastic": {"nproc_per_node": 6},
}
COMMON = ["--pp", "2", "--fault", f"kill,rank=1,at_step={FAULT_STEP}"]
VARIANTS = {
    "replicated-async": ["--migration", "async"],
    "zero-async": ["--zero", "1", "--migration", "async"],
    "replicated-blocking": ["--migration", "blocking"],
    "zero-blocking": ["--zero", "1", "--migration", "blocking"],
    "zero-async-noverify": ["--zero", "1", "--migration", "async", "--verify-every", "0"],
    "zero3-blocking": ["--zero", "3", "--migration", "blocking"],
}


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-stagezero-"))
    env = bench_env(tmp / "state")
    cfg = write_config(tmp / "wide.yaml", config, WIDE)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i in range(1, repeat + 1):
        for name, args in VARIANTS.items():
            run_dir = tmp / f"{name}-{i}"
            job = f"bench-sz-{name}-{os.getpid()}-{i}"
            elaswave_launch(cfg, run_dir, job, env=env, extra_args=[*COMMON, *args])
            runs[name].append(_measure(run_dir, cfg))
            r = runs[name][-1]
            console.print(
                f"run {i}/{repeat} {name}: step {ms(r['step_s'])} ms, MTTR {ms(r['mttr_s'])} ms"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    keys = (
        "step_s", "mttr_s", "moved_bytes", "state_bytes_per_rank", "param_bytes_per_rank",
        "held_bytes_per_rank",
    )  # fmt: skip
    summary = {v: {k: summarize(r[k] for r in rs) for k in keys} for v, rs in runs.items()}

    def ratio(
        key: str, mode: str = "async", zero: str = "zero", other: str = "replicated"
    ) -> float | None:
        a = summary[f"{zero}-{mode}"][key]["median"]
        b = summary[f"{other}-{mode}"][key]["median"]
        return a / b if a and b else None

    def zero3(key: str) -> float | None:  # ZeRO-3 against ZeRO-1, both blocking
        return ratio(key, "blocking", "zero3", "zero")

    return {
        "scenario": "stagezero",
        "command": launch_command(cfg, [*COMMON, "--zero", "1"]),
        "bench_command": "python -m bench stagezero --repeat 3",
        "repeat": repeat,
        "device_time": DEVICE_TIME,
        "runs": runs,
        "summary": summary,
        "state_ratio": ratio("state_bytes_per_rank"),
        "step_ratio": ratio("step_s"),
        "mttr_ratio": ratio("mttr_s"),
        "mttr_ratio_blocking": ratio("mttr_s", "blocking"),
        "zero3_param_ratio": zero3("param_bytes_per_rank"),
        "zero3_held_ratio": zero3("held_bytes_per_rank"),
        "zero3_step_ratio": zero3("step_s"),
        "zero3_mttr_ratio": zero3("mttr_s"),
        "verify_cost": (
            summary["zero-async"]["step_s"]["median"]
            / summary["zero-async-noverify"]["step_s"]["median"]
        ),
    }


def _measure(run_dir: Path, cfg: Path) -> dict[str, Any]:
    from elaswave.report import build_report

    report = build_report(run_dir)
    if report["totals"]["missing_steps"] or report["totals"]["duplicate_steps"]:
        raise BenchError(f"{run_dir}: steps lost or duplicated")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    window = [m["step_seconds"] for m in metrics if 2 <= m["step"] < FAULT_STEP]
    if len(window) < 4 or any(s <= 0 for s in window):
        raise BenchError(f"{run_dir}: too few fault-free steps to measure")
    synced = [e for e in events if e["kind"] == "state_synced"]
    first = min(e["epoch"] for e in synced)
    start = [e for e in synced if e["epoch"] == first]
    # Optimizer state a rank keeps current at the start: the kept moments (ZeRO; ZeRO-3's store
    # keeps the parameters beside them: two of its three 4-byte arrays), or both moments of
    # every element of its stage (replicated; 4-byte floats).
    memory = [e for e in events if e["kind"] == "memory" and e["epoch"] == first]
    zero3 = any(e["gathered_bytes"] for e in memory)
    share = 2 / 3 if zero3 else 1.0
    per_rank = [e["moment_bytes"] * share if "moment_bytes" in e else None for e in start]
    if None in per_rank:
        per_rank = [8 * _stage_elements(cfg, e["layers"]) for e in start]
    inc = report["incidents"][0]
    # The whole layout change's volume (every rank reports the same totals).
    change = next(e for e in synced if e["epoch"] == inc["epoch"])
    if "bytes" in change:  # replicated: layers with both moments
        moved = change["bytes"]
    else:  # ZeRO: parameter pieces and moment pieces (two moments each; ZeRO-3: and params)
        moved = 4 * change["param_elements"] + (12 if zero3 else 8) * change["moment_elements"]
    return {
        "step_s": statistics.median(window),
        "mttr_s": inc["mttr_s"],
        "moved_bytes": moved,
        "state_bytes_per_rank": statistics.mean(per_rank),
        # parameters a rank keeps between steps (ZeRO-3: its parts'; else its whole stage)
        "param_bytes_per_rank": statistics.mean(e["param_bytes"] for e in memory),
        # everything it keeps between steps: parameters, gradients and the reduction buffer,
        # optimizer state, the pre-update copy a rollback restores
        "held_bytes_per_rank": statistics.mean(
            sum(e[k] for k in ("param_bytes", "grad_bytes", "optimizer_bytes", "replica_bytes"))
            for e in memory
        ),
    }


def _stage_elements(cfg: Path, layers: list[int]) -> int:
    """Parameter elements of layers ``layers[0]:layers[1]`` of the benchmark's model."""
    from elaswave.config import load_config
    from elaswave.runtime.workload.load import build_model

    segments = build_model(load_config(cfg, env={})).segments()
    return sum(length for _, length in segments[layers[0] : layers[1]])


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, s in result["summary"].items():
        rows.append((
            name,
            f"{s['state_bytes_per_rank']['median'] / 1e6:.2f}",
            ms(s["step_s"]["median"]),
            f"{ms(s['step_s']['min'])}–{ms(s['step_s']['max'])}",
            ms(s["mttr_s"]["median"]),
            f"{s['moved_bytes']['median'] / 1e6:.2f}",
            f"{s['param_bytes_per_rank']['median'] / 1e6:.2f}",
            f"{s['held_bytes_per_rank']['median'] / 1e6:.2f}",
        ))  # fmt: skip
    print_table(
        f"ZeRO-1 and ZeRO-3 inside stages, dp=3 × pp=2 ({result['repeat']} runs, medians, "
        f"device_time {result['device_time']} s)",
        (
            "variant",
            "opt. state MB/rank",
            "step ms",
            "range",
            "MTTR ms",
            "moved MB",
            "params MB/rank between steps",
            "all MB/rank between steps",
        ),
        rows,
    )
    r = result
    console.print(
        f"zero / replicated: optimizer state {r['state_ratio']:.3f}, "
        f"step time {r['step_ratio']:.3f}, MTTR {r['mttr_ratio']:.3f} (async) / "
        f"{r['mttr_ratio_blocking']:.3f} (blocking); CRC records + checks every 10 steps vs "
        f"none: step time {r['verify_cost']:.3f}"
    )
    console.print(
        f"zero3 / zero (blocking): parameters kept between steps {r['zero3_param_ratio']:.3f}, "
        f"everything kept between steps {r['zero3_held_ratio']:.3f}, "
        f"step time {r['zero3_step_ratio']:.3f}, MTTR {r['zero3_mttr_ratio']:.3f}"
    )
