"""Which strategy a job's config asks for."""

from __future__ import annotations

from typing import TYPE_CHECKING

from elaswave.runtime.strategies.base import Strategy
from elaswave.runtime.strategies.pipeline.strategy import PipelineStages
from elaswave.runtime.strategies.replicated import Replicated
from elaswave.runtime.strategies.zero.strategy import HostZero3, Zero1, Zero3

if TYPE_CHECKING:
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext

__all__ = ["strategy_for"]


def strategy_for(ctx: RankContext, durable: DurableSource) -> Strategy:
    """Pipeline stages (replicated or ZeRO stage state) when ``pp > 1``; else ZeRO-3, ZeRO-1
    or replicated data parallelism."""
    if ctx.cfg.pp > 1:
        return PipelineStages(ctx, durable)
    if ctx.cfg.zero == 3:
        if ctx.cfg.train.shard_scope == "host":
            return HostZero3(ctx, durable)
        return Zero3(ctx, durable)
    if ctx.cfg.zero:
        return Zero1(ctx, durable)
    return Replicated(ctx, durable)
