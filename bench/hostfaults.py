"""Detection latency per fault kind: crash, hang, host loss, partition.

Each repetition is one job on five hosts × one worker, every host a network namespace of the
multi-host test bed (elaswave.testing.netbed: real etcd, real daemons, gloo over veths), with a
lease TTL of 2 s and a hang timeout of 2 s. Four faults hit four different non-leader hosts in turn,
each after the previous one has been planned away:

- crash: ``inject-fault --kind kill`` (SIGKILL a worker) → the daemon's ``worker_exit``;
- hang: ``inject-fault --kind hang`` (SIGSTOP) → the daemon's ``hang_detected``;
- host loss: ``inject-fault --kind host`` (SIGKILL daemon and worker) → the leader's ``host_lost``;
- partition: ``inject-fault --kind partition`` (the host's link goes down) → the leader's
  ``host_lost`` (the cut-off host fences its workers only once it can read the plan that
  dropped them, after the link is back).

"To plan" is fault → the plan without the target published. Needs root and iproute2.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    bench_env,
    ms,
    print_table,
    read_jsonl,
    summarize,
    wait_until,
)
from elaswave.testing import netbed

DESCRIPTION = "detection latency of crash, hang, host loss and partition (5 netns hosts × 1)"
DEFAULT_REPEAT = 5
HOSTS = 5
LEASE_TTL = 2
HANG_TIMEOUT = 2.0
KINDS = ("crash", "hang", "host", "partition")
GOALS_S = {  # detection must stay within these (the hang timeout or the lease TTL + slack)
    "crash": 1.0,  # process exit: milliseconds on an idle machine, scheduling delay under load
    "hang": HANG_TIMEOUT + 1.0,
    "host": LEASE_TTL + 2.0,
    "partition": LEASE_TTL + 2.0,
}


def run(repeat: int, config: Path) -> dict[str, Any]:
    reason = netbed.skip_reason()
    if reason:
        raise BenchError(f"the netns test bed is unavailable: {reason}")
    runs = []
    for i in range(repeat):
        with tempfile.TemporaryDirectory(prefix="elaswave-bench-") as tmp:
            bed = netbed.NetBed(Path(tmp), config=config, hosts=HOSTS)
            try:
                bed.start()
                runs.append(_one_run(bed, Path(tmp), f"hostfaults-{i}"))
            finally:
                bed.close()
    summary = {
        kind: {
            "detection_s": summarize(r[kind]["detection_s"] for r in runs),
            "to_plan_s": summarize(r[kind]["to_plan_s"] for r in runs),
        }
        for kind in KINDS
    }
    goals = {
        kind: {
            "max_s": GOALS_S[kind],
            "met": (summary[kind]["detection_s"]["max"] or 1e9) <= GOALS_S[kind],
        }
        for kind in KINDS
    }
    return {
        "scenario": "hostfaults",
        "repeat": repeat,
        "hosts": HOSTS,
        "lease_ttl_s": LEASE_TTL,
        "hang_timeout_s": HANG_TIMEOUT,
        "runs": runs,
        "summary": summary,
        "goals": goals,
    }


def _one_run(bed: Any, tmp: Path, job: str) -> dict[str, Any]:
    env = bench_env(
        tmp / "state",
        {
            "ELASWAVE_TIMEOUTS__LEASE_TTL": str(LEASE_TTL),
            "ELASWAVE_TIMEOUTS__ETCD_CONNECT": "2",
        },
    )
    for host in bed.hosts:
        bed.launch(
            host, "--job-id", job, "--nproc-per-node", "1", "--nnodes", f"{HOSTS}:{HOSTS}",
            "--steps", "100000", "--hang-timeout", str(HANG_TIMEOUT), env=env,
        )  # fmt: skip
    leader = wait_until(lambda: _leader(bed), 120, "no leader elected")
    wait_until(lambda: _plans(bed, leader), 180, "the job did not start")
    targets = [h for h in bed.hosts if h != leader]
    out: dict[str, Any] = {"leader": leader}
    for kind, host in zip(KINDS, targets, strict=False):
        plan = _plans(bed, leader)[-1]
        worker = f"{host}.w0"
        if kind in ("crash", "hang"):
            args = ["--kind", "kill" if kind == "crash" else "hang"]
            args += ["--rank", str(plan["workers"].index(worker))]
        else:
            args = ["--kind", kind, "--host", host]
        r = bed.cli("inject-fault", "--job-id", job, "--etcd", bed.endpoints, "--json", *args,
                    env=env)  # fmt: skip
        if r.returncode != 0:
            raise BenchError(f"inject-fault {kind} failed: {r.stderr.strip()[-300:]}")
        next_plan = wait_until(
            lambda e=plan["epoch"]: [p for p in _plans(bed, leader) if p["epoch"] > e],
            60,
            f"no plan after the {kind} fault",
        )[0]
        if worker in next_plan["workers"]:
            raise BenchError(f"the plan after the {kind} fault still holds {worker}")
        out[kind] = _latency(bed, kind, host, leader, json.loads(r.stdout), next_plan)
    return out


def _latency(
    bed: Any, kind: str, host: str, leader: str, injected: dict[str, Any], plan: dict[str, Any]
) -> dict[str, Any]:
    def first(h: str, event: str) -> dict[str, Any]:
        return wait_until(
            lambda: [e for e in _events(bed, h) if e["kind"] == event and e.get("host", h) == host],
            30,
            f"no {event} for {host}",
        )[0]

    if kind == "partition":
        t0 = float(injected["t"])
    else:
        t0 = first(host, "fault_injected")["t"]
    detected = {
        "crash": lambda: first(host, "worker_exit"),
        "hang": lambda: first(host, "hang_detected"),
        "host": lambda: first(leader, "host_lost"),
        "partition": lambda: first(leader, "host_lost"),
    }[kind]()
    return {"detection_s": detected["t"] - t0, "to_plan_s": plan["t"] - t0}


def _events(bed: Any, host: str) -> list[dict[str, Any]]:
    return read_jsonl(bed.workdir / host / "events.jsonl")


def _plans(bed: Any, leader: str) -> list[dict[str, Any]]:
    return [e for e in _events(bed, leader) if e["kind"] == "plan_published"]


def _leader(bed: Any) -> str | None:
    for host in bed.hosts:
        if any(e["kind"] == "leader_elected" for e in _events(bed, host)):
            return host
    return None


def show(result: dict[str, Any]) -> None:
    rows = []
    for kind in KINDS:
        s, goal = result["summary"][kind], result["goals"][kind]
        d = s["detection_s"]
        verdict = "[green]yes[/green]" if goal["met"] else "[red]NO[/red]"
        rows.append((
            kind, ms(d["median"]), f"{ms(d['min'])}–{ms(d['max'])}",
            ms(s["to_plan_s"]["median"]), f"≤ {goal['max_s']:g} s: {verdict}",
        ))  # fmt: skip
    print_table(
        f"Detection latency, {result['hosts']} netns hosts × 1 worker, lease TTL "
        f"{result['lease_ttl_s']} s, hang timeout {result['hang_timeout_s']:g} s, medians over "
        f"{result['repeat']} runs, milliseconds",
        ("fault", "detection", "spread", "to plan", "goal"),
        rows,
    )
