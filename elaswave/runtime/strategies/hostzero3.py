"""ZeRO-3 sharded inside each host, replicated across hosts (``train.shard_scope: host``).

Each host holds the whole model, cut over its own ranks (the shards, their gradient sums and
Adam moments: :class:`~.paramshards.ParamShards` over the host's group). A step is ZeRO-3's
(:class:`~.zero3.Zero3`) with two differences: every layer's gathers stay inside the host, and
each layer's gradient is summed over every rank (by tiers where the plan has them: inside the
host, one lane per rank between the hosts, shared back), every rank keeping its part. The
hosts then update the same elements from the same sums, so their copies stay the same bits
(clipping takes its norm from the first host's squares only, for that).

The copies on other hosts replace snapshots: none are kept. After a membership change
(:mod:`elaswave.planning.hostshards`), the ranks agree on the resume step, each host plans its
next layout (survivors keep their ranges, the lost ones are cut among them, joiners carve even
shares), and every rank reads what it lacks from its host's ranks (a joiner's share) or from
the same elements on another host (a lost worker's ranges; a whole new host). Only if no
surviving rank holds some element (on every host) does the job fall back to the durable
checkpoint. An interrupted step is redone whole, as in ZeRO-3.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elaswave.planning.hostshards import Copy, host_layout, host_ranks, rebuild_transfers
from elaswave.planning.plan import Plan
from elaswave.planning.shards import Range, Transfer, position, recovery_stats
from elaswave.runtime.durable.checkpoints import DurableState, Piece
from elaswave.runtime.strategies.base import DP
from elaswave.runtime.strategies.reshard import unpack_into
from elaswave.runtime.strategies.shard import Shard, ShardLost
from elaswave.runtime.strategies.sharded import ResumePoint
from elaswave.runtime.strategies.zero3 import Zero3

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["HostZero3"]


class HostZero3(Zero3):
    """ZeRO-3 with each host's ranks sharing one whole copy of the state."""

    def __init__(self, ctx: RankContext, durable: DurableSource) -> None:
        super().__init__(ctx, durable)
        self.shards.snapshot_every = 0  # the other hosts' copies recover a lost shard
        self.path.across_hosts = True
        self.host: tuple[str, tuple[str, ...], int] = (DP, (), -1)  # group, workers, my index

    # ---- a new plan -----------------------------------------------------------------------------
    def groups(self, plan: Plan) -> dict[str, tuple[str, ...]]:
        """ZeRO-3's groups (without hpZ: every gather stays inside the host anyway), and each
        host's ranks (``dp.host<h>``, the tiers' name for the same ranks)."""
        out = super().groups(plan)
        self.path.secondary = None
        me = plan.workers.index(self.ctx.worker)
        for h, ranks in enumerate(host_ranks(plan.hosts)):
            name, workers = f"{DP}.host{h}", tuple(plan.workers[r] for r in ranks)
            out[name] = workers
            if me in ranks:
                self.host = (name, workers, ranks.index(me))
        return out

    def sync(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """ZeRO-3's agreement on the resume step, each host's shards rebuilt from the copies
        the ranks hold (:meth:`_reshard`)."""
        return {**super().sync(plan, broken), "shard_scope": "host"}

    def _start_fresh(self, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The initial parameters, each host's over its ranks."""
        z, (group, workers, index) = self.shards, self.host
        z.group, z.norm_share = group, self._first_host(plan)
        return z.reshard(
            self.ctx.comm,
            (),
            None,
            new_workers=workers,
            new_rank=index,
            resume_step=0,
            epoch=plan.epoch,
            abort=broken,
        )

    def _reshard(self, plan: Plan, broken: Callable[[], bool], at: ResumePoint) -> dict[str, Any]:
        """Every host's shards of its next layout, from the copies at ``at.resume`` wherever
        they are (no snapshots: which layout a rank's shard had, and which rank the layout
        would come from, do not matter: only what each copy holds)."""
        return self._rebuild(plan, at.resume, broken)

    def holders(self) -> dict[str, list[int]]:
        """No replica pieces: the other hosts' copies take their place."""
        return {}

    def _first_host(self, plan: Plan) -> bool:
        return plan.hosts[plan.workers.index(self.ctx.worker)] == plan.hosts[0]

    def _rebuild(self, plan: Plan, resume: int, broken: Callable[[], bool]) -> dict[str, Any]:
        """Every rank's shard of its host's next layout, from the copies at step ``resume``:
        its own, its host's ranks', the other hosts'. Raises :class:`ShardLost` (on every rank
        alike) when some element has no copy left."""
        start = time.perf_counter()
        z, comm = self.shards, self.ctx.comm
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
        me = self.ctx.worker
        group, workers, index = self.host
        layout = layouts[plan.hosts[plan.workers.index(me)]]
        out = self._moved(
            plan, moves, own, pieces=layout.pieces(index), size=layout.padded_size, broken=broken
        )
        z.group, z.norm_share = group, self._first_host(plan)
        z.adopt_layout(layout, workers, index, epoch=plan.epoch)
        z._start_from(
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
        comm, dev = self.ctx.comm, self.state.device
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
        z, me = self.shards, self.ctx.worker
        dev = self.state.device
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

    # ---- whole state ----------------------------------------------------------------------------
    def durable_pieces(self) -> list[Piece] | None:
        """The first host's ranks write their pieces (they tile the model); the others, the
        same elements again, nothing."""
        plan = self.ctx.plan
        if plan is None or not self._first_host(plan):
            return []
        return super().durable_pieces()

    def adopt(self, state: DurableState, plan: Plan, broken: Callable[[], bool]) -> dict[str, Any]:
        """The whole state in (a durable checkpoint): this rank's shard of its host's fresh
        even layout."""
        st, comm, z = self.state, self.ctx.comm, self.shards
        group, workers, index = self.host
        self.forget_partial()
        z.group, z.norm_share = group, self._first_host(plan)
        z.restore_full(
            comm, workers, index, step=state.step, exp_avg=state.exp_avg,
            exp_avg_sq=state.exp_avg_sq, epoch=plan.epoch, abort=broken, hosts=(), loss=state.loss,
            params=state.params,
        )  # fmt: skip
        st.step, st.last_loss = state.step, state.loss
        return {"shard_scope": "host"}

    def layout_key(self) -> Any:
        return (self.host[0], *super().layout_key())
