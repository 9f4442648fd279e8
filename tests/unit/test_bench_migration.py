"""The migration benchmark's arithmetic (bench/migration.py) on made-up runs: medians per cell,
the copy in steps, async MTTR over blocking's, and the goal's verdict."""

from __future__ import annotations

from typing import Any

import pytest

from bench import SCENARIOS, migration


def _run(mttr: float, state: float, step: float) -> dict[str, Any]:
    return {"mttr_s": mttr, "state_s": state, "migration_s": state, "state_bytes": 1e6,
            "full_layout_s": state, "window_samples_per_s": 0.0, "step_s": step}  # fmt: skip


def _runs(cells: dict[tuple[str, int], tuple[float, float, float]]) -> dict[str, list]:
    """(link, width) → (async MTTR, blocking MTTR, blocking copy) at 1 s steps, three runs
    each whose medians are those numbers."""
    out: dict[str, list] = {}
    for (link, width), (a, b, copy) in cells.items():
        out[f"{link} d{width} async"] = [_run(a * f, 0.05, 1.0) for f in (1.0, 0.5, 2.0)]
        out[f"{link} d{width} blocking"] = [_run(b * f, copy * f, 1.0) for f in (2.0, 1.0, 0.5)]
    return out


@pytest.mark.parametrize(
    ("cells", "met", "far"),
    [
        # the copy takes 3 steps, async recovers in a third of blocking's time: met
        ({("100mbit", 256): (1.0, 3.0, 3.0), ("400mbit", 256): (0.8, 1.0, 0.7)}, True, 1),
        # the same, but async only 0.6 × blocking where the copy is long: not met
        ({("100mbit", 256): (1.8, 3.0, 3.0), ("400mbit", 256): (0.2, 1.0, 0.7)}, False, 1),
        # no cell copies for two steps or more: nothing shows the goal, not met
        ({("100mbit", 256): (0.1, 3.0, 1.9)}, False, 0),
    ],
)
def test_cells_and_the_goal(cells: dict, met: bool, far: int) -> None:
    links = sorted({link for link, _ in cells})
    widths = sorted({w for _, w in cells})
    out, goal = migration.summarize_cells(_runs(cells), links, widths)
    assert goal["met"] is met and goal["cells"] == far
    for c in out:
        a, b, copy = cells[(c["link"], c["d_model"])]
        assert c["async"]["mttr_s"] == a and c["blocking"]["mttr_s"] == b  # medians
        assert c["copy_over_step"] == pytest.approx(copy)
        assert c["async_over_blocking"] == pytest.approx(a / b)


def test_the_scenario_is_listed() -> None:
    assert SCENARIOS["migration"] is migration
