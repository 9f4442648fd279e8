"""Structured pruning while training (``train.prune``) over zero-invariant groups: OTOv2's DHSPG
or OTOv3's HESSO.

Off by default. The hyper-parameters left unset take the reference's defaults: DHSPG's for the
optimizer the job trains with (its Adam defaults for AdamW, its SGD defaults for SGD), HESSO's
schedule (:meth:`PruneConfig.resolved`).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Literal, get_args

from elaswave.errors import ConfigError

# The pruning algorithms (``train.prune.method``).
Method = Literal["dhspg", "hesso"]
METHODS: tuple[Method, ...] = get_args(Method)

# The settings only one method reads: a setting of the other method's is refused.
ONLY = {
    "dhspg": ("partition_step", "tolerance", "epsilon", "lmbda", "lmbda_amplify",
              "hat_lmbda_coeff"),
    "hesso": ("pruning_steps", "pruning_periods"),
}  # fmt: skip
# OTOv3's defaults for HESSO (only_train_once's ``hesso()``): one period of one step.
HESSO_DEFAULTS = {"pruning_steps": 1, "pruning_periods": 1}
USUAL_EPSILON = 0.9  # the low end of the reference tutorials' epsilon (0.9-0.95)

# OTOv2's defaults (only_train_once/optimizer/hyperparameter.py): (lmbda, lmbda_amplify,
# hat_lmbda_coeff) for its Adam variants and for SGD.
DEFAULTS = {"adamw": (1e-2, 20.0, 1e3), "sgd": (1e-3, 2.0, 10.0)}


@dataclass(kw_only=True)
class PruneConfig:
    """Structured pruning of a ``target_sparsity`` share of the model's zero-invariant groups.

    DHSPG (``method: dhspg``): at ``partition_step`` the groups are split into a redundant set (a
    ``target_sparsity + tolerance`` share of them, by OTOv2's saliency score) and the rest;
    from then on the redundant groups are pulled towards zero, and from ``start_step`` a
    half-space projection sets a redundant group exactly to zero once the step would carry it
    across the origin. Pruning stops pulling once ``target_sparsity`` of the groups are zero;
    a group once zero stays zero.

    HESSO (``method: hesso``): from ``start_step``, ``pruning_steps`` are cut into
    ``pruning_periods`` periods; each period picks the next share of the groups (the
    lowest saliency among those not picked yet) and shrinks them linearly to exactly zero by its
    last step, while the other groups train as without pruning; a picked group stays zero."""

    method: Method = "dhspg"
    """The pruning algorithm: dhspg (OTOv2's DHSPG) or hesso (OTOv3's HESSO)."""
    target_sparsity: float = 0.5
    """The share of zero-invariant groups to drive to zero."""
    tolerance: float = 0.05
    """The sparsity ends in [target, target + tolerance]."""
    start_step: int = 1
    """dhspg: the first step that projects groups onto zero; hesso: the first step of the
    first period."""
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
    pruning_steps: int | None = None
    """hesso: the steps the periods take, from start_step (default 1, the reference's)."""
    pruning_periods: int | None = None
    """hesso: how many periods pick and shrink groups (default 1, the reference's)."""
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
        if self.method == "dhspg" and not 0 <= self.tolerance < 1 - self.target_sparsity:
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
        for name in ("pruning_steps", "pruning_periods"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"train.prune.{name} must be >= 1, got {value}")
        steps = self.pruning_steps or HESSO_DEFAULTS["pruning_steps"]
        if self.pruning_periods is not None and self.pruning_periods > steps:
            raise ConfigError(
                f"train.prune.pruning_periods must be at most pruning_steps ({steps}), got "
                f"{self.pruning_periods}"
            )
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        for other, names in ONLY.items():
            for name in names:
                if other != self.method and getattr(self, name) != defaults[name]:
                    raise ConfigError(
                        f"train.prune.{name} is a setting of method {other}, not of "
                        f"{self.method}: remove it or set train.prune.method: {other}"
                    )

    @property
    def partition_at(self) -> int:
        return self.start_step if self.partition_step is None else self.partition_step

    @property
    def pruning_ends(self) -> int:
        """hesso: the step whose end leaves every picked group zero (the last period's last step:
        the periods take ``pruning_steps // pruning_periods`` steps each)."""
        steps = self.pruning_steps or HESSO_DEFAULTS["pruning_steps"]
        periods = self.pruning_periods or HESSO_DEFAULTS["pruning_periods"]
        return self.start_step + periods * (steps // periods) - 1

    def resolved(self, optimizer: str) -> PruneConfig:
        """This config with every unset hyper-parameter at the reference's default: DHSPG's for
        ``optimizer``, HESSO's schedule."""
        if self.method == "hesso":
            steps, periods = self.pruning_steps, self.pruning_periods
            return replace(
                self,
                pruning_steps=HESSO_DEFAULTS["pruning_steps"] if steps is None else steps,
                pruning_periods=HESSO_DEFAULTS["pruning_periods"] if periods is None else periods,
            )
        lmbda, amplify, hat = DEFAULTS[optimizer]
        return replace(
            self,
            lmbda=lmbda if self.lmbda is None else self.lmbda,
            lmbda_amplify=amplify if self.lmbda_amplify is None else self.lmbda_amplify,
            hat_lmbda_coeff=hat if self.hat_lmbda_coeff is None else self.hat_lmbda_coeff,
        )

    def shortfall(self, sparsity: float | None, *, last_step: int) -> str | None:
        """One line when a run that ended at ``last_step`` with group ``sparsity`` (None: it
        never pruned) stays below its target, naming the setting that would change it; None
        when the target is reached."""
        if sparsity is not None and sparsity >= self.target_sparsity - 1e-9:
            return None
        reached = 0.0 if sparsity is None else sparsity
        head = (
            f"train.prune: ended at group sparsity {reached:.2f}, below its target "
            f"{self.target_sparsity:.2f}"
        )
        if self.method == "hesso":
            return (
                f"{head}: its periods end at step {self.pruning_ends}, after the run's last step "
                f"{last_step}: lower train.prune.pruning_steps "
                f"({self.pruning_steps or HESSO_DEFAULTS['pruning_steps']} now) or "
                "train.prune.start_step, or train more steps"
            )
        if self.epsilon < USUAL_EPSILON:
            return (
                f"{head}: raise train.prune.epsilon ({self.epsilon} now; 0.9-0.95 is usual for "
                "short runs) or train more steps"
            )
        lmbda = "its optimizer's default" if self.lmbda is None else f"{self.lmbda} now"
        return f"{head}: raise train.prune.lmbda ({lmbda}) or train more steps"
