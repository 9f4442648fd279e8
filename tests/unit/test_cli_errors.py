"""User errors on the command line: one line, non-zero exit, and nothing started first.

Every path here must fail while validating its input, before any etcd, daemon or worker exists;
the ``no_side_effects`` fixture turns a call into those entry points into a test failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import typer.testing
import yaml
from typer.testing import Result  # typer may vendor click: never import click itself

from elaswave.cli.app import app

runner = typer.testing.CliRunner()


@pytest.fixture(autouse=True)
def isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No ELASWAVE_* from the caller's shell; an empty per-test state dir."""
    for key in list(os.environ):
        if key.startswith("ELASWAVE_"):
            monkeypatch.delenv(key)
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setenv("ELASWAVE_STATE_DIR", str(state))
    return state


@pytest.fixture(autouse=True)
def no_side_effects(monkeypatch: pytest.MonkeyPatch) -> None:
    import elaswave.daemon.etcd as etcd_mod
    import elaswave.daemon.etcd_server as etcd_server
    import elaswave.daemon.launch as launch_mod

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a user error must be reported before anything is started")

    monkeypatch.setattr(launch_mod, "launch", forbidden)
    monkeypatch.setattr(etcd_server.EmbeddedEtcd, "start", forbidden)
    monkeypatch.setattr(etcd_mod.Etcd, "connect", forbidden)


def error_text(result: Result) -> str:
    """What the command printed on stderr (older click mixes it into ``output``)."""
    try:
        text = result.stderr
    except ValueError:  # stderr not captured separately
        text = ""
    return text or result.output


def one_error_line(result: Result) -> str:
    """Assert a clean user-error exit and return its single message line."""
    assert result.exit_code != 0, result.output
    # A handled error exits through SystemExit, never a traceback from some other exception.
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    lines = [line for line in error_text(result).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_launch_unknown_config_key(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"train": {"steps": 3, "stepz": 4}}))
    result = runner.invoke(app, ["launch", str(config)])
    line = one_error_line(result)
    assert "unknown config key" in line
    assert "train.stepz" in line
    assert result.exit_code == 2


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--fault", "boom"], "boom"),
        (["--fault", "kill"], "needs a target"),
        (["--fault", "kill,rank=1,at_step=0"], "at_step"),
        (["--fault", "kill,rank=1", "--fault", "kill,rank=x"], "rank must be an integer"),
        (["--fault", "kill,rank=9"], "rank out of range"),
        (["--fault", "kill,rank=1,at_step=5", "--steps", "4"], "after the last step"),
        (["--steps", "0"], "train.steps"),
        (["--nnodes", "3:2"], "elastic.nnodes"),
        (["--nproc-per-node", "0"], "elastic.nproc_per_node"),
        (["--nproc-per-node", "64"], "inconsistent sizes"),
        (["--job-id", "bad id"], "job_id"),
        (["--etcd", "nohostport"], "bad etcd endpoint"),
        (["--max-restarts", "-1"], "max_restarts"),
        (["--fault", "slow,rank=1,at_step=3"], "needs delay=S"),
        (["--fault", "slow,rank=1,delay=-1"], "delay must be a finite number >= 0"),
        (["--fault", "kill,rank=1,delay=2"], "delay applies to 'slow' faults only"),
        (["--straggler-threshold", "0.9"], "straggler_threshold"),
        (["--loop-breaker", "-2"], "loop_breaker"),
        (["--snapshot-every", "-1"], "snapshot_every must be >= 0"),
        (["--metrics-port", "70000"], "metrics_port must be 0..65535"),
        (["--progress-every", "0"], "--progress-every must be > 0"),
        (["--device", "tpu"], "train.device must be one of auto, cpu, cuda, npu"),
        (["--workers-per-device", "0"], "elastic.workers_per_device must be > 0, got 0"),
        (["--hang-timeout", "soon"], "timeouts.hang must be auto or a number > 0, got 'soon'"),
        (["--hang-timeout", "0"], "timeouts.hang must be auto or a number > 0, got 0.0"),
        (["--hang-timeout", "-2"], "timeouts.hang must be auto or a number > 0, got -2.0"),
        (["--hang-timeout", "0.3"], "timeouts.hang (0.3) must be at least twice"),
    ],
)
def test_launch_bad_flags(args: list[str], fragment: str) -> None:
    line = one_error_line(runner.invoke(app, ["launch", *args]))
    assert fragment in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has a CUDA device")
@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--device", "cuda"], "error: --device cuda: no CUDA device on this host"),
        (["--device", "npu"], "error: --device npu: no NPU device on this host"),
    ],
)
def test_launch_on_a_device_this_host_lacks(args: list[str], line: str) -> None:
    assert one_error_line(runner.invoke(app, ["launch", *args])) == line


def test_launch_missing_config_file(tmp_path: Path) -> None:
    line = one_error_line(runner.invoke(app, ["launch", str(tmp_path / "absent.yaml")]))
    assert "not found" in line


def test_launch_bad_env_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASWAVE_TRAIN__STEPS", "abc")
    line = one_error_line(runner.invoke(app, ["launch"]))
    assert "train.steps" in line


def test_report_on_empty_dir(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    line = one_error_line(runner.invoke(app, ["report", "--run-dir", str(empty)]))
    assert "no run found" in line and "events.jsonl" in line


@pytest.mark.parametrize("fmt", ["xml", "JSON", ""])
def test_report_unknown_format(tmp_path: Path, fmt: str) -> None:
    result = runner.invoke(app, ["report", "--format", fmt, "--run-dir", str(tmp_path / "X")])
    line = one_error_line(result)
    assert "--format" in line


def test_report_baseline_is_for_html_and_must_be_a_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"t": 1.0, "kind": "host_joined"}) + "\n")
    (run / "metrics.jsonl").write_text("")
    base = ["--run-dir", str(run), "--baseline", str(tmp_path / "nothing")]
    assert "--baseline is for --format html" in one_error_line(
        runner.invoke(app, ["report", *base])
    )
    line = one_error_line(runner.invoke(app, ["report", "--format", "html", *base]))
    assert "not a run directory" in line


def test_status_watch_is_not_json() -> None:
    line = one_error_line(runner.invoke(app, ["status", "--job-id", "x", "--watch", "--json"]))
    assert "--watch and --json" in line


def test_report_needs_a_run() -> None:
    line = one_error_line(runner.invoke(app, ["report"]))
    assert "--run-dir" in line


def test_report_of_unknown_job_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # the fallback runs/<job-id> must not exist
    line = one_error_line(runner.invoke(app, ["report", "--job-id", "nope"]))
    assert "nope" in line


def test_report_json_of_a_real_run_succeeds(tmp_path: Path) -> None:
    # The counterpart of the error paths: a valid run directory is reported, exit 0.
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(json.dumps({"t": 1.0, "kind": "host_joined"}) + "\n")
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 2.0, "epoch": 1, "world_size": 1, "time": 2.0}) + "\n"
    )
    result = runner.invoke(app, ["report", "--format", "json", "--run-dir", str(run)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["incidents"] == [] and report["totals"]["committed_steps"] == 1


def test_inject_fault_unknown_job() -> None:
    result = runner.invoke(
        app, ["inject-fault", "--job-id", "nope", "--kind", "kill", "--rank", "0"]
    )
    line = one_error_line(result)
    assert "nope" in line


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--kind", "boom", "--rank", "0"], "unknown fault kind"),
        (["--kind", "kill"], "needs a target"),
        (["--kind", "kill", "--rank", "-1"], "rank must be >= 0"),
        (["--kind", "kill", "--rank", "0", "--at-step", "0"], "at_step"),
        (["--kind", "slow", "--rank", "0"], "needs delay=S"),
        (["--kind", "slow", "--rank", "0", "--delay", "-1"], "delay must be a finite number"),
        (["--kind", "hang", "--rank", "0", "--delay", "1"], "delay applies to 'slow' faults"),
        (["--kind", "host"], "needs a target: host=H"),
        (["--kind", "partition", "--host", "h1", "--rank", "0"], "takes host=H only"),
        (["--kind", "kill", "--host", "h1"], "targets a rank"),
    ],
)
def test_inject_fault_bad_spec(args: list[str], fragment: str) -> None:
    line = one_error_line(runner.invoke(app, ["inject-fault", "--job-id", "nope", *args]))
    assert fragment in line


def test_valid_launch_reaches_the_guard() -> None:
    # Proves the guard above is wired: valid flags get as far as starting the job.
    result = runner.invoke(app, ["launch", "--steps", "3", "--fault", "kill,rank=1,at_step=2"])
    assert isinstance(result.exception, AssertionError), result.output
    assert "before anything is started" in str(result.exception)


def _token_job(tmp_path: Path, tokens: list[int], dtype: str = "uint16", **model: object) -> Path:
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.asarray(tokens, dtype=dtype).tofile(path)
    cfg = {
        "model": {"vocab_size": 256, "seq_len": 8, **model},
        "data": {"source": "tokens", "path": str(path), "dtype": dtype},
    }
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        (list(range(8)), "8 tokens is too short for one sample of seq_len 8"),
        ([1, 2, 3, 300, 4, 5, 6, 7, 8, 9], "token 300 at position 3 is not below"),
        ([255] * 20 + [256], "token 256 at position 20 is not below the model's vocab_size 256"),
    ],
)
def test_launch_refuses_unusable_token_data(
    tmp_path: Path, tokens: list[int], fragment: str
) -> None:
    """Before anything starts: fewer tokens than one sample, or an id past the vocabulary."""
    result = runner.invoke(app, ["launch", str(_token_job(tmp_path, tokens))])
    line = one_error_line(result)
    assert line.startswith("error: data: ") and fragment in line, line


def test_launch_refuses_a_missing_token_file(tmp_path: Path) -> None:
    config = _token_job(tmp_path, list(range(20)))
    (tmp_path / "tokens.bin").unlink()
    assert "is not a file" in one_error_line(runner.invoke(app, ["launch", str(config)]))


def test_launch_takes_token_data_within_the_vocabulary(tmp_path: Path) -> None:
    result = runner.invoke(app, ["launch", str(_token_job(tmp_path, [255] * 20))])
    assert isinstance(result.exception, AssertionError), result.output  # reached the guard


@pytest.mark.parametrize(
    ("train", "fragment"),
    [
        ({"optimizer": "lion"}, "train.optimizer must be adamw, sgd or a dotted class name"),
        ({"momentum": 1.0}, "train.momentum must be in [0, 1)"),
        ({"weight_decay": -0.1}, "train.weight_decay must be >= 0"),
        ({"param_groups": [{"params": [], "weight_decay": 0.1}]}, "needs at least one params"),
        ({"eval_every": 5}, "train.eval_every needs held-out samples: set data.eval_samples"),
        ({"eval_every": -1}, "train.eval_every must be >= 0"),
        ({"param_groups": [{"params": ["*"]}]}, "train.param_groups[0].weight_decay' is required"),
    ],
)
def test_launch_refuses_a_bad_optimizer(tmp_path: Path, train: dict, fragment: str) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"train": train}))
    line = one_error_line(runner.invoke(app, ["launch", str(config)]))
    assert fragment in line, line


def test_launch_refuses_holding_out_every_sample(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({"data": {"num_samples": 64, "eval_samples": 64}}))
    line = one_error_line(runner.invoke(app, ["launch", str(config)]))
    assert "data.eval_samples (64) leaves no training samples" in line, line
    tokens = _token_job(tmp_path, list(range(40)))  # 40 tokens: 4 samples of 8 (+1)
    cfg = yaml.safe_load(tokens.read_text())
    cfg["data"]["eval_samples"] = 4
    tokens.write_text(yaml.safe_dump(cfg))
    line = one_error_line(runner.invoke(app, ["launch", str(tokens)]))
    assert "leaves none of the data set's 4 samples for training" in line, line


def _text_job(tmp_path: Path, text: str, name: str = "a.jsonl", vocab: int = 257) -> Path:
    (tmp_path / name).write_text(text)
    cfg = {
        "model": {"vocab_size": vocab, "seq_len": 8},
        "data": {"source": "text", "files": [str(tmp_path / name)],
                 "cache_dir": str(tmp_path / "cache")},
    }  # fmt: skip
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.mark.parametrize(
    ("text", "vocab", "fragment"),
    [
        ('{"text": "a"}\n{"body": "x"}\n', 257, "a.jsonl:2: no 'text' field (data.text_field)"),
        ('{"text": ""}\n', 257, "a.jsonl has no text"),
        ('{"text": "' + "long enough " * 3 + '"}\n', 256,
         "data: UTF-8 bytes has a vocabulary of 257 (end of document 256 included), more than "
         "the model's vocab_size 256"),
    ],
)  # fmt: skip
def test_launch_refuses_unusable_text(tmp_path: Path, text: str, vocab: int, fragment: str) -> None:
    line = one_error_line(
        runner.invoke(app, ["launch", str(_text_job(tmp_path, text, vocab=vocab))])
    )
    assert line.startswith("error: ") and fragment in line, line
    assert not list((tmp_path / "cache").glob("*.tokens"))


def test_launch_tokenizes_text_once_and_hands_the_job_the_token_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not on a terminal, the first launch says it tokenizes and where to; the job it starts
    names the cached file. A second launch (quiet: nothing shown) reuses that file."""
    import elaswave.daemon.launch as launch_mod

    config = _text_job(tmp_path, "".join(f'{{"text": "document {i}"}}\n' for i in range(4)))
    result = runner.invoke(app, ["launch", str(config)])
    assert isinstance(result.exception, AssertionError), result.output  # reached the guard
    (cached,) = (tmp_path / "cache").glob("*.tokens")
    assert "tokenizing 92 bytes of text" in result.output  # 4 lines of 23 bytes
    assert f"tokenized into {cached}" in result.output
    stamp = cached.stat().st_mtime_ns
    started: list[Any] = []
    monkeypatch.setattr(launch_mod, "launch", lambda cfg, **kw: started.append(cfg) or 0)
    result = runner.invoke(app, ["launch", str(config), "--quiet"])
    assert result.exit_code == 0 and result.output == "", result.output
    assert started[0].data.path == str(cached.resolve()) and started[0].data.dtype == "uint16"
    assert cached.stat().st_mtime_ns == stamp
