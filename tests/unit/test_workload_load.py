"""From a config to a workload: the built-in GPT, a user factory, and one clear error for each
way a factory can be wrong."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
import torch

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.workload.gpt import GPTWorkload
from elaswave.runtime.workload.load import load_workload
from examples.mlp_classifier import MLPClassifier


@pytest.fixture
def fake_module() -> Iterator[types.ModuleType]:
    mod = types.ModuleType("fake_workloads")
    mod.not_a_workload = lambda: object()  # type: ignore[attr-defined]
    mod.broken = lambda: 1 / 0  # type: ignore[attr-defined]
    mod.constant = 3  # type: ignore[attr-defined]
    sys.modules["fake_workloads"] = mod
    yield mod
    del sys.modules["fake_workloads"]


def _cfg(**model: object) -> JobConfig:
    return JobConfig.from_dict({"model": model})


def test_default_is_the_builtin_gpt() -> None:
    w = load_workload(_cfg())
    assert isinstance(w, GPTWorkload) and w.num_layers == 4


def test_factory_with_args() -> None:
    w = load_workload(
        _cfg(
            source="module",
            factory="examples.mlp_classifier:mlp_classifier",
            args={"depth": 3, "hidden": 8},
        )  # fmt: skip
    )
    assert isinstance(w, MLPClassifier) and w.num_layers == 5 and w.hidden == 8


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"source": "keras"}, "model.source must be one of gpt, module, hf, torchvision, timm"),
        ({"source": "module"}, "needs model.factory as 'package.module:function'"),
        ({"source": "module", "factory": "no_colon"}, "'package.module:function'"),
        ({"factory": "a.b:c"}, "needs model.source: module"),
        ({"source": "module", "factory": "a:b", "args": [1]}, "must be a mapping"),
    ],
)
def test_config_errors(model: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _cfg(**model)


@pytest.mark.parametrize(
    ("factory", "args", "message"),
    [
        ("no_such_module_xyz:f", {}, "cannot import 'no_such_module_xyz'"),
        ("fake_workloads:missing", {}, "has no 'missing'"),
        ("fake_workloads:constant", {}, "is not callable"),
        ("fake_workloads:not_a_workload", {}, "returned object, not a Workload"),
        ("fake_workloads:broken", {}, "failed: ZeroDivisionError: division by zero"),
        ("examples.mlp_classifier:mlp_classifier", {"colour": 1}, "failed: TypeError"),
    ],
)
def test_factory_errors(fake_module: object, factory: str, args: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_workload(_cfg(source="module", factory=factory, args=args))


def test_more_stages_than_layers() -> None:
    cfg = JobConfig.from_dict(
        {"model": {"source": "module", "factory": "examples.mlp_classifier:mlp_classifier",
                   "args": {"depth": 1}},
         "pp": 4, "elastic": {"nproc_per_node": 4}}
    )  # fmt: skip
    with pytest.raises(ConfigError, match="pp=4 stages but the workload has only 3 layers"):
        load_workload(cfg)


def test_the_example_workload_builds_a_micro_batch_and_a_loss() -> None:
    w = load_workload(
        _cfg(source="module", factory="examples.mlp_classifier:mlp_classifier", args={})
    )
    data = w.dataset(7)
    inputs, targets = w.collate([data[i] for i in (0, 5, 9)])
    assert inputs.shape == (3, 16) and targets.shape == (3,)
    assert int(targets.max()) < 4
    assert all(torch.equal(data[5][0], w.dataset(7)[5][0]) for _ in range(2))  # by (seed, id)
    h = inputs
    layers = [w.build_layer(i, 7) for i in range(w.num_layers)]
    for i, layer in enumerate(layers):
        h = layer(h)
        assert (tuple(h.shape), h.dtype) == (w.boundary(i, 3).shape, w.boundary(i, 3).dtype)
    total, count = w.loss(h, targets)
    assert count == 3 and total.ndim == 0
