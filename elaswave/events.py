"""The run directory's structured logs: ``events.jsonl`` and ``metrics.jsonl``.

Both are append-only JSON lines. Every event has ``t`` (wall-clock seconds) and ``kind``; the MTTR
report is computed by replaying them, so an event's fields are part of the interface.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

EVENTS_FILE = "events.jsonl"
METRICS_FILE = "metrics.jsonl"


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses no finished line."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, sort_keys=True, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def keep_only(self, keep: Callable[[dict[str, Any]], bool]) -> None:
        """Rewrite the file with the records ``keep`` accepts (atomically: a new file renamed
        over the old one), then go on appending."""
        with self._lock:
            self._file.close()
            records = [r for r in read_jsonl(self.path) if keep(r)]
            tmp = self.path.with_name(self.path.name + ".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for r in records:
                    f.write(json.dumps(r, sort_keys=True, separators=(",", ":")) + "\n")
            os.replace(tmp, self.path)
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def close(self) -> None:
        with self._lock:
            self._file.close()


class EventLog(JsonlWriter):
    """``events.jsonl``: faults, detections, plans and recovery phases."""

    def emit(self, kind: str, *, t: float | None = None, **fields: Any) -> dict[str, Any]:
        record = {"t": time.time() if t is None else t, "kind": kind, **fields}
        self.write(record)
        return record


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
