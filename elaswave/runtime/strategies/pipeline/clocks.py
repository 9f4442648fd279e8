"""Who sets a pipeline stage's clock: the actuators that apply a frequency plan
(:func:`elaswave.planning.dvfs.frequency_plan`).

:class:`SimActuator` (tests; the engine stretches a stage's compute by
:meth:`SimActuator.time_scale`), :class:`NvmlActuator` (NVIDIA, locked graphics clocks through
``pynvml``), :class:`NpuActuator` (Ascend, ``npu-smi``; untested without the hardware). None of
them touches hardware unless constructed explicitly; :func:`make_actuator` builds one by name.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from elaswave.planning.dvfs import DvfsError

log = logging.getLogger(__name__)

ACTUATOR_KINDS = ("off", "sim", "nvml", "npu")


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


CPUFREQ = Path("/sys/devices/system/cpu")


def _writable(path: Path) -> bool:
    return os.access(path, os.W_OK)


def cpufreq_status(root: Path = CPUFREQ, *, writable: Callable[[Path], bool] = _writable) -> str:
    """One line on this machine's CPU clock control through Linux cpufreq (under ``root``):
    absent, present but read-only for this process (``writable``), or writable (the CPUs, the
    driver's range and governor). What a DVFS benchmark says beside predictions only."""
    cpus = sorted(root.glob("cpu[0-9]*/cpufreq"), key=lambda p: int(p.parent.name[3:]))
    if not cpus:
        return f"no cpufreq: {root}/cpu0/cpufreq is absent (no CPU clock control here)"

    def read(name: str) -> str:
        try:
            return (cpus[0] / name).read_text().strip()
        except OSError:
            return "?"

    lo, hi = read("cpuinfo_min_freq"), read("cpuinfo_max_freq")
    span = f"{int(lo) // 1000}–{int(hi) // 1000} MHz" if lo.isdigit() and hi.isdigit() else "?"
    what = f"{len(cpus)} CPUs, {span}, governor {read('scaling_governor')}"
    if not writable(cpus[0] / "scaling_max_freq"):
        return f"cpufreq read-only ({what}): setting scaling_max_freq needs root"
    return f"cpufreq writable ({what})"


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
