"""What ``launch`` shows while it prepares ``data.source: text``: on a terminal a progress bar
per phase (hashing the files, which every launch does and which leaves no trace; tokenizing,
on a cache miss), elsewhere a plain line when tokenizing starts; everywhere the notes the
corpus gives (tokenized into a file, a cached file reused, another launch waited for).
``--quiet`` shows none of it."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

__all__ = ["TokenizingView"]


class TokenizingView:
    """An :class:`elaswave.data.text.Progress` on a rich console."""

    def __init__(self, console: Console, *, interactive: bool) -> None:
        self.console = console
        self.interactive = interactive
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def note(self, line: str) -> None:
        self.console.print(line, highlight=False, soft_wrap=True)

    def start(self, what: str, total: int) -> None:
        if not self.interactive:
            if what == "tokenizing":
                self.note(f"tokenizing {_size(total)} of text (once: the tokens are cached)")
            return
        self._bar = Progress(
            TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(),
            console=self.console, transient=what != "tokenizing",
        )  # fmt: skip
        self._task = self._bar.add_task(what, total=total)
        self._bar.start()

    def advance(self, nbytes: int) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, nbytes)

    def stop(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar, self._task = None, None


def _size(nbytes: int) -> str:
    """``812 bytes``, ``1.2 MB``."""
    size, unit = float(nbytes), "bytes"
    for bigger in ("KB", "MB", "GB"):
        if size < 1000:
            break
        size, unit = size / 1000, bigger
    return f"{nbytes} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
