"""Which micro-batches a recovery computes again (``redo_shares``): a table."""

from __future__ import annotations

import pytest

from elaswave.planning.redo import redo_shares


@pytest.mark.parametrize(
    ("total", "kept", "weights", "expected"),
    [
        # 4 ranks, 16 micro-batches, rank 1 died: its 4 go to the three keepers by weight
        (16, [range(0, 4), None, range(8, 12), range(12, 16)], [6, 0, 5, 5],
         ((4, 5), (), (6,), (7,))),
        # the same by equal weights: the remainder goes to the lower rank
        (16, [range(0, 4), range(8, 12), range(12, 16)], [1, 1, 1], ((4, 5), (6,), (7,))),
        # a host with two ranks lost: 8 micro-batches over two keepers
        (16, [range(0, 4), range(4, 8)], [1, 1], ((8, 9, 10, 11), (12, 13, 14, 15))),
        # a newcomer (keeps nothing) computes nothing; a faster keeper takes more
        (8, [range(0, 2), (), range(6, 8)], [1, 5, 3], ((2,), (), (3, 4, 5))),
        # nothing lost (a rank whose reduction succeeded kept nothing usable): nothing to do
        (4, [range(0, 2), range(2, 4)], [1, 1], ((), ())),
        # a second fault during a redo: kept sets are not contiguous any more
        (8, [(0, 1, 6), None, (4, 5, 7)], [1, 1, 1], ((2,), (), (3,))),
        # weights that sum to nothing: equal shares among the keepers
        (6, [range(0, 2), None, range(4, 6)], [0, 3, 0], ((2,), (), (3,))),
    ],
)  # fmt: skip
def test_lost_micro_batches_go_to_the_keepers(
    total: int, kept: list, weights: list, expected: tuple
) -> None:
    shares = redo_shares(total, kept, weights)
    assert shares == expected
    done = [i for k in kept if k for i in k] + [i for s in shares for i in s]
    assert sorted(done) == list(range(total)), "every micro-batch exactly once"


@pytest.mark.parametrize(
    ("kept", "why"),
    [
        ([None, None], "nobody keeps anything: the whole step, as planned"),
        ([(), None], "empty sets keep nothing"),
        ([(0, 1), (1, 2)], "overlapping sums cannot be combined"),
        ([(0, 9), None], "an index outside the step"),
    ],
)
def test_the_whole_step_when_kept_sums_cannot_be_used(kept: list, why: str) -> None:
    assert redo_shares(4, kept, [1] * len(kept)) is None, why


def test_one_kept_set_per_rank() -> None:
    with pytest.raises(ValueError, match="2 kept sets for 3 ranks"):
        redo_shares(4, [None, None], [1, 1, 1])
