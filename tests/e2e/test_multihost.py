"""Host-level faults on three hosts × two workers, each host a network namespace (tests/e2e/netbed).

Every test checks the run-wide properties on the hosts' merged logs: the job completes, every step
is committed exactly once and in order (one committer at a time: no split brain), epochs only grow
and none is planned twice, losses equal the fault-free run, no process is left behind.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Run, assert_clean_run, wait_for
from netbed import NetBed, netbed_factory  # noqa: F401 - the fixture

from elaswave.events import read_jsonl

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

STEPS = 30
LEASE_TTL = 2


def _env(state_env: dict[str, str]) -> dict[str, str]:
    return dict(
        state_env,
        ELASWAVE_TIMEOUTS__LEASE_TTL=str(LEASE_TTL),
        ELASWAVE_TIMEOUTS__ETCD_CONNECT="2",
        ELASWAVE_TIMEOUTS__RENDEZVOUS="60",
    )


def _start(bed: NetBed, job: str, env: dict[str, str], steps: int = STEPS) -> None:
    for host in bed.hosts:
        bed.launch(
            host, "--job-id", job, "--nproc-per-node", "2", "--nnodes", "3:3",
            "--steps", str(steps), env=env,
        )  # fmt: skip


def _events(bed: NetBed, host: str) -> list[dict[str, Any]]:
    return list(read_jsonl(bed.run_dirs[host] / "events.jsonl"))


def _step(bed: NetBed) -> int:
    return max(
        (m["step"] for h in bed.hosts for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")),
        default=0,
    )


def _leader(bed: NetBed) -> str:
    def find() -> str | None:
        for h in bed.hosts:
            if any(e["kind"] == "leader_elected" for e in _events(bed, h)):
                return h
        return None

    return wait_for(find, timeout=60)


def _merged(bed: NetBed) -> Run:
    return Run(*(bed.run_dirs[h] for h in bed.hosts))


def assert_one_plan_per_epoch(run: Run) -> list[dict[str, Any]]:
    plans = run.of("plan_published")
    epochs = [p["epoch"] for p in plans]
    assert epochs == list(range(1, len(plans) + 1)), f"epochs planned twice or skipped: {epochs}"
    committed = [m["epoch"] for m in run.metrics]
    assert committed == sorted(committed), f"a step committed under an older epoch: {committed}"
    return plans


def test_fault_free_three_hosts(
    netbed_factory: Any, state_env: dict[str, str], reference: Run  # noqa: F811
) -> None:
    bed = netbed_factory(hosts=3)
    _start(bed, "mh-free", _env(state_env), steps=10)
    codes = bed.wait(timeout=120)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = _merged(bed)
    assert_clean_run(run, 10, reference)
    assert [p["world"] for p in assert_one_plan_per_epoch(run)] == [6]
