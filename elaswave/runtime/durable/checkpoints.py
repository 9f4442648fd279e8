"""Durable checkpoints: the last resort when both in-memory copies of a shard are gone.

Every ``durable_every`` committed steps the full training state (parameters and both Adam
moments, gathered from the shards under ZeRO) is written with ``torch.distributed.checkpoint``
by rank 0, from a background thread so the step loop does not wait for the disk. A checkpoint
becomes visible only once complete (written under a temporary name, then renamed, then
``LATEST`` updated atomically). Because it holds whole tensors, any number of workers can load it:
that is how a job falls back after a double loss, and how ``--resume`` restarts on another size.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

log = logging.getLogger(__name__)

LATEST = "LATEST"


@dataclass
class DurableState:
    step: int
    loss: float
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    path: Path


class DurableCheckpoints:
    """Writes ``<dir>/step-00000010`` … and keeps the newest ``keep`` of them."""

    def __init__(self, directory: str | os.PathLike[str], *, keep: int = 2) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable")
        self._pending: Future[Path] | None = None

    def save_async(
        self,
        step: int,
        loss: float,
        params: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        on_done: Callable[[Path, float], None] | None = None,
    ) -> None:
        """Snapshot the tensors now (copies) and write them in the background."""
        state = {
            "params": params.detach().clone(),
            "exp_avg": exp_avg.detach().clone(),
            "exp_avg_sq": exp_avg_sq.detach().clone(),
            "meta": torch.tensor([float(step), loss], dtype=torch.float64),
        }
        if self._pending is not None:
            self._pending.result()  # one write at a time; the previous one is long done
        self._pending = self._pool.submit(self._write, step, state, on_done)

    def _write(
        self,
        step: int,
        state: dict[str, torch.Tensor],
        on_done: Callable[[Path, float], None] | None,
    ) -> Path:
        start = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step-{step:08d}"
        tmp = self.dir / f".step-{step:08d}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming a single process": it is
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = self.dir / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.dir / LATEST)
        for old in sorted(self.dir.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        if on_done is not None:
            on_done(final, time.perf_counter() - start)
        return final

    def flush(self) -> None:
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def discard_after(self, step: int) -> None:
        """Remove the checkpoints newer than ``step`` (saved from a state a later check found
        corrupt) and point ``LATEST`` at the newest one left, if any."""
        self.flush()
        if not self.dir.is_dir():
            return
        left = []
        for path in sorted(self.dir.glob("step-*")):
            if int(path.name.removeprefix("step-")) > step:
                shutil.rmtree(path, ignore_errors=True)
            else:
                left.append(path)
        marker = self.dir / LATEST
        if left:
            tmp = self.dir / f".{LATEST}.tmp"
            tmp.write_text(left[-1].name)
            os.replace(tmp, marker)
        else:
            marker.unlink(missing_ok=True)


def latest(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``directory``, if any."""
    root = Path(directory)
    marker = root / LATEST
    if marker.is_file():
        path = root / marker.read_text().strip()
        if (path / ".metadata").is_file():
            return path
    return None


def load(path: Path, numel: int) -> DurableState:
    """Read a checkpoint written by :class:`DurableCheckpoints` (same model size)."""
    state = {
        "params": torch.zeros(numel),
        "exp_avg": torch.zeros(numel),
        "exp_avg_sq": torch.zeros(numel),
        "meta": torch.zeros(2, dtype=torch.float64),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    step, loss = state["meta"].tolist()
    return DurableState(
        int(step), loss, state["params"], state["exp_avg"], state["exp_avg_sq"], path
    )
