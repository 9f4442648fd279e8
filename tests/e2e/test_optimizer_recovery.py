"""Any element-wise torch.optim optimizer and any lr_scheduler, named in the config, on a user's
own module (examples/own_model.py), by real workers; Adafactor, which steps whole parameters,
replicated.

The optimizer's state tensors live in ElasWave's flat state slots, so they survive what
parameters survive: a rank SIGKILLed mid-step and respawned (its state from peers), and the
whole job stopped and relaunched (the state from the durable checkpoint). In the deterministic
mode (float64 reduction) every loss, the final parameters and the optimizer state are the
fault-free run's, bit for bit.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import F64, ROOT, assert_no_orphans, cli, paced, run_config

CONFIG = ROOT / "examples" / "own_model.yaml"
STEPS = 8
HALF = 4  # the first launch stops here; the relaunch resumes from its final checkpoint

CASES: dict[str, dict[str, Any]] = {
    "rmsprop-zero1": {"optimizer": "torch.optim.RMSprop",
                      "optimizer_args": {"alpha": 0.9, "momentum": 0.5}},
    "adam-onecycle-zero3": {
        "optimizer": "torch.optim.Adam", "optimizer_args": {"betas": [0.9, 0.99]},
        "lr_schedule": "torch.optim.lr_scheduler.OneCycleLR",
        "lr_schedule_args": {"max_lr": 0.01, "total_steps": STEPS},
    },
    "adagrad-replicated": {"optimizer": "torch.optim.Adagrad",
                           "optimizer_args": {"initial_accumulator_value": 0.1}},
}  # fmt: skip
STRATEGY = {"rmsprop-zero1": ["--zero", "1"], "adam-onecycle-zero3": ["--zero", "3"],
            "adagrad-replicated": []}  # fmt: skip


def _config(tmp: Path, train: dict[str, Any]) -> Path:
    doc = yaml.safe_load(CONFIG.read_text())
    doc["train"].update(train, eval_every=0, steps=STEPS)
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_optimizer_class_survives_a_kill_and_a_relaunch_bit_identical(
    tmp_path: Path, case: str
) -> None:
    config = _config(tmp_path, CASES[case])
    strategy = STRATEGY[case]
    ref_env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "ref-state"), **F64}
    reference = run_config(config, tmp_path / "ref", ref_env, "--job-id", "ref", *strategy)
    assert reference.losses[STEPS] < reference.losses[1], reference.losses

    env = paced({**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state"), **F64}, 0.03)
    args = ("--job-id", "opt", *strategy)
    first = run_config(config, tmp_path / "run", env, *args, "--steps", str(HALF),
                    "--fault", "kill,rank=1,at_step=3")  # fmt: skip
    assert [e["exit_code"] for e in first.of("worker_exit")] == [-9]
    run = run_config(config, tmp_path / "run", env, *args)  # resumes from step HALF's checkpoint
    (again,) = run.of("relaunched")
    assert again["resume_step"] == HALF and again["lost_steps"] == 0
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))  # each step once
    assert run.losses == reference.losses  # bit for bit, step by step
    finals = [f for f in run.of("final_state") if f["t"] > again["t"]]
    assert len(finals) == 3 and all(f["step"] == STEPS for f in finals)
    for key in ("params_sha256", "state_sha256"):  # every replica: the reference's state
        assert {f[key] for f in finals} == {f[key] for f in reference.of("final_state")}, key
    assert_no_orphans(run)


def test_adafactor_trains_replicated_through_a_kill_bit_identical(tmp_path: Path) -> None:
    """Adafactor steps whole parameters (not element-wise): replicated data parallelism takes
    it, its factored moments packed into the state slots, which the survivors carry through
    the kill (and hand to the respawned rank): the fault-free run's losses and state, bit for
    bit."""
    config = _config(tmp_path, {"optimizer": "torch.optim.Adafactor"})
    ref_env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "ref-state"), **F64}
    reference = run_config(config, tmp_path / "ref", ref_env, "--job-id", "ref")
    assert reference.losses[STEPS] < reference.losses[1], reference.losses
    env = paced({**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state"), **F64}, 0.03)
    run = run_config(config, tmp_path / "run", env, "--job-id", "adafactor",
                     "--fault", "kill,rank=1,at_step=3")  # fmt: skip
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]
    assert 2 in [p["world"] for p in run.of("plan_published")]  # went on without it
    assert run.losses == reference.losses
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in reference.of("final_state")
        }, key
    assert_no_orphans(run)


@pytest.mark.parametrize(
    ("train", "flags", "message"),
    [  # the launch's one line; tests/unit/test_optimizer_classes.py has the whole table
        ({"optimizer": "torch.optim.Adafactor"}, ["--zero", "1"], "ZeRO updates slices"),
        ({"lr_schedule": "torch.optim.lr_scheduler.StepLR"}, [], "missing 1 required positional"),
    ],
)  # fmt: skip
def test_an_optimizer_that_does_not_fit_is_one_line(
    tmp_path: Path, train: dict[str, Any], flags: list[str], message: str
) -> None:
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(tmp_path / "state")}
    config = _config(tmp_path, train)
    r = cli("launch", str(config), "--run-dir", str(tmp_path / "run"), *flags, env=env,
            timeout=120)  # fmt: skip
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
