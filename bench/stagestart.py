"""Start-up of a pipeline job: launch → the first committed step, and each worker's peak resident
memory before that step, at pp = 4 on the ~60 M-parameter Llama of ``stagemem`` (4 workers, one
stage each).

A pipeline worker learns its stage from its first plan. Before it, it needs the model's layout
(every layer's shapes), not its values: the layers it will not hold are built on the meta device
(no memory, no initialisation), and the held ones are built when the plan arrives. ``--tree DIR``
adds the same runs from another checkout (an earlier commit, for the before/after comparison; its
launch runs with ``PYTHONPATH=DIR``), interleaved round by round.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    REPO_ROOT,
    BenchError,
    bench_env,
    console,
    earlier_tree,
    print_table,
    read_jsonl,
    summarize,
)
from bench.stagemem import job_config

DESCRIPTION = "pipeline start-up at pp = 4 (60 M llama): launch → first step, peak RSS before it"
DEFAULT_REPEAT = 3
PP = 4
STEPS = 2


def run(repeat: int, config: Path, tree: Path | None = None) -> dict[str, Any]:
    modes: dict[str, dict[str, Any]] = {"now": {"env": {}, "root": REPO_ROOT}}
    if tree is not None:
        modes["before"] = earlier_tree(tree)
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-stagestart-"))
    cfg = job_config(tmp / "config.yaml", STEPS)
    rounds = []
    for i in range(repeat):
        for name, mode in modes.items():
            run_dir = tmp / f"{name}-{i}"
            row = {"mode": name, "round": i, **_start(cfg, run_dir, mode, f"stagestart-{name}-{i}")}
            rounds.append(row)
            console.print(
                f"round {i + 1}/{repeat} {name}: first step {row['first_step_s']:.2f} s, "
                f"peak RSS before it {row['peak_rss_mb']:.0f} MB (largest worker)"
            )
    shutil.rmtree(tmp, ignore_errors=True)
    keys = ("first_step_s", "ready_s", "peak_rss_mb")
    return {
        "scenario": "stagestart",
        "pp": PP,
        "repeat": repeat,
        "tree": str(tree.resolve()) if tree is not None else None,
        "rounds": rounds,
        "summary": {
            name: {k: summarize(r[k] for r in rounds if r["mode"] == name) for k in keys}
            for name in modes
        },
        "command": f"python -m bench stagestart --repeat {repeat}"
        + (" --tree DIR" if tree is not None else ""),
    }


def _start(cfg: Path, run_dir: Path, mode: dict[str, Any], job_id: str) -> dict[str, Any]:
    """One launch; its workers' resident memory sampled every 50 ms until the first step."""
    env = bench_env(run_dir.parent / f"state-{run_dir.name}", mode["env"])
    module = mode.get("module", "elaswave")
    cmd = [sys.executable, "-m", module, "launch", str(cfg), "--run-dir", str(run_dir),
           "--job-id", job_id, "--pp", str(PP), "--quiet"]  # fmt: skip
    peaks: dict[int, int] = {}
    first = threading.Event()

    def sample() -> None:
        import psutil

        events, metrics = run_dir / "events.jsonl", run_dir / "metrics.jsonl"
        while not first.is_set():
            if metrics.exists() and metrics.stat().st_size:
                first.set()
                break
            pids = [e["pid"] for e in read_jsonl(events) if e["kind"] == "worker_spawned"]
            for pid in pids if events.exists() else []:
                try:
                    peaks[pid] = max(peaks.get(pid, 0), psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    continue
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    start = time.time()
    sampler.start()
    proc = subprocess.run(cmd, cwd=mode["root"], env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    first.set()
    sampler.join()
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise BenchError(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    events = read_jsonl(run_dir / "events.jsonl")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    spawned = [e["t"] for e in events if e["kind"] == "worker_spawned"]
    ready = [e["t"] for e in events if e["kind"] == "worker_ready"]
    if not metrics or not peaks or len(ready) < len(spawned):
        raise BenchError(f"{run_dir}: no committed step, no worker sampled, or one never ready")
    return {
        "first_step_s": metrics[0]["time"] - start,
        "ready_s": max(ready) - min(spawned),  # spawn → every worker ready for its plan
        "peak_rss_mb": max(peaks.values()) / 2**20,
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for name, s in result["summary"].items():
        rows.append([
            name,
            *(
                f"{s[k]['median']:.2f} ({s[k]['min']:.2f}–{s[k]['max']:.2f})"
                for k in ("first_step_s", "ready_s")
            ),
            f"{s['peak_rss_mb']['median']:.0f} ({s['peak_rss_mb']['min']:.0f}–"
            f"{s['peak_rss_mb']['max']:.0f})",
        ])  # fmt: skip
    print_table(
        f"pipeline start-up, pp = {result['pp']} (60 M llama, 4 workers), median (min–max) of "
        f"{result['repeat']}",
        ["code", "launch → first step s", "spawn → ready s", "peak RSS before step 1, MB"],
        rows,
    )
