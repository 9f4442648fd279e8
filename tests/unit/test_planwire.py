"""The plan's wire format (``planwire``): exact round trips on a table of plans and on random ones,
the plain format of before, and the size of plans of 100,000 ranks against etcd's request limit."""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace

import pytest

from elaswave.planning import planwire
from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import Member, Plan, assign_microbatches, next_plan
from elaswave.planning.scaleplans import host_name, synthetic_members

ETCD_REQUEST_LIMIT = 1536 * 1024  # etcd's default --max-request-bytes (1.5 MiB)
SCALE_BUDGET = ETCD_REQUEST_LIMIT // 8  # 192 KiB; measured: 68 KiB (dp), 102 KiB (pp=16)


def plan(workers: list[str], hosts: list[str], **kw: object) -> Plan:
    args: dict = {
        "epoch": 4,
        "workers": tuple(workers),
        "hosts": tuple(hosts),
        "microbatches": tuple(assign_microbatches(3 * len(workers), [1.0] * len(workers))),
        "store": "10.0.0.1:29500",
        "reason": "worker w1 died → epoch 4: dp 4→3",
        "created": 1700000000.25,
        "committed": 17,
    }
    args.update(kw)
    return Plan(**args)


def on_hosts(names: list[str], per_host: int) -> tuple[list[str], list[str]]:
    """(workers, hosts) of ``per_host`` workers ``<host>.w<slot>`` on each host, host by host."""
    pairs = [(f"{h}.w{s}", h) for h in names for s in range(per_host)]
    return [w for w, _ in pairs], [h for _, h in pairs]


PLANS = {
    "minimal, no pipeline fields": Plan(
        epoch=1, workers=("w0",), hosts=("h0",), microbatches=(16,), store="127.0.0.1:1"
    ),
    "data parallel": plan(*on_hosts(["node-00", "node-01", "node-02"], 4)),
    "pipeline": plan(
        *on_hosts(["node-7", "node-8", "node-9", "node-10"], 2),
        microbatches=(5, 5, 5, 4, 4, 4, 7, 7),
        replicas=((0, 1, 2), (3, 4, 5), (6, 7)),
        bounds=((0, 2, 4, 6), (0, 2, 4, 6), (0, 3, 6)),
        shares=(5, 4, 7),
    ),
    "pipeline, replicas not consecutive or empty": plan(
        *on_hosts(["a", "b"], 2),
        replicas=((2, 0), (1, 3), (), (5,)),
        bounds=((0, 1, 2), (0, 1, 2), (), (0, 2)),
        shares=(3, 3, 0, 6),
    ),
    "ids that do not start with their host": plan(
        ["w0", "h1.w1", "h1x.w2", "h10.w0", "x.h1.w3"], ["h1", "h1", "h1", "h1", "h1"]
    ),
    "hosts with dots": plan(
        *on_hosts(["gpu1.example.com", "gpu2.example.com", "10.0.0.9", "10.0.0.10"], 2),
        departed=("gpu3.example.com.w1.r2", "10.0.0.11.w0"),
    ),
    "unicode and odd characters": plan(
        ["узел-1.w0", "節點2.w1", "h\nx.w0", "\ud800.w1", ".w0", "ok.w01", "ok.w", "ok.w-1", "ok."],
        ["узел-1", "節點2", "h\nx", "\ud800", "", "ok", "ok", "ok", "ok"],
        reason='✓ → "quoted" \\ back\tslash \u2028',
        store="[::1]:2379",
        departed=("\ud800.w7", "", ".", "w0", "x.w99999999999999999999999"),
    ),
    "incarnations": plan(
        ["n-1.w0.r3", "n-1.w1", "n-1.w2.r1", "n-1.w3", "n-2.w0", "n-2.w1.r12", "n-2.w2.r0"],
        ["n-1"] * 4 + ["n-2"] * 3,
    ),
    "departed and evicted": plan(
        *on_hosts(["node-1", "node-3"], 2),
        departed=("node-2.w0", "node-2.w1", "node-1.w2", "lost", "node-9.w0.r1", "node-2.w3"),
        evicted=("node-1.w2", "node-2.w3"),
    ),
    "numbered names across widths": plan(
        *on_hosts(["node-0998", "node-0999", "node-1000", "node-9", "node-10", "r1-n2", "r1-n3"], 1)
    ),
    "numbers too long to count": plan(
        *on_hosts(["h" + "9" * 30, "h1" + "0" * 30, "h" + "7" * 5000], 2)
    ),
    "a worker listed twice": plan(["h.w0", "h.w0", "h.w1"], ["h", "h", "h"]),
    "ranks interleaved across hosts": plan(
        ["b.w0", "a.w0", "b.w1", "c.w0", "a.w2", "a.w1"], ["b", "a", "b", "c", "a", "a"]
    ),
    "hosts in racks": plan(
        *on_hosts(["a", "b", "c"], 2), racks=(("a", "rack-1"), ("b", "rack-1"), ("c", "rack-2"))
    ),
}


@pytest.mark.parametrize("p", PLANS.values(), ids=PLANS.keys())
def test_round_trip(p: Plan) -> None:
    text = planwire.encode(p)
    assert planwire.decode(text) == p
    assert planwire.decode(text.encode()) == p  # etcd hands bytes
    assert text.isascii() and json.loads(text)["v"] == 2


@pytest.mark.parametrize("p", PLANS.values(), ids=PLANS.keys())
def test_reads_the_plain_format_of_before(p: Plan) -> None:
    assert planwire.decode(json.dumps(asdict(p), sort_keys=True)) == p


def test_wire_text_of_a_small_plan() -> None:
    """The example of the planwire docstring, byte for byte: runs of hosts, slots, ranks and
    counts, a respawn and a departed worker relative to their host."""
    workers = [f"node-00.w{s}" for s in range(4)] + ["node-01.w0", "node-01.w1"]
    p = Plan(
        epoch=3,
        workers=(*workers, "node-01.w2.r1", "node-01.w3"),
        hosts=("node-00",) * 4 + ("node-01",) * 4,
        microbatches=(3, 3, 3, 3, 2, 2, 2, 2),
        store="10.0.0.1:29500",
        reason="...",
        created=1700000000.5,
        departed=("node-01.w2",),
        committed=120,
    )
    assert planwire.encode(p) == (
        '{"v":2,"epoch":3,"committed":120,"created":1700000000.5,"store":"10.0.0.1:29500",'
        '"reason":"...","hosts":[["node-","00",2]],'
        '"workers":[[0,0,4],[1,0,2],[1,"w2.r1"],[1,3,1]],"ranks":[[0,8]],'
        '"microbatches":[[3,4],[2,4]],"replicas":[],"bounds":[],"shares":[],'
        '"departed":[[1,2,1]],"evicted":[]}'
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"v": 3}, "version 3"),
        ({"ranks": [[0, 3]]}, "do not order"),  # 3 ranks for 4 workers
        ({"ranks": [0, 0, 1, 2]}, "do not order"),  # a worker twice, one never
        ({"workers": [[0, 0, 2, 3]]}, "beyond the table"),  # 3 hosts of a table of 2
        ({"workers": ["bare-id", [0, 0, 2], [1, 0, 1]]}, "no host"),
    ],
)
def test_rejects_malformed_text(change: dict, message: str) -> None:
    good = json.loads(planwire.encode(plan(*on_hosts(["a", "b"], 2))))
    with pytest.raises(ValueError, match=message):
        planwire.decode(json.dumps({**good, **change}))


# ---- random plans ------------------------------------------------------------------------------

ALPHABET = "ab.w0123r-_é☃\n"


def random_plan(rng: random.Random) -> Plan:
    """Any plan: odd host names, ids of the usual shape or not, ranks in any order."""

    def text(n: int) -> str:
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, n)))

    def worker(host: str) -> str:
        shape = rng.random()
        if shape < 0.5:
            return f"{host}.w{rng.randint(0, 9)}"
        if shape < 0.7:
            return f"{host}.w{rng.randint(0, 9)}.r{rng.randint(1, 3)}"
        return rng.choice([f"{host}.{text(4)}", text(8)])

    names = [rng.choice([f"node-{rng.randint(0, 12):02d}", text(6)]) for _ in range(6)]
    hosts = [rng.choice(names) for _ in range(rng.randint(1, 30))]
    workers = [worker(h) for h in hosts]
    stages = [rng.randint(0, 4) for _ in range(rng.randint(0, 5))]
    return Plan(
        epoch=rng.randint(1, 10**6),
        workers=tuple(workers),
        hosts=tuple(hosts),
        microbatches=tuple(rng.choice([1, 2, 2, 2, 3]) for _ in workers),
        store=text(10),
        reason=text(20),
        created=rng.random() * 1e9,
        departed=tuple(worker(rng.choice(names)) for _ in range(rng.randint(0, 6))),
        replicas=tuple(
            tuple(rng.sample(range(len(workers) + 5), min(s, len(workers)))) for s in stages
        ),
        bounds=tuple(tuple(sorted(rng.sample(range(20), s + 1))) for s in stages),
        shares=tuple(rng.randint(0, 5) for _ in stages),
        evicted=tuple(rng.sample(workers, rng.randint(0, min(2, len(workers))))),
        committed=rng.randint(0, 10**6),
    )


@pytest.mark.parametrize("seed", range(4))
def test_random_plans_round_trip(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(100):
        p = random_plan(rng)
        assert planwire.decode(planwire.encode(p)) == p, p


# ---- 100,000 ranks -----------------------------------------------------------------------------

HOSTS, PER_HOST = 12_500, 8
MICROBATCHES = 200_000  # at least one per rank
LAYER_COSTS = [1.0 + 0.1 * (i % 5) for i in range(32)]


def cluster() -> tuple[list[Member], list[Member]]:
    """(everyone, who is left after 1,000 workers departed): 12,500 hosts × 8 workers, every 97th
    of them a respawn (``.r3``); 100 whole hosts are lost, and 200 more workers here and there."""
    everyone = [
        replace(m, worker_id=f"{m.worker_id}.r3") if i % 97 == 5 else m
        for i, m in enumerate(synthetic_members(HOSTS, PER_HOST))
    ]
    lost_hosts = {host_name(120 * k + 7) for k in range(100)}
    scattered = [m for m in everyone if m.host not in lost_hosts]
    lost = {m.worker_id for m in everyone if m.host in lost_hosts}
    lost |= {m.worker_id for m in random.Random(1).sample(scattered, 200)}
    return everyone, [m for m in everyone if m.worker_id not in lost]


@pytest.fixture(scope="module")
def big_plans() -> dict[str, Plan]:
    everyone, left = cluster()
    args: dict = {"num_microbatches": MICROBATCHES, "max_workers": 10**6, "store": "s:1"}
    dp = next_plan(next_plan(None, everyone, now=1.0, **args), left, now=2.0, **args)
    assert dp is not None
    slow = [0.5 if r % 101 == 0 else 1.0 for r in range(dp.world_size)]  # stragglers re-shared
    dp = replace(dp, microbatches=assign_microbatches(MICROBATCHES, slow))
    pipe = {"pp": 16, "costs": LAYER_COSTS, **args}
    first = next_pipeline_plan(None, everyone, now=1.0, **pipe)
    pp = next_pipeline_plan(first, left, now=2.0, **pipe)
    assert pp is not None
    return {"dp": dp, "pp=16": pp}


@pytest.mark.parametrize("kind", ["dp", "pp=16"])
def test_plan_of_100k_ranks_is_small_and_exact(big_plans: dict[str, Plan], kind: str) -> None:
    p = big_plans[kind]
    assert len(p.departed) == 1_000 and len(set(p.microbatches)) > 1
    if kind == "pp=16":  # replicas that lost stages were cut again, each their own way
        assert len(set(p.bounds)) > 2 and len({len(r) for r in p.replicas}) > 1
    text = planwire.encode(p)
    assert len(text.encode()) < SCALE_BUDGET  # the plain format: 3.4 MB (dp), 4.6 MB (pp)
    assert planwire.decode(text) == p


def test_ranks_in_join_order_across_hosts_still_fit() -> None:
    """Workers register when they are ready, so at scale the join order mixes the hosts. The
    planner lays ranks out host by host; a plan whose ranks mix the hosts (one that placed
    them otherwise) costs an index into the host-ordered listing of the workers per rank."""
    everyone = synthetic_members(HOSTS, PER_HOST)
    random.Random(2).shuffle(everyone)
    joined = [replace(m, order=i) for i, m in enumerate(everyone)]
    p = next_plan(None, joined, num_microbatches=MICROBATCHES, max_workers=10**6, store="s", now=0)
    assert p is not None
    first = {h: i for i, h in reversed(list(enumerate(m.host for m in joined)))}
    assert p.hosts == tuple(sorted(p.hosts, key=first.__getitem__))  # host by host
    p = replace(p, workers=tuple(m.worker_id for m in joined), hosts=tuple(m.host for m in joined))
    text = planwire.encode(p)
    assert len(text.encode()) < ETCD_REQUEST_LIMIT // 2  # measured: 575 KiB (plain: 3.4 MB)
    assert planwire.decode(text) == p


def test_racks_are_written_only_when_some_host_has_one() -> None:
    assert "racks" not in json.loads(planwire.encode(PLANS["data parallel"]))
    assert json.loads(planwire.encode(PLANS["hosts in racks"]))["racks"] == [
        ["a", "rack-1"], ["b", "rack-1"], ["c", "rack-2"],
    ]  # fmt: skip
