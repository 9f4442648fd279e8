"""The control plane's scale harness at its smallest size, in the default suite.

Twenty simulated hosts of eight workers (:mod:`bench.scalesim`: the daemon's own membership,
election, planner and plan-watch code against a real three-member etcd cluster) go through every
fault the benchmark injects. Each must be answered by one new plan that every live host holds,
with the right workers in it, which every host got as a delta of the plan before; the leader's
loss elects another; the hosts on a killed etcd member move to the others; and no live host's
lease may expire on the way.
"""

from __future__ import annotations

import asyncio

from bench.scale import one_size
from bench.scalesim import ETCD_REQUEST_LIMIT

HOSTS = 20


def test_every_fault_is_answered_by_one_plan_every_host_holds() -> None:
    result = asyncio.run(one_size(HOSTS, repeat=2, lease_ttl=2))
    faults = result["faults"]
    assert [f["fault"] for f in faults] == [
        "worker exit", "worker exit", "host lost", "leader host lost",
        "etcd member lost, then worker exit",
    ]  # fmt: skip
    # epochs one apart: one plan per fault, none in between
    assert [f["epoch"] for f in faults] == [2, 3, 4, 5, 6]
    # the worlds: 160 workers, two exits, two hosts of 8, one exit
    assert [f["world"] for f in faults] == [159, 158, 150, 142, 141]
    live = [HOSTS, HOSTS, HOSTS - 1, HOSTS - 2, HOSTS - 2]
    assert [f["hosts_seen"] for f in faults] == live
    for f in faults:
        # (a host may see the plan before the leader's compare-and-set has answered)
        assert f["published_s"] > 0 and f["seen_s"]["max"] > 0
        assert f["plan_bytes"] < ETCD_REQUEST_LIMIT
        # every host held the plan before: each applied the delta, none read the whole plan
        assert f["whole_reads"] == 0 and f["delta_bytes"] < f["plan_bytes"]
        assert f["planning_s"] is not None and f["read_s"] is not None
    lost, leader_lost, member = faults[2], faults[3], faults[4]
    assert 1.0 < lost["lease_expiry_s"] < 2 * 2 + 1.0  # etcd expired the silent host's lease
    assert leader_lost["failover_s"] >= 0  # a new leader made the plan
    assert member["hosts_on_member"] >= 1 and member["moved_s"] > 0  # the leader's, at least
