"""Where the CPU goes per training step: ElasWave's workers, daemon and embedded etcd vs DDP.

On a host where workers outnumber cores, everything beside the workers takes time from them, so
the fault-free overhead against DDP is mostly CPU spent by the control path. Each repeat runs
the same job twice (``SHORT`` and ``LONG`` steps) and takes the difference, so start-up does not
count: ElasWave's CPU per process kind is read from ``/proc/<pid>/stat`` while the job runs
(sampled every 0.1 s, each process's last reading), DDP's from ``getrusage`` of its workers.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT, BenchError, bench_env, console, print_table, summarize
from bench.ddp_baseline import run_ddp

DESCRIPTION = "CPU per training step by process kind: ElasWave workers / daemon / etcd vs DDP"
DEFAULT_REPEAT = 2
SHORT, LONG = 40, 200
WORLD = 4
KINDS = ("workers", "daemon", "etcd")


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-cpushare-"))
    rounds = []
    for r in range(1, repeat + 1):
        short, long = (_elaswave_cpu(config, tmp / f"r{r}-{n}", n) for n in (SHORT, LONG))
        ddp_short, ddp_long = (_ddp_cpu(config, tmp / f"r{r}-ddp{n}", n) for n in (SHORT, LONG))
        row = {k: (long[k] - short[k]) / (LONG - SHORT) for k in KINDS}
        row["ddp"] = (ddp_long - ddp_short) / (LONG - SHORT)
        rounds.append(row)
        console.print(
            f"round {r}/{repeat}: ms of CPU per step: "
            + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in row.items())
        )
    shutil.rmtree(tmp, ignore_errors=True)
    summary = {k: summarize(row[k] for row in rounds) for k in (*KINDS, "ddp")}
    total = sum(summary[k]["median"] or 0.0 for k in KINDS)
    return {
        "scenario": "cpushare",
        "world": WORLD,
        "steps": [SHORT, LONG],
        "rounds": rounds,
        "summary": summary,
        "elaswave_over_ddp_cpu": total / summary["ddp"]["median"]
        if summary["ddp"]["median"]
        else None,
    }


def _elaswave_cpu(config: Path, run_dir: Path, steps: int) -> dict[str, float]:
    """CPU seconds per process kind of one ``elaswave launch`` of ``steps`` steps."""
    cmd = [sys.executable, "-m", "elaswave", "launch", str(config), "--run-dir",
           str(run_dir), "--job-id", f"cpushare-{os.getpid()}-{steps}", "--steps", str(steps),
           "--nproc-per-node", str(WORLD), "--quiet"]  # fmt: skip
    env = bench_env(run_dir.parent / "state")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    last: dict[int, tuple[str, int]] = {}
    while proc.poll() is None:
        for pid in _descendants(proc.pid):
            kind, ticks = _sample(pid, proc.pid)
            if kind:
                last[pid] = (kind, ticks)
        time.sleep(0.1)
    if proc.returncode != 0:
        raise BenchError(
            f"launch exited {proc.returncode}: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
        )
    hz = os.sysconf("SC_CLK_TCK")
    return {k: sum(t for kind, t in last.values() if kind == k) / hz for k in KINDS}


def _descendants(root: int) -> list[int]:
    """``root`` and every process below it (from ``/proc/*/stat`` parent ids)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def _sample(pid: int, root: int) -> tuple[str, int]:
    """(kind, user + system ticks) of one process; kind "" for one that is not counted."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "", 0
    ticks = int(fields[11]) + int(fields[12])
    if pid == root:
        return "daemon", ticks
    if "etcdbin/etcd" in args:
        return "etcd", ticks
    if "elaswave.worker" in args:
        return "workers", ticks
    return "", 0


def _ddp_cpu(config: Path, out_dir: Path, steps: int) -> float:
    """CPU seconds of the DDP baseline's workers for ``steps`` steps."""
    out_dir.mkdir(parents=True, exist_ok=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run_ddp(config, steps=steps, world=WORLD, out_dir=out_dir)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def show(result: dict[str, Any]) -> None:
    s = result["summary"]
    rows = [
        (
            kind,
            f"{1e3 * s[kind]['median']:.1f}",
            f"{1e3 * s[kind]['min']:.1f}–{1e3 * s[kind]['max']:.1f}",
        )
        for kind in (*KINDS, "ddp")
    ]
    print_table(
        f"CPU per training step, {result['world']} workers (steps {SHORT}→{LONG}, difference), ms",
        ["process kind", "median", "min–max"],
        rows,
    )
    ratio = result["elaswave_over_ddp_cpu"]
    if ratio is not None:
        console.print(f"ElasWave (workers + daemon + etcd) / DDP workers, CPU: {ratio:.3f}")
