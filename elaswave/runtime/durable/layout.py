"""Where durable checkpoints lie on disk, whether one can be trusted, and which one to use,
without torch (``launch`` asks before any worker exists, and the daemon never imports torch).

A checkpoint is a directory ``step-NNNNNNNN`` under the checkpoint directory. It counts only once
its writer has put ``checksums.json`` in it, last: the size and SHA-256 of every file the
checkpoint holds (``.metadata`` and the data files of a whole checkpoint; ``pieces.json``, every
rank's index and data files of a per-stage one). Before a checkpoint is used (a relaunch's
resume, ``--resume``, a fall-back after a double loss, ``export``) every listed file is read
back and compared: a file truncated, changed or missing, or a checkpoint without its checksums
(never finished, or its metadata deleted), is never loaded. The newest checkpoint that passes is
chosen, and the ones skipped are named with the file that failed. ``LATEST`` names the newest
committed checkpoint, for people and scripts; the choice does not rely on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "LATEST",
    "MANIFEST",
    "PIECES",
    "Choice",
    "check",
    "file_sums",
    "files_under",
    "latest",
    "newest_intact",
    "resume_point",
    "step_of",
    "write_manifest",
]

LATEST = "LATEST"
PIECES = "pieces.json"  # a per-stage checkpoint's index: which rank wrote which interval
MANIFEST = "checksums.json"  # every file of a committed checkpoint: its size and SHA-256
METADATA = ".metadata"  # torch.distributed.checkpoint's index of a whole checkpoint
_CHUNK = 1 << 20

# relative path -> [size in bytes, SHA-256 hex digest]
Sums = dict[str, list[int | str]]


def file_sums(root: Path, names: Iterable[str]) -> Sums:
    """The size and SHA-256 of each file ``root / name``."""
    return {name: [(root / name).stat().st_size, _sha256(root / name)] for name in sorted(names)}


def files_under(root: Path, prefix: str = "") -> list[str]:
    """Every regular file under ``root``, as paths relative to it (each led by ``prefix``)."""
    return sorted(prefix + p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def write_manifest(path: Path, sums: Sums) -> None:
    """Write a checkpoint's ``checksums.json`` (the last file it gets: it makes it count)."""
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": sums}, sort_keys=True))
    os.replace(tmp, path / MANIFEST)


def check(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be trusted, naming the file that failed (one
    phrase); None when every file it lists is there, whole and unchanged."""
    if not path.is_dir():
        return f"{path.name} does not exist"
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
        listed = {str(k): (int(v[0]), str(v[1])) for k, v in files.items()}
    except FileNotFoundError:
        if (path / METADATA).is_file() or (path / PIECES).is_file():
            return f"{MANIFEST} is missing (never finished, or written without checksums)"
        return f"{MANIFEST} is missing (the checkpoint was never finished)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{MANIFEST} is unreadable"
    if METADATA not in listed and PIECES not in listed:
        return f"{MANIFEST} lists neither {METADATA} nor {PIECES}"
    for name, (size, digest) in sorted(listed.items()):
        f = path / name
        try:
            if not f.is_file():
                return f"{name} is missing"
            actual = f.stat().st_size
            if actual != size:
                return f"{name} has {actual} of its {size} bytes"
            if _sha256(f) != digest:
                return f"{name} does not match its checksum"
        except OSError as exc:
            return f"{name} cannot be read ({exc.strerror or type(exc).__name__})"
    return None


@dataclass(frozen=True)
class Choice:
    """The newest intact checkpoint under a directory (None: none), and the newer ones that
    failed their check, each with the reason."""

    path: Path | None
    skipped: tuple[tuple[Path, str], ...] = ()

    @property
    def step(self) -> int | None:
        return step_of(self.path) if self.path is not None else None

    def failures(self) -> str:
        """The skipped checkpoints in a phrase: ``step-00000040: rank-00001/__0_0.distcp has
        10 of its 4096 bytes``; '' when none was skipped."""
        return "; ".join(f"{p.name}: {why}" for p, why in self.skipped)


def newest_intact(directory: str | os.PathLike[str]) -> Choice:
    """The newest checkpoint under ``directory`` that passes :func:`check`, reading newer ones
    first (at most until one passes)."""
    root = Path(directory)
    found = sorted(
        (s, p) for p in (root.glob("step-*") if root.is_dir() else ()) if (s := step_of(p)) >= 0
    )
    skipped: list[tuple[Path, str]] = []
    for _, path in reversed(found):
        why = check(path)
        if why is None:
            return Choice(path, tuple(skipped))
        skipped.append((path, why))
    return Choice(None, tuple(skipped))


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest intact checkpoint under ``directory``, if any."""
    return newest_intact(directory).path


def resume_point(directory: str | os.PathLike[str]) -> tuple[Path | None, str]:
    """What ``--resume DIR`` starts from: DIR itself when it is a checkpoint, else the newest
    checkpoint under it; (path, '') when it passes its check, else (None, one line saying which
    file failed). An explicit resume never falls back to an older checkpoint on its own."""
    root = Path(directory)
    if step_of(root) >= 0 or (root / MANIFEST).is_file() or (root / METADATA).is_file():
        path = root
    else:
        steps = [p for p in (root.glob("step-*") if root.is_dir() else ()) if step_of(p) >= 0]
        if not steps:
            return None, f"--resume: no complete durable checkpoint in {root}"
        path = max(steps, key=step_of)
    why = check(path)
    if why is None:
        return path, ""
    older = newest_intact(path.parent).path
    hint = f"; --resume {older} starts from the newest intact one" if older is not None else ""
    return None, f"--resume: the checkpoint {path} failed its check: {why}{hint}"


def step_of(path: Path) -> int:
    """The step of a checkpoint directory ``step-NNNNNNNN``; -1 for any other name."""
    digits = path.name.removeprefix("step-")
    return int(digits) if path.name.startswith("step-") and digits.isdigit() else -1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
