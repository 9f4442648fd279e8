"""The ``logging`` section (TensorBoard, W&B): where it comes from, what it refuses, and a
missing package as one line naming the extra, before anything starts."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest
import typer.testing

from elaswave.cli.app import app
from elaswave.config import load_config
from elaswave.config import observe as observe_mod
from elaswave.config.jobs import training_config
from elaswave.errors import ConfigError

runner = typer.testing.CliRunner()


def test_off_by_default() -> None:
    cfg = load_config(env={})
    assert cfg.logging.tensorboard is None and cfg.logging.wandb is None
    assert not cfg.logging.enabled and cfg.logging.streams == ()


@pytest.mark.parametrize(
    ("kwargs", "tensorboard", "wandb"),
    [
        ({"overrides": {"logging.tensorboard": "tb"}}, "tb", None),
        ({"env": {"ELASWAVE_LOGGING__TENSORBOARD": "tb2"}}, "tb2", None),
        (
            {"env": {"ELASWAVE_LOGGING__WANDB": "{project: p, mode: offline}"}},
            None, ("p", "offline"),
        ),
        ({"env": {"ELASWAVE_LOGGING__WANDB": "{}"}}, None, ("elaswave", "online")),
    ],
)  # fmt: skip
def test_where_the_section_comes_from(
    kwargs: dict[str, Any], tensorboard: str | None, wandb: tuple | None
) -> None:
    kwargs.setdefault("env", {})
    cfg = load_config(**kwargs)
    assert cfg.logging.tensorboard == tensorboard
    got = (cfg.logging.wandb.project, cfg.logging.wandb.mode) if cfg.logging.wandb else None
    assert got == wandb
    assert cfg.logging.enabled


def test_disabled_wandb_is_no_stream() -> None:
    cfg = load_config(env={"ELASWAVE_LOGGING__WANDB": "{mode: disabled}"})
    assert cfg.logging.streams == () and not cfg.logging.enabled


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({"ELASWAVE_LOGGING__WANDB": "{mode: sometimes}"}, "logging.wandb.mode must be one of"),
        ({"ELASWAVE_LOGGING__WANDB": "{team: x}"}, "unknown config key 'logging.wandb.team'"),
        ({"ELASWAVE_LOGGING__TENSORBOARD": "' '"}, "logging.tensorboard must be a directory"),
        ({"ELASWAVE_LOGGING__COLOR": "x"}, "unknown config key 'logging.color'"),
    ],
)
def test_refused(env: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        load_config(env=env)


def test_every_host_must_log_the_same_way() -> None:
    """One stream per job: the section is part of what the hosts agree on."""
    a = training_config(load_config(env={}))
    b = training_config(load_config(overrides={"logging.tensorboard": "tb"}, env={}))
    assert a != b and b["logging"]["tensorboard"] == "tb"


def _missing(monkeypatch: pytest.MonkeyPatch, package: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        observe_mod.importlib.util, "find_spec",
        lambda name, *a: None if name == package else real(name, *a),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "env", "package", "line"),
    [
        (["--tensorboard", "tb"], {}, "tensorboard",
         "error: logging.tensorboard needs the tensorboard package: "
         "pip install 'elaswave[tensorboard]'"),
        ([], {"ELASWAVE_LOGGING__WANDB": "{mode: offline}"}, "wandb",
         "error: logging.wandb needs the wandb package: pip install 'elaswave[wandb]'"),
    ],
)  # fmt: skip
def test_a_missing_package_is_one_line_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    args: list[str],
    env: dict[str, str],
    package: str,
    line: str,
) -> None:
    import elaswave.daemon.launch as launch_mod

    for key in list(os.environ):
        if key.startswith("ELASWAVE_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("ELASWAVE_STATE_DIR", str(tmp_path))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _missing(monkeypatch, package)

    def forbidden(*a: object, **k: object) -> None:
        raise AssertionError("started a job with a stream it cannot write")

    monkeypatch.setattr(launch_mod, "launch", forbidden)
    result = runner.invoke(app, ["launch", "--run-dir", str(tmp_path / "run"), *args])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    try:
        text = result.stderr
    except ValueError:
        text = result.output
    assert [ln for ln in text.splitlines() if ln.strip()] == [line]
    overrides = {"logging.tensorboard": "tb"} if args else None
    with pytest.raises(ConfigError, match=f"elaswave\\[{package}\\]"):  # launch() checks too
        launch_mod.check_packages(load_config(env=env, overrides=overrides).logging)
