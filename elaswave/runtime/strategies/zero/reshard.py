"""Where a ZeRO-1 reshard's data comes from and how it travels: the surviving copies of the old
shards, verified and agreed on by every rank, the transfers packed into one message per peer,
and the received messages unpacked into the new shard. Pure data movement over a
:class:`~.state.ShardState`'s copies, kept apart from the state's step
and commit (host-scoped ZeRO-3 unpacks its own rebuild transfers with :func:`unpack_into`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence

import torch

from elaswave.planning.shards import (
    Holding,
    Range,
    ReplicaPiece,
    ShardLayout,
    Transfer,
    held_by,
    holdings,
    position,
)
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.strategies.zero.shard import Shard, ShardLost

# For each old shard a rank holds (part of), keyed by (owner, replica): the verified data and the
# flat ranges its buffer positions stand for.
Sources = dict[tuple[int, bool], tuple[Shard, list[Range]]]


def usable_copies(
    comm: Communicator,
    old_workers: tuple[str, ...],
    old_layout: ShardLayout,
    *,
    placement: tuple[ReplicaPiece, ...],
    new_workers: tuple[str, ...],
    me: str,
    resume_step: int,
    abort: Callable[[], bool],
    replicas: Mapping[int, Shard],
    copy: Shard | None,
    group: str,
    device: torch.device,
) -> tuple[list[Holding], Sources]:
    """Which surviving copies hold every old shard, and this rank's verified ones (its
    ``replicas`` and ``copy``, the shard recovery rebuilds from). Every rank decides together
    (an all-gather on ``group``): all stop, with the same verdict, if any copy is unusable."""
    problem, found, sources = "", [], {}
    try:
        found = holdings(old_layout, old_workers, placement, alive=set(new_workers))
        sources = _sources(
            found, me, old_workers, old_layout=old_layout, placement=placement,
            resume_step=resume_step, replicas=replicas, copy=copy,
        )  # fmt: skip
    except KeyError as exc:
        problem = str(exc.args[0])
    except ShardLost as exc:
        problem = str(exc)
    flags = torch.zeros(len(new_workers), dtype=torch.int64, device=device)
    mine = torch.tensor([0 if problem else 1], dtype=torch.int64, device=device)
    comm.allgather_into(group, flags, mine, abort=abort)
    if not bool(flags.all()):
        first = int((flags == 0).nonzero()[0])
        raise ShardLost(
            problem
            or f"a shard copy held by {new_workers[first]} is missing, stale or fails its checksum"
        )
    return found, sources


def _sources(
    found: list[Holding],
    me: str,
    old_workers: tuple[str, ...],
    *,
    old_layout: ShardLayout,
    placement: tuple[ReplicaPiece, ...],
    resume_step: int,
    replicas: Mapping[int, Shard],
    copy: Shard | None,
) -> Sources:
    """For each old shard this rank holds (part of), the verified data and the flat ranges
    its buffer positions stand for."""
    out: Sources = {}
    for h in found:
        if h.worker != me or (h.owner, h.replica) in out:
            continue
        if h.replica:
            shard = replicas.get(h.owner)
            pieces = held_by(placement, old_workers.index(me), h.owner)
        else:
            shard, pieces = copy, old_layout.pieces(h.owner)
        if shard is None or shard.step != resume_step or not shard.verify():
            raise ShardLost(
                f"the copy of old rank {h.owner}'s shard held by {me} is missing, stale or "
                "fails its checksum"
            )
        out[(h.owner, h.replica)] = (shard, pieces)
    return out


def pack_transfers(
    moves: list[Transfer],
    me: str,
    found: list[Holding],
    *,
    sources: Sources,
    nt: int,
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, list[tuple[int, int]]]]:
    """This rank's part of a reshard's ``moves``: one message per receiving peer (each range as
    the ``nt`` tensors of its source shard in turn), the size of what each sending peer sends,
    and the ranges it sends, in order (for :func:`unpack_into`)."""
    outgoing: dict[str, list[torch.Tensor]] = defaultdict(list)
    recv_sizes: dict[str, int] = defaultdict(int)
    unpack: dict[str, list[tuple[int, int]]] = defaultdict(list)
    mine = [h for h in found if h.worker == me]
    for mv in moves:
        if mv.src == me:
            h = next(h for h in mine if h.offset <= mv.offset < h.offset + h.length)
            shard, pieces = sources[(h.owner, h.replica)]
            pos = position(pieces, mv.offset)
            outgoing[mv.dst] += [t[pos : pos + mv.length] for t in shard.tensors()]
        if mv.dst == me:
            recv_sizes[mv.src] += nt * mv.length
            unpack[mv.src].append((mv.offset, mv.length))
    sends = {dst: torch.cat(parts) for dst, parts in outgoing.items()}
    return sends, dict(recv_sizes), dict(unpack)


def unpack_into(
    out: Sequence[torch.Tensor],
    received: Mapping[str, torch.Tensor],
    ranges: Mapping[str, Sequence[Range]],
    *,
    pieces: Sequence[Range],
) -> None:
    """A reshard's received transfers into the new shard ``out`` (laid out as ``pieces``): from
    each peer, its ``ranges`` one after another, each as every tensor of ``out`` in turn."""
    for src, spans in ranges.items():
        buf, cursor = received[src], 0
        for lo, n in spans:
            pos = position(pieces, lo)
            for t in out:
                t[pos : pos + n] = buf[cursor : cursor + n]
                cursor += n
