"""Deterministic data: sample order is a pure function of (seed, step, global sample index)."""

from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from elaswave.data.tokens import TokenArray, write_token_file
from elaswave.errors import ConfigError

__all__ = [
    "MicroBatch",
    "SyntheticTokens",
    "TokenFile",
    "microbatches",
    "sample_ids",
    "token_file",
    "write_token_file",
]


def _require_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")


def _check_index(sample_id: int, size: int) -> int:
    idx = operator.index(sample_id)
    if not 0 <= idx < size:
        raise IndexError(f"sample id {idx} out of range [0, {size})")
    return idx


@lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, num_samples: int) -> np.ndarray:
    perm = np.random.Generator(np.random.PCG64([seed, epoch])).permutation(num_samples)
    perm.setflags(write=False)
    return perm


def sample_ids(seed: int, step: int, global_batch: int, *, num_samples: int) -> list[int]:
    """Global sample ids consumed by `step` (steps start at 1); each epoch is a permutation."""
    _require_positive(step=step, global_batch=global_batch, num_samples=num_samples)
    if seed < 0:
        raise ValueError(f"seed must be non-negative, got {seed}")
    start = (step - 1) * global_batch
    end = start + global_batch
    out: list[int] = []
    pos = start
    while pos < end:
        epoch, offset = divmod(pos, num_samples)
        take = min(end - pos, num_samples - offset)
        out.extend(_permutation(seed, epoch, num_samples)[offset : offset + take].tolist())
        pos += take
    return out


class SyntheticTokens:
    """Learnable synthetic corpus: samples drawn from a fixed seeded sparse Markov chain."""

    SUCCESSORS = 4
    CHAIN_MASS = 0.9
    SUCCESSOR_WEIGHTS = (0.55, 0.25, 0.12, 0.08)

    def __init__(self, *, seed: int, vocab_size: int, seq_len: int, num_samples: int) -> None:
        _require_positive(vocab_size=vocab_size, seq_len=seq_len, num_samples=num_samples)
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        self.seed = seed
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.num_samples = num_samples
        chain_rng = np.random.Generator(np.random.PCG64([seed, 0xC4A1]))
        self._successors = chain_rng.integers(0, vocab_size, size=(vocab_size, self.SUCCESSORS))

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        idx = _check_index(sample_id, self.num_samples)
        n = self.seq_len + 1
        rng = np.random.Generator(np.random.PCG64([self.seed, 0x5A3E, idx]))
        uniform = rng.integers(0, self.vocab_size, size=n)
        follow = rng.random(n) < self.CHAIN_MASS
        which = rng.choice(self.SUCCESSORS, size=n, p=self.SUCCESSOR_WEIGHTS)
        tokens = np.empty(n, dtype=np.int64)
        tok = int(uniform[0])
        tokens[0] = tok
        for t in range(1, n):
            tok = int(self._successors[tok, which[t]]) if follow[t] else int(uniform[t])
            tokens[t] = tok
        return torch.from_numpy(tokens)


class TokenFile:
    """nanoGPT-style flat binary token file, memory-mapped read-only: sample ``i`` is the
    ``seq_len + 1`` tokens from ``i * seq_len`` (see :class:`~elaswave.data.tokens.TokenArray`)."""

    def __init__(
        self, path: str | os.PathLike[str], *, seq_len: int, dtype: str = "uint16"
    ) -> None:
        _require_positive(seq_len=seq_len)
        array = TokenArray(path, seq_len=seq_len, dtype=dtype)
        self.path = array.path
        self.seq_len = seq_len
        self.dtype = dtype
        self.n_tokens = array.n_tokens
        self.num_samples = array.num_samples
        self._tokens = array.tokens

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, sample_id: int) -> torch.Tensor:
        idx = _check_index(sample_id, self.num_samples)
        start = idx * self.seq_len
        window = self._tokens[start : start + self.seq_len + 1]
        return torch.from_numpy(window.astype(np.int64))


def token_file(path: str | None, *, seq_len: int, dtype: str) -> TokenFile:
    """The data set of ``data.source: tokens`` or ``text``: the token file at ``path``. For
    ``text`` the path is set by ``elaswave launch`` once it has tokenized the files
    (:func:`elaswave.data.text.resolve_text`); without it there is nothing to read yet."""
    if path is None:
        raise ConfigError(
            "data.source: text has no token file yet: elaswave launch tokenizes data.files "
            "(elaswave.data.text.resolve_text) before the workers read them"
        )
    return TokenFile(path, seq_len=seq_len, dtype=dtype)


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a step: its id within the step and its global sample ids."""

    id: int
    sample_ids: tuple[int, ...]


def microbatches(
    seed: int, step: int, global_batch: int, *, micro_batch_size: int, num_samples: int
) -> list[MicroBatch]:
    """Cut the step's sample ids into consecutive micro-batches with ids 0..n-1."""
    _require_positive(micro_batch_size=micro_batch_size)
    if global_batch % micro_batch_size != 0:
        raise ValueError(
            f"global_batch {global_batch} not divisible by micro_batch_size {micro_batch_size}"
        )
    ids = sample_ids(seed, step, global_batch, num_samples=num_samples)
    return [
        MicroBatch(id=k, sample_ids=tuple(ids[start : start + micro_batch_size]))
        for k, start in enumerate(range(0, global_batch, micro_batch_size))
    ]
