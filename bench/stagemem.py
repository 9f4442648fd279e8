"""Memory per pipeline rank: what each worker holds at pp = 1, 2, 4 on a ~60 M-parameter
Llama-style model (transformers, random init), 4 workers.

For each pp, one short fault-free launch. Per rank, from the report (``totals.memory``: what
each worker says it holds, by purpose) and from the operating system (peak resident set of each
worker process, sampled while it runs): parameter, gradient, optimizer and recovery-copy bytes,
against the model's size and its stage share (model / pp). The gradient bytes a rank sends per
step are those of a ring all-reduce (2 (k - 1) / k of what k ranks reduce): at pp = 1 the whole
[gradient | tail] buffer over all W ranks; in a pipeline each layer's gradient among its holders,
as each rank reports it (``state_synced``'s ``grad_sent_bytes``). A pipeline rank allocates
only its stage's layers; the goal is (parameters + optimizer) per rank within 1/pp of the
model's + 10 %, reported as the median and the largest ratio over the ranks. The cut holds each
stage's bytes to 1.1 × an even share where it can (``stage_balance``), at a compute cost shown
as its slowest stage over the slowest stage of the cut that balances compute alone.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
    bench_env,
    console,
    print_table,
    read_jsonl,
    write_config,
)

DESCRIPTION = "memory per pipeline rank at pp = 1, 2, 4 (60 M llama): bytes held and peak RSS"
DEFAULT_REPEAT = 1
WORLD = 4
STEPS = 3
PPS = (1, 2, 4)
CONFIG = Path(__file__).with_name("llama-10m.yaml")
MODEL = {  # ~60 M parameters: 2 x 32000 x 512 embeddings + 8 blocks of ~3.4 M
    "hf": {"model_type": "llama", "vocab_size": 32000, "hidden_size": 512,
           "intermediate_size": 1536, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 8, "max_position_embeddings": 256},
}  # fmt: skip
FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "replica_bytes")


def job_config(path: Path, steps: int) -> Path:
    """The job these pipeline benchmarks run: ``MODEL`` on ``WORLD`` workers, ``steps`` steps."""
    return write_config(
        path,
        CONFIG,
        {
            "model": MODEL,
            "train": {"steps": steps, "global_batch": 8, "micro_batch_size": 1},
            "elastic": {"nproc_per_node": WORLD},
        },
    )


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-stagemem-"))
    env = bench_env(tmp / "state")
    cfg = job_config(tmp / "config.yaml", STEPS)
    model = _model_bytes(cfg)
    cells = {}
    for pp in PPS:
        for i in range(1, repeat + 1):
            run_dir = tmp / f"pp{pp}-{i}"
            peaks = _launch(cfg, run_dir, f"bench-stagemem-{os.getpid()}-{pp}-{i}", pp, env)
            cells.setdefault(str(pp), []).append(_cell(run_dir, peaks, pp, model))
            c = cells[str(pp)][-1]
            console.print(
                f"pp={pp} run {i}/{repeat}: params {c['param_mb']:.1f} MB / rank "
                f"(stage share {c['stage_share_mb']:.1f}), peak RSS {c['peak_rss_mb']:.0f} MB"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    return {
        "scenario": "stagemem",
        "command": "python -m bench stagemem",
        "world": WORLD,
        "model": MODEL,
        "cells": cells,
    }


def _launch(
    cfg: Path,
    run_dir: Path,
    job_id: str,
    pp: int,
    env: dict[str, str],
    extra_args: Sequence[str] = (),
) -> list[int]:
    """Run the job; the peak resident bytes of each worker process (sampled every 0.1 s)."""
    cmd = [sys.executable, "-m", "elaswave", "launch", str(cfg), "--run-dir", str(run_dir),
           "--job-id", job_id, "--pp", str(pp), *extra_args, "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    peaks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        import psutil

        while not done.is_set():
            events = run_dir / "events.jsonl"
            pids = (
                [e["pid"] for e in read_jsonl(events) if e["kind"] == "worker_spawned"]
                if events.exists()
                else []
            )
            for pid in pids:
                try:
                    rss = psutil.Process(pid).memory_info().rss
                except psutil.Error:
                    continue
                peaks[pid] = max(peaks.get(pid, 0), rss)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate(timeout=1800)
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-2000:]}")
    return list(peaks.values())


def _model_bytes(cfg: Path) -> int:
    """The whole model's float32 parameter bytes."""
    from elaswave.config import load_config
    from elaswave.runtime.workload.load import build_model

    return 4 * sum(n for _, n in build_model(load_config(cfg, env={})).segments())


def _cell(run_dir: Path, peaks: list[int], pp: int, model: int) -> dict[str, Any]:
    from elaswave.report import build_report

    memory = build_report(run_dir)["totals"]["memory"]
    if len(memory) != WORLD:
        raise BenchError(f"{run_dir}: {len(memory)} workers reported their memory, not {WORLD}")
    per_field = {f: statistics.median(m[f] for m in memory.values()) for f in FIELDS}
    # the step's reduction buffer (float32): the gradient bytes beside the parameters' own
    buffer = statistics.median(m["grad_bytes"] - m["param_bytes"] for m in memory.values())
    ratios = [(m["param_bytes"] + m["optimizer_bytes"]) / (3 * model / pp) for m in memory.values()]
    mb = 1 / 2**20
    return {
        **{f.replace("_bytes", "_mb"): v * mb for f, v in per_field.items()},
        "model_mb": model * mb,
        "stage_share_mb": model / pp * mb,
        "param_plus_optimizer_over_share": statistics.median(ratios),
        "param_plus_optimizer_over_share_max": max(ratios),
        "peak_rss_mb": statistics.median(peaks) * mb if peaks else 0.0,
        "peak_rss_max_mb": max(peaks) * mb if peaks else 0.0,
        "grad_sent_mb_per_step": _grad_sent(run_dir, pp, buffer) * mb,
        "compute_cost": _compute_cost(run_dir, pp),
    }


def _compute_cost(run_dir: Path, pp: int) -> float:
    """The first plan's slowest stage over the slowest stage of a compute-only cut (its layer
    costs as the plan used them): what bounding the bytes cost in speed (1.0: nothing)."""
    from elaswave.planning.partition import partition_layers

    if pp == 1:
        return 1.0
    events = read_jsonl(run_dir / "events.jsonl")
    plan = next(e for e in events if e["kind"] == "plan_published")
    costs, cut = plan["layer_costs"], plan["bounds"][0]
    slowest = max(sum(costs[a:b]) for a, b in zip(cut, cut[1:], strict=False))
    return slowest / partition_layers(costs, [1.0] * pp).bottleneck


def _grad_sent(run_dir: Path, pp: int, buffer: float) -> float:
    """Bytes of gradient a rank sends per step (median over ranks)."""
    if pp == 1:  # data parallelism: one all-reduce of the whole buffer over every rank
        return 2 * (WORLD - 1) / WORLD * buffer
    synced = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "state_synced"]
    last = {e["worker"]: e["grad_sent_bytes"] for e in synced}  # the plan in force at the end
    return statistics.median(last.values())


def show(result: dict[str, Any]) -> None:
    rows = []
    for pp, cells in result["cells"].items():
        c = {k: statistics.median(x[k] for x in cells) for k in cells[0]}
        rows.append(
            (pp, f"{c['param_mb']:.1f}", f"{c['stage_share_mb']:.1f}", f"{c['grad_mb']:.1f}",
             f"{c['optimizer_mb']:.1f}", f"{c['replica_mb']:.1f}",
             f"{c['param_plus_optimizer_over_share']:.2f}",
             f"{c['param_plus_optimizer_over_share_max']:.2f}", f"{c['peak_rss_mb']:.0f}",
             f"{c['grad_sent_mb_per_step']:.1f}", f"{c['compute_cost']:.2f}")
        )  # fmt: skip
    print_table(
        f"Memory per rank, {result['world']} workers (MB, median over ranks)",
        ("pp", "params", "model / pp", "grads", "optimizer", "recovery copies",
         "(params+opt)/(model x 3 / pp)", "largest", "peak RSS", "grad sent/step",
         "slowest stage / compute-only cut"),
        rows,
    )  # fmt: skip
