"""Which micro-batches a recovery computes again: data parallelism's ranks (``redo_shares``)
and a pipeline plan's replicas (``stage_redo``), as tables."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from elaswave.planning.plan import assign_microbatches
from elaswave.planning.redo import redo_shares, stage_redo


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


def _by(weights: list[int]) -> Callable[[int], tuple[int, ...]]:
    """The split a plan would give: in proportion to ``weights``."""
    return lambda n: assign_microbatches(n, weights) if n else (0,) * len(weights)


def _stages(cut: list[int], ids: range | tuple) -> dict[int, tuple]:
    """One stage's kept sums: every layer of ``cut`` (start, stop) keeps ``ids``."""
    return {layer: tuple(ids) for layer in range(*cut)}


@pytest.mark.parametrize(
    ("kept", "weights", "shares", "why"),
    [
        # dp=2 x pp=2, 8 micro-batches, 4 layers: replica 0 lost a stage (its survivor took all
        # four layers and kept nothing); replica 1 finished its four. Replica 0's micro-batches
        # go to both replicas by their new weights.
        ([None, None, _stages([0, 2], range(4, 8)), _stages([2, 4], range(4, 8))], [1, 3],
         ((0,), (1, 2, 3)), "the damaged replica's micro-batches, by weight"),
        # replica 0's stage 1 (layers 2, 3) finished the backward of micro-batch 0 before its
        # stage 0 died: micro-batch 0 is still computed again (layers 0, 1 lack it)
        ([None, _stages([2, 4], (0,)), _stages([0, 2], range(4, 8)), _stages([2, 4], range(4, 8))],
         [1, 1], ((0, 1), (2, 3)), "a micro-batch is redone until every layer keeps it"),
        # dp=3 x pp=2: two intact replicas keep theirs; the middle replica's two are split
        ([_stages([0, 2], (0, 1, 2)), _stages([2, 4], (0, 1, 2)), None, None,
          _stages([0, 2], (5, 6, 7)), _stages([2, 4], (5, 6, 7))], [1, 1, 1],
         ((3,), (4,), ()), "a replica with no share left after the split computes nothing"),
        # a replica out of service (its layers migrating) computes none of it
        ([None, None, _stages([0, 2], range(4, 8)), _stages([2, 4], range(4, 8))], [0, 4],
         ((), (0, 1, 2, 3)), "out of service: weight 0"),
        # nothing lost: every layer keeps every micro-batch
        ([_stages([0, 4], range(0, 4)), _stages([0, 4], range(4, 8))], [1, 1], ((), ()),
         "nothing to compute again"),
    ],
)  # fmt: skip
def test_a_pipeline_redoes_what_some_layer_lacks(
    kept: list, weights: list, shares: tuple, why: str
) -> None:
    redo = stage_redo(8, 4, kept, split=_by(weights))
    assert redo is not None and redo.shares == shares, why
    for layer in range(4):
        have = sorted(i for mine in kept if mine for i in mine.get(layer, ()))
        again = [i for i in redo.redone if i not in redo.kept[layer]]
        assert sorted(have + again) == list(range(8)), f"layer {layer}: each micro-batch once"


@pytest.mark.parametrize(
    ("kept", "weights", "why"),
    [
        ([None, None], [1, 1], "nobody keeps anything: the whole step, as planned"),
        ([{0: ()}, None], [1, 1], "empty sets keep nothing"),
        ([{0: (0, 1)}, {0: (1, 2)}], [1, 1], "one layer's sums overlap"),
        ([{0: (0, 9)}, None], [1, 1], "an index outside the step"),
        ([{7: (0,)}, None], [1, 1], "a layer outside the model"),
    ],
)
def test_a_pipeline_step_is_computed_whole_when_kept_sums_cannot_be_used(
    kept: list, weights: list, why: str
) -> None:
    assert stage_redo(4, 4, kept, split=_by(weights)) is None, why


def test_a_split_that_does_not_hand_out_every_lost_micro_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"split\(4\) gave \[1, 1\]"):
        stage_redo(4, 2, [{0: (), 1: ()}, {0: (0,)}], split=lambda n: (1, 1))
