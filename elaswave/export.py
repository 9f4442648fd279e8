"""Getting the trained model back: ``elaswave export``.

A run keeps its config (``<run_dir>/config.json``, written at launch) and its state as durable
checkpoints: every ``durable_every`` steps, and the last step's with ``train.save_final`` (the
default). Export rebuilds the workload's layers from the config, loads a checkpoint's parameters
into them and lets the workload write them: a Hugging Face model as a directory that
``AutoModelForCausalLM.from_pretrained`` loads, any other workload as one safetensors file keyed
by its global parameter names (``layers.<index>.<name>``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from elaswave.config import JobConfig
from elaswave.errors import ConfigError, ElasWaveError

__all__ = ["Exported", "export_model", "find_checkpoint", "run_config"]


@dataclass(frozen=True)
class Exported:
    step: int  # the step whose state was written
    loss: float  # that step's loss
    checkpoint: Path
    out: Path


def run_config(run_dir: Path) -> JobConfig:
    """The config a run was launched with."""
    from elaswave.events import RUN_CONFIG

    path = run_dir / RUN_CONFIG
    if not path.is_file():
        raise ElasWaveError(f"no run found at {run_dir} (missing {RUN_CONFIG})")
    try:
        return JobConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as exc:
        raise ElasWaveError(f"{path}: not a run config ({exc})") from None


def find_checkpoint(directory: Path, step: int | None) -> Path:
    """The checkpoint of ``step`` under ``directory``, or the newest one (``LATEST``)."""
    from elaswave.runtime.durable.layout import complete, latest

    if step is None:
        path = latest(directory)
        if path is None:
            raise ElasWaveError(
                f"no saved state in {directory}: the run ended before its last step without "
                "durable checkpoints, or ran with train.save_final: false"
            )
        return path
    path = directory / f"step-{step:08d}"
    if not complete(path):
        have = sorted(
            int(p.name.removeprefix("step-")) for p in directory.glob("step-*") if complete(p)
        )
        listed = ", ".join(map(str, have)) or "none"
        raise ElasWaveError(f"no checkpoint of step {step} in {directory} (steps kept: {listed})")
    return path


def export_model(run_dir: Path, out: Path, step: int | None = None) -> Exported:
    """Write the model of ``run_dir`` at ``step`` (default: its newest saved state) to ``out``."""
    from elaswave.runtime.durable.checkpoints import load
    from elaswave.runtime.optim import FlatParams
    from elaswave.runtime.workload.base import build_layers
    from elaswave.runtime.workload.load import load_workload

    if out.exists():
        raise ConfigError(f"--out {out} already exists (remove it, or choose another path)")
    cfg = run_config(run_dir)
    path = find_checkpoint(cfg.resolved_durable_dir, step)
    workload = load_workload(cfg)
    model = build_layers(workload, cfg.train.seed)
    flat = FlatParams(model)
    state = load(path, flat.numel)
    flat.data.copy_(state.params)
    out.parent.mkdir(parents=True, exist_ok=True)
    workload.export(model, out)
    return Exported(state.step, state.loss, path, out)
