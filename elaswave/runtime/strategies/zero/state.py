"""One ZeRO rank's shard state: the ranges of the flat buffers it owns (its *shard*), the
newest snapshot of it, the replica pieces it keeps of its peers' snapshots, and what a step has
staged before its commit.

Each rank owns shard ranges of the optimizer state (see :mod:`elaswave.planning.shards`): Adam's
two moments for its ranges of every layer, and, where the parameters are sharded too (ZeRO-3),
the parameters there. Where the parameters live is a piece of its own
(:mod:`~elaswave.runtime.strategies.zero.holding`); how a step's gradient reaches the shard and
updates it is another (:mod:`~elaswave.runtime.strategies.zero.update`). One step:

0. all-reduce the step's tail (:class:`~elaswave.runtime.strategies.sums.StepTail`: loss sum,
   count, newest epoch seen; float64): the update divides by the batch's exact count;
1. each rank receives the full-batch gradient of its shard;
2. *stage* the AdamW update of its shard (live state untouched);
3. on a snapshot step (every ``snapshot_every`` steps), send each peer the piece of the staged
   shard it keeps (with its checksum) and receive the pieces of the peers' shards this rank keeps:
   after this, every shard of step ``s`` exists twice, its replica spread over the peers;
4. commit barrier: a one-element all-reduce
   (:func:`~elaswave.runtime.strategies.zero.update.commit_barrier`). A rank that returns from
   it knows every rank staged (and replicated) step ``s``; it applies the staged state
   (:meth:`ShardState.commit`). A rank whose barrier failed keeps the staged state aside:
   recovery decides.

Recovery: the survivors agree on the resume step (the newest snapshot that any of them
committed: every rank that reached the barrier holds it staged), roll back to it, and adopt the
next layout (:meth:`ShardState.reshard`, its plan of moves from :mod:`elaswave.planning.shards`):
every survivor keeps its ranges and promotes the verified replica pieces of the lost shard it
holds, so a single failure moves nothing over the network. Joiners receive their share through
disjoint point-to-point transfers. With snapshots ``K > 1`` steps apart, a snapshot also keeps
the owned parameter chunk, so the parameters of the snapshot step can be rebuilt after the
rollback.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from elaswave.planning.shards import (
    Range,
    ReplicaPiece,
    ShardLayout,
    next_layout,
    overlaps,
    place_replicas,
    plan_transfers,
    position,
    promoted,
    recovery_stats,
)
from elaswave.planning.tiers import Tiers
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.optim import FlatParams, OptimHyper
from elaswave.runtime.prunehook import PruneHook
from elaswave.runtime.strategies.zero.replicas import repair_copies, send_replicas
from elaswave.runtime.strategies.zero.reshard import pack_transfers, unpack_into, usable_copies
from elaswave.runtime.strategies.zero.shard import Shard, Staged

if TYPE_CHECKING:
    from elaswave.runtime.strategies.zero.holding import ParamHolding

__all__ = ["ShardState"]

DP = "dp"


@dataclass
class ShardState:
    """One rank's ZeRO state: its shard, its snapshot, the replica pieces it keeps of its
    peers' snapshots, and what a step has staged. ``holding`` says where the parameters live
    (whole on every rank, or in the shard)."""

    flat: FlatParams
    hyper: OptimHyper
    segments: tuple[tuple[int, int], ...]
    holding: ParamHolding
    layout: ShardLayout | None = None
    workers: tuple[str, ...] = ()  # rank order of ``layout``
    rank: int = -1
    layout_epoch: int = -1  # plan epoch under which ``layout`` was adopted (-1: none yet)
    # each rank's fault domain in ``layout`` (its host, or its rack where the ranks span racks:
    # ``Plan.domains``); replicas avoid the owner's
    hosts: tuple[str, ...] = ()
    placement: tuple[ReplicaPiece, ...] = ()
    own: Shard | None = None  # live state (the newest committed step)
    snap: Shard | None = None  # the newest committed snapshot of ``own`` (``own`` itself if K=1)
    snap_loss: float = math.nan  # the loss of the snapshot step
    replicas: dict[int, Shard] = field(default_factory=dict)  # owner rank -> pieces kept
    staged: Staged | None = None
    index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    groups: torch.Tensor | None = None  # each shard element's weight-decay group (None: one)
    # Gloo's reduce_scatter is slower than its ring all-reduce on CPU (docs/benchmarks.md,
    # "Measurements behind design choices"), so on gloo the gradient is all-reduced and each
    # rank keeps its part; backends with a fast reduce-scatter (NCCL) set this: each rank then
    # receives only its part of the sums, and clipping takes the global norm from every rank's
    # per-layer squares of its part (``update.shard_sumsq``, one more all-reduce of a float per
    # layer).
    native_reduce_scatter: bool = False
    tiers: Tiers | None = None  # the all-reduce and all-gather by hosts (gloo: no native ones)
    compressed: bool = False  # train.grad_compress int8: the gradient crosses hosts as int8
    snapshot_every: int = 1  # replicate every K committed steps (0: never)
    # The group the shards are laid out over: every data-parallel rank, or (ZeRO-3 with
    # ``train.shard_scope: host``) the ranks of this rank's host, each host a whole copy.
    group: str = DP
    # Whether this rank's squares count in the clipping norm (host scope: the first host's
    # only, so that every host clips by the same number and the copies stay the same bits).
    norm_share: bool = True
    prune: PruneHook | None = None  # train.prune: pruning after the update
    _send_spans: dict[int, list[Range]] = field(default_factory=dict)
    clip_runs: list[tuple[int, int]] | None = None  # ``layer_runs`` of this layout (clipping)
    _recv_sizes: dict[int, int] = field(default_factory=dict)

    # ---- layout -----------------------------------------------------------------------------
    def adopt_layout(
        self,
        layout: ShardLayout,
        workers: tuple[str, ...],
        rank: int,
        *,
        epoch: int,
        hosts: tuple[str, ...] = (),
    ) -> None:
        self.layout, self.workers, self.rank, self.layout_epoch = layout, workers, rank, epoch
        self.hosts = tuple(hosts) if len(hosts) == len(workers) else ()
        self.placement = place_replicas(layout, self.hosts)
        self.index = self.holding.index_of(self, layout)
        self.clip_runs = None  # taken on the first clip under this layout
        mine = layout.pieces(rank)
        # each element's weight-decay group: once per layout, not per update
        self.groups = self.hyper.groups_in(mine, self.size, self.flat.data.device)
        self._send_spans = defaultdict(list)
        self._recv_sizes = defaultdict(int)
        for p in self.placement:
            if p.owner == rank:
                self._send_spans[p.holder].append((position(mine, p.offset), p.length))
            if p.holder == rank:
                self._recv_sizes[p.owner] += p.length
        for spans in self._send_spans.values():
            spans.sort()

    @property
    def size(self) -> int:
        assert self.layout is not None
        return self.layout.padded_size

    @property
    def keeps_params(self) -> bool:
        """Whether a shard carries its parameter chunk (:meth:`ParamHolding.keeps_params`)."""
        return self.holding.keeps_params(self)

    def is_snapshot(self, step: int) -> bool:
        return self.snapshot_every > 0 and step % self.snapshot_every == 0

    def mine(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's shard (padded, on the state's device) of a tensor laid out like the
        whole flat buffer (a checkpoint's is read on the CPU)."""
        return self.holding.mine(self, whole)

    def gather(
        self, comm: Communicator, part: torch.Tensor, abort: Callable[[], bool]
    ) -> torch.Tensor:
        """A shard-laid-out tensor of every rank, whole in flat order."""
        return self.holding.gather(self, comm, part, abort)

    # ---- one step ---------------------------------------------------------------------------
    def commit(self, loss: float = math.nan) -> None:
        """Step 4, after the barrier returned: the staged state becomes the live state (and, on
        a snapshot step, the snapshot)."""
        staged = self.staged
        assert staged is not None
        self.holding.apply(self, staged)
        self.own, self.staged = staged.own, None
        if staged.replicas is not None:
            self.snap, self.replicas, self.snap_loss = staged.own, staged.replicas, loss

    def replicate(
        self, comm: Communicator, shard: Shard, abort: Callable[[], bool]
    ) -> dict[int, Shard]:
        """Send every holder its pieces of ``shard``; receive the pieces this rank keeps."""
        if len(self.workers) == 1 or not self.snapshot_every:
            return {}
        return send_replicas(
            comm, shard, abort, group=self.group, send_spans=self._send_spans,
            recv_sizes=self._recv_sizes, like=self.flat.data,
        )  # fmt: skip

    def restore_full(
        self,
        comm: Communicator,
        workers: tuple[str, ...],
        rank: int,
        *,
        step: int,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        epoch: int,
        abort: Callable[[], bool],
        hosts: tuple[str, ...] = (),
        loss: float = math.nan,
        params: torch.Tensor | None = None,
    ) -> None:
        """Take this rank's shard of whole moments (from a durable checkpoint) in a fresh even
        layout; its parameter chunk, where the shard carries one, from ``params`` (default: the
        replicated parameters, already in place)."""
        self.adopt_layout(
            ShardLayout.even(self.segments, len(workers)), workers, rank, epoch=epoch, hosts=hosts
        )
        whole = self.flat.data if params is None else params
        own = Shard.of(
            step, self.mine(exp_avg).clone(), self.mine(exp_avg_sq).clone(),
            params=self.mine(whole).clone() if self.keeps_params else None,
        )  # fmt: skip
        self.start_from(comm, own, loss, abort=abort)

    def start_from(
        self, comm: Communicator, own: Shard, loss: float, *, abort: Callable[[], bool]
    ) -> None:
        self.own, self.staged = own, None
        self.snap = own if self.snapshot_every else None
        self.snap_loss = loss
        self.replicas = self.replicate(comm, own, abort)

    def full_state(
        self, comm: Communicator, abort: Callable[[], bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both Adam moments for the whole model, in flat order (all-gathered from the shards)."""
        assert self.own is not None and self.layout is not None
        out = []
        for part in (self.own.exp_avg, self.own.exp_avg_sq):
            out.append(self.gather(comm, part, abort))
        return out[0], out[1]

    # ---- verification -----------------------------------------------------------------------
    def verify_own(self) -> bool:
        return self.snap is None or self.snap.verify()

    def verify_replicas(self) -> bool:
        return all(r.verify() for r in self.replicas.values())

    def corrupt_target(self) -> tuple[torch.Tensor, str]:
        """The copy a ``corrupt,target=snapshot`` fault hits: the replica pieces kept of the
        previous rank's shard (else any kept replica, else the owned shard)."""
        assert self.own is not None
        if self.replicas:
            world = len(self.workers)
            owner = min(self.replicas, key=lambda o: (self.rank - o) % world)
            return self.replicas[owner].exp_avg, f"zero replica of rank {owner} (exp_avg)"
        return (self.snap or self.own).exp_avg, "zero shard (exp_avg)"

    def repair(
        self,
        comm: Communicator,
        bad_own: list[int],
        bad_replica: list[int],
        *,
        abort: Callable[[], bool],
    ) -> None:
        """Replace corrupt copies from the good ones: an owner's snapshot from the replica
        pieces its peers keep, a rank's replica pieces from their owners. Every rank computes
        the same exchange from the same lists."""
        repair_copies(
            comm, bad_own, bad_replica, abort=abort, rank=self.rank, placement=self.placement,
            snap=self.snap, replicas=self.replicas, send_spans=self._send_spans,
            recv_sizes=self._recv_sizes, group=self.group, like=self.flat.data,
        )  # fmt: skip

    # ---- recovery ---------------------------------------------------------------------------
    def copy(self) -> Shard | None:
        """What recovery rebuilds from: the snapshot (the live shard if there are none)."""
        return self.snap if self.snapshot_every else self.own

    def info(self) -> list[float]:
        """What this rank tells its peers before a reshard."""
        copy = self.copy()
        committed = copy.step if copy else -1
        staged = self.staged
        ok = staged is not None and staged.reached_barrier and self.is_snapshot(staged.step)
        return [float(committed), float(staged.step if ok and staged else -1)]

    def settle(self, resume_step: int) -> None:
        """Make the snapshot the resume step's: apply a staged step everyone may have
        committed, or drop one nobody did."""
        if self.staged is not None and self.staged.step == resume_step:
            self.commit(self.snap_loss)
        self.staged = None

    def reshard(
        self,
        comm: Communicator,
        old_workers: tuple[str, ...],
        old_layout: ShardLayout | None,
        *,
        new_workers: tuple[str, ...],
        new_rank: int,
        resume_step: int,
        epoch: int,
        abort: Callable[[], bool],
        old_hosts: tuple[str, ...] = (),
        new_hosts: tuple[str, ...] = (),
    ) -> dict[str, float]:
        """Move shards from ``old_workers``' layout (owners or replica pieces) to the next one.

        ``old_workers`` empty means a fresh start: every shard begins at zero. With snapshots
        ``K > 1`` steps apart, the parameters are rebuilt from the snapshot's chunks too."""
        start = time.perf_counter()
        me = new_workers[new_rank]
        nt = 3 if self.keeps_params else 2
        if not old_workers or old_layout is None:
            self.start_fresh(
                comm,
                new_workers,
                new_rank,
                resume_step=resume_step,
                epoch=epoch,
                abort=abort,
                hosts=new_hosts,
            )
            return {
                "bytes": 0,
                "promoted_bytes": 0,
                "pairs": 0,
                "max_over_mean": 1.0,
                "transfers": 0,
            }
        hosts = old_hosts if len(old_hosts) == len(old_workers) else ()
        found, sources = usable_copies(
            comm, old_workers, old_layout, placement=place_replicas(old_layout, hosts),
            new_workers=new_workers, me=me, resume_step=resume_step, abort=abort,
            replicas=self.replicas, copy=self.copy(), group=self.group,
            device=self.flat.data.device,
        )  # fmt: skip
        new_layout = next_layout(old_layout, old_workers, found, new_workers=new_workers)
        moves = plan_transfers(found, new_layout, new_workers)
        new_pieces = new_layout.pieces(new_rank)
        out = [self.flat.data.new_zeros(new_layout.padded_size) for _ in range(nt)]
        for h in found:  # what I already hold and keep (own ranges, promoted pieces): locally
            if h.worker != me:
                continue
            shard, pieces = sources[(h.owner, h.replica)]
            for dst_lo, dst_n, dst_pos in overlaps(new_pieces, h.offset, h.length):
                src_pos = position(pieces, dst_lo)
                for t, src in zip(out, shard.tensors(), strict=True):
                    t[dst_pos : dst_pos + dst_n] = src[src_pos : src_pos + dst_n]
        sends, recvs, unpack = pack_transfers(moves, me, found, sources=sources, nt=nt)
        recv_buffers = {peer: self.flat.data.new_empty(total) for peer, total in recvs.items()}
        comm.exchange(
            self.group,
            sends=[(new_workers.index(dst), buf) for dst, buf in sends.items()],
            recvs=[(new_workers.index(src), recv_buffers[src]) for src in recvs],
            abort=abort,
            tag=2000,
        )
        unpack_into(out, recv_buffers, unpack, pieces=new_pieces)
        self.adopt_layout(new_layout, new_workers, new_rank, epoch=epoch, hosts=new_hosts)
        own = Shard.of(resume_step, out[0], out[1], params=out[2] if nt == 3 else None)
        self.holding.rebuilt(self, comm, own, abort)
        self.start_from(comm, own, self.snap_loss, abort=abort)
        stats = recovery_stats(
            moves, promoted(found, new_layout, new_workers), element_bytes=4 * nt
        )
        return {**stats, "transfers": len(moves), "transfer_s": time.perf_counter() - start}

    def start_fresh(
        self,
        comm: Communicator,
        workers: tuple[str, ...],
        rank: int,
        *,
        resume_step: int,
        epoch: int,
        abort: Callable[[], bool],
        hosts: tuple[str, ...],
    ) -> None:
        """A fresh start: an even layout, every shard's moments zero (and, with K > 1, the
        parameter chunk of the current parameters)."""
        self.adopt_layout(
            ShardLayout.even(self.segments, len(workers)), workers, rank, epoch=epoch, hosts=hosts
        )
        zeros = self.flat.data.new_zeros(self.size)
        params = self.holding.fresh_params(self)
        self.start_from(
            comm,
            Shard.of(resume_step, zeros.clone(), zeros.clone(), params=params),
            math.nan,
            abort=abort,
        )
