"""ZeRO-1 over the data-parallel group, with a two-phase step commit and buddy replicas.

Each rank owns an interleaved shard of the optimizer state (see :mod:`elaswave.runtime.shards`):
Adam's two moments for its chunk of every layer. Parameters stay replicated. One step:

1. reduce-scatter the gradients: each rank receives the full-batch gradient of its shard;
2. *stage* the AdamW update of its shard (live state untouched) and all-gather the staged
   parameter chunks into a staged full parameter buffer;
3. send the staged shard with its checksum to the buddy rank (the next one) and receive the
   previous rank's: after this, every shard of step ``s`` exists twice, on different ranks;
4. commit barrier: a tiny all-reduce (it also carries the loss and the newest epoch seen). A rank
   that returns from it knows every rank staged and replicated step ``s``; it applies the staged
   state. A rank whose barrier failed keeps the staged state aside: recovery decides.

Recovery: the survivors agree on the resume step (the newest that any of them committed: every
rank that reached the barrier holds it staged), rebuild each lost shard from its buddy's replica
after checking its checksum, and move every range to its owner in the new layout through
disjoint point-to-point transfers.
"""

from __future__ import annotations

import hashlib
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from elaswave.runtime.comm import Communicator
from elaswave.runtime.optim import AdamWHyper, FlatAdamW, FlatParams
from elaswave.runtime.shards import (
    ShardLayout,
    Transfer,
    buddy,
    buddy_shift,
    plan_transfers,
    transfer_stats,
)

DP = "dp"


class ShardLost(RuntimeError):
    """Both copies of a shard are gone (an owner and its buddy died together)."""


def digest(*tensors: torch.Tensor) -> int:
    """A 63-bit checksum of tensors' bytes (blake2b): for whole-model comparisons."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def fast_checksum(*tensors: torch.Tensor) -> int:
    """A vectorised checksum of float32 tensors, cheap enough for every shard of every step.

    Sums of the 32-bit words, plain and position-weighted, in int64: any single flipped bit
    changes the plain sum; a swap of two words changes the weighted one.
    """
    total = 0
    for t in tensors:
        words = t.detach().contiguous().view(torch.int32).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, dtype=torch.int64)
        plain = int(words.sum())
        weighted = int((words * weights).sum())
        total = (total * 1_000_003 + plain * 7 + weighted) % (1 << 62)
    return total


@dataclass
class Shard:
    """Adam moments of one rank's shard at one step, with the checksum taken when made."""

    step: int
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    checksum: int

    @classmethod
    def of(cls, step: int, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> Shard:
        return cls(step, exp_avg, exp_avg_sq, fast_checksum(exp_avg, exp_avg_sq))

    def verify(self) -> bool:
        return fast_checksum(self.exp_avg, self.exp_avg_sq) == self.checksum


@dataclass
class Staged:
    step: int
    params: torch.Tensor  # every rank's updated parameter chunks, rank-major (all-gathered)
    own: Shard
    replica: Shard | None
    reached_barrier: bool = False


@dataclass
class ZeroState:
    """One rank's ZeRO-1 state: its shard, its buddy's replica, and what a step has staged."""

    flat: FlatParams
    hyper: AdamWHyper
    segments: tuple[tuple[int, int], ...]
    layout: ShardLayout | None = None
    workers: tuple[str, ...] = ()  # rank order of ``layout``
    rank: int = -1
    layout_epoch: int = -1  # plan epoch under which ``layout`` was adopted (-1: none yet)
    shift: int = 1  # buddy of rank r is r + shift: chosen so it lives on another host
    own: Shard | None = None
    replica: Shard | None = None  # the shard of rank (rank - 1) % world, kept for recovery
    staged: Staged | None = None
    index: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    # Gloo's reduce_scatter is slower than its ring all-reduce on CPU (gpt-tiny, 4 workers:
    # 92 vs 79 ms per step), so on gloo the gradient is all-reduced and each rank keeps its part;
    # backends with a fast reduce-scatter (NCCL) set this.
    native_reduce_scatter: bool = False
    replicate: bool = True  # keep a buddy replica of every shard (``snapshot_every``)

    # ---- layout -----------------------------------------------------------------------------
    def adopt_layout(
        self, workers: tuple[str, ...], rank: int, epoch: int, hosts: tuple[str, ...] = ()
    ) -> None:
        self.layout = ShardLayout(self.segments, len(workers))
        self.workers, self.rank, self.layout_epoch = workers, rank, epoch
        self.shift = buddy_shift(hosts) if len(hosts) == len(workers) else 1
        self.index = self.layout.gather_index()

    @property
    def size(self) -> int:
        assert self.layout is not None
        return self.layout.padded_size

    def _my_index(self) -> torch.Tensor:
        return self.index.view(len(self.workers), self.size)[self.rank]

    def _ext(self, flat: torch.Tensor) -> torch.Tensor:
        return torch.cat([flat, flat.new_zeros(1)])

    # ---- one step ---------------------------------------------------------------------------
    def stage(
        self,
        comm: Communicator,
        grads: torch.Tensor,
        step: int,
        abort: Callable[[], bool],
        before_update: Callable[[], None],
    ) -> None:
        """Steps 1–3 of the docstring: reduce-scatter, staged update, all-gather, replicate."""
        assert self.layout is not None and self.own is not None
        world, size = len(self.workers), self.size
        rank_major = self._ext(grads)[self.index].view(world, size)
        if self.native_reduce_scatter:
            mine = torch.empty(size, dtype=grads.dtype)
            comm.reduce_scatter(DP, list(rank_major.unbind(0)), mine, abort)
        else:  # same sum, each rank keeps its part (see ``native_reduce_scatter``)
            comm.allreduce(DP, rank_major.reshape(-1), abort)
            mine = rank_major[self.rank]
        grad = mine.to(torch.float32) if mine.dtype != torch.float32 else mine
        before_update()
        param = self._ext(self.flat.data)[self._my_index()].clone()
        opt = FlatAdamW(0, self.hyper)  # update copies of the moments; the live ones stay put
        opt.exp_avg, opt.exp_avg_sq = self.own.exp_avg.clone(), self.own.exp_avg_sq.clone()
        opt.step_count = step - 1
        opt.step(param, grad)
        gathered = torch.empty(world * size, dtype=torch.float32)
        comm.allgather_into(DP, gathered, param, abort)
        own = Shard.of(step, opt.exp_avg, opt.exp_avg_sq)
        self.staged = Staged(step, gathered, own, None)
        self.staged.replica = self._replicate(comm, own, abort)

    def commit(self) -> None:
        """Step 4, after the barrier returned: the staged state becomes the live state."""
        staged = self.staged
        assert staged is not None
        live = self._ext(self.flat.data)
        live.index_copy_(0, self.index, staged.params)  # padding lands in the extra slot
        self.flat.data.copy_(live[:-1])
        self.own, self.replica, self.staged = staged.own, staged.replica, None

    def _replicate(
        self, comm: Communicator, shard: Shard, abort: Callable[[], bool]
    ) -> Shard | None:
        world = len(self.workers)
        if world == 1 or not self.replicate:
            return None
        size = self.size
        # One message: both moments as 32-bit words, then step and checksum as int64 halves.
        meta = torch.tensor([shard.step, shard.checksum], dtype=torch.int64).view(torch.int32)
        payload = torch.cat(
            [shard.exp_avg.view(torch.int32), shard.exp_avg_sq.view(torch.int32), meta]
        )
        got = torch.empty_like(payload)
        prev = (self.rank - self.shift) % world
        comm.exchange(
            DP,
            sends=[(buddy(self.rank, world, self.shift), payload)],
            recvs=[(prev, got)],
            abort=abort,
            tag=1000,
        )
        step, checksum = got[2 * size :].clone().view(torch.int64).tolist()
        m = got[:size].clone().view(torch.float32)
        v = got[size : 2 * size].clone().view(torch.float32)
        return Shard(int(step), m, v, int(checksum))

    def restore_full(
        self,
        comm: Communicator,
        workers: tuple[str, ...],
        rank: int,
        step: int,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        epoch: int,
        abort: Callable[[], bool],
        hosts: tuple[str, ...] = (),
    ) -> None:
        """Take this rank's shard of whole moments (from a durable checkpoint) in a new layout."""
        self.adopt_layout(workers, rank, epoch, hosts)
        mine = self._my_index()
        self.own = Shard.of(
            step, self._ext(exp_avg)[mine].clone(), self._ext(exp_avg_sq)[mine].clone()
        )
        self.staged = None
        self.replica = self._replicate(comm, self.own, abort)

    def full_state(
        self, comm: Communicator, abort: Callable[[], bool]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both Adam moments for the whole model, in flat order (all-gathered from the shards)."""
        assert self.own is not None and self.layout is not None
        out = []
        for part in (self.own.exp_avg, self.own.exp_avg_sq):
            gathered = torch.empty(len(self.workers) * self.size)
            comm.allgather_into(DP, gathered, part, abort)
            flat = torch.zeros(self.layout.numel + 1)
            flat.index_copy_(0, self.index, gathered)
            out.append(flat[:-1])
        return out[0], out[1]

    def repair(
        self,
        comm: Communicator,
        bad_own: list[int],
        bad_replica: list[int],
        abort: Callable[[], bool],
    ) -> None:
        """Replace corrupt copies from the good one: an owner's shard from its buddy's replica,
        a replica from its owner. Every rank computes the same exchange from the same lists."""
        world = len(self.workers)
        sends: list[tuple[int, torch.Tensor]] = []
        recvs: list[tuple[int, torch.Tensor]] = []
        incoming: list[tuple[str, torch.Tensor]] = []
        for o in bad_own:  # the buddy of o sends its replica of o's shard
            if buddy(o, world, self.shift) == self.rank:
                assert self.replica is not None
                sends.append((o, torch.cat([self.replica.exp_avg, self.replica.exp_avg_sq])))
            if o == self.rank:
                buf = torch.empty(2 * self.size)
                recvs.append((buddy(o, world, self.shift), buf))
                incoming.append(("own", buf))
        for b in bad_replica:  # the owner of b's replica re-sends its shard
            owner = (b - self.shift) % world
            if owner == self.rank:
                assert self.own is not None
                sends.append((b, torch.cat([self.own.exp_avg, self.own.exp_avg_sq])))
            if b == self.rank:
                buf = torch.empty(2 * self.size)
                recvs.append((owner, buf))
                incoming.append(("replica", buf))
        comm.exchange(DP, sends, recvs, abort, tag=3000)
        for which, buf in incoming:
            old = self.own if which == "own" else self.replica
            assert old is not None
            fixed = Shard(
                old.step, buf[: self.size].clone(), buf[self.size :].clone(), old.checksum
            )
            if not fixed.verify():
                raise ShardLost(f"both copies of a shard fail their checksum ({which} repair)")
            if which == "own":
                self.own = fixed
            else:
                self.replica = fixed

    # ---- recovery ---------------------------------------------------------------------------
    def info(self) -> list[float]:
        """What this rank tells its peers before a reshard."""
        committed = self.own.step if self.own else -1
        staged = self.staged.step if self.staged and self.staged.reached_barrier else -1
        return [float(committed), float(staged)]

    def settle(self, resume_step: int) -> None:
        """Make the live state the resume step's: apply a staged step everyone may have
        committed, or drop one nobody did."""
        if self.staged is not None and self.staged.step == resume_step:
            self.commit()
        self.staged = None

    def reshard(
        self,
        comm: Communicator,
        old_workers: tuple[str, ...],
        new_workers: tuple[str, ...],
        new_rank: int,
        resume_step: int,
        epoch: int,
        abort: Callable[[], bool],
        *,
        old_shift: int = 1,
        new_hosts: tuple[str, ...] = (),
    ) -> dict[str, float]:
        """Move shards from ``old_workers``' layout (owners or buddies) to ``new_workers``'.

        ``old_workers`` empty means a fresh start: every shard begins at zero."""
        start = time.perf_counter()
        me = new_workers[new_rank]
        new_layout = ShardLayout(self.segments, len(new_workers))
        if not old_workers:
            self.adopt_layout(new_workers, new_rank, epoch, new_hosts)
            zeros = torch.zeros(self.size)
            self.own = Shard.of(resume_step, zeros.clone(), zeros.clone())
            self.replica = self._replicate(comm, self.own, abort)
            return {"bytes": 0, "pairs": 0, "max_over_mean": 1.0, "transfers": 0}
        old_layout = ShardLayout(self.segments, len(old_workers))
        problem = ""
        try:
            holders, sources = self._holders(
                old_workers, set(new_workers), me, resume_step, old_shift
            )
        except ShardLost as exc:
            problem = str(exc)
        # Decide together: every rank stops, with the same verdict, if any copy is unusable.
        flags = torch.zeros(len(new_workers), dtype=torch.int64)
        comm.allgather_into(DP, flags, torch.tensor([0 if problem else 1]), abort)
        if not bool(flags.all()):
            first = int((flags == 0).nonzero()[0])
            raise ShardLost(
                problem
                or f"a shard copy held by {new_workers[first]} is missing, stale or fails its "
                "checksum"
            )
        moves = plan_transfers(old_layout, holders, new_layout, new_workers)
        new_pieces = new_layout.pieces(new_rank)
        new_size = new_layout.padded_size
        m, v = torch.zeros(new_size), torch.zeros(new_size)
        # What I already hold and keep: copy locally.
        for o, holder in holders.items():
            if holder != me:
                continue
            shard = sources[o]
            for lo, n in old_layout.pieces(o):
                for dst_lo, dst_n, dst_pos in _overlaps(new_pieces, lo, n):
                    src_pos = _position(old_layout.pieces(o), dst_lo)
                    m[dst_pos : dst_pos + dst_n] = shard.exp_avg[src_pos : src_pos + dst_n]
                    v[dst_pos : dst_pos + dst_n] = shard.exp_avg_sq[src_pos : src_pos + dst_n]
        sends, recvs, unpack = self._pack(moves, me, holders, sources, old_layout)
        recv_buffers = {peer: torch.empty(total) for peer, total in recvs.items()}
        comm.exchange(
            DP,
            sends=[(new_workers.index(dst), buf) for dst, buf in sends.items()],
            recvs=[(new_workers.index(src), recv_buffers[src]) for src in recvs],
            abort=abort,
            tag=2000,
        )
        for src, ranges in unpack.items():
            buf, cursor = recv_buffers[src], 0
            for lo, n in ranges:
                pos = _position(new_pieces, lo)
                m[pos : pos + n] = buf[cursor : cursor + n]
                v[pos : pos + n] = buf[cursor + n : cursor + 2 * n]
                cursor += 2 * n
        self.adopt_layout(new_workers, new_rank, epoch, new_hosts)
        self.own = Shard.of(resume_step, m, v)
        self.replica = self._replicate(comm, self.own, abort)
        stats = transfer_stats(moves, element_bytes=8)  # two float32 moments per element
        return {**stats, "transfers": len(moves), "transfer_s": time.perf_counter() - start}

    def _holders(
        self,
        old_workers: tuple[str, ...],
        alive: set[str],
        me: str,
        resume_step: int,
        old_shift: int,
    ) -> tuple[dict[int, str], dict[int, Shard]]:
        """Who holds each old rank's shard, and (for this rank) the verified data itself."""
        world = len(old_workers)
        holders: dict[int, str] = {}
        sources: dict[int, Shard] = {}
        for o, worker in enumerate(old_workers):
            if worker in alive:
                holders[o] = worker
            elif old_workers[buddy(o, world, old_shift)] in alive and world > 1:
                holders[o] = old_workers[buddy(o, world, old_shift)]
            else:
                raise ShardLost(f"the shard of old rank {o} ({worker}) and its replica are gone")
        for o, worker in holders.items():
            if worker != me:
                continue
            shard = self.own if old_workers[o] == me else self.replica
            if shard is None or shard.step != resume_step or not shard.verify():
                raise ShardLost(
                    f"the copy of old rank {o}'s shard held by {worker} is missing, stale or "
                    "fails its checksum"
                )
            sources[o] = shard
        return holders, sources

    def _pack(
        self,
        moves: list[Transfer],
        me: str,
        holders: dict[int, str],
        sources: dict[int, Shard],
        old_layout: ShardLayout,
    ) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, list[tuple[int, int]]]]:
        outgoing: dict[str, list[torch.Tensor]] = defaultdict(list)
        recv_sizes: dict[str, int] = defaultdict(int)
        unpack: dict[str, list[tuple[int, int]]] = defaultdict(list)
        for mv in moves:
            if mv.src == me:
                o = _owner(old_layout, mv.offset)
                assert holders[o] == me
                pos = _position(old_layout.pieces(o), mv.offset)
                shard = sources[o]
                outgoing[mv.dst].append(shard.exp_avg[pos : pos + mv.length])
                outgoing[mv.dst].append(shard.exp_avg_sq[pos : pos + mv.length])
            if mv.dst == me:
                recv_sizes[mv.src] += 2 * mv.length
                unpack[mv.src].append((mv.offset, mv.length))
        sends = {dst: torch.cat(parts) for dst, parts in outgoing.items()}
        return sends, dict(recv_sizes), dict(unpack)


def _position(pieces: list[tuple[int, int]], flat_offset: int) -> int:
    """Index in a shard buffer of ``flat_offset`` (which lies inside one of ``pieces``)."""
    cursor = 0
    for lo, n in pieces:
        if lo <= flat_offset < lo + n:
            return cursor + flat_offset - lo
        cursor += n
    raise ValueError(f"offset {flat_offset} is not in this shard")


def _overlaps(pieces: list[tuple[int, int]], lo: int, n: int) -> list[tuple[int, int, int]]:
    """Parts of ``[lo, lo+n)`` inside ``pieces``: (flat_lo, length, shard position)."""
    out, cursor = [], 0
    for plo, pn in pieces:
        a, b = max(plo, lo), min(plo + pn, lo + n)
        if b > a:
            out.append((a, b - a, cursor + a - plo))
        cursor += pn
    return out


def _owner(layout: ShardLayout, flat_offset: int) -> int:
    for r in range(layout.world):
        for lo, n in layout.pieces(r):
            if lo <= flat_offset < lo + n:
                return r
    raise ValueError(f"offset {flat_offset} is outside the layout")
