"""Who miscomputed a gradient (``replay_every``): the pure decision over the replay's digests.

Every ``replay_every`` steps, rank ``o``'s first micro-batch is computed twice: by ``o`` itself
(the *owner*, the gradient it brings to the reduction) and again by its *peer* ``o + 1 mod W``.
Both digest the gradient as they computed it. The RNG is keyed by (seed, step, micro-batch,
layer) and the replicas hold the same parameters, so two healthy devices of one kind give the
same bytes. Where owner and peer disagree, a *third* rank ``o + 2 mod W`` computes it once more
and the majority names the odd rank. Fewer than 3 ranks cannot break a tie: :func:`replay_ranks`
says so and the replay is skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "UNDECIDED", "ReplayFinding", "judge_replay", "peer_of", "replay_due", "replay_ranks",
    "replay_verdict", "third_of",
]  # fmt: skip

UNDECIDED: Literal["undecided"] = "undecided"
MIN_RANKS = 3  # owner, peer, and a third to break a tie


def replay_ranks(world: int) -> str | None:
    """Why a plan of ``world`` ranks cannot replay (None: it can)."""
    if world < MIN_RANKS:
        return (
            f"{world} rank{'s' if world != 1 else ''}: a replay needs 2 ranks to compare and a "
            "third to break a tie"
        )
    return None


def replay_due(step: int, every: int, *, world: int, redo: bool) -> bool:
    """Whether ``step`` is replayed: every ``every`` steps, with 3 ranks or more, and not while
    a step is redone from micro-batches survivors kept (its shares are not the plan's)."""
    return every > 0 and step % every == 0 and world >= MIN_RANKS and not redo


def peer_of(owner: int, world: int) -> int:
    """The rank that recomputes ``owner``'s micro-batch."""
    return (owner + 1) % world


def third_of(owner: int, world: int) -> int:
    """The rank that recomputes ``owner``'s micro-batch when owner and peer disagree."""
    return (owner + 2) % world


def replay_verdict(
    *, owner: tuple[int, int], peer: tuple[int, int], third: tuple[int, int] | None = None
) -> int | None | Literal["undecided"]:
    """One micro-batch's verdict from ``(rank, digest)`` of its owner, its peer and (after a
    disagreement) a third rank: None when owner and peer agree, else the rank the other two
    outvote, else :data:`UNDECIDED` (no third, or three different digests)."""
    if owner[1] == peer[1]:
        return None
    if third is None:
        return UNDECIDED
    if third[1] == owner[1]:
        return peer[0]
    if third[1] == peer[1]:
        return owner[0]
    return UNDECIDED


@dataclass(frozen=True)
class ReplayFinding:
    """A replayed step's verdicts: owners whose digests disagreed, the ranks the majority named
    (sorted) and owners whose micro-batch stayed undecided."""

    mismatched: tuple[int, ...] = ()
    odd: tuple[int, ...] = ()
    undecided: tuple[int, ...] = ()

    @property
    def clean(self) -> bool:
        return not self.mismatched


def mismatched_owners(owners: Sequence[int], peers: Sequence[int]) -> tuple[int, ...]:
    """Owners whose digest differs from their peer's: ``owners[o]`` is rank o's digest of its
    own micro-batch, ``peers[p]`` rank p's digest of its recomputation of rank p - 1's."""
    world = len(owners)
    return tuple(o for o in range(world) if owners[o] != peers[peer_of(o, world)])


def judge_replay(
    owners: Sequence[int], peers: Sequence[int], thirds: Sequence[int | None] = ()
) -> ReplayFinding:
    """Every owner's verdict from the gathered digests (the same on every rank). ``thirds[t]``:
    rank t's digest of rank t - 2's micro-batch where that one was mismatched (else None)."""
    world = len(owners)
    mismatched = mismatched_owners(owners, peers)
    odd: set[int] = set()
    undecided = []
    for o in mismatched:
        p, t = peer_of(o, world), third_of(o, world)
        digest = thirds[t] if t < len(thirds) and t not in (o, p) else None
        verdict = replay_verdict(
            owner=(o, owners[o]), peer=(p, peers[p]),
            third=(t, digest) if digest is not None else None,
        )  # fmt: skip
        if verdict == UNDECIDED:
            undecided.append(o)
        elif isinstance(verdict, int):
            odd.add(verdict)
    return ReplayFinding(mismatched, tuple(sorted(odd)), tuple(undecided))
