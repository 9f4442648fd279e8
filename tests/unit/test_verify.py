"""Majority vote over replica checksums, and the bit flip used to fake silent corruption."""

from __future__ import annotations

import zlib

import pytest
import torch

from elaswave.runtime.integrity.checksums import digest, fast_checksum
from elaswave.runtime.integrity.verify import flip_bit, judge, judge_copies
from elaswave.runtime.strategies.zero.shard import Shard


@pytest.mark.parametrize(
    ("sums", "bad", "source", "tie"),
    [
        ([7, 7, 7, 7], (), None, False),
        ([7, 7, 9, 7], (2,), 0, False),
        ([9, 7, 7, 7], (0,), 1, False),
        ([7, 9, 9, 7], (1, 2), 0, True),  # no majority: the lowest rank's copy wins, flagged
        ([1, 2, 3], (1, 2), 0, True),
        ([5], (), None, False),
    ],
)
def test_judge(sums: list[int], bad: tuple[int, ...], source: int | None, tie: bool) -> None:
    verdict = judge(sums)
    assert verdict.bad == bad and verdict.source == source and verdict.unanimous_loss == tie


def test_flip_bit_changes_one_value_and_the_checksum() -> None:
    t = torch.linspace(-1, 1, 100)
    before = t.clone()
    flip_bit(t, 42)
    assert (t != before).sum() == 1 and t[42] != before[42]
    assert digest(t) != digest(before)


def test_shard_checksum_catches_a_flip() -> None:
    shard = Shard.of(3, torch.ones(10), torch.ones(10))
    assert shard.verify()
    flip_bit(shard.exp_avg_sq, 4)
    assert not shard.verify()


@pytest.mark.parametrize(
    ("sums", "self_bad", "bad", "source", "tie"),
    [
        ([7, 7, None], [False, False, False], (), None, False),  # all agree
        ([7, 9, None], [False, True, False], (1,), 0, False),  # two copies: the hit one knows
        ([9, 7], [True, False], (0,), 1, False),  # ... whichever rank it is
        ([7, 9], [False, False], (1,), 0, True),  # two copies, nobody knows: a guess (tie)
        ([7, 9, 7], [False, False, False], (1,), 0, False),  # three copies: the majority
        ([7, 9, 9], [True, False, False], (0,), 1, False),  # a flagged copy does not vote
        ([7, 9], [True, True], (0, 1), None, False),  # nothing trustworthy left
        ([None, 5, None], [False, False, False], (), None, False),  # a single copy
    ],
)
def test_judge_copies(
    sums: list[int | None], self_bad: list[bool], bad: tuple[int, ...], source: int | None,
    tie: bool,
) -> None:  # fmt: skip
    v = judge_copies(sums, self_bad)
    assert (v.bad, v.source, v.unanimous_loss) == (bad, source, tie)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64])
def test_checksums_read_any_dtype_and_shape_in_place(dtype: torch.dtype) -> None:
    whole = torch.arange(24).to(dtype).view(4, 6)
    column = whole[:, 1]  # not contiguous: checksummed as its values, in order
    assert fast_checksum(column) == fast_checksum(column.clone())
    assert digest(column) == digest(column.clone())
    assert fast_checksum(whole) == zlib.crc32(whole.view(torch.uint8).numpy().tobytes())
    assert fast_checksum(whole[0, 0]) == fast_checksum(whole.reshape(-1)[:1])  # 0-d
    flipped = whole.clone()
    flipped.view(torch.uint8).view(-1)[5] ^= 1
    assert fast_checksum(flipped) != fast_checksum(whole) and digest(flipped) != digest(whole)
