"""Checksums of tensors' bytes, on any device and of any dtype (read through host memory)."""

from __future__ import annotations

import hashlib
import zlib

import torch

__all__ = ["digest", "fast_checksum", "host_bytes"]


def host_bytes(t: torch.Tensor) -> memoryview:
    """A tensor's bytes in host memory, whatever device it lives on (a copy only off the CPU)."""
    return memoryview(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy())


def digest(*tensors: torch.Tensor) -> int:
    """A 63-bit checksum of tensors' bytes (blake2b): for whole-model comparisons."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(host_bytes(t))
    return int.from_bytes(h.digest(), "little") >> 1


def fast_checksum(*tensors: torch.Tensor) -> int:
    """A CRC-32 of tensors' bytes, cheap enough for every shard piece of every snapshot.

    zlib's native CRC reads the tensor memory in place: 1.7-9x faster than the earlier pure-torch
    sums of int64-widened words (``python -m bench checksum``), and it catches any burst of up to
    32 flipped bits and any swap of two different words.
    """
    crc = 0
    for t in tensors:
        crc = zlib.crc32(host_bytes(t), crc)
    return crc
