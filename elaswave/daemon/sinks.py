"""Where the job's stream lands: TensorBoard event files and a W&B run.

:mod:`~elaswave.daemon.streams` drives them (the event files from the daemon's event loop and
the stream's thread, under a lock; the W&B run from the thread only). Their packages are
imported by :func:`load_packages` when the daemon is built, before its event loop runs (an
import on the thread while the loop runs could hold an import lock the loop needs), and only
for a job that logs to them: neither imports torch.

**TensorBoard** (:class:`TensorBoardFiles`): events are written with TensorBoard's own record
writer and protos (``tensorboard.summary.writer.record_writer``, ``tensorboard.compat.proto``;
torch is not needed). A host writes into one event file for as long as the records it lands
follow one another; when another host recorded the step before (rank 0 moved, a leader change
with it) it opens a new file whose name sorts after every file before it in the stream
(:func:`~elaswave.daemon.streamplan.event_file_name`). TensorBoard reads the files of a run in
name order, so several hosts writing into one directory make one stream, and a directory copied
together from several hosts (no shared filesystem) is that stream again.

**W&B** (:class:`WandbRun`): one run per launch of a job (the same id on every host), with the
job's config; ``mode: offline`` writes it under ``<run_dir>/wandb`` for ``wandb sync`` later.
"""

from __future__ import annotations

import importlib
import logging
from pathlib import Path
from typing import Any, BinaryIO

from elaswave.config.observe import PACKAGES, LoggingConfig, WandbConfig
from elaswave.daemon.streamplan import Entry, event_file_name, wandb_rows
from elaswave.errors import ConfigError

log = logging.getLogger(__name__)

FILE_VERSION = "brain.Event:2"  # what TensorBoard's own writers put first in every event file

MODULES = {  # what each sink imports
    "tensorboard": (
        "tensorboard.compat.proto.event_pb2",
        "tensorboard.compat.proto.summary_pb2",
        "tensorboard.compat.proto.tensor_pb2",
        "tensorboard.compat.proto.types_pb2",
        "tensorboard.plugins.text.metadata",
        "tensorboard.summary.writer.record_writer",
    ),
    "wandb": ("wandb",),
}


def load_packages(cfg: LoggingConfig) -> None:
    """Import what the section's streams need; a package that cannot be imported is one line
    naming its extra."""
    for stream in cfg.streams:
        for name in MODULES[stream]:
            try:
                importlib.import_module(name)
            except Exception as exc:  # noqa: BLE001 - a broken install: one line, not a trace
                package, extra = PACKAGES[stream]
                raise ConfigError(
                    f"logging.{stream}: cannot import {name} ({type(exc).__name__}: {exc}); "
                    f"pip install 'elaswave[{extra}]'"
                ) from None


class TensorBoardFiles:
    """This host's event files in the job's TensorBoard run directory."""

    def __init__(self, directory: Path, *, host: str, started: float) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, types_pb2
        from tensorboard.plugins.text import metadata as text_metadata
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2, self._summary_pb2 = event_pb2, summary_pb2
        self._tensor_pb2, self._types_pb2 = tensor_pb2, types_pb2
        self._text_metadata = text_metadata
        self._record_writer = RecordWriter
        self.directory = directory
        self.host = host
        self.started = started
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file: BinaryIO | None = None
        self._writer: Any = None
        self.key: int | None = None  # the key of the file open now (None: none yet)
        self.paths: list[Path] = []  # every file this host opened, in order

    def write(self, entries: list[Entry], *, key: int | None, continues: bool) -> None:
        """Append ``entries``; a new file first when they do not continue this host's newest
        records (``key``: the revision that orders it; None: keep the file, or the last key)."""
        if not entries:
            return
        if self._file is None or not continues:
            self._open(key if key is not None else (self.key or 0))
        for entry in entries:
            self._writer.write(self._event(entry).SerializeToString())
        self._writer.flush()

    def _open(self, key: int) -> None:
        self.close()
        path = self.directory / event_file_name(self.started, key, self.host)
        self._file = open(path, "ab")  # noqa: SIM115 - kept open until the next file or close
        self._writer = self._record_writer(self._file)
        self.key = key
        self.paths.append(path)
        if self._file.tell() == 0:
            version = self._event_pb2.Event(wall_time=self.started, file_version=FILE_VERSION)
            self._writer.write(version.SerializeToString())

    def _event(self, entry: Entry) -> Any:
        pb = self._event_pb2
        event = pb.Event(wall_time=entry.wall_time, step=entry.step)
        if entry.restart:
            event.session_log.status = pb.SessionLog.START
            return event
        values = [
            self._summary_pb2.Summary.Value(tag=tag, simple_value=value)
            for tag, value in entry.scalars
        ]
        for tag, text in entry.texts:
            tensor = self._tensor_pb2.TensorProto(
                dtype=self._types_pb2.DT_STRING, string_val=[text.encode("utf-8")]
            )
            meta = self._text_metadata.create_summary_metadata(display_name=tag, description="")
            values.append(self._summary_pb2.Summary.Value(tag=tag, metadata=meta, tensor=tensor))
        event.summary.value.extend(values)
        return event

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer = None, None


class WandbRun:
    """The job's W&B run, as this host logs into it."""

    def __init__(
        self,
        cfg: WandbConfig,
        *,
        run_id: str,
        name: str,
        directory: Path,
        config: dict[str, Any],
    ) -> None:
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=cfg.project, mode=cfg.mode, id=run_id, name=name, dir=str(directory),
            resume="allow", config=config,
            settings=wandb.Settings(silent=True, console="off"),  # never the daemon's terminal
        )  # fmt: skip
        self.step = 0  # the newest step logged: W&B takes steps in order only
        self.skipped = 0  # rows of steps already past (redone after a rollback)

    def write(self, entries: list[Entry]) -> None:
        for step, values in wandb_rows(entries):
            if step < self.step:
                self.skipped += 1
                continue
            self.run.log(values, step=step)
            self.step = step

    def close(self) -> None:
        if self.skipped:
            log.warning("W&B: %d rows of redone steps not logged (a run cannot go back)",
                        self.skipped)  # fmt: skip
        self.run.finish()
