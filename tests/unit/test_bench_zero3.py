"""The ZeRO-3 benchmark's arithmetic (bench/zero3.py), on small made-up runs: bytes per rank
against the whole model's share, gathered bytes in layers' worth, paired step-time and MTTR
ratios, and the goals' verdicts; what it reads from a run's events."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench import SCENARIOS, zero3
from bench.common import BenchError
from bench.mttr import PHASES

LAYERS = [100, 20, 20, 100]  # 240 parameters: whole state 16 x 240 = 3840 B, / 4 ranks = 960 B
WORLD = 4


def _rank(param: int, grad: int, opt: int, replica: int = 0, gathered: int = 0) -> dict[str, int]:
    return {"param_bytes": param, "grad_bytes": grad, "optimizer_bytes": opt,
            "replica_bytes": replica, "gathered_bytes": gathered,
            "layer_grad_bytes": gathered // 2,
            "transient_bytes": gathered + gathered // 4}  # fmt: skip


def _cell(ranks: list[dict[str, int]], step: float, loss: list[float]) -> dict[str, Any]:
    return {
        "memory": {f"w{i}": m for i, m in enumerate(ranks)},
        "peak_rss_bytes": [1000 + 10 * i for i in range(len(ranks))],
        "step_s": step,
        "interval_s": step + 0.1,
        "loss": loss,
        "launch_s": 30.0,
    }


def _crash(mttr: float) -> dict[str, float]:
    return {**dict.fromkeys(PHASES, 0.01), "redo_s": mttr - 0.04, "mttr_s": mttr}


def _round(zero3_step: float, gathered: int, z1_mttr: float, z3_mttr: float) -> dict[str, Any]:
    replicated = [_rank(960, 1920, 1920)] * WORLD  # 4 + 8 (+ the step's buffer) + 8 B/param
    zero1 = [_rank(960, 1920, 480, replica=480)] * WORLD
    zero3_ranks = [_rank(240, 248, 480, 720, gathered)] * 3 + [_rank(260, 268, 520, 780, 800)]
    return {
        "fault_free": {
            "replicated": _cell(replicated, 2.0, [2.0, 1.5]),
            "zero1": _cell(zero1, 1.0, [2.0, 1.5 + 1e-7]),
            "zero3": _cell(zero3_ranks, zero3_step, [2.0, 1.5 - 3e-7]),
        },
        "crash": {"zero1": _crash(z1_mttr), "zero3": _crash(z3_mttr)},
    }


def test_summary_is_bytes_against_the_share_layers_worth_and_paired_ratios() -> None:
    rounds = [_round(1.2, 800, 0.5, 1.0), _round(1.3, 900, 0.4, 1.0)]
    r = zero3.summary(rounds, LAYERS, WORLD)
    assert r["parameters"] == 240 and r["whole_state_bytes"] == 3840
    assert r["share_bytes"] == 960 and r["largest_layer_bytes"] == 400
    z3 = r["memory"]["zero3"]
    assert z3["state_bytes"]["median"] == 968 and z3["state_bytes"]["n"] == 8  # every rank, run
    assert z3["state_over_share"]["max"] == pytest.approx(1048 / 960)
    assert z3["gathered_layers"]["median"] == 2.0 and z3["gathered_layers"]["max"] == 2.25
    assert z3["transient_layers"]["median"] == 2.5  # parameters and gradients at once
    assert r["memory"]["replicated"]["state_over_share"]["median"] == 5.0
    assert r["memory"]["zero1"]["peak_rss_bytes"] == {"median": 1015, "min": 1000, "max": 1030,
                                                      "n": 8}  # fmt: skip
    assert r["step"]["zero3"]["step_s"]["median"] == pytest.approx(1.25)
    assert r["ratios"]["step_zero3_over_zero1"]["median"] == pytest.approx(1.25)
    assert r["ratios"]["step_zero3_over_replicated"]["max"] == pytest.approx(0.65)
    assert r["ratios"]["mttr_zero3_over_zero1"]["median"] == pytest.approx(2.25)
    assert r["mttr"]["zero1"]["mttr_s"]["median"] == pytest.approx(0.45)
    assert r["max_abs_loss_diff_vs_replicated"]["zero3"] == pytest.approx(3e-7)
    goals = r["goals"]
    assert goals["zero3_state_over_share"]["met"]  # 1.09 on the largest rank
    assert not goals["zero3_gathered_layers"]["met"]  # 2.25 layers' worth in round 2
    assert goals["zero3_gathered_layers"]["measured"] == 2.25
    assert goals["step_zero3_over_zero1"]["met"]  # 1.25 <= 1.3


def test_a_goal_is_missed_on_the_largest_rank_or_the_median_round() -> None:
    rounds = [_round(1.2, 800, 0.5, 1.0), _round(1.5, 800, 0.5, 1.0), _round(1.4, 800, 0.5, 1.0)]
    big = _rank(300, 308, 600, 900, 800)  # 1208 / 960 = 1.26
    rounds[1]["fault_free"]["zero3"]["memory"]["w0"] = big
    r = zero3.summary(rounds, LAYERS, WORLD)
    assert r["memory"]["zero3"]["state_over_share"]["median"] == pytest.approx(968 / 960)
    assert not r["goals"]["zero3_state_over_share"]["met"]
    assert r["goals"]["zero3_gathered_layers"]["met"]  # 800 B = 2 layers of 400 B
    assert r["goals"]["step_zero3_over_zero1"]["measured"] == pytest.approx(1.4)
    assert not r["goals"]["step_zero3_over_zero1"]["met"]


def test_show_prints_every_table(capsys: pytest.CaptureFixture[str]) -> None:
    rounds = [_round(1.2, 800, 0.5, 1.0)]
    result = {
        **zero3.summary(rounds, LAYERS, WORLD),
        "modes": {m: label for m, (label, _) in zero3.MODES.items()},
        "world": WORLD,
        "repeat": 1,
        "steps": zero3.STEPS,
        "warmup_steps": zero3.WARMUP,
        "crash_steps": zero3.CRASH_STEPS,
        "fault": zero3.FAULT,
    }
    zero3.show(result)
    out = capsys.readouterr().out
    assert "State per rank" in out and "Fault-free step time" in out and "Crash MTTR" in out
    assert out.count("goal: ") == 3 and "NOT met" not in out
    assert SCENARIOS["zero3"] is zero3


def _events(mode: str) -> list[dict[str, Any]]:
    sync = {"kind": "state_synced", "epoch": 1}
    if mode != "replicated":
        sync["max_over_mean"] = 1.0
    gathered = 500 if mode == "zero3" else 0
    return [
        sync,
        {"kind": "memory", "worker": "w0", "epoch": 1, **_rank(4, 8, 8, 0, gathered)},
        {"kind": "memory", "worker": "w0", "epoch": 1, **_rank(4, 8, 8, 2, gathered // 2)},
        {"kind": "memory", "worker": "w1", "epoch": 1, **_rank(4, 8, 8, 2, gathered)},
    ]


def test_memory_is_the_last_report_with_the_largest_gathered_peak() -> None:
    memory = zero3._memory(_events("zero3"))
    assert memory == {"w0": _rank(4, 8, 8, 2, 500), "w1": _rank(4, 8, 8, 2, 500)}


@pytest.mark.parametrize("ran", ["replicated", "zero1", "zero3"])
def test_a_run_of_another_mode_is_refused(ran: str) -> None:
    for mode in zero3.MODES:
        if mode == ran:
            zero3._check_mode(Path("run"), _events(ran), mode)
            continue
        with pytest.raises(BenchError, match=f"expected {mode}"):
            zero3._check_mode(Path("run"), _events(ran), mode)
