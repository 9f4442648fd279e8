"""Bytes between hosts and step time, gradient reduced by one flat ring vs by tiers.

Two hosts × four workers, each host a network namespace of the multi-host bed
(elaswave.testing.netbed: real etcd, real daemons, gloo over veths), the 10 M-parameter Llama of
``bench/llama-10m.yaml`` (transformers, random init), data parallelism. For each link — unshaped,
then each host's egress shaped by ``tc`` (a token bucket at 400 and at 100 Mbit/s) — one job with
``train.hierarchy: flat``, one with ``auto`` (summed inside each host, each lane between the hosts,
shared back) and one with ``auto`` and ``train.grad_compress: int8`` (the lanes cross as block-wise
int8).

Per job: the bytes each host's ``eth0`` sent per step (its veth counter sampled while the job
runs, between the commits of step ``WARM`` and of the last step: the gradients, and the etcd
and control traffic beside them) and the median step time over the same steps. The theory for
ranks laid out host by host, M the gradient buffer's bytes: a flat ring sends
2 (N − 1) / N × M per host across (1.75 M at N = 8), the tiers 2 (H − 1) / H × M (1.0 M), int8
lanes (H − 1) × M / 4 × (1 + 4 / 256) (0.25 M: an all-gather of each host's codes and scales).

Four hosts of two (``wide``, unshaped): the same 8 workers, where the tiers save less (theory: flat
1.75 M, tiers 2 (H − 1) / H = 1.5 M, int8 0.76 M).

After a worker's loss (``killed``): the flat and the tiers job on the unshaped link, rank 1 (the
second worker of the host that holds ranks 0-3) SIGKILLed at step ``KILL_STEP`` and not
respawned: the MTTR of each (the report's), and the bytes in a window that starts
``KILL_WINDOW`` steps later (the new plan in place) and runs ``STEPS - WARM`` steps. With tiers
that host then has three workers for four lanes (the lost worker's lane goes to its first);
each host should still send about 2 (H − 1) / H × M.

ZeRO-3 (``zero3``, unshaped and 100 Mbit/s): three jobs with ``zero: 3``. Each layer is
all-gathered for its forward (a ring over all 8 ranks) and again for its backward, and its
gradient reduced as backward produces it. ``flat``: every collective over all ranks. ``tiers``
(``hpz: off``): the gradient by tiers (an all-reduce of which each rank keeps its part, as gloo's
reduce-scatter is underneath): 2 (N − 1) / N − 2 (H − 1) / H = 0.75 M per host per step less.
``hpz``: the tiers, and each layer's backward gathered inside the host from the secondary parts
its forward left (1/4 of the layer per rank): the backward ring's (N − 1) / N = 0.88 M per host
less again (all layers but the last, which is gathered once). ``hpz-gather``: that, and each
layer's forward gathered by tiers (``zero3_gather: tiers``: each host's parts inside the host,
the lanes between them): the forward ring's 0.88 M becomes (H − 1) / H = 0.5 M. ``hsdp``
(``shard_scope: host``): each host holds the whole model over its four ranks, so no gather leaves
the host and no snapshot is sent; only the gradient crosses, by tiers: 2 (H − 1) / H = 1.0 M.

Pipelines (``pp``, unshaped): ``pp: 2`` on the 8 workers, so each stage's 4 holders span both
hosts, 2 on each; flat: each holder group's ring (a host sends 2 × (4 − 1) / 4 × M_s per stage
it holds, M_s a stage's gradient) vs by tiers (2 (H − 1) / H × M_s).

ZeRO-3 after a worker's loss (``zero3-killed``, unshaped): rank 1 SIGKILLed at ``KILL_STEP`` and
not respawned, shards over every rank (hpZ on: the survivors promote the snapshot pieces they
hold) or inside each host (the lost ranges read from the other host's copy): the MTTR of each.

ZeRO-1 (``zero1``, unshaped and 100 Mbit/s): the flat and the tiers job with ``zero: 1``: the
gradient all-reduced and the updated parameters all-gathered, over one ring each (3 (N − 1) / N
= 2.63 M per host per step) or by tiers (2 (H − 1) / H + (H − 1) / H = 1.5 M: each host's
block of shards crosses once, lane by lane).

What int8 does to training: ``CURVE_STEPS`` steps of gpt-tiny (configs/gpt-tiny.yaml) on two
hosts × two workers, float32, tiers with and without int8: the largest and the last relative
distance between the two loss curves.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench.common import BenchError, bench_env, diffs, print_table, read_jsonl, write_config
from elaswave.testing import netbed

DESCRIPTION = (
    "bytes between hosts and step time: flat ring, tiers, int8 lanes (2 netns hosts × 4, 10 M)"
)
DEFAULT_REPEAT = 1
HOSTS, PER_HOST = 2, 4
WIDE = (4, 2)  # the same 8 workers on 4 hosts of 2 (unshaped): where tiers save less
STEPS = 8
WARM = 2  # steps before the measured window (start-up, the first step's allocations)
LINKS = ("unshaped", "400mbit", "100mbit")
# mode -> (train.hierarchy, train.grad_compress)
MODES = {"flat": ("flat", "off"), "auto": ("auto", "off"), "int8": ("auto", "int8")}
CONFIG = Path(__file__).with_name("llama-10m.yaml")
CURVE_CONFIG = Path(__file__).parents[1] / "configs" / "gpt-tiny.yaml"
CURVE_STEPS = 200
KILL_STEP, KILL_WINDOW = 3, 3  # the killed cell: fault at step 3, measured from step 6
ZERO3_LINKS = ("unshaped", "100mbit")
# what ``--parts`` picks from (all by default): data parallelism's links × modes, ZeRO-3's and
# ZeRO-1's, the killed and the wide layout, and int8's curve
PARTS = ("dp", "zero3", "zero1", "pp", "killed", "zero3-killed", "wide", "curve")
# ZeRO-3's modes -> (the mode's hierarchy, train.hpz, train.zero3_gather, train.shard_scope)
ZERO3_MODES = {
    "flat": ("flat", "off", "flat", "job"),
    "tiers": ("auto", "off", "flat", "job"),
    "hpz": ("auto", "auto", "flat", "job"),
    "hpz-gather": ("auto", "auto", "tiers", "job"),
    "hsdp": ("auto", "off", "flat", "host"),
}


Cells = dict[str, dict[str, list[dict[str, Any]]]]  # link → mode → one result per round


def require_bed() -> None:
    reason = netbed.skip_reason()
    if reason:
        raise BenchError(f"the netns test bed is unavailable: {reason}")


def one_round(
    cells: Cells, name: str, i: int, job: Callable[..., tuple[dict[str, Any], int]]
) -> int:
    """Round ``i`` of every (link, mode) of ``cells``, side by side: ``job(tmp, job_id, link,
    mode)`` in a directory of its own, its result appended; returns the gradient's bytes."""
    grad = 0
    for link, modes in cells.items():
        for mode, results in modes.items():
            with tempfile.TemporaryDirectory(prefix="elaswave-bench-") as tmp:
                cell, grad = job(Path(tmp), f"{name}-{link}-{mode}-{i}", link, mode)
            results.append(cell)
    return grad


def run(repeat: int, config: Path, parts: list[str] | None = None) -> dict[str, Any]:
    """Every part of :data:`PARTS` (``parts``: only those), ``repeat`` rounds each."""
    del config  # the 10 M llama, always
    parts = list(PARTS) if parts is None else parts
    require_bed()
    cells: Cells = {link: {mode: [] for mode in MODES} for link in LINKS} if "dp" in parts else {}
    grad_bytes = 0
    killed: dict[str, list[dict[str, Any]]] = {"flat": [], "auto": []}
    zero3_killed: dict[str, list[dict[str, Any]]] = {"job": [], "host": []}
    wide: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    zero3: Cells = {link: {m: [] for m in ZERO3_MODES} for link in ZERO3_LINKS}
    zero1: Cells = {link: {"flat": [], "auto": []} for link in ZERO3_LINKS}
    pp: Cells = {"unshaped": {"flat": [], "auto": []}}
    for i in range(repeat):
        grad_bytes = one_round(cells, "hier", i, _one_job) or grad_bytes
        if "zero3" in parts:
            grad_bytes = one_round(zero3, "hier-zero3", i, _zero3_job) or grad_bytes
        if "zero1" in parts:
            grad_bytes = one_round(zero1, "hier-zero1", i, lambda *a: _one_job(*a, zero=1))
        if "pp" in parts:
            one_round(pp, "hier-pp", i, lambda *a: _one_job(*a, pp=2))
        if "killed" in parts:
            one_round({"unshaped": killed}, "hier-killed", i, lambda *a: _one_job(*a, killed=True))
        if "zero3-killed" in parts:
            one_round({"unshaped": zero3_killed}, "hier-zero3-killed", i, _zero3_killed_job)
        if "wide" in parts:
            one_round({"unshaped": wide}, "hier-wide", i, lambda *a: _one_job(*a, layout=WIDE))
    curve = None
    if "curve" in parts:
        with tempfile.TemporaryDirectory(prefix="elaswave-bench-") as tmp:
            curves = {c: _curve(Path(tmp) / c, c) for c in ("off", "int8")}
        exact, int8 = curves["off"], curves["int8"]
        deviation = [abs(int8[s] - exact[s]) / abs(exact[s]) for s in sorted(exact)]
        curve = {
            "steps": CURVE_STEPS,
            "max_rel_deviation": max(deviation),
            "final_rel_deviation": deviation[-1],
            "final_loss": {"exact": exact[CURVE_STEPS], "int8": int8[CURVE_STEPS]},
        }
    theory = _theory(HOSTS, PER_HOST)
    return {
        "scenario": "hier",
        "repeat": repeat,
        "parts": parts,
        "hosts": HOSTS,
        "per_host": PER_HOST,
        "steps": STEPS,
        "warm": WARM,
        "grad_bytes": grad_bytes,
        "theory_per_host": theory,
        "cells": cells,
        "killed": killed if "killed" in parts else None,
        "zero3_killed": zero3_killed if "zero3-killed" in parts else None,
        "wide": {"layout": list(WIDE), "cells": wide, "theory_per_host": _theory(*WIDE)}
        if "wide" in parts
        else None,
        "zero3": {"cells": zero3, "theory_saved": theory["flat"] - 1.0}
        if "zero3" in parts
        else None,
        "zero1": {"cells": zero1, "theory_per_host": _zero1_theory(HOSTS, PER_HOST)}
        if "zero1" in parts
        else None,
        "pp": {"cells": pp} if "pp" in parts else None,
        "curve": curve,
    }


def _theory(hosts: int, per_host: int) -> dict[str, float]:
    """Bytes per host per step across, × M: a flat ring, the tiers, int8 lanes."""
    n = hosts * per_host
    return {"flat": 2 * (n - 1) / n, "auto": 2 * (hosts - 1) / hosts,
            "int8": (hosts - 1) / 4 * (1 + 4 / 256)}  # fmt: skip


def _zero3_job(tmp: Path, job: str, link: str, mode: str) -> tuple[dict[str, Any], int]:
    hierarchy, hpz, gather, scope = ZERO3_MODES[mode]
    return _one_job(tmp, job, link, hierarchy, zero=3, hpz=hpz, gather=gather, scope=scope)


def _zero3_killed_job(tmp: Path, job: str, link: str, scope: str) -> tuple[dict[str, Any], int]:
    """ZeRO-3 (hpZ as by default) with its shards over every rank or inside each host, rank 1
    SIGKILLed: the job scope promotes the snapshot pieces the survivors hold, the host scope
    reads the lost ranges from the other host."""
    return _one_job(tmp, job, link, "auto", killed=True, zero=3, hpz="auto", scope=scope)


def _zero1_theory(hosts: int, per_host: int) -> dict[str, float]:
    """ZeRO-1's bytes per host per step across, × M: the all-reduce and the all-gather."""
    n = hosts * per_host
    return {"flat": 3 * (n - 1) / n, "auto": 3 * (hosts - 1) / hosts}


def _one_job(
    tmp: Path,
    job: str,
    link: str,
    mode: str,
    *,
    killed: bool = False,
    layout: tuple[int, int] = (HOSTS, PER_HOST),
    zero: int = 0,
    hpz: str = "off",
    pp: int = 1,
    gather: str = "flat",
    scope: str = "job",
) -> tuple[dict[str, Any], int]:
    """One job's bytes per host per step and median step over the window (``killed``: rank 1
    SIGKILLed at ``KILL_STEP``; the window after the new plan; ``zero``: the data-parallel
    mode; ``hpz``: ZeRO-3's host-local backward gathers; ``scope``: ZeRO-3's shards over every
    rank or inside each host)."""
    hierarchy, compress = MODES[mode]
    warm = KILL_STEP + KILL_WINDOW if killed else WARM
    steps = warm + STEPS - WARM
    cfg = write_config(tmp / "job.yaml", CONFIG, {
        "zero": zero,
        "pp": pp,
        "train": {"steps": steps, "hierarchy": hierarchy, "grad_compress": compress,
                  "hpz": hpz, "zero3_gather": gather, "shard_scope": scope},
        "elastic": {"nproc_per_node": layout[1], "nnodes": f"{layout[0]}:{layout[0]}"},
    })  # fmt: skip
    bed = netbed.NetBed(tmp, config=cfg, hosts=layout[0])
    try:
        bed.start()
        if link != "unshaped":
            for host in bed.hosts:
                shape(bed.ns(host), link)
        fault = ["--fault", f"kill,rank=1,at_step={KILL_STEP}"] if killed else []
        with counting(lambda: [tx_bytes(bed.ns(h)) for h in bed.hosts]) as samples:
            run_job(bed, tmp, job, fault)
        commits = commit_times(bed, steps)
        t0, t1 = commits[warm], commits[steps]
        sent = sent_between(samples, t0, t1)
        times = diffs([commits[s] for s in range(warm, steps + 1)])
        grad = grad_bytes_of(bed, sharded=zero == 3)
        if scope == "host":  # every host's shards add up to the whole model
            grad //= layout[0]
        mttr = None
        if killed:
            from elaswave.report import build_report

            (incident,) = build_report(*(bed.run_dirs[h] for h in bed.hosts))["incidents"]
            mttr = incident["mttr_s"]
        return {
            "mttr_s": mttr,
            "per_host_bytes_per_step": [s / (steps - warm) for s in sent],
            "step_s": statistics.median(times),
            "lanes": tier_groups(bed),
            "world_after": _world_after(bed),
        }, grad
    finally:
        bed.close()


@contextlib.contextmanager
def counting(read: Callable[[], list[int]]) -> Iterator[list[tuple[float, list[int]]]]:
    """``read()`` (byte counters) sampled every 0.2 s while the block runs: (time, counters)."""
    samples: list[tuple[float, list[int]]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.time(), read()))
            stop.wait(0.2)

    poller = threading.Thread(target=sample, daemon=True)
    poller.start()
    try:
        yield samples
    finally:
        stop.set()
        poller.join()


def _curve(tmp: Path, compress: str) -> dict[int, float]:
    """The loss per step of gpt-tiny on two hosts × two workers, by tiers, ``compress``."""
    tmp.mkdir(parents=True)
    cfg = write_config(tmp / "job.yaml", CURVE_CONFIG, {
        "train": {"steps": CURVE_STEPS, "hierarchy": "auto", "grad_compress": compress},
        "elastic": {"nproc_per_node": 2, "nnodes": "2:2"},
    })  # fmt: skip
    bed = netbed.NetBed(tmp, config=cfg, hosts=2)
    try:
        bed.start()
        run_job(bed, tmp, f"curve-{compress}")
        losses = {m["step"]: m["loss"] for h in bed.hosts
                  for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")}  # fmt: skip
    finally:
        bed.close()
    if sorted(losses) != list(range(1, CURVE_STEPS + 1)):
        raise BenchError(f"curve {compress}: steps committed {sorted(losses)}")
    return losses


def run_job(bed: Any, tmp: Path, job: str, extra: list[str] | None = None) -> None:
    """Launch ``job`` on every host of the started ``bed`` (``extra``: more launch flags, the
    same on every host) and wait for it to end cleanly."""
    env = bench_env(tmp / "state", {"ELASWAVE_TIMEOUTS__RENDEZVOUS": "120"})
    for host in bed.hosts:
        bed.launch(host, "--job-id", job, *(extra or []), env=env)
    codes = bed.wait(timeout=900)
    if any(codes.values()):
        raise BenchError(f"{job}: exit codes {codes}: {bed.output(bed.hosts[0])[-500:]}")


def shape(ns: str, rate: str, dev: str = "eth0") -> None:
    """A token bucket on ``dev``'s egress: ``rate``, a 64 kB burst, 400 ms of queue."""
    subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    rate, "burst", "64kb", "latency", "400ms"], check=True)  # fmt: skip


def tx_bytes(ns: str, dev: str = "eth0") -> int:
    out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", dev],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def sent_between(samples: list[tuple[float, list[int]]], t0: float, t1: float) -> list[int]:
    """Each counter's growth from ``t0`` to ``t1``."""
    return [b - a for a, b in zip(counters_at(samples, t0), counters_at(samples, t1), strict=True)]


def counters_at(samples: list[tuple[float, list[int]]], t: float) -> list[int]:
    """The counters sampled last at or before ``t`` (the first sample if none)."""
    before = [c for when, c in samples if when <= t]
    return before[-1] if before else samples[0][1]


def commit_times(bed: Any, steps: int = STEPS) -> dict[int, float]:
    """When each step was committed (its record's time), over every host's records."""
    out: dict[int, float] = {}
    for h in bed.hosts:
        for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl"):
            out.setdefault(m["step"], m["time"])
    if sorted(out) != list(range(1, steps + 1)):
        raise BenchError(f"steps committed: {sorted(out)}")
    return out


def _world_after(bed: Any) -> int:
    """The world size of the last step committed."""
    last = [m for h in bed.hosts for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")]
    return int(max(last, key=lambda m: m["step"])["world_size"])


def _events(bed: Any, kind: str) -> list[dict[str, Any]]:
    return [e for h in bed.hosts for e in read_jsonl(bed.run_dirs[h] / "events.jsonl")
            if e["kind"] == kind]  # fmt: skip


def grad_bytes_of(bed: Any, sharded: bool = False) -> int:
    """The reduction buffer's bytes (every rank's parameters, float32, and a short tail); with
    ``sharded`` (ZeRO-3: a rank holds its shard only), the first plan's shards added up."""
    memory = _events(bed, "memory")
    if not memory:
        return 0
    if not sharded:
        return int(memory[0].get("param_bytes", 0))
    first = {e["worker"]: e["param_bytes"] for e in memory if e.get("epoch") == 1}
    return int(sum(first.values()))


def tier_groups(bed: Any) -> list[str]:
    built = {g for e in _events(bed, "comm_rebuilt") for g in e["rebuilt"]}
    return sorted(g for g in built if g.startswith("dp."))


def _medians(modes: dict[str, list[dict[str, Any]]]) -> tuple[dict[str, float], dict[str, float]]:
    """Each mode's median over rounds of its bytes per host per step, and of its step time."""
    sent = {m: statistics.median(statistics.mean(c["per_host_bytes_per_step"]) for c in cs)
            for m, cs in modes.items()}  # fmt: skip
    return sent, {m: statistics.median(c["step_s"] for c in cs) for m, cs in modes.items()}


def show(result: dict[str, Any]) -> None:
    grad = result["grad_bytes"] or 1
    mb = 1 / 2**20
    if result["cells"]:
        _show_dp(result, grad, mb)
    theory = result["theory_per_host"]
    for mode, killed in (result.get("killed") or {}).items():
        per_host = [statistics.median(c["per_host_bytes_per_step"][h] for c in killed)
                    for h in range(result["hosts"])]  # fmt: skip
        mttr = statistics.median(c["mttr_s"] for c in killed)
        n = result["hosts"] * result["per_host"] - 1  # ranks after the kill
        expect = theory["auto"] if mode == "auto" else 2 * (n - 1) / n
        print_table(
            f"{mode} after rank 1 was SIGKILLed at step {KILL_STEP}: MTTR {mttr:.2f} s (unshaped; "
            f"theory per host {expect:.2f} M)",
            ("host", "MB sent per step", "× M", "world after", "step s"),
            [(f"host {h}", f"{b * mb:.1f}", f"{b / grad:.2f}", str(killed[0]["world_after"]),
              f"{statistics.median(c['step_s'] for c in killed):.2f}")
             for h, b in enumerate(per_host)],
        )  # fmt: skip
    zero3_killed = result.get("zero3_killed")
    if zero3_killed:
        rows = []
        for scope, cs in zero3_killed.items():
            mttr = [c["mttr_s"] for c in cs]
            sent = statistics.median(statistics.mean(c["per_host_bytes_per_step"]) for c in cs)
            rows.append(
                (
                    scope,
                    f"{statistics.median(mttr):.2f} ({min(mttr):.2f}-{max(mttr):.2f})",
                    f"{sent * mb:.1f}",
                    f"{statistics.median(c['step_s'] for c in cs):.2f}",
                )
            )
        print_table(
            f"ZeRO-3 after rank 1 was SIGKILLed at step {KILL_STEP} (unshaped): shards over every "
            "rank (snapshot pieces promoted) or inside each host (the lost ranges from the other "
            "host)",
            ("shard scope", "MTTR s (median, min-max)", "MB/host/step after", "step s after"),
            rows,
        )  # fmt: skip
    wide = result.get("wide")
    if wide:
        h, k = wide["layout"]
        med, step = _medians(wide["cells"])
        print_table(
            f"The same 8 workers on {h} hosts × {k} (unshaped)",
            ("mode", "MB/host/step", "× M", "theory × M", "step s", "step / flat"),
            [(mode, f"{b * mb:.1f}", f"{b / grad:.2f}", f"{wide['theory_per_host'][mode]:.2f}",
              f"{step[mode]:.2f}", f"{step[mode] / step['flat']:.2f}")
             for mode, b in med.items()],
        )  # fmt: skip
    zero3 = result.get("zero3")
    if zero3:
        rows = []
        for link, modes in zero3["cells"].items():
            b, t = _medians(modes)
            sent = [f"{b[m] * mb:.1f} ({b[m] / grad:.2f} M)" for m in modes]
            steps = [f"{t[m]:.2f}" for m in modes]
            ratios = [f"{t[m] / t['flat']:.2f}" for m in modes if m != "flat"]
            rows.append((link, *sent, *steps, *ratios))
        shown = list(modes)  # the modes the result has (an older one: fewer)
        print_table(
            f"ZeRO-3, {result['hosts']} hosts × {result['per_host']} workers: flat; the "
            f"gradient by tiers (theory: {zero3['theory_saved']:.2f} M per host less); and the "
            f"backward gathers inside the host (hpz); shards inside each host (hsdp)",
            ("link", *(f"{m}: MB/host/step" for m in shown), *(f"{m} step s" for m in shown),
             *(f"{m} / flat" for m in shown if m != "flat")),
            rows,
        )  # fmt: skip
    zero1 = result.get("zero1")
    if zero1:
        rows = []
        for link, modes in zero1["cells"].items():
            b, t = _medians(modes)
            theory = zero1["theory_per_host"]
            rows.append((link, *(f"{b[m] * mb:.1f} ({b[m] / grad:.2f} M; {theory[m]:.2f})"
                                 for m in ("flat", "auto")),
                         f"{b['flat'] / b['auto']:.2f}", f"{t['flat']:.2f}", f"{t['auto']:.2f}",
                         f"{t['auto'] / t['flat']:.2f}"))  # fmt: skip
        print_table(
            f"ZeRO-1, {result['hosts']} hosts × {result['per_host']} workers: the gradient's "
            "all-reduce and the parameters' all-gather, flat vs by tiers (theory × M)",
            ("link", "flat: MB/host/step", "tiers", "flat / tiers", "flat step s",
             "tiers step s", "tiers / flat"),
            rows,
        )  # fmt: skip
    pp = result.get("pp")
    if pp:
        b, t = _medians(pp["cells"]["unshaped"])
        print_table(
            f"pp = 2 on {result['hosts']} hosts × {result['per_host']} workers (unshaped): each "
            "stage's holder group flat vs by tiers",
            ("flat: MB/host/step", "tiers", "flat / tiers", "flat step s", "tiers step s",
             "tiers / flat"),
            [(f"{b['flat'] * mb:.1f}", f"{b['auto'] * mb:.1f}", f"{b['flat'] / b['auto']:.2f}",
              f"{t['flat']:.2f}", f"{t['auto']:.2f}", f"{t['auto'] / t['flat']:.2f}")],
        )  # fmt: skip
    curve = result["curve"]
    if not curve:
        return
    print_table(
        f"int8 lanes vs exact tiers, gpt-tiny, 2 hosts × 2 workers, {curve['steps']} steps",
        ("max relative loss deviation", "at the last step", "last loss exact", "last loss int8"),
        [(f"{curve['max_rel_deviation']:.2e}", f"{curve['final_rel_deviation']:.2e}",
          f"{curve['final_loss']['exact']:.4f}", f"{curve['final_loss']['int8']:.4f}")],
    )  # fmt: skip


def _show_dp(result: dict[str, Any], grad: float, mb: float) -> None:
    rows = []
    for link, modes in result["cells"].items():
        b, t = _medians(modes)
        (fb, ft), (hb, ht), (qb, qt) = ((b[m], t[m]) for m in ("flat", "auto", "int8"))
        rows.append((link, f"{fb * mb:.1f} ({fb / grad:.2f} M)",
                     f"{hb * mb:.1f} ({hb / grad:.2f} M)", f"{qb * mb:.1f} ({qb / grad:.2f} M)",
                     f"{fb / hb:.2f}", f"{ft:.2f}", f"{ht:.2f}", f"{qt:.2f}", f"{ht / ft:.2f}",
                     f"{qt / ft:.2f}"))  # fmt: skip
    theory = result["theory_per_host"]
    print_table(
        f"Flat ring vs tiers vs tiers with int8 lanes, {result['hosts']} hosts × "
        f"{result['per_host']} workers (M = {grad * mb:.1f} MB of gradient; theory per host: "
        f"flat {theory['flat']:.2f} M, tiers {theory['auto']:.2f} M, int8 "
        f"{theory['int8']:.2f} M)",
        ("link", "flat: MB/host/step", "tiers", "tiers int8", "flat / tiers bytes",
         "flat step s", "tiers step s", "int8 step s", "tiers / flat", "int8 / flat"),
        rows,
    )  # fmt: skip
