"""A job's config as hosts compare it and as its run directory records it.

Every host of a running job trains the same model on the same data with the same training
settings (:func:`training_config`); a relaunch of a job id trains the same model on the same data
as the earlier run (:func:`same_job`: the training settings, the number of steps among them, may
change); ``config.json`` holds the config with absolute paths (:func:`run_record`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from elaswave.config.job import JobConfig

__all__ = ["config_difference", "run_record", "same_job", "training_config"]


def training_config(cfg: JobConfig) -> dict[str, Any]:
    """The sections every host of a job must agree on (the data as
    :meth:`~elaswave.config.DataConfig.agreed` gives it: text by its content key; ``logging``
    too: one stream per job, and pipelines take the gradient norm for it with a collective;
    ``workers_per_device``: it picks the backend every group of the job is built on)."""
    full = cfg.to_dict()
    sections = {"model": full["model"], "data": cfg.data.agreed(), "train": full["train"]}
    return (
        sections
        | {"logging": full["logging"]}
        | {
            "nproc_per_node": cfg.elastic.nproc_per_node,
            "nnodes": cfg.elastic.nnodes,
            "workers_per_device": cfg.elastic.workers_per_device,
        }
    )


def same_job(cfg: JobConfig) -> dict[str, Any]:
    """What a relaunch must train the same as the earlier run of its job id: the model and the
    data."""
    return {"model": dataclasses.asdict(cfg.model), "data": cfg.data.agreed()}


def config_difference(theirs: dict[str, Any], mine: dict[str, Any], prefix: str = "") -> str:
    """The first differing key as ``key: job has X, this host Y`` ('' when equal)."""
    for key in sorted(set(theirs) | set(mine)):
        a, b = theirs.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found = config_difference(a, b, f"{prefix}{key}.")
            if found:
                return found
        elif a != b:
            return f"{prefix}{key}: job has {a!r}, this host {b!r}"
    return ""


def run_record(cfg: JobConfig, run_dir: Path) -> dict[str, Any]:
    """The job's config as ``config.json`` holds it: its paths made absolute, so that it reads
    the same from anywhere (what ``elaswave export`` rebuilds the model from)."""
    record = cfg.to_dict()
    for section, key in (("model", "pretrained"), ("data", "path")):
        if record[section][key]:
            record[section][key] = str(Path(record[section][key]).resolve())
    record["run_dir"] = str(run_dir.resolve())
    record["durable_dir"] = str(cfg.resolved_durable_dir.resolve())
    return record
