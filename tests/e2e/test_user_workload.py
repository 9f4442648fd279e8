"""A user's workload, written only against the public seam (examples/mlp_classifier.py: an MLP
classifier with ``nn.Dropout`` in its layers), selected from a config, trained by real workers.

In the deterministic mode (float64 reduction) data parallelism, ZeRO-1 and dp × pp give the same
bits, so one fault-free data-parallel run is the reference for every strategy, each run with a
worker SIGKILLed mid-run: every loss, the final parameters and the optimizer state must be
bit-identical to it. The dropout masks survive the kill, the re-share and the re-cut because the
runtime keys them by (seed, step, micro-batch, layer) around each layer call.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, Run, assert_clean_run, assert_no_orphans, cli, elaswave_cmd

CONFIG = ROOT / "examples" / "mlp.yaml"
STEPS = 20


def _launch(run_dir: Path, env: dict[str, str], *args: str) -> Run:
    cmd = elaswave_cmd("launch", str(CONFIG), "--run-dir", str(run_dir), "--quiet",
                       "--steps", str(STEPS), *args)  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    return Run(run_dir)


@pytest.fixture(scope="module")
def mlp_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    base = tmp_path_factory.mktemp("mlp-ref")
    env = {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"),
           "ELASWAVE_TRAIN__REDUCE_DTYPE": "float64"}  # fmt: skip
    run = _launch(base / "run", env, "--job-id", "mlp-ref")
    losses = run.losses
    assert losses[STEPS] < 0.7 * losses[1], losses  # it learns
    return run


@pytest.mark.parametrize(
    "strategy",
    [[], ["--zero", "1"], ["--pp", "2", "--dp", "2"]],
    ids=["replicated", "zero1", "dp2xpp2"],
)
def test_user_workload_survives_a_kill_bit_identical(
    tmp_path: Path, state_env: dict, mlp_reference: Run, strategy: list[str]
) -> None:
    env = {**state_env, "ELASWAVE_TRAIN__REDUCE_DTYPE": "float64"}
    run = _launch(tmp_path / "run", env, "--job-id", "mlp-kill", *strategy,
                  "--fault", "kill,rank=1,at_step=8")  # fmt: skip
    assert len(run.of("fault_injected")) == 1
    assert [e["exit_code"] for e in run.of("worker_exit")] == [-9]  # the kill, and no other
    assert_clean_run(run, STEPS, mlp_reference)
    assert run.losses == mlp_reference.losses  # bit for bit, step by step
    for key in ("params_sha256", "state_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in mlp_reference.of("final_state")}


def test_a_factory_that_cannot_build_is_one_line(tmp_path: Path, state_env: dict) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.read_text().replace("hidden: 64", "hidden: 64, colour: red"))
    r = cli("launch", str(bad), "--run-dir", str(tmp_path / "run"), env=state_env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.factory" in lines[0] and "colour" in lines[0], r.stderr
    run = Run(tmp_path / "run")  # checked in the worker template, before any worker starts
    assert not run.of("worker_spawned")
    assert_no_orphans(run)
