"""Logical RNG: random streams keyed by identity, never by rank.

A stream is keyed by (seed, step, microbatch, layer, site).
Any worker that computes the same logical piece of work draws the same random numbers,
regardless of how many workers exist or which rank it has.
"""

from __future__ import annotations

import hashlib

__all__ = ["stream_seed"]

_DOMAIN = b"elaswave.rng.v1"
_MASK63 = (1 << 63) - 1


def _encode_int(value: int) -> bytes:
    """Unambiguous byte encoding of an arbitrary Python int (length-prefixed, signed)."""
    raw = value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    return len(raw).to_bytes(2, "little") + raw


def stream_seed(seed: int, step: int, microbatch: int, *, layer: int, site: int = 0) -> int:
    """Seed for one random stream; pure and stable across processes, in [0, 2**63)."""
    h = hashlib.blake2b(digest_size=8, person=_DOMAIN)
    for value in (seed, step, microbatch, layer, site):
        h.update(_encode_int(int(value)))
    return int.from_bytes(h.digest(), "little") & _MASK63
