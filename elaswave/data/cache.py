"""Tokenize once: the token file of a set of text files, kept in a cache shared by every launch,
rank and host.

The file is named by its **content key**: SHA-256 over a format version (:data:`FORMAT`), the
tokenizer's digest (its files' bytes; ``bytes`` for UTF-8 bytes), the text field (when a .jsonl or
.parquet file is read) and, in order, each input's kind and the SHA-256 of its bytes. Paths,
names, modification times and ``seq_len`` are not part of it: the same corpus copied elsewhere,
touched, or cut into other sample lengths finds the same file. Every launch hashes the inputs
(one read of their bytes); a launch whose key is already cached reads nothing else, and never
loads the tokenizer.

``<key>.tokens`` holds the ids (:mod:`elaswave.runtime.workload.data`'s flat token file format);
``<key>.json`` says how many, their dtype, vocabulary and end-of-document id, and is written
last: a key is cached when its record is there and the token file has the size it gives. A miss
takes ``<key>.lock`` (a POSIX ``fcntl`` lock, which NFS shares between hosts), looks again, and
only then tokenizes, into a temporary file in the cache directory renamed into place; so
launches racing on one shared directory tokenize once and wait for each other, and a crash
leaves no half-written file under a cached name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from elaswave.data.encode import ByteEncoder, Encoder, HFEncoder, file_digest, pack, token_dtype
from elaswave.data.sources import Source, documents, expand
from elaswave.errors import ConfigError

__all__ = ["FORMAT", "Corpus", "Progress", "corpus_key", "prepare", "tokenize_to"]

FORMAT = 1  # bump when the same inputs would give other tokens (the reading, the packing)
BATCH_CHARS = 1 << 20  # documents are encoded in batches of about this many characters
BATCH_DOCS = 1024


class Progress(Protocol):
    """What ``prepare`` tells whoever shows it (the CLI: a bar, or plain lines)."""

    def note(self, line: str) -> None:
        """A line worth showing (reusing a cached file, waiting for another launch)."""

    def start(self, what: str, total: int) -> None:
        """A phase of ``total`` bytes begins (``hashing``, ``tokenizing``)."""

    def advance(self, nbytes: int) -> None:
        """``nbytes`` more of the phase are done."""

    def stop(self) -> None:
        """The phase is over."""


class _Silent:
    def note(self, line: str) -> None:
        pass

    def start(self, what: str, total: int) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        pass

    def stop(self) -> None:
        pass


@dataclass(frozen=True)
class Corpus:
    """A token file made from text: where it is and what it holds."""

    path: Path
    tokens: int
    dtype: str
    vocab: int  # every id is below it
    eos: int  # ends each document
    tokenizer: str  # what encoded it, in words
    tokenized: bool = False  # this call wrote it (False: found in the cache)


def corpus_key(sources: Sequence[Source], text_field: str, tokenizer_digest: str,
               *, progress: Progress | None = None) -> str:  # fmt: skip
    """The content key of ``sources`` read with ``text_field`` and encoded by the tokenizer of
    ``tokenizer_digest`` (see the module docstring); 32 hex digits."""
    progress = progress or _Silent()
    h = hashlib.sha256(f"elaswave text tokens v{FORMAT}\n{tokenizer_digest}\n".encode())
    if any(s.kind != "txt" for s in sources):
        h.update(f"field {text_field}\n".encode())
    progress.start("hashing", sum(s.size for s in sources))
    try:
        for s in sources:
            h.update(f"{s.kind} {file_digest(s.path)}\n".encode())
            progress.advance(s.size)
    finally:
        progress.stop()
    return h.hexdigest()[:32]


def prepare(
    files: Sequence[str],
    *,
    cache_dir: Path,
    text_field: str = "text",
    tokenizer: Path | None = None,
    tokenizer_label: str = "data.tokenizer",
    vocab_size: int | None = None,
    progress: Progress | None = None,
) -> Corpus:
    """The token file of the text in ``files`` (globs), from ``cache_dir`` or tokenized into it
    (bytes without ``tokenizer``). ``vocab_size``: the model's, when known; a vocabulary larger
    than it (end of document included) is an error, before anything is tokenized."""
    progress = progress or _Silent()
    sources = expand(files)
    encoder: Encoder = ByteEncoder() if tokenizer is None else HFEncoder(tokenizer, tokenizer_label)
    key = corpus_key(sources, text_field, encoder.digest, progress=progress)
    found = _cached(cache_dir, key)  # a hit needs no write access (a read-only shared cache)
    if found is None:
        _make_dir(cache_dir)
        with _locked(cache_dir / f"{key}.lock", progress):
            found = _cached(cache_dir, key)  # written while we waited
            if found is None:
                if isinstance(encoder, HFEncoder):
                    encoder.load()
                _check_vocab(encoder.vocab, encoder.eos, encoder.describe, vocab_size=vocab_size)
                for stale in cache_dir.glob(f".{key}.*.tmp"):  # a writer that died
                    stale.unlink(missing_ok=True)
                found = _write(
                    cache_dir,
                    key,
                    sources,
                    text_field=text_field,
                    encoder=encoder,
                    progress=progress,
                )
    if not found.tokenized:
        progress.note(f"tokens cached: {found.path} ({found.tokens:,} tokens)")
        _check_vocab(found.vocab, found.eos, found.tokenizer, vocab_size=vocab_size)
    return found


def tokenize_to(
    out: Path,
    files: Sequence[str],
    *,
    text_field: str = "text",
    tokenizer: Path | None = None,
    progress: Progress | None = None,
) -> Corpus:
    """Tokenize ``files`` into the token file ``out`` (no cache: what ``prepare`` writes for the
    same inputs, byte for byte). Written to a temporary file first, then renamed."""
    sources = expand(files)
    encoder: Encoder = ByteEncoder()
    if tokenizer is not None:
        encoder = HFEncoder(tokenizer, "tokenizer").load()
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex}.tmp"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tokens, dtype = _tokenize(
            tmp, sources, text_field, encoder=encoder, progress=progress or _Silent()
        )
        os.replace(tmp, out)
    except OSError as exc:
        raise ConfigError(f"{out}: cannot write the token file ({exc.strerror})") from None
    finally:
        tmp.unlink(missing_ok=True)
    return Corpus(out, tokens, dtype, encoder.vocab, encoder.eos, encoder.describe, True)


def _check_vocab(vocab: int, eos: int, tokenizer: str, *, vocab_size: int | None) -> None:
    if vocab_size is not None and vocab > vocab_size:
        raise ConfigError(
            f"data: {tokenizer} has a vocabulary of {vocab} (end of document {eos} included), "
            f"more than the model's vocab_size {vocab_size}"
        )


def _make_dir(cache_dir: Path) -> None:
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"data.cache_dir {str(cache_dir)!r}: cannot create it ({exc.strerror})"
        ) from None
    if not os.access(cache_dir, os.W_OK | os.X_OK):
        raise ConfigError(f"data.cache_dir {str(cache_dir)!r} is not writable")


def _cached(cache_dir: Path, key: str) -> Corpus | None:
    """The cached token file of ``key``, if its record is there and the file whole."""
    path = cache_dir / f"{key}.tokens"
    try:
        meta = json.loads((cache_dir / f"{key}.json").read_text())
        size = path.stat().st_size
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return None
    try:
        whole = size == meta["tokens"] * np.dtype(meta["dtype"]).itemsize
        corpus = Corpus(path, int(meta["tokens"]), str(meta["dtype"]), int(meta["vocab"]),
                        int(meta["eos"]), str(meta["tokenizer"]))  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None
    return corpus if whole else None


@contextlib.contextmanager
def _locked(path: Path, progress: Progress) -> Iterator[None]:
    """Hold the exclusive lock on ``path`` (waiting as long as another holder tokenizes: the
    lock goes when its process does, even killed). The holder writes who it is into the file,
    so a waiter can say whom it waits for."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EAGAIN):
                raise
            holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "another launch"
            progress.note(f"waiting for {holder} to finish tokenizing these files")
            fcntl.lockf(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(cache_dir: Path, key: str, sources: Sequence[Source], *, text_field: str,
           encoder: Encoder, progress: Progress) -> Corpus:  # fmt: skip
    """Tokenize into ``<key>.tokens``, then record it in ``<key>.json`` (the lock is held)."""
    tag = f"{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
    tmp = cache_dir / f".{key}.{tag}.tmp"
    meta_tmp = cache_dir / f".{key}.{tag}.json.tmp"
    path = cache_dir / f"{key}.tokens"
    started = time.monotonic()
    try:
        tokens, dtype = _tokenize(tmp, sources, text_field, encoder=encoder, progress=progress)
        os.replace(tmp, path)
        meta = {"format": FORMAT, "tokens": tokens, "dtype": dtype, "vocab": encoder.vocab,
                "eos": encoder.eos, "tokenizer": encoder.describe, "text_field": text_field,
                "files": [str(s.path.resolve()) for s in sources]}  # fmt: skip
        with open(meta_tmp, "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(meta_tmp, cache_dir / f"{key}.json")
        _sync_dir(cache_dir)
    except OSError as exc:
        raise ConfigError(
            f"data.cache_dir {str(cache_dir)!r}: cannot write the token file ({exc.strerror})"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
        meta_tmp.unlink(missing_ok=True)
    took = time.monotonic() - started
    progress.note(f"tokenized into {path} ({tokens:,} tokens, {took:.1f} s)")
    return Corpus(path, tokens, dtype, encoder.vocab, encoder.eos, encoder.describe, True)


def _tokenize(out: Path, sources: Sequence[Source], text_field: str, *, encoder: Encoder,
              progress: Progress) -> tuple[int, str]:  # fmt: skip
    """Every document of ``sources`` encoded and packed into ``out`` (fsynced): (tokens,
    dtype)."""
    dtype = token_dtype(encoder.vocab)
    tokens = 0
    progress.start("tokenizing", sum(s.size for s in sources))
    try:
        with open(out, "wb") as f:
            for source in sources:
                for batch, nbytes in _batches(source, text_field):
                    if not batch:
                        progress.advance(nbytes)
                        continue
                    try:
                        ids = encoder.encode(batch)
                    except UnicodeEncodeError as exc:  # a lone surrogate from a JSON escape
                        raise ConfigError(
                            f"data.files: {source.path} is not UTF-8 text ({exc.reason})"
                        ) from None
                    packed = pack(ids, encoder.eos, dtype)
                    f.write(packed.tobytes())
                    tokens += len(packed)
                    progress.advance(nbytes)
            f.flush()
            os.fsync(f.fileno())
    finally:
        progress.stop()
    return tokens, dtype


def _batches(source: Source, text_field: str) -> Iterator[tuple[list[str], int]]:
    """The file's documents in batches of about :data:`BATCH_CHARS` characters."""
    batch: list[str] = []
    chars = nbytes = 0
    for text, read in documents(source, text_field):
        if text:  # an empty document has no tokens and no end
            batch.append(text)
        chars += len(text)
        nbytes += read
        if chars >= BATCH_CHARS or len(batch) >= BATCH_DOCS:
            yield batch, nbytes
            batch, chars, nbytes = [], 0, 0
    if batch or nbytes:
        yield batch, nbytes


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
