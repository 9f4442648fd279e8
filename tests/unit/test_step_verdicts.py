"""Non-finite steps: the local verdict each rank adds to the step's tail, the job's verdict on a
skipped step, the config and fault that name them, and the report's incident. Preemption's
signal and its slot in the same tail."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from elaswave.config import load_config
from elaswave.config.cluster import preempt_signum
from elaswave.faults import FaultKind, FaultSpec
from elaswave.planning.verdicts import nonfinite_verdict
from elaswave.report import build_report
from elaswave.report_text import render
from elaswave.runtime.strategies.sums import StepTail
from tests.unit.test_config import config_error
from tests.unit.test_report import start_events, write_run

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("loss", "grads", "skip", "bad"),
    [
        (2.5, [1.0, -2.0], False, False),
        (NAN, [1.0, -2.0], False, True),  # the loss alone
        (INF, [1.0, -2.0], False, True),
        (2.5, [1.0, NAN], False, True),  # the gradient alone
        (2.5, [INF, -INF], False, True),  # infinities that would cancel to NaN
        (2.5, [3e38, 3e38], False, False),  # their float32 sum overflows; float64's does not
        (2.5, [1.0, -2.0], True, False),  # skipped by the config: the rank's values are fine
    ],
)
def test_each_rank_judges_its_own_loss_and_gradient(
    loss: float, grads: list[float], skip: bool, bad: bool
) -> None:
    tail = StepTail()
    tail.add(torch.tensor(loss), 4)
    verdict = tail.judge(torch.tensor(grads, dtype=torch.float32), skip=skip)
    assert bool(verdict) is bad
    assert tail.nonfinite == (1 if bad or skip else 0)


def test_the_reduced_tail_counts_the_ranks_that_saw_non_finite_values() -> None:
    """Summed like any tail (an all-reduce), the count is the same on every rank: every rank
    skips the step, or none does."""
    total = StepTail()
    for loss in (1.0, NAN, 2.0, NAN):
        tail = StepTail()
        tail.add(torch.tensor(loss), 2)
        tail.judge(torch.zeros(3), skip=False)
        total.values += tail.values
    assert total.nonfinite == 2 and total.count == 8


@pytest.mark.parametrize(
    ("configured", "streak", "mode", "limit", "stop", "after"),
    [
        (False, 0, "skip", 5, None, 1),
        (False, 4, "skip", 5, None, 5),  # the fifth in a row: skipped
        (False, 5, "skip", 5, "6 non-finite steps in a row", 6),  # the sixth: stop
        (False, 0, "stop", 5, "train.nonfinite is stop", 1),
        (True, 3, "skip", 5, None, 3),  # a configured skip is no fault: streak kept
        (True, 0, "stop", 1, None, 0),
    ],
)
def test_what_a_skipped_step_means_for_the_job(
    configured: bool, streak: int, mode: str, limit: int, stop: str | None, after: int
) -> None:
    reason, streak_after = nonfinite_verdict(
        configured=configured, streak=streak, mode=mode, limit=limit
    )
    assert streak_after == after
    if stop is None:
        assert reason is None
    else:
        assert reason is not None and reason.startswith(stop)


def test_the_config_names_skipped_steps_and_the_policy() -> None:
    cfg = load_config(env={}, overrides={"train.skip_steps": [3, 7], "train.nonfinite": "stop"})
    assert cfg.train.skip_steps == [3, 7] and cfg.train.nonfinite == "stop"
    assert load_config(env={}).train.nonfinite == "skip"
    assert load_config(env={}).train.nonfinite_limit == 5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"train.nonfinite": "ignore"}, "train.nonfinite must be skip or stop"),
        ({"train.nonfinite_limit": 0}, "train.nonfinite_limit must be > 0"),
        ({"train.skip_steps": [0]}, "train.skip_steps: each must be a step in [1,"),
        ({"train.skip_steps": [41], "train.steps": 40}, "train.skip_steps: each must be"),
        ({"train.skip_steps": ["x"]}, "'train.skip_steps[0]' must be a number"),
    ],
)
def test_bad_nonfinite_settings_are_one_line_errors(
    overrides: dict[str, Any], message: str
) -> None:
    assert message in config_error(overrides=overrides)


def test_the_nan_fault_names_a_rank_and_a_step() -> None:
    fault = FaultSpec.parse("nan,rank=1,at_step=10")
    assert (fault.kind, fault.rank, fault.at_step) == (FaultKind.NAN, 1, 10)
    assert fault.kind.signal is None  # done inside the worker, not by a signal


def test_the_report_names_the_skipped_step_its_ranks_and_samples(tmp_path: Path) -> None:
    events = start_events() + [
        {"t": 100.0, "kind": "fault_injected", "worker": "w1", "rank": 1, "step": 10,
         "fault": {"kind": "nan", "rank": 1, "at_step": 10}},
        {"t": 100.02, "kind": "step_skipped", "worker": "w0", "step": 10, "reason": "nonfinite",
         "ranks": 1, "loss": None},
        {"t": 100.021, "kind": "nonfinite_local", "worker": "w1", "rank": 1, "step": 10,
         "microbatches": [4, 5], "samples": [17, 3, 99, 41], "samples_total": 4},
        {"t": 100.5, "kind": "step_skipped", "worker": "w0", "step": 12, "reason": "configured",
         "ranks": 4, "loss": 4.9},
    ]  # fmt: skip
    rows = [
        {"step": s, "loss": 5.0, "epoch": 1, "world_size": 4, "samples": 32 * s,
         "time": 90.0 + s if s < 10 else 100.0 + 0.1 * (s - 9)}
        for s in range(1, 16)
    ]  # fmt: skip
    report = build_report(write_run(tmp_path / "run", events, rows))
    (inc,) = report["incidents"]  # one: the configured skip is no incident, the fault no crash
    assert (inc["kind"], inc["fault_step"], inc["rank"]) == ("nonfinite", 10, 1)
    assert inc["first_commit_step"] == 11 and inc["recomputed_steps"] == 0
    assert inc["mttr_s"] == pytest.approx(0.2)  # the fault to step 11 committed
    assert "micro-batches [4, 5], samples [17, 3, 99, 41]" in inc["reason"]
    assert "step 10 not applied" in render(report, "md")


# ---- preemption: the signal's name, and the tail that tells every rank ----------------------


@pytest.mark.parametrize(
    ("name", "signum"),
    [("TERM", signal.SIGTERM), ("SIGUSR1", signal.SIGUSR1), ("usr1", signal.SIGUSR1),
     (str(int(signal.SIGHUP)), signal.SIGHUP), ("none", None), ("None", None)],
)  # fmt: skip
def test_the_preemption_signal_by_name_or_number(name: str, signum: int | None) -> None:
    assert preempt_signum(name) == signum


@pytest.mark.parametrize(
    ("name", "message"),
    [("KILL", "cannot be SIGKILL: it cannot be caught"), ("STOP", "cannot be SIGSTOP"),
     ("INT", "cannot be SIGINT: SIGINT stops a launch"), ("FOO", "must be a signal name"),
     ("USR2", "cannot be SIGUSR2: SIGUSR2 asks a hung worker for its stacks"),
     ("999", "must be a signal name")],
)  # fmt: skip
def test_a_preemption_signal_that_cannot_work_is_a_one_line_error(name: str, message: str) -> None:
    assert message in config_error(overrides={"elastic.preempt_signal": name})


def test_one_preempted_rank_tells_every_rank_in_the_same_step() -> None:
    total = StepTail()
    for preempted in (False, False, True, False):
        tail = StepTail()
        tail.preempt = preempted
        total.values += tail.values
    assert total.preempt == 1
