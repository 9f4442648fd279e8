"""One typed fault specification shared by the CLI, config files, the daemon and the tests.

Text form (``launch --fault`` and ``ELASWAVE_FAULTS``)::

    kill,rank=1,at_step=15          # first bare word is the kind
    kind=kill,rank=2                # or spelled out; "at-step" is accepted for "at_step"
    slow,rank=3,at_step=5,delay=0.2  # from step 5 on, rank 3 is 0.2 s per step slower
    kill,rank=2,at_step=9,phase=recovery  # dies as it starts applying the plan after step 9
    kill,rank=1,at_step=3,repeat    # whoever holds rank 1 dies at step 3, every time
    kill,rank=1,at_step=8,phase=forward,detect_delay=2  # dies before step 8's first forward;
                                    # its daemon reports the death 2 s late
    hang,rank=2,at_step=8,epoch=3   # from step 8 on, once the job runs plan epoch 3 or later
    nan,rank=1,at_step=10           # rank 1's loss and gradient are NaN in step 10
    corrupt,target=grad,rank=2,at_step=9  # rank 2 computes step 9's replayed micro-batch's
                                    # gradient with one bit wrong (a device that miscomputes)
    host,host=h2                    # whole-host faults name a host instead of a rank

YAML form (``faults:`` in a config)::

    faults:
      - {kind: kill, rank: 1, at_step: 15}
"""

from __future__ import annotations

import enum
import json
import signal
from dataclasses import asdict, dataclass
from typing import Any

from elaswave.errors import FaultSpecError

MAX_REQUEST_BYTES = 4096  # a fault request is a few dozen bytes of JSON
PHASES = ("reduce", "optimizer", "recovery", "forward")
TARGETS = ("params", "snapshot", "grad")


class FaultKind(str, enum.Enum):
    """What the injected fault does to its target."""

    KILL = "kill"  # SIGKILL the worker process: a crash with no goodbye
    HANG = "hang"  # SIGSTOP the worker process: alive but silent, its peers block on it
    CORRUPT = "corrupt"  # flip a bit in the worker's parameters or snapshot (silent corruption)
    SLOW = "slow"  # the worker computes ``delay`` seconds per step slower: a straggler
    HOST = "host"  # SIGKILL a host's daemon and all its workers: a dead host, no cleanup runs
    PARTITION = "partition"  # cut a host's network link (only where the tool can act: netns bed)
    NAN = "nan"  # the worker's loss (and so its gradient) turns NaN in that step: bad data

    @property
    def targets_host(self) -> bool:
        """Whole-host faults name a host (``host=H``); the others name a rank."""
        return self in (FaultKind.HOST, FaultKind.PARTITION)

    @property
    def signal(self) -> signal.Signals | None:
        """The real signal that carries the fault out (``None``: done inside the worker)."""
        return {FaultKind.KILL: signal.SIGKILL, FaultKind.HANG: signal.SIGSTOP}.get(self)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """A fault to inject: its kind, its target and when.

    ``at_step`` means "while step ``at_step`` is in flight" (after its forward/backward, before its
    gradient reduction), so the step is genuinely interrupted. Without it the fault fires at once.
    ``phase=recovery`` fires instead when the worker starts applying a new plan while step
    ``at_step`` (or a later one) is next: a fault during recovery. ``repeat`` re-arms the fault on
    every worker that holds ``rank`` in a later plan (a respawned incarnation, a survivor that
    moved up), each firing once: a fault storm. ``delay`` (``slow`` only): extra seconds of
    compute per step at an even share of micro-batches, spread over the worker's micro-batches
    so that it scales with its work like a slower device would. ``phase=forward`` fires before
    the step's first forward (a pipeline stage has posted nothing yet, so its neighbours meet the
    dead peer in their sends and receives). ``detect_delay`` (``kill`` only): the victim's daemon
    reports the death that many seconds late, as a slow detector would (a host found dead only
    when its lease expires): meanwhile the survivors meet the dead peer in the transport itself,
    and every error they get there must latch. ``epoch`` arms the fault only once the job runs
    a plan of that epoch or a later one (its rank is resolved in that plan, its ``at_step`` then
    means the first step from ``at_step`` on): a second fault scripted to land after the
    membership the first one caused, e.g. after a respawned worker has joined.
    """

    kind: FaultKind
    rank: int | None = None
    host: str | None = None  # whole-host faults: the target host id
    at_step: int | None = None
    phase: str = "reduce"  # "reduce": before the gradient reduction; "optimizer": ZeRO's update
    # corrupt: "params", "snapshot" (ZeRO: a replica piece it keeps) or "grad" (the gradient of
    # the step's first micro-batch, and of a peer's it recomputes, as this rank computes them)
    target: str = "params"
    delay: float | None = None  # slow: extra compute seconds per step (even share)
    repeat: bool = False  # re-arm on whichever worker holds ``rank`` in later plans
    detect_delay: float | None = None  # kill: the death is reported this many seconds late
    epoch: int | None = None  # armed from the plan of this epoch on

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            object.__setattr__(self, "kind", _kind(self.kind))
        if self.kind.targets_host:
            if not self.host:
                raise FaultSpecError(f"fault '{self.kind.value}' needs a target: host=H")
            if self.rank is not None or self.at_step is not None or self.epoch is not None:
                raise FaultSpecError(
                    f"fault '{self.kind.value}' takes host=H only (it fires at once)"
                )
            return
        if self.host is not None:
            raise FaultSpecError(f"fault '{self.kind.value}' targets a rank, not host=H")
        if self.rank is None:
            raise FaultSpecError(f"fault '{self.kind.value}' needs a target: rank=R")
        if self.rank < 0:
            raise FaultSpecError(f"fault rank must be >= 0, got {self.rank}")
        if self.at_step is not None and self.at_step < 1:
            raise FaultSpecError(f"fault at_step must be >= 1, got {self.at_step}")
        if self.epoch is not None and self.epoch < 1:
            raise FaultSpecError(f"fault epoch must be >= 1, got {self.epoch}")
        if self.target not in TARGETS:
            raise FaultSpecError(
                f"fault target must be one of {', '.join(TARGETS)}, got {self.target!r}"
            )
        if self.phase not in PHASES:
            raise FaultSpecError(
                f"fault phase must be one of {', '.join(PHASES)}, got {self.phase!r}"
            )
        if self.kind is FaultKind.SLOW:
            if self.delay is None:
                raise FaultSpecError("fault 'slow' needs delay=S (extra seconds per step)")
            if not self.delay >= 0 or self.delay == float("inf"):  # also rejects NaN
                raise FaultSpecError(f"fault delay must be a finite number >= 0, got {self.delay}")
        elif self.delay is not None:
            raise FaultSpecError(f"delay applies to 'slow' faults only, not '{self.kind.value}'")
        if self.detect_delay is not None:
            if self.kind is not FaultKind.KILL:
                raise FaultSpecError(
                    f"detect_delay applies to 'kill' faults only, not '{self.kind.value}'"
                )
            if not 0 <= self.detect_delay <= 60:  # also rejects NaN
                raise FaultSpecError(
                    f"fault detect_delay must be between 0 and 60 seconds, got {self.detect_delay}"
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
                if part == "repeat":
                    fields["repeat"] = True
                    continue
                raise FaultSpecError(
                    f"malformed fault spec {text!r}: expected key=value, got {part!r}"
                )
            key, _, value = part.partition("=")
            fields[key.strip().replace("-", "_")] = value.strip()
        return cls.from_dict(fields, source=repr(text))

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "fault spec") -> FaultSpec:
        known = {
            "kind", "rank", "host", "at_step", "phase", "target", "delay", "repeat", "detect_delay",
            "epoch",
        }  # fmt: skip
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
            host=str(data["host"]) if data.get("host") is not None else None,
            at_step=_int(data.get("at_step"), "at_step", source),
            phase=str(data.get("phase", "reduce")),
            target=str(data.get("target", "params")),
            delay=_float(data.get("delay"), "delay", source),
            repeat=_bool(data.get("repeat", False), "repeat", source),
            detect_delay=_float(data.get("detect_delay"), "detect_delay", source),
            epoch=_int(data.get("epoch"), "epoch", source),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kind"] = self.kind.value
        if out["phase"] == "reduce":
            del out["phase"]
        if out["target"] == "params":
            del out["target"]
        if not out["repeat"]:
            del out["repeat"]
        return {k: v for k, v in out.items() if v is not None}

    def armed(self, epoch: int, step: int) -> bool:
        """Whether the fault is due in a worker running plan ``epoch`` at ``step``."""
        return (self.epoch or 0) <= epoch and (self.at_step or 0) <= step

    def describe(self) -> str:
        if self.host is not None:
            return f"{self.kind.value} host {self.host}"
        when = f" at step {self.at_step}" if self.at_step is not None else ""
        extra = f" (+{self.delay:g} s/step)" if self.delay is not None else ""
        if self.phase == "recovery":
            extra += " during recovery"
        elif self.phase == "forward":
            extra += " before its forward"
        if self.detect_delay:
            extra += f" (reported {self.detect_delay:g} s late)"
        if self.repeat:
            extra += ", repeated"
        if self.epoch is not None:
            extra += f" (from plan epoch {self.epoch})"
        return f"{self.kind.value} rank {self.rank}{when}{extra}"


def decode_request(value: bytes) -> FaultSpec:
    """A fault request as read from etcd (``faults/<id>``): JSON only, validated, never trusted.

    Anything else (oversized, not UTF-8, not JSON, not an object, unknown fields, bad values)
    raises a one-line :class:`FaultSpecError`; the daemon logs it and carries on.
    """
    if len(value) > MAX_REQUEST_BYTES:
        raise FaultSpecError(f"fault request of {len(value)} bytes (limit {MAX_REQUEST_BYTES})")
    try:
        data = json.loads(value)
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise FaultSpecError("fault request is not JSON") from None
    if not isinstance(data, dict):
        raise FaultSpecError(f"fault request must be a JSON object, got {type(data).__name__}")
    return FaultSpec.from_dict(data, source="fault request")


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


def _float(value: Any, name: str, source: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise FaultSpecError(f"malformed {source}: {name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise FaultSpecError(
            f"malformed {source}: {name} must be a number, got {value!r}"
        ) from None


def _bool(value: Any, name: str, source: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes"):
        return True
    if text in ("0", "false", "no"):
        return False
    raise FaultSpecError(f"malformed {source}: {name} must be true or false, got {value!r}")
