"""The GPU benchmark and the one GPU command, on a machine without a GPU: what each says when
there is none (one line, non-zero), how their results are summed up, and how a stage over its
time limit is interrupted. The end-to-end dry run is ``tests/e2e/test_gpucheck_dry.py``."""

from __future__ import annotations

import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import gpucheck, gpustep
from bench.common import BenchError

NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")


@pytest.mark.parametrize(
    ("device", "cuda", "message"),
    [
        ("cuda", True, None),
        ("cpu", False, None),  # the dry run
        ("cpu", True, None),
        ("cuda", False, "gpustep needs a CUDA device and this machine has none (--device cpu "
                        "runs its plumbing on the CPU)"),
        ("npu", True, "gpustep runs on cuda or cpu, not 'npu'"),
    ],
)  # fmt: skip
def test_gpustep_runs_where_it_can(device: str, cuda: bool, message: str | None) -> None:
    if message is None:
        gpustep.require(device, cuda)
        return
    with pytest.raises(BenchError) as err:
        gpustep.require(device, cuda)
    assert str(err.value) == message


@NO_CUDA
def test_gpustep_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.__main__ import main

    assert main(["gpustep"]) == 1
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and "gpustep needs a CUDA device" in lines[0], lines


@NO_CUDA
def test_gpucheck_without_cuda_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpucheck.main([]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "needs a CUDA device" in out.err


def _measured(step: float, inner: float, loss: list[float]) -> dict[str, Any]:
    return {"step_median_s": step, "in_step_median_s": inner, "loss": loss}


def test_gpustep_summary_is_the_median_ratio_and_the_loss_gap() -> None:
    e, p = "elaswave", "plain"
    rounds = [
        {e: _measured(0.012, 0.011, [2.0, 1.5]), p: _measured(0.010, 0.010, [2.0, 1.5])},
        {e: _measured(0.011, 0.010, [2.0, 1.5]), p: _measured(0.011, 0.011, [2.0, 1.5 + 2e-7])},
        {e: _measured(0.013, 0.012, [2.0, 1.5]), p: _measured(0.010, 0.010, [2.0, 1.5])},
    ]
    r = gpustep.summary(rounds, device="cuda", steps=30, warmup=5, config=Path("c.yaml"),
                        args=["--device", "cuda"])  # fmt: skip
    assert r["summary"]["elaswave"]["step_s"]["median"] == 0.012
    assert r["summary"]["plain"]["step_s"]["median"] == 0.010
    assert r["ratio_vs_plain"] == pytest.approx(1.2)
    assert r["ratio_vs_plain_paired"]["median"] == pytest.approx(1.2)
    assert r["ratio_vs_plain_paired"]["min"] == pytest.approx(1.0)
    assert r["max_abs_loss_diff"] == pytest.approx(2e-7)
    assert not r["dry_run"] and r["repeat"] == 3


JUNIT = textwrap.dedent(
    """\
    <?xml version="1.0" encoding="utf-8"?>
    <testsuites><testsuite name="pytest" errors="0" failures="1" skipped="1" tests="3">
    <testcase classname="tests.e2e.test_gpu" name="test_crash" time="31.25"/>
    <testcase classname="tests.e2e.test_gpu" name="test_hang" time="12.0">
      <failure message="AssertionError: step 7: losses differ&#10;more">trace</failure>
    </testcase>
    <testcase classname="tests.e2e.test_gpu" name="test_shrink" time="0.0">
      <skipped type="pytest.skip" message="shrinking an NCCL group needs two CUDA devices"/>
    </testcase>
    </testsuite></testsuites>
    """
)


def _stages(timed_out: bool = False) -> list[gpucheck.Stage]:
    return [
        gpucheck.Stage("machine", 3.0, 0, False),
        gpucheck.Stage("tests", 120.0, None if timed_out else 0, timed_out),
        gpucheck.Stage("gpustep", 80.0, 0, False),
    ]


def test_gpucheck_reports_each_test_and_fails_on_a_failure(tmp_path: Path) -> None:
    junit = tmp_path / "gpu-tests.xml"
    junit.write_text(JUNIT)
    r = gpucheck.summary(_stages(), junit, tmp_path / "absent.json", "cuda", 203.0)
    assert r["tests"]["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert [(c["outcome"], c["seconds"]) for c in r["tests"]["cases"]] == [
        ("passed", 31.2), ("failed", 12.0), ("skipped", 0.0)
    ]  # fmt: skip
    assert r["tests"]["cases"][1]["message"] == "AssertionError: step 7: losses differ"
    assert not r["ok"] and r["gpustep"] is None
    lines = gpucheck.report_lines(r)
    assert "FAILED  tests.e2e.test_gpu::test_hang (12.0 s): AssertionError: step 7: losses " \
           "differ" in lines  # fmt: skip
    assert lines[-2:] == ["gpustep: no result", "NOT OK"]


def test_gpucheck_is_ok_when_every_test_passed_and_the_benchmark_ran(tmp_path: Path) -> None:
    junit = tmp_path / "gpu-tests.xml"
    failure = '<failure message="AssertionError: step 7: losses differ&#10;more">trace</failure>'
    junit.write_text(JUNIT.replace('failures="1"', 'failures="0"').replace(failure, ""))
    bench = tmp_path / "gpustep.json"
    result = {"device": "cuda", "ratio_vs_plain": 1.05, "max_abs_loss_diff": 1e-7,
              "summary": {"elaswave": {"step_s": {"median": 0.0105}},
                          "plain": {"step_s": {"median": 0.010}}}}  # fmt: skip
    bench.write_text(__import__("json").dumps(result))
    r = gpucheck.summary(_stages(), junit, bench, "cuda", 203.0)
    assert r["ok"] and r["gpustep"]["elaswave_ms"] == pytest.approx(10.5)
    assert gpucheck.report_lines(r)[-1] == "OK"
    assert not gpucheck.summary(_stages(timed_out=True), junit, bench, "cuda", 480.0)["ok"]
    assert not gpucheck.summary(_stages(), tmp_path / "none.xml", bench, "cuda", 9.0)["ok"]


def test_a_stage_over_its_limit_is_interrupted_then_killed(tmp_path: Path) -> None:
    """SIGINT first (pytest writes its report on it); a stage that ignores it is killed."""
    stubborn = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"
    # The polite child starts with SIGINT blocked (a mask is inherited through fork and exec)
    # and unblocks it inside its try: a SIGINT sent before it got there waits for it, however
    # long a loaded machine takes to start an interpreter; it then has the grace to say bye.
    # Ignored here (a test run started in the background by a shell), it is polite all the
    # same: the stage runs with SIGINT's default action back.
    polite = (
        "import signal, time\ntry:\n    signal.pthread_sigmask(signal.SIG_UNBLOCK, "
        "{signal.SIGINT})\n    time.sleep(60)\nexcept KeyboardInterrupt:\n    print('bye')"
    )
    saved = gpucheck.INTERRUPT_GRACE_S
    try:
        gpucheck.INTERRUPT_GRACE_S = 60  # the child leaves as soon as it has said bye
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            s = gpucheck._run("x", [sys.executable, "-c", polite], tmp_path / "a.log", limit=1)
        finally:
            signal.signal(signal.SIGINT, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        assert s.timed_out and s.returncode is None and s.seconds < 60
        assert (tmp_path / "a.log").read_text().strip() == "bye"
        gpucheck.INTERRUPT_GRACE_S = 1
        s = gpucheck._run("x", [sys.executable, "-c", stubborn], tmp_path / "b.log", limit=1.5)
        assert s.timed_out and s.seconds < 10
        s = gpucheck._run(
            "x", [sys.executable, "-c", "print('done')"], tmp_path / "c.log", limit=30
        )
        assert not s.timed_out and s.returncode == 0
    finally:
        gpucheck.INTERRUPT_GRACE_S = saved


def test_gpucheck_runs_every_file_with_gpu_tests() -> None:
    files = gpucheck.gpu_test_files()
    assert "tests/e2e/test_gpu.py" in files and "tests/unit/test_comm_staging.py" in files
    assert "tests/unit/test_device.py" not in files
