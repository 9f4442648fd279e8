"""Communicator recovery: what rebuilding the process groups costs after one rank fails.

For each world size W, W processes (``torch.multiprocessing`` spawn, one TCPStore master here)
hold a hybrid dp×pp = (W/2)×2 layout of gloo groups, built the way ElasWave's runtime builds
them (``ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)``): one ``world``
group, W/2 ``pp`` pairs (ranks 2i, 2i+1) and two ``dp`` groups (one per stage). Then rank 1
leaves (simulated: it drops its groups and takes no further part) and the survivors reconfigure
to the same groups without it, by one of three strategies:

- ``full``: every group is recreated under a new prefix;
- ``partial``: only the groups that contained rank 1 (world, pp0, dp1) are recreated; the others
  are kept, and checked with a small allreduce, timed separately: ``check`` is how much later
  than the slowest rebuild the last check ends (a check also waits for its peers' rebuilds);
- ``in-place``: ``pg.shrink([failed])`` on the groups that contained rank 1, if this torch
  build's ``ProcessGroupGloo.supports_shrinking`` says so. Otherwise the reason is recorded.

Per trial the figure is the slowest survivor's rebuild time: that is how long the job waits.
The processes are spawned once per world size; repetitions and strategies (rotated, so that
drift hits all of them alike) all run inside them.
"""

from __future__ import annotations

import datetime
import json
import os
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

DESCRIPTION = "process-group recovery after a rank fails: full vs partial rebuild vs shrink"
DEFAULT_REPEAT = 5
WORLDS = (4, 8, 16)
FAILED = 1
STRATEGIES = ("full", "partial", "in-place")
PG_TIMEOUT_S = 60.0


# ---- layout ------------------------------------------------------------------------------------
def groups_of(rank: int, world: int) -> dict[str, list[int]]:
    """The groups ``rank`` belongs to in the dp×pp = (world/2)×2 layout, in build order."""
    stage = rank % 2
    return {
        "world": list(range(world)),
        f"pp{rank // 2}": [rank - stage, rank - stage + 1],
        f"dp{stage}": list(range(stage, world, 2)),
    }


# ---- worker side -------------------------------------------------------------------------------
def _worker(rank: int, port: int, world: int, repeat: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )  # fmt: skip
    device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")

    def build(prefix: str, members: list[int]) -> Any:
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [device]
        opts._timeout = timeout
        pg_store = dist.PrefixStore(prefix, store)
        return dist.ProcessGroupGloo(pg_store, members.index(rank), len(members), opts)

    def allreduce_ok(pg: Any, size: int) -> None:
        t = torch.ones(4)
        pg.allreduce([t]).wait()
        if t[0].item() != size:
            raise RuntimeError(f"allreduce gave {t[0].item()}, expected {size}")

    def barrier(key: str, count: int) -> None:
        store_barrier(store, key, count)

    mine = groups_of(rank, world)
    survivors = world - 1
    records: list[dict[str, Any]] = []
    shrink: dict[str, Any] | None = None  # the in-place probe's verdict, found in the first trial
    for rep in range(repeat):
        for k in range(len(STRATEGIES)):
            strategy = STRATEGIES[(rep + k) % len(STRATEGIES)]
            if strategy == "in-place" and store.check(["shrink/unsupported"]):
                continue  # unsupported: recorded once, nothing to time
            tag = f"w{world}/r{rep}/{strategy}"
            old = {n: (m, build(f"{tag}/old/{n}", m)) for n, m in mine.items()}
            for m, pg in old.values():
                allreduce_ok(pg, len(m))
            barrier(f"{tag}/ready", world)
            if rank == FAILED:  # "leaves": drops its groups, waits for the survivors to finish
                old.clear()
                store.set(f"{tag}/left", "1")
                barrier(f"{tag}/end", world)
                continue
            store.wait([f"{tag}/left"])
            barrier(f"{tag}/start", survivors)
            t_start, c0 = time.time(), time.perf_counter()
            new: dict[str, tuple[list[int], Any]] = {}
            kept: dict[str, tuple[list[int], Any]] = {}
            error, world_s = None, 0.0
            for name, (members, pg) in old.items():
                after = [r for r in members if r != FAILED]
                if strategy == "partial" and after == members:
                    kept[name] = (members, pg)
                elif strategy == "full" or after != members and strategy == "partial":
                    g0 = time.perf_counter()
                    new[name] = (after, build(f"{tag}/new/{name}", after))
                    if name == "world":
                        world_s = time.perf_counter() - g0
                elif after != members:  # in-place
                    if shrink is None:
                        shrink = {"supported": bool(pg.supports_shrinking), "error": None}
                    try:
                        new[name] = (after, pg.shrink([members.index(FAILED)]))
                    except Exception as exc:  # noqa: BLE001 - the reason is the result
                        error = f"{type(exc).__name__}: {exc}"
                        shrink.update(supported=False, error=error)
                        break
                else:
                    kept[name] = (members, pg)  # in-place: untouched groups stay as they are
            c1 = time.perf_counter()
            for members, pg in kept.values():
                if strategy == "partial":
                    allreduce_ok(pg, len(members))
            c2 = time.perf_counter()
            if error is None:
                for members, pg in new.values():
                    allreduce_ok(pg, len(members))
            records.append({
                "rep": rep, "strategy": strategy, "rebuild_s": c1 - c0, "check_s": c2 - c1,
                "world_s": world_s,
                "built": len(new), "kept": len(kept), "t_start": t_start,
                "t_end": t_start + (c1 - c0),
                "t_checked": t_start + (c2 - c0), "error": error,
            })  # fmt: skip
            if error is not None and rank == 0:
                store.set("shrink/unsupported", error)  # before "end": every rank sees it next
            barrier(f"{tag}/end", world)
            del old, new, kept
    store.set(f"result/{rank}", json.dumps({"records": records, "shrink": shrink}))
    barrier("exit", world)  # rank 0 of the job must not tear down under the others


# ---- parent side -------------------------------------------------------------------------------
def _measure(world: int, repeat: int) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    began = time.time()
    mp.start_processes(_worker, args=(port, world, repeat), nprocs=world, start_method="spawn")
    per_rank = {
        r: json.loads(store.get(f"result/{r}")) for r in range(world) if r != FAILED
    }  # fmt: skip
    probe = next((v["shrink"] for v in per_rank.values() if v["shrink"]), None)
    trials: dict[str, list[dict[str, Any]]] = {s: [] for s in STRATEGIES}
    for rep in range(repeat):
        for strategy in STRATEGIES:
            recs = [
                rec for v in per_rank.values() for rec in v["records"]
                if rec["rep"] == rep and rec["strategy"] == strategy
            ]  # fmt: skip
            if not recs or any(rec["error"] for rec in recs):
                continue
            if len(recs) != world - 1:
                raise BenchError(
                    f"world {world} rep {rep} {strategy}: {len(recs)} survivor records"
                )
            trials[strategy].append({
                "rep": rep,
                "rebuild_max_s": max(rec["rebuild_s"] for rec in recs),
                "rebuild_span_s": max(rec["t_end"] for rec in recs)
                - min(rec["t_start"] for rec in recs),
                "check_max_s": max(rec["check_s"] for rec in recs),
                # what the check adds to the job's wait, beyond the slowest rebuild
                "check_extra_s": max(
                    0.0,
                    max(rec["t_checked"] for rec in recs) - max(rec["t_end"] for rec in recs),
                ),
                "world_group_max_s": max(rec["world_s"] for rec in recs),
                "groups_built": sum(rec["built"] for rec in recs),
                "groups_kept": sum(rec["kept"] for rec in recs),
            })  # fmt: skip
    summary = {
        s: {
            "rebuild": summarize(t["rebuild_max_s"] for t in trials[s]),
            "check": summarize(t["check_extra_s"] for t in trials[s]) if s == "partial" else None,
            "world_group": summarize(t["world_group_max_s"] for t in trials[s]),
        }
        for s in STRATEGIES
    }
    inplace = summary["in-place"]["rebuild"]["median"]
    full, partial = summary["full"]["rebuild"]["median"], summary["partial"]["rebuild"]["median"]
    return {
        "world": world,
        "survivors": world - 1,
        "seconds": round(time.time() - began, 1),
        "shrink": probe,
        "trials": trials,
        "summary": summary,
        "ratio_full_partial": full / partial if full and partial else None,
        "ratio_full_inplace": full / inplace if full and inplace else None,
    }


def run(repeat: int, config: Path) -> dict[str, Any]:  # noqa: ARG001 - no job config needed
    worlds = []
    for world in WORLDS:
        worlds.append(_measure(world, repeat))
        w = worlds[-1]
        console.print(
            f"world {world}: full {ms(w['summary']['full']['rebuild']['median'])} ms, "
            f"partial {ms(w['summary']['partial']['rebuild']['median'])} ms, "
            f"in-place {_inplace_text(w)} ({w['seconds']:.0f} s, "
            f"load {os.getloadavg()[0]:.1f})"
        )
    return {
        "scenario": "comm",
        "repeat": repeat,
        "layout": "dp×pp = (W/2)×2: world, pp pairs (2i, 2i+1), dp per stage; rank 1 fails",
        "failed_rank": FAILED,
        "pg_timeout_s": PG_TIMEOUT_S,
        "worlds": worlds,
    }


def _inplace_text(w: dict[str, Any]) -> str:
    probe = w["shrink"]
    if probe is None or probe["supported"] and not probe["error"]:
        return f"{ms(w['summary']['in-place']['rebuild']['median'])} ms"
    return "unsupported"


def show(result: dict[str, Any]) -> None:
    rows = []
    for w in result["worlds"]:
        for s in STRATEGIES:
            r = w["summary"][s]["rebuild"]
            if s == "in-place" and _inplace_text(w) == "unsupported":
                rows.append((f"{w['world']} → {w['survivors']}", s, "unsupported", "–", "–", "–"))
                continue
            check, of_world = w["summary"][s]["check"], w["summary"][s]["world_group"]["median"]
            rows.append((
                f"{w['world']} → {w['survivors']}", s, ms(r["median"]),
                f"{ms(r['min'])}–{ms(r['max'])}", ms(of_world) if of_world else "–",
                ms(check["median"]) if check else "–",
            ))  # fmt: skip
    print_table(
        f"Communicator recovery after rank {result['failed_rank']} fails, slowest survivor, "
        f"ms over {result['repeat']} reps",
        ("world", "strategy", "median", "spread (min–max)", "world group", "+ check kept"),
        rows,
    )
    ratios = [
        (str(w["world"]), _ratio(w["ratio_full_partial"]), _ratio(w["ratio_full_inplace"]))
        for w in result["worlds"]
    ]  # fmt: skip
    print_table("Ratios of medians", ("world", "full / partial", "full / in-place"), ratios)
    probe = next((w["shrink"] for w in result["worlds"] if w["shrink"]), None)
    if probe and (not probe["supported"] or probe["error"]):
        console.print(f"in-place: supports_shrinking={probe['supported']}; "
                      f"shrink() raised {probe['error']}", highlight=False)  # fmt: skip


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}"
