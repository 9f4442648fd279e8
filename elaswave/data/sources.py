"""The documents of ``data.files``: the globs expanded in order, each file read by its kind.

- ``.txt`` (or ``.md``: plain text too): the whole file is one document, read at once.
- ``.jsonl``: one JSON object per line (the stdlib's ``json``), its ``text_field`` the document;
  blank lines are skipped.
- ``.parquet``: one document per row of the ``text_field`` column, read with pyarrow (the ``hf``
  extra) a batch of rows at a time.

Every way a file can be unusable is one :class:`~elaswave.errors.ConfigError` line that names the
file (and the line or row): no file matches a glob, a file of another kind, a file with no text,
bytes that are not UTF-8, a line that is not a JSON object or lacks the field, a missing or
non-text column, a null value. An empty document (``""``) is skipped; a file whose documents are
all empty is refused.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from elaswave.config.schema import first_line
from elaswave.errors import ConfigError

__all__ = ["KINDS", "Source", "documents", "expand"]

KINDS = {".txt": "txt", ".md": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
PARQUET_ROWS = 4096  # rows per batch read from a parquet file


@dataclass(frozen=True)
class Source:
    """One input file: where it is, how it is read, and its size (for progress)."""

    path: Path
    kind: str  # "txt" | "jsonl" | "parquet"
    size: int


def expand(globs: Sequence[str]) -> list[Source]:
    """The files the globs match (``~`` expanded, ``**`` recursive), in the globs' order, each
    glob's matches sorted by name; a file two globs match is read once, at its first place."""
    sources: list[Source] = []
    seen: set[Path] = set()
    for pattern in globs:
        matches = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True))
        files = [p for p in matches if p.is_file()]
        if not files:
            raise ConfigError(f"data.files: no file matches {pattern!r}")
        for path in files:
            real = path.resolve()
            if real in seen:
                continue
            seen.add(real)
            kind = KINDS.get(path.suffix.lower())
            if kind is None:
                raise ConfigError(f"data.files: {path} is not a .txt, .md, .jsonl or .parquet file")
            sources.append(Source(path, kind, path.stat().st_size))
    return sources


def documents(source: Source, text_field: str) -> Iterator[tuple[str, int]]:
    """Each document of ``source`` (``""`` for an empty one, which the caller skips) with how
    many of the file's bytes were read since the previous one (they sum to the file's size); a
    file with no text is an error."""
    read = {"txt": _txt, "jsonl": _jsonl, "parquet": _parquet}[source.kind]
    found = False
    for text, nbytes in read(source, text_field):
        found = found or bool(text)
        yield text, nbytes
    if not found:
        raise ConfigError(f"data.files: {source.path} has no text")


def _decode(data: bytes, path: Path, where: str = "") -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"data.files: {path}{where} is not UTF-8 text (byte {exc.start}: {exc.reason})"
        ) from None


def _txt(source: Source, _field: str) -> Iterator[tuple[str, int]]:
    data = source.path.read_bytes()
    yield _decode(data, source.path), len(data)


def _jsonl(source: Source, field: str) -> Iterator[tuple[str, int]]:
    with open(source.path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f":{number}"
            line = _decode(raw, source.path, f" line {number}")
            if not line.strip():
                yield "", len(raw)
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"data.files: {source.path}{where}: not valid JSON ({exc.msg})"
                ) from None
            if not isinstance(record, dict):
                raise ConfigError(f"data.files: {source.path}{where}: not a JSON object")
            if field not in record:
                raise ConfigError(
                    f"data.files: {source.path}{where}: no {field!r} field (data.text_field)"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.files: {source.path}{where}: {field!r} is "
                    f"{type(text).__name__}, not text"
                )
            yield text, len(raw)


def _parquet(source: Source, field: str) -> Iterator[tuple[str, int]]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"data.files: reading {source.path} needs pyarrow: pip install 'elaswave[hf]'"
        ) from None
    try:
        pf = pq.ParquetFile(source.path)
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(
            f"data.files: {source.path} is not a parquet file ({first_line(exc)})"
        ) from None
    schema = pf.schema_arrow
    if field not in schema.names:
        raise ConfigError(
            f"data.files: {source.path} has no column {field!r} (data.text_field; columns: "
            f"{', '.join(schema.names) or 'none'})"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
            or pa.types.is_string_view(kind)):  # fmt: skip
        raise ConfigError(f"data.files: {source.path}: column {field!r} is {kind}, not text")
    rows = max(pf.metadata.num_rows, 1)
    done_rows, done_bytes, row = 0, 0, 0
    try:
        for batch in pf.iter_batches(batch_size=PARQUET_ROWS, columns=[field]):
            values = batch.column(0).to_pylist()
            done_rows += len(values)
            share = source.size * done_rows // rows - done_bytes
            done_bytes += share
            for i, text in enumerate(values):
                if text is None:
                    raise ConfigError(f"data.files: {source.path} row {row + i}: {field!r} is null")
                yield text, share if i == len(values) - 1 else 0
            row += len(values)
    except UnicodeDecodeError as exc:
        raise ConfigError(f"data.files: {source.path} is not UTF-8 text ({exc.reason})") from None
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(
            f"data.files: {source.path}: cannot be read ({first_line(exc)})"
        ) from None
    if done_bytes < source.size:
        yield "", source.size - done_bytes
