"""The rollback decision after a check that found silent corruption (pure, table-tested), and the
records a rollback rewrites: metrics of the redone steps, durable checkpoints saved after it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elaswave.events import JsonlWriter, read_jsonl
from elaswave.runtime.durable import checkpoints as durable
from elaswave.runtime.integrity.checker import check_due
from elaswave.runtime.integrity.rollback import NONE, RollbackVerdict, rollback_verdict

VOID = RollbackVerdict(None, reason="a rank's layout changed since the last clean check")


@pytest.mark.parametrize(
    ("good", "step", "whole", "verdict"),
    [
        ([5, 5, 5, 5], 10, True, RollbackVerdict(5, 0)),
        ([5, 5, 5, 5], 10, False, RollbackVerdict(5, 0)),  # each rank takes its own part back
        ([NONE, 5, 5], 10, False, VOID),  # a part (a shard, a stage's layers) fits no newcomer
        ([5, NONE], 10, False, VOID),
        ([NONE, NONE], 10, False, RollbackVerdict(None, reason="no rank keeps a known-good state")),
        ([NONE, 5, 5], 10, True, RollbackVerdict(5, 1)),  # a newcomer receives it from rank 1
        ([10, 10], 10, True, RollbackVerdict(10, 0)),  # found by the check right after a clean one
        ([0, 0, 0], 3, True, RollbackVerdict(0, 0)),  # the initial state is known good
        ([NONE, NONE], 10, True, RollbackVerdict(None, reason="no rank keeps a known-good state")),
        (
            [5, 10],
            10,
            True,
            RollbackVerdict(None, reason="ranks keep known-good states of steps [5, 10]"),
        ),
        (
            [15, 15],
            10,
            True,
            RollbackVerdict(None, reason="the known-good state (step 15) is newer"),
        ),
    ],
)
def test_rollback_verdict(
    good: list[int], step: int, whole: bool, verdict: RollbackVerdict
) -> None:
    assert rollback_verdict(good, step, whole=whole) == verdict


@pytest.mark.parametrize(
    ("step", "every", "per_layout", "generation", "checked", "due"),
    [
        (20, 10, False, 1, 1, True),  # the periodic check
        (21, 10, False, 2, 1, False),  # the whole state fits any layout: no extra check
        (21, 10, True, 1, 1, False),  # per layout, the same generation as the last clean check
        (21, 10, True, 2, 1, True),  # a new layout: its first commit is checked
        (21, 10, True, (2, 1), (2, 0), True),  # a migration switched under the same plan
        (21, 10, True, None, 1, False),  # layers still migrating: nothing would be kept
        (21, 10, True, 2, None, True),  # a newcomer, with no clean check of its own yet
        (21, 0, True, 2, 1, False),  # verification off
    ],
)
def test_a_check_is_due_periodically_and_at_a_new_layouts_first_commit(
    step: int, every: int, per_layout: bool, generation: object, checked: object, due: bool
) -> None:
    assert check_due(step, every, per_layout, generation=generation, checked=checked) is due


def test_metrics_of_redone_steps_give_way(tmp_path: Path) -> None:
    w = JsonlWriter(tmp_path / "metrics.jsonl")
    for step in range(1, 11):
        w.write({"step": step, "loss": float(step)})
    w.keep_only(lambda r: r["step"] <= 5)
    for step in range(6, 8):
        w.write({"step": step, "loss": -float(step)})
    w.close()
    records = list(read_jsonl(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["loss"] for r in records][5:] == [-6.0, -7.0]


def test_checkpoints_after_the_known_good_step_are_discarded(tmp_path: Path) -> None:
    ckpt = durable.DurableCheckpoints(tmp_path, keep=3)
    t = torch.arange(6, dtype=torch.float32)
    for step in (4, 8, 12):
        ckpt.save_async(step, 1.0, t, exp_avg=t, exp_avg_sq=t)
    ckpt.flush()
    assert durable.latest(tmp_path) == tmp_path / "step-00000012"
    ckpt.discard_after(10)
    assert durable.latest(tmp_path) == tmp_path / "step-00000008"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000008"]
    ckpt.discard_after(2)
    assert durable.latest(tmp_path) is None
