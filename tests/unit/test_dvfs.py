"""DVFS: the frequency policy (tables and properties), the simulated actuator, actuator choice."""

from __future__ import annotations

import random
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest

from elaswave.errors import ElasWaveError
from elaswave.planning.dvfs import DvfsError, frequency_plan
from elaswave.runtime.strategies.pipeline.clocks import (
    NvmlActuator,
    OffActuator,
    SimActuator,
    cpufreq_status,
    make_actuator,
    snap_clock,
)

NOM, LO, HI = 1000.0, 500.0, 1250.0  # nominal, floor and boost clocks (MHz) for the tables

# ---- frequency_plan: tables ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "headroom", "targets", "after"),
    [
        # balanced: nothing idles, nothing changes
        ([4.0, 4.0, 4.0, 4.0], None, [NOM] * 4, [4.0] * 4),
        ([4.0, 4.05, 4.0, 4.0], None, [NOM] * 4, [4.0, 4.05, 4.0, 4.0]),  # within 2 %
        # a single stage is balanced by definition
        ([3.0], None, [NOM], [3.0]),
        # one slow stage: raised to f_max, the others lowered to keep pace with it
        ([5.0, 3.2, 3.2, 3.2], None, [HI, 800.0, 800.0, 800.0], [4.0] * 4),
        ([3.2, 3.2, 5.0], None, [800.0, 800.0, HI], [4.0] * 3),
        # two bottleneck stages both go to f_max
        ([5.0, 5.0, 3.0, 3.0], None, [HI, HI, 750.0, 750.0], [4.0] * 4),
        # no headroom anywhere: only lowering
        ([5.0, 3.2, 3.2, 3.2], [False] * 4, [NOM, 640.0, 640.0, 640.0], [5.0] * 4),
        # no headroom on the bottleneck is the same
        ([5.0, 3.2, 3.2, 3.2], [False, True, True, True], [NOM, 640.0, 640.0, 640.0], [5.0] * 4),
        # a stage without headroom that would become the bottleneck bounds the others
        (
            [5.0, 4.5, 3.0, 3.0],
            [True, False, True, True],
            [5000.0 / 4.5, NOM, 3000.0 / 4.5, 3000.0 / 4.5],
            [4.5] * 4,
        ),
        # the f_min floor: those stages simply finish early
        ([5.0, 1.0, 1.0, 4.0], None, [HI, LO, LO, NOM], [4.0, 2.0, 2.0, 4.0]),
    ],
)
def test_frequency_plan_table(
    times: list[float], headroom: list[bool] | None, targets: list[float], after: list[float]
) -> None:
    plan = frequency_plan(
        times, microbatches=8, f_nominal=NOM, f_min=LO, f_max=HI, headroom=headroom
    )
    assert plan.targets == pytest.approx(targets, rel=1e-12)
    assert plan.stage_times == pytest.approx(after, rel=1e-12)
    pipeline = 8 + len(times) - 1
    assert plan.step_time_before == pytest.approx(pipeline * max(times))
    assert plan.step_time_after == pytest.approx(pipeline * max(after))
    assert plan.changed == (targets != [NOM] * len(times))
    assert plan.as_targets() == dict(enumerate(plan.targets))
    energy = sum((f / NOM) ** 2 * t for f, t in zip(targets, after, strict=True)) / sum(times)
    assert plan.energy_ratio == pytest.approx(energy)
    assert "\n" not in plan.describe()


def test_frequency_plan_numbers_of_one_case() -> None:
    plan = frequency_plan([5.0, 3.2, 3.2, 3.2], microbatches=8, f_nominal=NOM, f_min=LO, f_max=HI)
    assert plan.step_time_before == 55.0 and plan.step_time_after == 44.0
    assert plan.speedup == pytest.approx(1.25)
    # (1.25^2 * 4 + 3 * 0.8^2 * 4) / 14.6: the boost costs less than the slowed stages save
    assert plan.energy_ratio == pytest.approx(13.93 / 14.6)
    assert plan.targets[0] == HI  # exactly f_max, not a rounding of it


def test_frequency_plan_tolerance_zero_acts_on_any_imbalance() -> None:
    times = [4.0, 4.05, 4.0]
    assert not frequency_plan(times, microbatches=4, f_nominal=NOM, f_min=LO, f_max=HI).changed
    plan = frequency_plan(times, microbatches=4, f_nominal=NOM, f_min=LO, f_max=HI, tolerance=0)
    assert plan.targets[1] == HI and plan.step_time_after < plan.step_time_before


def test_frequency_plan_properties_randomized() -> None:
    rng = random.Random(31)
    for _ in range(300):
        n = rng.randint(1, 6)
        times = [rng.uniform(0.5, 5.0) for _ in range(n)]
        room = [rng.random() < 0.7 for _ in range(n)]
        f_nom = rng.uniform(800, 1500)
        f_min, f_max = f_nom * rng.uniform(0.3, 1.0), f_nom * rng.uniform(1.0, 1.6)
        plan = frequency_plan(
            times, microbatches=rng.randint(1, 16), f_nominal=f_nom, f_min=f_min, f_max=f_max,
            headroom=room, tolerance=rng.choice([0.0, 0.02]),
        )  # fmt: skip
        where = f"times={times} room={room} clocks={(f_min, f_nom, f_max)} plan={plan}"
        assert plan.step_time_after <= plan.step_time_before * (1 + 1e-12), where
        bottleneck = max(plan.stage_times)
        for s, (f, t) in enumerate(zip(plan.targets, plan.stage_times, strict=True)):
            assert f_min * (1 - 1e-12) <= f <= (f_max if room[s] else f_nom) * (1 + 1e-12), where
            if plan.changed and f > f_min * (1 + 1e-9):
                # the lowest clock that keeps pace: any slower would make this stage the bottleneck
                assert t == pytest.approx(bottleneck, rel=1e-9), where
        if plan.changed:  # no cheaper bottleneck exists within the caps
            caps = [f_max if r else f_nom for r in room]
            best = max(t * f_nom / c for t, c in zip(times, caps, strict=True))
            assert bottleneck == pytest.approx(best, rel=1e-12), where


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage_times": []}, "no pipeline stages"),
        ({"stage_times": [1.0, 0.0]}, "stage 1 has 0.0"),
        ({"stage_times": [1.0, -2.0]}, "stage 1 has -2.0"),
        ({"stage_times": [float("nan")]}, "stage time must be"),
        ({"microbatches": 0}, "microbatches must be >= 1"),
        ({"f_min": 1100.0}, "0 < f_min <= f_nominal <= f_max"),
        ({"f_max": 900.0}, "0 < f_min <= f_nominal <= f_max"),
        ({"f_min": 0.0}, "0 < f_min"),
        ({"f_nominal": float("inf"), "f_max": float("inf")}, "f_nominal=inf"),
        ({"headroom": [True]}, "headroom names 1 stages, stage_times 2"),
        ({"tolerance": -0.1}, "tolerance must be"),
    ],
)
def test_frequency_plan_errors(kwargs: dict, message: str) -> None:
    args: dict = {
        "stage_times": [2.0, 1.0],
        "microbatches": 4,
        "f_nominal": NOM,
        "f_min": LO,
        "f_max": HI,
    }
    args.update(kwargs)
    times = args.pop("stage_times")
    with pytest.raises(DvfsError, match=message) as info:
        frequency_plan(times, **args)
    assert "\n" not in str(info.value) and isinstance(info.value, ElasWaveError)


# ---- actuators -----------------------------------------------------------------------------


def test_sim_actuator_scales_stage_times() -> None:
    sim = SimActuator(f_nominal=NOM)
    plan = frequency_plan([5.0, 3.2, 3.2], microbatches=4, f_nominal=NOM, f_min=LO, f_max=HI)
    sim.apply(plan.as_targets())
    # stretching each stage's nominal time by its scale reproduces the plan's prediction
    for s, t in enumerate([5.0, 3.2, 3.2]):
        assert t * sim.time_scale(s) == pytest.approx(plan.stage_times[s])
    assert sim.time_scale(0) == pytest.approx(0.8) and sim.time_scale(7) == 1.0
    sim.apply({1: 500.0})
    assert sim.time_scale(1) == 2.0 and sim.time_scale(0) == pytest.approx(0.8)
    sim.reset()
    assert all(sim.time_scale(s) == 1.0 for s in range(3))
    assert sim.history == [plan.as_targets(), {1: 500.0}, {}]


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_sim_actuator_rejects_bad_clocks(bad: float) -> None:
    sim = SimActuator(f_nominal=NOM)
    with pytest.raises(DvfsError, match="clock must be"):
        sim.apply({0: bad})
    assert sim.targets == {}
    with pytest.raises(DvfsError, match="f_nominal must be"):
        SimActuator(f_nominal=bad)


@pytest.mark.parametrize(
    ("target", "supported", "expected"),
    [
        (1400.0, [1980, 1410, 1395, 210], 1410),  # lowest clock not slower than asked
        (1410.0, [1980, 1410, 1395], 1410),
        (2500.0, [1980, 1410], 1980),  # above the top: the top
        (100.0, [1980, 1410, 210], 210),
    ],
)
def test_snap_clock(target: float, supported: list[float], expected: float) -> None:
    assert snap_clock(target, supported) == expected


def test_snap_clock_needs_clocks() -> None:
    with pytest.raises(DvfsError, match="no supported clocks"):
        snap_clock(1000.0, [])


def test_make_actuator_kinds() -> None:
    off = make_actuator("off")
    assert isinstance(off, OffActuator)
    off.apply({0: 1.0})
    off.reset()
    sim = make_actuator("sim", f_nominal=NOM)
    assert isinstance(sim, SimActuator) and sim.f_nominal == NOM


@pytest.mark.parametrize(
    ("kind", "kwargs", "message"),
    [
        ("turbo", {}, "unknown DVFS actuator 'turbo' \\(choose one of: off, sim, nvml, npu\\)"),
        ("", {}, "unknown DVFS actuator ''"),
        ("sim", {"f_nom": 1.0}, "bad options for DVFS actuator 'sim'"),
    ],
)
def test_make_actuator_errors(kind: str, kwargs: dict, message: str) -> None:
    with pytest.raises(DvfsError, match=message):
        make_actuator(kind, **kwargs)


def test_make_actuator_nvml_without_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    with pytest.raises(DvfsError, match="needs pynvml: pip install nvidia-ml-py"):
        make_actuator("nvml")


def test_make_actuator_npu_without_torch_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    with pytest.raises(DvfsError, match="needs torch_npu"):
        make_actuator("npu", f_nominal=NOM)


# ---- NvmlActuator's bookkeeping, against a stand-in for pynvml (no GPU is touched) ----------


def _fake_pynvml(calls: list[tuple], deny: Callable[[str], bool]) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(f"NVML error {value}")
            self.value = value

    def call(name: str, result: object = None) -> Callable[..., object]:
        def fn(*args: object) -> object:
            calls.append((name, *args))
            if deny(name):
                raise NVMLError(nvml.NVML_ERROR_NO_PERMISSION)
            return result

        return fn

    nvml.NVMLError = NVMLError
    nvml.NVML_ERROR_NO_PERMISSION = 4
    nvml.NVML_ERROR_NOT_SUPPORTED = 3
    nvml.NVML_CLOCK_GRAPHICS = 0
    nvml.nvmlInit = call("init")
    nvml.nvmlShutdown = call("shutdown")
    nvml.nvmlDeviceGetHandleByIndex = lambda i: f"gpu{i}"
    nvml.nvmlDeviceGetSupportedMemoryClocks = lambda h: [3201, 1593]
    nvml.nvmlDeviceGetSupportedGraphicsClocks = lambda h, mem: [1980, 1410, 1005, 345]
    nvml.nvmlDeviceGetDefaultApplicationsClock = lambda h, kind: 1410
    nvml.nvmlDeviceGetMaxClockInfo = lambda h, kind: 1980
    nvml.nvmlDeviceSetGpuLockedClocks = call("lock")
    nvml.nvmlDeviceResetGpuLockedClocks = call("reset")
    return nvml


def test_nvml_actuator_locks_snapped_clocks_and_resets(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls, lambda name: False))
    act = make_actuator("nvml")
    assert isinstance(act, NvmlActuator)
    assert act.clock_range(0) == (345.0, 1410.0, 1980.0)
    act.apply({0: 1980.0, 1: 900.0})
    assert act.locked == {0: 1980, 1: 1005}
    act.close()
    assert calls == [
        ("init",),
        ("lock", "gpu0", 1980, 1980),
        ("lock", "gpu1", 1005, 1005),
        ("reset", "gpu0"),
        ("reset", "gpu1"),
        ("shutdown",),
    ]
    assert act.locked == {}


def test_nvml_actuator_permission_error_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(calls, lambda name: name == "lock"))
    act = make_actuator("nvml")
    with pytest.raises(DvfsError, match="cannot lock clocks on GPU 0: permission denied"):
        act.apply({0: 1410.0})
    assert act.locked == {}  # nothing to undo


def _cpu(root: Path, index: int) -> None:
    d = root / f"cpu{index}" / "cpufreq"
    d.mkdir(parents=True)
    for name, value in (
        ("cpuinfo_min_freq", "800000"),
        ("cpuinfo_max_freq", "3500000"),
        ("scaling_governor", "schedutil"),
        ("scaling_max_freq", "3500000"),
    ):
        (d / name).write_text(value + "\n")


@pytest.mark.parametrize(
    ("cpus", "writable", "line"),
    [
        (0, True, "no cpufreq: {root}/cpu0/cpufreq is absent (no CPU clock control here)"),
        (2, True, "cpufreq writable (2 CPUs, 800–3500 MHz, governor schedutil)"),
        (1, False, "cpufreq read-only (1 CPUs, 800–3500 MHz, governor schedutil): setting "
                   "scaling_max_freq needs root"),
    ],
)  # fmt: skip
def test_what_a_machine_offers_to_set_cpu_clocks_is_one_line(
    tmp_path: Path, cpus: int, writable: bool, line: str
) -> None:
    for i in range(cpus):
        _cpu(tmp_path, i)
    (tmp_path / "cpuidle").mkdir()  # a neighbour that is no CPU
    seen: list[Path] = []

    def can_write(path: Path) -> bool:  # root may write anything: the test says who may
        seen.append(path)
        return writable

    assert cpufreq_status(tmp_path, writable=can_write) == line.format(root=tmp_path)
    assert seen == ([tmp_path / "cpu0" / "cpufreq" / "scaling_max_freq"] if cpus else [])
