"""The checksum an accelerator computes where the state lives (run here on the CPU: the same
integer arithmetic on any device): equal bytes agree, any flipped bit or swapped word shows."""

from __future__ import annotations

import pytest
import torch

from elaswave.runtime.integrity import checksums
from elaswave.runtime.integrity.checksums import device_checksum


def _state(n: int = 5000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7))


def test_equal_bytes_agree_whatever_the_layout() -> None:
    t = _state()
    assert device_checksum(t) == device_checksum(t.clone())
    assert device_checksum(t) == device_checksum(t.view(50, 100))  # bytes, not shape
    assert device_checksum(t[:3000], t[3000:]) == device_checksum(t)  # one stream of words
    assert 0 <= device_checksum(t) < checksums.PRIME


@pytest.mark.parametrize("position", [0, 1, 777, 4999])
@pytest.mark.parametrize("bit", [0, 13, 22, 31])  # mantissa, exponent and sign bits
def test_every_flipped_bit_shows(position: int, bit: int) -> None:
    t = _state()
    flipped = t.clone()
    words = flipped.view(torch.int32)
    words[position] ^= torch.tensor(1 << bit if bit < 31 else -(1 << 31), dtype=torch.int32)
    assert not torch.equal(t, flipped)
    assert device_checksum(flipped) != device_checksum(t)


def test_swapped_words_show() -> None:
    t = _state()
    swapped = t.clone()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert device_checksum(swapped) != device_checksum(t)


def test_many_chunks_and_odd_byte_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checksums, "CHUNK", 64)  # many chunks: positions carry across them
    t = _state(1000)
    whole = device_checksum(t)
    t2 = t.clone()
    t2[999] += 1.0
    assert device_checksum(t2) != whole
    odd = torch.arange(11, dtype=torch.uint8)  # an odd number of bytes
    assert device_checksum(odd) != device_checksum(odd.flip(0))
    assert device_checksum(torch.zeros(3, dtype=torch.float64)) == 0


def test_the_cpu_keeps_its_own_checksums() -> None:
    """On the CPU the CRC and blake2b stay (read in place); the device sum is for accelerators."""
    t = _state()
    assert checksums.fast_checksum(t) != device_checksum(t)
    assert checksums.digest(t) != device_checksum(t)
