"""Training from a nanoGPT-style token file, configured through the environment."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import Run, launch

from elaswave.runtime.workload.data import write_token_file

pytestmark = pytest.mark.e2e


def test_token_file_job_survives_a_crash(tmp_path: Path, state_env: dict[str, str]) -> None:
    rng = np.random.default_rng(0)
    tokens = np.tile(rng.integers(0, 256, size=97), 200)  # a repeating text: learnable
    write_token_file(tmp_path / "train.bin", tokens, dtype="uint16")
    env = dict(
        state_env,
        ELASWAVE_DATA__SOURCE="tokens",
        ELASWAVE_DATA__PATH=str(tmp_path / "train.bin"),
        ELASWAVE_ELASTIC__NPROC_PER_NODE="3",
    )
    r = launch(tmp_path / "run", "--job-id", "tokens", "--steps", "12",
               "--fault", "kill,rank=2,at_step=6", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, 13))
    assert [m["world_size"] for m in run.metrics][-1] == 2
    assert run.losses[12] < run.losses[1]
    assert len({f["params_sha256"] for f in run.of("final_state")}) == 1
