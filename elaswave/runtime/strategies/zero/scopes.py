"""Which ranks a ZeRO rank's shards are laid out over, and how they reach a new plan's layout:
the piece a ZeRO strategy picks beside its data path.

- :class:`MeshScope`: over every data-parallel rank (ZeRO-1, ZeRO-3). Survivors agree on the
  resume step and move their shards to the next layout from the owners or from the replica
  pieces peers keep (:meth:`~.state.ShardState.reshard`); the old layout comes from a rank that
  held state.
- :class:`HostScope` (ZeRO-3 with ``train.shard_scope: host``): each host holds the whole model,
  cut over its own ranks; every layer's gathers stay inside the host, and each layer's gradient
  is summed over every rank (by tiers where the plan has them: inside the host, one lane per
  rank between the hosts, shared back), every rank keeping its part. The hosts then update the
  same elements from the same sums, so their copies stay the same bits (clipping takes its norm
  from the first host's squares only, for that). The copies on other hosts replace snapshots:
  none are kept. After a membership change (:mod:`elaswave.planning.hostshards`), each host
  plans its next layout (survivors keep their ranges, the lost ones are cut among them, joiners
  carve even shares), and every rank reads what it lacks from its host's ranks (a joiner's
  share) or from the same elements on another host (a lost worker's ranges; a whole new host).
  Only if no surviving rank holds some element (on every host) does the job fall back to the
  durable checkpoint.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from elaswave.planning.hostshards import Copy, host_layout, host_ranks, rebuild_transfers
from elaswave.planning.plan import Plan
from elaswave.planning.shards import Range, ShardLayout, Transfer, position, recovery_stats
from elaswave.runtime.strategies.base import DP
from elaswave.runtime.strategies.zero.reshard import unpack_into
from elaswave.runtime.strategies.zero.shard import Shard, ShardLost
from elaswave.runtime.strategies.zero.state import ShardState

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

__all__ = ["HostScope", "MeshScope", "ResumePoint", "ShardScope"]


@dataclass(frozen=True)
class ResumePoint:
    """What the ranks agreed at a sync: every rank's row (step, layout epoch, ...), the ranks
    that hold optimizer state, the step they resume from and a rank that holds it."""

    rows: list[list[float]]
    with_state: list[int]
    resume: int
    source: int


@dataclass(frozen=True)
class Members:
    """The ranks a rank's shards are laid out over: their group, their workers in order, this
    rank's index, and each one's fault domain (empty: replicas ignore domains)."""

    group: str
    workers: tuple[str, ...]
    index: int
    domains: tuple[str, ...]


class ShardScope(ABC):
    """How the shards of ``z`` span the plan's ranks (``ctx``: this rank's context)."""

    fields: ClassVar[dict[str, Any]] = {}  # what a sync's event says of the scope

    def __init__(self, ctx: RankContext, z: ShardState) -> None:
        self.ctx, self.z = ctx, z

    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Process groups of its own under ``plan``, beside data parallelism's."""
        return {}

    @abstractmethod
    def members(self, plan: Plan) -> Members:
        """The ranks this rank's shards are laid out over under ``plan``."""

    @abstractmethod
    def start_fresh(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """Nobody holds state: every shard starts from its initial values; what moved."""

    @abstractmethod
    def reshard(self, plan: Plan, broken: Callable[[], bool], at: ResumePoint) -> dict[str, Any]:
        """Every rank's shard of the plan's layout at ``at.resume``; what moved. Raises
        :class:`ShardLost` (on every rank alike) when some element has no copy left."""

    def holders(self) -> dict[str, list[int]]:
        """Owner rank -> ranks that keep pieces of its replica (for events and tests)."""
        out: dict[str, set[int]] = {}
        for p in self.z.placement:
            out.setdefault(str(p.owner), set()).add(p.holder)
        return {owner: sorted(holders) for owner, holders in out.items()}

    def writes_durable(self, plan: Plan | None) -> bool:
        """Whether this rank writes its pieces of a durable checkpoint."""
        return True

    def adopt(self, plan: Plan) -> Members:
        """Before a whole state is taken in: the ranks it is cut over (the state's group and
        clipping share set for them)."""
        return self.members(plan)


class MeshScope(ShardScope):
    """Shards over every data-parallel rank, each replicated in pieces over the peers."""

    def members(self, plan: Plan) -> Members:
        return Members(DP, plan.workers, self.ctx.comm.rank(DP), plan.domains)

    def start_fresh(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        comm = self.ctx.comm
        return self.z.reshard(
            comm, (), None, new_workers=plan.workers, new_rank=comm.rank(DP), resume_step=0,
            epoch=plan.epoch, abort=broken, new_hosts=plan.domains,
        )  # fmt: skip

    def reshard(self, plan: Plan, broken: Callable[[], bool], at: ResumePoint) -> dict[str, Any]:
        """Survivors roll back to ``at.resume`` and move their shards to the plan's layout (the
        old layout comes from rank ``at.source``)."""
        z, comm = self.z, self.ctx.comm
        rows, with_state, resume, source = at.rows, at.with_state, at.resume, at.source
        if len({int(rows[i][2]) for i in with_state}) > 1:
            raise ShardLost("ranks hold shards of different layouts (a fault while resharding)")
        z.settle(resume)
        layout = z.layout.to_json() if z.layout is not None else []
        old = comm.broadcast_json(
            DP, {"workers": z.workers, "ranges": layout, "hosts": z.hosts}, source, abort=broken
        )
        if len(with_state) < len(rows) and not z.keeps_params:
            # newcomers: full parameters from the source (K > 1 rebuilds them from chunks)
            comm.broadcast(DP, z.flat.data, source, abort=broken)
        return z.reshard(
            comm, tuple(old["workers"]), ShardLayout.from_json(z.segments, old["ranges"]),
            new_workers=plan.workers, new_rank=comm.rank(DP), resume_step=resume, epoch=plan.epoch,
            abort=broken, old_hosts=tuple(old["hosts"]), new_hosts=plan.domains,
        )  # fmt: skip


class HostScope(ShardScope):
    """Shards over each host's ranks, every host a whole copy (see the module docstring)."""

    fields: ClassVar[dict[str, Any]] = {"shard_scope": "host"}

    def __init__(self, ctx: RankContext, z: ShardState) -> None:
        super().__init__(ctx, z)
        z.snapshot_every = 0  # the other hosts' copies recover a lost shard
        self.host = Members(DP, (), -1, ())  # this rank's host's, under the newest plan

    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """Each host's ranks (``dp.host<h>``, the tiers' name for the same ranks)."""
        out = {}
        me = plan.workers.index(self.ctx.worker)
        for h, ranks in enumerate(host_ranks(plan.hosts)):
            name, workers = f"{DP}.host{h}", tuple(plan.workers[r] for r in ranks)
            out[name] = workers
            if me in ranks:
                self.host = Members(name, workers, ranks.index(me), ())
        return out

    def members(self, plan: Plan) -> Members:
        return self.host

    def first_host(self, plan: Plan) -> bool:
        return plan.hosts[plan.workers.index(self.ctx.worker)] == plan.hosts[0]

    def adopt(self, plan: Plan) -> Members:
        self.z.group, self.z.norm_share = self.host.group, self.first_host(plan)
        return self.host

    def start_fresh(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The initial parameters, each host's over its ranks."""
        z, host = self.z, self.host
        z.group, z.norm_share = host.group, self.first_host(plan)
        return z.reshard(
            self.ctx.comm, (), None, new_workers=host.workers, new_rank=host.index,
            resume_step=0, epoch=plan.epoch, abort=broken,
        )  # fmt: skip

    def reshard(self, plan: Plan, broken: Callable[[], bool], at: ResumePoint) -> dict[str, Any]:
        """Every host's shards of its next layout, from the copies at ``at.resume`` wherever
        they are (no snapshots: which layout a rank's shard had, and which rank the layout
        would come from, do not matter: only what each copy holds)."""
        return self._rebuild(plan, at.resume, broken)

    def holders(self) -> dict[str, list[int]]:
        """No replica pieces: the other hosts' copies take their place."""
        return {}

    def writes_durable(self, plan: Plan | None) -> bool:
        """The first host's ranks write their pieces (they tile the model); the others, the
        same elements again, nothing."""
        return plan is not None and self.first_host(plan)

    def _rebuild(self, plan: Plan, resume: int, broken: Callable[[], bool]) -> dict[str, Any]:
        """Every rank's shard of its host's next layout, from the copies at step ``resume``:
        its own, its host's ranks', the other hosts'. Raises :class:`ShardLost` (on every rank
        alike) when some element has no copy left."""
        start = time.perf_counter()
        z, comm = self.z, self.ctx.comm
        z.settle(resume)
        held = z.own is not None and z.own.step == resume and z.layout is not None
        own = z.layout.pieces(z.rank) if held and z.layout is not None else []
        copies = self._copies(plan, own, broken)
        kept: dict[str, dict[str, tuple[Range, ...]]] = {}
        for c in copies:
            kept.setdefault(c.host, {})[c.worker] = c.ranges
        layouts, wants = {}, []
        for ranks in host_ranks(plan.hosts):
            workers = tuple(plan.workers[r] for r in ranks)
            host = plan.hosts[ranks[0]]
            layout = host_layout(z.segments, kept.get(host, {}), workers)
            layouts[host] = layout
            wants += [Copy(w, host, tuple(layout.ranges[i])) for i, w in enumerate(workers)]
        try:
            moves = rebuild_transfers(copies, wants)
        except KeyError as exc:
            raise ShardLost(f"no copy left on any host: {exc.args[0]}") from None
        mine = self.host
        layout = layouts[plan.hosts[plan.workers.index(self.ctx.worker)]]
        out = self._moved(
            plan, moves, own, pieces=layout.pieces(mine.index), size=layout.padded_size,
            broken=broken,
        )  # fmt: skip
        z.group, z.norm_share = mine.group, self.first_host(plan)
        z.adopt_layout(layout, mine.workers, mine.index, epoch=plan.epoch)
        z.start_from(
            comm, Shard.of(resume, out[0], out[1], params=out[2]), z.snap_loss, abort=broken
        )
        host_of = dict(zip(plan.workers, plan.hosts, strict=True))
        sent = [m for m in moves if m.src != m.dst]
        across = sum(m.length for m in sent if host_of[m.src] != host_of[m.dst])
        return {
            **recovery_stats(sent, {}, element_bytes=12),
            "cross_host_bytes": across * 12,
            "transfers": len(sent),
            "transfer_s": time.perf_counter() - start,
        }

    def _copies(self, plan: Plan, own: list[Range], broken: Callable[[], bool]) -> list[Copy]:
        """Every rank's current copy (its flat ranges; none for a newcomer or a stale rank), in
        plan order."""
        comm, dev = self.ctx.comm, self.ctx.state.device
        count = torch.tensor([float(len(own))], dtype=torch.float64, device=dev)
        counts = [int(c[0]) for c in comm.allgather(DP, count, broken)]
        width = max(counts)
        if not width:
            return []
        mine = torch.zeros(2 * width, dtype=torch.int64, device=dev)
        if own:
            mine[: 2 * len(own)] = torch.tensor(own, dtype=torch.int64).reshape(-1)
        rows = comm.allgather(DP, mine, broken)
        out = []
        for r, (n, row) in enumerate(zip(counts, rows, strict=True)):
            if n:
                pairs = row[: 2 * n].view(n, 2).tolist()
                out.append(Copy(plan.workers[r], plan.hosts[r], tuple(map(tuple, pairs))))
        return out

    def _moved(
        self,
        plan: Plan,
        moves: list[Transfer],
        own: list[Range],
        *,
        pieces: list[Range],
        size: int,
        broken: Callable[[], bool],
    ) -> list[torch.Tensor]:
        """This rank's new shard (moments and parameters, :meth:`Shard.tensors`' order): its
        own elements copied, the rest received; what others lack of its copy, sent."""
        z, me = self.z, self.ctx.worker
        dev = self.ctx.state.device
        mine = z.own.tensors() if own and z.own is not None else []
        out = [torch.zeros(size, dtype=torch.float32, device=dev) for _ in range(3)]
        sends: dict[str, list[torch.Tensor]] = {}
        recvs: dict[str, list[tuple[int, int]]] = {}
        for m in moves:
            if m.src == me:
                at = position(own, m.offset)
                parts = [t[at : at + m.length] for t in mine]
                if m.dst == me:
                    to = position(pieces, m.offset)
                    for t, part in zip(out, parts, strict=True):
                        t[to : to + m.length] = part
                else:
                    sends.setdefault(m.dst, []).extend(parts)
            elif m.dst == me:
                recvs.setdefault(m.src, []).append((m.offset, m.length))
        buffers = {
            src: torch.empty(3 * sum(n for _, n in ranges), dtype=torch.float32, device=dev)
            for src, ranges in recvs.items()
        }
        rank = {w: r for r, w in enumerate(plan.workers)}
        self.ctx.comm.exchange(
            DP,
            sends=[(rank[dst], torch.cat(parts)) for dst, parts in sends.items()],
            recvs=[(rank[src], buf) for src, buf in buffers.items()],
            abort=broken,
            tag=2000,
        )
        unpack_into(out, buffers, recvs, pieces=pieces)
        return out
