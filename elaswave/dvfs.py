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

Actuators apply a plan's clocks: :class:`SimActuator` (tests; the engine stretches a stage's
compute by :meth:`SimActuator.time_scale`), :class:`NvmlActuator` (NVIDIA, locked graphics
clocks through ``pynvml``), :class:`NpuActuator` (Ascend, ``npu-smi``; untested without the
hardware). None of them touches hardware unless constructed explicitly; :func:`make_actuator`
builds one by name.
"""

from __future__ import annotations

import importlib
import logging
import math
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from elaswave.errors import ElasWaveError

log = logging.getLogger(__name__)

ACTUATOR_KINDS = ("off", "sim", "nvml", "npu")


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
    _check_plan_inputs(stage_times, microbatches, f_nominal, f_min, f_max, headroom, tolerance)
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


class Actuator(Protocol):
    """Sets clocks. Keys name what is clocked: a local device index for the hardware actuators;
    the simulated one accepts any int (the engine uses the stage index)."""

    def apply(self, targets: Mapping[int, float]) -> None: ...

    def reset(self) -> None: ...


class OffActuator:
    """Does nothing (DVFS disabled)."""

    def apply(self, targets: Mapping[int, float]) -> None:
        del targets

    def reset(self) -> None:
        pass


class SimActuator:
    """Records clocks instead of setting them; tests and the CPU engine read the effect back.

    ``time_scale(key)`` is ``f_nominal / f`` for the clock last applied to ``key`` (1.0 when
    none): the factor by which the engine stretches that stage's compute to simulate the clock.
    """

    def __init__(self, f_nominal: float = 1.0) -> None:
        if not (math.isfinite(f_nominal) and f_nominal > 0):
            raise DvfsError(f"f_nominal must be a finite number > 0, got {f_nominal}")
        self.f_nominal = float(f_nominal)
        self.targets: dict[int, float] = {}
        self.history: list[dict[int, float]] = []  # every apply(), in order; {} for a reset()

    def apply(self, targets: Mapping[int, float]) -> None:
        for key, f in targets.items():
            if not (math.isfinite(f) and f > 0):
                raise DvfsError(f"clock must be a finite number > 0, {key} got {f}")
        self.targets.update({int(k): float(f) for k, f in targets.items()})
        self.history.append(dict(targets))

    def reset(self) -> None:
        self.targets.clear()
        self.history.append({})

    def time_scale(self, key: int) -> float:
        return self.f_nominal / self.targets.get(key, self.f_nominal)


def snap_clock(target: float, supported: Sequence[float]) -> float:
    """The lowest supported clock >= ``target`` (so a stage is never slower than planned), or the
    highest supported one if ``target`` exceeds them all."""
    if not supported:
        raise DvfsError("the device reports no supported clocks")
    above = [c for c in supported if c >= target]
    return min(above) if above else max(supported)


class NvmlActuator:
    """Locks NVIDIA graphics clocks per device through ``pynvml`` (``nvidia-ml-py``).

    Targets are in MHz and snapped to a supported clock (:func:`snap_clock`). Locking clocks
    needs root (or an administrator's permission); ``reset()`` unlocks every device this
    actuator locked, and ``close()`` also shuts NVML down.
    """

    def __init__(self) -> None:
        try:
            pynvml = importlib.import_module("pynvml")  # optional: NVIDIA hosts only
        except ImportError:
            raise DvfsError("DVFS actuator 'nvml' needs pynvml: pip install nvidia-ml-py") from None
        self._nvml: Any = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as err:
            raise DvfsError(f"NVML is not available: {err}") from None
        self.locked: dict[int, float] = {}  # device index -> MHz locked by this actuator

    def _handle(self, device: int) -> Any:
        try:
            return self._nvml.nvmlDeviceGetHandleByIndex(device)
        except self._nvml.NVMLError as err:
            raise DvfsError(f"no GPU {device} visible to NVML: {err}") from None

    def _error(self, device: int, what: str, err: Exception) -> DvfsError:
        nvml = self._nvml
        code = getattr(err, "value", None)
        if code == nvml.NVML_ERROR_NO_PERMISSION:
            return DvfsError(f"cannot {what} on GPU {device}: permission denied (needs root)")
        if code == nvml.NVML_ERROR_NOT_SUPPORTED:
            return DvfsError(f"cannot {what} on GPU {device}: not supported by this GPU/driver")
        return DvfsError(f"cannot {what} on GPU {device}: {err}")

    def supported_clocks(self, device: int) -> list[float]:
        """Graphics clocks (MHz) the device supports at its highest memory clock."""
        nvml, handle = self._nvml, self._handle(device)
        try:
            memory = max(nvml.nvmlDeviceGetSupportedMemoryClocks(handle))
            return sorted(nvml.nvmlDeviceGetSupportedGraphicsClocks(handle, memory))
        except nvml.NVMLError as err:
            raise self._error(device, "read supported clocks", err) from None

    def clock_range(self, device: int) -> tuple[float, float, float]:
        """``(f_min, f_nominal, f_max)`` in MHz for :func:`frequency_plan`: the lowest supported
        graphics clock, the default application clock and the maximum graphics clock."""
        nvml, handle = self._nvml, self._handle(device)
        try:
            nominal = nvml.nvmlDeviceGetDefaultApplicationsClock(handle, nvml.NVML_CLOCK_GRAPHICS)
            highest = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_GRAPHICS)
        except nvml.NVMLError as err:
            raise self._error(device, "read clocks", err) from None
        return float(min(self.supported_clocks(device))), float(nominal), float(highest)

    def apply(self, targets: Mapping[int, float]) -> None:
        nvml = self._nvml
        for device, f in targets.items():
            clock = snap_clock(f, self.supported_clocks(device))
            try:
                nvml.nvmlDeviceSetGpuLockedClocks(self._handle(device), int(clock), int(clock))
            except nvml.NVMLError as err:
                raise self._error(device, "lock clocks", err) from None
            self.locked[device] = clock
            log.info("GPU %d graphics clock locked at %d MHz (asked %.0f)", device, clock, f)

    def reset(self) -> None:
        nvml = self._nvml
        for device in sorted(self.locked):
            try:
                nvml.nvmlDeviceResetGpuLockedClocks(self._handle(device))
            except nvml.NVMLError as err:
                raise self._error(device, "reset clocks", err) from None
            del self.locked[device]

    def close(self) -> None:
        try:
            self.reset()
        finally:
            self._nvml.nvmlShutdown()


class NpuActuator:
    """Sets Ascend AI-core clocks by running ``npu-smi`` (untested here: no Ascend hardware).

    Only constructible where ``torch_npu`` imports and ``npu-smi`` is on ``PATH``. Keys are NPU
    ids (``npu-smi -i``), targets MHz; whether a fixed AI-core clock can be set depends on the
    SKU and firmware. There is no "unlock" command, so ``reset()`` sets ``f_nominal`` back on
    every NPU this actuator changed.
    """

    def __init__(self, *, f_nominal: float, chip: int = 0, timeout: float = 10.0) -> None:
        try:
            importlib.import_module("torch_npu")  # optional: Ascend hosts only
        except ImportError:
            raise DvfsError("DVFS actuator 'npu' needs torch_npu (Ascend hosts only)") from None
        tool = shutil.which("npu-smi")
        if tool is None:
            raise DvfsError("DVFS actuator 'npu' needs npu-smi on PATH")
        self._tool = tool
        self.f_nominal = float(f_nominal)
        self.chip = chip
        self.timeout = timeout
        self.changed: dict[int, float] = {}

    def _set(self, device: int, mhz: float) -> None:
        cmd = [self._tool, "set", "-t", "aicore-freq", "-i", str(device), "-c", str(self.chip)]
        cmd += ["-f", str(int(mhz))]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.timeout, check=False
            )
        except subprocess.TimeoutExpired:
            raise DvfsError(f"npu-smi did not answer within {self.timeout} s") from None
        if done.returncode != 0:
            last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise DvfsError(f"npu-smi failed on NPU {device}: {last[0]}")

    def apply(self, targets: Mapping[int, float]) -> None:
        for device, f in targets.items():
            self._set(device, f)
            self.changed[device] = f

    def reset(self) -> None:
        for device in sorted(self.changed):
            self._set(device, self.f_nominal)
            del self.changed[device]


def make_actuator(kind: str, **kw: Any) -> Actuator:
    """Build the actuator named ``kind`` (off | sim | nvml | npu) with its keyword arguments."""
    makers: dict[str, Any] = {
        "off": OffActuator,
        "sim": SimActuator,
        "nvml": NvmlActuator,
        "npu": NpuActuator,
    }
    if kind not in makers:
        raise DvfsError(
            f"unknown DVFS actuator {kind!r} (choose one of: {', '.join(ACTUATOR_KINDS)})"
        )
    try:
        return makers[kind](**kw)
    except TypeError as err:  # wrong or missing keyword for that actuator
        raise DvfsError(f"bad options for DVFS actuator {kind!r}: {err}") from None
