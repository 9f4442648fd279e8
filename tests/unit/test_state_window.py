"""A pipeline rank's window of layers (``TrainState.set_window``): it allocates the state of the
layers it needs and nothing else, and what it keeps is what the whole model would hold."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elaswave.config import JobConfig
from elaswave.runtime.optim import Spans
from elaswave.runtime.state import TrainState
from elaswave.runtime.strategies.base import nbytes
from elaswave.runtime.strategies.pipeline.stagegrads import chunks
from elaswave.runtime.strategies.pipeline.stagestate import hull


def _cfg(pp: int, zero: int = 0, **train: Any) -> JobConfig:
    return JobConfig.from_dict(
        {
            "pp": pp,
            "zero": zero,
            "model": {
                "source": "module",
                "factory": "tests.unit.test_strategies:tied_ends",
                "args": {"features": 8, "hidden": 16, "depth": 3, "dropout": 0.0},
            },
            "train": {"global_batch": 8, "micro_batch_size": 2, "seed": 7, **train},
        }
    )


def _whole() -> TrainState:
    return TrainState.build(_cfg(pp=1))


def test_a_pipeline_rank_allocates_nothing_before_its_first_plan() -> None:
    st = TrainState.build(_cfg(pp=2))
    assert st.window == range(0) and st.flat.numel == 0 and st.flat.total == _whole().flat.total
    assert all(p.device.type == "meta" for p in st.model.parameters())
    assert nbytes(st.flat.data, st.opt.exp_avg, st.opt.exp_avg_sq) == 0


@pytest.mark.parametrize("window", [range(0, 1), range(1, 3), range(2, 5), range(0, 5)])
def test_a_window_holds_the_whole_models_values_of_its_layers(window: range) -> None:
    whole, st = _whole(), TrainState.build(_cfg(pp=2))
    st.set_window(window)
    seg = st.segments
    span = slice(seg[window.start][0], sum(seg[window.stop - 1]))
    assert st.flat.base == span.start and st.flat.numel == span.stop - span.start
    assert st.params[span].equal(whole.flat.data[span])  # built alone, the same values
    assert nbytes(st.flat.data) == 4 * (span.stop - span.start)
    for i, layer in enumerate(st.model.layers):
        devices = {p.device.type for p in layer.parameters()}
        assert devices == ({"cpu"} if i in window else {"meta"}), i


def test_moving_the_window_keeps_what_stays_and_frees_what_leaves() -> None:
    st = TrainState.build(_cfg(pp=2))
    st.set_window(range(0, 3))
    seg = st.segments
    stays = slice(seg[1][0], sum(seg[2]))
    st.params[stays].fill_(1.5)
    st.exp_avg[stays].fill_(2.5)
    st.exp_avg_sq[stays].fill_(3.5)
    st.set_window(range(1, 5))
    assert st.params[stays].eq(1.5).all() and st.exp_avg[stays].eq(2.5).all()
    assert st.exp_avg_sq[stays].eq(3.5).all()
    entered = slice(seg[3][0], sum(seg[4]))
    assert st.params[entered].equal(_whole().flat.data[entered])  # initial values
    assert st.exp_avg[entered].eq(0).all()
    assert {p.device.type for p in st.model.layers[0].parameters()} == {"meta"}
    with pytest.raises(IndexError, match="not held here"):
        st.params[slice(seg[0][0], seg[0][0] + 1)]  # layer 0 left: never a silent empty view
    # the module's parameters are views of the flat buffer: training writes reach it
    weight = next(st.model.layers[1].parameters())
    weight.data.fill_(9.0)
    assert st.params[slice(seg[1][0], seg[1][0] + weight.numel())].eq(9.0).all()


def test_zero_inside_stages_allocates_no_moments() -> None:
    st = TrainState.build(_cfg(pp=2, zero=1))
    st.set_window(range(1, 3))
    assert st.opt.exp_avg.numel() == 0 and st.flat.numel > 0


def test_weight_decay_groups_are_cut_to_the_window() -> None:
    train = {"weight_decay": 0.1, "param_groups": [{"params": ["*.bias"], "weight_decay": 0.0}]}
    whole = TrainState.build(_cfg(pp=1, **train))
    st = TrainState.build(_cfg(pp=2, **train))
    st.set_window(range(1, 4))
    seg = st.segments
    span = slice(seg[1][0], sum(seg[3]))
    hyper, full = st.opt.hyper, whole.opt.hyper
    assert full.groups is not None and hyper.groups is not None
    assert hyper.groups.numel() == st.flat.numel  # the window's elements only
    assert hyper.groups_of(span).equal(full.groups_of(span))
    assert set(full.groups.tolist()) == {0, 1}


def test_tied_gradients_are_summed_only_where_both_copies_are_held() -> None:
    st = _whole()
    ((a, b),) = st.ties
    grads = torch.zeros(st.flat.numel)
    grads[a], grads[b] = 1.0, 2.0
    st.tie_gradients(grads)
    assert grads[a].eq(3.0).all() and grads[b].eq(3.0).all()
    stage = TrainState.build(_cfg(pp=2))
    stage.set_window(range(0, 2))  # the first copy only: left as it is
    local = torch.zeros(stage.flat.numel)
    stage.flat.at(local)[a].fill_(1.0)
    stage.tie_gradients(local)
    assert stage.flat.at(local)[a].eq(1.0).all()


def test_spans_translate_offsets_and_refuse_what_they_do_not_hold() -> None:
    s = Spans(torch.arange(10.0), base=100)
    assert s[slice(102, 105)].tolist() == [2.0, 3.0, 4.0]
    assert s.holds(100, 110) and not s.holds(99, 101) and not s.holds(105, 111)
    assert s[slice(50, 50)].numel() == 0  # an empty range is held anywhere
    for outside in (slice(99, 101), slice(105, 111)):
        with pytest.raises(IndexError):
            s[outside]


@pytest.mark.parametrize(
    ("ranges", "expected"),
    [
        ((), range(0)),
        ((None, range(0)), range(0)),
        ((range(2, 4),), range(2, 4)),
        ((range(2, 4), None), range(2, 4)),
        ((range(2, 4), range(0, 1)), range(0, 4)),
        ((range(3, 6), range(1, 4), range(0)), range(1, 6)),
    ],
)
def test_hull(ranges: tuple[range | None, ...], expected: range) -> None:
    assert hull(*ranges) == expected


@pytest.mark.parametrize(
    ("total", "size", "lo", "hi", "expected"),
    [
        (10, 4, 0, 10, [(0, 4, 0, 4), (4, 8, 4, 8), (8, 10, 8, 10)]),
        (10, 4, 3, 6, [(0, 4, 3, 4), (4, 8, 4, 6), (8, 10, 8, 8)]),
        (10, 4, 0, 0, [(0, 4, 0, 0), (4, 8, 4, 4), (8, 10, 8, 8)]),  # an empty window
        (8, 4, 4, 8, [(0, 4, 0, 0), (4, 8, 4, 8)]),
        (3, 4, 1, 2, [(0, 3, 1, 2)]),
    ],
)
def test_a_migrations_reduction_chunks(
    total: int, size: int, lo: int, hi: int, expected: list[tuple[int, int, int, int]]
) -> None:
    """Every rank walks the same chunks of the whole model (the same collectives in the same
    order) and brings only the part its window holds."""
    assert chunks(total, size, lo, hi=hi) == expected
