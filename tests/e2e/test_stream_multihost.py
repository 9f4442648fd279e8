"""The job's TensorBoard stream on three hosts × two workers (network namespaces sharing one
filesystem, tests/e2e/netbed) through the loss of the leader's host, and of the host that
writes it."""

from __future__ import annotations

import time
from typing import Any

import pytest
from conftest import Run, wait_for
from netbed import NetBed, netbed_fixture  # noqa: F401 - provides the netbed_factory fixture

from elaswave.events import read_jsonl
from tests.streamread import accumulate, scalars, texts

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

JOB = "mh-stream"
STEPS = 30
LEASE_TTL = 2


def _events(bed: NetBed, host: str, kind: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(bed.run_dirs[host] / "events.jsonl") if e["kind"] == kind]


def _step(bed: NetBed) -> int:
    lines = (m for h in bed.hosts for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl"))
    return max((m["step"] for m in lines), default=0)


def _rank0_host(bed: NetBed) -> str | None:
    for h in bed.hosts:
        for plan in _events(bed, h, "plan_published"):
            return str(plan["workers"][0]).split(".")[0]
    return None


@pytest.mark.parametrize("victim", ["leader", "rank0"])
def test_stream_has_every_step_once_through_a_host_loss(
    netbed_factory: Any, state_env: dict[str, str], victim: str
) -> None:
    """The leader's host, or the host of rank 0 (which writes the stream), dies mid-run (daemon
    and workers SIGKILLed). Every step any host recorded is in the one stream once, with its
    loss, and the host's loss is marked at the first step recorded under the plan that
    answered it. Where the dead host held rank 0 (and so wrote the steps until then), another
    host takes the stream over in a file of its own."""
    bed = netbed_factory(hosts=3)
    env = dict(
        state_env,
        ELASWAVE_TIMEOUTS__LEASE_TTL=str(LEASE_TTL),
        ELASWAVE_TIMEOUTS__ETCD_CONNECT="2",
        ELASWAVE_TIMEOUTS__RENDEZVOUS="60",
    )
    tb = bed.workdir / "tb"
    for host in bed.hosts:
        bed.launch(
            host, "--job-id", JOB, "--nproc-per-node", "2", "--nnodes", "3:3",
            "--steps", str(STEPS), "--tensorboard", str(tb), env=env,
        )  # fmt: skip
    leader = wait_for(
        lambda: next((h for h in bed.hosts if _events(bed, h, "leader_elected")), None), 60
    )
    wait_for(lambda: _step(bed) >= 6, timeout=120, interval=0.1)
    rank0 = wait_for(lambda: _rank0_host(bed), 10)
    dead = leader if victim == "leader" else rank0
    bed.kill_host(dead)
    killed_at = time.time()
    codes = bed.wait(timeout=150)
    assert codes[dead] == -9 and all(c == 0 for h, c in codes.items() if h != dead), codes

    run = Run(*(bed.run_dirs[h] for h in bed.hosts))
    committed = {m["step"]: m for m in run.metrics}
    assert sorted(committed) == list(range(1, STEPS + 1)) and len(run.metrics) == STEPS

    acc = accumulate(tb / JOB)
    loss = scalars(acc, "train/loss")
    assert [s for s, _ in loss] == list(range(1, STEPS + 1))  # every committed step, once
    assert all(v == pytest.approx(committed[s]["loss"], rel=1e-6) for s, v in loss)

    plans = run.of("plan_published")
    assert [p["world"] for p in plans] == [6, 4]
    first = min(s for s, m in committed.items() if m["epoch"] >= plans[1]["epoch"])
    assert scalars(acc, "incidents/world_size") == [(first, 4.0)]
    ((step, text),) = texts(acc, "incidents")
    assert step == first and f"host {dead} lost" in text and "**host" in text
    ((_, mttr),) = scalars(acc, "incidents/mttr_s")
    assert 0 < mttr < time.time() - killed_at

    writers = [p.name.split(".")[-2] for p in sorted((tb / JOB).iterdir())]
    if rank0 == dead:  # the dead host wrote the stream until it died; another went on
        assert writers[0] == dead and len(set(writers)) == 2, writers
    else:
        assert set(writers) == {rank0}, writers
    print(f"leader {leader}, rank 0 on {rank0}, {dead} killed, event files by {writers}")
