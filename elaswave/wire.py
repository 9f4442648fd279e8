"""The daemon↔worker control channel: every message as a dataclass, one encoder, one decoder.

On the wire a message is one JSON object per line over a Unix socket, ``{"type": NAME, ...its
fields}``. Nothing received is unpickled. :func:`decode` checks a line against its type's fields
(present, of the annotated kind) and raises :class:`WireError`, one line that names what is wrong;
each end logs it and drops the line. Both ends dispatch by a table from message class to handler
(``daemon/supervisor.py``, ``runtime/comm/control_client.py``).

worker → daemon: :class:`Hello`, :class:`Ready`, :class:`Event`, :class:`Heartbeat`,
:class:`Commit`, :class:`Eval`, :class:`Log`, :class:`Rollback`, :class:`Compute`,
:class:`Memory`, :class:`LayerCosts`, :class:`Evict`, :class:`Done`.

daemon → worker: :class:`Config`, :class:`PlanUpdate`, :class:`Fault`, :class:`Stop`,
:class:`Preempt`, :class:`Activate`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeAlias, Union

from elaswave.errors import ElasWaveError
from elaswave.faults import FaultSpec
from elaswave.planning import planwire
from elaswave.planning.plan import Plan

__all__ = [
    "MAX_LINE", "Activate", "Commit", "Compute", "Config", "DaemonMessage", "Done", "Eval",
    "Event", "Evict", "Fault", "Heartbeat", "Hello", "LayerCosts", "Log", "Memory", "Message",
    "PlanUpdate", "Preempt", "Ready", "Rollback", "Stop", "WireError", "WorkerMessage",
    "check_fields", "decode", "encode", "fits", "schema",
]  # fmt: skip

MAX_LINE = 1 << 20


class WireError(ValueError):
    """A line that is not a message of the protocol (one line, for the log)."""


class Message:
    """Base of every message: ``TYPE`` is its name on the wire."""

    TYPE: ClassVar[str]
    # Fields the class converts itself (``fields`` / ``from_fields``): the JSON kind they have
    # on the wire, checked by the decoder instead of the field's annotation.
    WIRE_KINDS: ClassVar[dict[str, Any]] = {}

    def fields(self) -> dict[str, Any]:
        """The message's fields as JSON values."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]  # every subclass is a dataclass

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> Message:
        """The message from checked JSON fields."""
        return cls(**data)


# ---- worker → daemon --------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello(Message):
    """A worker's first line: which worker this connection is."""

    TYPE = "hello"
    worker_id: str
    pid: int


@dataclass(frozen=True)
class Ready(Message):
    """The worker is built and waits for a plan. Pipelines add what the leader cuts the layers
    by: the workload's estimate, a start-up profile, each layer's bytes."""

    TYPE = "ready"
    worker_id: str
    layer_estimate: list[float] | None = None
    layer_seconds: list[float] | None = None
    layer_bytes: list[float] | None = None


@dataclass(frozen=True)
class Event(Message):
    """One record of the job's event stream (``kind`` and its fields), as the report reads it."""

    TYPE = "event"
    event: dict[str, Any]


@dataclass(frozen=True)
class Heartbeat(Message):
    """The worker is alive: its step, its phase and how long it has been in that phase (the
    daemon's hang detector compares that with the phase's bound). ``phase``: ``compute`` (a
    step's forward, backward and update), ``eval`` (a held-out evaluation's compute),
    ``collective`` (waiting on peers), ``idle`` (between steps, waiting for a plan)."""

    TYPE = "hb"
    step: int
    phase: str
    phase_age: float


@dataclass(frozen=True)
class Commit(Message):
    """Rank 0 committed ``step``: the step's record. ``prune``: the pruner's numbers
    (``prune_sparsity``, ...) on a pruning job."""

    TYPE = "commit"
    step: int
    loss: float
    epoch: int
    world: int
    samples: int
    t: float
    step_seconds: float | None = None
    lr: float | None = None
    grad_norm: float | None = None  # None unless measured (a stream, clipping)
    prune: dict[str, float] = field(default_factory=dict)
    skipped: str | None = None  # "nonfinite" | "configured": counted, not applied


@dataclass(frozen=True)
class Eval(Message):
    """Rank 0's held-out evaluation after committing ``step``."""

    TYPE = "eval"
    step: int
    loss: float
    samples: int
    t: float
    accuracy: float | None = None


@dataclass(frozen=True)
class Log(Message):
    """Metrics a user's own loop logged after ``step`` (``job.log``)."""

    TYPE = "log"
    step: int
    metrics: dict[str, float]
    t: float


@dataclass(frozen=True)
class Rollback(Message):
    """Silent corruption rolled the job back to ``step``: the records after it are redone."""

    TYPE = "rollback"
    step: int


@dataclass(frozen=True)
class Compute(Message):
    """This rank's compute seconds per micro-batch under plan ``epoch``, oldest first, up to
    ``step`` (the straggler detector's input)."""

    TYPE = "compute"
    step: int
    epoch: int
    per_mb: list[float]


@dataclass(frozen=True)
class Memory(Message):
    """Bytes this rank holds by purpose under plan ``epoch`` (``param_bytes``, ...)."""

    TYPE = "memory"
    epoch: int
    bytes: dict[str, int]


@dataclass(frozen=True)
class LayerCosts(Message):
    """A pipeline stage's measured seconds per layer (``layer_costs: online``)."""

    TYPE = "layer_costs"
    step: int
    epoch: int
    layer_seconds: dict[str, float]


@dataclass(frozen=True)
class Evict(Message):
    """A replay of ``step`` found ``workers`` miscomputing a gradient: the leader should plan
    without them (``reason``: the plan's)."""

    TYPE = "evict"
    step: int
    workers: list[str]
    reason: str


@dataclass(frozen=True)
class Done(Message):
    """The worker finished the job at ``step``."""

    TYPE = "done"
    step: int
    worker_id: str


# ---- daemon → worker --------------------------------------------------------------------------
@dataclass(frozen=True)
class Config(Message):
    """The job's config (``JobConfig.to_dict``) and the address the worker's groups bind."""

    TYPE = "config"
    config: dict[str, Any]
    host_addr: str


@dataclass(frozen=True)
class PlanUpdate(Message):
    """A plan in force (the worker keeps the newest epoch it has seen)."""

    TYPE = "plan"
    WIRE_KINDS = {"plan": str}
    plan: Plan

    def fields(self) -> dict[str, Any]:
        return {"plan": planwire.encode(self.plan)}

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> Message:
        return cls(planwire.decode(data["plan"]))


@dataclass(frozen=True)
class Fault(Message):
    """A fault to inject (``elaswave fault`` or ``launch --fault``)."""

    TYPE = "fault"
    WIRE_KINDS = {"fault": dict[str, Any]}
    fault: FaultSpec

    def fields(self) -> dict[str, Any]:
        return {"fault": self.fault.to_dict()}

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> Message:
        return cls(FaultSpec.from_dict(data["fault"]))


@dataclass(frozen=True)
class Stop(Message):
    """Leave: the job stopped, or this worker is not one the daemon started."""

    TYPE = "stop"


@dataclass(frozen=True)
class Preempt(Message):
    """The host is being preempted (``signal``, e.g. SIGTERM, reached its launch): checkpoint
    the newest committed step durably, then leave with the preempted exit code."""

    TYPE = "preempt"
    signal: str


@dataclass(frozen=True)
class Activate(Message):
    """A warm spare takes a lost worker's place: the device ``slot`` it now holds (set before
    anything is built on an accelerator) and the worker it ``replaces``. Until this message a
    spare trains nothing and gets no plans."""

    TYPE = "activate"
    slot: int
    replaces: str


WorkerMessage: TypeAlias = (
    Hello
    | Ready
    | Event
    | Heartbeat
    | Commit
    | Eval
    | Log
    | Rollback
    | Compute
    | Memory
    | LayerCosts
    | Evict
    | Done
)
DaemonMessage: TypeAlias = Config | PlanUpdate | Fault | Stop | Preempt | Activate

TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls for cls in (*typing.get_args(WorkerMessage), *typing.get_args(DaemonMessage))
}


Schema: TypeAlias = tuple[tuple[str, Any, bool], ...]


def schema(cls: type[Any]) -> Schema:
    """The fields on the wire of the dataclass ``cls``: (name, JSON kind, required); a field
    named in its ``WIRE_KINDS`` has that kind instead of its annotation."""
    hints = typing.get_type_hints(cls)
    kinds = getattr(cls, "WIRE_KINDS", {})
    return tuple(
        (
            f.name,
            kinds.get(f.name, hints[f.name]),
            f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING,
        )
        for f in dataclasses.fields(cls)
    )


def check_fields(name: str, fields: Schema, data: dict[str, Any]) -> None:
    """:class:`WireError` unless ``data`` has exactly the ``fields`` of ``name``, each of its
    kind (checked by :func:`fits`)."""
    extra = sorted(set(data) - {fname for fname, _, _ in fields})
    if extra:
        raise WireError(f"{name!r}: unknown field {extra[0]!r}")
    for fname, kind, required in fields:
        if fname not in data:
            if required:
                raise WireError(f"{name!r} lacks {fname!r}")
        elif not fits(data[fname], kind):
            raise WireError(f"{name!r}: {fname!r} is not {_kind_name(kind)}: {data[fname]!r:.80}")


_SCHEMAS = {cls: schema(cls) for cls in TYPES.values()}


def encode(msg: Message) -> bytes:
    """One line of the wire: ``{"type": ..., fields}``."""
    return (json.dumps({"type": msg.TYPE, **msg.fields()}, separators=(",", ":")) + "\n").encode()


def decode(line: bytes) -> Message:
    """The message on ``line``; :class:`WireError` when it is not one of the protocol's."""
    try:
        data = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise WireError(f"not a JSON object: {type(data).__name__}")
    name = data.pop("type", None)
    cls = TYPES.get(name) if isinstance(name, str) else None
    if cls is None:
        raise WireError(f"unknown message type {name!r}")
    check_fields(name, _SCHEMAS[cls], data)
    try:
        return cls.from_fields(data)
    except (ElasWaveError, ValueError, KeyError, TypeError) as exc:
        raise WireError(f"{name!r}: {exc}") from None


def fits(value: Any, kind: Any) -> bool:
    """Whether the JSON ``value`` is of the annotated ``kind`` (ints count as floats; a
    dataclass is an object of its fields, each of its kind)."""
    if kind is Any:
        return True
    origin = typing.get_origin(kind)
    if origin in (Union, types.UnionType):
        return any(fits(value, k) for k in typing.get_args(kind))
    if isinstance(kind, type) and dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            return False
        try:
            check_fields(kind.__name__, schema(kind), value)
        except WireError:
            return False
        return True
    if kind is type(None):
        return value is None
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind in (str, bool):
        return isinstance(value, kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        return isinstance(value, list) and all(fits(v, item) for v in value)
    if origin is dict:
        key, item = typing.get_args(kind)
        return isinstance(value, dict) and all(
            fits(k, key) and fits(v, item) for k, v in value.items()
        )
    raise TypeError(f"no wire check for {kind!r}")


def _kind_name(kind: Any) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")
