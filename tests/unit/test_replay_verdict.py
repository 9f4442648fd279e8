"""The replay's pure verdict: who miscomputed a micro-batch's gradient (``replay_every``)."""

from __future__ import annotations

import pytest

from elaswave.planning.replay import (
    UNDECIDED,
    ReplayFinding,
    judge_replay,
    replay_due,
    replay_ranks,
    replay_verdict,
)


@pytest.mark.parametrize(
    ("owner", "peer", "third", "expected"),
    [
        ((0, 7), (1, 7), None, None),  # agree: nothing to decide
        ((0, 7), (1, 7), (2, 9), None),  # agree: a third digest changes nothing
        ((0, 7), (1, 8), (2, 7), 1),  # the third sides with the owner: the peer is odd
        ((0, 7), (1, 8), (2, 8), 0),  # the third sides with the peer: the owner is odd
        ((0, 7), (1, 8), (2, 9), UNDECIDED),  # three different digests
        ((0, 7), (1, 8), None, UNDECIDED),  # no third rank to break the tie
    ],
)
def test_replay_verdict(owner, peer, third, expected) -> None:
    assert replay_verdict(owner=owner, peer=peer, third=third) == expected


@pytest.mark.parametrize(
    ("owners", "peers", "thirds", "expected"),
    [
        # all agree: peers[p] is p's recomputation of p - 1's micro-batch
        ([1, 2, 3, 4], [4, 1, 2, 3], [], ReplayFinding()),
        # rank 2 miscomputes both of its gradients: its own and its replay of rank 1's
        ([1, 2, 30, 4], [4, 1, 20, 3], [3, None, None, 2], ReplayFinding((1, 2), (2,), ())),
        # only rank 2's own gradient is wrong (its peer 3 and the third, rank 0, agree)
        ([1, 2, 30, 4], [4, 1, 2, 3], [3, None, None, None], ReplayFinding((2,), (2,), ())),
        # rank 3's replay of rank 2's micro-batch is wrong: the third (rank 0) names rank 3
        ([1, 2, 3, 4], [4, 1, 2, 33], [3, None, None, None], ReplayFinding((2,), (3,), ())),
        # three different digests: undecided
        ([1, 2, 30, 4], [4, 1, 2, 31], [32, None, None, None], ReplayFinding((2,), (), (2,))),
        # three ranks: rank 1's miscomputation is outvoted in both of its pairs
        ([1, 20, 3], [3, 21, 2], [2, None, 1], ReplayFinding((0, 1), (1,), ())),
    ],
)
def test_judge_replay(owners, peers, thirds, expected) -> None:
    assert judge_replay(owners, peers, thirds) == expected


def test_two_ranks_cannot_break_a_tie() -> None:
    assert judge_replay([1, 2], [2, 10]) == ReplayFinding((0,), (), (0,))
    assert (
        replay_ranks(2) == "2 ranks: a replay needs 2 ranks to compare and a third to break a tie"
    )
    assert replay_ranks(1) is not None and replay_ranks(3) is None


@pytest.mark.parametrize(
    ("step", "every", "world", "redo", "due"),
    [(4, 2, 4, False, True), (5, 2, 4, False, False), (4, 0, 4, False, False),
     (4, 2, 2, False, False), (4, 2, 4, True, False), (1, 1, 3, False, True)],
)  # fmt: skip
def test_replay_due(step: int, every: int, world: int, redo: bool, due: bool) -> None:
    assert replay_due(step, every, world=world, redo=redo) is due
