"""The step's tail record (loss sum, epoch, flag, count) reduces exactly at the scale of the
largest jobs: 10^6 ranks, plan epoch 10^4, 2^40 tokens in a batch."""

from __future__ import annotations

import pytest
import torch

from elaswave.runtime.strategies.sums import StepSums, StepTail

WORLD = 10**6
EPOCH = 10**4
TOKENS = 2**40


def _tails(world: int, epoch: int, tokens: int, newer: int | None = None) -> torch.Tensor:
    """Every rank's tail as its values (one row per rank): each saw ``epoch`` (rank ``newer``
    one more), counted its share of ``tokens``, flagged itself ready."""
    share, extra = divmod(tokens, world)
    one = StepTail()
    rows = one.values.new_zeros(world, StepTail.SIZE)
    rows[:, StepTail.EPOCH] = epoch
    rows[:, StepTail.FLAG] = 1
    rows[:, StepTail.COUNT] = share
    rows[:extra, StepTail.COUNT] += 1
    rows[:, StepTail.LOSS] = 2.5
    if newer is not None:
        rows[newer, StepTail.EPOCH] += 1
    return rows


def _ring(rows: torch.Tensor) -> StepTail:
    """The sum as an all-reduce forms it, in the tail's own dtype: partial sums of blocks of
    ranks, added one block after another."""
    out = StepTail()
    for block in rows.split(4096):
        out.values += block.sum(0)
    return out


def test_a_million_ranks_sum_epoch_count_and_flag_exactly() -> None:
    tail = _ring(_tails(WORLD, EPOCH, TOKENS))
    assert tail.epoch == WORLD * EPOCH  # 10^10: what the engine compares with
    assert tail.count == TOKENS
    assert tail.flag == WORLD
    assert tail.loss == pytest.approx(2.5 * WORLD, rel=1e-12)


def test_one_rank_on_a_newer_plan_is_seen_in_the_sum() -> None:
    """The engine switches plans when the epoch sum is not world × epoch: one rank one epoch
    ahead moves the sum by exactly 1 at 10^6 ranks."""
    tail = _ring(_tails(WORLD, EPOCH, TOKENS, newer=WORLD // 2))
    assert tail.epoch == WORLD * EPOCH + 1
    # the same rows summed in float32 (the gradients' dtype) lose it: why the tail is its own
    rows32 = _tails(WORLD, EPOCH, TOKENS, newer=WORLD // 2).to(torch.float32)
    assert int(rows32[:, StepTail.EPOCH].sum()) != WORLD * EPOCH + 1


def test_the_tail_stays_float64_whatever_the_gradients_dtype() -> None:
    sums = StepSums(torch.zeros(8, dtype=torch.float32), StepTail())
    assert sums.tail.values.dtype == torch.float64
    sums.tail.add(torch.tensor(1.25, dtype=torch.float32), TOKENS - 1)
    sums.tail.add(torch.tensor(0.5, dtype=torch.float32), 1)
    assert (sums.tail.loss, sums.tail.count) == (1.75, TOKENS)


def test_setters_fields_and_a_fresh_tail() -> None:
    tail = StepTail()
    tail.loss, tail.epoch, tail.flag, tail.count = torch.tensor(3.0), 7, 1, 12
    assert (tail.loss, tail.epoch, tail.flag, tail.count) == (3.0, 7, 1, 12)
    fresh = tail.fresh()
    assert fresh.values is not tail.values and not fresh.values.any()
    tail.zero()
    assert not tail.values.any()
