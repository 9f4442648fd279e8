"""The daemon↔daemon messages: every JSON value a job keeps in etcd, as a dataclass.

Daemons talk through the job's keys (:class:`~elaswave.keys.JobKeys`), and ``status`` and
``inject-fault`` read the same keys. Each key holds one class of value, named by :data:`KEYS`.
:func:`encode` writes a value (keys sorted unless the class keeps its fields' order), and
:func:`decode` reads one with the checks of the worker protocol (:mod:`elaswave.wire`): every
field present, of its annotated kind, none unknown; anything else raises
:class:`~elaswave.wire.WireError`, one line that names the key. A daemon logs that line and goes
on: it never trusts what it reads in etcd.

A field with a default of ``None`` is left out while it is ``None``; a required one is written
as ``null``. A class whose ``UNWRAPPED`` is set is its one field on the wire (a map keyed by
worker, a list), not an object of fields.

Two values have codecs of their own, which :data:`KEYS` names and nothing here repeats: the plan
and its delta (:mod:`elaswave.planning.planwire`, :mod:`elaswave.planning.plandelta`) and fault
requests (:func:`elaswave.faults.decode_request`). ``leader``, ``starting`` and
``departures/<worker>`` hold plain text (a host id, a reason), not JSON.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

from elaswave.wire import WireError, check_fields, schema

__all__ = [
    "KEYS", "VALUES", "Done", "HangBounds", "HostInfo", "Incident", "Incidents", "JobStop",
    "LayerCostsReport",
    "MemoryReport", "Progress", "Speeds", "StreamStart", "TrainedConfig", "Value", "WireError",
    "WorkerInfo", "WorkerLayerCosts", "WorkerSpeed", "decode", "decode_entries", "encode",
    "from_json",
]  # fmt: skip

V = TypeVar("V", bound="Value")

log = logging.getLogger(__name__)


class Value:
    """Base of every value kept in etcd (and of the records nested in one)."""

    KEY: ClassVar[str] = ""  # the key it lives under, as :data:`KEYS` names it ("" if nested)
    UNWRAPPED: ClassVar[bool] = False  # the value is its one field, not an object of fields
    SORT_KEYS: ClassVar[bool] = True  # False: its fields in their order (as written so far)
    WIRE_KINDS: ClassVar[dict[str, Any]] = {}

    def fields(self) -> dict[str, Any]:
        """The value's fields as JSON values (a field defaulting to None left out while None)."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]  # every value is a dataclass
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            out[f.name] = _plain(value)
        return out

    def to_json(self) -> Any:
        """The JSON document of the value."""
        data = self.fields()
        if self.UNWRAPPED:
            (only,) = data.values()
            return only
        return data


# ---- hosts and workers ---------------------------------------------------------------------------
@dataclass(frozen=True)
class HostInfo(Value):
    """``hosts/<host>``, under the host lease: the host is alive, and where it runs."""

    KEY = "hosts/<host>"
    SORT_KEYS = False
    host: str
    addr: str  # the address peers reach it on
    pid: int  # its daemon
    nproc: int  # worker slots
    run_dir: str
    netns: str | None  # the ``ip netns`` it runs in (the test bed), else null
    started: float  # when it registered (wall clock)


@dataclass(frozen=True)
class WorkerInfo(Value):
    """``workers/<worker>``, under its host's lease: a worker that is built and ready. Pipelines
    add what the leader cuts layers by; ``rack`` is its host's (``launch --rack``)."""

    KEY = "workers/<worker>"
    worker_id: str
    host: str
    pid: int
    slot: int
    rack: str | None = None
    layer_estimate: list[float] | None = None
    layer_seconds: list[float] | None = None
    layer_bytes: list[float] | None = None


# ---- what hosts share with the leader ------------------------------------------------------------
@dataclass(frozen=True)
class WorkerSpeed(Value):
    """A worker's newest compute seconds per micro-batch under plan ``epoch``."""

    epoch: int
    per_mb: list[float]


@dataclass(frozen=True)
class Speeds(Value):
    """``speed/<host>``, under the host lease: its running workers' compute times."""

    KEY = "speed/<host>"
    UNWRAPPED = True
    workers: dict[str, WorkerSpeed]


@dataclass(frozen=True)
class EvictRequest(Value):
    """``evict/<worker>``: a replay of ``step`` outvoted the worker on a micro-batch's gradient
    (``by``: the worker that reported it); the leader plans without it (``reason``)."""

    KEY = "evict/<worker>"
    step: int
    reason: str
    by: str


@dataclass(frozen=True)
class WorkerLayerCosts(Value):
    """A pipeline worker's newest seconds per layer (``layer_costs: online``)."""

    step: int
    epoch: int
    layer_seconds: dict[str, float]


@dataclass(frozen=True)
class LayerCostsReport(Value):
    """``costs/<host>``, under the host lease: its running workers' layer costs."""

    KEY = "costs/<host>"
    UNWRAPPED = True
    workers: dict[str, WorkerLayerCosts]


@dataclass(frozen=True)
class MemoryReport(Value):
    """``memory/<host>``, under the host lease: its running workers' bytes by purpose
    (``param_bytes``, ...) under their newest plan; ``status`` shows them per rank."""

    KEY = "memory/<host>"
    UNWRAPPED = True
    workers: dict[str, dict[str, int]]


@dataclass(frozen=True)
class HangBounds(Value):
    """``hang/<host>``, under the host lease: the bounds its hang detector applies now (seconds
    of silence, of one compute phase, of one evaluation) and how they were derived; ``status``
    shows them."""

    KEY = "hang/<host>"
    silence_s: float
    compute_s: float
    eval_s: float
    how: str


# ---- the job's record ----------------------------------------------------------------------------
STEP_FIELDS = (
    "step", "loss", "epoch", "world_size", "samples", "step_seconds", "lr", "grad_norm",
    "sparsity", "skipped", "time", "samples_per_s", "total_steps", "writer", "prior_epoch",
)  # fmt: skip


@dataclass(frozen=True)
class Progress(Value):
    """``progress``, outside every lease: the job's newest committed step. One of three shapes:
    a step's record (``loss`` set: its ``metrics.jsonl`` line, the throughput, the writer's
    token and the epoch of the record it followed), a rollback's marker (``rolled_back``), or a
    relaunch's seed (``relaunched``: the reason)."""

    KEY = "progress"
    step: int
    epoch: int | None = None
    time: float | None = None
    writer: str | None = None  # "<host>/<token>": this write, and no other
    loss: float | None = None
    world_size: int | None = None
    samples: int | None = None
    step_seconds: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    sparsity: float | None = None
    skipped: str | None = None  # "nonfinite" or "configured": the step counted, not applied
    samples_per_s: float | None = None
    total_steps: int | None = None
    prior_epoch: int | None = None
    rolled_back: bool | None = None
    relaunched: str | None = None

    def fields(self) -> dict[str, Any]:
        """A step's record keeps every field of its line, ``null`` included (a reader tells
        "not measured" from "not a step's record" by it)."""
        out = super().fields()
        if self.loss is not None:
            out.update({name: getattr(self, name) for name in STEP_FIELDS})
        return out


@dataclass(frozen=True)
class Incident(Value):
    """A plan the leader published: when, its epoch and reason, and whether a fault caused it."""

    t: float
    epoch: int
    reason: str
    fault: bool


@dataclass(frozen=True)
class Incidents(Value):
    """``incidents``: the newest plans' incidents, oldest first (a bounded list)."""

    KEY = "incidents"
    UNWRAPPED = True
    incidents: list[Incident]


@dataclass(frozen=True)
class Done(Value):
    """``done``: the job committed its last ``step`` at ``t``."""

    KEY = "done"
    step: int
    t: float


@dataclass(frozen=True)
class JobStop(Value):
    """``stop``: the leader's verdict that ends the whole job (a restart loop)."""

    KEY = "stop"
    reason: str
    t: float


@dataclass(frozen=True)
class TrainedConfig(Value):
    """``config``: what every host must train, as the first host published it."""

    KEY = "config"
    UNWRAPPED = True
    config: dict[str, Any]


@dataclass(frozen=True)
class StreamStart(Value):
    """``logging``: when the job's event stream started (its files and W&B run are named by
    it), set once by the first host that asks."""

    KEY = "logging"
    started: float


VALUES: tuple[type[Value], ...] = (
    HostInfo, WorkerInfo, Speeds, EvictRequest, LayerCostsReport, MemoryReport, HangBounds,
    Progress, Incidents, Done, JobStop, TrainedConfig, StreamStart,
)  # fmt: skip

# Every JSON key of a job (under ``/elaswave/<job-id>/``): the class it holds, or the module whose
# codec reads it.
KEYS: dict[str, type[Value] | str] = {
    **{cls.KEY: cls for cls in VALUES},
    "plan": "elaswave.planning.planwire",
    "delta": "elaswave.planning.plandelta",
    "faults/<id>": "elaswave.faults.decode_request",
}

_SCHEMAS: dict[type[Any], Any] = {}


def _schema_of(cls: type[Any]) -> Any:
    found = _SCHEMAS.get(cls)
    if found is None:
        found = _SCHEMAS[cls] = schema(cls)
    return found


def encode(value: Value) -> str:
    """The text ``value`` is kept as in etcd."""
    return json.dumps(value.to_json(), sort_keys=value.SORT_KEYS)


def decode(cls: type[V], raw: bytes | str) -> V:
    """The value of class ``cls`` that ``raw`` (as read from its key) holds; :class:`WireError`,
    one line naming the key, when it holds none."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError(f"{cls.KEY or cls.__name__}: not JSON ({exc})") from None
    return from_json(cls, data)


def decode_or_log(cls: type[V], raw: bytes | str, *, ignoring: str) -> V | None:
    """:func:`decode`, or None with one logged line (``ignoring``: what the caller reads) when
    ``raw`` holds no value of ``cls``: a daemon skips a malformed value and goes on."""
    try:
        return decode(cls, raw)
    except WireError as exc:
        log.error("ignoring %s: %s", ignoring, exc)
        return None


def from_json(cls: type[V], data: Any) -> V:
    """The value of class ``cls`` from its JSON document ``data``, checked as :func:`decode`
    checks it."""
    name = cls.KEY or cls.__name__
    if cls.UNWRAPPED:
        (field,) = dataclasses.fields(cls)  # type: ignore[arg-type]  # every value is a dataclass
        data = {field.name: data}
    elif not isinstance(data, dict):
        raise WireError(f"{name}: not a JSON object: {type(data).__name__}")
    check_fields(name, _schema_of(cls), data)
    return typing.cast(V, _build(cls, data))


def decode_entries(cls: type[V], raw: bytes | str) -> tuple[V, list[str]]:
    """A value of an ``UNWRAPPED`` map class (keyed by worker) with its malformed entries left
    out: the value of the others, and the one-line error of each entry left out.
    :class:`WireError` when ``raw`` is not a JSON object at all."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise WireError(f"{cls.KEY}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise WireError(f"{cls.KEY}: not a JSON object: {type(data).__name__}")
    kept: dict[str, Any] = {}
    errors = []
    for key, entry in data.items():
        try:
            from_json(cls, {key: entry})
        except WireError:
            errors.append(f"{cls.KEY}: entry {key!r} is malformed: {entry!r:.80}")
            continue
        kept[key] = entry
    return from_json(cls, kept), errors


def _build(kind: Any, value: Any) -> Any:
    """``value`` (JSON, checked against ``kind``) with the dataclasses in ``kind`` built."""
    if dataclasses.is_dataclass(kind):
        fkinds = {fname: fkind for fname, fkind, _ in _schema_of(kind)}  # type: ignore[arg-type]
        return kind(**{k: _build(fkinds[k], v) for k, v in value.items()})  # type: ignore[operator]
    origin = typing.get_origin(kind)
    if origin is list:
        (item,) = typing.get_args(kind)
        return [_build(item, v) for v in value]
    if origin is dict:
        _, item = typing.get_args(kind)
        return {k: _build(item, v) for k, v in value.items()}
    if origin in (Union, types.UnionType):
        for option in typing.get_args(kind):
            if dataclasses.is_dataclass(option) and isinstance(value, dict):
                return _build(option, value)
    return value


def _plain(value: Any) -> Any:
    """``value`` as JSON: nested values as their documents."""
    if isinstance(value, Value):
        return value.to_json()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
