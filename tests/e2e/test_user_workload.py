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
from pathlib import Path

import pytest
from conftest import ROOT, Run, assert_clean_run, assert_no_orphans, cli, paced, run_config

CONFIG = ROOT / "examples" / "mlp.yaml"
STEPS = 20


def _launch(run_dir: Path, env: dict[str, str], *args: str) -> Run:
    return run_config(CONFIG, run_dir, env, "--steps", str(STEPS), *args)


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


def test_user_workload_under_zero3_survives_a_kill_a_respawn_and_a_hang(
    tmp_path: Path, state_env: dict, mlp_reference: Run
) -> None:
    """ZeRO-3 on three workers (parameters sharded, every layer of the user's model gathered
    while it runs): a SIGKILL (the worker is respawned and joins), then, once it has joined, a
    hang the daemon kills after 1.5 s: 3 → 2 → 3 → 2 ranks, and still the reference's bits
    (float64 mode). Emulated device time (≥ 0.2 s a step) leaves the respawn time to join."""
    env = paced({**state_env, "ELASWAVE_TRAIN__REDUCE_DTYPE": "float64"}, 0.04)
    run = _launch(tmp_path / "run", env, "--job-id", "mlp-z3", "--zero", "3",
                  "--nproc-per-node", "3", "--max-restarts", "1", "--hang-timeout", "1.5",
                  "--fault", "kill,rank=1,at_step=5",
                  "--fault", "hang,rank=2,at_step=12,epoch=3")  # fmt: skip
    assert [p["world"] for p in run.of("plan_published")] == [3, 2, 3, 2]
    grown = [e for e in run.of("state_synced") if e["epoch"] == 3]
    assert len(grown) == 3, "the respawned worker joined before the hang"
    assert len(run.of("hang_detected")) == 1
    assert_clean_run(run, STEPS, mlp_reference)
    assert run.losses == mlp_reference.losses
    for key in ("params_sha256", "state_sha256"):
        mine = {f[key] for f in run.of("final_state")}
        assert mine == {f[key] for f in mlp_reference.of("final_state")}


def test_user_workload_under_zero3_in_float32_stays_on_its_own_fault_free_curve(
    tmp_path: Path, state_env: dict
) -> None:
    """float32 (no deterministic mode): a kill moves each loss by at most 1e-6 (relative) from
    ZeRO-3's own fault-free run."""
    clean = _launch(tmp_path / "clean", state_env, "--job-id", "mlp-z3-32", "--zero", "3")
    killed = _launch(tmp_path / "kill", state_env, "--job-id", "mlp-z3-32k", "--zero", "3",
                     "--fault", "kill,rank=1,at_step=8")  # fmt: skip
    assert_clean_run(killed, STEPS, clean)


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
