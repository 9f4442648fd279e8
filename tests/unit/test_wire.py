"""The control channel's messages: every type round-trips through its one encoder and decoder,
a line that is not a message is one line of error, and both ends have a handler for every
message the other sends."""

from __future__ import annotations

import typing

import pytest

from elaswave import wire
from elaswave.daemon.channel import WorkerChannel
from elaswave.daemon.supervisor import HostDaemon
from elaswave.faults import FaultSpec
from elaswave.planning.plan import Plan
from elaswave.runtime.comm.control_client import HANDLERS

PLAN = Plan(
    epoch=3, workers=("h0.w0", "h1.w0"), hosts=("h0", "h1"), microbatches=(2, 2), store="x:1"
)
EVERY = [
    wire.Hello(worker_id="h0.w0", pid=41),
    wire.Ready(worker_id="h0.w0"),
    wire.Ready(worker_id="h0.w1", layer_estimate=[1.0, 2.5], layer_bytes=[4.0, 4.0]),
    wire.Event({"t": 1.5, "kind": "step_aborted", "step": 4}),
    wire.Heartbeat(step=7, phase="collective", phase_age=0.25),
    wire.Heartbeat(step=8, phase="eval", phase_age=12.5),
    wire.Commit(step=2**40, loss=1.25, epoch=9, world=10**6, samples=2**45, t=2.0),
    wire.Commit(
        step=3,
        loss=1.0,
        epoch=1,
        world=2,
        samples=96,
        t=2.0,
        grad_norm=0.5,
        prune={"prune_sparsity": 0.25},
    ),  # fmt: skip
    wire.Eval(step=4, loss=0.5, samples=64, t=3.0),
    wire.Eval(step=4, loss=0.5, samples=64, t=3.0, accuracy=0.75),
    wire.Log(step=5, metrics={"ema_loss": 0.5}, t=4.0),
    wire.Rollback(step=6),
    wire.Compute(step=7, epoch=2, per_mb=[0.01, 0.02]),
    wire.Memory(epoch=2, bytes={"param_bytes": 2**33, "grad_bytes": 16}),
    wire.LayerCosts(step=8, epoch=2, layer_seconds={"0": 0.5, "1": 0.25}),
    wire.Evict(step=9, workers=["h0.w2"], reason="miscomputed gradient: h0.w2 (rank 2)"),
    wire.Done(step=9, worker_id="h0.w0"),
    wire.Config(config={"train": {"steps": 3}}, host_addr="127.0.0.1"),
    wire.PlanUpdate(PLAN),
    wire.Fault(FaultSpec.parse("kill,rank=1,at_step=5")),
    wire.Stop(),
    wire.Preempt(signal="SIGTERM"),
    wire.Activate(slot=1, replaces="h0.w1"),
]


@pytest.mark.parametrize("msg", EVERY, ids=lambda m: m.TYPE)
def test_every_message_round_trips(msg: wire.Message) -> None:
    line = wire.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert wire.decode(line) == msg


def test_every_type_is_covered_here() -> None:
    assert {type(m) for m in EVERY} == set(wire.TYPES.values())


@pytest.mark.parametrize(
    "line, says",
    [
        (b"nope", "not JSON"),
        (b"[1, 2]", "not a JSON object: list"),
        (b'{"step": 1}', "unknown message type None"),
        (b'{"type": "shout"}', "unknown message type 'shout'"),
        (b'{"type": "hb", "step": 1, "phase": "idle"}', "'hb' lacks 'phase_age'"),
        (b'{"type": "hb", "step": "1", "phase": "idle", "phase_age": 0}', "'step' is not int"),
        (b'{"type": "hb", "step": true, "phase": "idle", "phase_age": 0}', "'step' is not int"),
        (b'{"type": "rollback", "step": 1, "extra": 2}', "unknown field 'extra'"),
        (b'{"type": "compute", "step": 1, "epoch": 1, "per_mb": [0.1, "x"]}', "'per_mb' is not"),
        (b'{"type": "memory", "epoch": 1, "bytes": {"a": 1.5}}', "'bytes' is not"),
        (b'{"type": "plan", "plan": "{}"}', "'plan':"),
        (b'{"type": "fault", "fault": {"kind": "melt"}}', "'fault':"),
    ],
)
def test_a_line_that_is_not_a_message_is_one_line_of_error(line: bytes, says: str) -> None:
    with pytest.raises(wire.WireError) as err:
        wire.decode(line)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_float_field_takes_an_int_and_an_int_field_refuses_a_float() -> None:
    assert wire.decode(b'{"type":"rollback","step":2}') == wire.Rollback(step=2)
    hb = b'{"type":"hb","step":1,"phase":"idle","phase_age":0}'
    assert wire.decode(hb) == wire.Heartbeat(step=1, phase="idle", phase_age=0.0)
    with pytest.raises(wire.WireError, match="'step' is not int"):
        wire.decode(b'{"type":"rollback","step":2.0}')


def test_each_end_handles_every_message_the_other_sends() -> None:
    """The daemon's table covers every worker message but ``hello`` (answered before a worker
    counts); the worker's covers every daemon message."""
    channel = WorkerChannel(HostDaemon.__new__(HostDaemon))  # the table only: nothing runs
    workers = set(typing.get_args(wire.WorkerMessage))
    assert set(channel.handlers) == workers - {wire.Hello}
    assert set(HANDLERS) == set(typing.get_args(wire.DaemonMessage))
