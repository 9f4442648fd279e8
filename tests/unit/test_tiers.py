"""The reduction by tiers: which ranks reduce together (tables), and the real all-reduce over
gloo groups (five ranks on two uneven "hosts", as threads of a child process) summing what one
flat ring sums."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from elaswave.planning.tiers import Tiers, lane_bounds, lane_owners, tiers_of

HOSTS = ["a", "a", "b", "b", "b"]
# Two racks of two hosts; host c has one rank (it carries every lane), rack X's lanes are cut in
# two slices between the racks, one carried by host a's owner, the other by host b's.
RACKED = ["a", "a", "b", "b", "b", "c", "d", "d"]
RACKS = {"a": "X", "b": "X", "c": "Y", "d": "Y"}


@pytest.mark.parametrize(
    ("hosts", "mode", "expected", "lanes", "lane_groups"),
    [
        # two hosts of two: two lanes, one rank of each host on each
        (["a", "a", "b", "b"], "auto", ((0, 1), (2, 3)), 2, ((0, 2), (1, 3))),
        # uneven: host a's two ranks carry host b's three lanes (rank 0 carries lanes 0 and 2)
        (["a", "a", "b", "b", "b"], "auto", ((0, 1), (2, 3, 4)), 3, ((0, 2), (1, 3), (0, 4))),
        # a host of one rank carries every lane
        (["a", "b", "b"], "auto", ((0,), (1, 2)), 2, ((0, 1), (0, 2))),
        # three hosts, ranks not host by host (a pipeline's order): grouped by host all the same
        (["a", "b", "a", "c", "b", "c"], "auto", ((0, 2), (1, 4), (3, 5)), 2,
         ((0, 1, 3), (2, 4, 5))),
    ],
)  # fmt: skip
def test_tiers_table(hosts, mode, expected, lanes, lane_groups) -> None:
    t = tiers_of(hosts, mode)
    assert t is not None and t.hosts == expected
    assert t.lanes == lanes and t.lane_groups() == lane_groups
    # every lane has one rank per host; every rank's lanes are the ones it owns
    for j, group in enumerate(t.lane_groups()):
        assert [t.place(r)[0] for r in group] == list(range(len(expected)))
        assert all(j in t.my_lanes(r) for r in group)
    assert sorted(j for r in range(len(hosts)) for j in t.my_lanes(r)) == sorted(
        j for j in range(lanes) for _ in expected
    )


@pytest.mark.parametrize(
    "hosts",
    [["a", "a", "a"], ["a", "b", "c"], ["a"]],  # one host; no host with two ranks
)
def test_flat_where_tiers_only_add_hops(hosts) -> None:
    assert tiers_of(hosts, "auto") is None


def test_flat_mode_and_errors() -> None:
    assert tiers_of(["a", "a", "b", "b"], "flat") is None
    with pytest.raises(ValueError, match="hierarchy must be one of auto, flat"):
        tiers_of(["a"], "Auto")
    with pytest.raises(ValueError, match="at least one lane"):
        lane_bounds(4, 0)


def test_racks_table() -> None:
    """Two racks (X: hosts a, b; Y: c, d): lane j summed inside each rack by its owners, then
    cut in two slices, each carried between the racks by one owner per rack."""
    t = tiers_of(RACKED, "auto", RACKS)
    assert t is not None and t.hosts == ((0, 1), (2, 3, 4), (5,), (6, 7))
    assert t.racks == ((0, 1), (2, 3)) and t.lanes == 3 and t.sublanes == 2
    assert t.rack_lane_groups(2) == ((0, 4), (5, 6))  # host a's rank 0 owns lane 2 (2 mod 2)
    assert [t.cross_group(2, q) for q in (0, 1)] == [(0, 5), (4, 6)]
    assert t.my_sublanes(0) == [0] and t.my_sublanes(4) == [1] and t.my_sublanes(5) == [0]
    groups = t.groups([f"w{r}" for r in range(8)])
    assert not any(g.startswith("dp.lane") for g in groups)  # the rack level replaces them
    assert groups["dp.rlane2.0"] == ("w0", "w4") and groups["dp.xlane2.1"] == ("w4", "w6")
    # each slice between the racks has one carrier per rack; each rank carries only its lanes'
    for j in range(t.lanes):
        for q in range(t.sublanes):
            group = t.cross_group(j, q)
            assert [t.rack_place(r)[0] for r in group] == [0, 1]
            assert all(j in t.my_lanes(r) and q in t.my_sublanes(r) for r in group)


@pytest.mark.parametrize(
    ("racks", "levels"),
    [
        (None, 0),
        ({"a": "X", "b": "X", "c": "Y"}, 0),  # host d without a rack: no rack level
        ({"a": "X", "b": "Y", "c": "Z", "d": "W"}, 0),  # no rack with two hosts
        ({"a": "X", "b": "X", "c": "X", "d": "X"}, 0),  # one rack
        (RACKS, 2),
    ],
)
def test_the_rack_level_only_where_it_saves_hops(racks, levels) -> None:
    t = tiers_of(RACKED, "auto", racks)
    assert t is not None and t.sublanes == levels


def test_racks_alone_make_tiers() -> None:
    """One rank per host, two racks of two hosts: the racks are the tiers."""
    t = tiers_of(["a", "b", "c", "d"], "auto", RACKS)
    assert t is not None and t.lanes == 1 and t.racks == ((0, 1), (2, 3))
    assert tiers_of(["a", "b", "c", "d"], "auto") is None


def test_groups_by_name() -> None:
    t = Tiers(((0, 1), (2,)))
    assert t.groups(["w0", "w1", "w2"]) == {
        "dp.host0": ("w0", "w1"),  # host 1 has one rank: no host group
        "dp.lane0": ("w0", "w2"),
        "dp.lane1": ("w1", "w2"),
    }


@pytest.mark.parametrize(
    ("ranks", "slots", "lanes", "owners"),
    [
        ([0, 1, 2, 3], [0, 1, 2, 3], 4, (0, 1, 2, 3)),  # each worker its slot's lane
        ([5, 6, 7], [0, 2, 3], 4, (5, 5, 6, 7)),  # slot 1 lost: its lane to the first rank
        ([5, 6, 7], [1, 2, 3], 4, (5, 5, 6, 7)),  # slot 0 lost: lane 0 to the first rank
        ([5, 6], [0, 3], 4, (5, 5, 6, 6)),  # two lost: their lanes to the least loaded
        ([0, 1], [0, 1], 3, (0, 1, 0)),  # a smaller host: lane j to rank j mod k
        ([4, 9], [None, None], 2, (4, 9)),  # no slots: by position, fewest lanes first
        ([4, 9], [7, 0], 2, (9, 4)),  # a slot past the lanes carries what is left
    ],
)  # fmt: skip
def test_lane_owners_table(ranks, slots, lanes, owners) -> None:
    assert lane_owners(ranks, slots, lanes) == owners


def test_a_lost_worker_changes_only_its_own_lane_group() -> None:
    """Hosts a and b of four workers; a.w1 is lost, then respawned (a.w1.r1, last on its host in
    rank order): of the lane groups only lane 1's changes, each time; without the workers' ids
    (positions as slots) the loss moves lanes 2 and 3 as well."""
    full = [f"{h}.w{i}" for h in "ab" for i in range(4)]
    lost = [w for w in full if w != "a.w1"]
    back = ["a.w0", "a.w2", "a.w3", "a.w1.r1", *full[4:]]

    def lanes(workers: list[str], ids: bool = True) -> dict[str, tuple[str, ...]]:
        hosts = [w.split(".")[0] for w in workers]
        t = tiers_of(hosts, "auto", None, workers=workers if ids else ())
        assert t is not None
        return {g: m for g, m in t.groups(workers).items() if g.startswith("dp.lane")}

    before, after, again = lanes(full), lanes(lost), lanes(back)
    assert {g for g in before if before[g] != after[g]} == {"dp.lane1"}
    assert after["dp.lane1"] == ("a.w0", "b.w1")
    assert {g for g in after if after[g] != again[g]} == {"dp.lane1"}
    assert again["dp.lane1"] == ("a.w1.r1", "b.w1")  # the respawned worker's slot, its lane
    moved = lanes(lost, ids=False)
    assert {g for g in before if before[g] != moved[g]} == {"dp.lane1", "dp.lane2", "dp.lane3"}


@pytest.mark.parametrize(
    ("n", "lanes", "bounds"),
    [(10, 3, [0, 4, 7, 10]), (2, 3, [0, 1, 2, 2]), (0, 2, [0, 0, 0]), (6, 1, [0, 6])],
)
def test_lane_bounds(n, lanes, bounds) -> None:
    assert lane_bounds(n, lanes) == bounds


SCRIPT = textwrap.dedent(
    """
    import datetime, json, os, sys, threading
    import torch
    import torch.distributed as dist
    from elaswave.planning.tiers import tiers_of
    from elaswave.runtime.comm.communicator import Communicator
    from elaswave.runtime.comm.tiered import allgather_tiered, allreduce_tiered

    HOSTS, RACKS = json.loads(sys.argv[1])
    WORKERS = [f"w{r}" for r in range(len(HOSTS))]
    never = lambda: False

    def waker(event):
        return lambda: None

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    address = f"127.0.0.1:{store.port}"
    tiers = tiers_of(HOSTS, "auto", RACKS)
    groups = {"dp": tuple(WORKERS), **tiers.groups(WORKERS)}
    out, errors = {}, []

    def values(rank, n):  # float32 gradients, summed in float64 as the deterministic mode does
        g = torch.Generator().manual_seed(rank)
        return torch.randn(n, generator=g).to(torch.float64)

    def body(rank):
        try:
            comm = Communicator(me=WORKERS[rank], host_addr="127.0.0.1", rendezvous_timeout=30,
                                collective_timeout=30, waker=waker)
            comm.configure(groups, store=address, epoch=1, abort=never)
            got = {}
            for n in (11, 2, 1000):  # 2 < 3 lanes: an empty lane
                flat, tiered, int8 = values(rank, n), values(rank, n), values(rank, n)
                comm.allreduce("dp", flat, never)
                allreduce_tiered(comm, "dp", tiers, tensor=tiered, abort=never)
                # all but the last value (a count, say) cross between hosts as int8
                allreduce_tiered(comm, "dp", tiers, tensor=int8, abort=never, compressed=n - 1)
                part = values(rank, n)
                rings = part.new_empty(len(HOSTS) * n)
                comm.allgather_into("dp", rings, part, abort=never)
                gathered = part.new_full((len(HOSTS) * n,), float("nan"))
                allgather_tiered(comm, "dp", tiers, out=gathered, part=part, abort=never)
                got[n] = [flat.tolist(), tiered.tolist(), int8.tolist(), rings.tolist(),
                          gathered.tolist()]
            out[rank] = got
        except BaseException as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=body, args=(r,)) for r in range(len(HOSTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    expected = {n: sum(values(r, n) for r in range(len(HOSTS))).tolist() for n in (11, 2, 1000)}
    print(json.dumps({"out": out, "errors": errors, "expected": expected}), flush=True)
    os._exit(0)
    """
)


def _collectives(hosts: list[str], racks: dict[str, str] | None) -> dict:
    """One run of the ranks' collectives (flat, tiered, tiered with int8)."""
    r = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps([hosts, racks])],
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert sorted(result["out"], key=int) == [str(r) for r in range(len(hosts))]
    return result


@pytest.fixture(scope="module")
def collectives() -> dict:
    """Five ranks on two uneven hosts, for both tests below."""
    return _collectives(HOSTS, None)


def test_three_levels_sum_what_the_flat_ring_sums() -> None:
    """Racks: hosts, lanes inside the racks, slices between them. Every rank ends with the flat
    ring's sums bit for bit; with int8 between the racks, every rank with the same bits, near
    the exact sums, and not them (the slowest hop was int8)."""
    result = _collectives(RACKED, RACKS)
    int8 = set()
    for rank, got in result["out"].items():
        for n, (flat, tiered, compressed, rings, gathered) in got.items():
            assert tiered == flat, (rank, n)
            assert compressed == pytest.approx(flat, abs=0.1), (rank, n)
            assert gathered == rings, (rank, n)
            int8.add((n, tuple(compressed)))
    assert len(int8) == 3  # one result per size, on every rank
    big = next(v for n, v in int8 if n == "1000")
    assert list(big) != result["expected"]["1000"]


def test_the_tiered_all_reduce_sums_what_the_flat_ring_sums(collectives: dict) -> None:
    """Every rank ends with the same sums as a flat ring's, bit for bit (float32 values summed
    in float64), on uneven hosts, with a lane left empty by a short buffer."""
    for rank, got in collectives["out"].items():
        for n, (flat, tiered, *_) in got.items():
            assert tiered == flat, (rank, n)
            assert tiered == pytest.approx(collectives["expected"][n], abs=1e-12)


def test_the_tiered_all_gather_gathers_what_the_flat_ring_gathers(collectives: dict) -> None:
    """Every rank ends with every rank's part in rank order, as the flat ring gives it: host
    blocks of two and three parts, lanes of unequal widths, and lanes left empty by parts of
    two values (a block of four values in three lanes)."""
    for rank, got in collectives["out"].items():
        for n, (*_, rings, gathered) in got.items():
            assert gathered == rings, (rank, n)
            parts = [_values(r, int(n)) for r in range(len(HOSTS))]
            assert gathered == [x for part in parts for x in part], (rank, n)


def test_the_int8_hop_gives_every_rank_the_same_sums_within_the_rounding(
    collectives: dict,
) -> None:
    """``compressed``: each host's partial sum crosses as int8. Every rank still ends with the
    same bits; each value is off the exact sum by at most half a quantization step per host
    (a step is the block's largest partial / 127); the values after ``compressed`` are exact."""
    hosts = {"a": (0, 1), "b": (2, 3, 4)}
    out = collectives["out"]
    for n in ("11", "2", "1000"):
        (got,) = {tuple(o[n][2]) for o in out.values()}  # one result, bit for bit
        exact, count = collectives["expected"][n], int(n)
        assert got[-1] == out["0"][n][0][-1], "the count is summed exactly"
        values = {r: _values(r, count) for ranks in hosts.values() for r in ranks}
        partials = [[sum(values[r][i] for r in ranks) for i in range(count)]
                    for ranks in hosts.values()]  # fmt: skip
        bound = sum(max(abs(x) for x in p[:-1] or [0.0]) / 254 for p in partials) + 1e-12
        assert all(abs(g - e) <= bound for g, e in zip(got, exact, strict=True)), n
        if count > 100:
            assert got != exact, "nothing was rounded: the hop was not int8"


def _values(rank: int, n: int) -> list[float]:
    import torch

    g = torch.Generator().manual_seed(rank)
    return torch.randn(n, generator=g).to(torch.float64).tolist()
