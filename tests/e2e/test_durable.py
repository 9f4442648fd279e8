"""Durable checkpoints: the fallback when both in-memory copies die, and resume on another size."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import REL_TOL, Run, assert_clean_run, elaswave_cmd, launch

from elaswave.report import build_report
from elaswave.runtime.durable.checkpoints import PIECES

pytestmark = pytest.mark.e2e


def _fallback_run(
    tmp_path: Path, env: dict[str, str], reference: Run, *flags: str
) -> tuple[Run, dict]:
    """A ZeRO run with a durable checkpoint every 5 steps whose shard is lost at step 12: it must
    complete on the fault-free curve from the step-10 checkpoint, recomputing one step."""
    r = launch(tmp_path / "run", "--zero", "1", "--durable-every", "5", *flags, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    (restored,) = run.of("durable_restored")
    assert restored["step"] == 10 and restored["recomputed_steps"] == 1
    return run, restored


def test_rank_and_buddy_lost_together_fall_back_to_the_durable_checkpoint(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    run, restored = _fallback_run(
        tmp_path, state_env, reference, "--job-id", "fallback",
        "--fault", "kill,rank=1,at_step=12", "--fault", "kill,rank=2,at_step=12",
    )  # fmt: skip
    assert "replica are gone" in restored["reason"]
    incidents = build_report(run.dir)["incidents"]
    assert sum(i["recomputed_steps"] for i in incidents) == 1
    assert any("restored checkpoint step 10" in i["reason"] for i in incidents)


def test_resume_from_a_durable_checkpoint_on_three_workers(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    first = launch(tmp_path / "a", "--job-id", "resume-a", "--zero", "1", "--steps", "20",
                   "--durable-every", "10", env=state_env)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    second = launch(tmp_path / "b", "--job-id", "resume-b", "--zero", "1", "--steps", "40",
                    "--nproc-per-node", "3", "--resume", str(tmp_path / "a" / "checkpoints"),
                    env=state_env)  # fmt: skip
    assert second.returncode == 0, second.stderr[-2000:]
    run = Run(tmp_path / "b")
    assert [m["step"] for m in run.metrics] == list(range(21, 41))
    assert {m["world_size"] for m in run.metrics} == {3}
    for step, loss in run.losses.items():
        ref = reference.losses[step]
        assert abs(loss - ref) <= REL_TOL * abs(ref), f"step {step}: {loss} vs {ref}"
    assert len({f["params_sha256"] for f in run.of("final_state")}) == 1


def test_resume_without_a_checkpoint_is_a_one_line_error(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    r = launch(tmp_path / "run", "--job-id", "noresume", "--resume", str(tmp_path), env=state_env)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "no complete durable checkpoint" in lines[0]


def test_without_snapshots_a_lost_shard_comes_from_the_durable_checkpoint(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    _, restored = _fallback_run(
        tmp_path, state_env, reference, "--job-id", "nosnap", "--snapshot-every", "0",
        "--fault", "kill,rank=1,at_step=12",
    )  # fmt: skip
    assert "missing" in restored["reason"]


def test_pipeline_loses_both_holders_of_a_stage_and_falls_back(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """dp=2 × pp=2: the last stage of both replicas dies at once, so layers 2–3 have no holder
    left. The job continues on the two first-stage ranks (each replica now one stage with every
    layer) from the step-10 checkpoint, assembled from the stages when it was written."""
    r = launch(
        tmp_path / "run", "--job-id", "pp-fallback", "--pp", "2", "--durable-every", "5",
        "--fault", "kill,rank=1,at_step=12", "--fault", "kill,rank=3,at_step=12", env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, 40, reference)
    (restored,) = run.of("durable_restored")
    assert restored["step"] == 10 and restored["recomputed_steps"] == 1
    assert "held by no surviving rank" in restored["reason"]
    plans = [e for e in run.of("plan_published") if "bounds" in e]
    assert plans[-1]["bounds"] == [[0, 4], [0, 4]]
    assert all(f["holders_agree"] for f in run.of("final_state"))


@pytest.mark.parametrize("zero", ["1", "3"])
def test_resume_a_data_parallel_checkpoint_into_zero_pipelines(
    tmp_path: Path, state_env: dict[str, str], reference: Run, zero: str
) -> None:
    """A checkpoint holds whole tensors: a data-parallel run's step-20 checkpoint resumes as
    dp=3 × pp=2 with ZeRO-1 or ZeRO-3 inside the stages, on the fault-free curve."""
    first = launch(tmp_path / "a", "--job-id", "pp-resume-a", "--steps", "20",
                   "--durable-every", "10", env=state_env)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    second = launch(
        tmp_path / "b", "--job-id", "pp-resume-b", "--steps", "26", "--nproc-per-node", "6",
        "--pp", "2", "--zero", zero, "--resume", str(tmp_path / "a" / "checkpoints"),
        env=state_env,
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-2000:]
    run = _resumed_on_the_curve(tmp_path / "b", reference, 21, 26)
    assert all(f["holders_agree"] for f in run.of("final_state"))


def _resumed_on_the_curve(run_dir: Path, reference: Run, first: int, last: int) -> Run:
    """A resumed run trained steps ``first..last`` once each, every loss on the fault-free
    curve, and its ranks ended with one model."""
    run = Run(run_dir)
    assert [m["step"] for m in run.metrics] == list(range(first, last + 1))
    for step, loss in run.losses.items():
        ref = reference.losses[step]
        assert abs(loss - ref) <= REL_TOL * abs(ref), f"step {step}: {loss} vs {ref}"
    assert len({f["params_sha256"] for f in run.of("final_state")}) == 1
    return run


@pytest.fixture(scope="module")
def stage_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A dp=2 × pp=2 run of 20 steps with a durable checkpoint every 10: written per stage."""
    base = tmp_path_factory.mktemp("stage-ckpt")
    env = dict(os.environ, ELASWAVE_STATE_DIR=str(base / "state"))
    r = launch(base / "run", "--job-id", "pp-ckpt", "--pp", "2", "--steps", "20",
               "--durable-every", "10", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = Run(base / "run")
    saved = [e for e in run.of("durable_saved") if e["step"] == 20]
    assert len(saved) == 1 and saved[0]["parts"] == 4
    return base / "run" / "checkpoints"


def test_each_stage_writes_only_the_layers_it_owns(stage_checkpoints: Path) -> None:
    """No rank assembles the model: the step-20 checkpoint is the parts of replica 0's two
    stages (the first holder of every layer), which tile the model, and nothing else."""
    path = stage_checkpoints / "step-00000020"
    index = json.loads((path / PIECES).read_text())
    assert {rank for _, _, rank in index["pieces"]} == {0, 1}
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == ["rank-00000", "rank-00001"]
    assert not (path / ".metadata").exists(), "a whole-state file was written too"
    edges = [(a, b) for a, b, _ in index["pieces"]]
    assert edges[0][0] == 0 and all(x[1] == y[0] for x, y in zip(edges, edges[1:], strict=False))
    sizes = {rank: sum(b - a for a, b, r in index["pieces"] if r == rank) for rank in (0, 1)}
    assert min(sizes.values()) > 0.25 * index["numel"], sizes  # each a real share, not all


@pytest.mark.parametrize(("layout", "args"), [("dp3-pp1", ()), ("dp1-pp3", ("--pp", "3"))])
def test_a_per_stage_checkpoint_resumes_on_another_layout(
    tmp_path: Path, state_env: dict[str, str], reference: Run, stage_checkpoints: Path,
    layout: str, args: tuple[str, ...],
) -> None:  # fmt: skip
    """The dp=2 × pp=2 checkpoint of step 20 resumes on three workers as plain data parallelism
    and as one replica of three stages, on the fault-free curve."""
    r = launch(tmp_path / "run", "--job-id", f"ckpt-{layout}", "--steps", "24",
               "--nproc-per-node", "3", *args, "--resume", str(stage_checkpoints),
               env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    _resumed_on_the_curve(tmp_path / "run", reference, 21, 24)


def test_a_zero3_stage_checkpoint_resumes_as_zero3_data_parallelism(
    tmp_path: Path, state_env: dict[str, str], reference: Run
) -> None:
    """dp=3 × pp=2 with ZeRO-3 inside the stages: no rank holds a layer whole between steps,
    so the step-10 checkpoint is written from the parts (each by its first keeper, parameters
    and moments) and tiles the model; ``elaswave export`` writes the run's final weights from
    it, and it resumes on three workers as ZeRO-3 data parallelism, on the fault-free curve."""
    from safetensors.torch import load_file

    from elaswave.export import run_config
    from elaswave.runtime.workload.base import build_layers
    from elaswave.runtime.workload.load import load_workload

    r = launch(tmp_path / "run", "--job-id", "pp-zero3-ckpt", "--pp", "2", "--zero", "3",
               "--nproc-per-node", "6", "--steps", "10", "--durable-every", "10",
               env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = _resumed_on_the_curve(tmp_path / "run", reference, 1, 10)
    assert all(f["holders_agree"] for f in run.of("final_state"))
    index = json.loads((tmp_path / "run" / "checkpoints" / "step-00000010" / PIECES).read_text())
    edges = sorted((a, b) for a, b, _ in index["pieces"])
    assert edges[0][0] == 0 and edges[-1][1] == index["numel"]
    assert all(x[1] == y[0] for x, y in zip(edges, edges[1:], strict=False))  # a tiling
    assert len({rank for _, _, rank in index["pieces"]}) > 2  # parts of several keepers
    out = tmp_path / "model.safetensors"
    export = elaswave_cmd("export", "--run-dir", str(tmp_path / "run"), "--out", str(out))
    r = subprocess.run(export, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "exported step 10" in r.stdout, r.stderr[-2000:]
    tensors = load_file(str(out))
    model = build_layers(load_workload(run_config(tmp_path / "run")), 1234)
    names = [n for n, p in model.named_parameters() if p.requires_grad]  # the flat order
    params = b"".join(tensors[n].reshape(-1).numpy().tobytes() for n in names)
    (final,) = {f["params_sha256"] for f in run.of("final_state")}
    assert hashlib.sha256(params).hexdigest() == final, "the exported weights are the final ones"
    r = launch(tmp_path / "resumed", "--job-id", "pp-zero3-resumed", "--steps", "14",
               "--nproc-per-node", "3", "--zero", "3",
               "--resume", str(tmp_path / "run" / "checkpoints"), env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    _resumed_on_the_curve(tmp_path / "resumed", reference, 11, 14)


@pytest.mark.parametrize("zero", ["0", "1"])
def test_a_checkpoint_taken_while_layers_migrate_is_written_per_stage(
    tmp_path: Path, state_env: dict[str, str], reference: Run, zero: str
) -> None:
    """dp=2 × pp=2 (replicated stage state, and ZeRO inside the stages): a stage dies at step 6
    and its layers migrate in the background over a link so slow that the run ends first. The
    checkpoints of steps 8 and 10 are taken mid-migration, each rank writing what it holds until
    the switch (nothing assembled on one rank); the last one resumes on three workers as data
    parallelism, on the fault-free curve."""
    env = {**state_env, "ELASWAVE_TRAIN__STATE_BANDWIDTH": "0.01"}  # MB/s: minutes for a layer
    r = launch(tmp_path / "run", "--job-id", "pp-mid-migration", "--pp", "2", "--zero", zero,
               "--steps", "10", "--migration", "async", "--durable-every", "2",
               "--fault", "kill,rank=1,at_step=6", env=env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    run = _resumed_on_the_curve(tmp_path / "run", reference, 1, 10)
    assert [e["migration"] for e in run.of("state_synced") if e["epoch"] == 2] == ["async"] * 3
    assert not run.of("migration_done")  # still migrating when the run ended
    saved = {e["step"]: e for e in run.of("durable_saved")}
    assert saved[8]["parts"] == 3 and saved[10]["parts"] == 3, saved
    index = json.loads((tmp_path / "run" / "checkpoints" / "step-00000010" / PIECES).read_text())
    edges = sorted((a, b) for a, b, _ in index["pieces"])
    assert edges[0][0] == 0 and edges[-1][1] == index["numel"]
    assert all(x[1] == y[0] for x, y in zip(edges, edges[1:], strict=False))  # a tiling
    r = launch(tmp_path / "resumed", "--job-id", "pp-mid-migration-resumed", "--steps", "14",
               "--nproc-per-node", "3", "--resume", str(tmp_path / "run" / "checkpoints"),
               env=state_env)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    _resumed_on_the_curve(tmp_path / "resumed", reference, 11, 14)
