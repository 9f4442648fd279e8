"""A user's own nn.Module and Dataset, no Workload written (examples/own_model.py: a small
residual network with BatchNorm and Dropout on scikit-learn's digits), trained by real workers.

ElasWave traces the module, cuts it into layers at its top-level children and trains them like
any workload: in the deterministic mode (float64 reduction) a run whose rank 1 is SIGKILLed
mid-step and respawned gives the fault-free run's losses, parameters and optimizer state bit
for bit under ZeRO-1 and ZeRO-3 (replicated and as a pipeline: torchvision's resnet18 in
test_vision_models.py), BatchNorm's running statistics included, and so does a checkpoint resumed
at another world size. The export is the class's own state_dict, and scores the held-out samples
as the run did.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import F64, ROOT, Run, assert_clean_run, cli, paced, run_config
from safetensors.torch import load_file

from examples.own_model import SmallResNet, digit_images

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
    _same_final_state(run, reference)


def _same_final_state(run: Run, reference: Run) -> None:
    """Parameters, optimizer state and BatchNorm's running statistics, bit for bit; every
    micro-batch of every step folded into the statistics once (8 per step)."""
    for key in ("params_sha256", "state_sha256", "buffers_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in reference.of("final_state")}, key
    assert {f["norm_batches"] for f in run.of("final_state")} == {STEPS * 8}


def test_a_checkpoint_resumed_at_another_world_size_keeps_the_buffers(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """Half the steps on 3 workers, the rest from its final checkpoint on 2: the fault-free
    run's losses and final state, running statistics included."""
    env = {**state_env, **F64, **FAST}
    first = run_config(CONFIG, tmp_path / "a", env, "--steps", str(STEPS // 2),
                       "--job-id", "own-a")  # fmt: skip
    assert first.losses == {s: reference.losses[s] for s in range(1, STEPS // 2 + 1)}
    run = _launch(tmp_path / "b", env, "--job-id", "own-b", "--nproc-per-node", "2",
                  "--resume", str(tmp_path / "a" / "checkpoints"))  # fmt: skip
    assert [p["world"] for p in run.of("plan_published")] == [2]
    assert run.losses == {s: reference.losses[s] for s in range(STEPS // 2 + 1, STEPS + 1)}
    _same_final_state(run, reference)


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
    # The class in eval mode scores the held-out samples as the run's last evaluation did:
    # its running statistics are the run's.
    data, final = digit_images(channels=1, size=8), reference.evals[-1]
    ids = range(len(data) - final["eval_samples"], len(data))
    model.eval()
    loss, hits = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(ids), 4):
            x, y = (torch.stack(t) for t in zip(*(data[i] for i in ids[a : a + 4]), strict=True))
            out = model(x)
            loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
            hits += int((out.argmax(1) == y).sum())
    assert hits / len(ids) == final["eval_accuracy"]
    assert loss / len(ids) == pytest.approx(final["eval_loss"], rel=1e-6)


def test_a_corruption_rolled_back_takes_the_statistics_back_too(
    tmp_path: Path, state_env: dict, reference: Run
) -> None:
    """A bit flipped in rank 2's parameters after step 7 skews the statistics of its
    micro-batches in steps 8-10; the check at step 10 rolls every rank back to step 5, running
    statistics included, and the redone steps end on the fault-free state."""
    env = {**state_env, **F64, **FAST}
    run = _launch(tmp_path / "run", env, "--job-id", "own-sdc", "--verify-every", "5",
                  "--fault", "corrupt,rank=2,at_step=7")  # fmt: skip
    rolled = run.of("sdc_rolled_back")
    assert [(e["step"], e["to_step"]) for e in rolled] == [(10, 5)]
    assert run.losses == reference.losses
    _same_final_state(run, reference)
