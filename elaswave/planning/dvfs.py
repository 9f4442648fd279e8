"""The frequency axis: which clock each pipeline stage should run at, and who sets it.

After a re-partition the stages of a pipeline rarely take the same time. A 1F1B pipeline runs at
the pace of its slowest stage, so the others idle in bubbles. :func:`frequency_plan` (pure) raises
the bottleneck's clock where the device has headroom and lowers every other stage to the lowest
clock at which it still keeps up: same or better step time, less energy.

The model (stated so that it can be checked against measurements):

- A stage's compute time scales with ``1 / f``: ``t_s(f) = t_s * f_nominal / f``, where ``t_s``
  is its forward + backward time for one micro-batch at ``f_nominal``. Memory-bound work scales
  less than that, so the model overstates both the speed-up and the slow-down.
- One 1F1B step with ``M`` micro-batches over ``S`` stages takes ``(M + S - 1) * max_s t_s``
  (fill, steady state, drain); communication is not modelled.
- Energy proxy: dynamic power grows like ``f^3`` (``P ~ C V^2 f`` with ``V ~ f``), so a stage's
  energy per step is ``~ f^2 * busy time`` with ``busy = M * t_s(f)``. ``energy_ratio`` is the
  sum over stages after the plan divided by the same sum at nominal clocks. Idle and static
  power are not counted.

The actuators that apply a plan's clocks are in
:mod:`elaswave.runtime.strategies.pipeline.clocks`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from elaswave.errors import ElasWaveError


class DvfsError(ElasWaveError, ValueError):
    """A frequency plan or an actuator cannot be made as asked (one-line message)."""


# ---- the policy ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class FrequencyPlan:
    """Per-stage clocks and what the model predicts for them.

    ``targets[s]`` is stage ``s``'s clock (same unit as ``f_nominal``); ``stage_times[s]`` its
    predicted per-micro-batch time at that clock. Step times follow the 1F1B model of the module
    docstring; ``energy_ratio`` is the energy proxy after / before (1.0 = unchanged).
    """

    targets: tuple[float, ...]
    stage_times: tuple[float, ...]
    step_time_before: float
    step_time_after: float
    energy_ratio: float
    f_nominal: float

    @property
    def changed(self) -> bool:
        return any(f != self.f_nominal for f in self.targets)

    @property
    def speedup(self) -> float:
        return self.step_time_before / self.step_time_after

    def as_targets(self) -> dict[int, float]:
        """``{stage: clock}`` for :meth:`Actuator.apply`."""
        return dict(enumerate(self.targets))

    def describe(self) -> str:
        """One line for events and reports."""
        if not self.changed:
            return "nominal clocks on every stage (balanced, or no room to change)"
        clocks = ", ".join(f"{f:.4g}" for f in self.targets)
        return (
            f"clocks [{clocks}]: step {self.step_time_before:.4g} → {self.step_time_after:.4g} "
            f"(×{self.speedup:.3f}), energy ×{self.energy_ratio:.3f}"
        )


def _check_plan_inputs(
    stage_times: Sequence[float],
    microbatches: int,
    f_nominal: float,
    *,
    f_min: float,
    f_max: float,
    headroom: Sequence[bool] | None,
    tolerance: float,
) -> None:
    if not stage_times:
        raise DvfsError("no pipeline stages to plan clocks for")
    for s, t in enumerate(stage_times):
        if not (math.isfinite(t) and t > 0):
            raise DvfsError(f"stage time must be a finite number > 0, stage {s} has {t}")
    if microbatches < 1:
        raise DvfsError(f"microbatches must be >= 1, got {microbatches}")
    clocks = (f_min, f_nominal, f_max)
    if not all(math.isfinite(f) and f > 0 for f in clocks) or not f_min <= f_nominal <= f_max:
        raise DvfsError(
            f"clocks must satisfy 0 < f_min <= f_nominal <= f_max, "
            f"got f_min={f_min} f_nominal={f_nominal} f_max={f_max}"
        )
    if headroom is not None and len(headroom) != len(stage_times):
        raise DvfsError(f"headroom names {len(headroom)} stages, stage_times {len(stage_times)}")
    if not (math.isfinite(tolerance) and tolerance >= 0):
        raise DvfsError(f"tolerance must be a finite number >= 0, got {tolerance}")


def frequency_plan(
    stage_times: Sequence[float],
    *,
    microbatches: int,
    f_nominal: float,
    f_min: float,
    f_max: float,
    headroom: Sequence[bool] | None = None,
    tolerance: float = 0.02,
) -> FrequencyPlan:
    """Clock each stage so that the pipeline's bottleneck is as fast as the clocks allow.

    ``stage_times`` are per-micro-batch compute times at ``f_nominal``. ``headroom[s]`` says
    whether stage ``s``'s device may run above ``f_nominal`` (default: all may; a device at its
    power or thermal limit may not). The rule:

    1. If the slowest stage is within ``tolerance`` (relative) of the fastest, nothing idles
       worth speaking of: every stage keeps ``f_nominal`` (a single stage always does).
    2. Otherwise the new bottleneck time is the lowest the caps allow,
       ``T = max_s t_s * f_nominal / cap_s`` with ``cap_s = f_max`` where there is headroom and
       ``f_nominal`` where not; a bottleneck stage with headroom runs at ``f_max``.
    3. Every stage gets the lowest clock at which it is no slower than ``T``,
       ``max(f_min, t_s * f_nominal / T)``; a stage that would otherwise wait in bubbles is
       slowed down instead.
    """
    _check_plan_inputs(
        stage_times,
        microbatches,
        f_nominal,
        f_min=f_min,
        f_max=f_max,
        headroom=headroom,
        tolerance=tolerance,
    )
    times = [float(t) for t in stage_times]
    f_nominal, f_min, f_max = float(f_nominal), float(f_min), float(f_max)
    n_stages = len(times)
    room = [True] * n_stages if headroom is None else [bool(h) for h in headroom]
    pipeline = microbatches + n_stages - 1
    before = pipeline * max(times)

    if max(times) <= min(times) * (1.0 + tolerance):
        targets = [f_nominal] * n_stages
    else:
        caps = [f_max if r else f_nominal for r in room]
        fastest = [t * f_nominal / cap for t, cap in zip(times, caps, strict=True)]
        bottleneck = max(fastest)
        targets = [
            cap if best == bottleneck else min(cap, max(f_min, t * f_nominal / bottleneck))
            for t, cap, best in zip(times, caps, fastest, strict=True)
        ]
    predicted = tuple(t * f_nominal / f for t, f in zip(times, targets, strict=True))
    energy_after = sum(
        (f / f_nominal) ** 2 * p for f, p in zip(targets, predicted, strict=True)
    )  # ~ f^2 * busy time per stage; the common factor M cancels in the ratio
    return FrequencyPlan(
        targets=tuple(targets),
        stage_times=predicted,
        step_time_before=before,
        step_time_after=pipeline * max(predicted),
        energy_ratio=energy_after / sum(times),
        f_nominal=f_nominal,
    )


# ---- actuators -------------------------------------------------------------------------------
