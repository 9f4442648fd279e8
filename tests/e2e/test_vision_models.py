"""torchvision and timm models by name (``model.source: torchvision | timm``), random init, on
the digits as 3 × 32 × 32 images (examples/own_model.py's data set), by real workers.

Each is traced and cut at its top-level children; a rank SIGKILLed mid-step is respawned, and in
the deterministic mode (float64 reduction) every loss and the final parameters and optimizer
state are the fault-free run's, bit for bit: torchvision's resnet18 replicated and as a
two-stage pipeline (its auto cut), timm's ViT and ConvNeXt replicated.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import F64, Run, assert_clean_run, paced, run_config

STEPS = 8

MODELS: dict[str, dict[str, Any]] = {
    "resnet18": {"source": "torchvision", "name": "resnet18", "args": {"num_classes": 10}},
    "vit": {"source": "timm", "name": "vit_tiny_patch16_224",
            "args": {"img_size": 32, "patch_size": 8, "num_classes": 10}},
    "convnext": {"source": "timm", "name": "convnext_atto", "args": {"num_classes": 10}},
}  # fmt: skip


def _config(tmp: Path, model: dict[str, Any]) -> Path:
    doc = {
        "model": model,
        "data": {"source": "dataset", "factory": "examples.own_model:digit_images",
                 "args": {"channels": 3, "size": 32}},
        "train": {"steps": STEPS, "global_batch": 16, "micro_batch_size": 4, "lr": 0.001},
        "elastic": {"nproc_per_node": 3, "nnodes": "1:1", "max_restarts": 1},
    }  # fmt: skip
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    """The fault-free run of each model (float64 mode), made when a test first asks."""
    made: dict[str, Run] = {}

    class Lazy(dict):  # type: ignore[type-arg]
        def __missing__(self, name: str) -> Run:
            base = tmp_path_factory.mktemp(f"ref-{name}")
            env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}
            made[name] = run_config(_config(base, MODELS[name]), base / "run", env,
                                 "--job-id", f"ref-{name}", "--max-restarts", "0")  # fmt: skip
            return made[name]

    return Lazy()


@pytest.mark.parametrize(
    ("name", "strategy"),
    [("resnet18", []), ("resnet18", ["--pp", "2", "--dp", "2", "--nproc-per-node", "4"]),
     ("vit", []), ("convnext", [])],
    ids=["resnet18", "resnet18-pp2", "vit", "convnext"],
)  # fmt: skip
def test_a_model_by_name_survives_a_kill_bit_identical(
    tmp_path: Path, state_env: dict, references: dict[str, Run], name: str, strategy: list[str]
) -> None:
    reference = references[name]
    env = paced({**state_env, **F64}, 0.05)
    run = run_config(_config(tmp_path, MODELS[name]), tmp_path / "run", env, "--job-id", name,
                  *strategy, "--fault", "kill,rank=1,at_step=3")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in reference.of("final_state")}, key
