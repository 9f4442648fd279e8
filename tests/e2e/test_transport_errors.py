"""A survivor never dies because a peer died, however it learns of the death.

The victim dies before its step's first forward, and its daemon reports the death 2 s late
(``detect_delay``, a slow detector): until the new plan arrives the survivors meet the dead peer
in the transport alone — a send posted to a closed connection raises at once, a receive or a
collective fails its wait. Every one of those errors must latch (the step is dropped and redone
under the next plan: data parallelism and ZeRO-1 compute only the victim's micro-batches again, a
dp × pp pipeline with ZeRO inside its stages the whole step); in the deterministic mode the run
ends bit-identical to the fault-free one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import F64, Float64Runs, Run, assert_clean_run, assert_redid_only, launch

pytestmark = pytest.mark.e2e

STEPS = 10
FAULT = "kill,rank=1,at_step=5,phase=forward,detect_delay=2"


@pytest.fixture(scope="module")
def float64_reference(float64_runs: Float64Runs) -> Run:
    return float64_runs(STEPS)


@pytest.mark.parametrize(
    "flags",
    [(), ("--zero", "1"), ("--pp", "2", "--zero", "1")],
    ids=["data-parallel", "zero", "pipeline-zero"],
)
def test_survivors_latch_transport_errors_from_a_dead_peer(
    tmp_path: Path, state_env: dict, float64_reference: Run, flags: tuple
) -> None:
    r = launch(tmp_path / "run", "--job-id", "latch", "--steps", str(STEPS), *flags,
               "--fault", FAULT, env={**state_env, **F64})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, float64_reference)
    assert run.losses == float64_reference.losses  # bit for bit
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in float64_reference.of("final_state")
        }
    (fault,) = run.of("fault_injected")
    exits = run.of("worker_exit")
    assert [e["worker"] for e in exits] == [fault["worker"]], "only the victim may exit"
    if "--pp" not in flags:  # it computed nothing of step 5: its whole share, and only it
        assert_redid_only(run, 2, {fault["worker"]})
    # The survivors met the dead peer in the transport before any plan told them.
    failed = [e for e in run.of("step_aborted") if "interrupted" not in e["reason"]]
    assert failed, run.of("step_aborted")
    assert all(e["step"] == 5 for e in failed)
    published = [p["t"] for p in run.of("plan_published") if p["epoch"] > 1]
    assert published and min(e["t"] for e in failed) < published[0]
