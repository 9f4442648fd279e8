"""The one GPU command's dry run on the CPU: ``python -m bench.gpucheck --device cpu`` runs every
stage a GPU machine runs (the doctor, the ``gpu`` tests, collected and skipped here, and the
step-time benchmark on the CPU) and writes the results a GPU run writes, so that
the command is known to work before a GPU is there to run it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real thing"),
    pytest.mark.timeout(520),  # the command's own budget (bench.gpucheck.BUDGET_S), and more
]


def test_the_gpu_command_runs_its_plumbing_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "bench.gpucheck", "--device", "cpu", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    result = json.loads((out / "summary.json").read_text())
    assert result["ok"] and result["seconds"] < result["budget_s"]
    assert [(s["name"], s["returncode"]) for s in result["stages"]] == [
        ("machine", 0), ("tests", 0), ("gpustep", 0)
    ]  # fmt: skip
    cases = result["tests"]["cases"]
    names = {c["test"].rsplit("::", 1)[1] for c in cases}
    assert {"test_crash_recovers_in_place_on_the_gpu", "test_hang_is_killed_by_the_daemon",
            "test_one_worker_on_nccl_is_respawned_and_resumes",
            "test_every_operation_on_cuda_tensors_through_host_memory"} <= names  # fmt: skip
    assert all(c["outcome"] == "skipped" and c["message"] for c in cases), cases
    step = json.loads((out / "gpustep.json").read_text())
    assert step["dry_run"] and step["device"] == "cpu" and step["ratio_vs_plain"] > 0
    assert step["max_abs_loss_diff"] < 1e-4  # both trained the same job
    assert json.loads((out / "doctor.txt").read_text())["checks"]
    assert "summary (cpu" in r.stdout and r.stdout.rstrip().endswith(f"results: {out}")
