"""The one loader: defaults < YAML file < ``ELASWAVE_*`` environment < command-line flags.

Environment names are ``ELASWAVE_<SECTION>__<FIELD>`` for section fields
(``ELASWAVE_TRAIN__STEPS=40``) and ``ELASWAVE_<FIELD>`` for top-level ones (``ELASWAVE_JOB_ID``).
This module is the only place that reads ``os.environ``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from elaswave.config.job import JobConfig
from elaswave.config.schema import first_line
from elaswave.errors import ConfigError

ENV_PREFIX = "ELASWAVE_"


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> JobConfig:
    """Defaults < YAML at ``path`` < ``ELASWAVE_*`` env < ``overrides`` (``train.steps``)."""
    return JobConfig.from_dict(config_values(path, overrides=overrides, env=env))


def config_values(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """What :func:`load_config` builds the config from: the values the YAML, the environment
    and the overrides give (nested by section), without the defaults."""
    merged: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.load(p.read_text(), Loader=_YamlLoader) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML ({first_line(exc)})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        merged = loaded
    env = os.environ if env is None else env
    for key, raw in sorted(env.items()):
        if not key.startswith(ENV_PREFIX) or key in _NOT_CONFIG_ENV:
            continue
        dotted = key[len(ENV_PREFIX) :].lower().replace("__", ".")
        _set_dotted(merged, dotted, yaml.load(raw, Loader=_YamlLoader) if raw else raw)
    for dotted, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(merged, dotted, value)
    return merged


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without YAML 1.1 base-60 numbers, so ``nnodes: 1:2`` stays ``"1:2"``,
    and with only ``true``/``false`` as booleans (YAML 1.2), so ``autocast: off`` is ``"off"``."""

    def resolve(self, kind: Any, value: Any, implicit: Any) -> str:
        tag = super().resolve(kind, value, implicit)
        if kind is yaml.ScalarNode and ":" in str(value) and tag.endswith((":int", ":float")):
            return "tag:yaml.org,2002:str"
        if kind is yaml.ScalarNode and tag.endswith(":bool") and value.lower() not in BOOLS:
            return "tag:yaml.org,2002:str"
        return tag


BOOLS = ("true", "false")


# Environment variables that are not config fields (read by :func:`state_dir` and
# :func:`etcd_credentials`).
_NOT_CONFIG_ENV = {"ELASWAVE_STATE_DIR", "ELASWAVE_ETCD_USER", "ELASWAVE_ETCD_PASSWORD"}


def etcd_credentials(env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """etcd user and password from ``ELASWAVE_ETCD_USER`` / ``ELASWAVE_ETCD_PASSWORD``.

    Credentials come from the environment only, never from flags or YAML, so that they do not
    show up in ``ps``, shell history or a config file checked into a repository.
    """
    env = os.environ if env is None else env
    user = env.get("ELASWAVE_ETCD_USER") or None
    password = env.get("ELASWAVE_ETCD_PASSWORD") or None
    if user is None and password is None:
        return None
    if user is None or password is None:
        missing = "ELASWAVE_ETCD_USER" if user is None else "ELASWAVE_ETCD_PASSWORD"
        raise ConfigError(f"etcd credentials: {missing} is not set (set both or neither)")
    return user, password


def state_dir(env: Mapping[str, str] | None = None) -> Path:
    """Per-user directory where running jobs leave their discovery files."""
    env = os.environ if env is None else env
    if env.get("ELASWAVE_STATE_DIR"):
        return Path(env["ELASWAVE_STATE_DIR"])
    base = env.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "elaswave"


def cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Per-user cache directory (``$XDG_CACHE_HOME/elaswave``, else ``~/.cache/elaswave``):
    where tokenized text is kept unless ``data.cache_dir`` says otherwise."""
    env = os.environ if env is None else env
    base = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "elaswave"


def _set_dotted(target: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = target
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key {part!r} is not a section")
        node = child
    node[leaf] = value
