"""The run directory's structured logs: ``events.jsonl`` and ``metrics.jsonl``.

Both are append-only JSON lines. Every event has ``t`` (wall-clock seconds) and ``kind``; the MTTR
report is computed by replaying them, so an event's fields are part of the interface.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"
RUN_CONFIG = "config.json"  # the job's config as it ran (what ``elaswave export`` rebuilds from)


class JsonlWriter:
    """Appends one JSON object per line, written through at once, so a crash loses no finished
    line.

    A full disk (or any other failed write) loses nothing and stops nothing: a line that could not
    be written whole is cut back off the file (the file only ever holds whole lines) and kept in
    memory with every later one, and they are all written, in order, once a write succeeds
    again. ``on_error(path, exc)`` hears of the first failure of each such stretch;
    :attr:`unwritten` counts the lines held back.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        on_error: Callable[[Path, OSError], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._on_error = on_error
        self._backlog: list[bytes] = []
        self._failing = False
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    @property
    def unwritten(self) -> int:
        return len(self._backlog)

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n"
        with self._lock:
            self._backlog.append(line.encode())
            self._drain()

    def _drain(self) -> None:
        """Write the held-back lines in order; stop at the first that fails."""
        while self._backlog:
            line = self._backlog[0]
            size = os.fstat(self._fd).st_size
            try:
                written = os.write(self._fd, line)
                if written != len(line):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, size)  # no torn line: cut back what did get in
                if not self._failing and self._on_error is not None:
                    self._on_error(self.path, exc)
                self._failing = True
                return
            self._backlog.pop(0)
        self._failing = False

    def flush(self) -> bool:
        """Try the held-back lines again; ``True`` when none is left."""
        with self._lock:
            self._drain()
            return not self._backlog

    def keep_only(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the file with the records ``keep`` accepts (atomically: a new file renamed
        over the old one), then go on appending. Held-back lines are filtered too."""
        with self._lock:
            records = [r for r in read_jsonl(self.path) if keep(r)]
            self._backlog = [b for b in self._backlog if keep(json.loads(b))]
            tmp = self.path.with_name(self.path.name + ".tmp")
            try:
                with open(tmp, "w", encoding="utf-8") as f:
                    for r in records:
                        f.write(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n")
            except OSError as exc:  # no room for the copy: the records stay as they are
                tmp.unlink(missing_ok=True)
                if self._on_error is not None:
                    self._on_error(self.path, exc)
                return
            os.replace(tmp, self.path)
            os.close(self._fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        with self._lock:
            self._drain()
            with contextlib.suppress(OSError):
                os.close(self._fd)


class EventLog(JsonlWriter):
    """``events.jsonl``: faults, detections, plans and recovery phases."""

    def emit(self, kind: str, *, t: float | None = None, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time() if t is None else t, "kind": kind, **fields}
        self.write(record)
        return record


def distinct_records(lines: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``metrics.jsonl`` lines of one or several hosts, each step's record once: a record whose
    ``writer`` token an earlier line has is the same record written again (its first writer
    died, or was cut off, between moving the job's progress record and writing the line, and
    the host that took rank 0 over wrote it from the progress record; the first may still have
    written it). A step committed twice has two tokens and stays twice."""
    seen: set[str] = set()
    out = []
    for line in lines:
        writer = line.get("writer")
        if writer is not None:
            if writer in seen:
                continue
            seen.add(writer)
        out.append(line)
    return out


def read_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """Yield the records of a JSONL file; a torn last line (writer killed mid-line) is skipped."""
    p = Path(path)
    if not p.exists():
        return
    with open(p, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
