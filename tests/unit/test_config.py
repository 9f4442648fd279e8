"""The typed job config and its loader: precedence, validation and one-line errors.

Every test passes ``env=`` explicitly, so the process environment never leaks in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from elaswave.config import JobConfig, load_config
from elaswave.errors import ConfigError
from elaswave.faults import FaultKind, FaultSpec


def write_yaml(tmp_path: Path, data: Any, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def config_error(**kwargs: Any) -> str:
    """Load with ``kwargs`` expecting a ConfigError; return its message, checked to be one line."""
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(**kwargs)
    message = str(info.value)
    assert message.strip(), "empty ConfigError message"
    assert "\n" not in message and "\r" not in message, f"multi-line message: {message!r}"
    return message


# ---- precedence ------------------------------------------------------------------------------


def test_defaults_without_file_env_or_overrides() -> None:
    cfg = load_config(env={})
    assert cfg == JobConfig()
    assert cfg.train.steps == 40
    assert cfg.faults == []


@pytest.mark.parametrize(
    ("env", "overrides", "expected"),
    [
        ({}, {}, 7),  # YAML beats the default (40)
        ({"ELASWAVE_TRAIN__STEPS": "8"}, {}, 8),  # env beats YAML
        ({"ELASWAVE_TRAIN__STEPS": "8"}, {"train.steps": 9}, 9),  # overrides beat env
        ({}, {"train.steps": 9}, 9),  # overrides beat YAML
        ({"ELASWAVE_TRAIN__STEPS": "8"}, {"train.steps": None}, 8),  # None = flag not given
    ],
)
def test_precedence_defaults_yaml_env_overrides(
    tmp_path: Path, env: dict[str, str], overrides: dict[str, Any], expected: int
) -> None:
    path = write_yaml(tmp_path, {"train": {"steps": 7}})
    cfg = load_config(path, env=env, overrides=overrides)
    assert cfg.train.steps == expected
    # Keys nobody set keep their defaults.
    assert cfg.train.global_batch == JobConfig().train.global_batch


def test_precedence_applies_per_key_not_per_section(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"train": {"steps": 7, "seed": 11}, "job_id": "from-yaml"})
    cfg = load_config(
        path,
        env={"ELASWAVE_TRAIN__STEPS": "8", "ELASWAVE_JOB_ID": "from-env"},
        overrides={"job_id": "from-flag"},
    )
    assert (cfg.train.steps, cfg.train.seed, cfg.job_id) == (8, 11, "from-flag")


def test_env_without_prefix_and_non_config_env_are_ignored() -> None:
    env = {
        "TRAIN__STEPS": "3",
        "HOME": "/nowhere",
        "ELASWAVE_STATE_DIR": "/tmp/state",
        "ELASWAVE_ETCD_USER": "u",
        "ELASWAVE_ETCD_PASSWORD": "p",
    }
    assert load_config(env=env) == JobConfig()


def test_env_nnodes_range_is_a_string_not_a_base60_number() -> None:
    # YAML 1.1 reads 1:2 as 62; the loader must keep MIN:MAX as text.
    cfg = load_config(env={"ELASWAVE_ELASTIC__NNODES": "1:2"})
    assert cfg.elastic.nnodes_range == (1, 2)


def test_yaml_unquoted_nnodes_range(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "elastic:\n  nnodes: 1:2\n  nproc_per_node: 2\n")
    assert load_config(path, env={}).elastic.nnodes_range == (1, 2)


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path, ""), env={}) == JobConfig()


# ---- unknown keys ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "dotted"),
    [
        ({"stepz": 3}, "stepz"),
        ({"train": {"stepz": 3}}, "train.stepz"),
        ({"model": {"d_modle": 64}}, "model.d_modle"),
        ({"timeouts": {"forever": 1.0}}, "timeouts.forever"),
    ],
)
def test_unknown_yaml_key_names_the_dotted_key(
    tmp_path: Path, data: dict[str, Any], dotted: str
) -> None:
    message = config_error(path=write_yaml(tmp_path, data))
    assert "unknown config key" in message
    assert repr(dotted) in message


@pytest.mark.parametrize(
    ("env", "dotted"),
    [
        ({"ELASWAVE_BOGUS": "1"}, "bogus"),
        ({"ELASWAVE_TRAIN__BOGUS": "1"}, "train.bogus"),
    ],
)
def test_unknown_env_key_names_the_dotted_key(env: dict[str, str], dotted: str) -> None:
    message = config_error(env=env)
    assert "unknown config key" in message and repr(dotted) in message


def test_unknown_override_key() -> None:
    message = config_error(overrides={"elastic.nproc": 2})
    assert repr("elastic.nproc") in message


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("train: [1, 2]\n", "'train' must be a section"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        ("train: {steps: 3\n", "not valid YAML"),
    ],
)
def test_badly_shaped_yaml(tmp_path: Path, text: str, fragment: str) -> None:
    assert fragment in config_error(path=write_yaml(tmp_path, text))


def test_missing_config_file(tmp_path: Path) -> None:
    assert "not found" in config_error(path=tmp_path / "absent.yaml")


# ---- consistency -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"train.global_batch": 30, "train.micro_batch_size": 4}, "multiple of"),
        # 4 workers (the default) but 3 micro-batches
        ({"train.global_batch": 6, "train.micro_batch_size": 2}, "inconsistent sizes"),
        (
            {"train.global_batch": 16, "elastic.nproc_per_node": 3, "elastic.nnodes": "1:3"},
            "inconsistent sizes",  # up to 9 workers, 8 micro-batches
        ),
        ({"model.d_model": 130, "model.n_head": 4}, "divisible"),
        ({"model.dropout": 1.0}, "dropout"),
        ({"train.steps": 0}, "train.steps"),
        ({"train.lr": 0.0}, "train.lr"),
        ({"train.lr": float("nan")}, "train.lr"),
        ({"timeouts.collective": float("nan")}, "timeouts.collective"),
        ({"timeouts.lease_ttl": 0}, "timeouts.lease_ttl"),
        ({"timeouts.hang": "later"}, "timeouts.hang must be auto or a number > 0, got 'later'"),
        ({"timeouts.hang": float("nan")}, "timeouts.hang must be auto or a number > 0"),
        ({"timeouts.hang": True}, "timeouts.hang must be auto or a number > 0, got 'True'"),
        ({"train.reduce_dtype": "float16"}, "reduce_dtype"),
        ({"train.device_time": -0.1}, "train.device_time"),
        ({"train.state_bandwidth": float("nan")}, "train.state_bandwidth"),
        ({"data.source": "tokens"}, "data.path"),
        ({"job_id": "has space"}, "job_id"),
        ({"etcd_port": 70000}, "etcd_port"),
        ({"elastic.max_restarts": -1}, "max_restarts"),
        ({"elastic.straggler_threshold": 0.5}, "straggler_threshold"),
        ({"elastic.straggler_threshold": 1.0}, "straggler_threshold"),
        ({"elastic.straggler_threshold": -3}, "straggler_threshold"),
        ({"elastic.straggler_threshold": float("nan")}, "straggler_threshold"),
        ({"elastic.loop_breaker": -1}, "loop_breaker"),
        ({"zero": 2}, "zero must be 0, 1 or 3, got 2"),
        ({"rack": "row 1/a"}, "rack must be 1-64 of [A-Za-z0-9_.-], got 'row 1/a'"),
        ({"zero": 3, "pp": 2, "grad_reduce": "all"}, "grad_reduce: all is not supported with"),
        (
            {"zero": 3, "pp": 2, "train.shard_scope": "host"},
            "train.shard_scope: host is not supported with zero: 3 inside pipeline stages",
        ),
        ({"zero": 3, "pp": 2, "train.zero3_gather": "tiers"}, "zero3_gather: tiers is not"),
        ({"train.grad_compress": "int8", "pp": 2}, "not pipelines' holder groups (got pp: 2)"),
        ({"train.shard_scope": "rack"}, "train.shard_scope must be job or host, got 'rack'"),
        ({"train.shard_scope": "host", "zero": 1}, "it needs zero: 3 (got zero: 1)"),
        (
            {"train.shard_scope": "host", "zero": 3, "train.zero3_gather": "tiers"},
            "with train.shard_scope host every gather stays inside the host",
        ),
        ({"stage_loss": "reroute"}, "stage_loss must be one of reshard, drop, recycle"),
        (
            {"stage_loss": "recycle", "pp": 2, "zero": 1},
            "zero: 1 is not supported with stage_loss recycle",
        ),
        ({"stage_loss": "recycle", "pp": 2, "dvfs": "sim"}, "dvfs: sim is not supported with"),
        ({"elastic.workers_per_device": 0}, "elastic.workers_per_device must be > 0, got 0"),
        ({"replay_every": -1}, "replay_every must be >= 0, got -1"),
        ({"replay_every": 1, "zero": 3}, "replay_every: zero: 3 reduce-scatters each layer's"),
        ({"replay_every": 1, "pp": 2}, "replay_every: pp=2 stages each hold part of the model"),
        ({"train.rng": "device"}, "train.rng must be sample or rank, got 'device'"),
        ({"train.batch": "grow"}, "train.batch must be fixed or shrink, got 'grow'"),
        ({"train.batch": "shrink"}, "train.batch: shrink needs train.partial_redo: false"),
        ({"train.rng": "rank", "pp": 2}, "train.rng: rank is an ablation for data parallelism"),
        (
            {"train.batch": "shrink", "train.partial_redo": False, "zero": 3},
            "train.batch: shrink is an ablation for data parallelism's whole-model path",
        ),
        (
            {"elastic.workers_per_device": 2, "dvfs": "nvml", "pp": 2},
            "dvfs=nvml clocks each worker's own device: it cannot be used with "
            "elastic.workers_per_device 2 (shared devices)",
        ),
    ],
)
def test_invalid_values(overrides: dict[str, Any], fragment: str) -> None:
    assert fragment in config_error(overrides=overrides)


def test_replay_every_is_allowed_on_the_whole_model_data_path() -> None:
    for zero in (0, 1):
        cfg = load_config(env={}, overrides={"replay_every": 2, "zero": zero})
        assert cfg.replay_every == 2


def test_workers_equal_to_microbatches_is_allowed() -> None:
    cfg = load_config(env={}, overrides={"train.global_batch": 8, "train.micro_batch_size": 2})
    assert cfg.train.num_microbatches == 4 == cfg.elastic.nproc_per_node


@pytest.mark.parametrize("nnodes", ["0", "3:2", "a", "", "1:", ":2", "0:2", "-1", "1:2:3"])
def test_bad_nnodes(nnodes: str) -> None:
    assert "elastic.nnodes" in config_error(overrides={"elastic.nnodes": nnodes})


@pytest.mark.parametrize(
    ("nnodes", "expected"),
    [("1", (1, 1)), ("2", (2, 2)), ("1:2", (1, 2)), (" 1 : 2 ", (1, 2)), ("2:2", (2, 2))],
)
def test_good_nnodes(nnodes: str, expected: tuple[int, int]) -> None:
    cfg = load_config(env={}, overrides={"elastic.nnodes": nnodes, "elastic.nproc_per_node": 2})
    assert cfg.elastic.nnodes_range == expected


# ---- faults ----------------------------------------------------------------------------------


EXPECTED_FAULTS = [
    FaultSpec(kind=FaultKind.KILL, rank=1, at_step=3),
    FaultSpec(kind=FaultKind.KILL, rank=2),
]


def test_faults_from_yaml_list_of_dicts(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        {"faults": [{"kind": "kill", "rank": 1, "at_step": 3}, {"kind": "kill", "rank": 2}]},
    )
    assert load_config(path, env={}).faults == EXPECTED_FAULTS


def test_faults_from_yaml_list_of_strings(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"faults": ["kill,rank=1,at_step=3", "kind=kill,rank=2"]})
    assert load_config(path, env={}).faults == EXPECTED_FAULTS


def test_faults_from_env_string() -> None:
    cfg = load_config(env={"ELASWAVE_FAULTS": "kill,rank=1,at_step=3;kill,rank=2"})
    assert cfg.faults == EXPECTED_FAULTS


def test_faults_env_replaces_yaml(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, {"faults": [{"kind": "kill", "rank": 3}]})
    cfg = load_config(path, env={"ELASWAVE_FAULTS": "kill,rank=2"})
    assert cfg.faults == [FaultSpec(kind=FaultKind.KILL, rank=2)]


def test_faults_from_overrides_as_specs() -> None:
    cfg = load_config(env={}, overrides={"faults": list(EXPECTED_FAULTS)})
    assert cfg.faults == EXPECTED_FAULTS


@pytest.mark.parametrize(
    ("faults", "fragment"),
    [
        ("kill,rank=1,at_step=41", "after the last step"),  # default 40 steps
        ("kill,rank=4", "rank out of range"),  # default 4 workers on 1 node
        ("kill,rank=1;kill,rank=9,at_step=2", "rank out of range"),
        ("boom,rank=1", "unknown fault kind"),
        ("kill", "needs a target"),
        ("kill,rank=x", "rank must be an integer"),
        ("kill,rank=1,when=now", "unknown field"),
    ],
)
def test_bad_faults_from_env(faults: str, fragment: str) -> None:
    assert fragment in config_error(env={"ELASWAVE_FAULTS": faults})


@pytest.mark.parametrize(
    ("fault", "fragment"),
    [
        ({"kind": "kill", "rank": 1, "at_step": 8}, "after the last step"),
        ({"kind": "kill", "rank": 1, "at_step": 0}, "at_step must be >= 1"),
        ({"kind": "kill", "rank": 1.5}, "rank must be an integer"),
        ({"kind": "kill", "rank": True}, "rank must be an integer"),
        ({"rank": 1}, "missing the fault kind"),
        (42, "must be a fault spec"),
    ],
)
def test_bad_faults_from_yaml(tmp_path: Path, fault: Any, fragment: str) -> None:
    path = write_yaml(tmp_path, {"train": {"steps": 7}, "faults": [fault]})
    assert fragment in config_error(path=path)


def test_fault_at_last_step_and_last_rank_are_allowed() -> None:
    cfg = load_config(
        env={"ELASWAVE_TRAIN__STEPS": "7", "ELASWAVE_FAULTS": "kill,rank=3,at_step=7"}
    )
    assert cfg.faults == [FaultSpec(kind=FaultKind.KILL, rank=3, at_step=7)]


def test_fault_rank_range_follows_max_nodes() -> None:
    # 2 per node, up to 3 nodes: ranks 0..5 exist.
    overrides = {"elastic.nproc_per_node": 2, "elastic.nnodes": "1:3"}
    ok = load_config(env={"ELASWAVE_FAULTS": "kill,rank=5"}, overrides=overrides)
    assert ok.faults[0].rank == 5
    message = config_error(env={"ELASWAVE_FAULTS": "kill,rank=6"}, overrides=overrides)
    assert "0..5" in message


# ---- types -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("source", "key", "value"),
    [
        ("env", "ELASWAVE_TRAIN__STEPS", "abc"),
        ("env", "ELASWAVE_TRAIN__LR", "fast"),
        ("env", "ELASWAVE_TRAIN__STEPS", "7.5"),
        ("yaml", "train.steps", "abc"),
        ("yaml", "train.steps", 7.5),
        ("yaml", "train.steps", True),
        ("yaml", "train.steps", float("inf")),
        ("yaml", "train.steps", [1]),
        ("yaml", "model.dropout", {"p": 0.1}),
        ("yaml", "job_id", ["a", "b"]),
        ("yaml", "etcd", 5),
        ("override", "train.seed", "abc"),
    ],
)
def test_wrong_types(tmp_path: Path, source: str, key: str, value: Any) -> None:
    if source == "env":
        message = config_error(env={key: value})
    elif source == "yaml":
        section, _, leaf = key.rpartition(".")
        data: dict[str, Any] = {section: {leaf: value}} if section else {leaf: value}
        message = config_error(path=write_yaml(tmp_path, data))
    else:
        message = config_error(overrides={key: value})
    dotted = key.removeprefix("ELASWAVE_").lower().replace("__", ".")
    assert repr(dotted) in message


@pytest.mark.parametrize(
    ("env", "attr", "expected"),
    [
        ({"ELASWAVE_TRAIN__STEPS": "12"}, ("train", "steps"), 12),
        ({"ELASWAVE_TRAIN__LR": "0.01"}, ("train", "lr"), 0.01),
        ({"ELASWAVE_TRAIN__LR": "3e-3"}, ("train", "lr"), 3e-3),
        ({"ELASWAVE_JOB_ID": "job-7"}, ("job_id",), "job-7"),
        ({"ELASWAVE_RUN_DIR": "/tmp/r"}, ("run_dir",), "/tmp/r"),
        ({"ELASWAVE_ETCD": "h1:2379,h2:2379"}, ("etcd",), ["h1:2379", "h2:2379"]),
        ({"ELASWAVE_TIMEOUTS__LEASE_TTL": "9"}, ("timeouts", "lease_ttl"), 9),
        ({}, ("timeouts", "hang"), "auto"),  # the default
        ({"ELASWAVE_TIMEOUTS__HANG": "1.5"}, ("timeouts", "hang"), 1.5),
        ({"ELASWAVE_TIMEOUTS__HANG": "2"}, ("timeouts", "hang"), 2.0),
        ({"ELASWAVE_TIMEOUTS__HANG": "auto"}, ("timeouts", "hang"), "auto"),
    ],
)
def test_env_values_are_coerced_to_field_types(
    env: dict[str, str], attr: tuple[str, ...], expected: Any
) -> None:
    value: Any = load_config(env=env)
    for name in attr:
        value = getattr(value, name)
    assert value == expected
    assert type(value) is type(expected)


# ---- round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {
            "job_id": "rt",
            "run_dir": "/tmp/rt",
            "etcd": ["h1:2379", "h2:2379"],
            "host_id": "host-a",
            "train.steps": 9,
            "train.lr": 0.5,
            "elastic.nnodes": "1:2",
            "elastic.nproc_per_node": 2,
            "model.dropout": 0.0,
            "faults": [FaultSpec(kind="kill", rank=1, at_step=3), FaultSpec(kind="kill", rank=0)],
        },
        {"timeouts.hang": 2.5},
        {"timeouts.hang": "2.5"},
    ],
)
def test_to_dict_from_dict_round_trip(tmp_path: Path, overrides: dict[str, Any]) -> None:
    cfg = load_config(env={}, overrides=overrides)
    data = cfg.to_dict()
    assert JobConfig.from_dict(data) == cfg
    # The dict is plain data: it survives YAML and reloading through the file path too.
    path = write_yaml(tmp_path, data)
    assert load_config(path, env={}) == cfg
    assert all(isinstance(f, dict) for f in data["faults"])


def test_resolved_run_dir() -> None:
    assert load_config(env={}, overrides={"job_id": "j1"}).resolved_run_dir == Path("runs/j1")
    assert load_config(env={"ELASWAVE_RUN_DIR": "/x/y"}).resolved_run_dir == Path("/x/y")
