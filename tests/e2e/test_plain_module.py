"""A user's own nn.Module and Dataset, no Workload written (examples/own_model.py: a small
residual network with BatchNorm and Dropout on scikit-learn's digits), trained by real workers.

ElasWave traces the module, cuts it into layers at its top-level children and trains them like
any workload: in the deterministic mode (float64 reduction) a run whose rank 1 is SIGKILLed
mid-step and respawned gives the fault-free run's losses, parameters and optimizer state bit
for bit under ZeRO-1 and ZeRO-3 (replicated and as a pipeline: torchvision's resnet18 in
test_vision_models.py). The export is the class's own state_dict.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import F64, ROOT, Run, assert_clean_run, cli, paced, run_config
from safetensors.torch import load_file

from examples.own_model import SmallResNet

CONFIG = ROOT / "examples" / "own_model.yaml"
STEPS = 16
FAST = {"ELASWAVE_TRAIN__EVAL_EVERY": "0"}  # no held-out scoring: these tests train


def _launch(run_dir: Path, env: dict[str, str], *args: str) -> Run:
    return run_config(CONFIG, run_dir, env, "--steps", str(STEPS), *args)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("own-ref")
    # Held-out scoring leaves training alone: the runs with faults, which skip it, match this.
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64,
           "ELASWAVE_TRAIN__EVAL_EVERY": "8"}  # fmt: skip
    run = _launch(base / "run", env, "--job-id", "own-ref", "--max-restarts", "0")
    assert run.losses[STEPS] < 0.8 * run.losses[1], run.losses  # it learns
    assert [e["step"] for e in run.evals] == [8, 16]
    assert all(e["eval_samples"] == 297 and 0.1 < e["eval_accuracy"] <= 1 for e in run.evals)
    (plan,) = run.of("plan_published")
    assert plan["world"] == 3
    return run


@pytest.mark.parametrize(  # replicated and dp × pp: tests/e2e/test_vision_models.py (resnet18)
    "strategy", [["--zero", "1"], ["--zero", "3"]], ids=["zero1", "zero3"]
)
def test_own_module_survives_a_kill_and_a_respawn_bit_identical(
    tmp_path: Path, state_env: dict, reference: Run, strategy: list[str]
) -> None:
    env = paced({**state_env, **F64, **FAST}, 0.03)  # the respawn joins before the end
    run = _launch(tmp_path / "run", env, "--job-id", "own-kill", *strategy,
                  "--fault", "kill,rank=1,at_step=5")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]  # the kill, and no other
    assert len(run.of("worker_spawned")) == len(run.of("plan_published")[0]["workers"]) + 1
    worlds = [p["world"] for p in run.of("plan_published")]
    assert worlds[0] - 1 in worlds and worlds[-1] == worlds[0], worlds  # shrank, grew back
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in reference.of("final_state")}, key


def test_the_export_is_the_classs_own_state_dict(tmp_path: Path, reference: Run) -> None:
    out = tmp_path / "model.safetensors"
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state")}
    r = cli("export", "--run-dir", str(reference.dir), "--out", str(out), env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    state = load_file(str(out))
    model = SmallResNet()
    model.load_state_dict(state, strict=True)  # buffers included
    assert state["stem.1.num_batches_tracked"].item() > 0  # BatchNorm's statistics are there
    # The trained weights: what the run's last checkpoint holds for the first convolution.
    from elaswave.runtime.durable.checkpoints import latest, load

    path = latest(reference.dir / "checkpoints")
    assert path is not None
    flat = load(path, sum(p.numel() for p in model.parameters())).params
    first = model.stem[0].weight
    assert torch.equal(flat[: first.numel()].view_as(first), first)
