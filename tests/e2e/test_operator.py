"""What an operator sees of a live job: the launch's progress display on a terminal, a status
that refreshes in place, and the Prometheus metrics, all while a worker is killed and the job
recovers. Terminals are real pseudo-terminals; metrics are scraped over HTTP and parsed with the
client library's own text parser."""

from __future__ import annotations

import os
import pty
import re
import subprocess
import threading
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from conftest import CONFIG, Run, assert_no_orphans, elaswave_cmd, wait_for
from prometheus_client.parser import text_string_to_metric_families

from elaswave.events import read_jsonl

pytestmark = pytest.mark.e2e

STEPS = 100
FAULT_STEP = 30
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Terminal:
    """A command on a pseudo-terminal of 160 columns; everything it writes, kept."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        term_env = {**env, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
        self.proc = subprocess.Popen(
            args, stdin=slave, stdout=slave, stderr=slave, env=term_env, close_fds=True
        )
        os.close(slave)
        self.master = master
        self.chunks: list[bytes] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:  # the other side closed
                return
            if not data:
                return
            self.chunks.append(data)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        os.close(self.master)
        return code

    @property
    def raw(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")

    @property
    def text(self) -> str:
        """What it wrote, without colours and cursor movements."""
        return ANSI.sub("", self.raw)


def _scrape(url: str) -> dict[str, Any]:
    """``name{labels}`` -> value, labels without job and host (which every series has)."""
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, Any] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert {"job", "host"} <= set(s.labels), s
            rest = ",".join(
                f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("job", "host")
            )
            out[f"{s.name}{{{rest}}}" if rest else s.name] = s.value
    return out


def _metrics_url(run_dir: Path) -> str | None:
    path = run_dir / "events.jsonl"
    events = (
        [e for e in read_jsonl(path) if e["kind"] == "metrics_serving"] if path.exists() else []
    )
    return events[0]["url"] if events else None


def test_an_operator_watches_a_job_survive_a_crash(
    tmp_path: Path, state_env: dict[str, str]
) -> None:
    run_dir = tmp_path / "run"
    launch = Terminal(
        elaswave_cmd("launch", str(CONFIG), "--run-dir", str(run_dir), "--job-id", "ops",
                     "--steps", str(STEPS), "--metrics-port", "0",
                     "--fault", f"kill,rank=1,at_step={FAULT_STEP}"),
        state_env,
    )  # fmt: skip
    watch = None
    try:
        url = wait_for(lambda: _metrics_url(run_dir), timeout=90, interval=0.1)
        early = wait_for(
            lambda: (m := _scrape(url)).get("elaswave_committed_step", 0) >= 3 and m, timeout=60,
            interval=0.1,
        )  # fmt: skip
        watch = Terminal(elaswave_cmd("status", "--job-id", "ops", "--watch"), state_env)
        late = wait_for(
            lambda: (m := _scrape(url)).get("elaswave_epoch", 0) >= 2
            and m.get("elaswave_mttr_seconds_count", 0) >= 1
            and m["elaswave_committed_step"] >= FAULT_STEP + 5 and m,
            timeout=90, interval=0.2,
        )  # fmt: skip
        assert launch.wait(timeout=120) == 0, launch.text[-3000:]
        assert watch.wait(timeout=30) == 0, watch.text[-3000:]
    finally:
        for term in (launch, watch):
            if term is not None and term.proc.poll() is None:
                term.proc.kill()

    # Metrics: one host, so it leads and serves the job-wide series; they moved.
    assert early["elaswave_is_leader"] == 1.0
    assert (early["elaswave_epoch"], early["elaswave_world_size"]) == (1.0, 4.0)
    assert early["elaswave_workers{state=training}"] == 4.0
    assert early["elaswave_loss"] > 0 and early["elaswave_samples_per_second"] >= 0
    assert (late["elaswave_world_size"], late["elaswave_workers{state=exited}"]) == (3.0, 1.0)
    assert late["elaswave_workers{state=training}"] == 3.0
    assert late["elaswave_incidents_total{kind=crash}"] == 1.0
    assert 0 < late["elaswave_mttr_seconds_sum"] < 30
    assert late["elaswave_step_seconds_count"] >= late["elaswave_committed_step"] - 1
    assert late["elaswave_loss"] < early["elaswave_loss"]

    # The launch's display: redrawn in place (frames without new lines), then the incident,
    # its recovery with the MTTR, and the final frame.
    text = launch.text
    frames = re.findall(rf"step (\d+)/{STEPS}", text)
    assert len(set(frames)) >= 5, text[-2000:]
    assert [int(f) for f in frames] == sorted(int(f) for f in frames), "steps go forward"
    lines_with_frames = [ln for ln in text.split("\n") if "samples/s" in ln]
    assert len(lines_with_frames) <= 3, "a new line per refresh: not in place"
    incident = re.search(r"incident: worker \S+ \(rank 1\) killed by SIGKILL[^\n]*epoch 2", text)
    assert incident, text[-3000:]
    recovered = re.search(r"recovered: epoch 2, step (\d+) committed; MTTR (\d+) ms", text)
    assert recovered and int(recovered[1]) == FAULT_STEP, text[-3000:]
    assert f"step {STEPS}/{STEPS}" in text
    assert "| 1 | kill rank 1 |" in text  # the MTTR summary still ends the launch

    # status --watch: redrawn in place (cursor moved up over the old view), ended with the job.
    shown = watch.text
    assert shown.count("job ops") >= 3
    assert re.search(r"\x1b\[\d*A", watch.raw), "not redrawn in place (no cursor-up)"
    assert "done" in shown or "job ops: no longer running" in shown
    assert_no_orphans(Run(run_dir))
