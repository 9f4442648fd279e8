"""ElasWave's reshard against ReCycle, dropping the replica (TorchFT) and the ideal after stage
losses, on the device model of :mod:`bench.pipesim`, over a dp × pp grid; and the same model
checked against what ``bench pipeline`` measures on its emulated devices.

ElasWave's and drop's layouts after a loss come from the planner the leader runs
(:func:`~elaswave.planning.pipeplan.next_pipeline_plan`, policies ``reshard`` and ``drop``): the
cut of the damaged replica and every replica's share of the micro-batches. ReCycle keeps every
cut and share and routes the failed devices' micro-batches to their stage's peers
(:func:`bench.pipesim.run_recycle`). The ideal is the fault-free step's throughput times the
fraction of devices left.

Failures: one, replica 0's last stage (as ``bench pipeline`` kills); two, that and replica 1's
first stage (no replica is left intact at dp = 2: dropping replicas has nothing to run).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from bench.pipesim import Pipe, ScheduleError, run_orders, run_recycle, stage_seconds
from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import Member, Plan

POLICIES = ("healthy", "reshard", "recycle", "drop")
RECYCLE_PARTS = {  # ReCycle's optimizations, added one at a time (its full schedule: the last)
    "reroute": {"decoupled": False, "staggered": False},
    "+ decoupled backprop": {"decoupled": True, "staggered": False},
    "+ staggered optimizer": {"decoupled": True, "staggered": True},
}


def failed_slots(dp: int, pp: int, failures: int) -> list[tuple[int, int]]:
    """The (replica, stage) pairs lost: replica 0's last stage, then replica 1's first."""
    return [(0, pp - 1), (1, 0)][:failures]


def _members(n: int) -> list[Member]:
    return [Member(worker_id=f"w{i}", host="h", order=i) for i in range(n)]


def _start(dp: int, pp: int, costs: Sequence[float], microbatches: int) -> Plan:
    """The fault-free plan: replica d's stage s is worker d·pp + s (join order)."""
    start = next_pipeline_plan(None, _members(dp * pp), **_plan_kw(dp, pp, costs, microbatches))
    assert start is not None and len(start.replicas) == dp
    return start


def _after(
    start: Plan, costs: Sequence[float], microbatches: int, failed: Sequence[tuple[int, int]],
    policy: str,
) -> Plan | None:  # fmt: skip
    """The plan after ``failed`` under ``policy`` (``None``: nothing left to run)."""
    dp, pp = len(start.replicas), len(start.replicas[0])
    lost = {f"w{d * pp + s}" for d, s in failed}
    left = [m for m in _members(dp * pp) if m.worker_id not in lost]
    try:
        # A plan that loses workers always changes; none means no replica is left to run.
        return next_pipeline_plan(
            start, left, policy=policy, **_plan_kw(dp, pp, costs, microbatches)
        )
    except ValueError:
        return None


def _plan_kw(dp: int, pp: int, costs: Sequence[float], microbatches: int) -> dict[str, Any]:
    return {"pp": pp, "costs": costs, "num_microbatches": microbatches,
            "max_workers": dp * pp, "store": "-", "now": 0.0}  # fmt: skip


def fault_free_step(
    dp: int, pp: int, *, costs: Sequence[float], device_time: float, microbatches: int
) -> float:
    """The model's fault-free 1F1B step without the fixed cost (what a run's measured step
    fits that cost against)."""
    return run_orders(pipes_of(_start(dp, pp, costs, microbatches), costs, device_time)).step_s


def pipes_of(plan: Plan, costs: Sequence[float], device_time: float) -> list[Pipe]:
    """Each replica of ``plan`` as the model sees it: its stages' seconds and its share."""
    return [
        Pipe(stage_seconds(costs, plan.bounds[d], device_time), plan.shares[d])
        for d in range(len(plan.replicas))
    ]


def compare(
    dp: int,
    pp: int,
    failures: int,
    *,
    costs: Sequence[float],
    device_time: float,
    microbatches: int,
    batch: int,
    overhead: float,
) -> dict[str, Any]:
    """Samples/s of each policy after ``failures`` losses (``None``: the policy cannot run),
    ReCycle's parts one at a time, and the ideal."""
    failed = failed_slots(dp, pp, failures)
    start = _start(dp, pp, costs, microbatches)
    reshard = _after(start, costs, microbatches, failed, "reshard")
    drop = _after(start, costs, microbatches, failed, "drop")
    healthy = pipes_of(start, costs, device_time)
    step = {
        "healthy": run_orders(healthy, overhead=overhead).step_s,
        "reshard": run_orders(pipes_of(reshard, costs, device_time), overhead=overhead).step_s
        if reshard and reshard.replicas else None,
        "drop": run_orders(pipes_of(drop, costs, device_time), overhead=overhead).step_s
        if drop and drop.replicas else None,
    }  # fmt: skip
    parts = {}
    for name, flags in RECYCLE_PARTS.items():
        try:
            parts[name] = run_recycle(healthy, failed, overhead=overhead, **flags).step_s
        except ScheduleError:
            parts[name] = None
    step["recycle"] = parts["+ staggered optimizer"]
    step["recycle reroute"] = parts["reroute"]  # what ``--stage-loss recycle`` runs
    # ReCycle's own fault-free step: its decoupled, staggered schedule fills some of the 1F1B
    # bubbles even without a failure, which is not failure handling; "retained" divides it out.
    step["recycle fault-free"] = _recycle_fault_free(tuple(healthy), overhead)
    tput = {k: (batch / v if v else None) for k, v in step.items()}
    alive = (dp * pp - failures) / (dp * pp)
    tput["ideal"] = tput["healthy"] * alive
    return {
        "dp": dp,
        "pp": pp,
        "failures": failures,
        "failed": failed,
        "microbatches": microbatches,
        "step_s": step,
        "samples_per_s": tput,
        "recycle_parts_samples_per_s": {k: (batch / v if v else None) for k, v in parts.items()},
        "reshard_over_recycle": _ratio(tput["reshard"], tput["recycle"]),
        "reshard_over_drop": _ratio(tput["reshard"], tput["drop"]),
        "reshard_over_ideal": _ratio(tput["reshard"], tput["ideal"]),
        "retained": {
            "reshard": _ratio(tput["reshard"], tput["healthy"]),
            "recycle": _ratio(tput["recycle"], tput["recycle fault-free"]),
            "drop": _ratio(tput["drop"], tput["healthy"]),
        },
        "layout": {"reshard": _layout(reshard), "drop": _layout(drop)},
    }


@functools.cache
def _recycle_fault_free(pipes: tuple[Pipe, ...], overhead: float) -> float:
    """ReCycle's step without a loss: the same for every loss of a grid cell, run once."""
    return run_recycle(pipes, [], overhead=overhead).step_s


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def _layout(plan: Plan | None) -> str:
    if plan is None or not plan.replicas:
        return "nothing left"
    return "; ".join(f"cut {list(b)} × {s}" for b, s in zip(plan.bounds, plan.shares, strict=True))
