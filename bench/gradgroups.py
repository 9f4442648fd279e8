"""Editing a pipeline's process groups after a stage loss vs building every group.

For each dp × pp grid (W = dp × pp processes, ``torch.multiprocessing`` spawn, one TCPStore
master here), every process runs ElasWave's own :class:`~elaswave.runtime.comm.communicator.
Communicator` and configures the groups a pipeline plan needs: the training and migration groups
of every rank and one gradient group per holder set (:mod:`elaswave.planning.gradgroups`),
replicas cut alike, 4 layers per stage. One all-reduce per gradient group stands for a step. Then
the last stage of replica 0 dies, and its layers go to the stage before it (the takeover). The
survivors configure the new plan's groups in one of two ways:

- ``edit``: the same communicator, marked interrupted as a fault leaves it; members agree through
  the store which groups are sound, keep those, build the new ones (what the runtime does);
- ``full``: a fresh communicator, so every group of the new plan is built.

Per trial the figure is the slowest survivor's ``configure`` (the job waits for it), timed from
a store barrier; the strategies alternate.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import (
    BenchError,
    console,
    free_port,
    ms,
    print_table,
    store_barrier,
    summarize,
)

DESCRIPTION = "a pipeline's gradient groups after a stage loss: edit (keep, build new) vs build all"
DEFAULT_REPEAT = 5
GRIDS = ((2, 2), (4, 2), (2, 4), (4, 4))  # (dp, pp)
LAYERS_PER_STAGE = 4
STRATEGIES = ("edit", "full")


def layout(dp: int, pp: int, lost: int | None) -> list[range]:
    """Each rank's layers (replica-major ranks); ``lost``: that rank is gone and replica 0's
    previous stage takes its layers."""
    cut = [s * LAYERS_PER_STAGE for s in range(pp + 1)]
    out: list[range] = []
    for d in range(dp):
        for s in range(pp):
            r = d * pp + s
            if r == lost:
                continue
            stop = cut[s + 2] if d == 0 and lost == r + 1 else cut[s + 1]
            out.append(range(cut[s], stop))
    return out


def plan_groups(dp: int, pp: int, lost: int | None) -> dict[str, tuple[str, ...]]:
    """The groups of the plan before (``lost`` None) or after the loss, by name."""
    from elaswave.planning.gradgroups import group_name, reductions
    from elaswave.planning.stageshards import holder_blocks

    workers = [f"w{r}" for r in range(dp * pp) if r != lost]
    layers = pp * LAYERS_PER_STAGE
    offsets = [(i * 10, i * 10 + 10) for i in range(layers)]
    out = {"dp": tuple(workers), "mig": tuple(workers)}
    for red in reductions(holder_blocks(layout(dp, pp, lost), offsets)):
        if len(red.members) > 1:
            members = tuple(workers[r] for r in red.members)
            out[group_name(members)] = members
    return out


# ---- worker side -------------------------------------------------------------------------------
def _worker(rank: int, port: int, dp: int, pp: int, repeat: int) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    from elaswave.runtime.comm.communicator import Communicator

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))  # fmt: skip
    world, lost = dp * pp, pp - 1  # replica 0's last stage
    me, address = f"w{rank}", f"127.0.0.1:{port}"
    before, after = plan_groups(dp, pp, None), plan_groups(dp, pp, lost)

    def communicator() -> Communicator:
        return Communicator(me=me, host_addr="127.0.0.1", rendezvous_timeout=120.0,
                            collective_timeout=120.0, waker=lambda _: lambda: None)  # fmt: skip

    def barrier(key: str, count: int) -> None:
        store_barrier(store, key, count)

    never = threading.Event().is_set
    records = []
    for rep in range(repeat):
        for k in range(len(STRATEGIES)):
            strategy = STRATEGIES[(rep + k) % len(STRATEGIES)]
            epoch = 2 * (rep * len(STRATEGIES) + k) + 1
            comm = communicator()
            comm.configure(before, store=address, epoch=epoch, abort=never)
            for name, members in before.items():  # a step: one all-reduce per gradient group
                if name.startswith("grad-") and me in members:
                    comm.allreduce(name, torch.ones(4), never)
            barrier(f"r{rep}/{strategy}/ready", world)
            if rank == lost:
                barrier(f"r{rep}/{strategy}/end", world)
                continue
            comm.mark_broken()  # a fault interrupted every rank
            if strategy == "full":
                comm = communicator()
            barrier(f"r{rep}/{strategy}/start", world - 1)
            start = time.perf_counter()
            stats = comm.configure(after, store=address, epoch=epoch + 1, abort=never)
            seconds = time.perf_counter() - start
            for name, members in after.items():  # every group works
                if name.startswith("grad-") and me in members:
                    t = torch.ones(4)
                    comm.allreduce(name, t, never)
                    if t[0].item() != len(members):
                        raise RuntimeError(f"{name}: {t[0].item()} != {len(members)}")
            records.append({"rep": rep, "strategy": strategy, "seconds": seconds,
                            "kept": len(stats.kept), "built": len(stats.rebuilt),
                            "dropped": len(stats.dropped)})  # fmt: skip
            barrier(f"r{rep}/{strategy}/end", world)
    store.set(f"result/{rank}", json.dumps(records))
    barrier("exit", world)


# ---- parent side -------------------------------------------------------------------------------
def _measure(dp: int, pp: int, repeat: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    world, lost = dp * pp, pp - 1
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    began = time.time()
    mp.start_processes(_worker, args=(port, dp, pp, repeat), nprocs=world, start_method="spawn")
    per_rank = {r: json.loads(store.get(f"result/{r}")) for r in range(world) if r != lost}
    out: dict[str, Any] = {"dp": dp, "pp": pp, "world": world, "seconds": 0.0}
    for strategy in STRATEGIES:
        trials = []
        for rep in range(repeat):
            recs = [x for v in per_rank.values() for x in v
                    if x["rep"] == rep and x["strategy"] == strategy]  # fmt: skip
            if len(recs) != world - 1:
                raise BenchError(f"{dp}×{pp} {strategy} rep {rep}: {len(recs)} survivor records")
            trials.append({
                "slowest_s": max(x["seconds"] for x in recs),
                "kept": sum(x["kept"] for x in recs), "built": sum(x["built"] for x in recs),
                "dropped": sum(x["dropped"] for x in recs),
            })  # fmt: skip
        out[strategy] = {
            "configure": summarize(t["slowest_s"] for t in trials),
            "kept": trials[0]["kept"], "built": trials[0]["built"],
            "dropped": trials[0]["dropped"],
        }  # fmt: skip
    before, after = plan_groups(dp, pp, None), plan_groups(dp, pp, lost)
    out["groups_before"], out["groups_after"] = len(before), len(after)
    out["groups_kept"] = sum(1 for n in after if before.get(n) == after[n])
    full, edit = out["full"]["configure"]["median"], out["edit"]["configure"]["median"]
    out["ratio_full_edit"] = full / edit if edit else None
    out["seconds"] = round(time.time() - began, 1)
    return out


def run(repeat: int, config: Path) -> dict[str, Any]:  # noqa: ARG001 - no job config needed
    grids = []
    for dp, pp in GRIDS:
        g = _measure(dp, pp, repeat)
        grids.append(g)
        console.print(f"dp {dp} × pp {pp}: edit {ms(g['edit']['configure']['median'])} ms, "
                      f"full {ms(g['full']['configure']['median'])} ms ({g['seconds']:.0f} s, "
                      f"load {os.getloadavg()[0]:.1f})")  # fmt: skip
    return {"scenario": "gradgroups", "repeat": repeat, "layers_per_stage": LAYERS_PER_STAGE,
            "grids": grids}  # fmt: skip


def show(result: dict[str, Any]) -> None:
    rows = []
    for g in result["grids"]:
        for s in STRATEGIES:
            c = g[s]["configure"]
            rows.append((f"{g['dp']} × {g['pp']}", s, ms(c["median"]),
                         f"{ms(c['min'])}–{ms(c['max'])}",
                         f"{g[s]['built']} / {g[s]['kept']} / {g[s]['dropped']}"))  # fmt: skip
    print_table(
        f"Groups after replica 0's last stage dies, slowest survivor's configure, ms over "
        f"{result['repeat']} reps",
        ("dp × pp", "strategy", "median", "min–max", "built / kept / dropped (all ranks)"),
        rows,
    )
    print_table(
        "Per grid",
        ("dp × pp", "groups before", "after", "of them unchanged", "full / edit"),
        [(f"{g['dp']} × {g['pp']}", str(g["groups_before"]), str(g["groups_after"]),
          str(g["groups_kept"]), f"{g['ratio_full_edit']:.2f}") for g in result["grids"]],
    )  # fmt: skip
