"""Hang MTTR: a worker that stops (SIGSTOP) instead of dying, for several hang timeouts.

Each repetition is one fault-injected ``elaswave launch`` per hang timeout T (rounds interleave
the T values): rank 1 SIGSTOPs itself while step 15 is in flight, the daemon sees its heartbeats
stop, SIGKILLs it after T seconds of silence, and the usual in-place recovery follows. MTTR and
its phases come from :func:`elaswave.report.build_report`; detection therefore includes the wait
for the timeout. It can be shorter than T: the fault fires at the end of the step's compute
phase, and a compute phase older than T also counts as hung, so the compute time already spent
is counted too. Goal: every MTTR <= T + 1 s.

For contrast, the same fault under plain gloo: 4 processes in an allreduce loop on a process
group with a C-second timeout; one SIGSTOPs itself and the survivors' allreduce raises only when
the collective timeout expires. That is the detection a torchrun/DDP job gets (torchrun has no
hang detector; it reacts once a worker exits on that error).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.markup import escape

from bench.common import (
    BenchError,
    bench_env,
    console,
    elaswave_launch,
    free_port,
    launch_command,
    ms,
    print_table,
    summarize,
)
from bench.mttr import PHASES
from bench.mttr import _check as check_recovered

DESCRIPTION = "hang MTTR (SIGSTOP rank 1 at step 15) for hang timeouts 1/2/5 s, vs gloo's timeout"
DEFAULT_REPEAT = 3
HANG_TIMEOUTS = (1.0, 2.0, 5.0)
FAULT = "hang,rank=1,at_step=15"
GOAL_SLACK_S = 1.0  # MTTR <= T + this
GLOO_TIMEOUT_S = 10.0
GLOO_WORLD = 4
GLOO_VICTIM = 1
GLOO_STOP_AFTER = 20  # allreduces before the victim stops


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.config import load_config

    steps = load_config(config, env={}).train.steps
    tmp = Path(tempfile.mkdtemp(prefix="elaswave-bench-hang-"))
    env = bench_env(tmp / "state")
    runs: dict[str, list[dict[str, Any]]] = {_key(t): [] for t in HANG_TIMEOUTS}
    for i in range(1, repeat + 1):
        for t in HANG_TIMEOUTS:
            run_dir = tmp / f"t{t:g}-run{i}"
            job_id = f"bench-hang-{os.getpid()}-{t:g}-{i}"
            began, ended = elaswave_launch(config, run_dir, job_id, env=env, extra_args=_args(t))
            inc = check_recovered(run_dir, steps, ended - began)
            inc["reason"] = _hang_reason(run_dir)
            runs[_key(t)].append(inc)
            console.print(
                f"round {i}/{repeat}, T={t:g} s: MTTR {ms(inc['mttr_s'])} ms (detection "
                f"{ms(inc['detection_s'])} ms, redo {ms(inc['redo_s'])} ms); load "
                f"{os.getloadavg()[0]:.1f}; {_verdict(inc['reason'])}"
            )
    shutil.rmtree(tmp, ignore_errors=True)  # kept (for inspection) when a run failed
    console.print(f"plain gloo, {GLOO_WORLD} ranks, timeout {GLOO_TIMEOUT_S:g} s: SIGSTOP rank "
                  f"{GLOO_VICTIM} and wait for the survivors' allreduce to raise ...")  # fmt: skip
    gloo = gloo_hang(GLOO_TIMEOUT_S)
    per_t = {}
    for t in HANG_TIMEOUTS:
        summary = {p: summarize(r[p] for r in runs[_key(t)]) for p in PHASES}
        worst = summary["mttr_s"]["max"]
        limit = t + GOAL_SLACK_S
        per_t[_key(t)] = {
            "hang_timeout_s": t,
            "command": launch_command(config, _args(t)),
            "summary": summary,
            "goal": {"mttr_max_s": limit, "met": worst is not None and worst <= limit},
        }
    return {
        "scenario": "hang",
        "repeat": repeat,
        "fault": FAULT,
        "runs": runs,
        "per_timeout": per_t,
        "gloo": gloo,
    }


def _key(t: float) -> str:
    return f"{t:g}"


def _args(t: float) -> list[str]:
    return ["--hang-timeout", f"{t:g}", "--fault", FAULT]


def _verdict(reason: str) -> str:
    found = re.search(r"hung \(([^)]*)\)", reason)
    return found.group(1) if found else reason


def _hang_reason(run_dir: Path) -> str:
    """The daemon's verdict ("no heartbeat for …" or "stuck computing for …")."""
    from elaswave.report import build_report

    inc = build_report(run_dir)["incidents"][0]
    if inc["kind"] != "hang" or "hung" not in inc["reason"]:
        raise BenchError(f"{run_dir}: expected a hang incident, got {inc['kind']}: {inc['reason']}")
    return str(inc["reason"])


# ---- plain gloo with a stopped peer ------------------------------------------------------------
def _gloo_worker(rank: int, port: int, world: int, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120),
        wait_for_workers=False,
    )  # fmt: skip
    pg = dist.ProcessGroupGloo(
        dist.PrefixStore("hang", store), rank, world, datetime.timedelta(seconds=timeout_s)
    )
    tensor = torch.ones(1024)
    for i in range(GLOO_STOP_AFTER + 1_000_000):
        if rank == GLOO_VICTIM and i == GLOO_STOP_AFTER:
            store.set("stopped", repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)
        try:
            pg.allreduce([tensor]).wait()
        except RuntimeError as exc:
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            store.set(f"raised/{rank}", json.dumps({"t": time.time(), "iteration": i,
                                                    "error": lines[0][:300]}))  # fmt: skip
            os._exit(0)  # leave without tearing down a group whose peer is stopped
    raise RuntimeError("the stopped peer never blocked the allreduce")


def gloo_hang(timeout_s: float) -> dict[str, Any]:
    """Seconds from one rank's SIGSTOP until each survivor's allreduce raises."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    ctx = mp.start_processes(
        _gloo_worker, args=(port, GLOO_WORLD, timeout_s), nprocs=GLOO_WORLD, join=False,
        start_method="spawn",
    )  # fmt: skip
    survivors = [r for r in range(GLOO_WORLD) if r != GLOO_VICTIM]
    try:
        store.wait(["stopped"] + [f"raised/{r}" for r in survivors],
                   datetime.timedelta(seconds=timeout_s + 180))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - reported as the benchmark's failure
        raise BenchError(f"gloo hang run did not finish: {exc}") from None
    finally:
        for proc in ctx.processes:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)  # the stopped victim (and any straggler)
            proc.join(30)
    stopped = float(store.get("stopped"))
    raised = {r: json.loads(store.get(f"raised/{r}")) for r in survivors}
    detection = {str(r): round(v["t"] - stopped, 3) for r, v in raised.items()}
    return {
        "world": GLOO_WORLD,
        "victim": GLOO_VICTIM,
        "timeout_s": timeout_s,
        "detection_s": detection,
        "first_s": min(detection.values()),
        "last_s": max(detection.values()),
        "errors": {str(r): v["error"] for r, v in raised.items()},
        "iterations": {str(r): v["iteration"] for r, v in raised.items()},
    }


def show(result: dict[str, Any]) -> None:
    rows = []
    for key, per in result["per_timeout"].items():
        s = per["summary"]
        goal = per["goal"]
        verdict = "[green]yes[/green]" if goal["met"] else "[red]NO[/red]"
        rows.append((
            f"{key} s", *(ms(s[p]["median"]) for p in PHASES),
            f"{ms(s['mttr_s']['min'])}–{ms(s['mttr_s']['max'])}",
            f"≤ {goal['mttr_max_s']:g} s: {verdict}",
        ))  # fmt: skip
    print_table(
        f"Hang MTTR ({result['fault']}), medians over {result['repeat']} runs, milliseconds",
        ("hang timeout", *(p.removesuffix("_s") for p in PHASES), "MTTR spread", "goal"),
        rows,
    )
    g = result["gloo"]
    print_table(
        f"Plain gloo, {g['world']} ranks, rank {g['victim']} SIGSTOPped, "
        f"process-group timeout {g['timeout_s']:g} s",
        ("survivor", "stop → allreduce raises (s)", "error"),
        [(r, f"{d:.3f}", escape(g["errors"][r][-60:])) for r, d in g["detection_s"].items()],
    )
