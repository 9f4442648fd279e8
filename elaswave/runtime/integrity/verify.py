"""Online verification: replicas of the same data must agree, bit for bit.

Every ``verify_every`` committed steps each rank checksums what is replicated (the parameters,
and without ZeRO the optimizer moments too), the checksums are all-gathered, and a rank that
disagrees with the majority has silent data corruption: it is reported and repaired from a rank
that agrees. With ZeRO, each shard and the replica pieces of it also carry the checksum taken when
they were made; a copy that no longer matches its own checksum is replaced from the other copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """Which ranks hold a corrupt copy, and which good rank repairs them (``None``: all agree)."""

    bad: tuple[int, ...]
    source: int | None
    unanimous_loss: bool = False  # no strict majority: the repair source is a guess


def judge(checksums: Sequence[int]) -> Verdict:
    """Majority vote over per-rank checksums of data that should be identical. Pure."""
    counts = Counter(checksums)
    if len(counts) <= 1:
        return Verdict((), None)
    winner, votes = max(counts.items(), key=lambda kv: (kv[1], -checksums.index(kv[0])))
    tie = list(counts.values()).count(votes) > 1
    bad = tuple(r for r, c in enumerate(checksums) if c != winner)
    return Verdict(bad, checksums.index(winner), unanimous_loss=tie)


def judge_copies(checksums: Sequence[int | None], self_bad: Sequence[bool]) -> Verdict:
    """One piece of state kept by several ranks (``checksums[r]``: rank r's, ``None`` if it does
    not keep it). A copy that no longer matches the checksum its rank recorded when it last wrote
    it is bad for sure (``self_bad``); the remaining copies vote (:func:`judge`), which also
    breaks the tie of two copies when one of them knows it was hit. ``source`` is ``None`` when
    nothing is bad, or when no trustworthy copy is left to repair from. Pure."""
    held = {r: c for r, c in enumerate(checksums) if c is not None}
    holders = list(held)
    trusted = [r for r in holders if not self_bad[r]]
    vote = judge([held[r] for r in trusted]) if trusted else Verdict((), None)
    bad = sorted({r for r in holders if self_bad[r]} | {trusted[i] for i in vote.bad})
    if not bad or not trusted:
        return Verdict(tuple(bad), None)
    source = trusted[vote.source] if vote.source is not None else trusted[0]
    return Verdict(tuple(bad), source, unanimous_loss=vote.unanimous_loss)


def flip_bit(tensor: torch.Tensor, index: int, bit: int = 22) -> None:
    """Silent data corruption, for ``inject-fault --kind corrupt``: flip one bit of one float32."""
    flat = tensor.view(-1)
    as_int = flat[index : index + 1].view(torch.int32)
    as_int ^= 1 << bit
