"""One typed fault specification shared by the CLI, config files, the daemon and the tests.

Text form (``launch --fault`` and ``ELASWAVE_FAULTS``)::

    kill,rank=1,at_step=15          # first bare word is the kind
    kind=kill,rank=2                # or spelled out; "at-step" is accepted for "at_step"

YAML form (``faults:`` in a config)::

    faults:
      - {kind: kill, rank: 1, at_step: 15}
"""

from __future__ import annotations

import enum
import signal
from dataclasses import asdict, dataclass
from typing import Any

from elaswave.errors import FaultSpecError

PHASES = ("reduce", "optimizer")
TARGETS = ("params", "snapshot")


class FaultKind(str, enum.Enum):
    """What the injected fault does to its target."""

    KILL = "kill"  # SIGKILL the worker process: a crash with no goodbye
    HANG = "hang"  # SIGSTOP the worker process: alive but silent, its peers block on it
    CORRUPT = "corrupt"  # flip a bit in the worker's parameters or snapshot (silent corruption)

    @property
    def signal(self) -> signal.Signals | None:
        """The real signal that carries the fault out (``None``: done inside the worker)."""
        return {FaultKind.KILL: signal.SIGKILL, FaultKind.HANG: signal.SIGSTOP}.get(self)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """A fault to inject: its kind, its target and when.

    ``at_step`` means "while step ``at_step`` is in flight" (after its forward/backward, before its
    gradient reduction), so the step is genuinely interrupted. Without it the fault fires at once.
    """

    kind: FaultKind
    rank: int | None = None
    at_step: int | None = None
    phase: str = "reduce"  # "reduce": before the gradient reduction; "optimizer": ZeRO's update
    target: str = "params"  # corrupt: "params" or "snapshot" (ZeRO: a replica piece it keeps)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            object.__setattr__(self, "kind", _kind(self.kind))
        if self.rank is None:
            raise FaultSpecError(f"fault '{self.kind.value}' needs a target: rank=R")
        if self.rank < 0:
            raise FaultSpecError(f"fault rank must be >= 0, got {self.rank}")
        if self.at_step is not None and self.at_step < 1:
            raise FaultSpecError(f"fault at_step must be >= 1, got {self.at_step}")
        if self.target not in TARGETS:
            raise FaultSpecError(
                f"fault target must be one of {', '.join(TARGETS)}, got {self.target!r}"
            )
        if self.phase not in PHASES:
            raise FaultSpecError(
                f"fault phase must be one of {', '.join(PHASES)}, got {self.phase!r}"
            )

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse the text form; any malformed part raises a one-line :class:`FaultSpecError`."""
        fields: dict[str, Any] = {}
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts:
            raise FaultSpecError("empty fault spec; expected e.g. 'kill,rank=1,at_step=15'")
        for i, part in enumerate(parts):
            if "=" not in part:
                if i == 0:
                    fields["kind"] = part
                    continue
                raise FaultSpecError(
                    f"malformed fault spec {text!r}: expected key=value, got {part!r}"
                )
            key, _, value = part.partition("=")
            fields[key.strip().replace("-", "_")] = value.strip()
        return cls.from_dict(fields, source=repr(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "fault spec") -> FaultSpec:
        known = {"kind", "rank", "at_step", "phase", "target"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise FaultSpecError(
                f"malformed {source}: unknown field {unknown[0]!r} "
                f"(known: {', '.join(sorted(known))})"
            )
        if "kind" not in data:
            raise FaultSpecError(f"malformed {source}: missing the fault kind")
        return cls(
            kind=_kind(data["kind"]),
            rank=_int(data.get("rank"), "rank", source),
            at_step=_int(data.get("at_step"), "at_step", source),
            phase=str(data.get("phase", "reduce")),
            target=str(data.get("target", "params")),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value
        if out["phase"] == "reduce":
            del out["phase"]
        if out["target"] == "params":
            del out["target"]
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        when = f" at step {self.at_step}" if self.at_step is not None else ""
        return f"{self.kind.value} rank {self.rank}{when}"


def _kind(value: Any) -> FaultKind:
    try:
        return FaultKind(str(value).strip().lower())
    except ValueError:
        kinds = ", ".join(k.value for k in FaultKind)
        raise FaultSpecError(f"unknown fault kind {value!r} (supported: {kinds})") from None


def _int(value: Any, name: str, source: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise FaultSpecError(f"malformed {source}: {name} must be an integer, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise FaultSpecError(
            f"malformed {source}: {name} must be an integer, got {value!r}"
        ) from None
