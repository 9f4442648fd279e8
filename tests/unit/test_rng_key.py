"""``train.rng``: what a micro-batch's random numbers are keyed by (the ablation's switch)."""

from __future__ import annotations

import pytest

from elaswave.runtime.strategies.wholemodel import rng_key


@pytest.mark.parametrize(
    ("mode", "microbatch", "rank", "first", "key"),
    [
        ("sample", 5, 1, 4, 5),  # the micro-batch, whichever rank computes it
        ("sample", 5, 2, 5, 5),
        ("rank", 5, 1, 4, 16 * 2 + 1),  # rank 1's second micro-batch
        ("rank", 5, 2, 5, 16 * 3 + 0),  # the same micro-batch, first on rank 2: another key
        ("rank", 9, 2, 9, 16 * 3 + 0),  # another micro-batch, first on rank 2: the same key
        ("rank", 0, 0, 0, 16),  # never a sample key's range
    ],
)
def test_what_a_micro_batch_keys_its_random_numbers_by(
    mode: str, microbatch: int, rank: int, first: int, key: int
) -> None:
    assert rng_key(mode, microbatch, rank=rank, first=first, count=16) == key
