"""Building the typed config from plain mappings: every key checked against the dataclasses'
annotations, unknown and missing keys named, values coerced (numbers, booleans, lists, fault
specs) with one-line errors."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any

from elaswave.errors import ConfigError, FaultSpecError
from elaswave.faults import FaultSpec

# "package.module:function": a factory, a collate or a loss named in a config
FUNCTION = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")
# "package.module.Class" or "package.module:Class": an optimizer or a scheduler
CLASS = re.compile(r"[A-Za-z_][\w.]*[.:][A-Za-z_]\w*")


def build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"unknown config key {where + unknown[0]!r} (known: {', '.join(sorted(names))})"
        )
    required = [
        f.name
        for f in dataclasses.fields(cls)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    missing = [name for name in required if name not in data]
    if missing:
        raise ConfigError(f"config key {where + missing[0]!r} is required")
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        kwargs[name] = coerce(value, hints[name], where + name)
    try:
        return cls(**kwargs)
    except FaultSpecError as exc:
        raise ConfigError(str(exc)) from None


def coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for arg in args[:-1]:  # one of several kinds (a number or "auto"): the first that fits
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        return coerce(value, args[-1], key)
    if origin is typing.Literal:
        # a fixed set of values: coerced as their type (str); the dataclass's __post_init__
        # checks the value, with its own one-line error
        return coerce(value, type(typing.get_args(tp)[0]), key)
    if tp is FaultSpec:
        if isinstance(value, FaultSpec):
            return value
        try:
            if isinstance(value, str):
                return FaultSpec.parse(value)
            if isinstance(value, dict):
                return FaultSpec.from_dict(value, source=f"fault spec {key}")
        except FaultSpecError as exc:
            raise ConfigError(str(exc)) from None
        raise ConfigError(f"config key {key!r} must be a fault spec")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a section (mapping)")
        return build(tp, value, key + ".")
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"config key {key!r} must be a mapping")
        return dict(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            sep = ";" if item_tp is FaultSpec else ","
            value = [v for v in value.split(sep) if v.strip()]
        if not isinstance(value, list):
            raise ConfigError(f"config key {key!r} must be a list")
        return [coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key {key!r} must be true or false, got {value!r}")
    if tp in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}")
        try:
            number = tp(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"config key {key!r} must be a number, got {value!r}") from None
        if tp is int and isinstance(value, float) and value != int(value):
            raise ConfigError(f"config key {key!r} must be an integer, got {value!r}")
        return number
    if tp is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"config key {key!r} must be a string")
        return str(value)
    return value


def positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
