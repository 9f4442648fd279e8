"""Decisions behind host-level faults, as tables: fencing, lost hosts, etcd failover order."""

from __future__ import annotations

import pytest

from elaswave.config import load_config
from elaswave.daemon.etcd import failover_order
from elaswave.daemon.leader import lost_hosts
from elaswave.daemon.supervisor import fence_verdict
from elaswave.errors import ConfigError
from elaswave.faults import FaultSpec

TTL = 2


@pytest.mark.parametrize(
    ("since_refresh", "remaining", "verdict"),
    [
        (0.5, 2, None),  # healthy
        (1.9, None, None),  # refreshes failing, but etcd cannot have dropped us yet
        (2.0, None, None),  # exactly one TTL: not past it
        (2.1, None, "no lease refresh"),  # cut off for longer than the TTL
        (2.1, 2, "no lease refresh"),  # an answer that came too late does not undo the gap
        (0.1, 0, "expired"),  # back from a partition, but etcd already dropped the lease
        (0.1, -1, "expired"),
    ],
)
def test_fence_verdict(since_refresh: float, remaining: int | None, verdict: str | None) -> None:
    reason = fence_verdict(since_refresh, remaining, TTL)
    if verdict is None:
        assert reason is None
    else:
        assert reason is not None and verdict in reason


@pytest.mark.parametrize(
    ("plan_hosts", "live", "lost"),
    [
        (("h0", "h0", "h1", "h1"), {"h0", "h1"}, []),
        (("h0", "h0", "h1", "h1"), {"h0"}, ["h1"]),
        (("h1", "h0", "h1", "h2"), {"h0"}, ["h1", "h2"]),  # rank order, each host once
        (("h0",), set(), ["h0"]),
        ((), {"h0"}, []),
    ],
)
def test_lost_hosts(plan_hosts: tuple[str, ...], live: set[str], lost: list[str]) -> None:
    assert lost_hosts(plan_hosts, live) == lost


@pytest.mark.parametrize(
    ("current", "order"),
    [
        ("a:1", ["b:1", "c:1"]),
        ("b:1", ["c:1", "a:1"]),
        ("c:1", ["a:1", "b:1"]),
        ("x:1", ["a:1", "b:1", "c:1"]),  # unknown: try them all
    ],
)
def test_failover_order(current: str, order: list[str]) -> None:
    assert failover_order(["a:1", "b:1", "c:1"], current) == order


def test_partition_cannot_come_from_a_config() -> None:
    with pytest.raises(ConfigError, match="inject-fault"):
        load_config(None, overrides={"faults": [FaultSpec.parse("partition,host=h1")]})
