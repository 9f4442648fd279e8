"""The chaos soak's fault schedule (bench/chaos.py), as a table: seeded, complete, cured."""

from __future__ import annotations

from collections import Counter

import pytest

from bench.chaos import FAULTS, KINDS, SEED, VARIANTS, fault_count, schedule


@pytest.mark.parametrize(
    ("seed", "n", "kinds", "drawn"),
    [
        (5, 20, KINDS, 20),  # the soak's own schedule
        (1, 6, KINDS, 6),  # exactly one of each kind
        (2, 3, KINDS, 3),  # fewer faults than kinds: no kind twice
        (3, 0, KINDS, 0),  # nothing to draw
        (4, 12, ("kill", "slow"), 12),  # a subset (the single-host kinds)
    ],
)
def test_schedule(seed: int, n: int, kinds: tuple[str, ...], drawn: int) -> None:
    plan = schedule(seed, n, kinds)
    assert plan == schedule(seed, n, kinds), "same seed, same schedule"
    picked = [f for f in plan if not f.get("cure")]
    assert len(picked) == drawn
    count = Counter(f["kind"] for f in picked)
    assert set(count) <= set(kinds)
    assert len(count) == min(n, len(kinds)), "every kind at least once when n allows"
    for i, f in enumerate(plan):  # every slow worker is killed right after, and only then
        if f["kind"] == "slow":
            assert plan[i + 1] == {"kind": "kill", "cure": True}
        if f.get("cure"):
            assert plan[i - 1]["kind"] == "slow"
    assert sum(f["kind"] == "kill" for f in plan) == count["kill"] + count["slow"]


def test_schedule_differs_by_seed() -> None:
    assert schedule(1, 20) != schedule(2, 20)


def test_schedule_rejects_a_negative_count() -> None:
    with pytest.raises(ValueError, match="n must be >= 0"):
        schedule(1, -1)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_draws_at_least_30_faults(name: str) -> None:
    """A variant's schedule: ≥ 30 faults (a slow brings its curing kill, a fault during recovery
    is two), every one of the variant's kinds at least once."""
    variant = VARIANTS[name]
    plan = schedule(SEED, FAULTS, variant.kinds)
    assert fault_count(plan) >= 30
    assert {f["kind"] for f in plan} == set(variant.kinds) | (
        {"kill"} if "slow" in variant.kinds else set()
    )
