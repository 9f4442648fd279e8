"""The per-layer costs a pipeline plan is cut with, and the timings they are measured from.

Costs come from the FLOP estimate, the workers' start-up profiles or what the workers measured
while training (:func:`plan_costs`); a stage turns one step's timings into seconds per
micro-batch of each layer (:func:`stage_sample`) and smooths them (:func:`ema_update`).

Separate from :mod:`elaswave.planning.pipeplan`: this turns measurements into numbers and
decides no layout; the plan takes the costs as given. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

Observation = Mapping[Any, float]  # a worker's {layer: seconds}; JSON gives the keys as strings


def measured_costs(
    profiles: Sequence[Sequence[float]], *, fallback: Sequence[float]
) -> tuple[float, ...]:
    """Per-layer costs from workers' start-up profiles: the median over workers of each layer's
    seconds (robust to one slow or busy worker). Profiles of the wrong length are ignored; with
    none left, ``fallback`` (the FLOP estimate)."""
    usable = [p for p in profiles if _usable_profile(p, len(fallback))]
    if not usable:
        return tuple(fallback)
    return tuple(statistics.median(p[i] for p in usable) for i in range(len(fallback)))


def online_costs(
    observations: Sequence[Observation], *, fallback: Sequence[float]
) -> tuple[float, ...]:
    """Per-layer costs from workers' measurements while training (``layer_costs: online``).

    Each observation is one worker's ``{layer: seconds per micro-batch}`` for the layers its stage
    ran (keys may be JSON strings). A layer's cost is the median of its observations; a layer that
    nobody measured takes its ``fallback`` cost scaled by the median ratio measured / fallback of
    the measured layers, so that all costs share one unit. Keys that are not layer indices and
    values that are not finite and positive are ignored; with nothing left, ``fallback``.
    """
    seen = _observed(observations, len(fallback))
    measured = {i: statistics.median(xs) for i, xs in enumerate(seen) if xs}
    if not measured:
        return tuple(fallback)
    ratios = [measured[i] / fallback[i] for i in measured if fallback[i] > 0]
    scale = statistics.median(ratios) if ratios else 1.0
    return tuple(measured.get(i, fallback[i] * scale) for i in range(len(fallback)))


def measured_layers(observations: Sequence[Observation], layers: int) -> list[int]:
    """The layers (of ``layers``) that have at least one usable online measurement."""
    return [i for i, xs in enumerate(_observed(observations, layers)) if xs]


def plan_costs(
    mode: str,
    estimate: Sequence[float],
    profiles: Sequence[Sequence[float]] = (),
    *,
    observations: Sequence[Observation] = (),
) -> tuple[tuple[float, ...], str]:
    """The layer costs a pipeline plan is cut with, and where they came from.

    ``mode`` is the config's ``layer_costs``: ``estimate`` (the FLOP estimate), ``profile`` (the
    median of the workers' start-up profiles) or ``online`` (the profile, overridden by what the
    workers measured while training, :func:`online_costs`). What is missing falls back to the
    previous source. Returns (costs, source), source one of ``estimate | profile | online``.
    """
    n = len(estimate)
    costs, source = tuple(estimate), "estimate"
    if mode in ("profile", "online") and any(_usable_profile(p, n) for p in profiles):
        costs, source = measured_costs(profiles, fallback=estimate), "profile"
    if mode == "online" and measured_layers(observations, n):
        costs, source = online_costs(observations, fallback=costs), "online"
    return costs, source


def split_by(total: float, weights: Sequence[float]) -> tuple[float, ...]:
    """``total`` split in proportion to ``weights`` (equally when they sum to nothing); the parts
    add up to ``total``."""
    if not weights:
        return ()
    norm = sum(w for w in weights if w > 0)
    if norm <= 0:
        return tuple(total / len(weights) for _ in weights)
    return tuple(total * max(w, 0.0) / norm for w in weights)


def stage_sample(
    forward: Sequence[float],
    backward: float,
    pause: float,
    *,
    pause_weights: Sequence[float],
    microbatches: int,
) -> tuple[float, ...]:
    """Seconds per micro-batch of each layer of a stage, from one step's timings.

    ``forward[j]``: the step's total forward time of the stage's j-th layer (timed per layer);
    ``backward``: the step's total backward time of the whole stage, attributed to its layers in
    proportion to their forward times; ``pause``: the emulated device time of the step (forward
    and backward), attributed by ``pause_weights`` (the share of it each layer stands for).
    """
    if microbatches < 1:
        raise ValueError(f"need at least one micro-batch, got {microbatches}")
    if len(pause_weights) != len(forward):
        raise ValueError("need one pause weight per layer")
    parts = zip(forward, split_by(backward, forward), split_by(pause, pause_weights), strict=True)
    return tuple((f + b + p) / microbatches for f, b, p in parts)


def ema_update(
    previous: Mapping[int, float], sample: Mapping[int, float], *, weight: float
) -> dict[int, float]:
    """Exponential moving average per layer: ``(1 - weight) · previous + weight · sample``; a layer
    seen for the first time starts at its sample. Layers absent from ``sample`` are dropped (the
    stage no longer runs them)."""
    if not 0.0 < weight <= 1.0:
        raise ValueError(f"weight must be in (0, 1], got {weight}")
    return {
        layer: x if layer not in previous else (1.0 - weight) * previous[layer] + weight * x
        for layer, x in sample.items()
    }


def _usable_profile(profile: Sequence[float], layers: int) -> bool:
    return len(profile) == layers and all(x > 0 for x in profile)


def _observed(observations: Sequence[Observation], layers: int) -> list[list[float]]:
    """The usable values of every layer, over all observations."""
    seen: list[list[float]] = [[] for _ in range(layers)]
    for obs in observations:
        for key, value in obs.items():
            layer, seconds = _layer_index(key, layers), _positive_number(value)
            if layer is not None and seconds is not None:
                seen[layer].append(seconds)
    return seen


def _layer_index(key: Any, layers: int) -> int | None:
    """``key`` as a layer index (an int, or a string of digits as JSON object keys are)."""
    if isinstance(key, bool):
        return None
    if isinstance(key, str) and key.isascii() and key.isdigit():
        key = int(key)
    return key if isinstance(key, int) and 0 <= key < layers else None


def _positive_number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None
