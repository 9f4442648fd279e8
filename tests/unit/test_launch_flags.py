"""`elaswave launch`'s flags meet the config schema in one table (config.LAUNCH_FLAGS)."""

from __future__ import annotations

import inspect
import types
import typing
from pathlib import Path

import pytest

from elaswave.cli.launch import launch
from elaswave.config import LAUNCH_FLAGS, schema_type

NOT_CONFIG = {"ctx", "config", "fault", "host_addr", "quiet", "progress_every"}  # not config keys


def _flag_type(name: str) -> type:
    hint = typing.get_type_hints(launch)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) in (typing.Union, types.UnionType) else hint


def test_every_launch_option_is_in_the_table_and_nothing_else() -> None:
    params = set(inspect.signature(launch).parameters)
    assert params - NOT_CONFIG == set(LAUNCH_FLAGS)


@pytest.mark.parametrize("name", sorted(LAUNCH_FLAGS))
def test_flag_type_agrees_with_the_schema(name: str) -> None:
    key = LAUNCH_FLAGS[name]
    schema = schema_type(key)
    schema_args = [a for a in typing.get_args(schema) if a is not type(None)]
    flag = _flag_type(name)
    if len(schema_args) > 1:  # one of several kinds (a number or "auto"): the config coerces
        assert flag is str, f"--{name} fills {key}, a number or a word, from a string"
        return
    if typing.get_origin(schema) in (typing.Union, types.UnionType):
        schema = schema_args[0]
    if typing.get_origin(schema) is typing.Literal:  # a fixed set of values: the config checks it
        values = typing.get_args(schema)
        assert {type(v) for v in values} == {flag}, f"--{name} is {flag}, {key} is {schema}"
    elif typing.get_origin(schema) is list:
        assert flag is str, f"--{name} fills list {key} from a comma-separated string"
    elif flag is Path:
        assert schema is str, f"--{name} is a path; {key} must hold it as a string"
    else:
        assert flag is schema, f"--{name} is {flag}, {key} is {schema}"


def test_schema_type_rejects_unknown_keys() -> None:
    assert schema_type("train.steps") is int
    for bad in ("train.stepz", "nope", "train.steps.more"):
        with pytest.raises(KeyError):
            schema_type(bad)
