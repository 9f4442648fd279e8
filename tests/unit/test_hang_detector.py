"""The daemon's hang detector: what it learns from its workers' heartbeats."""

from __future__ import annotations

from pathlib import Path

from elaswave import wire
from elaswave.daemon.hangs import HangDetector
from elaswave.daemon.workers import WorkerProc
from elaswave.planning.hanglimits import MIN_PHASES, WARMUP_S


def test_the_detector_learns_phase_times_from_heartbeats(tmp_path: Path) -> None:
    """Heartbeats show phases as they go: a compute phase ends when the next beat shows another
    phase or a younger one; the detector's bounds follow what its workers showed, and an
    evaluation is learned apart from compute phases."""
    w = WorkerProc(worker_id="h.w0", slot=0, incarnation=0, proc=None,  # type: ignore[arg-type]
                   log_path=tmp_path / "w.log")  # fmt: skip
    det = HangDetector(setting="auto", heartbeat=0.2, host_id="h", emit=lambda *a, **k: None)
    assert "0 of 20" in det.limits.compute_how
    beats = [("compute", 10.0), ("compute", 30.0), ("collective", 0.1)] * MIN_PHASES
    beats += [("eval", 50.0), ("idle", 0.0), ("compute", 5.0), ("compute", 0.1)]
    for n, (phase, age) in enumerate(beats):
        w.heard(wire.Heartbeat(step=n, phase=phase, phase_age=age), at=float(n))
    det.learn([w])
    assert w.ended == []  # taken
    assert list(det.compute) == [30.0] * MIN_PHASES + [5.0]
    assert list(det.evals) == [50.0]
    assert det.limits.compute_s == 120.0 and det.limits.eval_s == WARMUP_S
    assert det.limits.compute_how == f"auto: 4 × p99 of {MIN_PHASES + 1} compute phases"
    fixed = HangDetector(setting=1.5, heartbeat=0.2, host_id="h", emit=lambda *a, **k: None)
    fixed.learn([w])
    assert (fixed.limits.silence_s, fixed.limits.compute_s) == (1.5, 1.5)
