"""A discrete-event model of pipeline schedules on emulated devices, for the policies ``bench
pipeline`` compares after a stage loss: ElasWave's reshard, dropping the replica (TorchFT), and
ReCycle (Gandhi et al., SOSP 2024), which ElasWave does not run as a policy.

The device model is the one ``train.device_time`` emulates in the workers: one micro-batch
through the whole model costs ``device_time`` seconds, a stage its layers' cost share of it; a
forward is a third, a backward two thirds. ReCycle's Decoupled BackProp splits that backward
into its input-gradient half (``B``, on the critical path) and its weight-gradient half (``W``,
deferrable); the others run it whole (``BW``).

Two ways to order the work of a device:

- :func:`run_orders`: every device follows a fixed op list (the runtime's own 1F1B order,
  :func:`~elaswave.planning.schedule.schedule_1f1b`); the step ends at one barrier (ElasWave's
  commit: a global reduction and update). This is what the runs measure, so it is checked
  against them.
- :func:`run_recycle`: ReCycle's adaptive schedule. A failed device's micro-batches are routed
  to the live devices that hold the same stage in the other pipelines (round robin), and every
  device runs, whenever it is idle, its most urgent ready op: a backward before a forward before
  a deferred weight gradient (so ``W`` fills the bubbles), a forward only while the device holds
  fewer in-flight activations than 1F1B allows it per pipeline it serves. With the Staggered
  Optimizer a stage updates as soon as its own weight gradients are done, and its next
  iteration's forwards wait only for that update (no barrier across stages). ReCycle's planner
  finds its schedule with a MILP; this list schedule is the usual greedy stand-in for it.

Pure: no process, no clock; times are seconds of emulated device time.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from elaswave.planning.schedule import Compute, schedule_1f1b

Device = Hashable
PRIORITY = {"B": 0, "BW": 0, "F": 1, "W": 2}  # ReCycle: critical path first, W fills bubbles


class ScheduleError(ValueError):
    """A layout the schedule cannot run (no live holder of a stage, an op waiting forever)."""


@dataclass(frozen=True, order=True)
class Op:
    iteration: int
    pipe: int  # whose micro-batch: the pipeline (data-parallel replica) it belongs to
    mb: int
    stage: int  # its stage in that pipeline
    kind: str  # "F", "B" (input gradient), "W" (weight gradient), "BW" (both)


@dataclass(frozen=True)
class Pipe:
    """One pipeline: its stages' seconds per micro-batch through them (forward + backward) and
    its micro-batches per step."""

    stage_seconds: tuple[float, ...]
    microbatches: int


@dataclass
class Timeline:
    """What a simulation found: every op's (device, start, end), and the step time."""

    step_s: float
    spans: dict[Op, tuple[Device, float, float]] = field(default_factory=dict)


def stage_seconds(costs: Sequence[float], bounds: Sequence[int], device_time: float) -> tuple:
    """Per stage of a cut (``bounds``), a micro-batch's forward + backward seconds: its layers'
    share of ``device_time`` (the workers' ``cost_share``)."""
    total = float(sum(costs))
    return tuple(
        device_time * sum(costs[a:b]) / total for a, b in zip(bounds, bounds[1:], strict=False)
    )


def op_seconds(op: Op, seconds: float) -> float:
    """An op's share of its stage's forward + backward ``seconds``: thirds (F, B, W), BW two."""
    return seconds * (2.0 if op.kind == "BW" else 1.0) / 3.0


def _deps(op: Op, stages: int, split: bool) -> list[Op]:
    """The ops ``op`` waits for: the forward before it, the backward after it, and its own
    forward (a backward) or input-gradient half (a weight gradient)."""
    it, p, i, s = op.iteration, op.pipe, op.mb, op.stage
    back = "B" if split else "BW"
    if op.kind == "F":
        return [Op(it, p, i, s - 1, "F")] if s > 0 else []
    if op.kind == "W":
        return [Op(it, p, i, s, "B")]
    out = [Op(it, p, i, s, "F")]
    if s + 1 < stages:
        out.append(Op(it, p, i, s + 1, back))
    return out


# ---- fixed orders: the runtime's 1F1B, one barrier per step ---------------------------------
def run_orders(pipes: Sequence[Pipe], *, overhead: float = 0.0) -> Timeline:
    """One step of independent 1F1B pipelines (each stage its own device, named ``(pipe,
    stage)``) ending at a barrier: the step time is the slowest pipeline's makespan plus
    ``overhead`` (the reduction, update and commit, the same for every layout)."""
    spans: dict[Op, tuple[Device, float, float]] = {}
    for p, pipe in enumerate(pipes):
        stages = len(pipe.stage_seconds)
        orders = {
            s: [
                Op(0, p, item.mb, s, "F" if item.kind == "F" else "BW")
                for item in schedule_1f1b(s, stages, pipe.microbatches)
                if isinstance(item, Compute)
            ]
            for s in range(stages)
        }
        free = dict.fromkeys(orders, 0.0)
        progress = True
        while progress:
            progress = False
            for s, order in orders.items():
                while order:
                    op = order[0]
                    deps = _deps(op, stages, split=False)
                    if any(d not in spans for d in deps):
                        break
                    start = max([free[s], *(spans[d][2] for d in deps)])
                    end = start + op_seconds(op, pipe.stage_seconds[s])
                    spans[op], free[s] = ((p, s), start, end), end
                    order.pop(0)
                    progress = True
        if any(orders.values()):
            raise ScheduleError(f"pipeline {p}: the 1F1B orders wait on each other")
    makespan = max((e for _, _, e in spans.values()), default=0.0)
    return Timeline(step_s=makespan + overhead, spans=spans)


# ---- ReCycle's adaptive schedule -----------------------------------------------------------
def reroute(
    pipes: int, stages: int, failed: Sequence[tuple[int, int]]
) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """Who runs each (pipeline, stage)'s micro-batches: itself, or, when it failed, the live
    devices holding that stage in the other pipelines (round robin over them)."""
    lost = set(failed)
    out: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for s in range(stages):
        live = [(p, s) for p in range(pipes) if (p, s) not in lost]
        if not live:
            raise ScheduleError(f"stage {s} has no live holder left: ReCycle cannot reroute")
        for p in range(pipes):
            out[(p, s)] = [(p, s)] if (p, s) not in lost else live
    return out


def run_recycle(
    pipes: Sequence[Pipe],
    failed: Sequence[tuple[int, int]] = (),
    *,
    decoupled: bool = True,
    staggered: bool = True,
    iterations: int = 6,
    overhead: float = 0.0,
) -> Timeline:
    """Steady-state step time of ReCycle's schedule after ``failed`` devices ((pipeline, stage)
    pairs) are lost. All pipelines have the same cut (ReCycle's premise) and keep their
    micro-batches (the global batch is unchanged). ``overhead``: a step's fixed cost (reduction,
    update, commit), paid once at the barrier without the Staggered Optimizer, and by each stage
    after its own last weight gradient with it (stages then pay it at different times). The
    step time is the mean over the iterations after the first two (the pipeline filled)."""
    stages = len(pipes[0].stage_seconds)
    if any(p.stage_seconds != pipes[0].stage_seconds for p in pipes):
        raise ScheduleError("ReCycle's pipelines share one cut")
    if iterations < 3:
        raise ValueError("need at least 3 iterations for a steady state")
    device_of = _assign(pipes, stages, failed, iterations, decoupled)
    queues: dict[Device, list[Op]] = {}
    for op, dev in device_of.items():
        queues.setdefault(dev, []).append(op)
    for ops in queues.values():
        ops.sort(key=_urgency)
    served = reroute(len(pipes), stages, failed)
    cap = {dev: (stages - dev[1]) * sum(dev in served[(p, dev[1])] for p in range(len(pipes)))
           for dev in queues}  # fmt: skip
    left = {(it, s): 0 for it in range(iterations) for s in range(stages)}
    for op in device_of:
        left[(op.iteration, op.stage)] += 1
    spans: dict[Op, tuple[Device, float, float]] = {}
    inflight = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done: dict[tuple[int, int], float] = {}  # (iteration, stage) → its last op's end
    release: dict[tuple[int, int], float] = {(0, s): 0.0 for s in range(stages)}
    now = 0.0
    while any(queues.values()):
        started = True
        while started:  # an op of no time makes others ready at once
            started = False
            for dev in sorted(queues, key=repr):
                ops = queues[dev]
                if free[dev] > now or not ops:
                    continue
                room = inflight[dev] < cap[dev]
                op = _next_ready(ops, spans, now, stages, decoupled, room, release)
                if op is None:
                    continue
                ops.remove(op)
                end = now + op_seconds(op, pipes[op.pipe].stage_seconds[op.stage])
                spans[op], free[dev] = (dev, now, end), end
                inflight[dev] += {"F": 1, "B": -1, "BW": -1}.get(op.kind, 0)
                key = (op.iteration, op.stage)
                left[key] -= 1
                done[key] = max(done.get(key, 0.0), end)
                if left[key] == 0:
                    _release_next(op.iteration, op.stage, left, staggered, overhead, done, release)
                started = True
        later = [t for t in free.values() if t > now]
        later += [t for t in release.values() if t > now]
        if not later:
            if any(queues.values()):
                raise ScheduleError("ReCycle's schedule is stuck: an op waits for nothing")
            break
        now = min(later)
    ends = [max(done[(it, s)] for s in range(stages)) + overhead for it in range(iterations)]
    return Timeline(step_s=(ends[-1] - ends[1]) / (iterations - 2), spans=spans)


def _assign(
    pipes: Sequence[Pipe],
    stages: int,
    failed: Sequence[tuple[int, int]],
    iterations: int,
    decoupled: bool,
) -> dict[Op, Device]:
    """Every op of every iteration on its device: a failed device's micro-batches go round
    robin over the stage's live holders, continuing across iterations."""
    runs_on = reroute(len(pipes), stages, failed)
    kinds = ("F", "B", "W") if decoupled else ("F", "BW")
    device_of: dict[Op, Device] = {}
    cursor: dict[tuple[int, int], int] = {}
    for it in range(iterations):
        for p, pipe in enumerate(pipes):
            for s in range(stages):
                holders = runs_on[(p, s)]
                for i in range(pipe.microbatches):
                    k = cursor.get((p, s), 0)
                    cursor[(p, s)] = k + 1
                    for kind in kinds:
                        device_of[Op(it, p, i, s, kind)] = holders[k % len(holders)]
    return device_of


def _release_next(
    iteration: int,
    stage: int,
    left: Mapping[tuple[int, int], int],
    staggered: bool,
    overhead: float,
    done: Mapping[tuple[int, int], float],
    release: dict[tuple[int, int], float],
) -> None:
    """``stage`` finished ``iteration``: with the Staggered Optimizer it may start the next one
    after its own update; without it, every stage waits for the last one's (a barrier)."""
    if staggered:
        release[(iteration + 1, stage)] = done[(iteration, stage)] + overhead
        return
    stages = [s for (it, s) in left if it == iteration]
    if all(left[(iteration, s)] == 0 for s in stages):
        end = max(done[(iteration, s)] for s in stages) + overhead
        for s in stages:
            release[(iteration + 1, s)] = end


def _urgency(op: Op) -> tuple:
    return (op.iteration, PRIORITY[op.kind], op.mb, op.pipe)


def _next_ready(
    ops: list[Op],
    spans: Mapping[Op, tuple[Device, float, float]],
    now: float,
    stages: int,
    split: bool,
    room: bool,
    release: Mapping[tuple[int, int], float],
) -> Op | None:
    """The most urgent of ``ops`` (kept sorted by urgency) whose inputs are there at ``now``.
    A device runs one stage, so nothing of a later iteration is released while it still has
    ops of the first one: the scan stops there."""
    for op in ops:
        if op.iteration > ops[0].iteration:
            break
        if op.kind == "F":
            if not room:
                continue
            at = release.get((op.iteration, op.stage))
            if at is None or at > now:
                continue
        deps = _deps(op, stages, split)
        if all(d in spans and spans[d][2] <= now for d in deps):
            return op
    return None
