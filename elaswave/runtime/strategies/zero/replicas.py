"""The spread replicas of ZeRO-1's snapshots as messages: each holder sent its pieces of a rank's
snapshot (with their checksum), and corrupt copies repaired from the good ones. Kept apart from
:class:`~.state.ShardState`, which decides when to replicate and what
is corrupt; these functions move the pieces its layout places."""

from __future__ import annotations

from collections.abc import Callable

import torch

from elaswave.planning.shards import Range, ReplicaPiece
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.integrity.checksums import fast_checksum
from elaswave.runtime.strategies.zero.shard import Shard, ShardLost


def send_replicas(
    comm: Communicator,
    shard: Shard,
    abort: Callable[[], bool],
    *,
    group: str,
    send_spans: dict[int, list[Range]],
    recv_sizes: dict[int, int],
    like: torch.Tensor,
) -> dict[int, Shard]:
    """Send every holder its pieces of ``shard`` (``send_spans``: the positions of each holder's
    pieces in it); receive the pieces this rank keeps (``recv_sizes``: their length per owner).
    New buffers take ``like``'s device."""
    sends = []
    for holder, spans in sorted(send_spans.items()):
        parts = shard.cut(spans)
        # One message: the tensors as 32-bit words, then step and checksum as int64 halves.
        meta = torch.tensor(
            [shard.step, fast_checksum(*parts)], dtype=torch.int64, device=like.device
        )
        sends.append(
            (holder, torch.cat([p.view(torch.int32) for p in parts] + [meta.view(torch.int32)]))
        )
    nt = len(shard.tensors())
    recvs = [
        (o, like.new_empty(nt * n + 4, dtype=torch.int32)) for o, n in sorted(recv_sizes.items())
    ]
    comm.exchange(group, sends=sends, recvs=recvs, abort=abort, tag=1000)
    out = {}
    for owner, got in recvs:
        n = recv_sizes[owner]
        step, checksum = got[nt * n :].clone().view(torch.int64).tolist()
        parts = [got[k * n : (k + 1) * n].clone().view(torch.float32) for k in range(nt)]
        out[owner] = Shard(int(step), parts[0], parts[1], int(checksum), *parts[2:])
    return out


def repair_copies(
    comm: Communicator,
    bad_own: list[int],
    bad_replica: list[int],
    *,
    abort: Callable[[], bool],
    rank: int,
    placement: tuple[ReplicaPiece, ...],
    snap: Shard | None,
    replicas: dict[int, Shard],
    send_spans: dict[int, list[Range]],
    recv_sizes: dict[int, int],
    group: str,
    like: torch.Tensor,
) -> None:
    """Replace corrupt copies from the good ones (see ``ShardState.repair``): ``snap`` repaired
    in place, ``replicas`` given the repaired pieces. ``placement``, ``send_spans`` and
    ``recv_sizes`` are the layout's replica pieces as :func:`send_replicas` takes them; new
    buffers take ``like``'s device."""
    sends: list[tuple[int, torch.Tensor]] = []
    own_in: list[tuple[int, torch.Tensor]] = []
    replica_in: list[tuple[int, torch.Tensor]] = []
    me, nt = rank, len(snap.tensors()) if snap else 2
    for o in bad_own:  # every holder of a piece of o's shard sends it back
        holders = sorted({p.holder for p in placement if p.owner == o})
        if me in holders:
            sends.append((o, torch.cat(replicas[o].tensors())))
        if o == me:
            own_in += [(h, like.new_empty(nt * _spans_len(send_spans[h]))) for h in holders]
    for b in bad_replica:  # every owner with pieces on b re-sends them
        owners = sorted({p.owner for p in placement if p.holder == b})
        if me in owners:
            assert snap is not None
            sends.append((b, torch.cat(snap.cut(send_spans[b]))))
        if b == me:
            replica_in += [(o, like.new_empty(nt * recv_sizes[o])) for o in owners]
    comm.exchange(group, sends, own_in + replica_in, abort=abort, tag=3000)
    for holder, buf in own_in:
        assert snap is not None
        _repair_own(snap, send_spans[holder], buf)
    if own_in:
        assert snap is not None
        if not snap.verify():
            raise ShardLost("both copies of a shard fail their checksum (own repair)")
    for owner, buf in replica_in:
        old, n = replicas[owner], recv_sizes[owner]
        parts = [buf[k * n : (k + 1) * n].clone() for k in range(nt)]
        fixed = Shard(old.step, parts[0], parts[1], old.checksum, *parts[2:])
        if not fixed.verify():
            raise ShardLost("both copies of a shard fail their checksum (replica repair)")
        replicas[owner] = fixed


def _spans_len(spans: list[Range]) -> int:
    return sum(n for _, n in spans)


def _repair_own(snap: Shard, spans: list[Range], buf: torch.Tensor) -> None:
    n = _spans_len(spans)
    for k, t in enumerate(snap.tensors()):
        part, cursor = buf[k * n : (k + 1) * n], 0
        for p, length in spans:
            t[p : p + length] = part[cursor : cursor + length]
            cursor += length
