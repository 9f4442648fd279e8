"""HESSO's pure parts (``train.prune.method: hesso``): its schedule, which groups each period
picks, the linear shrinking that reaches exactly zero on a period's last step, the marks a state
keeps, its settings; and through the pruner, the same bits on pipeline stages, on sharded data
parallelism and alone. Also the one line a run that ends below its target prints."""

from __future__ import annotations

import math

import pytest
import torch

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.prune import dhspg, hesso
from elaswave.prune.hesso import HESSO, Schedule
from tests.unit.test_prune_units import MODELS, _every_cut_matches_the_whole, _stage_problem

F64 = torch.float64


def _stats(xn: list[float], xd: list[float] | None = None) -> dhspg.Stats:
    n = len(xn)
    t = lambda v: torch.tensor(v, dtype=F64)  # noqa: E731
    return dhspg.Stats(t(xn), t(xd or [0.0] * n), t([1.0] * n), t([0.0] * n))


@pytest.mark.parametrize(
    ("start", "steps", "periods", "step", "where"),
    [
        (5, 6, 3, 4, None),  # before the first period
        (5, 6, 3, 5, (1, 0)),  # the first period's first step
        (5, 6, 3, 6, (1, 1)),  # ... its last
        (5, 6, 3, 7, (2, 0)),
        (5, 6, 3, 10, (3, 1)),  # the last period's last step: end
        (5, 6, 3, 11, None),  # after it
        (1, 7, 2, 7, None),  # 7 steps in 2 periods of 3: step 7 is a plain step
        (1, 1, 1, 1, (1, 0)),  # the reference's default: one period of one step
    ],
)
def test_the_schedule_cuts_the_pruning_steps_into_periods(
    start: int, steps: int, periods: int, step: int, where: tuple[int, int] | None
) -> None:
    s = Schedule.of(start, steps, periods)
    assert s.at(step) == where
    assert s.end == start + periods * (steps // periods) - 1


@pytest.mark.parametrize(
    ("groups", "target", "periods", "expected"),
    [
        (10, 0.5, 1, [5]),
        (10, 0.5, 2, [2, 5]),  # an even share, the rest in the later periods
        (96, 0.3, 1, [29]),  # ceil: at least the target (28.8 groups)
        (100, 0.3, 3, [10, 20, 30]),  # 0.3 * 100 is 30.000000000000004: still 30
        (5, 0.9, 1, [4]),  # never every group
        (3, 0.5, 5, [0, 0, 1, 1, 2]),  # more periods than groups: some pick none
        (1, 0.5, 1, [0]),
    ],
)
def test_each_period_picks_its_share_of_the_target(
    groups: int, target: float, periods: int, expected: list[int]
) -> None:
    got = [hesso.quota(groups, target, periods, k) for k in range(1, periods + 1)]
    assert got == expected


@pytest.mark.parametrize(
    ("marks", "period", "buckets", "expected"),
    [
        # 6 groups, target 0.5 in 3 periods: one more group each period, the lowest score
        ([0, 0, 0, 0, 0, 0], 1, (6,), [0, 0, 0, 1, 0, 0]),
        ([0, 0, 0, 1, 0, 0], 2, (6,), [0, 2, 0, 1, 0, 0]),  # among those not picked yet
        ([0, 2, 0, 1, 0, 0], 3, (6,), [0, 2, 0, 1, 3, 0]),  # ties (0.3): the lower index
        ([0, 2, 0, 1, 3, 0], 2, (6,), [0, 2, 0, 1, 0, 0]),  # a redone period picks again
        # uniform: each of two families of three picks its own share (quota 2 * k // 3)
        ([0, 0, 0, 0, 0, 0], 2, (3, 3), [0, 2, 0, 2, 0, 0]),
    ],
)
def test_a_period_picks_the_lowest_saliency_among_the_groups_not_picked_yet(
    marks: list[int], period: int, buckets: tuple[int, ...], expected: list[int]
) -> None:
    score = torch.tensor([0.9, 0.2, 0.5, 0.1, 0.3, 0.3], dtype=F64)
    out = hesso.pick(score, torch.tensor(marks), period, target=0.5, periods=3, buckets=buckets)
    assert out.tolist() == expected


def test_the_saliency_is_the_mean_of_five_normalised_criteria() -> None:
    """The reference's default: magnitude, mean magnitude, cosine + 1, |<x, d>|, <x, d>^2 / 2,
    each over its norm across the groups, weighted 0.2."""
    xn, xd, dn = [3.0, 1.0, 0.0], [2.0, -1.0, 0.0], [1.0, 2.0, 1.0]
    stats = dhspg.Stats(*(torch.tensor(v, dtype=F64) for v in (xn, xd, dn, [0.0] * 3)))
    sizes = torch.tensor([2.0, 4.0, 2.0], dtype=F64)
    terms = [
        xn,
        [x / (s + 1e-6) for x, s in zip(xn, sizes.tolist(), strict=True)],
        [d / (x + 1e-8) / (n + 1e-8) + 1 for x, d, n in zip(xn, xd, dn, strict=True)],
        [abs(d) for d in xd],
        [0.5 * d * d for d in xd],
    ]
    norms = [math.sqrt(sum(v * v for v in t) + 1e-8) + 1e-8 for t in terms]
    expected = [sum(0.2 * t[g] / n for t, n in zip(terms, norms, strict=True)) for g in range(3)]
    got = hesso.saliency(stats, sizes)
    assert got.tolist() == pytest.approx(expected, rel=1e-12)
    assert int(got.argmin()) == 2  # a zero group is the least salient


@pytest.mark.parametrize("length", [1, 2, 3, 7])
def test_a_period_shrinks_its_groups_linearly_to_exactly_zero(length: int) -> None:
    """Updates that change nothing (``h == x``): after ``j + 1`` steps of the period a picked
    group is ``(length - 1 - j) / length`` of itself, and exactly zero (cleared) after the
    last; the other groups are left bit for bit, and the group stays zero in the next period."""
    method = HESSO(0.5, Schedule.of(3, 2 * length, 2))
    stats = _stats([1.0, 2.0, 3.0, 4.0])  # group 0 is picked first, group 1 next
    sizes = torch.ones(4, dtype=F64)
    x = torch.tensor([[1.0, -1.0], [2.0, 2.0], [3.0, 3.0], [4.0, -4.0]])
    group = torch.arange(4).unsqueeze(1)
    marks, taken_at = torch.zeros(0, dtype=torch.int64), 0
    for j in range(length):
        choice = method.decide(3 + j, stats, marks=marks, taken_at=taken_at, sizes=sizes, lr=0.1)
        marks, taken_at = choice.marks, choice.taken_at
        x = choice.decisions.apply(x, x, group)
        assert torch.equal(x[2:], torch.tensor([[3.0, 3.0], [4.0, -4.0]]))
        if j < length - 1:
            assert x[0].tolist() == pytest.approx([(length - 1 - j) / length * v for v in (1, -1)])
            assert not choice.decisions.cleared.any()
    assert (marks.tolist(), taken_at) == ([1, 0, 0, 0], 3)
    assert choice.decisions.cleared.tolist() == [True, False, False, False]
    assert x[0].tolist() == [0.0, 0.0] and not torch.signbit(x[0]).any()
    nxt = method.decide(3 + length, _stats([0.0, 2.0, 3.0, 4.0]), marks=marks,
                        taken_at=taken_at, sizes=sizes, lr=0.1)  # fmt: skip
    assert nxt.marks.tolist() == [1, 2, 0, 0] and nxt.taken_at == 3 + length
    assert nxt.decisions.cleared.tolist()[0]  # the first period's group stays zero
    after = method.decide(3 + 2 * length, stats, marks=nxt.marks, taken_at=nxt.taken_at,
                          sizes=sizes, lr=0.1)  # fmt: skip
    assert after.decisions.cleared.tolist() == [True, True, False, False]
    assert after.decisions.keep is None  # after the periods: plain steps, the zeros kept


@pytest.mark.parametrize(
    ("taken_at", "step", "marks", "taken"),
    [
        (7, 9, [1, 2, 0, 2], 7),  # both periods begun by step 9: kept
        (7, 6, [1, 0, 0, 0], 5),  # a state at step 6: the second period's picks dropped
        (7, 4, [], 0),  # before the first period: none
        (5, 8, [1, 2, 0, 2], 5),  # marks of the first period only (a later one is stale)
        (0, 9, [], 0),
    ],
)
def test_a_state_keeps_the_picks_of_the_periods_begun_by_its_step(
    taken_at: int, step: int, marks: list[int], taken: int
) -> None:
    method = HESSO(0.5, Schedule.of(5, 4, 2))  # periods begin at steps 5 and 7
    got, at = method.kept(torch.tensor([1, 2, 0, 2]), taken_at, step)
    expect = [m if m <= 1 else 0 for m in marks] if taken == 5 else marks
    assert (got.tolist(), at) == (expect, taken)


@pytest.mark.parametrize(
    ("prune", "message"),
    [
        ({"method": "hesso", "pruning_steps": 0}, "pruning_steps must be >= 1"),
        ({"method": "hesso", "pruning_periods": 0}, "pruning_periods must be >= 1"),
        ({"method": "hesso", "pruning_steps": 2.5}, "pruning_steps' must be an integer"),
        ({"method": "hesso", "pruning_steps": 4, "pruning_periods": 5},
         r"pruning_periods must be at most pruning_steps \(4\)"),
        ({"method": "hesso", "epsilon": 0.9}, "epsilon is a setting of method dhspg"),
        ({"method": "hesso", "lmbda": 0.1}, "lmbda is a setting of method dhspg"),
        ({"method": "hesso", "partition_step": 1}, "partition_step is a setting of method dhspg"),
        ({"pruning_steps": 10}, "pruning_steps is a setting of method hesso, not of dhspg"),
    ],
)  # fmt: skip
def test_bad_hesso_settings_are_one_line_errors(prune: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        JobConfig.from_dict({"train": {"prune": prune}})
    assert "\n" not in str(info.value)


def test_hesso_settings_default_to_the_reference() -> None:
    p = JobConfig.from_dict({"train": {"prune": {"method": "hesso", "target_sparsity": 0.97}}})
    assert p.train.prune is not None  # a tolerance (DHSPG's) would not fit: not read
    resolved = p.train.prune.resolved("adamw")
    assert (resolved.pruning_steps, resolved.pruning_periods) == (1, 1)
    assert resolved.lmbda is None


@pytest.mark.parametrize(
    ("prune", "sparsity", "line"),
    [
        ({"target_sparsity": 0.5}, 0.5, None),
        ({"target_sparsity": 0.5}, 0.12,
         "train.prune: ended at group sparsity 0.12, below its target 0.50: raise "
         "train.prune.epsilon (0.0 now; 0.9-0.95 is usual for short runs) or train more steps"),
        ({"target_sparsity": 0.5, "epsilon": 0.95}, None,
         "train.prune: ended at group sparsity 0.00, below its target 0.50: raise "
         "train.prune.lmbda (its optimizer's default) or train more steps"),
        ({"method": "hesso", "target_sparsity": 0.3, "start_step": 11, "pruning_steps": 100},
         0.1, "train.prune: ended at group sparsity 0.10, below its target 0.30: its periods "
         "end at step 110, after the run's last step 40: lower train.prune.pruning_steps (100 "
         "now) or train.prune.start_step, or train more steps"),
        ({"method": "hesso", "target_sparsity": 0.3}, 29 / 96, None),
    ],
)  # fmt: skip
def test_a_run_below_its_target_says_so_in_one_line(
    prune: dict, sparsity: float | None, line: str | None
) -> None:
    p = JobConfig.from_dict({"train": {"prune": prune}}).train.prune
    assert p is not None
    assert p.shortfall(sparsity, last_step=40) == line


# -- through the pruner: the same bits wherever the groups are held ----------------------------

HESSO_PRUNE = {"method": "hesso", "start_step": 1, "target_sparsity": 0.5, "pruning_steps": 4,
               "pruning_periods": 2}  # fmt: skip


@pytest.mark.parametrize("name", ["mlp", "llama-gqa"])
def test_pipeline_stages_prune_exactly_as_the_whole_model(name: str) -> None:
    """HESSO on stages cut anywhere (each stage's sums added over the stages) gives the whole
    model's parameters and marks bit for bit, on a period's first step (a pick), on its shrinking
    step and on the step that zeroes the picked groups."""
    cfg = JobConfig.from_dict({"model": MODELS[name], "train": {"prune": HESSO_PRUNE}})
    pruner, starts, old, new = _stage_problem(cfg, name)
    for step in (1, 2, 3):
        pruner = _every_cut_matches_the_whole(pruner, starts, old, new, step)
    # the second period's first step: the first period's groups zero, the next ones shrinking
    first = hesso.quota(pruner.groups, 0.5, 2, 1)
    assert pruner.last["prune_zero_groups"] == first
    assert pruner.last["prune_shrinking"] == hesso.quota(pruner.groups, 0.5, 2, 2) - first


@pytest.mark.parametrize(("world", "zero"), [(2, 1), (3, 3)])
def test_sharded_data_parallelism_prunes_exactly_as_one_rank_alone(world: int, zero: int) -> None:
    """8 steps of HESSO (two periods of 3 steps from step 2): ZeRO-1 and ZeRO-3 reach one
    replicated rank's state bit for bit (float64 reduction), and the picked groups are zero."""
    from tests.unit.test_strategies import _run

    prune = {"method": "hesso", "start_step": 2, "target_sparsity": 0.5, "pruning_steps": 6,
             "pruning_periods": 2}  # fmt: skip
    alone = _run(1, 0, 8, prune=prune, lr=0.01)[0]
    unpruned = _run(1, 0, 8, lr=0.01)[0]
    assert int((alone == 0).sum()) > int((unpruned == 0).sum()) + 100  # groups went to zero
    assert all(torch.equal(w, alone) for w in _run(world, zero, 8, prune=prune, lr=0.01))
