"""The gradient reduced by tiers across hosts (``train.hierarchy``): two hosts × two workers,
each host a network namespace (tests/e2e/netbed).

In the deterministic mode (float64 reduction) the run reduced by tiers (summed inside each
host, each lane between the hosts, shared back) and the same run reduced by one flat ring give
every loss and the final state bit for bit, through a SIGKILL that leaves the hosts uneven (two
workers and one) and the respawn that evens them again — and both equal the single-host run.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from conftest import F64, Float64Runs, Run, assert_clean_run, paced, read_jsonl, wait_for
from netbed import NetBed, netbed_fixture  # noqa: F401 - provides the netbed_factory fixture

from elaswave.runtime.durable import checkpoints

pytestmark = [pytest.mark.e2e, pytest.mark.netns]

STEPS = 12
LOSS_TOL = 5e-4  # int8 between hosts: relative distance from the exact curve (measured ≤ 7e-5)


@pytest.fixture(scope="module")
def single_host(float64_runs: Float64Runs) -> Run:
    return float64_runs(STEPS)


def _run(
    bed: NetBed,
    job: str,
    mode: str,
    state_env: dict[str, str],
    compress: str = "off",
    kill: int = 3,
    zero: int = 0,
    per_host: int = 2,
    *extra: str,
) -> Run:
    # Emulated device time (50 ms per micro-batch, four per rank): the eight steps after the
    # kill last about 2 s, so the respawned worker (ready ~0.2 s after the kill) is planned
    # back in (a grow waits 0.5 s for more joiners) before the job ends, however fast the CPU.
    env = paced({**state_env, **F64, "ELASWAVE_TRAIN__HIERARCHY": mode,
                 "ELASWAVE_TRAIN__GRAD_COMPRESS": compress, "ELASWAVE_TIMEOUTS__LEASE_TTL": "2",
                 "ELASWAVE_TIMEOUTS__RENDEZVOUS": "60"}, 0.05)  # fmt: skip
    n = len(bed.hosts)
    for host in bed.hosts:
        bed.launch(host, "--job-id", job, "--nproc-per-node", str(per_host),
                   "--nnodes", f"{n}:{n}", "--steps", str(STEPS), "--max-restarts", "1",
                   "--zero", str(zero), "--fault", f"kill,rank={kill},at_step=4", *extra,
                   env=env)  # fmt: skip
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    return Run(*(bed.run_dirs[h] for h in bed.hosts))


def _lanes_built(run: Run) -> set[str]:
    return {g for e in run.of("comm_rebuilt") for g in e["rebuilt"] if g.startswith("dp.")}


def _as_single_host(run: Run, single_host: Run, world: int, keys: tuple[str, ...]) -> None:
    """Every step committed once, the single-host run's losses and final ``keys`` bit for bit,
    through the kill (``world - 1`` ranks) and the respawn (``world`` again)."""
    assert_clean_run(run, STEPS, single_host)
    assert run.losses == single_host.losses  # bit for bit, step by step
    worlds = [p["world"] for p in run.of("plan_published")]
    assert worlds[:2] == [world, world - 1] and worlds[-1] == world, worlds
    for key in keys:
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in single_host.of("final_state")
        }


def test_tiers_reduce_what_the_flat_ring_reduces_through_a_kill_and_a_respawn(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run
) -> None:
    tiered = _run(netbed_factory(hosts=2, name="tiered"), "hier-auto", "auto", state_env)
    flat = _run(netbed_factory(hosts=2, name="flat"), "hier-flat", "flat", state_env)
    for run in (tiered, flat):
        assert_clean_run(run, STEPS, single_host)
        assert run.losses == single_host.losses  # bit for bit, step by step
        worlds = [p["world"] for p in run.of("plan_published")]
        assert worlds[:2] == [4, 3] and worlds[-1] == 4, worlds  # uneven, then even again
    for key in ("params_sha256", "state_sha256"):
        assert (
            {f[key] for f in tiered.of("final_state")}
            == {f[key] for f in flat.of("final_state")}
            == {f[key] for f in single_host.of("final_state")}
        )
    # The tiers' groups: each host's ranks and two lanes (one rank per host each), built again
    # when the hosts went uneven (the survivor on its host carries both lanes); none without tiers.
    assert _lanes_built(tiered) >= {"dp.host0", "dp.host1", "dp.lane0", "dp.lane1"}
    assert _lanes_built(flat) == set()


@pytest.mark.parametrize(
    ("zero", "gather"), [(1, "flat"), (3, "flat"), (3, "tiers")],
    ids=["zero1", "zero3", "zero3-gather-tiers"],
)  # fmt: skip
def test_zero_sharded_by_tiers_is_what_data_parallelism_computes(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run, zero: int, gather: str
) -> None:
    """``--zero 1``: the gradient all-reduced and the updated parameters all-gathered by tiers
    (each host's shards inside the host, each lane of them between the hosts, shared back).
    ``--zero 3``: each layer's gradient reduced by tiers as backward produces it (every rank
    keeps its part), and each layer's backward gathered inside the host from the secondary
    parts its forward left (hpZ) while both hosts have two ranks; with ``zero3_gather: tiers``
    each layer's forward gathered by tiers too. Through the same kill (hosts of 2 and 1: lanes
    of unequal widths, and no hpZ) and respawn: the single-host replicated run's losses and
    final state bit for bit."""
    bed = netbed_factory(hosts=2, name=f"zero{zero}{gather[0]}")
    env = {**state_env, "ELASWAVE_TRAIN__ZERO3_GATHER": gather}
    run = _run(bed, f"hier-zero{zero}-{gather}", "auto", env, zero=zero)
    _as_single_host(run, single_host, 4, ("params_sha256", "state_sha256"))
    assert _lanes_built(run) >= {"dp.host0", "dp.host1", "dp.lane0", "dp.lane1"}
    if zero == 3:  # hpZ while every host has two ranks
        world = {p["epoch"]: p["world"] for p in run.of("plan_published")}
        hpz = {(e["epoch"], e["hpz"]) for e in run.of("state_synced")}
        assert hpz == {(epoch, world[epoch] == 4) for epoch, _ in hpz}, hpz
        assert {on for _, on in hpz} == {True, False}, hpz


def test_zero3_sharded_inside_each_host_is_what_data_parallelism_computes(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run, tmp_path: Path
) -> None:
    """``train.shard_scope: host`` (hybrid sharding): each host holds the whole model cut over
    its ranks, gathers stay inside the host, each layer's gradient is summed over both hosts by
    tiers. Rank 3 (host 1) killed: host 1's survivor takes its ranges from host 0's copy (bytes
    cross between the hosts, no snapshot exists); the respawned worker carves its share from its
    host peer (nothing crosses). The single-host replicated run's losses and final state bit for
    bit, and a final checkpoint (in a directory both hosts reach) of host 0's parts only that
    holds that state."""
    bed = netbed_factory(hosts=2, name="hsdp")
    env = {**state_env, "ELASWAVE_TRAIN__SHARD_SCOPE": "host", "ELASWAVE_TRAIN__SAVE_FINAL": "true"}
    shared = tmp_path / "checkpoints"
    run = _run(bed, "hier-hsdp", "auto", env, "off", 3, 3, 2, "--durable-dir", str(shared))
    _as_single_host(run, single_host, 4, ("params_sha256", "state_sha256"))
    synced = [e for e in run.of("state_synced") if e["epoch"] > 1]
    assert {e["shard_scope"] for e in synced} == {"host"}
    world = {p["epoch"]: p["world"] for p in run.of("plan_published")}
    lost = [e for e in synced if world[e["epoch"]] == 3]
    back = [e for e in synced if world[e["epoch"]] == 4]
    assert lost and back
    # the lost ranges: a quarter of the model's parameters and moments, from the other host
    assert all(e["cross_host_bytes"] > 0 and e["cross_host_bytes"] == e["bytes"] for e in lost)
    assert all(e["cross_host_bytes"] == 0 and e["bytes"] > 0 for e in back)
    (saved,) = run.of("final_saved")
    assert saved["parts"] == 4
    parts = json.loads((Path(saved["path"]) / checkpoints.PIECES).read_text())["pieces"]
    assert {rank for *_, rank in parts} == {0, 1}  # host 0's two ranks tile the model
    state = checkpoints.load(Path(saved["path"]), parts[-1][1])
    digest = hashlib.sha256(state.params.numpy().tobytes()).hexdigest()
    assert {digest} == {f["params_sha256"] for f in single_host.of("final_state")}


def test_zero3_inside_each_host_through_a_host_loss_and_its_return(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run
) -> None:
    """``train.shard_scope: host``, two hosts of two: the host that does not lead is SIGKILLed
    whole (daemon and workers); the other host's copy is whole already, so it goes on alone
    with nothing moved. Launched again, the host's new workers take the whole model from the
    other host (every byte crosses). The single-host run's losses and final state bit for bit."""
    bed = netbed_factory(hosts=2, name="hsdpo")
    env = paced({**state_env, **F64, "ELASWAVE_TRAIN__SHARD_SCOPE": "host",
                 "ELASWAVE_TIMEOUTS__LEASE_TTL": "2", "ELASWAVE_TIMEOUTS__RENDEZVOUS": "60"},
                0.25)  # fmt: skip
    args = ("--job-id", "hier-hsdp-host", "--nproc-per-node", "2", "--nnodes", "2:2",
            "--steps", str(STEPS), "--zero", "3")  # fmt: skip
    for host in bed.hosts:
        bed.launch(host, *args, env=env)

    def events(host: str) -> list[dict[str, Any]]:
        path = bed.run_dirs[host] / "events.jsonl"
        return list(read_jsonl(path)) if path.exists() else []

    leader = wait_for(
        lambda: next((h for h in bed.hosts if any(e["kind"] == "leader_elected"
                                                  for e in events(h))), None),
        timeout=60,
    )  # fmt: skip
    victim = next(h for h in bed.hosts if h != leader)

    def committed() -> int:  # the metrics are written where rank 0 runs, the leader or not
        return max((m["step"] for h in bed.hosts
                    for m in read_jsonl(bed.run_dirs[h] / "metrics.jsonl")), default=0)  # fmt: skip

    wait_for(lambda: committed() >= 2, timeout=120, interval=0.05)
    bed.kill_host(victim)
    wait_for(lambda: any(e["kind"] == "host_lost" for e in events(leader)), timeout=60)
    bed.launch(victim, *args, env=env)
    codes = bed.wait(timeout=180)
    assert codes == {h: 0 for h in bed.hosts}, [bed.output(h) for h in bed.hosts]
    run = Run(*(bed.run_dirs[h] for h in bed.hosts))
    assert_clean_run(run, STEPS, single_host)
    assert run.losses == single_host.losses
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in single_host.of("final_state")
        }
    world = {p["epoch"]: p["world"] for p in run.of("plan_published")}
    assert [world[e] for e in sorted(world)][:2] == [4, 2] and world[max(world)] == 4, world
    synced = [e for e in run.of("state_synced") if e["epoch"] > 1]
    alone = [e for e in synced if world[e["epoch"]] == 2]
    back = [e for e in synced if world[e["epoch"]] == 4]
    assert alone and all(e["bytes"] == 0 for e in alone)  # the host's copy was whole
    assert back and all(e["cross_host_bytes"] == e["bytes"] > 0 for e in back)
    assert len({e["bytes"] for e in back}) == 1  # every rank reports the same plan's moves


def test_pipeline_holder_groups_sum_by_tiers_what_data_parallelism_sums(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run
) -> None:
    """``--pp 2`` on two hosts of three workers: each stage's three holders span both hosts,
    two on one, so each holder group sums its layers' gradient by tiers (its own host and lane
    groups, named after it). Through the kill of rank 3 (a stage re-cut) and the respawn: the
    single-host replicated run's losses and final parameters bit for bit."""
    bed = netbed_factory(hosts=2, name="pp")
    run = _run(bed, "hier-pp", "auto", state_env, "off", 3, 0, 3, "--pp", "2")
    _as_single_host(run, single_host, 6, ("params_sha256",))
    built = {g for e in run.of("comm_rebuilt") for g in e["rebuilt"] if g.startswith("grad-")}
    tiered = {g.split(".", 1)[1] for g in built if "." in g}
    assert {"host0", "lane0", "lane1"} <= tiered, built  # the host with two holders, the lanes


def test_int8_between_hosts_keeps_every_rank_on_one_curve_near_the_exact_one(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run
) -> None:
    """``train.grad_compress: int8`` through the same kill and respawn: every step committed
    once, every rank ends with the same bits (every lane rank sums the same int8 parts in the
    same order), and the curve stays within LOSS_TOL (relative) of the exact sums' while
    not being it (the hop between hosts was int8)."""
    run = _run(netbed_factory(hosts=2, name="int8"), "hier-int8", "auto", state_env, "int8")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    assert len({f["params_sha256"] for f in run.of("final_state")}) == 1
    assert len(run.of("final_state")) == 4
    exact = single_host.losses
    worst = max(abs(run.losses[s] - exact[s]) / abs(exact[s]) for s in exact)
    assert 0 < worst <= LOSS_TOL, worst
    assert _lanes_built(run) >= {"dp.host0", "dp.host1", "dp.lane0", "dp.lane1"}


def test_racks_add_a_level_and_reduce_what_the_flat_ring_reduces(
    netbed_factory: Any, state_env: dict[str, str], single_host: Run
) -> None:
    """Two bridges: rack A (h0, h1) on one, rack B (h2) on the other, joined by one link; two
    workers a host. Each lane is summed inside the rack, cut in two slices between the racks
    (rack A's hosts carry one each) and shared back. Through a SIGKILL of rank 3 (a worker in
    rack A, whichever rack comes first: its host goes uneven) and its respawn, the losses and
    the final state are the single-host run's bit for bit."""
    bed = netbed_factory(hosts=3, name="racks", racks=("A", "A", "B"))
    run = _run(bed, "hier-racks", "auto", state_env, kill=3)
    _as_single_host(run, single_host, 6, ("params_sha256",))
    built = _lanes_built(run)
    # both lanes inside rack A (whichever rack index it has: racks go in join order), both
    # lanes' two slices between the racks; no host-to-host lanes
    assert built >= {"dp.host0", "dp.host1", "dp.host2", "dp.xlane0.0", "dp.xlane0.1",
                     "dp.xlane1.0", "dp.xlane1.1"}, built  # fmt: skip
    inside = {g.rsplit(".", 1)[0] for g in built if g.startswith("dp.rlane")}
    assert inside == {"dp.rlane0", "dp.rlane1"}, built
    assert len({g for g in built if g.startswith("dp.rlane")}) == 2, built  # one rack of two
    assert not {g for g in built if g.startswith("dp.lane")}
