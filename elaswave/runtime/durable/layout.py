"""Where durable checkpoints lie on disk and which one is the newest complete one, without torch
(``launch`` asks before any worker exists, and the daemon never imports torch).

A checkpoint is a directory ``step-NNNNNNNN`` under the checkpoint directory, committed once it
holds ``.metadata`` (written whole by rank 0) or ``pieces.json`` (per stage: the index of every
rank's part); ``LATEST`` names the newest committed one.
"""

from __future__ import annotations

import os
from pathlib import Path

LATEST = "LATEST"
PIECES = "pieces.json"  # a per-stage checkpoint's index: which rank wrote which interval


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``directory``, if any."""
    root = Path(directory)
    marker = root / LATEST
    if marker.is_file():
        path = root / marker.read_text().strip()
        if complete(path):
            return path
    return None


def complete(path: Path) -> bool:
    """Whether ``path`` is a committed checkpoint (whole, or every stage's part indexed)."""
    return (path / ".metadata").is_file() or (path / PIECES).is_file()
