"""A plan as a change to the one before (:mod:`elaswave.planning.plandelta`): applied to its base it
gives the plan exactly, for every kind of change the planners make; it is small where the plan is
large; anything that is not a change to the base a host holds is refused (the host then reads the
whole plan)."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from elaswave.planning import planwire
from elaswave.planning.pipeplan import next_pipeline_plan
from elaswave.planning.plan import Member, Plan, next_plan, reshared_plan
from elaswave.planning.plandelta import apply_delta, delta_epochs, encode_delta
from elaswave.planning.scaleplans import host_name, synthetic_members


def _dp_or_none(prev: Plan | None, members: list[Member], mbs: int = 64) -> Plan | None:
    return next_plan(prev, members, num_microbatches=mbs, max_workers=mbs, store="s:1", now=1.0)


def _pp_or_none(prev: Plan | None, members: list[Member]) -> Plan | None:
    return next_pipeline_plan(prev, members, pp=2, costs=[1.0] * 8, num_microbatches=16,
                              max_workers=16, store="s:1", now=1.0)  # fmt: skip


def _dp(prev: Plan | None, members: list[Member], mbs: int = 64) -> Plan:
    plan = _dp_or_none(prev, members, mbs)
    assert plan is not None
    return plan


def _pp(prev: Plan | None, members: list[Member]) -> Plan:
    plan = _pp_or_none(prev, members)
    assert plan is not None
    return plan


EVERYONE = synthetic_members(4, 2)  # node-00000.w0 … node-00003.w1


def _without(*ids: str) -> list[Member]:
    return [m for m in EVERYONE if m.worker_id not in ids]


def _changes() -> dict[str, tuple[Plan, Plan]]:
    start = _dp(None, EVERYONE)
    pipe = _pp(None, EVERYONE)
    respawned = Member(worker_id="node-00001.w0.r1", host=host_name(1), order=100)
    return {
        "a worker exits": (start, _dp(start, _without("node-00001.w1"))),
        "a host is lost": (start, _dp(start, _without("node-00002.w0", "node-00002.w1"))),
        "the first rank goes": (start, _dp(start, _without("node-00000.w0"))),
        "a respawn joins": (
            s := _dp(start, _without("node-00001.w0")),
            _dp(s, [*_without("node-00001.w0"), respawned]),
        ),
        "a host joins": (
            s := _dp(None, EVERYONE[:6]),
            _dp(s, EVERYONE),
        ),
        "a straggler re-share": (
            start,
            reshared_plan(start, [9, 7, 8, 8, 8, 8, 8, 8], store="s:1", now=2.0),
        ),
        "a straggler evicted": (
            start,
            reshared_plan(
                start, [10, 9, 9, 9, 9, 9, 9], evict=["node-00003.w1"], store="s:1", now=2.0
            ),
        ),
        "a stage taken over": (pipe, _pp(pipe, _without("node-00001.w1"))),
        "a pipeline host lost": (pipe, _pp(pipe, _without("node-00003.w0", "node-00003.w1"))),
        "the whole membership replaced": (start, replace(start, epoch=2, workers=("x.w0",) * 8)),
        "a host of another rack joins": (
            s := _dp(None, [replace(m, rack="r1") for m in EVERYONE[:6]]),
            _dp(
                s,
                [
                    *(replace(m, rack="r1") for m in EVERYONE[:6]),
                    *(replace(m, rack="r2") for m in EVERYONE[6:]),
                ],
            ),
        ),  # fmt: skip
    }


@pytest.mark.parametrize("change", sorted(_changes()))
def test_a_delta_applied_to_its_base_is_the_plan(change: str) -> None:
    base, new = _changes()[change]
    text = encode_delta(base, new)
    assert delta_epochs(text) == (base.epoch, new.epoch)
    assert apply_delta(base, text) == new


def test_kept_ranks_are_runs_of_the_base() -> None:
    base, new = _changes()["a worker exits"]  # rank 3 of 8 goes
    assert json.loads(encode_delta(base, new))["ranks"] == [[0, 3], [4, 4]]
    base, new = _changes()["a host joins"]  # two newcomers appended
    assert json.loads(encode_delta(base, new))["ranks"] == [
        [0, 6], ["node-00003.w0", "node-00003"], ["node-00003.w1", "node-00003"],
    ]  # fmt: skip


def test_random_sequences_of_changes() -> None:
    """Plans after random exits and joins (data parallel and pipelines): each delta applied to
    the plan before gives the next plan."""
    rng = random.Random(7)
    for make in (_dp_or_none, _pp_or_none):
        live = list(EVERYONE)
        spare = synthetic_members(4, 2, first=4)
        plan = make(None, live)
        assert plan is not None
        for _ in range(12):
            if spare and (len(live) < 4 or rng.random() < 0.4):
                live.append(spare.pop(0))
            else:
                live.remove(rng.choice(live))
            nxt = make(plan, live) if live else None
            if nxt is None:
                continue
            assert apply_delta(plan, encode_delta(plan, nxt)) == nxt
            plan = nxt


def test_a_first_plan_has_nothing_to_apply() -> None:
    first = _dp(None, EVERYONE)
    text = encode_delta(None, first)
    assert delta_epochs(text) == (0, 1)
    with pytest.raises(ValueError, match="not a change"):
        apply_delta(first, text)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: d.update(base=7), "not a change to epoch 1"),
        (lambda d: d.update(ranks=[[6, 3]]), "not in the base"),
        (lambda d: d.update(ranks=[[0, 0]]), "not in the base"),
        (lambda d: d.update(ranks=[[0, "x"]]), "bad rank item"),
        (lambda d: d["plan"].update(epoch=9), "epochs? .*differ"),
    ],
)
def test_a_delta_that_does_not_fit_its_base_is_refused(edit, match: str) -> None:  # noqa: ANN001
    base, new = _changes()["a worker exits"]
    doc = json.loads(encode_delta(base, new))
    edit(doc)
    with pytest.raises(ValueError, match=match):
        apply_delta(base, json.dumps(doc))


@pytest.mark.parametrize("text", [b"", b"[]", b"{}", b"\xff", b'{"base": 1}'])
def test_what_is_not_a_delta(text: bytes) -> None:
    with pytest.raises(ValueError):
        delta_epochs(text)


def test_at_100000_ranks_a_worker_exit_is_a_few_hundred_bytes() -> None:
    """12,500 hosts × 8 whose workers joined interleaved (as ready workers register): the plan
    after one exit is hundreds of KB, its delta a few hundred bytes."""
    members = synthetic_members(12_500, 8)
    random.Random(3).shuffle(members)
    members = [replace(m, order=i) for i, m in enumerate(members)]
    base = _dp(None, members, mbs=200_000)
    new = _dp(base, [m for m in members if m.worker_id != members[5_000].worker_id], mbs=200_000)
    whole, delta = len(planwire.encode(new).encode()), len(encode_delta(base, new).encode())
    assert whole > 100_000 and delta < 1_000, (whole, delta)
    assert apply_delta(base, encode_delta(base, new)) == new
