"""Every GPU check and benchmark in one command, in under eight minutes on a one-GPU machine:

    python -m bench.gpucheck --out results/gpucheck

Stages, each with its own time limit (the limits add up to ``BUDGET_S``), each writing under
the results directory (``--out``, else ``bench/results/gpucheck``):

1. ``machine``: ``nvidia-smi`` and ``elaswave doctor --device cuda --skip-smoke --json``
   (torch, CUDA, NCCL's version and whether it can shrink a communicator) -> ``nvidia-smi.txt``,
   ``doctor.txt``;
2. ``tests``: ``pytest -m gpu`` on every test file that has tests marked ``gpu``: every
   communicator operation staged on CUDA tensors; the crash, hang and pipeline recoveries of
   four workers sharing the GPU over gloo (one per GPU on NCCL with two or more), each compared
   bit for bit with a fault-free GPU run; a world of one on NCCL respawned; the NCCL shrink
   with two GPUs -> ``gpu-tests.log``, ``gpu-tests.xml``. At its limit pytest is interrupted
   (what finished is still reported);
3. ``gpustep``: ``python -m bench gpustep`` (one worker's step time against a plain PyTorch
   loop on the same GPU) -> ``gpustep.json``, ``gpustep.log``;

then ``summary.json`` and a printed summary: each test's outcome and time, the step-time
ratio, each stage's time. Exit 0 when every test passed (skips allowed) and the benchmark ran.

Without a CUDA device it says so in one line and exits 1; ``--device cpu`` runs the plumbing
(the GPU tests collected and skipped, gpustep's CPU dry run of one round).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

REPO_ROOT = Path(__file__).resolve().parent.parent
LIMITS_S = {"machine": 40, "tests": 300, "gpustep": 120}  # each stage's limit
BUDGET_S = sum(LIMITS_S.values())  # 460 s: under eight minutes, with the summary
INTERRUPT_GRACE_S = 20  # pytest interrupted (SIGINT) writes its report; then it is killed


@dataclass
class Stage:
    name: str
    seconds: float
    returncode: int | None  # None: killed at its limit
    timed_out: bool


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpucheck",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=None,
        help="results directory (default bench/results/gpucheck)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="cpu: a dry run of the plumbing on a machine without a GPU",
    )  # fmt: skip
    args = parser.parse_args(argv)
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpucheck needs a CUDA device and this machine has none "
              "(--device cpu runs its plumbing)", file=sys.stderr)  # fmt: skip
        return 1
    out = args.out or REPO_ROOT / "bench" / "results" / "gpucheck"
    out.mkdir(parents=True, exist_ok=True)
    return run_all(out.resolve(), args.device)


def run_all(out: Path, device: str) -> int:
    began = time.monotonic()
    py = sys.executable
    stages = [_machine(out, device)]
    junit = out / "gpu-tests.xml"
    junit.unlink(missing_ok=True)
    pytest = [py, "-m", "pytest", "-m", "gpu", *gpu_test_files(), "-v", "-p", "no:cacheprovider",
              f"--junitxml={junit}", "--durations=0"]  # fmt: skip
    stages.append(_run("tests", pytest, out / "gpu-tests.log"))
    bench = out / "gpustep.json"
    bench.unlink(missing_ok=True)
    dry = ["--device", "cpu", "--repeat", "1"] if device == "cpu" else []
    stages.append(
        _run("gpustep", [py, "-m", "bench", "gpustep", "--json", str(bench), *dry],
             out / "gpustep.log")
    )  # fmt: skip
    result = summary(stages, junit, bench, device, time.monotonic() - began)
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(report_lines(result)), flush=True)
    print(f"results: {out}", flush=True)
    return 0 if result["ok"] else 1


def gpu_test_files(root: Path = REPO_ROOT) -> list[str]:
    """The test files with tests marked ``gpu`` (relative paths). Named one by one: the whole
    tree cannot be collected in one session (tests/unit and tests/e2e share module names)."""
    return sorted(
        str(p.relative_to(root))
        for p in (root / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text()
    )


def _machine(out: Path, device: str) -> Stage:
    """What the machine is: the GPU(s) and driver, and the doctor's versions and backends."""
    began = time.monotonic()
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=15)
        (out / "nvidia-smi.txt").write_text(smi.stdout + smi.stderr)
    except (OSError, subprocess.TimeoutExpired) as exc:
        (out / "nvidia-smi.txt").write_text(f"nvidia-smi: {exc}\n")
    doctor = [sys.executable, "-m", "elaswave", "doctor", "--device", device,
              "--skip-smoke", "--json"]  # fmt: skip
    stage = _run("machine", doctor, out / "doctor.txt", echo=False,
                 limit=LIMITS_S["machine"] - (time.monotonic() - began))  # fmt: skip
    return Stage("machine", time.monotonic() - began, stage.returncode, stage.timed_out)


def _run(
    name: str, cmd: list[str], log: Path, *, echo: bool = True, limit: float | None = None
) -> Stage:
    """Run ``cmd`` from the repository root, its output into ``log`` (and echoed), for at most
    the stage's limit: then SIGINT (pytest still writes its report), then SIGKILL to its
    process group."""
    limit = LIMITS_S[name] if limit is None else max(limit, 1.0)
    print(f"== {name}: {' '.join(cmd[1:])} (limit {limit:.0f} s)", flush=True)
    began = time.monotonic()
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True, preexec_fn=_interruptible,
        )  # fmt: skip
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, sink, echo), daemon=True)
        pump.start()
        timed_out = False
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            print(f"== {name}: over its {limit:.0f} s limit, interrupted", flush=True)
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        pump.join(5)
    code = None if timed_out else proc.returncode
    return Stage(name, time.monotonic() - began, code, timed_out)


def _interruptible() -> None:
    """In the child before it executes: SIGINT's default action back. A command started in the
    background by a non-interactive shell inherits SIGINT ignored, and a Python child would then
    install no KeyboardInterrupt handler: the interrupt that lets pytest write its report would
    do nothing, and the stage would only be killed."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pump(stream: TextIO, sink: TextIO, echo: bool) -> None:
    for line in stream:
        sink.write(line)
        sink.flush()
        if echo:
            sys.stdout.write(line)
            sys.stdout.flush()


def junit_cases(path: Path) -> list[dict[str, Any]]:
    """Each test case of a pytest JUnit report: name, outcome (passed, failed, error, skipped),
    seconds, and the message of a failure or skip (first line)."""
    if not path.exists():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (found.get("message") or found.text or "").strip().splitlines()
                message = message[0][:200] if message else ""
                break
        cases.append({
            "test": f"{case.get('classname', '')}::{case.get('name', '')}",
            "outcome": outcome,
            "seconds": round(float(case.get("time") or 0.0), 1),
            "message": message,
        })  # fmt: skip
    return cases


def summary(
    stages: list[Stage], junit: Path, bench: Path, device: str, seconds: float
) -> dict[str, Any]:
    """The run's result: the stages, the tests' outcomes, the benchmark's ratio, and ``ok``."""
    cases = junit_cases(junit)
    counts = {k: sum(c["outcome"] == k for c in cases)
              for k in ("passed", "failed", "error", "skipped")}  # fmt: skip
    step = None
    if bench.exists():
        b = json.loads(bench.read_text())
        step = {
            "device": b["device"],
            "ratio_vs_plain": b["ratio_vs_plain"],
            "elaswave_ms": b["summary"]["elaswave"]["step_s"]["median"] * 1000,
            "plain_ms": b["summary"]["plain"]["step_s"]["median"] * 1000,
            "max_abs_loss_diff": b["max_abs_loss_diff"],
        }
    by_name = {s.name: s for s in stages}
    tests_ok = (
        bool(cases) and counts["failed"] == counts["error"] == 0 and not by_name["tests"].timed_out
    )
    return {
        "device": device,
        "seconds": round(seconds, 1),
        "budget_s": BUDGET_S,
        "stages": [asdict(s) | {"seconds": round(s.seconds, 1)} for s in stages],
        "tests": {"counts": counts, "cases": cases},
        "gpustep": step,
        "ok": tests_ok and step is not None,
    }


def report_lines(result: dict[str, Any]) -> list[str]:
    """The printed summary of :func:`summary`'s result."""
    lines = [f"== summary ({result['device']}, {result['seconds']:.0f} s of "
             f"{result['budget_s']} s budgeted)"]  # fmt: skip
    for s in result["stages"]:
        how = "timed out" if s["timed_out"] else f"exit {s['returncode']}"
        lines.append(f"stage {s['name']:<8} {s['seconds']:6.1f} s  {how}")
    for c in result["tests"]["cases"]:
        why = f": {c['message']}" if c["message"] and c["outcome"] != "passed" else ""
        lines.append(f"{c['outcome'].upper():<7} {c['test']} ({c['seconds']:.1f} s){why}")
    counts = result["tests"]["counts"]
    lines.append("tests: " + ", ".join(f"{n} {k}" for k, n in counts.items()))
    step = result["gpustep"]
    if step is None:
        lines.append("gpustep: no result")
    else:
        lines.append(
            f"gpustep ({step['device']}): ElasWave {step['elaswave_ms']:.2f} ms/step, plain "
            f"loop {step['plain_ms']:.2f} ms/step, ratio {step['ratio_vs_plain']:.3f}; "
            f"max |loss difference| {step['max_abs_loss_diff']:.1e}"
        )
    lines.append("OK" if result["ok"] else "NOT OK")
    return lines


if __name__ == "__main__":
    sys.exit(main())
