"""Decisions behind host-level faults, as tables: lost hosts, etcd endpoint orders, the
leader succession."""

from __future__ import annotations

import pytest

from elaswave.config import load_config
from elaswave.daemon.etcd_connect import failover_order, start_order
from elaswave.daemon.etcd_server import port_candidates
from elaswave.daemon.leader import lost_hosts, succession_delay, succession_turn
from elaswave.errors import ConfigError
from elaswave.faults import FaultSpec
from elaswave.planning.plan import Plan


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


@pytest.mark.parametrize(
    ("endpoints", "client", "order"),
    [
        (["a:1", "b:1", "c:1"], "", ["a:1", "b:1", "c:1"]),  # no name: as given
        (["a:1"], "h0", ["a:1"]),
        (["a:1", "b:1", "c:1"], "h1", ["a:1", "b:1", "c:1"]),  # crc32("h1") % 3 == 0
        (["a:1", "b:1", "c:1"], "h0", ["b:1", "c:1", "a:1"]),  # 1
        (["a:1", "b:1", "c:1"], "h3", ["c:1", "a:1", "b:1"]),  # 2
    ],
)
def test_start_order(endpoints: list[str], client: str, order: list[str]) -> None:
    assert start_order(endpoints, client) == order


def test_start_order_spreads_many_hosts_over_the_members() -> None:
    """A thousand hosts' first members: each of three takes a third, give or take 10 %."""
    firsts = [start_order(["a:1", "b:1", "c:1"], f"node-{i:05d}")[0] for i in range(1000)]
    assert all(300 <= firsts.count(m) <= 367 for m in ("a:1", "b:1", "c:1"))


@pytest.mark.parametrize(
    ("host", "plan_hosts", "turn", "delay"),
    [
        ("a", (), 0, 0.0),  # no plan yet: everyone claims at once
        ("a", ("a", "a", "b", "c"), 0, 0.0),  # the first host of the plan
        ("b", ("a", "a", "b", "c"), 1, 0.02),  # hosts, not ranks, count
        ("c", ("a", "a", "b", "c"), 2, 0.04),
        ("d", ("a", "a", "b", "c"), 3, 0.06),  # not in the plan: after all of them
        ("h99", tuple(f"h{i}" for i in range(100)), 99, 1.0),  # capped
    ],
)
def test_succession(host: str, plan_hosts: tuple[str, ...], turn: int, delay: float) -> None:
    plan = None
    if plan_hosts:
        workers = tuple(f"{h}.w{i}" for i, h in enumerate(plan_hosts))
        plan = Plan(
            epoch=1,
            workers=workers,
            hosts=plan_hosts,
            microbatches=(1,) * len(workers),
            store="s:1",
        )
    assert succession_turn(host, plan) == turn
    assert succession_turn(host, plan) == turn  # asked again: the plan's kept order
    assert succession_delay(turn) == pytest.approx(delay)


def test_partition_cannot_come_from_a_config() -> None:
    with pytest.raises(ConfigError, match="inject-fault"):
        load_config(None, overrides={"faults": [FaultSpec.parse("partition,host=h1")]})


@pytest.mark.parametrize(
    ("ephemeral", "candidates"),
    [
        ((32768, 60999), range(10000, 32768)),  # Linux's default: below the ephemeral range
        ((1024, 60999), range(61000, 65536)),  # no room below: above it
        ((1024, 65535), range(10000, 65536)),  # the whole space is ephemeral: anywhere
    ],
)
def test_embedded_etcd_ports_stay_out_of_the_ephemeral_range(
    ephemeral: tuple[int, int], candidates: range
) -> None:
    """A port picked for etcd is bound a moment later (and again when etcd is restarted): an
    outgoing connection of the job's own (gloo, gRPC) took one in between once (CI: "embedded
    etcd could not start: port … is busy"). Outgoing connections use the ephemeral range only."""
    assert port_candidates(ephemeral) == candidates
