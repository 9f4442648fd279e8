"""The graph analysis's pure parts (tables), and the engine's traced families built on it: a
residual stream across layers found, shrunk exactly; a LayerNorm over the channels ends a
family there (the layers keep their own classes)."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from torch import nn

from elaswave.prune.compress import kept_groups, shrink
from elaswave.prune.graph import TraceError
from elaswave.prune.groups import flat_index, traced_families
from elaswave.prune.rules import block_units, reshaped_axis
from elaswave.runtime.optim import FlatParams
from elaswave.runtime.workload.base import KeyedLayers
from tests.unit.test_zig import Branching, NextBlock, settle


@pytest.mark.parametrize(
    ("source", "shape", "axis", "expected"),
    [
        ((2, 8, 4, 4), (2, 128), 1, (1, 16)),  # flatten(1): 16 positions per channel
        ((2, 8, 4, 4), (2, 8, 16), 1, (1, 1)),  # the positions merged, the channels whole
        ((2, 8, 1, 1), (2, 8), 1, (1, 1)),  # a pooled map's view(n, -1)
        ((2, 16, 8), (32, 8), 2, (1, 1)),  # tokens merged into the batch
        ((2, 6, 8), (2, 6, 2, 4), 2, None),  # channels split into heads
        ((2, 8), (16,), 1, None),  # the batch merged into the channels
        ((2, 8, 4), (2, 4, 8), 1, None),  # a reshape that is no view of the channels
    ],
)
def test_a_reshape_keeps_the_channels_only_when_they_stay_whole(
    source: tuple, shape: tuple, axis: int, expected: tuple | None
) -> None:
    assert reshaped_axis(source, shape, axis) == expected


@pytest.mark.parametrize(
    ("per", "channels", "expected"),
    [
        (Fraction(1), 4, 4),  # one channel a unit: a norm group of 4 is 4 units
        (Fraction(2), 4, 2),
        (Fraction(4), 2, 1),  # a unit already spans whole blocks
        (Fraction(3, 2), 3, 2),
        (Fraction(1, 2), 2, 4),  # half a channel a unit
    ],
)
def test_a_block_of_channels_is_the_fewest_whole_units(
    per: Fraction, channels: int, expected: int
) -> None:
    assert block_units(per, channels) == expected


class Add(nn.Module):
    """``x + block(x)``: a layer whose input is the stream of the layer before it."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(8, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
            nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.block(x))


def _layers() -> KeyedLayers:
    torch.manual_seed(0)
    stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3))
    return KeyedLayers([settle(stem), settle(Add()), settle(head)], seed=0)


def test_a_stream_across_layers_is_one_family_and_shrinks_exactly() -> None:
    model = _layers().eval()
    x = torch.randn(2, 3, 8, 8)
    families = traced_families(model, (x,))
    assert [(f.name, f.count) for f in families] == [("layers.0.0", 8), ("layers.1.block.0", 4)]
    assert {m.param for m in families[0].members} >= {(0, "0.weight"), (1, "block.3.weight")}
    flat = FlatParams(model)
    with torch.no_grad():
        for f in families:
            flat.data[flat_index(f, model)[1::2]] = 0.0
        sparse = model(x, 0, 0)
        kept = kept_groups(families, model, flat.data, same_width=False)
        before = sum(p.numel() for p in model.parameters())
        shrink(model, families, kept)
        assert sum(p.numel() for p in model.parameters()) < before
        torch.testing.assert_close(model(x, 0, 0), sparse, rtol=0, atol=1e-5)


def test_a_layernorm_over_the_channels_ends_the_family_in_the_engine() -> None:
    model = KeyedLayers([settle(NextBlock())], seed=0)
    families = traced_families(model, (torch.randn(2, 3, 12, 12),))
    assert [(f.name, f.count) for f in families] == [("layers.0.mlp.2", 16)]


def test_the_engine_reports_a_trace_failure_with_its_cause() -> None:
    with pytest.raises(TraceError, match="train.prune: the model does not trace with torch.fx"):
        traced_families(KeyedLayers([Branching()], seed=0), (torch.randn(2, 3),))
