"""FaultSpec: the text form, the dict form, and their one-line errors."""

from __future__ import annotations

from typing import Any

import pytest

from elaswave.errors import FaultSpecError
from elaswave.faults import FaultKind, FaultSpec


@pytest.mark.parametrize(
    ("text", "rank", "at_step"),
    [
        ("kill,rank=1,at_step=15", 1, 15),
        ("kill,rank=0", 0, None),
        ("kind=kill,rank=2", 2, None),
        ("kind=kill,rank=2,at_step=1", 2, 1),
        ("kill,rank=3,at-step=7", 3, 7),
        ("kill,at_step=4,rank=5", 5, 4),  # any field order
        ("  kill , rank = 1 , at_step = 2  ", 1, 2),  # whitespace around parts
        ("KILL,rank=1", 1, None),  # kinds are case-insensitive
        ("kill,rank=1,", 1, None),  # a trailing comma is harmless
    ],
)
def test_parse_valid(text: str, rank: int, at_step: int | None) -> None:
    spec = FaultSpec.parse(text)
    assert spec == FaultSpec(kind=FaultKind.KILL, rank=rank, at_step=at_step)
    assert spec.kind is FaultKind.KILL
    assert isinstance(spec.rank, int)


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "empty fault spec"),
        ("   ", "empty fault spec"),
        (",,", "empty fault spec"),
        ("boom", "unknown fault kind"),
        ("boom,rank=1", "unknown fault kind"),
        ("kind=boom,rank=1", "unknown fault kind"),
        ("kill", "needs a target"),
        ("kill,at_step=3", "needs a target"),
        ("rank=1", "missing the fault kind"),
        ("kill,rank=one", "rank must be an integer"),
        ("kill,rank=1.5", "rank must be an integer"),
        ("kill,rank=", "rank must be an integer"),
        ("kill,rank=1,at_step=soon", "at_step must be an integer"),
        ("kill,rank=1,when=now", "unknown field 'when'"),
        ("kill,rank=1,extra", "expected key=value"),
        ("kill,rank=-1", "rank must be >= 0"),
        ("kill,rank=1,at_step=0", "at_step must be >= 1"),
        ("kill,rank=1,at_step=-3", "at_step must be >= 1"),
        ("kill,rank=1\nat_step=2", "rank must be an integer"),  # newline in input, one-line message
    ],
)
def test_parse_malformed(text: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.parse(text)
    message = str(info.value)
    assert fragment in message
    assert message.strip() and "\n" not in message


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({}, "missing the fault kind"),
        ({"kind": "kill"}, "needs a target"),
        ({"kind": "kill", "rank": 1.5}, "rank must be an integer"),
        ({"kind": "kill", "rank": True}, "rank must be an integer"),
        ({"kind": "kill", "rank": float("inf")}, "rank must be an integer"),
        ({"kind": "kill", "rank": [1]}, "rank must be an integer"),
        ({"kind": "kill", "rank": 1, "at_step": 2.5}, "at_step must be an integer"),
        ({"kind": "kill", "rank": 1, "host": "h1"}, "targets a rank, not host=H"),
        ({"kind": "host"}, "needs a target: host=H"),
        ({"kind": "host", "rank": 1}, "needs a target: host=H"),
        ({"kind": "partition", "host": "h1", "rank": 0}, "takes host=H only"),
        ({"kind": "host", "host": "h1", "at_step": 3}, "takes host=H only"),
        ({"kind": "corrupt", "rank": 1, "target": "w1"}, "fault target must be one of"),
        ({"kind": None, "rank": 1}, "unknown fault kind"),
    ],
)
def test_from_dict_malformed(data: dict[str, Any], fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.from_dict(data, source="fault spec faults[0]")
    message = str(info.value)
    assert fragment in message and "\n" not in message


def test_from_dict_names_its_source() -> None:
    with pytest.raises(FaultSpecError, match=r"fault spec faults\[2\]"):
        FaultSpec.from_dict({"kind": "kill", "rank": 1, "x": 1}, source="fault spec faults[2]")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"kind": "kill", "rank": 1}, FaultSpec(kind=FaultKind.KILL, rank=1)),
        ({"kind": "kill", "rank": "2", "at_step": "3"}, FaultSpec(kind="kill", rank=2, at_step=3)),
        ({"kind": "kill", "rank": 4.0}, FaultSpec(kind="kill", rank=4)),  # integral float
        ({"kind": "kill", "rank": 0, "at_step": None}, FaultSpec(kind="kill", rank=0)),
        ({"kind": "host", "host": "h2"}, FaultSpec(kind=FaultKind.HOST, host="h2")),
        ({"kind": "partition", "host": "h0"}, FaultSpec(kind=FaultKind.PARTITION, host="h0")),
    ],
)
def test_from_dict_valid(data: dict[str, Any], expected: FaultSpec) -> None:
    assert FaultSpec.from_dict(data) == expected


@pytest.mark.parametrize(
    "spec",
    [
        FaultSpec(kind=FaultKind.KILL, rank=0),
        FaultSpec(kind=FaultKind.KILL, rank=3, at_step=15),
        FaultSpec(kind="kill", rank=1, at_step=1),
    ],
)
def test_to_dict_from_dict_and_text_round_trip(spec: FaultSpec) -> None:
    data = spec.to_dict()
    assert data["kind"] == "kill" and isinstance(data["kind"], str)
    assert None not in data.values()  # unset fields are left out
    assert FaultSpec.from_dict(data) == spec
    text = ",".join(f"{k}={v}" for k, v in data.items())
    assert FaultSpec.parse(text) == spec


def test_kind_given_as_string_is_normalised_to_enum() -> None:
    assert FaultSpec(kind="KILL", rank=0).kind is FaultKind.KILL


def test_spec_is_hashable_and_immutable() -> None:
    spec = FaultSpec(kind="kill", rank=1)
    assert len({spec, FaultSpec(kind=FaultKind.KILL, rank=1)}) == 1
    with pytest.raises(AttributeError):
        spec.rank = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (FaultSpec(kind="kill", rank=1, at_step=15), "kill rank 1 at step 15"),
        (FaultSpec(kind="kill", rank=2), "kill rank 2"),
        (FaultSpec(kind="kill", rank=0, at_step=1), "kill rank 0 at step 1"),
        (FaultSpec(kind="host", host="h2"), "host host h2"),
        (FaultSpec(kind="partition", host="h0"), "partition host h0"),
    ],
)
def test_describe(spec: FaultSpec, text: str) -> None:
    assert spec.describe() == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("slow,rank=3,at_step=5,delay=0.2", FaultSpec(kind="slow", rank=3, at_step=5, delay=0.2)),
        ("slow,rank=0,delay=0", FaultSpec(kind="slow", rank=0, delay=0.0)),
        ("kind=slow,rank=1,delay=2", FaultSpec(kind="slow", rank=1, delay=2.0)),
        (
            "kill,rank=2,at_step=9,phase=recovery",
            FaultSpec(kind="kill", rank=2, at_step=9, phase="recovery"),
        ),
        ("kill,rank=1,at_step=3,repeat", FaultSpec(kind="kill", rank=1, at_step=3, repeat=True)),
        ("kill,rank=1,repeat=true", FaultSpec(kind="kill", rank=1, repeat=True)),
        ("kill,rank=1,repeat=no", FaultSpec(kind="kill", rank=1)),
        (
            "kill,rank=1,at_step=8,phase=forward,detect_delay=2",
            FaultSpec(kind="kill", rank=1, at_step=8, phase="forward", detect_delay=2.0),
        ),
        ("hang,rank=2,at_step=8,epoch=3", FaultSpec(kind="hang", rank=2, at_step=8, epoch=3)),
    ],
)
def test_slow_recovery_and_repeat_round_trip(text: str, expected: FaultSpec) -> None:
    spec = FaultSpec.parse(text)
    assert spec == expected
    assert FaultSpec.from_dict(spec.to_dict()) == spec
    assert "repeat" not in spec.to_dict() or spec.repeat


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("slow,rank=1", "needs delay=S"),
        ("slow,rank=1,at_step=3", "needs delay=S"),
        ("slow,rank=1,delay=-0.5", "delay must be a finite number >= 0"),
        ("slow,rank=1,delay=nan", "delay must be a finite number >= 0"),
        ("slow,rank=1,delay=inf", "delay must be a finite number >= 0"),
        ("slow,rank=1,delay=soon", "delay must be a number"),
        ("kill,rank=1,delay=1", "delay applies to 'slow' faults only, not 'kill'"),
        ("hang,rank=1,delay=1", "delay applies to 'slow' faults only, not 'hang'"),
        ("kill,rank=1,phase=later", "fault phase must be one of"),
        ("kill,rank=1,repeat=maybe", "repeat must be true or false"),
        ("hang,rank=1,detect_delay=1", "detect_delay applies to 'kill' faults only"),
        ("kill,rank=1,detect_delay=-1", "detect_delay must be between 0 and 60"),
        ("kill,rank=1,detect_delay=nan", "detect_delay must be between 0 and 60"),
        ("kill,rank=1,epoch=0", "fault epoch must be >= 1"),
        ("kill,rank=1,epoch=soon", "epoch must be an integer"),
        ("host,host=h2,epoch=2", "takes host=H only"),
    ],
)
def test_slow_recovery_and_repeat_errors(text: str, fragment: str) -> None:
    with pytest.raises(FaultSpecError) as info:
        FaultSpec.parse(text)
    assert fragment in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("spec", "text"),
    [
        (
            FaultSpec(kind="slow", rank=3, at_step=5, delay=0.2),
            "slow rank 3 at step 5 (+0.2 s/step)",
        ),
        (
            FaultSpec(kind="kill", rank=2, at_step=9, phase="recovery"),
            "kill rank 2 at step 9 during recovery",
        ),
        (FaultSpec(kind="kill", rank=1, at_step=3, repeat=True), "kill rank 1 at step 3, repeated"),
        (
            FaultSpec(kind="hang", rank=2, at_step=8, epoch=3),
            "hang rank 2 at step 8 (from plan epoch 3)",
        ),
    ],
)
def test_describe_new_forms(spec: FaultSpec, text: str) -> None:
    assert spec.describe() == text


def test_slow_is_carried_out_by_the_worker() -> None:
    assert FaultKind.SLOW.signal is None


def test_host_fault_text_form_round_trips() -> None:
    spec = FaultSpec.parse("host,host=h2")
    assert spec == FaultSpec(kind=FaultKind.HOST, host="h2") and spec.kind.targets_host
    assert FaultSpec.from_dict(spec.to_dict()) == spec
    assert spec.kind.signal is None  # the daemon acts, not a signal to one worker


@pytest.mark.parametrize(
    ("spec", "epoch", "step", "armed"),
    [
        (FaultSpec(kind="kill", rank=1), 1, 1, True),
        (FaultSpec(kind="kill", rank=1, at_step=8), 2, 7, False),
        (FaultSpec(kind="kill", rank=1, at_step=8), 2, 8, True),
        (FaultSpec(kind="kill", rank=1, at_step=8), 2, 11, True),  # a later step: still due
        (FaultSpec(kind="hang", rank=2, at_step=8, epoch=3), 2, 8, False),  # not that plan yet
        (FaultSpec(kind="hang", rank=2, at_step=8, epoch=3), 3, 7, False),
        (FaultSpec(kind="hang", rank=2, at_step=8, epoch=3), 3, 10, True),  # joined late: at once
        (FaultSpec(kind="hang", rank=2, at_step=8, epoch=3), 4, 8, True),
        (FaultSpec(kind="hang", rank=2, epoch=3), 0, 1, False),  # before the first plan
    ],
)
def test_a_fault_is_armed_from_its_step_and_its_plan_epoch(
    spec: FaultSpec, epoch: int, step: int, armed: bool
) -> None:
    assert spec.armed(epoch, step) is armed
