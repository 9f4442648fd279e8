"""Training through the control plane's own failures: what an outage costs a running job.

Each round runs gpt-tiny (4 workers, one host, float64 reduction) for STEPS steps four ways,
interleaved so that the machine's noise falls on all of them alike:

- fault-free;
- etcd killed: the embedded etcd is SIGKILLed at step 20 (``launch`` restarts it);
- etcd down 10 s: the job's external etcd (``--etcd``) is SIGKILLed at step 20 and started again
  on its data directory 10 s later;
- daemon paused: the ``launch`` process (the daemon) is SIGSTOPped at step 20 for 3 × the hang
  timeout (2 s), longer than the lease TTL (5 s).

Per run: the job's wall time (first to last commit) over the fault-free run of the same round,
the outage (from the report's control-plane incident: downtime, steps committed during it), and
what it cost, which must be nothing: workers lost, steps missing or committed twice, losses that
differ from the fault-free run's.
"""

from __future__ import annotations

import os
import shutil
import signal
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
    print_table,
    read_jsonl,
    summarize,
    wait_until,
)

DESCRIPTION = "etcd killed / down 10 s / daemon paused mid-run: wall time vs fault-free, 0 lost"
DEFAULT_REPEAT = 3
STEPS = 120
AT_STEP = 20
ETCD_DOWN_S = 10.0
HANG_S = 2.0
VARIANTS = ("fault-free", "etcd killed", "etcd down 10 s", "daemon paused")


def run(repeat: int, config: Path) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-cp-"))
    env = bench_env(
        tmp / "state",
        {"ELASWAVE_TRAIN__REDUCE_DTYPE": "float64", "ELASWAVE_TIMEOUTS__HANG": str(HANG_S)},
    )
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for i in range(1, repeat + 1):
        base: dict[str, Any] = {}
        for variant in VARIANTS:
            run_dir = tmp / f"{variant.replace(' ', '-')}-{i}"
            result = _one(config, run_dir, f"bench-cp-{os.getpid()}-{i}-{len(runs[variant])}",
                          variant, env, base)  # fmt: skip
            if variant == "fault-free":
                base = result
            runs[variant].append({k: v for k, v in result.items() if k != "losses"})
            console.print(
                f"round {i}/{repeat}, {variant}: wall {result['wall_s']:.2f} s "
                f"(× {result.get('wall_ratio', 1.0):.3f}), outage {result['downtime_s']} s, "
                f"{result['steps_during']} steps during it; load {os.getloadavg()[0]:.1f}"
            )
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    summary = {
        v: {
            "wall_ratio": summarize(r.get("wall_ratio") for r in rs),
            "downtime_s": summarize(r["downtime_s"] for r in rs),
            "steps_during": summarize(r["steps_during"] for r in rs),
            "lost": sum(r["lost"] for r in rs),
        }
        for v, rs in runs.items()
    }
    return {"steps": STEPS, "at_step": AT_STEP, "repeat": repeat, "runs": runs,
            "summary": summary}  # fmt: skip


def _one(
    config: Path, run_dir: Path, job_id: str, variant: str, env: dict[str, str],
    base: dict[str, Any],
) -> dict[str, Any]:  # fmt: skip
    from elaswave.daemon.etcd_server import EmbeddedEtcd
    from elaswave.report import build_report

    external = EmbeddedEtcd().start() if variant == "etcd down 10 s" else None
    extra = ["--etcd", external.endpoint] if external else []
    cmd = [
        sys.executable, "-m", "elaswave", "launch", str(config), "--run-dir",
        str(run_dir), "--job-id", job_id, "--steps", str(STEPS), "--quiet", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        if variant != "fault-free":
            wait_until(lambda: _step(run_dir) >= AT_STEP, 180, f"no step {AT_STEP}")
            _inject(variant, run_dir, proc, external)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        if external is not None:
            external.stop()
    if proc.returncode != 0:
        raise BenchError(f"{variant}: launch exited {proc.returncode}: {err.strip()[-500:]}")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    steps = [m["step"] for m in metrics]
    losses = {m["step"]: m["loss"] for m in metrics}
    lost = int(steps != list(range(1, STEPS + 1)))
    lost += sum(1 for e in events if e["kind"] in ("worker_exit", "hang_detected", "host_fenced"))
    if base:
        lost += sum(1 for s, x in losses.items() if base["losses"].get(s) != x)
    outages = [i for i in build_report(run_dir)["incidents"] if i["kind"] == "control plane"]
    if variant != "fault-free" and not outages:
        raise BenchError(f"{variant}: no control-plane incident in the report")
    result: dict[str, Any] = {
        "wall_s": metrics[-1]["time"] - metrics[0]["time"],
        "downtime_s": round(sum(o["downtime_s"] for o in outages), 3),
        "steps_during": sum(o["steps_trained"] for o in outages),
        "lost": lost,
        "losses": losses,
    }
    if base:
        result["wall_ratio"] = result["wall_s"] / base["wall_s"]
    return result


def _inject(variant: str, run_dir: Path, proc: subprocess.Popen[str], external: Any) -> None:
    if variant == "etcd killed":
        (joined,) = [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "host_joined"]
        os.kill(joined["embedded_etcd_pid"], signal.SIGKILL)
    elif variant == "etcd down 10 s":
        external.kill()
        time.sleep(ETCD_DOWN_S)
        external.spawn()
        external.wait_healthy()
    elif variant == "daemon paused":
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(3 * HANG_S)
        os.kill(proc.pid, signal.SIGCONT)


def _step(run_dir: Path) -> int:
    return max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=0)


def show(result: dict[str, Any]) -> None:
    rows = []
    for variant in VARIANTS:
        s = result["summary"][variant]
        ratio = s["wall_ratio"]
        rows.append((
            variant,
            "1" if variant == "fault-free" else
            f"{ratio['median']:.3f} ({ratio['min']:.3f}–{ratio['max']:.3f})",
            f"{s['downtime_s']['median']:.2f}", f"{s['steps_during']['median']:.0f}",
            str(s["lost"]),
        ))  # fmt: skip
    print_table(
        f"Control-plane outages at step {result['at_step']} of {result['steps']}, gpt-tiny, 4 "
        f"workers, medians of {result['repeat']} rounds",
        ("run", "wall time / fault-free", "outage s", "steps during outage", "lost"),
        rows,
    )
