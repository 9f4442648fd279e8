"""Durable checkpoints: the last resort when both in-memory copies of a shard are gone.

Every ``durable_every`` committed steps the full training state (parameters and both Adam
moments) is written with ``torch.distributed.checkpoint``, from a background thread so the step
loop does not wait for the disk, in one of two layouts:

- *whole* (data parallelism, ZeRO-1): rank 0 writes the whole state (gathered from the shards
  under ZeRO);
- *per stage* (pipelines): each rank writes the element intervals it owns — the layers it is the
  first holder of, or with ZeRO inside the stages the moment parts it is primary of — into a
  directory of its own (``rank-00003/``, with ``rank-00003.json`` saying which intervals), and
  nothing is assembled on one rank. Rank 0 commits the checkpoint once every rank of the plan has
  written its part: ``pieces.json`` names the rank that wrote each interval. The checkpoint
  directory must be one every host can reach (a shared filesystem).

A checkpoint becomes visible only once complete (written under a temporary name, with the size
and SHA-256 of every file in its ``checksums.json``, then renamed, then ``LATEST`` updated
atomically); whoever uses one checks those sums first (:mod:`.layout`), so a checkpoint that was
truncated, changed or never finished is never loaded. :func:`load` reads either layout into
whole tensors, so any number of workers and any dp × pp, with or without ZeRO, can resume from
it: that is how a job falls back after a double loss, how ``--resume`` restarts on another
size, and what ``export`` reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elaswave.runtime.durable.layout import (
    LATEST,
    PIECES,
    file_sums,
    files_under,
    latest,
    write_manifest,
)

__all__ = ["LATEST", "PIECES", "DurableCheckpoints", "DurableState", "latest", "load"]

log = logging.getLogger(__name__)

KINDS = ("params", "exp_avg", "exp_avg_sq")
PRUNE = "prune"  # the key of pruning's state in a whole checkpoint (and in a per-rank one's index)
BUFFERS = "buffers"  # the norm layers' running statistics (runtime/runningstats.py), likewise
SCRIPT = "script"  # a script's own registered state (runtime/loop.py), likewise
SIDES = (PRUNE, BUFFERS, SCRIPT)
COMMIT_S = 120.0  # how long rank 0 waits for the other ranks' parts before giving up
FLUSH_S = 10.0  # how long a flush waits for a commit still waiting on other ranks

# (start, stop, parameters, exp_avg, exp_avg_sq) of one flat element interval a rank writes
Piece = tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class DurableState:
    step: int
    loss: float
    params: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    path: Path
    prune: torch.Tensor | None = None  # pruning's redundant set (``Pruner.saved``), if any
    buffers: torch.Tensor | None = None  # running statistics (``RunningStats.saved``), if any
    script: torch.Tensor | None = None  # a script's state (``ScriptState.saved``), if any


class DurableCheckpoints:
    """Writes ``<dir>/step-00000010`` … and keeps the newest ``keep`` of them."""

    def __init__(
        self, directory: str | os.PathLike[str], *, keep: int = 2, commit_s: float = COMMIT_S
    ) -> None:
        self.dir = Path(directory)
        self.keep = keep
        self.commit_s = commit_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable")
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="durable-commit")
        self._pending: Future[Any] | None = None
        self._committing: Future[Any] | None = None
        self._discards = 0  # a commit queued before a discard must not land

    def writing(self) -> bool:
        """Whether a background write is still running (not its commit, which mostly waits for
        the other ranks' parts)."""
        return self._pending is not None and not self._pending.done()

    def save_async(
        self,
        step: int,
        loss: float,
        params: torch.Tensor,
        *,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        on_done: Callable[[Path, float], None] | None = None,
        extra: torch.Tensor | None = None,
        buffers: torch.Tensor | None = None,
        script: torch.Tensor | None = None,
    ) -> None:
        """Snapshot the tensors now (copies) and write them in the background; ``extra``:
        pruning's state, ``buffers`` the running statistics and ``script`` a script's own
        state, kept beside them."""
        state = {  # host copies: an accelerator's memory is not held until the write ends
            "params": _host_copy(params),
            "exp_avg": _host_copy(exp_avg),
            "exp_avg_sq": _host_copy(exp_avg_sq),
            "meta": torch.tensor([float(step), loss], dtype=torch.float64),
        }
        for key, side in zip(SIDES, (extra, buffers, script), strict=True):
            if side is not None:
                state[key] = _host_copy(side)
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
        tmp = self.dir / f".step-{step:08d}.whole.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "assuming a single process": it is
            _dcp().save(state, checkpoint_id=str(tmp), no_dist=True)
        write_manifest(tmp, file_sums(tmp, files_under(tmp)))
        final = self._publish(tmp, step)
        if on_done is not None:
            on_done(final, time.perf_counter() - start)
        return final

    def save_pieces_async(
        self,
        step: int,
        loss: float,
        *,
        rank: int,
        world: int,
        attempt: str,
        pieces: Sequence[Piece],
        on_done: Callable[[Path, float], None] | None = None,
        extra: torch.Tensor | None = None,
        buffers: torch.Tensor | None = None,
        script: torch.Tensor | None = None,
    ) -> None:
        """Snapshot this rank's ``pieces`` now (copies) and write them in the background, beside
        the other ranks' parts of the same checkpoint (``attempt`` names the plan: every rank
        of it passes the same, a redo under a later plan writes afresh). Rank 0 commits the
        checkpoint once every one of the ``world`` ranks has written its part, and then calls
        ``on_done``; its ``extra`` (pruning's state), ``buffers`` (the running statistics) and
        ``script`` (a script's state), the same on every rank, go into the checkpoint's index."""
        state = {
            f"{kind}/{a}-{b}": _host_copy(t)
            for a, b, *tensors in pieces
            for kind, t in zip(KINDS, tensors, strict=True)
        }
        intervals = [[a, b] for a, b, *_ in pieces]
        if self._pending is not None:
            self._pending.result()
        tmp = self.dir / f".step-{step:08d}.{attempt}.tmp"
        self._pending = self._pool.submit(self._write_part, tmp, rank, state, intervals=intervals)
        if rank == 0:
            if self._committing is not None:
                self._committing.result()
            sides = {
                key: side.tolist()
                for key, side in zip(SIDES, (extra, buffers, script), strict=True)
                if side is not None
            }
            self._committing = self._committer.submit(
                self._commit,
                tmp,
                step,
                loss,
                world=world,
                own=self._pending,
                discards=self._discards,
                on_done=on_done,
                sides=sides,
            )

    def _write_part(
        self, tmp: Path, rank: int, state: dict[str, torch.Tensor], *, intervals: list[list[int]]
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        name = f"rank-{rank:05d}"
        if state:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming a single process"
                _dcp().save(state, checkpoint_id=str(tmp / name), no_dist=True)
        files = file_sums(tmp, files_under(tmp / name, f"{name}/")) if state else {}
        _write_json(tmp / f"{name}.json", {"intervals": intervals, "files": files})

    def _commit(
        self,
        tmp: Path,
        step: int,
        loss: float,
        *,
        world: int,
        own: Future[Any],
        discards: int,
        on_done: Callable[[Path, float], None] | None,
        sides: dict[str, list[float]] | None = None,
    ) -> Path | None:
        """Rank 0: once every rank's part is written, index them and make the checkpoint
        visible. A rank that died before writing its part leaves the checkpoint uncommitted
        (the previous one stays the newest)."""
        start = time.perf_counter()
        own.result()
        deadline = time.monotonic() + self.commit_s
        while len(parts := sorted(tmp.glob("rank-*.json"))) < world:
            if time.monotonic() > deadline:
                log.warning("checkpoint of step %d: %d of %d parts", step, len(parts), world)
                return None
            time.sleep(0.05)
        docs = {p: json.loads(p.read_text()) for p in parts}
        pieces = sorted(
            [a, b, int(p.stem.removeprefix("rank-"))]
            for p, doc in docs.items()
            for a, b in doc["intervals"]
        )
        numel = 0
        for a, b, _ in pieces:  # the parts tile the model exactly
            if a != numel:
                log.warning("durable checkpoint of step %d: its parts do not tile the model", step)
                return None
            numel = b
        if discards != self._discards:  # the state it holds was found corrupt meanwhile
            return None
        index = {"step": step, "loss": loss, "numel": numel, "pieces": pieces, **(sides or {})}
        _write_json(tmp / PIECES, index)
        sums = {name: sum_ for doc in docs.values() for name, sum_ in doc["files"].items()}
        sums |= file_sums(tmp, [PIECES, *(p.name for p in parts)])
        write_manifest(tmp, sums)  # every rank's files by its own sums; they now count
        final = self._publish(tmp, step)
        if on_done is not None:
            on_done(final, time.perf_counter() - start)
        return final

    def _publish(self, tmp: Path, step: int) -> Path:
        """Rename a complete checkpoint into place, point ``LATEST`` at it, drop older ones."""
        final = self.dir / f"step-{step:08d}"
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        latest_tmp = self.dir / f".{LATEST}.tmp"
        latest_tmp.write_text(final.name)
        os.replace(latest_tmp, self.dir / LATEST)
        for old in sorted(self.dir.glob("step-*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in self.dir.glob(".step-*.tmp"):  # parts of checkpoints never committed
            if _step_of(stale) <= step:
                shutil.rmtree(stale, ignore_errors=True)
        return final

    def flush(self, *, commits: bool = True) -> None:
        """Wait for this rank's writes and (``commits``) for a commit waiting on other ranks,
        at most ``FLUSH_S`` for that one."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None
        if commits and self._committing is not None:
            with contextlib.suppress(TimeoutError):
                self._committing.result(timeout=FLUSH_S)

    def discard_after(self, step: int) -> None:
        """Remove the checkpoints newer than ``step`` (saved from a state a later check found
        corrupt) and point ``LATEST`` at the newest one left, if any."""
        self._discards += 1
        self.flush(commits=False)  # a commit still waiting will not land
        if not self.dir.is_dir():
            return
        for stale in self.dir.glob(".step-*.tmp"):
            if _step_of(stale) > step:
                shutil.rmtree(stale, ignore_errors=True)
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


def load(path: Path, numel: int) -> DurableState:
    """Read a checkpoint written by :class:`DurableCheckpoints`, whole or per stage, into whole
    tensors (same model size)."""
    if (path / PIECES).is_file():
        return _load_pieces(path, numel)
    state = {
        "params": torch.zeros(numel),
        "exp_avg": torch.zeros(numel),
        "exp_avg_sq": torch.zeros(numel),
        "meta": torch.zeros(2, dtype=torch.float64),
    }
    stored = _dcp().FileSystemReader(str(path)).read_metadata().state_dict_metadata
    for key in SIDES:
        if key in stored:
            state[key] = torch.zeros(stored[key].size, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        _dcp().load(state, checkpoint_id=str(path), no_dist=True)
    step, loss = state["meta"].tolist()
    return DurableState(
        int(step), loss, state["params"], state["exp_avg"], state["exp_avg_sq"], path,
        state.get(PRUNE), state.get(BUFFERS), state.get(SCRIPT),
    )  # fmt: skip


def _load_pieces(path: Path, numel: int) -> DurableState:
    index = json.loads((path / PIECES).read_text())
    if index["numel"] != numel:
        raise ValueError(
            f"{path} holds a model of {index['numel']} parameters, this one has {numel}"
        )
    whole = {kind: torch.zeros(numel) for kind in KINDS}
    by_rank: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for a, b, rank in index["pieces"]:
        by_rank[rank].append((a, b))
    for rank, intervals in sorted(by_rank.items()):
        state = {f"{kind}/{a}-{b}": whole[kind][a:b] for kind in KINDS for a, b in intervals}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            _dcp().load(state, checkpoint_id=str(path / f"rank-{rank:05d}"), no_dist=True)
    prune, buffers, script = (
        torch.tensor(index[key], dtype=torch.float64) if key in index else None for key in SIDES
    )
    return DurableState(
        int(index["step"]), float(index["loss"]), whole["params"], whole["exp_avg"],
        whole["exp_avg_sq"], path, prune, buffers, script,
    )  # fmt: skip


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def _step_of(tmp: Path) -> int:
    return int(tmp.name.split(".")[1].removeprefix("step-"))


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in host memory (a clone on the CPU) for a background write."""
    return t.detach().to("cpu", copy=True)


def _dcp() -> Any:
    """``torch.distributed.checkpoint``, imported at its first use: it costs a worker more than
    a second at start-up (DTensor and its operator tables), and most runs write no checkpoint
    until their end. A forked worker finds it already imported by the template."""
    import torch.distributed.checkpoint as dcp

    return dcp
