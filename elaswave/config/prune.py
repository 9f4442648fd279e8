"""Structured pruning while training (``train.prune``): OTOv2's DHSPG over zero-invariant groups.

Off by default. The hyper-parameters left unset take OTOv2's defaults for the optimizer the job
trains with (its Adam defaults for AdamW, its SGD defaults for SGD): :meth:`PruneConfig.resolved`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from elaswave.errors import ConfigError

# The pruning algorithms (``train.prune.method``).
Method = Literal["dhspg"]
METHODS: tuple[Method, ...] = get_args(Method)

# OTOv2's defaults (only_train_once/optimizer/hyperparameter.py): (lmbda, lmbda_amplify,
# hat_lmbda_coeff) for its Adam variants and for SGD.
DEFAULTS = {"adamw": (1e-2, 20.0, 1e3), "sgd": (1e-3, 2.0, 10.0)}


@dataclass(kw_only=True)
class PruneConfig:
    """DHSPG: at ``partition_step`` the groups are split into a redundant set (a
    ``target_sparsity + tolerance`` share of them, by OTOv2's saliency score) and the rest;
    from then on the redundant groups are pulled towards zero, and from ``start_step`` a
    half-space projection sets a redundant group exactly to zero once the step would carry it
    across the origin. Pruning stops pulling once ``target_sparsity`` of the groups are zero;
    a group once zero stays zero."""

    method: Method = "dhspg"
    """The pruning algorithm: dhspg (OTOv2's DHSPG, the only one)."""
    target_sparsity: float = 0.5
    """The share of zero-invariant groups to drive to zero."""
    tolerance: float = 0.05
    """The sparsity ends in [target, target + tolerance]."""
    start_step: int = 1
    """The first step that projects groups onto zero."""
    partition_step: int | None = None
    """The step that picks the redundant set (default start)."""
    epsilon: float = 0.0
    """The half-space's margin (OTOv2's epsilon)."""
    lmbda: float | None = None
    """The base penalty (default: OTOv2's for the optimizer)."""
    lmbda_amplify: float | None = None
    """The factor that raises a redundant group's penalty where its step points away from zero
    (default: OTOv2's for the optimizer)."""
    hat_lmbda_coeff: float | None = None
    """The raised penalty's cap, as a multiple of lmbda (default: OTOv2's for the optimizer)."""
    uniform: bool = False
    """Pick the same number of redundant groups in every layer's family of a kind, so that the
    compressed model has one width per kind (what a standard HF config can express)."""
    kinds: list[str] = field(default_factory=list)
    """Only groups of these kinds (attention, mlp: declared by the transformer families;
    channels: traced); empty: every group the model has."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"train.prune.method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if not 0 < self.target_sparsity < 1:  # also rejects NaN
            raise ConfigError(
                f"train.prune.target_sparsity must be in (0, 1), got {self.target_sparsity}"
            )
        if not 0 <= self.tolerance < 1 - self.target_sparsity:
            raise ConfigError(
                "train.prune.tolerance must be >= 0 and below 1 - target_sparsity, got "
                f"{self.tolerance}"
            )
        if self.start_step < 1:
            raise ConfigError(f"train.prune.start_step must be >= 1, got {self.start_step}")
        if self.partition_step is not None and not 1 <= self.partition_step <= self.start_step:
            raise ConfigError(
                f"train.prune.partition_step must be in [1, start_step={self.start_step}], got "
                f"{self.partition_step}"
            )
        if not self.epsilon >= 0:
            raise ConfigError(f"train.prune.epsilon must be >= 0, got {self.epsilon}")
        for name in ("lmbda", "lmbda_amplify", "hat_lmbda_coeff"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"train.prune.{name} must be > 0, got {value}")

    @property
    def partition_at(self) -> int:
        return self.start_step if self.partition_step is None else self.partition_step

    def resolved(self, optimizer: str) -> PruneConfig:
        """This config with every unset hyper-parameter at OTOv2's default for ``optimizer``."""
        lmbda, amplify, hat = DEFAULTS[optimizer]
        return replace(
            self,
            lmbda=lmbda if self.lmbda is None else self.lmbda,
            lmbda_amplify=amplify if self.lmbda_amplify is None else self.lmbda_amplify,
            hat_lmbda_coeff=hat if self.hat_lmbda_coeff is None else self.hat_lmbda_coeff,
        )
