"""torchvision and timm models by name (``model.source: torchvision | timm``), random init, on
the digits as 3 × 32 × 32 images (examples/own_model.py's data set), by real workers.

Each is traced and cut at its top-level children and loses rank 1 to a SIGKILL mid-step (it is
respawned). torchvision's resnet18, replicated and as a two-stage pipeline (its auto cut), ends
in the deterministic mode (float64 reduction) with every loss, the final parameters and the
optimizer state and BatchNorm's running statistics of the fault-free run, bit for bit (with
``--zero 1`` and ``--zero 3`` too); timm's ViT and ConvNeXt train through the
kill with every step committed once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import F64, Run, assert_clean_run, paced, run_config

STEPS = 6
HELD_OUT = 40  # the data set's last samples, scored once at the end by the reference

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
                 "args": {"channels": 3, "size": 32}, "eval_samples": HELD_OUT},
        "train": {"steps": STEPS, "global_batch": 12, "micro_batch_size": 2, "lr": 0.001},
        "elastic": {"nproc_per_node": 3, "nnodes": "1:1", "max_restarts": 1},
    }  # fmt: skip
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.fixture(scope="module")
def resnet_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("ref-resnet18")
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64,
           "ELASWAVE_TRAIN__EVAL_EVERY": str(STEPS)}  # fmt: skip
    return run_config(_config(base, MODELS["resnet18"]), base / "run", env,
                      "--job-id", "ref-resnet18", "--max-restarts", "0")  # fmt: skip


def _killed(tmp_path: Path, env: dict[str, str], name: str, *strategy: str) -> Run:
    run = run_config(_config(tmp_path, MODELS[name]), tmp_path / "run", env, "--job-id", name,
                     *strategy, "--fault", "kill,rank=1,at_step=3")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]
    return run


@pytest.mark.parametrize(
    "strategy",
    [[], ["--zero", "1"], ["--zero", "3"], ["--pp", "2", "--dp", "2", "--nproc-per-node", "4"]],
    ids=["dp", "zero1", "zero3", "pp2"],
)
def test_resnet18_survives_a_kill_bit_identical(
    tmp_path: Path, state_env: dict, resnet_reference: Run, strategy: list[str]
) -> None:
    run = _killed(tmp_path, paced({**state_env, **F64}, 0.05), "resnet18", *strategy)
    assert_clean_run(run, STEPS, resnet_reference)
    assert run.losses == resnet_reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256", "buffers_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in resnet_reference.of("final_state")}, key
    # every BatchNorm folded every micro-batch of every step in, once
    assert {f["norm_batches"] for f in run.of("final_state")} == {STEPS * 6}


@pytest.mark.parametrize("name", ["vit", "convnext"])
def test_a_timm_model_trains_through_a_kill(tmp_path: Path, state_env: dict, name: str) -> None:
    """Every step committed once, on replicas that agree bit for bit, nothing left running."""
    run = _killed(tmp_path, state_env, name, "--nproc-per-node", "2", "--max-restarts", "0")
    assert [p["world"] for p in run.of("plan_published")] == [2, 1]
    assert_clean_run(run, STEPS, run)  # its own losses: the properties, not a curve
    assert all(math.isfinite(loss) for loss in run.losses.values())


def test_the_resnet18_export_is_torchvisions_and_scores_as_the_run_did(
    tmp_path: Path, resnet_reference: Run
) -> None:
    """``torchvision.models.resnet18(num_classes=10)`` loads the export with ``strict=True``
    and, in eval mode (the run's BatchNorm statistics), gives the run's last evaluation."""
    import torch
    import torchvision
    from conftest import cli
    from safetensors.torch import load_file

    from examples.own_model import digit_images

    out = tmp_path / "resnet18.safetensors"
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state")}
    r = cli("export", "--run-dir", str(resnet_reference.dir), "--out", str(out), env=env,
            timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    model = torchvision.models.resnet18(num_classes=10)
    model.load_state_dict(load_file(str(out)), strict=True)
    assert int(model.bn1.num_batches_tracked) == STEPS * 6
    data, (final,) = digit_images(channels=3, size=32), resnet_reference.evals
    held_out = [data[i] for i in range(len(data) - HELD_OUT, len(data))]
    x, y = (torch.stack(t) for t in zip(*held_out, strict=True))
    model.eval()
    with torch.no_grad():
        out_ = torch.cat([model(x[a : a + 2]) for a in range(0, HELD_OUT, 2)])
    loss = float(torch.nn.functional.cross_entropy(out_.double(), y, reduction="sum"))
    assert float((out_.argmax(1) == y).double().mean()) == final["eval_accuracy"]
    assert loss / HELD_OUT == pytest.approx(final["eval_loss"], rel=1e-6)
