"""The daemon's hang detector: what it learns from heartbeats, and a hung worker's stacks taken
as it kills it (real processes, real signals, no torch).

The child registers its stacks file as a worker does (``procutil.stacks_on_signal``), then
freezes itself with SIGSTOP (the ``hang`` fault) or sleeps (stuck computing). The daemon's side
(``daemon/stacks.py``) must come back with the frame the child was stuck in, kill it with
SIGKILL, and never take longer than its bound, whatever the child does."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elaswave import wire
from elaswave.daemon.hangs import HangDetector
from elaswave.daemon.stacks import STACKS_WAIT_S, discard_unused, keep, kill_with_stacks
from elaswave.daemon.workers import WorkerProc
from elaswave.planning.hanglimits import MIN_PHASES, WARMUP_S

ROOT = Path(__file__).resolve().parents[2]
AT = time.mktime((2025, 3, 4, 5, 6, 7, 0, 0, -1))  # when the worker was found hung
STAMP = "20250304-050607"

CHILD = """
import faulthandler, os, signal, sys, threading, time
from elaswave.procutil import stacks_on_signal

mode, path = sys.argv[1], sys.argv[2]
if mode == "stuck-in-c":  # a main thread that never gets back to Python to end itself
    signal.signal(signal.SIGUSR2, lambda *_: None)
    faulthandler.register(signal.SIGUSR2, file=open(path, "w"), all_threads=True, chain=True)
elif mode == "deaf":  # takes no notice of the signal at all
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    open(path, "w").close()
else:
    stacks_on_signal(path)

def beating():
    while True:
        time.sleep(0.05)

def frozen_in_its_step():
    print("ready", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    print("ran on after the stop", flush=True)
    time.sleep(60)

def computing_for_ever():
    print("ready", flush=True)
    time.sleep(60)

threading.Thread(target=beating, name="heartbeat", daemon=True).start()
computing_for_ever() if mode == "sleep" else frozen_in_its_step()
"""


async def _start(tmp_path: Path, mode: str) -> WorkerProc:
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    stacks = logs / "h.w1.stacks"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CHILD, mode, str(stacks), cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ready"
    w = WorkerProc(worker_id="h.w1", slot=1, incarnation=0, proc=proc,
                   log_path=logs / "h.w1.log", stacks_path=stacks)  # fmt: skip
    if mode == "sleep":
        await asyncio.sleep(0.1)  # from its "ready" into its sleep
    else:  # stopped: state T in /proc
        deadline = time.monotonic() + 10
        while Path(f"/proc/{proc.pid}/stat").read_text().split(")")[1].split()[0] != "T":
            assert time.monotonic() < deadline, "the child never stopped"
            await asyncio.sleep(0.01)
    return w


async def _kill(w: WorkerProc) -> tuple[float, int, str]:
    started = time.monotonic()
    await kill_with_stacks(w)
    seconds = time.monotonic() - started
    code = await asyncio.wait_for(w.proc.wait(), 5)
    assert w.proc.stdout is not None
    output = (await w.proc.stdout.read()).decode()
    return seconds, code, output


@pytest.mark.parametrize(
    ("mode", "frame"),
    [("stop", "frozen_in_its_step"), ("sleep", "computing_for_ever"),
     ("stuck-in-c", "frozen_in_its_step")],
)  # fmt: skip
def test_the_stacks_hold_the_stuck_frame_and_the_kill_is_a_sigkill_within_the_bound(
    tmp_path: Path, mode: str, frame: str
) -> None:
    """Frozen (SIGSTOP), stuck in a sleep, or with a main thread that never gets back to Python:
    the stacks name the function it was stuck in (its main thread writes them first as it
    continues), every thread is there, and it is killed by SIGKILL within the bound."""

    async def main() -> tuple[float, int, str, tuple[str, str] | None]:
        w = await _start(tmp_path, mode)
        seconds, code, output = await _kill(w)
        return seconds, code, output, keep(w, tmp_path, AT)

    seconds, code, output, kept = asyncio.run(main())
    assert code == -signal.SIGKILL
    assert seconds < STACKS_WAIT_S, seconds  # it died, or its file stopped growing: no wait
    if mode == "stop":  # it ends itself as its main thread is back in Python: at once
        assert "ran on" not in output
    assert kept is not None
    path, stacks = kept
    assert path == f"stacks/h.w1-{STAMP}.txt"  # when it was found hung
    assert (tmp_path / path).read_text() == stacks
    assert not (tmp_path / "logs" / "h.w1.stacks").exists()
    main_thread = stacks.split("Current thread")[1]
    assert f"in {frame}" in main_thread, stacks
    assert "in beating" in stacks  # every thread's stack


def test_a_worker_deaf_to_the_signal_is_killed_at_the_bound_without_stacks(
    tmp_path: Path,
) -> None:
    async def main() -> tuple[float, int, tuple[str, str] | None]:
        w = await _start(tmp_path, "deaf")
        seconds, code, _ = await _kill(w)
        kept = keep(w, tmp_path, AT)
        discard_unused(w)  # what the pool does once it sees the exit
        return seconds, code, kept

    seconds, code, kept = asyncio.run(main())
    assert code == -signal.SIGKILL
    assert STACKS_WAIT_S <= seconds < STACKS_WAIT_S + 0.5
    assert kept is None
    assert not (tmp_path / "stacks").exists() and not (tmp_path / "logs" / "h.w1.stacks").exists()


def test_stacks_found_at_the_same_second_keep_the_first(tmp_path: Path) -> None:
    """A relaunch in the same run directory: worker ids start over."""
    (tmp_path / "stacks").mkdir()
    (tmp_path / "stacks" / f"h.w1-{STAMP}.txt").write_text("the first run's")

    async def main() -> tuple[str, str] | None:
        w = await _start(tmp_path, "stop")
        await _kill(w)
        return keep(w, tmp_path, AT)

    kept = asyncio.run(main())
    assert kept is not None and kept[0] == f"stacks/h.w1-{STAMP}-2.txt"
    assert (tmp_path / "stacks" / f"h.w1-{STAMP}.txt").read_text() == "the first run's"


def test_the_detector_learns_phase_times_from_heartbeats(tmp_path: Path) -> None:
    """Heartbeats show phases as they go: a compute phase ends when the next beat shows another
    phase or a younger one; the detector's bounds follow what its workers showed, and an
    evaluation is learned apart from compute phases."""
    w = WorkerProc(worker_id="h.w0", slot=0, incarnation=0, proc=None,  # type: ignore[arg-type]
                   log_path=tmp_path / "w.log")  # fmt: skip
    det = HangDetector(setting="auto", heartbeat=0.2, run_dir=tmp_path, host_id="h",
                       emit=lambda *a, **k: None)  # fmt: skip
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
    fixed = HangDetector(setting=1.5, heartbeat=0.2, run_dir=tmp_path, host_id="h",
                         emit=lambda *a, **k: None)  # fmt: skip
    fixed.learn([w])
    assert (fixed.limits.silence_s, fixed.limits.compute_s) == (1.5, 1.5)


def test_the_bounds_are_shared_when_they_change_or_the_lease_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``hang/<host>`` for ``status``: written at once, again when a bound moves or the host
    holds a new lease (the key went with the old one), not while nothing changed."""
    from elaswave.daemon import hangs

    monkeypatch.setattr(hangs, "SHARE_S", 0.0)
    written: list[tuple[float, object]] = []

    class Store:
        async def share_hang_bounds(self, host: str, bounds: Any, *, lease: object) -> None:
            written.append((bounds.compute_s, lease))

    det = HangDetector(setting="auto", heartbeat=0.2, run_dir=Path("."), host_id="h",
                       emit=lambda *a, **k: None)  # fmt: skip
    leases = ["lease 1"]

    async def main() -> None:
        task = asyncio.create_task(det.share(Store(), lease=lambda: leases[-1]))  # type: ignore[arg-type]
        for change in (None, "bound", None, "lease", None):
            if change == "bound":
                det.compute.extend([30.0] * MIN_PHASES)
                det.limits = det._limits()
            elif change == "lease":
                leases.append("lease 2")
            for _ in range(5):
                await asyncio.sleep(0)
        task.cancel()

    asyncio.run(main())
    assert written == [(WARMUP_S, "lease 1"), (120.0, "lease 1"), (120.0, "lease 2")]


BUSY = "print('ready', flush=True); sum(range(10**13))"  # one C call: the GIL is never let go
FROZEN = "import os, signal; print('ready', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"


@pytest.mark.parametrize(("code", "frozen"), [(BUSY, False), (FROZEN, True)])
def test_cpu_time_tells_a_busy_silent_worker_from_a_frozen_one(
    tmp_path: Path, code: str, frozen: bool
) -> None:
    """Both are silent; only the frozen one uses no CPU time: looked at every half heartbeat
    for 1.5 s, it has been still since its last beat, and the busy one never for long."""

    async def main() -> float:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE
        )
        assert proc.stdout is not None
        assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"ready"
        w = WorkerProc(worker_id="h.w1", slot=1, incarnation=0, proc=proc,
                       log_path=tmp_path / "h.w1.log")  # fmt: skip
        w.last_beat = time.monotonic()
        try:
            still = None
            while time.monotonic() - w.last_beat < 1.5:
                await asyncio.sleep(0.1)
                still = w.still(time.monotonic())
            assert still is not None
            return still
        finally:
            proc.kill()
            await proc.wait()

    still = asyncio.run(main())
    if frozen:
        assert still >= 1.4, still
    else:
        assert still < 0.7, still
