"""Non-finite steps (``train.nonfinite``): a step whose loss turns NaN on one rank is applied on
no rank, named in the report, and the run goes on exactly as a fault-free run that skips the
same step's samples (``train.skip_steps``), pipelines too; too many in a row stop the job with
one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from elaswave.report import build_report
from tests.e2e.conftest import F64, Float64Runs, Run, assert_no_orphans, launch

STEPS = 12
NAN_STEP = 6


@pytest.mark.parametrize(
    ("mode", "extra"),
    [
        ("replicated", ()),
        # a kill after the skipped step: recovery from the peers' copies agrees on the step the
        # skip committed (its snapshot and replicas moved on like any step's)
        ("zero1", ("--zero", "1", "--fault", "kill,rank=1,at_step=9")),
        ("zero3", ("--zero", "3", "--fault", "kill,rank=1,at_step=9")),
        # a kill after it re-cuts the pipeline
        ("pipeline", ("--pp", "2", "--fault", "kill,rank=1,at_step=9")),
    ],
    ids=["replicated", "zero1", "zero3", "pipeline"],
)
def test_a_nan_step_is_applied_on_no_rank_bit_identical_to_skipping_it(
    tmp_path: Path, state_env: dict[str, str], float64_runs: Float64Runs, mode: str,
    extra: tuple[str, ...],
) -> None:  # fmt: skip
    reference = float64_runs(STEPS, {"ELASWAVE_TRAIN__SKIP_STEPS": f"[{NAN_STEP}]"})
    r = launch(
        tmp_path / "run", "--job-id", f"nan-{mode}", "--steps", str(STEPS),
        "--fault", f"nan,rank=2,at_step={NAN_STEP}", *extra, env={**state_env, **F64},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    skipped = {m["step"]: m["skipped"] for m in run.metrics if m["skipped"]}
    assert skipped == {NAN_STEP: "nonfinite"}
    assert [m["step"] for m in reference.metrics if m["skipped"]] == [NAN_STEP]
    losses, ref = run.losses, reference.losses
    assert losses[NAN_STEP] != losses[NAN_STEP]  # NaN: what the step would have applied
    assert {s: v for s, v in losses.items() if s != NAN_STEP} == {
        s: v for s, v in ref.items() if s != NAN_STEP
    }
    finals = run.of("final_state")
    assert {f["params_sha256"] for f in finals} == {
        f["params_sha256"] for f in reference.of("final_state")
    }, "the parameters differ from the run that skipped the same samples"
    assert len({f["state_sha256"] for f in finals}) == 1
    (local,) = run.of("nonfinite_local")  # only the poisoned rank names its samples
    assert local["rank"] == 2 and local["step"] == NAN_STEP and local["samples"]
    report = build_report(run.dir)
    (inc,) = [i for i in report["incidents"] if i["kind"] == "nonfinite"]
    assert inc["fault_step"] == NAN_STEP and inc["first_commit_step"] == NAN_STEP + 1
    assert f"micro-batches {local['microbatches']}" in inc["reason"]
    assert_no_orphans(run)


@pytest.mark.parametrize(
    ("name", "args", "stopped_at", "why"),
    [
        (
            "six-in-a-row",
            [a for s in range(3, 9) for a in ("--fault", f"nan,rank=0,at_step={s}")],
            8,
            "6 non-finite steps in a row (train.nonfinite_limit: 5)",
        ),
    ],
    ids=["six-in-a-row"],
)  # fmt: skip
def test_non_finite_steps_that_cannot_be_skipped_stop_the_job_with_one_line(
    tmp_path: Path, state_env: dict[str, str], name: str, args: list[str], stopped_at: int,
    why: str,
) -> None:  # fmt: skip
    r = launch(tmp_path / "run", "--job-id", f"nan-stop-{name}", "--steps", str(STEPS), *args,
               env=state_env)  # fmt: skip
    assert r.returncode != 0
    line = f"step {stopped_at} is not finite and the job stops: {why}"
    assert line in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert max(m["step"] for m in run.metrics) == stopped_at - 1, "the stopping step is recorded"
    assert run.of("worker_spawned") and not run.of("final_state")
    assert len(run.of("worker_spawned")) == 4, "a worker was respawned into the same data"
    assert_no_orphans(run)
