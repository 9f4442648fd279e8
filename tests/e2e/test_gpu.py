"""The accelerator path on real GPUs: NCCL carries the collectives, a fault aborts the old
epoch's communicators together (or shrinks them in place where NCCL can), and recovery keeps
every property the CPU runs keep. Skipped without CUDA (``pytest -m gpu`` selects them); each
needs at least two GPUs (NCCL refuses two ranks on one device), the pipeline test four.

Every comparison is with a fault-free run on the same GPUs in the deterministic mode (float64
reduction): GPUs compute each micro-batch identically on whichever device runs it, so a fault
must not change a single loss or parameter bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import F64, Run, assert_clean_run, assert_redid_only, launch

from elaswave.report import build_report

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORKERS = min(GPUS, 4)
STEPS = 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices (NCCL: one rank per device)"),
    pytest.mark.timeout(900),  # CUDA start-up in every worker, and a reference run
]


def _cuda(*args: str) -> tuple[str, ...]:
    return ("--device", "cuda", "--nproc-per-node", str(WORKERS), "--steps", str(STEPS), *args)


def _env(base: Path) -> dict[str, str]:
    return {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}


def _shrinks() -> bool:
    """Whether this torch and NCCL can shrink a communicator in place (the runtime decides the
    same at run time, per group)."""
    nccl = getattr(torch.distributed, "ProcessGroupNCCL", None)
    version = torch.cuda.nccl.version() if GPUS else (0, 0, 0)
    return nccl is not None and hasattr(nccl, "shrink") and tuple(version) >= (2, 27, 0)


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The fault-free run on the GPUs, float64 reduction."""
    base = tmp_path_factory.mktemp("gpu-ref")
    r = launch(base / "run", "--job-id", "gpu-ref", *_cuda(), env=_env(base), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(base / "run")
    assert {e["backend"] for e in run.of("comm_rebuilt")} == {"nccl"}
    return run


def test_crash_recovers_in_place_on_nccl(tmp_path: Path, gpu_reference: Run) -> None:
    """A worker SIGKILLed mid-run: the survivors abort (or shrink) their NCCL groups, redo only
    the in-flight step, and end bit-identical to the fault-free run."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-kill", *_cuda("--fault", "kill,rank=1,at_step=8"),
        env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses  # bit for bit
    (fault,) = run.of("fault_injected")
    assert_redid_only(run, 2, {fault["worker"]})
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert len(after) == WORKERS - 1 and all(e["backend"] == "nccl" for e in after)
    if _shrinks():  # the training group lost one member: shrunk in place, not rebuilt
        assert all("dp" in e["shrunk"] and "dp" not in e["rebuilt"] for e in after), after
    else:
        assert all("dp" in e["rebuilt"] and e["shrunk"] == [] for e in after), after


def test_hang_is_aborted_by_the_daemon(tmp_path: Path, gpu_reference: Run) -> None:
    """SIGSTOP one worker: its peers' NCCL collectives spin on the device until the daemon's
    hang check kills it; then their communicators are aborted and training goes on."""
    timeout = 3.0
    r = launch(
        tmp_path / "run", "--job-id", "gpu-hang", "--hang-timeout", str(timeout),
        *_cuda("--fault", "hang,rank=1,at_step=6"), env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "hang" and inc["mttr_s"] <= timeout + 2.0, inc
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert after and all(e["abort_seconds"] < 5.0 for e in after), after


@pytest.mark.skipif(GPUS < 4, reason="dp=2 × pp=2 needs four CUDA devices")
def test_pipeline_stage_loss_on_nccl(tmp_path: Path, gpu_reference: Run) -> None:
    """dp=2 × pp=2 on four GPUs: a stage dies, its layers migrate to the survivor over NCCL
    point-to-point, and the run stays bit-identical to data parallelism on the same GPUs."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-pp", *_cuda("--pp", "2", "--migration", "blocking",
        "--fault", "kill,rank=1,at_step=5"), env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert synced and all(e["migration"] == "blocking" for e in synced)
    assert any(e["bytes_received"] > 0 for e in synced)
