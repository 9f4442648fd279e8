import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from elaswave.runtime.workload import call_layer
from elaswave.runtime.workload.base import layer_seed
from elaswave.runtime.workload.rng import stream_seed


def test_stream_seed_matches_pinned_values() -> None:
    assert stream_seed(0, 1, 0, layer=0, site=0) == 8980328576395037255
    assert stream_seed(1234, 7, 3, layer=2, site=1) == 4741311632509528395


def test_stream_seed_stable_across_processes() -> None:
    code = (
        "from elaswave.runtime.workload.rng import stream_seed; "
        "print(stream_seed(1234, 7, 3, layer=2, site=1))"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root, env=env
    ).stdout
    assert int(out) == stream_seed(1234, 7, 3, layer=2, site=1)


def test_stream_seed_default_site_is_zero() -> None:
    assert stream_seed(5, 2, 1, layer=3) == stream_seed(5, 2, 1, layer=3, site=0)


@pytest.mark.parametrize("seed", [0, 1, 2**62, 2**80, -3])
def test_stream_seed_range(seed: int) -> None:
    value = stream_seed(seed, 1, 2, layer=3, site=4)
    assert 0 <= value < 2**63


def test_stream_seed_distinct_keys() -> None:
    keys = [
        (s, st, mb, ly, si)
        for s in range(3)
        for st in range(1, 4)
        for mb in range(4)
        for ly in range(4)
        for si in range(3)
    ]
    seeds = {stream_seed(s, st, mb, layer=ly, site=si) for s, st, mb, ly, si in keys}
    assert len(seeds) == len(keys)


def test_stream_seed_not_symmetric_in_fields() -> None:
    assert stream_seed(1, 2, 3, layer=4, site=5) != stream_seed(5, 4, 3, layer=2, site=1)
    assert stream_seed(0, 1, 2, layer=0) != stream_seed(0, 2, 1, layer=0)


class _Noise(torch.nn.Module):
    """A user layer that draws from the default generator (no keys of its own)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape) + torch.nn.functional.dropout(torch.ones(x.shape), 0.5)


def _draw(seed: int, step: int, mb: int, layer: int) -> torch.Tensor:
    x = torch.zeros(16)
    return call_layer(_Noise(), x, seed=seed, step=step, microbatch=mb, index=layer)


def test_a_layer_draws_the_same_numbers_for_the_same_key() -> None:
    first = _draw(7, 3, 2, 1)
    torch.rand(100)  # whatever ran in between
    assert torch.equal(first, _draw(7, 3, 2, 1))


def test_a_layer_draws_other_numbers_for_other_keys() -> None:
    base = _draw(7, 3, 2, 1)
    for key in [(8, 3, 2, 1), (7, 4, 2, 1), (7, 3, 3, 1), (7, 3, 2, 2)]:
        assert not torch.equal(base, _draw(*key))


class _DeviceNoise(torch.nn.Module):
    """A layer that draws on its input's device, and on the host."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        host = torch.rand(4).to(x.device)
        return torch.nn.functional.dropout(x + 1.0, 0.5) + torch.rand_like(x) + host.sum()


def _as_if_manual_seed(device: torch.device) -> None:
    """call_layer seeds only the generators its layer draws from: the numbers are those the
    layer draws after ``torch.manual_seed`` of the same key (which seeds every generator)."""
    seed = layer_seed(11, 5, 3, layer=2)  # (seed, step, micro-batch, layer)
    x = torch.zeros(64, device=device)
    torch.rand(7, device=device), torch.rand(3)  # whatever ran before
    got = call_layer(_DeviceNoise(), x, seed=11, step=5, microbatch=3, index=2)
    torch.manual_seed(seed)
    want = _DeviceNoise()(x)
    assert torch.equal(got, want)


def test_a_layer_on_the_cpu_draws_what_manual_seed_gives_it() -> None:
    _as_if_manual_seed(torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_layer_on_a_gpu_draws_what_manual_seed_gives_it() -> None:
    _as_if_manual_seed(torch.device("cuda", torch.cuda.current_device()))
