"""Silent corruption, as the engine's loop sees it: the seal, the periodic check, the known-good
state and the rollback.

After each clean check every rank keeps the state (``KnownGood``; step 0's too): the whole, or what
its layout holds (ZeRO-3's shard, a pipeline stage's layers), void once the layout changes. A check
compares the copies through the strategy (``Strategy.verify``: replicated votes, ZeRO shard copies,
pipeline layer holders) and repairs bad ones. A *seal* — the CRC of the parameters a rank computes
with, taken at commit and checked before the next step — catches flips that the next step would
wash out of the copies. When anything was found, every rank rolls back to the known-good state
(``rollback_verdict``) and the main loop redoes the steps since. Only strategies whose parameters
are overwritten from peers every step (``Strategy.sealed``: ZeRO) pay for the seal: elsewhere a
flip stays in the copy it hit, and the next check finds it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from elaswave import wire
from elaswave.runtime.integrity.checksums import fast_checksum
from elaswave.runtime.integrity.inject import FaultInjector
from elaswave.runtime.integrity.rollback import NONE, KnownGood, rollback_verdict
from elaswave.runtime.integrity.verify import flip_bit

if TYPE_CHECKING:
    from elaswave.planning.plan import Plan
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["CheckedStrategy", "Integrity", "check_due"]

DP = "dp"  # the training group: every rank of the plan


class CheckedStrategy(Protocol):
    """What the checker calls on the rank's strategy
    (:class:`~elaswave.runtime.strategies.base.Strategy` has each, documented there)."""

    @property
    def sealed(self) -> bool: ...

    def computes_with(self) -> torch.Tensor: ...

    def corrupt_target(self, target: str) -> tuple[torch.Tensor, str]: ...

    def verify(self, step: int, broken: Callable[[], bool]) -> bool: ...

    def known_good(self, broken: Callable[[], bool]) -> torch.Tensor: ...

    def take_known_good(
        self, step: int, loss: float, good: torch.Tensor, *, plan: Plan, broken: Callable[[], bool]
    ) -> None: ...

    def layout_key(self) -> Any: ...

    def layout_generation(self) -> Any: ...

    def say(self, kind: str, **fields: Any) -> None: ...


def check_due(
    step: int, every: int, per_layout: bool, *, generation: object, checked: object
) -> bool:
    """Whether the commit of ``step`` is checked: every ``every`` steps, and, where known-good
    states are kept per layout (``per_layout``: a stage's layers, a shard), at the first commit
    of a settled layout generation (``generation``, the same on every rank; ``None`` while not
    settled) other than the one of the last clean check (``checked``): a new layout voids the
    known-good state, and without this check a corruption found before the next periodic one
    could only be repaired in place, not rolled back. Pure."""
    if not every:
        return False
    if step % every == 0:
        return True
    return per_layout and generation is not None and generation != checked


class Integrity:
    """One rank's side of corruption detection and rollback (every method that talks to peers
    is called by every rank of the plan together)."""

    def __init__(
        self,
        ctx: RankContext,
        strategy: CheckedStrategy,
        durable: DurableSource,
        *,
        faults: FaultInjector,
    ) -> None:
        self.ctx = ctx
        self.strategy = strategy
        self.durable = durable
        self.faults = faults
        self.every = ctx.cfg.verify_every
        self.good: KnownGood | None = None  # what it keeps of the last clean check's state
        self._good_stats: torch.Tensor | None = None  # and of its running statistics
        self._good_key: object = None  # the layout it fits (None: the whole state fits any)
        self._good_generation: object = None  # the layout generation of the last clean check
        self._seal: int | None = None  # CRC of the parameters as last committed
        self._tainted = False  # they changed at rest since

    def before_step(self) -> None:
        if self._seal_broken():
            self._tainted = True  # changed at rest: the next check rolls everyone back

    def reseal(self) -> None:
        if self.every and self.strategy.sealed and self.ctx.plan is not None:
            self._seal = fast_checksum(self.strategy.computes_with())

    def _seal_broken(self) -> bool:
        return self._seal is not None and fast_checksum(self.strategy.computes_with()) != self._seal

    def after_apply(self) -> None:
        """A plan is in force; at step 0 every rank built the same state: it is known good. A
        known-good shard of a layout the plan changed is void (no rank keeps one then: a check
        that finds something before the next clean one repairs in place, without a rollback)."""
        if self.every and self.ctx.state.step == 0:
            self.capture_good(0)
        elif not self._good_fits():
            self.good = None

    def after_commit(self, step: int) -> bool:
        """Corruption faults due at ``step`` land; on a check step, the check. True when every
        rank rolled back (the main loop redoes the steps since the known-good state)."""
        self.reseal()
        self.faults.corrupt(step, self._flip)
        if not check_due(step, self.every, self.strategy.layout_key() is not None,
                         generation=self.strategy.layout_generation(),
                         checked=self._good_generation):  # fmt: skip
            return False
        self.ctx.enter("collective")
        tainted = self._tainted or self._seal_broken()  # before a repair rewrites anything
        found = self.strategy.verify(step, self.ctx.broken)
        rolled_back = self._settle(step, found, tainted)
        self.ctx.enter("idle")
        return rolled_back

    def _flip(self, target: str, step: int) -> str:
        tensor, name = self.strategy.corrupt_target(target)
        index = (step * 7919) % tensor.numel()
        flip_bit(tensor, index)
        return f"{name}[{index}]"

    def _settle(self, step: int, found: bool, tainted: bool) -> bool:
        """After a check at ``step`` (``found``: copies disagreed on some rank; ``tainted``: this
        rank's parameters changed at rest): keep the state as known good when every rank is
        clean; otherwise roll every rank back to the known-good state (True)."""
        ctx = self.ctx
        plan, dev = ctx.plan, ctx.state.device
        assert plan is not None
        good = self.good.step if self.good is not None and self._good_fits() else NONE
        mine = torch.tensor([int(tainted), int(found), good], dtype=torch.int64, device=dev)
        rows = [r.tolist() for r in ctx.comm.allgather(DP, mine, ctx.broken)]
        hit = [r for r, row in enumerate(rows) if row[0]]
        found_any = any(row[1] for row in rows)
        if hit and not found_any:  # only the seal saw it (the copies agree again)
            self.strategy.say(
                "sdc_detected", step=step, what="parameters changed at rest", ranks=hit,
                workers=[plan.workers[r] for r in hit], source_rank=None,
            )  # fmt: skip
        if not hit and not found_any:
            self.capture_good(step)
            return False
        whole = self.strategy.layout_key() is None
        verdict = rollback_verdict([row[2] for row in rows], step, whole=whole)
        if verdict.target is None:  # the in-place repair stands; the steps since keep its trace
            self.strategy.say("sdc_not_rolled_back", step=step, reason=verdict.reason)
            self._tainted = False
            self.reseal()
            return False
        assert verdict.source is not None
        self._roll_back(step, verdict.target, verdict.source, kept=[row[2] for row in rows])
        return True

    def _good_fits(self) -> bool:
        """This rank keeps a known-good state that fits its layout now (a pipeline stage's
        migration may have moved layers within a plan)."""
        return self.good is not None and self._good_key == self.strategy.layout_key()

    @property
    def good_bytes(self) -> int:
        """What this rank keeps for a rollback."""
        if self.good is None or not self.good.kept.numel():
            return 0
        return self.good.kept.untyped_storage().nbytes()

    def capture_good(self, step: int) -> None:
        """Every rank keeps its known-good state of ``step`` (a collective where it is the whole
        state: ZeRO-1 gathers the moments)."""
        kept = self.strategy.known_good(self.ctx.broken)
        self.good = KnownGood(step, self.ctx.state.last_loss, kept)
        stats = self.ctx.state.stats
        self._good_stats = stats.saved() if stats is not None else None
        self._good_key = self.strategy.layout_key()
        self._good_generation = self.strategy.layout_generation()
        self._tainted = False

    def _roll_back(self, step: int, target: int, source: int, *, kept: list[int]) -> None:
        """Every rank restores the known-good state of ``target``; steps ``target + 1 .. step``
        are redone by the main loop."""
        ctx = self.ctx
        assert ctx.plan is not None
        broken, start, dev = ctx.broken, time.perf_counter(), ctx.state.device
        if any(k != target for k in kept):  # newcomers receive it from a rank that keeps it
            n = ctx.state.flat.total
            meta = torch.tensor([float(target), math.nan], dtype=torch.float64, device=dev)
            whole = ctx.state.flat.data.new_empty(3 * n)
            if self.good is not None and self.good.step == target:
                meta[1], whole = self.good.loss, self.good.kept
            ctx.comm.broadcast(DP, meta, source, abort=broken)
            ctx.comm.broadcast(DP, whole, source, abort=broken)
            self.good = KnownGood(target, float(meta[1]), whole)
            stats = ctx.state.stats
            if stats is not None:  # the running statistics of that step too
                held = self._good_stats if self._good_stats is not None else stats.saved()
                saved = held.to(dev)
                ctx.comm.broadcast(DP, saved, source, abort=broken)
                self._good_stats = saved.cpu()
        assert self.good is not None
        self.strategy.take_known_good(
            target, self.good.loss, self.good.kept, plan=ctx.plan, broken=broken
        )
        if ctx.state.stats is not None:
            ctx.state.stats.adopt(self._good_stats, target)
        self._tainted = False
        self.reseal()
        if ctx.comm.rank(DP) != 0:
            return
        if self.durable.checkpoints is not None:
            self.durable.checkpoints.discard_after(target)  # saved from a state the check failed
        ctx.event(
            "sdc_rolled_back", step=step, to_step=target, redone_steps=step - target,
            seconds=round(time.perf_counter() - start, 6),
        )  # fmt: skip
        ctx.send(wire.Rollback(step=target))
