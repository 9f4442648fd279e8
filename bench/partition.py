"""Layer partitioner and DVFS policy: how long planning takes, and what the plans predict.

For each pipeline shape (L layers, S stages) a seeded model gets per-layer costs (transformer
blocks of cost 1 ± 20 %, an embedding of 0.5 and an output head of 1.5) and S equal stages. The
initial cut is ``partition_layers(costs, speeds)``; then the middle stage is lost and
``takeover()`` re-partitions the replica over the S - 1 survivors. Timed: both calls (median of
``repeat`` rounds, each the best of a few calls). Reported: the bottleneck against the optimum and
against the ideal (total cost / survivors), the layers the takeover moves against a re-partition
that ignores the current placement, and what :func:`~elaswave.planning.dvfs.frequency_plan` predicts
for the new stage times, with boost headroom and without ("lower only"), for illustrative clocks
f_min / f_nominal / f_max = 1005 / 1410 / 1980 MHz. The DVFS figures are the policy's model, not
measurements.
"""

from __future__ import annotations

import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import console, print_table
from elaswave.planning.dvfs import frequency_plan
from elaswave.planning.partition import moved_layers, partition_layers, takeover

DESCRIPTION = "layer partitioner + DVFS policy: planning time and plan quality after a lost stage"
DEFAULT_REPEAT = 5
SHAPES = ((26, 4), (50, 8), (98, 16), (194, 32))  # blocks + embedding + head
CLOCKS = {"f_min": 1005.0, "f_nominal": 1410.0, "f_max": 1980.0}
CALLS_PER_ROUND = 3


def _costs(n_layers: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [0.5] + [rng.uniform(0.8, 1.2) for _ in range(n_layers - 2)] + [1.5]


def _best_of(fn: Any) -> float:
    best = float("inf")
    for _ in range(CALLS_PER_ROUND):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _shape(n_layers: int, n_stages: int, repeat: int) -> dict[str, Any]:
    costs = _costs(n_layers, seed=n_layers * 1000 + n_stages)
    speeds = [1.0] * n_stages
    lost = n_stages // 2
    survivors = [1.0] * (n_stages - 1)
    initial = partition_layers(costs, speeds)
    after = takeover(initial.assignment(), lost, costs, speeds_of_survivors=survivors)
    renumbered = [-1 if s == lost else s - (s > lost) for s in initial.assignment()]
    naive = partition_layers(costs, survivors)  # same optimum, placement ignored
    plan = frequency_plan(after.stage_times, microbatches=2 * n_stages, **CLOCKS)
    lower = frequency_plan(
        after.stage_times, microbatches=2 * n_stages, headroom=[False] * (n_stages - 1), **CLOCKS
    )
    initial_s, takeover_s = [], []
    for _ in range(repeat):
        initial_s.append(_best_of(lambda: partition_layers(costs, speeds)))
        takeover_s.append(
            _best_of(
                lambda: takeover(initial.assignment(), lost, costs, speeds_of_survivors=survivors)
            )
        )
    return {
        "layers": n_layers,
        "stages": n_stages,
        "lost_stage": lost,
        "initial_s": statistics.median(initial_s),
        "takeover_s": statistics.median(takeover_s),
        "takeover_s_all": takeover_s,
        "initial_bottleneck": initial.bottleneck,
        "bottleneck": after.bottleneck,
        "optimum": after.optimum,
        "ideal": sum(costs) / (n_stages - 1),
        "moved": after.moved,
        "lost_layers": len(initial.layers(lost)),
        "moved_naive": len(moved_layers(renumbered, naive.assignment())),
        "dvfs": {
            "targets": list(plan.targets),
            "speedup": plan.speedup,
            "energy_ratio": plan.energy_ratio,
            "stage_time_spread": max(after.stage_times) / min(after.stage_times),
            "lower_only_targets": list(lower.targets),
            "lower_only_energy_ratio": lower.energy_ratio,
        },
    }


def run(repeat: int, config: Path) -> dict[str, Any]:
    from elaswave.runtime.strategies.pipeline.clocks import cpufreq_status

    del config  # pure planning: no job is launched
    shapes = [_shape(n, s, repeat) for n, s in SHAPES]
    return {"repeat": repeat, "shapes": shapes, "cpu_clocks": cpufreq_status()}


def show(result: dict[str, Any]) -> None:
    rows = [
        (
            f"{r['layers']} × {r['stages']} → {r['stages'] - 1}",
            f"{r['initial_s'] * 1000:.1f}",
            f"{r['takeover_s'] * 1000:.1f}",
            f"{r['bottleneck'] / r['optimum']:.4f}",
            f"{r['bottleneck'] / r['ideal']:.3f}",
            f"{r['moved']} ({r['lost_layers']} lost)",
            str(r["moved_naive"]),
        )
        for r in result["shapes"]
    ]
    print_table(
        f"Partitioner, median of {result['repeat']} rounds (ms)",
        ("layers × stages", "initial", "takeover", "bn / optimum", "bn / ideal", "moved",
         "moved, placement ignored"),
        rows,
    )  # fmt: skip
    rows = [
        (
            f"{r['layers']} × {r['stages'] - 1}",
            f"{r['dvfs']['stage_time_spread']:.3f}",
            f"{min(r['dvfs']['targets']):.0f}–{max(r['dvfs']['targets']):.0f}",
            f"{r['dvfs']['speedup']:.3f}",
            f"{r['dvfs']['energy_ratio']:.3f}",
            f"{min(r['dvfs']['lower_only_targets']):.0f}–{max(r['dvfs']['lower_only_targets']):.0f}",
            f"{r['dvfs']['lower_only_energy_ratio']:.3f}",
        )
        for r in result["shapes"]
    ]
    print_table(
        "DVFS policy on the post-takeover stage times (model predictions, MHz)",
        ("layers × stages", "slowest / fastest", "clocks", "step speed-up", "energy ratio",
         "lower-only clocks", "lower-only energy"),
        rows,
    )  # fmt: skip
    console.print(  # no clock is set here: GPUs' through python -m bench.gpucheck
        f"CPU clocks on this machine: {result.get('cpu_clocks', 'not read')}; the DVFS figures "
        "are the policy's predictions, not measurements"
    )
