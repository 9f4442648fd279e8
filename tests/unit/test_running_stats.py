"""BatchNorm's running statistics as train state (runtime/runningstats.py): captured per
micro-batch, summed over the ranks that ran them, folded in micro-batch order."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from elaswave.runtime.runningstats import RunningStats
from elaswave.runtime.workload.base import KeyedLayers

MICRO = 4


def _model(momentum: float | None = 0.1) -> KeyedLayers:
    torch.manual_seed(0)
    layers = [
        nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3, momentum=momentum), nn.ReLU()),
        nn.Sequential(nn.Flatten(), nn.Linear(3 * 4 * 4, 5)),  # no norm
        nn.Sequential(nn.BatchNorm1d(5, momentum=momentum), nn.Linear(5, 2)),
    ]
    return KeyedLayers(layers, seed=1)


def _batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(6, 1, 6, 6, generator=gen) * (i + 1) + i for i in range(MICRO)]


def _rank(model: KeyedLayers) -> RunningStats:
    stats = RunningStats.of(None, model, MICRO, device=torch.device("cpu"))  # type: ignore[arg-type]
    assert stats is not None
    model.stats = stats
    for index, layer in enumerate(model.layers):
        stats.bind(index, layer)
    model.train()
    return stats


def _forward(model: KeyedLayers, step: int, ids: list[int]) -> None:
    for mb in ids:
        model(_batches()[mb], step, mb).sum().backward()


def _plain(momentum: float | None) -> nn.Module:
    """The same layers run as one process runs them: BatchNorm's own updates, in order."""
    model = _model(momentum)
    model.train()
    for x in _batches():
        for layer in model.layers:
            x = layer(x)
    return model


@pytest.mark.parametrize("momentum", [0.1, None])
def test_ranks_sharing_a_step_end_with_one_process_statistics(momentum: float | None) -> None:
    """Two ranks run micro-batches {0, 3} and {1, 2}; the sum of their rows, folded, is what
    one rank running all four gives, bit for bit, and what BatchNorm itself keeps (to rounding:
    its kernel adds in another order)."""
    alone, (a, b) = _model(momentum), (_model(momentum), _model(momentum))
    one, ra, rb = _rank(alone), _rank(a), _rank(b)
    _forward(alone, 1, [0, 1, 2, 3])
    _forward(a, 1, [0, 3])
    _forward(b, 1, [2, 1])
    every = dict.fromkeys(range(3), [0, 1, 2, 3])
    rows = one.contribution(1, every)
    shared = ra.contribution(1, dict.fromkeys(range(3), [0, 3])) + rb.contribution(
        1, dict.fromkeys(range(3), [1, 2])
    )
    assert torch.equal(rows, shared)
    for stats in (one, ra, rb):
        stats.commit(1, shared.clone())
    assert torch.equal(one.values, ra.values) and torch.equal(ra.values, rb.values)
    plain = _plain(momentum)
    pairs = [(alone.layers[i][j], plain.layers[i][j]) for i, j in ((0, 1), (2, 0))]
    for layer, theirs in pairs:
        torch.testing.assert_close(layer.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(layer.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
        assert int(layer.num_batches_tracked) == MICRO == int(theirs.num_batches_tracked)
        assert layer.momentum == momentum  # restored after each capture


def test_a_forward_of_no_training_step_leaves_the_statistics_alone() -> None:
    model = _model()
    stats = _rank(model)
    before = stats.saved()
    _forward(model, 0, [0])  # a timing probe: step 0
    model.eval()
    model(_batches()[1], -2, 0)  # an evaluation
    assert torch.equal(stats.saved(), before)
    with pytest.raises(RuntimeError, match="micro-batch 0, layer 0 were not captured"):
        stats.contribution(1, {0: [0]})


def test_a_norm_that_did_not_run_is_not_folded() -> None:
    """A micro-batch whose rows say a norm did not run (a skipped block) leaves it as it was."""
    model = _model()
    stats = _rank(model)
    _forward(model, 1, [0, 1, 2, 3])
    rows = stats.contribution(1, {0: [0, 1, 2, 3], 2: [0, 1, 2, 3]})
    first = model.layers[0][1]
    rows[:, stats.values.numel()] = 0.0  # the first norm's flag: it never ran
    mean = first.running_mean.clone()
    stats.commit(1, rows)
    assert torch.equal(first.running_mean, mean) and int(first.num_batches_tracked) == 0
    assert int(model.layers[2][0].num_batches_tracked) == MICRO


def test_saved_and_adopted_round_trip_and_a_wrong_size_is_refused() -> None:
    model = _model()
    stats = _rank(model)
    _forward(model, 1, [0, 1, 2, 3])
    stats.commit(1, stats.contribution(1, dict.fromkeys(range(3), [0, 1, 2, 3])))
    other = copy.deepcopy(_model())
    theirs = _rank(other)
    theirs.adopt(stats.saved(), 1)
    assert torch.equal(other.layers[2][0].running_var, model.layers[2][0].running_var)
    assert int(other.layers[0][1].num_batches_tracked) == MICRO and theirs.step == 1
    with pytest.raises(ValueError, match="have 3 values, this model 18"):
        theirs.adopt(torch.zeros(3, dtype=torch.float64), 1)
    with pytest.raises(ValueError, match="holds no running statistics"):
        theirs.adopt(None, 1)
