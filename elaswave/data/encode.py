"""Text to token ids: UTF-8 bytes, or a local Hugging Face tokenizer; documents packed into one
stream, each followed by its end-of-document id.

Bytes: ids 0..255 are the text's UTF-8 bytes and 256 ends a document (:data:`BYTE_EOS`), so the
vocabulary is 257 (:data:`BYTE_VOCAB`) and a model needs ``vocab_size >= 257``. A byte never
stands for the end of a document, so a NUL in the text is not mistaken for one.

A tokenizer is a directory ``save_pretrained`` wrote, loaded with ``AutoTokenizer`` and
``local_files_only=True`` (nothing is downloaded); transformers is imported only then. Its
end-of-document id is its ``eos_token``, and its vocabulary ``len(tokenizer)`` (added tokens
included). What a tokenizer is, for the cache key, is a digest of its directory's files other
than model weights, so the cache is found again without loading it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from elaswave.config.schema import first_line
from elaswave.errors import ConfigError

__all__ = ["BYTE_EOS", "BYTE_VOCAB", "ByteEncoder", "Encoder", "HFEncoder", "pack"]

BYTE_EOS = 256
BYTE_VOCAB = 257
# Files of a model directory that are not its tokenizer: left out of the tokenizer's digest (a
# fine-tuned model's tokenizer is still the same, and weights can be gigabytes).
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_CHUNK = 1 << 20


class Encoder:
    """What turns documents into ids: its end-of-document id, its vocabulary (every id is below
    it), a one-line description and the digest that stands for it in the cache key."""

    eos: int
    vocab: int
    describe: str
    digest: str

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        """The ids of each document (no end-of-document id; :func:`pack` adds it)."""
        raise NotImplementedError


class ByteEncoder(Encoder):
    """UTF-8 bytes as ids 0..255, end of document 256."""

    eos = BYTE_EOS
    vocab = BYTE_VOCAB
    describe = "UTF-8 bytes"
    digest = "bytes:eos=256"

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]


class HFEncoder(Encoder):
    """A local Hugging Face tokenizer (see the module docstring). ``label`` names where the
    directory came from in errors (``data.tokenizer`` or ``model.pretrained``)."""

    def __init__(self, directory: Path, label: str) -> None:
        self.directory = directory
        self.label = label
        self.digest = tokenizer_digest(directory, label)
        self.describe = f"the tokenizer in {directory}"
        self._tok: Any = None

    def load(self) -> HFEncoder:
        """Load the tokenizer (the cache key does not need it; tokenizing does)."""
        try:
            from transformers import AutoTokenizer
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ConfigError(
                f"{self.label} {str(self.directory)!r}: a tokenizer needs transformers: "
                "pip install 'elaswave[hf]'"
            ) from None
        hf_logging.disable_progress_bar()
        try:
            tok = AutoTokenizer.from_pretrained(str(self.directory), local_files_only=True)
        except Exception as exc:  # transformers' many ways to fail on a directory: one line
            raise ConfigError(
                f"{self.label} {str(self.directory)!r}: cannot load a tokenizer from it "
                f"({first_line(exc)})"
            ) from None
        if tok.eos_token_id is None:
            raise ConfigError(
                f"{self.label} {str(self.directory)!r}: the tokenizer has no eos_token to end "
                "each document with"
            )
        self._tok = tok
        self.eos = int(tok.eos_token_id)
        self.vocab = max(len(tok), self.eos + 1)
        return self

    def encode(self, texts: Sequence[str]) -> list[np.ndarray]:
        assert self._tok is not None, "load() first"
        ids = self._tok(
            list(texts), add_special_tokens=False, return_attention_mask=False, verbose=False
        )["input_ids"]
        return [np.asarray(i, dtype=np.int64) for i in ids]


def tokenizer_digest(directory: Path, label: str) -> str:
    """SHA-256 over the names and bytes of the directory's files, weights left out."""
    if not directory.is_dir():
        raise ConfigError(f"{label} {str(directory)!r} is not a directory")
    h = hashlib.sha256()
    files = sorted(p for p in directory.iterdir() if p.is_file() and not p.name.endswith(_WEIGHTS))
    if not files:
        raise ConfigError(f"{label} {str(directory)!r} holds no tokenizer files")
    for path in files:
        h.update(path.name.encode() + b"\0")
        h.update(file_digest(path).encode() + b"\n")
    return "tokenizer:" + h.hexdigest()


def file_digest(path: Path) -> str:
    """SHA-256 of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def pack(ids: Sequence[np.ndarray], eos: int, dtype: str) -> np.ndarray:
    """The documents' ids back to back, each followed by ``eos``, as ``dtype``."""
    total = sum(len(i) for i in ids) + len(ids)
    out = np.empty(total, dtype=dtype)
    pos = 0
    for doc in ids:
        out[pos : pos + len(doc)] = doc
        pos += len(doc)
        out[pos] = eos
        pos += 1
    return out


def token_dtype(vocab: int) -> str:
    """The narrowest token file dtype every id below ``vocab`` fits."""
    return "uint16" if vocab <= np.iinfo(np.uint16).max + 1 else "uint32"
