"""The control plane at scale: N simulated hosts × 8 workers against a real 3-member etcd
cluster on loopback, and the pure planners at 10^5 ranks.

Per size (``--hosts 100,1000,4000``; default 100 and 1000), one job on a fresh cluster
(:mod:`bench.scalesim`: the daemon's own membership, election, planner and plan-watch code, no
torch workers), then the faults in turn, each once every host holds the previous plan:

- ``worker exit`` (``--repeat`` times): a host records a worker's departure, as its daemon does
  when the process exits;
- ``host lost``: a host goes silent; etcd expires its lease (the detection) and the leader plans
  without its workers;
- ``leader host lost``: the same for the leader's host: the others elect a new leader, which plans;
- ``etcd member lost``: the member the leader talks to is SIGKILLed (the hosts that talk to it,
  a third, fail over); once they all have, a worker exits.

Per fault: from the detection (the departure written; the host key deleted by etcd) to the plan
published and to every live host holding it decoded (p50, p99, max over hosts), the leader's time
to read the members and to plan, the plan's size, etcd's requests and bytes sent meanwhile, the
database size; per size also the requests per second while nothing happens (lease keep-alives)
and the time to start the job. The simulated hosts share this machine's cores with etcd: their
receipt times include the time their one process took to get to each.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import BenchError, console, print_table
from bench.scalesim import ETCD_REQUEST_LIMIT, Sim
from elaswave.daemon.etcd_server import EtcdCluster
from elaswave.planning import planwire
from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import next_plan
from elaswave.planning.plandelta import encode_delta
from elaswave.planning.scaleplans import synthetic_members

DESCRIPTION = "simulated hosts on a 3-member etcd: fault → every host holds the plan; planners"
DEFAULT_REPEAT = 3
SIZES = (100, 1000)
PER_HOST = 8
PLANNER_RANKS = 100_000
PIPELINE_PP = 16


def lease_ttl_for(hosts: int) -> int:
    """The host lease: the default 5 s, longer where this one process could not refresh every
    simulated host's lease in time (the simulator's limit, not etcd's)."""
    return 5 if hosts <= 1000 else 60


async def one_size(hosts: int, repeat: int, lease_ttl: int | None = None) -> dict[str, Any]:
    """Start a job of ``hosts`` simulated hosts, inject the faults, return what was measured."""
    ttl = lease_ttl or lease_ttl_for(hosts)
    with EtcdCluster(3) as cluster:
        sim = Sim(cluster, hosts=hosts, per_host=PER_HOST, lease_ttl=ttl)
        try:
            start = await sim.start()
            steady = await sim.steady_rate(5.0)
            faults = [await sim.worker_exit() for _ in range(repeat)]
            faults.append(await sim.host_lost())
            faults.append(await sim.host_lost(leader=True))
            faults.append(await sim.etcd_member_lost())
        finally:
            await sim.close()
    expired = sim.events.of("lease_expired")
    if expired:  # a live host lost its keys: its workers would have been dropped
        raise BenchError(f"{len(expired)} live host lease(s) expired at {hosts} hosts")
    return {
        "hosts": hosts,
        "workers": hosts * PER_HOST,
        "lease_ttl": ttl,
        **start,
        "steady_requests_per_s": steady,
        "faults": faults,
    }


def planner_times(ranks: int = PLANNER_RANKS, rounds: int = 3) -> dict[str, Any]:
    """Seconds of the pure planners at ``ranks`` ranks (median of ``rounds``): the start plan,
    one host's workers lost, one host joined; data parallel and dp × pp with pp = 16."""
    hosts = ranks // PER_HOST
    members = synthetic_members(hosts + 1, PER_HOST)
    first, extra = members[:-PER_HOST], members[-PER_HOST:]
    lost = first[PER_HOST:]  # node-00000's workers gone
    mbs = 2 * ranks
    costs = [1.0] * (PIPELINE_PP * 4)

    def dp(prev: Any, live: Any) -> Any:
        return next_plan(prev, live, num_microbatches=mbs, max_workers=ranks + PER_HOST,
                         store="s:1", now=0.0)  # fmt: skip

    def pp(prev: Any, live: Any) -> Any:
        return next_pipeline_plan(prev, live, pp=PIPELINE_PP, costs=costs, num_microbatches=mbs,
                                  max_workers=ranks + PER_HOST, store="s:1", now=0.0)  # fmt: skip

    out: dict[str, Any] = {"ranks": ranks}
    for kind, planner in (("dp", dp), ("pp16", pp)):
        times: dict[str, list[float]] = {"start": [], "host lost": [], "host joined": []}
        sizes = []
        for _ in range(rounds):
            t = time.perf_counter()
            plan = planner(None, first)
            times["start"].append(time.perf_counter() - t)
            t = time.perf_counter()
            after = planner(plan, lost)
            times["host lost"].append(time.perf_counter() - t)
            t = time.perf_counter()
            planner(after, [*lost, *extra])
            times["host joined"].append(time.perf_counter() - t)
            sizes.append(len(planwire.encode(after).encode()))
        out[kind] = {k: round(statistics.median(v), 4) for k, v in times.items()}
        out[kind]["plan_bytes"] = max(sizes)
    # Workers register as they become ready: at a real start the hosts' workers interleave in
    # rank order, the plan's worst case (and the whole plan every host reads at the start).
    shuffled = list(first)
    random.Random(0).shuffle(shuffled)
    shuffled = [replace(m, order=i) for i, m in enumerate(shuffled)]
    plan = dp(None, shuffled)
    after = dp(plan, [m for m in shuffled if m.worker_id != shuffled[ranks // 2].worker_id])
    out["interleaved"] = {
        "plan_bytes": len(planwire.encode(after).encode()),
        "delta_bytes": len(encode_delta(plan, after).encode()),
    }
    worst = max(out[k]["plan_bytes"] for k in ("dp", "pp16", "interleaved"))
    if worst > ETCD_REQUEST_LIMIT:
        raise BenchError(f"a plan of {ranks} ranks is over etcd's request limit")
    return out


def run(repeat: int, config: Path, hosts: list[int] | None = None) -> dict[str, Any]:
    logging.getLogger("elaswave").setLevel(logging.ERROR)  # failovers are expected here
    result: dict[str, Any] = {"per_host": PER_HOST, "sizes": [], "repeat": repeat}
    result["planners"] = planner_times()
    console.print(f"planners at {PLANNER_RANKS} ranks: {result['planners']}")
    # One event loop for every size: gRPC's asyncio poller stays bound to the loop it first
    # ran on, so a second ``asyncio.run`` would never see a reply.
    result["sizes"] = asyncio.run(_sizes(hosts or SIZES, repeat))
    return result


async def _sizes(hosts: list[int], repeat: int) -> list[dict[str, Any]]:
    # ``kill -USR1 <pid>`` prints where every task of the harness waits (thousands of them).
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, _print_tasks)
    sizes = []
    for n in hosts:
        size = await one_size(n, repeat)
        sizes.append(size)
        worst = max(f["seen_s"]["p99"] for f in size["faults"])
        console.print(f"{n} hosts: started in {size['register_s'] + size['first_plan_s']:.1f} s, "
                      f"worst p99 fault → every host holds the plan {worst:.3f} s")  # fmt: skip
    return sizes


def _print_tasks() -> None:
    """Where every task waits: its chain of awaited coroutines, innermost last."""
    for task in asyncio.all_tasks():
        where, coro = [], task.get_coro()
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                where.append(f"{frame.f_code.co_filename}:{frame.f_lineno} {frame.f_code.co_name}")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        print(
            f"{task.get_name()} cancelling={task.cancelling()}: " + " <- ".join(where),
            file=sys.stderr,
        )


def show(result: dict[str, Any]) -> None:
    rows = []
    for size in result["sizes"]:
        for f in size["faults"]:
            rows.append(
                (f"{size['hosts']}", f["fault"], f"{f['published_s']:.3f}",
                 f"{f['seen_s']['p50']:.3f}", f"{f['seen_s']['p99']:.3f}",
                 f"{f['seen_s']['max']:.3f}", f"{f['read_s']:.3f}", f"{f['planning_s']:.3f}",
                 f"{f['plan_bytes'] / 1024:.1f}", f"{f['requests']}", f"{f['sent_mb']:.1f}",
                 f"{f['db_mb']:.1f}", f"{f.get('failover_s', '')}")
            )  # fmt: skip
    print_table(
        f"Fault (after detection) → plan (seconds), {result['per_host']} workers per host",
        ("hosts", "fault", "published", "held p50", "p99", "max", "leader read", "planner",
         "plan KiB", "etcd requests", "sent MB", "db MB", "failover"),
        rows,
    )  # fmt: skip
    print_table(
        "Per size",
        ("hosts", "workers", "lease TTL", "register s", "first plan s", "idle requests/s"),
        [(f"{s['hosts']}", f"{s['workers']}", f"{s['lease_ttl']}", f"{s['register_s']:.1f}",
          f"{s['first_plan_s']:.2f}", f"{s['steady_requests_per_s']:.0f}")
         for s in result["sizes"]],
    )  # fmt: skip
    p = result["planners"]
    print_table(
        f"Pure planners at {p['ranks']} ranks (seconds, median)",
        ("plan", "start", "host lost", "host joined", "plan KiB"),
        [(k, f"{p[k]['start']:.3f}", f"{p[k]['host lost']:.3f}", f"{p[k]['host joined']:.3f}",
          f"{p[k]['plan_bytes'] / 1024:.1f}") for k in ("dp", "pp16")],
    )  # fmt: skip
    i = p["interleaved"]
    console.print(f"dp plan at {p['ranks']} ranks whose hosts' workers joined interleaved: "
                  f"{i['plan_bytes'] / 1024:.0f} KiB; its delta after a worker exit "
                  f"{i['delta_bytes']} B")  # fmt: skip
