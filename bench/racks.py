"""Bytes between racks and step time: one flat ring, tiers by host, tiers by host and rack.

Two racks × two hosts × two workers on the multi-host bed (elaswave.testing.netbed): each rack a
bridge, the two joined by one veth pair (the link between the racks, ``up1`` / ``dn1`` in the
switch's namespace), the 10 M-parameter Llama of ``bench/llama-10m.yaml``, data parallelism. Three
jobs per link, side by side: ``flat`` (``train.hierarchy: flat``), ``hosts`` (``auto``, the hosts
launched without ``--rack``: the job knows its hosts, not its racks) and ``racks`` (``auto`` with
``--rack``: lanes inside each rack, slices between them). Links: unshaped, then the link between the
racks shaped by ``tc`` to 100 Mbit/s each way (a token bucket on both ends' egress).

Per job: the bytes that crossed between the racks per step (both directions, the pair's two
transmit counters sampled while the job runs, between the commits of step ``WARM`` and of the
last) and the median step over the same steps. Theory, M the gradient buffer's bytes, ranks rack
by rack and host by host: a ring over N ranks crosses between the racks twice, each crossing
carrying 2 (N − 1) / N × M: 3.5 M at N = 8; by host, each lane's ring over the H hosts crosses
twice too: 2 × 2 (H − 1) / H × M = 3.0 M at H = 4; by rack, each rack sends 2 (R − 1) / R × M
across: 2.0 M at R = 2.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from bench.common import diffs, print_table, write_config
from bench.hier import (
    CONFIG,
    Cells,
    commit_times,
    counting,
    grad_bytes_of,
    one_round,
    require_bed,
    run_job,
    sent_between,
    shape,
    tier_groups,
    tx_bytes,
)
from elaswave.testing import netbed

DESCRIPTION = "bytes between racks and step time: flat ring, tiers by host, by rack (2 × 2 × 2)"
DEFAULT_REPEAT = 1
RACKS = ("A", "A", "B", "B")  # each host's rack
PER_HOST = 2
STEPS = 8
WARM = 2
LINKS = ("unshaped", "100mbit")
MODES = {"flat": ("flat", False), "hosts": ("auto", False), "racks": ("auto", True)}
THEORY = {"flat": 2 * 2 * 7 / 8, "hosts": 2 * 2 * 3 / 4, "racks": 2 * 2 * 1 / 2}  # × M
CROSS = ("up1", "dn1")  # the veth pair between the racks, in the switch's namespace


def run(repeat: int, config: Path) -> dict[str, Any]:
    del config  # the 10 M llama, always
    require_bed()
    cells: Cells = {link: {mode: [] for mode in MODES} for link in LINKS}
    grad = 0
    for i in range(repeat):
        grad = one_round(cells, "racks", i, _job)
    return {
        "scenario": "racks",
        "repeat": repeat,
        "racks": list(RACKS),
        "per_host": PER_HOST,
        "steps": STEPS,
        "warm": WARM,
        "grad_bytes": grad,
        "theory_cross": THEORY,
        "cells": cells,
    }


def _job(tmp: Path, job: str, link: str, mode: str) -> tuple[dict[str, Any], int]:
    hierarchy, labelled = MODES[mode]
    n = len(RACKS)
    cfg = write_config(tmp / "job.yaml", CONFIG, {
        "train": {"steps": STEPS, "hierarchy": hierarchy},
        "elastic": {"nproc_per_node": PER_HOST, "nnodes": f"{n}:{n}"},
    })  # fmt: skip
    bed = netbed.NetBed(tmp, config=cfg, hosts=n, racks=RACKS, label_racks=labelled)
    try:
        bed.start()
        switch = bed.ns("sw")
        if link != "unshaped":
            for dev in CROSS:
                shape(switch, link, dev)
        with counting(lambda: [tx_bytes(switch, dev) for dev in CROSS]) as samples:
            run_job(bed, tmp, job)
        commits = commit_times(bed, STEPS)
        sent = sent_between(samples, commits[WARM], commits[STEPS])
        times = diffs([commits[s] for s in range(WARM, STEPS + 1)])
        return {
            "cross_bytes_per_step": sum(sent) / (STEPS - WARM),
            "step_s": statistics.median(times),
            "groups": tier_groups(bed),
        }, grad_bytes_of(bed)
    finally:
        bed.close()


def show(result: dict[str, Any]) -> None:
    grad = result["grad_bytes"] or 1
    mb = 1 / 2**20
    rows = []
    for link, modes in result["cells"].items():
        for mode, cells in modes.items():
            sent = statistics.median(c["cross_bytes_per_step"] for c in cells)
            step = statistics.median(c["step_s"] for c in cells)
            flat = statistics.median(c["step_s"] for c in modes["flat"])
            rows.append((link, mode, f"{sent * mb:.1f}", f"{sent / grad:.2f}",
                         f"{result['theory_cross'][mode]:.2f}", f"{step:.2f}",
                         f"{step / flat:.2f}"))  # fmt: skip
    print_table(
        f"Between two racks of two hosts × {result['per_host']} workers (M = "
        f"{grad * mb:.1f} MB of gradient; both directions per step)",
        ("link", "mode", "MB / step", "× M", "theory × M", "step s", "step / flat"),
        rows,
    )
