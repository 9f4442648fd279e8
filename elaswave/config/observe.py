"""Where the job's training curves go besides ``metrics.jsonl``: a TensorBoard event stream and a
Weights & Biases run (the ``logging`` section; both optional, each through an extra of its own).

Every host of a job must give the same section (it is part of what the hosts agree on): the
stream is one per job, written by whichever host records a step, and pipelines take the
gradient norm with one more collective when a stream wants it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal, get_args

from elaswave.errors import ConfigError

# How the W&B run is kept (``logging.wandb.mode``).
WandbMode = Literal["online", "offline", "disabled"]
WANDB_MODES: tuple[WandbMode, ...] = get_args(WandbMode)

# what each stream needs installed, and the extra that installs it
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb")}


@dataclass(kw_only=True)
class WandbConfig:
    """One W&B run per job (``logging.wandb``)."""

    project: str = "elaswave"
    """The W&B project the run is logged to (not empty)."""
    mode: WandbMode = "online"
    """online | offline (files under <run_dir>/wandb, sync later) | disabled."""

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ConfigError(
                f"logging.wandb.mode must be one of {', '.join(WANDB_MODES)}, got {self.mode!r}"
            )
        if not self.project.strip():
            raise ConfigError("logging.wandb.project must not be empty")


@dataclass(kw_only=True)
class LoggingConfig:
    """``logging.tensorboard: DIR`` writes the job's event stream under ``DIR/<job-id>/``;
    ``logging.wandb: {project, mode}`` logs the same numbers to one W&B run."""

    tensorboard: str | None = None
    """A directory: the job's TensorBoard event stream goes under ``DIR/<job-id>/``; None: none."""
    wandb: WandbConfig | None = None
    """The W&B run the same numbers go to; None: none."""

    def __post_init__(self) -> None:
        if self.tensorboard is not None and not str(self.tensorboard).strip():
            raise ConfigError("logging.tensorboard must be a directory")

    @property
    def streams(self) -> tuple[str, ...]:
        """The streams this section asks for, by package name."""
        wanted = []
        if self.tensorboard is not None:
            wanted.append("tensorboard")
        if self.wandb is not None and self.wandb.mode != "disabled":
            wanted.append("wandb")
        return tuple(wanted)

    @property
    def enabled(self) -> bool:
        """Whether any stream is written (the workers then report the gradient norm)."""
        return bool(self.streams)


def check_packages(cfg: LoggingConfig) -> None:
    """A stream whose package is not installed: one line naming the extra (before the job)."""
    for stream in cfg.streams:
        package, extra = PACKAGES[stream]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"logging.{stream} needs the {package} package: pip install 'elaswave[{extra}]'"
            )
