"""Layer costs measured while training (``layer_costs: online``): the pure arithmetic (moving
average, attribution of backward and device time to layers, the leader's merge of workers'
measurements) and the per-step bookkeeping of a stage."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

from elaswave.config import load_config
from elaswave.errors import ConfigError
from elaswave.planning.layercosts import (
    ema_update,
    measured_layers,
    online_costs,
    plan_costs,
    split_by,
    stage_sample,
)
from elaswave.runtime import timing
from elaswave.runtime.strategies.pipeline.stagetimes import StageTimer

# ---- moving average --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("previous", "sample", "weight", "expected"),
    [
        ({}, {0: 2.0, 1: 4.0}, 0.3, {0: 2.0, 1: 4.0}),  # first sample: taken as is
        ({0: 2.0}, {0: 4.0}, 0.5, {0: 3.0}),
        ({0: 2.0}, {0: 4.0}, 0.25, {0: 2.5}),
        ({0: 2.0}, {0: 4.0}, 1.0, {0: 4.0}),  # weight 1: only the newest
        ({0: 2.0, 1: 8.0}, {1: 4.0, 2: 1.0}, 0.5, {1: 6.0, 2: 1.0}),  # layer 0 no longer run
    ],
)
def test_ema_update(
    previous: dict[int, float], sample: dict[int, float], weight: float, expected: dict
) -> None:
    got = ema_update(previous, sample, weight=weight)
    assert got.keys() == expected.keys()
    for layer, value in expected.items():
        assert got[layer] == pytest.approx(value)


@pytest.mark.parametrize("weight", [0.0, -0.1, 1.5, math.nan])
def test_ema_update_rejects_bad_weights(weight: float) -> None:
    with pytest.raises(ValueError, match="weight"):
        ema_update({}, {0: 1.0}, weight=weight)


def test_ema_converges_to_a_new_level() -> None:
    avg: dict[int, float] = {0: 1.0}
    for _ in range(30):
        avg = ema_update(avg, {0: 3.0}, weight=0.3)
    assert avg[0] == pytest.approx(3.0, rel=1e-4)


# ---- attribution -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "weights", "expected"),
    [
        (6.0, [1.0, 2.0], (2.0, 4.0)),
        (6.0, [0.0, 3.0], (0.0, 6.0)),
        (6.0, [0.0, 0.0], (3.0, 3.0)),  # nothing to go by: equal parts
        (6.0, [-1.0, 1.0], (0.0, 6.0)),  # negative weights count as nothing
        (0.0, [1.0, 2.0], (0.0, 0.0)),
        (5.0, [], ()),
    ],
)
def test_split_by(total: float, weights: list[float], expected: tuple[float, ...]) -> None:
    assert split_by(total, weights) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("forward", "backward", "pause", "weights", "mbs"),
    [
        ([0.1, 0.3], 0.8, 0.0, [0.5, 0.5], 4),
        ([0.01, 0.2, 0.05], 0.5, 0.9, [0.01, 0.9, 0.09], 3),
        ([0.0, 0.0], 0.4, 0.2, [0.0, 0.0], 2),
        ([0.7], 1.4, 0.3, [1.0], 1),
    ],
)
def test_stage_sample_accounts_for_every_measured_second(
    forward: list[float], backward: float, pause: float, weights: list[float], mbs: int
) -> None:
    sample = stage_sample(forward, backward, pause, pause_weights=weights, microbatches=mbs)
    assert len(sample) == len(forward)
    assert sum(sample) * mbs == pytest.approx(sum(forward) + backward + pause)
    assert all(x >= 0 for x in sample)


def test_stage_sample_follows_forward_for_backward_and_weights_for_pause() -> None:
    # Backward follows the forward times (1:3), the device time its own shares (3:1).
    sample = stage_sample([1.0, 3.0], 8.0, 4.0, pause_weights=[0.75, 0.25], microbatches=2)
    assert sample == pytest.approx(((1.0 + 2.0 + 3.0) / 2, (3.0 + 6.0 + 1.0) / 2))


@pytest.mark.parametrize(
    ("forward", "weights", "mbs", "message"),
    [([1.0], [1.0], 0, "micro-batch"), ([1.0, 2.0], [1.0], 2, "pause weight")],
)
def test_stage_sample_rejects_bad_shapes(
    forward: list[float], weights: list[float], mbs: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        stage_sample(forward, 1.0, 0.0, pause_weights=weights, microbatches=mbs)


# ---- the leader's merge ----------------------------------------------------------------------

FALLBACK = (1.0, 10.0, 10.0, 4.0)


@pytest.mark.parametrize(
    ("observations", "expected"),
    [
        # every layer measured: the median of its observations
        ([{0: 0.1, 1: 2.0}, {2: 3.0, 3: 1.0}, {0: 0.3, 1: 4.0}, {0: 0.2}], (0.2, 3.0, 3.0, 1.0)),
        # layers 2, 3 unmeasured: fallback × median ratio (0.5/1 = 0.5, 5/10 = 0.5)
        ([{0: 0.5, 1: 5.0}], (0.5, 5.0, 5.0, 2.0)),
        # the ratio is the median over the measured layers (0.2, 0.3, 0.6 → 0.3)
        ([{0: 0.2, 1: 3.0, 2: 6.0}], (0.2, 3.0, 6.0, 1.2)),
        # JSON keys are strings
        ([{"0": 0.5, "1": 5.0, "2": 5.0, "3": 2.0}], (0.5, 5.0, 5.0, 2.0)),
        # nothing measured: the fallback
        ([], FALLBACK),
        ([{}], FALLBACK),
    ],
)
def test_online_costs(observations: list[dict], expected: tuple[float, ...]) -> None:
    assert online_costs(observations, fallback=FALLBACK) == pytest.approx(expected)


@pytest.mark.parametrize(
    "bad",
    [
        {0: 0.0},
        {0: -1.0},
        {0: math.nan},
        {0: math.inf},
        {0: True},
        {0: "0.5"},
        {0: None},
        {4: 1.0},  # no such layer
        {-1: 1.0},
        {"x": 1.0},
        {"1.5": 1.0},
        {"²": 1.0},
        {True: 1.0},
    ],
)
def test_online_costs_ignore_invalid_measurements(bad: dict[Any, Any]) -> None:
    good = {0: 0.5, 1: 5.0}
    assert online_costs([good, bad], fallback=FALLBACK) == pytest.approx((0.5, 5.0, 5.0, 2.0))
    assert online_costs([bad], fallback=FALLBACK) == FALLBACK
    assert measured_layers([bad], 4) == []


def test_measured_layers() -> None:
    assert measured_layers([{"3": 1.0}, {1: 2.0, 2: -1.0}], 4) == [1, 3]
    assert measured_layers([], 4) == []


PROFILE = [0.5, 5.0, 5.0, 2.0]
ESTIMATE = (1.0, 10.0, 10.0, 4.0)


@pytest.mark.parametrize(
    ("mode", "profiles", "observations", "costs", "source"),
    [
        ("estimate", [PROFILE], [{0: 9.0}], ESTIMATE, "estimate"),
        ("profile", [PROFILE], [{0: 9.0}], PROFILE, "profile"),
        ("profile", [[1.0, 2.0]], [], ESTIMATE, "estimate"),  # unusable profile
        ("online", [PROFILE], [], PROFILE, "profile"),  # nothing measured yet
        ("online", [], [], ESTIMATE, "estimate"),
        # measured layers override the profile; unmeasured ones follow it, rescaled
        ("online", [PROFILE], [{0: 1.0, 1: 10.0}], (1.0, 10.0, 10.0, 4.0), "online"),
        ("online", [PROFILE], [{"0": 0.4, "1": 6.0, "2": 7.0, "3": 1.0}], (0.4, 6, 7, 1), "online"),
        ("online", [], [{0: 0.5, 1: 5.0}], (0.5, 5.0, 5.0, 2.0), "online"),
        ("online", [PROFILE], [{0: -1.0}], PROFILE, "profile"),  # nothing usable measured
    ],
)
def test_plan_costs(
    mode: str, profiles: list, observations: list, costs: tuple, source: str
) -> None:
    got, got_source = plan_costs(mode, ESTIMATE, profiles, observations=observations)
    assert got == pytest.approx(costs)
    assert got_source == source


# ---- the stage's bookkeeping -----------------------------------------------------------------


class _Clock(timing.Clock):
    """The runtime's clock, advanced by the test alone: timings exact whatever the load."""

    def __init__(self) -> None:
        self.t = self.w = 0.0

    def now(self) -> float:
        return self.t

    def waited(self) -> float:
        return self.w


@pytest.fixture
def clock() -> Iterator[_Clock]:
    fake = _Clock()
    old = timing.set_clock(fake)
    yield fake
    timing.set_clock(old)


def _step(
    timer: StageTimer, layers: range, work: dict[int, float], clock: _Clock, mbs: int = 2
) -> None:
    timer.begin(layers)
    for _ in range(mbs):
        for layer in layers:
            with timer.forward(layer):
                clock.t += work.get(layer, 0.0)
        with timer.backward():
            clock.t += 0.002
        with timer.pause():
            pass
    timer.end(mbs, [1.0 / len(layers)] * len(layers))


def test_busy_time_leaves_out_the_wait_for_a_cpu(clock: _Clock) -> None:
    mark = timing.busy_mark()
    clock.t += 5.0  # 5 s elapsed, 2 s of them waiting for a core
    clock.w += 2.0
    assert timing.busy_since(mark) == 3.0


def test_stage_timer_skips_the_warm_up_step_and_averages_real_ones(clock: _Clock) -> None:
    timer = StageTimer(weight=0.5)
    _step(timer, range(1, 3), {1: 0.001, 2: 0.02}, clock)
    assert timer.snapshot() == {}  # the first step on these layers warms up
    _step(timer, range(1, 3), {1: 0.001, 2: 0.02}, clock)
    seconds = timer.snapshot()
    # Per micro-batch: the layer's forward and its share of the backward (by forward time).
    assert seconds == pytest.approx({1: 0.001 + 0.002 / 21, 2: 0.02 + 0.002 * 20 / 21})
    _step(timer, range(1, 3), {1: 0.003, 2: 0.02}, clock)  # layer 1 slower: the EMA follows
    assert seconds[1] < timer.snapshot()[1] < 0.003 + 0.002 * 3 / 23


def test_stage_timer_keeps_the_layers_it_still_runs_after_a_layout_change(clock: _Clock) -> None:
    timer = StageTimer()
    for _ in range(2):
        _step(timer, range(0, 2), {}, clock)
    kept = timer.snapshot()[1]
    _step(timer, range(1, 4), {}, clock)  # a takeover: new layers, a warm-up step
    assert timer.snapshot() == {1: kept}
    _step(timer, range(1, 4), {}, clock)
    assert set(timer.snapshot()) == {1, 2, 3}


def test_stage_timer_ignores_a_step_without_micro_batches(clock: _Clock) -> None:
    timer = StageTimer()
    for _ in range(2):
        _step(timer, range(0, 1), {}, clock)
    before = timer.snapshot()
    timer.begin(range(0, 1))
    timer.end(0, [1.0])
    assert timer.snapshot() == before


# ---- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["estimate", "profile", "online"])
def test_config_accepts_layer_cost_modes(mode: str) -> None:
    cfg = load_config(env={"ELASWAVE_LAYER_COSTS": mode, "ELASWAVE_PP": "2"})
    assert (cfg.layer_costs, cfg.pp, cfg.cost_every) == (mode, 2, 10)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_costs": "measured"}, "layer_costs must be one of estimate, profile, online"),
        ({"layer_costs": "Online"}, "layer_costs must be one of"),
        ({"cost_every": 0}, "cost_every must be >= 1"),
        ({"stage_balance": 0.9}, "stage_balance must be 0 or >= 1, got 0.9"),
        ({"stage_balance": float("inf")}, "stage_balance must be 0 or >= 1"),
        ({"max_stage_bytes": -1}, "max_stage_bytes must be >= 0, got -1"),
    ],
)
def test_config_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(env={}, overrides={"pp": 2, **overrides})


def test_cost_every_from_env() -> None:
    cfg = load_config(env={"ELASWAVE_LAYER_COSTS": "online", "ELASWAVE_COST_EVERY": "4"})
    assert cfg.cost_every == 4
