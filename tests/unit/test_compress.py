"""Block-wise int8 of the inter-host hop (elaswave.runtime.comm.compress): pure, no I/O."""

from __future__ import annotations

import math

import pytest
import torch

from elaswave.config.train import TrainConfig
from elaswave.errors import ConfigError
from elaswave.runtime.comm.compress import BLOCK, dequantize, quantize, wire_bytes


def _round_trip(values: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    codes, scale = quantize(values, block)
    return dequantize(codes, scale, values.numel(), dtype=values.dtype)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),  # a block of zeros: scale 0, no division by it
        ([127.0, -127.0, 1.0, 0.0], [127.0, -127.0, 1.0, 0.0]),  # on the grid: exact
        ([2.54, 1.26, -0.009], [2.54, 1.26, 0.0]),  # -0.009 is under half a step (0.01)
        ([1.0, 0.5 + 1e-9], [1.0, 64 / 127]),  # rounded to the nearest step
    ],
)
def test_round_trip_table(values: list[float], expected: list[float]) -> None:
    got = _round_trip(torch.tensor(values, dtype=torch.float64))
    assert got.tolist() == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_each_value_within_half_a_step_of_its_block(n: int, dtype: torch.dtype) -> None:
    values = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=dtype) * 3
    values[n // 2] *= 100  # one large value: its block's step grows, the others' do not
    got = _round_trip(values, block=64)
    assert got.dtype == dtype and got.numel() == n
    for lo in range(0, n, 64):
        block = values[lo : lo + 64]
        step = float(block.abs().max()) / 127
        assert float((got[lo : lo + 64] - block).abs().max()) <= step / 2 * (1 + 1e-6) + 1e-12


def test_non_finite_values_keep_their_block_non_finite() -> None:
    values = torch.ones(2 * BLOCK)
    values[3] = math.nan
    values[BLOCK + 7] = math.inf
    got = _round_trip(values)
    assert not torch.isfinite(got[:BLOCK]).any() and not torch.isfinite(got[BLOCK:]).all()


def test_the_wire_carries_a_quarter_of_float32() -> None:
    assert wire_bytes(1) == BLOCK + 4  # a whole block and its scale
    assert wire_bytes(1_000_000) / (4 * 1_000_000) == pytest.approx(0.254, abs=0.001)
    codes, scale = quantize(torch.randn(1000))
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32
    assert codes.numel() + 4 * scale.numel() == wire_bytes(1000)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"grad_compress": "fp8"}, "train.grad_compress must be off or int8"),
        ({"grad_compress": "int8", "hierarchy": "flat"}, "needs train.hierarchy auto"),
    ],
)
def test_config_errors(fields: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**fields)
    assert fragment in str(info.value) and "\n" not in str(info.value)
