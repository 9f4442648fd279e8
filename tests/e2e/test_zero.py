"""ZeRO-1: a crash takes a unique optimizer shard with it; it comes back from its buddy."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import Run, assert_clean_run, launch

pytestmark = pytest.mark.e2e


def _synced(run: Run, epoch: int) -> list[dict]:
    return [e for e in run.of("state_synced") if e["epoch"] == epoch]


@pytest.mark.parametrize("phase", ["reduce", "optimizer"])
def test_zero_kill_restores_the_shard_from_its_buddy(
    tmp_path: Path, state_env: dict[str, str], reference: Run, phase: str
) -> None:
    r = launch(tmp_path / "run", "--job-id", f"zero-{phase}", "--zero", "1",
               "--fault", f"kill,rank=1,at_step=15,phase={phase}", env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)  # losses vs the replicated fault-free run, ≤1e-6
    (fault,) = run.of("fault_injected")
    assert fault["phase"] == phase
    synced = _synced(run, 2)
    assert {e["resume_step"] for e in synced} == {14}, "a step not committed by all is redone"
    assert all(e["transfers"] > 0 and e["bytes"] > 0 for e in synced)
    assert {e["pairs"] for e in synced} == {2}, "the lost shard moves only from its buddy"


def test_zero_deterministic_mode_matches_the_replicated_run_bit_for_bit(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """float64 reduction: ZeRO with a crash ends with the very parameters *and* optimizer
    state (gathered from the shards) of a replicated fault-free run."""
    env = dict(state_env, ELASWAVE_TRAIN__REDUCE_DTYPE="float64")
    plain = launch(tmp_path / "plain", "--job-id", "zdet-plain", "--steps", "20", env=env)
    zero = launch(tmp_path / "zero", "--job-id", "zdet-zero", "--steps", "20", "--zero", "1",
                  "--fault", "kill,rank=3,at_step=7,phase=optimizer", env=env)  # fmt: skip
    assert plain.returncode == 0 and zero.returncode == 0, zero.stderr[-2000:]
    a, b = Run(tmp_path / "plain"), Run(tmp_path / "zero")
    assert a.losses == b.losses
    assert {f["state_sha256"] for f in a.of("final_state")} == {
        f["state_sha256"] for f in b.of("final_state")
    }


def test_losing_a_rank_and_its_buddy_is_a_clear_failure(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Both copies of one shard gone: no durable checkpoint to fall back on yet, so the job
    stops with a one-line reason instead of training on a wrong state."""
    r = launch(tmp_path / "run", "--job-id", "zero-both", "--zero", "1",
               "--fault", "kill,rank=1,at_step=10", "--fault", "kill,rank=2,at_step=10",
               env=state_env)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot recover" in lines[0] and "replica" in lines[0], r.stderr
    run = Run(tmp_path / "run")
    assert run.of("shard_lost")
    assert max(m["step"] for m in run.metrics) < 10
