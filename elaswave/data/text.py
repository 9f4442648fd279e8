"""Your own text as training data: ``data.source: text``.

``data.files`` (globs of .txt, .jsonl and .parquet files, :mod:`~elaswave.data.sources`) are
encoded with the model's tokenizer or as UTF-8 bytes (:mod:`~elaswave.data.encode`), documents
packed into one stream each ended by its end-of-document id, and written once into a token file
cached by content (:mod:`~elaswave.data.cache`). The job then trains on that file exactly as on
``data.source: tokens``: the same memory-mapped ``seq_len + 1`` windows, the same sample order,
so exactly-once sampling across resizes is unchanged.

:func:`resolve_text` is the one call ``elaswave launch`` makes, before the job starts: it returns
the config with ``data.path`` (the cached token file) and ``data.dtype`` set, which is what
reaches the workers; they never hash or tokenize. Nothing here imports torch; transformers is
imported only to load a tokenizer directory on a cache miss.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import cast

from elaswave.config import JobConfig, ModelConfig, cache_dir
from elaswave.config.model import TokenDtype
from elaswave.data.cache import FORMAT, Corpus, Progress, corpus_key, prepare, tokenize_to
from elaswave.data.encode import BYTE_EOS, BYTE_VOCAB
from elaswave.errors import ConfigError

__all__ = [
    "BYTE_EOS",
    "BYTE_VOCAB",
    "FORMAT",
    "Corpus",
    "Progress",
    "corpus_key",
    "model_vocab",
    "prepare",
    "resolve_text",
    "tokenize_to",
]


def resolve_text(cfg: JobConfig, *, progress: Progress | None = None) -> JobConfig:
    """``cfg`` with its text tokenized (or found in the cache): ``data.path`` names the token
    file, ``data.dtype`` its dtype. The tokenizer is ``data.tokenizer``, else the
    ``model.pretrained`` directory's, else UTF-8 bytes. A config of another source is returned
    as it is."""
    d, m = cfg.data, cfg.model
    if d.source != "text":
        return cfg
    if d.path is not None:
        raise ConfigError(
            "data.path is for data.source: tokens; with data.source: text, launch tokenizes "
            "data.files into data.cache_dir and sets it"
        )
    tokenizer, label = None, "data.tokenizer"
    if d.tokenizer is not None:
        tokenizer = Path(d.tokenizer).expanduser()
    elif m.source == "hf" and m.pretrained is not None:
        tokenizer, label = Path(m.pretrained).expanduser(), "model.pretrained"
    corpus = prepare(
        d.files,
        cache_dir=Path(d.cache_dir).expanduser() if d.cache_dir else cache_dir() / "tokens",
        text_field=d.text_field,
        tokenizer=tokenizer,
        tokenizer_label=label,
        vocab_size=model_vocab(m),
        progress=progress,
    )
    if corpus.tokens < m.seq_len + 1:
        raise ConfigError(
            f"data.files: {corpus.tokens} tokens is too short for one sample of seq_len {m.seq_len}"
        )
    dtype = cast(TokenDtype, corpus.dtype)  # DataConfig checks it
    data = dataclasses.replace(d, path=str(corpus.path.resolve()), dtype=dtype)
    return dataclasses.replace(cfg, data=data)


def model_vocab(m: ModelConfig) -> int | None:
    """The model's vocabulary size, where it is known without building the model: the built-in
    GPT's ``vocab_size``, ``model.hf``'s ``vocab_size`` key, or a ``model.pretrained``
    directory's config.json. Otherwise None (the token file's ids are still checked against the
    built model before the job starts)."""
    if m.source == "gpt":
        return m.vocab_size
    if m.source != "hf":
        return None
    if m.hf:
        value = m.hf.get("vocab_size")
    else:
        assert m.pretrained is not None
        try:
            config = json.loads((Path(m.pretrained).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return None  # building the model says what is wrong with the directory
        value = config.get("vocab_size") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None
