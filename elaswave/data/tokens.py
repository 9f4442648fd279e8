"""Flat token files as numbers, without torch: their size in samples, the checks a job's data
must pass before it starts, and writing one. (:class:`~.data.TokenFile` serves the samples as
tensors to the workers; ``launch`` checks the file with this module before anything starts.)"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["DTYPES", "TokenArray", "check_token_file", "numpy_dtype", "write_token_file"]

DTYPES: dict[str, type[np.unsignedinteger]] = {"uint16": np.uint16, "uint32": np.uint32}


class TokenArray:
    """A flat binary token file of ``dtype``, memory-mapped read-only, cut into samples of
    ``seq_len + 1`` tokens that overlap by one (sample ``i`` starts at token ``i * seq_len``)."""

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, dtype: str) -> None:
        np_dtype = numpy_dtype(dtype)
        size = os.path.getsize(path)  # FileNotFoundError if missing
        itemsize = np.dtype(np_dtype).itemsize
        if size % itemsize != 0:
            raise ValueError(
                f"{path}: size {size} is not a multiple of {dtype} itemsize {itemsize}"
            )
        n_tokens = size // itemsize
        if n_tokens < seq_len + 1:
            raise ValueError(
                f"{path}: {n_tokens} tokens is too short for one sample of seq_len {seq_len}"
            )
        self.path = os.fspath(path)
        self.n_tokens = n_tokens
        self.num_samples = (n_tokens - 1) // seq_len
        self.tokens = np.memmap(path, dtype=np_dtype, mode="r")


def check_token_file(
    path: str | os.PathLike[str], *, seq_len: int, dtype: str, vocab_size: int | None
) -> None:
    """Refuse, with a one-line ValueError, a token file a job cannot train on: missing, not whole
    tokens of ``dtype``, fewer tokens than one sample (``seq_len + 1``), or a token id the
    model's embedding has no row for (``>= vocab_size``; read in chunks, one pass)."""
    if not os.path.isfile(path):
        raise ValueError(f"data.path {os.fspath(path)!r} is not a file")
    tokens = TokenArray(path, seq_len=seq_len, dtype=dtype).tokens
    if vocab_size is None:
        return
    chunk = 1 << 24
    for start in range(0, len(tokens), chunk):
        top = int(tokens[start : start + chunk].max())
        if top >= vocab_size:
            at = start + int(np.argmax(tokens[start : start + chunk] >= vocab_size))
            raise ValueError(
                f"{os.fspath(path)}: token {int(tokens[at])} at position {at} is not below the "
                f"model's vocab_size {vocab_size}"
            )


def numpy_dtype(dtype: str) -> type[np.unsignedinteger]:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def write_token_file(
    path: str | os.PathLike[str], tokens: np.ndarray | list[int], dtype: str = "uint16"
) -> None:
    """Write tokens as a flat binary file readable by `TokenFile`."""
    np_dtype = numpy_dtype(dtype)
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
    if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(np_dtype).max):
        raise ValueError(f"token values out of range for {dtype}")
    arr.astype(np_dtype).tofile(path)
