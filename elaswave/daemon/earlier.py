"""What earlier runs of a job id left on this host and in etcd, for the relaunch decision
(:mod:`elaswave.planning.relaunch`), and ``--fresh``, which moves it aside.

Read before the new run writes anything: the run directory's ``metrics.jsonl`` (the newest
committed step and its epoch), ``config.json`` (what the earlier run trained: a relaunch must
train the same model on the same data), and the newest complete durable checkpoint. Without
torch: ``launch`` reads it before any worker exists.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from elaswave.config import JobConfig
from elaswave.config.jobs import config_difference, run_record, same_job
from elaswave.errors import ElasWaveError
from elaswave.events import METRICS_FILE, RUN_CONFIG, read_jsonl
from elaswave.planning.relaunch import Records
from elaswave.runtime.durable.layout import LATEST, newest_intact

__all__ = [
    "PREVIOUS",
    "archive",
    "etcd_records",
    "run_dir_records",
    "write_run_config",
]

PREVIOUS = "previous"  # where --fresh moves an earlier run's records, one folder per move


def run_dir_records(run_dir: Path, durable_dir: Path, cfg: JobConfig) -> Records | None:
    """What the run directory (and the checkpoint directory) of an earlier run of ``cfg``'s job
    id hold; None if nothing."""
    committed = epoch = 0
    for line in read_jsonl(run_dir / METRICS_FILE):
        if "kind" not in line:  # a step record (not an evaluation or a script's log)
            committed = max(committed, int(line.get("step", 0)))
            epoch = max(epoch, int(line.get("epoch", 0)))
    found = newest_intact(durable_dir)
    if not committed and found.path is None and not found.skipped:
        return None
    return Records(
        committed=committed,
        epoch=epoch,
        where=f"run directory {run_dir}",
        checkpoint=found.step,
        checkpoint_dir=str(durable_dir),
        checkpoint_failed=found.failures(),
        config_diff=_config_diff(run_dir / RUN_CONFIG, cfg),
    )


def etcd_records(
    progress: dict[str, Any] | None, plan_epoch: int, *, config_diff: str = ""
) -> Records | None:
    """What the job's records in etcd say (they outlive the hosts on an external etcd): the
    progress record's step and epoch (or the plan's), and how what it trained differs."""
    step = int((progress or {}).get("step", 0))
    epoch = max(plan_epoch, int((progress or {}).get("epoch", 0)))
    if not step:
        return None
    return Records(committed=step, epoch=epoch, where="its progress record in etcd",
                   config_diff=config_diff)  # fmt: skip


def _config_diff(path: Path, cfg: JobConfig) -> str:
    """The first model or data setting in which ``cfg`` differs from the earlier run's config
    (``path``), '' if none or if the earlier one cannot be read (then nothing is compared)."""
    try:
        earlier = JobConfig.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, ElasWaveError):
        return ""
    if earlier.job_id != cfg.job_id:
        return f"the run directory holds job {earlier.job_id!r}"
    now = JobConfig.from_dict(run_record(cfg, cfg.resolved_run_dir))
    return config_difference(same_job(earlier), same_job(now)).replace("job has", "it had", 1)


def write_run_config(cfg: JobConfig, run_dir: Path) -> None:
    """The job's config as it runs, in ``<run_dir>/config.json`` (:func:`run_record`): written
    once the host is in the job, so that a launch refused (another model, say) leaves the
    earlier run's config as it was."""
    tmp = run_dir / f".{RUN_CONFIG}.tmp"
    tmp.write_text(json.dumps(run_record(cfg, run_dir), indent=1))
    os.replace(tmp, run_dir / RUN_CONFIG)


def archive(run_dir: Path, durable_dir: Path) -> Path | None:
    """``--fresh``: move an earlier run's records (``metrics.jsonl``, ``events.jsonl``,
    ``config.json``, logs) and its checkpoints aside, into ``<run_dir>/previous/<time>/``
    (checkpoints outside the run directory into ``<durable_dir>/previous/<time>/``). Returns
    where they went (None: there was nothing)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved: Path | None = None
    if run_dir.is_dir():
        keep = {PREVIOUS}
        items = [p for p in run_dir.iterdir() if p.name not in keep]
        if items:
            moved = _unique(run_dir / PREVIOUS / stamp)
            for item in items:
                shutil.move(str(item), moved / item.name)
    inside = moved is not None and _is_within(durable_dir, run_dir)
    if durable_dir.is_dir() and not inside:
        items = [p for p in durable_dir.iterdir() if p.name.startswith("step-") or p.name == LATEST]
        if items:
            target = _unique(durable_dir / PREVIOUS / stamp)
            for item in items:
                shutil.move(str(item), target / item.name)
            moved = moved or target
    return moved


def _unique(path: Path) -> Path:
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    candidate.mkdir(parents=True)
    return candidate


def _is_within(path: Path, parent: Path) -> bool:
    try:
        path.resolve().relative_to(parent.resolve())
    except ValueError:
        return False
    return True
