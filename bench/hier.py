"""Bytes between hosts and step time, gradient reduced by one flat ring vs by tiers.

Two hosts × four workers, each host a network namespace of the multi-host bed (elaswave.netbed:
real etcd, real daemons, gloo over veths), the 10 M-parameter Llama of ``bench/llama-10m.yaml``
(transformers, random init), data parallelism. For each link — unshaped, then each host's egress
shaped by ``tc`` (a token bucket at 400 and at 100 Mbit/s) — one job with ``train.hierarchy:
flat``, one with ``auto`` (summed inside each host, each lane between the hosts, shared back)
and one with ``auto`` and ``train.grad_compress: int8`` (the lanes cross as block-wise int8).

Per job: the bytes each host's ``eth0`` sent per step (its veth counter sampled while the job
runs, between the commits of step ``WARM`` and of the last step: the gradients, and the etcd
and control traffic beside them) and the median step time over the same steps. The theory for
ranks laid out host by host, M the gradient buffer's bytes: a flat ring sends
2 (N − 1) / N × M per host across (1.75 M at N = 8), the tiers 2 (H − 1) / H × M (1.0 M), int8
lanes (H − 1) × M / 4 × (1 + 4 / 256) (0.25 M: an all-gather of each host's codes and scales).

What int8 does to training: ``CURVE_STEPS`` steps of gpt-tiny (configs/gpt-tiny.yaml) on two
hosts × two workers, float32, tiers with and without int8: the largest and the last relative
distance between the two loss curves.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.common import BenchError, bench_env, diffs, print_table, read_jsonl, write_config
from elaswave import netbed

DESCRIPTION = (
    "bytes between hosts and step time: flat ring, tiers, int8 lanes (2 netns hosts × 4, 10 M)"
)
DEFAULT_REPEAT = 1
HOSTS, PER_HOST = 2, 4
STEPS = 8
WARM = 2  # steps before the measured window (start-up, the first step's allocations)
LINKS = ("unshaped", "400mbit", "100mbit")
# mode -> (train.hierarchy, train.grad_compress)
MODES = {"flat": ("flat", "off"), "auto": ("auto", "off"), "int8": ("auto", "int8")}
CONFIG = Path(__file__).with_name("llama-10m.yaml")
CURVE_CONFIG = Path(__file__).parents[1] / "configs" / "gpt-tiny.yaml"
CURVE_STEPS = 200


def run(repeat: int, config: Path) -> dict[str, Any]:
    del config  # the 10 M llama, always
    reason = netbed.skip_reason()
    if reason:
        raise BenchError(f"the netns test bed is unavailable: {reason}")
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {
        link: {mode: [] for mode in MODES} for link in LINKS
    }
    grad_bytes = 0
    for i in range(repeat):
        for link in LINKS:
            for mode in MODES:  # side by side on the same link, in the same round
                with tempfile.TemporaryDirectory(prefix="elaswave-bench-") as tmp:
                    cell, grad_bytes = _one_job(Path(tmp), f"hier-{link}-{mode}-{i}", link, mode)
                cells[link][mode].append(cell)
    with tempfile.TemporaryDirectory(prefix="elaswave-bench-") as tmp:
        curves = {c: _curve(Path(tmp) / c, c) for c in ("off", "int8")}
    exact, int8 = curves["off"], curves["int8"]
    deviation = [abs(int8[s] - exact[s]) / abs(exact[s]) for s in sorted(exact)]
    return {
        "scenario": "hier",
        "repeat": repeat,
        "hosts": HOSTS,
        "per_host": PER_HOST,
        "steps": STEPS,
        "warm": WARM,
        "grad_bytes": grad_bytes,
        "theory_per_host": {
            "flat": 2 * (HOSTS * PER_HOST - 1) / (HOSTS * PER_HOST),
            "auto": 2 * (HOSTS - 1) / HOSTS,
            "int8": (HOSTS - 1) / 4 * (1 + 4 / 256),
        },
        "cells": cells,
        "curve": {
            "steps": CURVE_STEPS,
            "max_rel_deviation": max(deviation),
            "final_rel_deviation": deviation[-1],
            "final_loss": {"exact": exact[CURVE_STEPS], "int8": int8[CURVE_STEPS]},
        },
    }


def _one_job(tmp: Path, job: str, link: str, mode: str) -> tuple[dict[str, Any], int]:
    hierarchy, compress = MODES[mode]
    cfg = write_config(tmp / "job.yaml", CONFIG, {
        "train": {"steps": STEPS, "hierarchy": hierarchy, "grad_compress": compress},
        "elastic": {"nproc_per_node": PER_HOST, "nnodes": f"{HOSTS}:{HOSTS}"},
    })  # fmt: skip
    bed = netbed.NetBed(tmp, config=cfg, hosts=HOSTS)
    try:
        bed.start()
        if link != "unshaped":
            for host in bed.hosts:
                _shape(bed.ns(host), link)
        samples: list[tuple[float, list[int]]] = []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                samples.append((time.time(), [_tx_bytes(bed.ns(h)) for h in bed.hosts]))
                stop.wait(0.2)

        poller = threading.Thread(target=sample, daemon=True)
        poller.start()
        try:
            _run_job(bed, tmp, job)
        finally:
            stop.set()
            poller.join()
        commits = _commits(bed)
        t0, t1 = commits[WARM], commits[STEPS]
        sent = [b - a for a, b in zip(_at(samples, t0), _at(samples, t1), strict=True)]
        times = diffs([commits[s] for s in range(WARM, STEPS + 1)])
        grad = _grad_bytes(bed)
        return {
            "per_host_bytes_per_step": [s / (STEPS - WARM) for s in sent],
            "step_s": statistics.median(times),
            "lanes": _lanes(bed),
        }, grad
    finally:
        bed.close()


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
        _run_job(bed, tmp, f"curve-{compress}")
        losses = {m["step"]: m["loss"] for h in bed.hosts
                  for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")}  # fmt: skip
    finally:
        bed.close()
    if sorted(losses) != list(range(1, CURVE_STEPS + 1)):
        raise BenchError(f"curve {compress}: steps committed {sorted(losses)}")
    return losses


def _run_job(bed: Any, tmp: Path, job: str) -> None:
    """Launch ``job`` on every host of the started ``bed`` and wait for it to end cleanly."""
    env = bench_env(tmp / "state", {"ELASWAVE_TIMEOUTS__RENDEZVOUS": "120"})
    for host in bed.hosts:
        bed.launch(host, "--job-id", job, env=env)
    codes = bed.wait(timeout=900)
    if any(codes.values()):
        raise BenchError(f"{job}: exit codes {codes}: {bed.output(bed.hosts[0])[-500:]}")


def _shape(ns: str, rate: str) -> None:
    """A token bucket on the host's egress: ``rate``, a 64 kB burst, 400 ms of queue."""
    subprocess.run(["tc", "-n", ns, "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate",
                    rate, "burst", "64kb", "latency", "400ms"], check=True)  # fmt: skip


def _tx_bytes(ns: str) -> int:
    out = subprocess.run(["ip", "-n", ns, "-s", "-j", "link", "show", "eth0"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


def _at(samples: list[tuple[float, list[int]]], t: float) -> list[int]:
    """The counters sampled last at or before ``t`` (the first sample if none)."""
    before = [c for when, c in samples if when <= t]
    return before[-1] if before else samples[0][1]


def _commits(bed: Any) -> dict[int, float]:
    """When each step was committed (its record's time), over every host's records."""
    out: dict[int, float] = {}
    for h in bed.hosts:
        for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl"):
            out.setdefault(m["step"], m["time"])
    if sorted(out) != list(range(1, STEPS + 1)):
        raise BenchError(f"steps committed: {sorted(out)}")
    return out


def _events(bed: Any, kind: str) -> list[dict[str, Any]]:
    return [e for h in bed.hosts for e in read_jsonl(bed.run_dirs[h] / "events.jsonl")
            if e["kind"] == kind]  # fmt: skip


def _grad_bytes(bed: Any) -> int:
    """The reduction buffer's bytes (every rank's parameters, float32, and a short tail)."""
    (first, *_) = _events(bed, "memory") or [{}]
    return int(first.get("param_bytes", 0))


def _lanes(bed: Any) -> list[str]:
    built = {g for e in _events(bed, "comm_rebuilt") for g in e["rebuilt"]}
    return sorted(g for g in built if g.startswith("dp."))


def show(result: dict[str, Any]) -> None:
    grad = result["grad_bytes"] or 1
    mb = 1 / 2**20
    rows = []
    for link, modes in result["cells"].items():
        med = {
            mode: (
                statistics.median(statistics.mean(c["per_host_bytes_per_step"]) for c in cells),
                statistics.median(c["step_s"] for c in cells),
            )
            for mode, cells in modes.items()
        }
        (fb, ft), (hb, ht), (qb, qt) = med["flat"], med["auto"], med["int8"]
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
    curve = result["curve"]
    print_table(
        f"int8 lanes vs exact tiers, gpt-tiny, 2 hosts × 2 workers, {curve['steps']} steps",
        ("max relative loss deviation", "at the last step", "last loss exact", "last loss int8"),
        [(f"{curve['max_rel_deviation']:.2e}", f"{curve['final_rel_deviation']:.2e}",
          f"{curve['final_loss']['exact']:.4f}", f"{curve['final_loss']['int8']:.4f}")],
    )  # fmt: skip
