"""The daemon↔daemon messages kept in etcd (:mod:`elaswave.wire_etcd`): each round-trips, each
malformed value is one line that names its key, the tables cover every kind, and each daemon
part reads only the members its protocol lists."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elaswave import wire_etcd
from elaswave.daemon.channel import ChannelHost
from elaswave.daemon.controlplane import PlaneHost
from elaswave.daemon.entry import EntryHost
from elaswave.daemon.etcd import WatchEvent
from elaswave.daemon.faultrelay import FaultHost
from elaswave.daemon.jobstore import Change, JobStore
from elaswave.daemon.pool import PoolHost
from elaswave.keys import JobKeys
from elaswave.wire import WireError
from elaswave.wire_etcd import (
    Done,
    EvictRequest,
    HangBounds,
    HostInfo,
    Incident,
    Incidents,
    JobStop,
    LayerCostsReport,
    MemoryReport,
    Progress,
    Speeds,
    StreamStart,
    TrainedConfig,
    Value,
    WorkerInfo,
    WorkerLayerCosts,
    WorkerSpeed,
    decode,
    decode_entries,
    encode,
)

STEP = Progress(
    step=7, epoch=2, time=1.5, writer="h0/abc", loss=3.25, world_size=4, samples=32,
    samples_per_s=12.0, total_steps=40, prior_epoch=1,
)  # fmt: skip
EXAMPLES: list[Value] = [
    HostInfo(host="h0", addr="10.0.0.1", pid=11, nproc=2, run_dir="/r", netns=None, started=1.0),
    WorkerInfo(worker_id="h0.w0", host="h0", pid=12, slot=0),
    WorkerInfo(worker_id="h0.w1", host="h0", pid=13, slot=1, rack="r1", layer_seconds=[0.5, 1]),
    Speeds({"h0.w0": WorkerSpeed(epoch=3, per_mb=[0.1, 0.2])}),
    LayerCostsReport({"h0.w0": WorkerLayerCosts(step=9, epoch=3, layer_seconds={"0": 0.5})}),
    MemoryReport({"h0.w0": {"param_bytes": 1024}}),
    STEP,
    Progress(step=3, rolled_back=True, time=2.0, epoch=1, writer="h0/def"),
    Progress(step=5, epoch=2, relaunched="resumed from its checkpoint", time=3.0),
    Incidents([Incident(t=1.0, epoch=2, reason="worker h0.w1 exit code 1", fault=True)]),
    Done(step=40, t=9.5),
    JobStop(reason="restart loop", t=9.0),
    TrainedConfig({"model": {"n_layer": 2}, "data": None}),
    StreamStart(started=1700000000.25),
    HangBounds(silence_s=1.0, compute_s=10.0, eval_s=300.0, how="auto: floor"),
    EvictRequest(step=9, reason="miscomputed gradient: h0.w2 (rank 2)", by="h0.w0"),
]


@pytest.mark.parametrize("value", EXAMPLES, ids=lambda v: type(v).__name__)
def test_each_value_round_trips(value: Value) -> None:
    text = encode(value)
    assert decode(type(value), text) == value
    assert decode(type(value), text.encode()) == value  # as read from etcd


def test_every_class_has_an_example() -> None:
    assert {type(v) for v in EXAMPLES} == set(wire_etcd.VALUES)


# ---- what readers of the keys see: the JSON stays as it was written --------------------------
def test_a_host_key_keeps_its_fields_in_order_and_writes_null() -> None:
    info = EXAMPLES[0]
    assert encode(info) == json.dumps(
        {"host": "h0", "addr": "10.0.0.1", "pid": 11, "nproc": 2, "run_dir": "/r",
         "netns": None, "started": 1.0}
    )  # fmt: skip


def test_optional_fields_are_left_out_while_unset() -> None:
    assert json.loads(encode(EXAMPLES[1])) == {"worker_id": "h0.w0", "host": "h0", "pid": 12,
                                              "slot": 0}  # fmt: skip


def test_a_step_record_keeps_its_lines_nulls_and_a_marker_has_none() -> None:
    step = json.loads(encode(STEP))
    assert step["lr"] is None and step["grad_norm"] is None and step["sparsity"] is None
    assert "rolled_back" not in step and "relaunched" not in step
    assert encode(STEP) == json.dumps(step, sort_keys=True)  # keys sorted, as before
    assert json.loads(encode(EXAMPLES[7])) == {
        "step": 3, "rolled_back": True, "time": 2.0, "epoch": 1, "writer": "h0/def",
    }  # fmt: skip


def test_unwrapped_values_are_their_one_field() -> None:
    assert json.loads(encode(EXAMPLES[3])) == {"h0.w0": {"epoch": 3, "per_mb": [0.1, 0.2]}}
    assert json.loads(encode(EXAMPLES[9]))[0]["epoch"] == 2


# ---- malformed values: one line that names the key -------------------------------------------
@pytest.mark.parametrize(
    ("cls", "raw", "expected"),
    [
        (Done, b"{not json", "done: not JSON"),
        (Done, b"\xff", "done: not JSON"),
        (Done, b"[1, 2]", "done: not a JSON object: list"),
        (Done, b'{"step": 1}', "'done' lacks 't'"),
        (Done, b'{"step": 1, "t": 2, "by": "x"}', "'done': unknown field 'by'"),
        (Done, b'{"step": "1", "t": 2}', "'done': 'step' is not int"),
        (Done, b'{"step": true, "t": 2}', "'done': 'step' is not int"),
        (JobStop, b'{"reason": 3, "t": 1}', "'stop': 'reason' is not str"),
        (HostInfo, b'{"host": "h"}', "'hosts/<host>' lacks 'addr'"),
        (WorkerInfo, b'{"worker_id": "w", "host": "h"}', "'workers/<worker>' lacks 'pid'"),
        (Progress, b'{"epoch": 1}', "'progress' lacks 'step'"),
        (Progress, b'{"step": 1, "loss": "nan"}', "'progress': 'loss' is not"),
        (Speeds, b'{"w": {"epoch": 1}}', "'speed/<host>': 'workers' is not"),
        (Speeds, b"[]", "'speed/<host>': 'workers' is not"),
        (Incidents, b'[{"t": 1}]', "'incidents': 'incidents' is not"),
        (StreamStart, b"{}", "'logging' lacks 'started'"),
    ],
)
def test_a_malformed_value_is_one_line(cls: type[Value], raw: bytes, expected: str) -> None:
    with pytest.raises(WireError) as err:
        decode(cls, raw)
    message = str(err.value)
    assert message.startswith(expected) and "\n" not in message


def test_malformed_entries_of_a_map_are_left_out_one_line_each() -> None:
    raw = json.dumps({
        "h0.w0": {"step": 1, "epoch": 1, "layer_seconds": {"0": 0.5}},
        "h0.w1": {"step": 1, "epoch": 1, "layer_seconds": [0.5]},
    })  # fmt: skip
    report, errors = decode_entries(LayerCostsReport, raw)
    assert list(report.workers) == ["h0.w0"]
    assert len(errors) == 1 and "'h0.w1'" in errors[0] and "\n" not in errors[0]
    with pytest.raises(WireError):
        decode_entries(LayerCostsReport, b"[]")


# ---- the tables cover every kind -------------------------------------------------------------
def test_every_json_key_of_a_job_is_in_the_table() -> None:
    keys = JobKeys("j")
    plain_text = {keys.leader, keys.starting, keys.departures}  # host ids and reasons, not JSON
    named = {
        keys.hosts: "hosts/<host>", keys.workers: "workers/<worker>", keys.faults: "faults/<id>",
        keys.speed: "speed/<host>", keys.costs: "costs/<host>", keys.memory: "memory/<host>",
        keys.hang: "hang/<host>", keys.evict: "evict/<worker>",
    }  # fmt: skip
    layout = {v for k, v in vars(keys).items() if k not in ("job_id", "prefix")}
    expected = {named.get(key, key.removeprefix(keys.prefix)) for key in layout - plain_text}
    assert set(wire_etcd.KEYS) == expected


def test_each_class_is_found_under_its_key() -> None:
    for cls in wire_etcd.VALUES:
        assert wire_etcd.KEYS[cls.KEY] is cls


def test_the_planners_change_table_covers_every_change() -> None:
    store = JobStore(None, JobKeys("j"))  # type: ignore[arg-type]  # no call reaches etcd
    assert len(store.change_table) == 6
    made = {
        (Change.DONE, "put"), (Change.HOST_GONE, "delete"), (Change.MEMBERSHIP, "put"),
        (Change.SPEED, "put"), (Change.SPEED_GONE, "delete"), (Change.EVICT, "put"),
    }  # fmt: skip
    values = {
        "workers/": encode(WorkerInfo(worker_id="h.w0", host="h", pid=1, slot=0)).encode(),
        "speed/": encode(Speeds({})).encode(),
        "evict/": encode(EvictRequest(step=1, reason="r", by="h.w1")).encode(),
    }
    seen = set()
    for prefix, change_of in store.change_table.items():
        rest = "" if prefix.endswith("done") else "h"
        for kind in ("put", "delete"):
            raw = values.get(prefix.removeprefix(store.keys.prefix), b"{}")
            ev = WatchEvent(kind=kind, key=prefix + rest, value=raw, mod_revision=2,
                            create_revision=1)  # fmt: skip
            change = change_of(ev, rest)
            if change is not None:
                seen.add((change.kind, kind))
    assert {kind for kind, _ in seen} == set(Change)
    assert made <= seen


# ---- the daemon's parts are narrow -----------------------------------------------------------
def _members(protocol: type[Any]) -> set[str]:
    return {
        name for name in vars(protocol)
        if not name.startswith("_") and name not in ("copy_with",)
    }  # fmt: skip


@pytest.mark.parametrize(
    ("protocol", "most"),
    [(PoolHost, 13), (FaultHost, 10), (PlaneHost, 11), (EntryHost, 17), (ChannelHost, 15)],
)
def test_each_part_reads_a_few_members_of_its_daemon(protocol: type[Any], most: int) -> None:
    members = _members(protocol)
    assert 0 < len(members) <= most, sorted(members)
