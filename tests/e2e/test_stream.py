"""The job's event stream (``--tensorboard DIR``, ``logging.wandb``) through a real crash: the test
model, 4 gloo workers, real etcd, a real SIGKILL; read back with TensorBoard's own readers and
from the W&B offline run's file, and compared with ``metrics.jsonl``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import F64, Run, launch

from elaswave.report import build_report
from tests.streamread import accumulate, data_server_scalars, scalars, texts, wandb_history

pytestmark = pytest.mark.e2e

JOB = "stream-kill"
KILL_STEP = 15


@pytest.fixture(scope="module")
def kill_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with both streams on and rank 1 SIGKILLed in step 15."""
    base = tmp_path_factory.mktemp(JOB)
    env = dict(
        os.environ,
        ELASWAVE_STATE_DIR=str(base / "state"),
        ELASWAVE_LOGGING__WANDB="{project: elaswave-e2e, mode: offline}",
    )
    r = launch(
        base / "run", "--job-id", JOB, "--tensorboard", str(base / "tb"),
        "--fault", f"kill,rank=1,at_step={KILL_STEP}", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    assert "logging." not in r.stderr, r.stderr[-3000:]  # no stream stopped
    return base


def test_tensorboard_has_every_committed_step_once_through_a_kill(kill_run: Path) -> None:
    run = Run(kill_run / "run")
    committed = {m["step"]: m for m in run.metrics}
    assert sorted(committed) == list(range(1, 41)) and len(run.metrics) == 40
    events = kill_run / "tb" / JOB
    assert len(list(events.iterdir())) == 1  # one host, one writer: one file

    acc = accumulate(events)
    for tag, key in (
        ("train/loss", "loss"), ("train/grad_norm", "grad_norm"), ("train/learning_rate", "lr"),
        ("train/world_size", "world_size"), ("train/epoch", "epoch"),
    ):  # fmt: skip
        points = scalars(acc, tag)
        assert [s for s, _ in points] == list(range(1, 41)), tag  # each committed step, once
        assert all(v == pytest.approx(committed[s][key], rel=1e-6) for s, v in points), tag
    assert [v for _, v in scalars(acc, "train/world_size")] == [4] * 14 + [3] * 26
    assert all(m["grad_norm"] > 0 for m in run.metrics)  # measured for the stream

    (inc,) = [i for i in build_report(run.dir)["incidents"] if i["kind"] == "kill"]
    assert inc["first_commit_step"] == KILL_STEP
    assert scalars(acc, "incidents/mttr_s") == [(KILL_STEP, pytest.approx(inc["mttr_s"]))]
    assert scalars(acc, "incidents/world_size") == [(KILL_STEP, 3.0)]
    ((step, text),) = texts(acc, "incidents")
    assert step == KILL_STEP
    assert "(rank 1) killed by SIGKILL → epoch 2: dp 4→3" in text and "from the fault" in text

    try:
        fast = data_server_scalars(kill_run / "tb", ["train/loss", "incidents/mttr_s"])
    except Exception as exc:  # noqa: BLE001 - no data server binary on this platform
        pytest.skip(f"TensorBoard's data server: {exc}")
    assert fast[JOB]["train/loss"] == scalars(acc, "train/loss")
    assert fast[JOB]["incidents/mttr_s"] == scalars(acc, "incidents/mttr_s")


def test_wandb_offline_run_has_every_step_once(kill_run: Path) -> None:
    run = Run(kill_run / "run")
    (offline,) = (kill_run / "run" / "wandb").glob("offline-run-*")
    assert f"-{JOB}-" in offline.name  # one run per job: its id is the job's and its start
    rows = wandb_history(kill_run / "run")
    assert [r["_step"] for r in rows] == list(range(1, 41))
    assert [r["train/loss"] for r in rows] == [m["loss"] for m in run.metrics]
    assert [r["train/grad_norm"] for r in rows] == [m["grad_norm"] for m in run.metrics]
    marked = [r["_step"] for r in rows if "incidents" in r]
    assert marked == [KILL_STEP] and "killed by SIGKILL" in rows[KILL_STEP - 1]["incidents"]


def test_pipelines_report_the_same_gradient_norm(
    kill_run: Path, tmp_path: Path, state_env: dict[str, str]
) -> None:
    """dp = 2 × pp = 2 with a stream: the stages complete the global norm with one collective,
    and rank 0 reports the norm data parallelism reports for the same steps."""
    r = launch(
        tmp_path / "run", "--job-id", "stream-pp", "--pp", "2", "--dp", "2", "--steps", "10",
        "--tensorboard", str(tmp_path / "tb"), env=state_env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    pp = {m["step"]: m for m in Run(tmp_path / "run").metrics}
    dp = {m["step"]: m for m in Run(kill_run / "run").metrics}
    assert sorted(pp) == list(range(1, 11))
    for step in pp:
        assert pp[step]["grad_norm"] == pytest.approx(dp[step]["grad_norm"], rel=1e-4), step
    points = scalars(accumulate(tmp_path / "tb" / "stream-pp"), "train/grad_norm")
    assert [s for s, _ in points] == list(range(1, 11))
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["logging"]["tensorboard"] == str(tmp_path / "tb")


def test_a_rollback_leaves_each_step_once_with_its_redone_value(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    """Silent corruption after step 7, found by the check at step 10: every rank rolls back to
    step 5 and redoes 6-10. Both of TensorBoard's readers show each step once, with the value
    of the redone step (the one metrics.jsonl keeps), not the first, corrupt one."""
    r = launch(
        tmp_path / "run", "--job-id", "stream-sdc", "--steps", "14", "--verify-every", "5",
        "--fault", "corrupt,rank=2,at_step=7", "--tensorboard", str(tmp_path / "tb"),
        env={**state_env, **F64},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert [(e["to_step"], e["redone_steps"]) for e in run.of("sdc_rolled_back")][:1] == [(5, 5)]
    committed = {m["step"]: m["loss"] for m in run.metrics}
    assert sorted(committed) == list(range(1, 15)) and len(run.metrics) == 14
    events = tmp_path / "tb" / "stream-sdc"
    assert len(list(events.iterdir())) == 2  # the rollback goes on in a file of its own
    acc = accumulate(events)
    loss = scalars(acc, "train/loss")
    assert loss == [(s, pytest.approx(committed[s], rel=1e-6)) for s in range(1, 15)]
    ((step, text),) = texts(acc, "incidents")  # marked where the redone steps start
    assert step == 6 and "after step 10; rolled back to the known-good step 5" in text
    try:
        fast = data_server_scalars(tmp_path / "tb", ["train/loss"])
    except Exception as exc:  # noqa: BLE001 - no data server binary on this platform
        pytest.skip(f"TensorBoard's data server: {exc}")
    assert fast["stream-sdc"]["train/loss"] == loss
