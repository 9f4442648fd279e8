"""``report --format html``: one self-contained page whose plots a real browser draws."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from elaswave.report_html import deviation, render_html, throughput
from tests.unit.test_report import (
    STACKS,
    hang_events,
    kill_events,
    metrics,
    start_events,
    write_run,
)


class _Elements(HTMLParser):
    """Every start tag with its attributes, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, dict(attrs)))


def _page(tmp_path: Path, baseline: bool = True) -> tuple[str, Path]:
    run = write_run(tmp_path / "run", start_events() + kill_events(), metrics())
    base = write_run(tmp_path / "base", start_events(), metrics()) if baseline else None
    page = render_html([run], [base] if base else [])
    out = tmp_path / "report.html"
    out.write_text(page)
    return page, out


def test_the_page_is_self_contained_and_has_every_plot(tmp_path: Path) -> None:
    page, _ = _page(tmp_path)
    parser = _Elements()
    parser.feed(page)
    charts = [a["id"] for tag, a in parser.tags if tag == "svg"]
    assert charts == ["phases", "loss", "deviation", "throughput", "world"]
    refs = [v for _, a in parser.tags for k, v in a.items() if k in ("src", "href") and v]
    assert refs == [], "nothing is loaded from anywhere"
    assert not re.search(r"https?://", page)
    assert "kill rank 1" in page and "epoch 2: dp 4→3" in page
    without = render_html([tmp_path / "run"])
    assert "deviation" not in re.findall(r'<svg class="chart" id="(\w+)"', without)


def test_the_stacks_of_a_worker_killed_as_hung_are_on_the_page(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", start_events() + hang_events("hang"), metrics())
    page = render_html([run])
    (details,) = re.findall(r'<details class="stacks">(.*?)</details>', page, re.S)
    assert "#1: stacks of w1 as it was killed (stacks/w1-20250304-050607.txt)" in details
    assert html.escape(STACKS) in details
    assert "<details" not in render_html([write_run(tmp_path / "kill", kill_events(), metrics())])


def test_throughput_and_deviation_are_computed_from_the_records() -> None:
    rows = [{"step": s, "time": 10.0 + s, "samples": 32 * s, "loss": 2.0} for s in range(1, 9)]
    assert throughput(rows) == [(5.0, 32.0), (6.0, 32.0), (7.0, 32.0)]
    base = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 4.0}]
    assert deviation(rows[:3], base) == [(1.0, 0.0), (2.0, 0.5)]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (.ci/run installs it)")
def test_a_browser_draws_the_plots(tmp_path: Path) -> None:
    """Headless chromium lays the page out: every chart has its size, its lines have length,
    the fault is marked where it happened and each MTTR phase is a bar of its own width."""
    _, out = _page(tmp_path)
    profile = tmp_path / "profile"
    dom = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=2000",
         "--dump-dom", out.as_uri()],
        capture_output=True, text=True, timeout=120,
    ).stdout  # fmt: skip
    found = re.search(r'<pre id="layout">(.*?)</pre>', dom, re.S)
    assert found and found[1], dom[-2000:]
    layout: dict[str, Any] = json.loads(found[1])
    assert set(layout) == {"phases", "loss", "deviation", "throughput", "world"}
    for name, chart in layout.items():
        assert chart["width"] >= 700 and chart["height"] >= 60, (name, chart)
    for name in ("loss", "deviation", "throughput", "world"):
        assert all(length > 100 for length in layout[name]["lines"]), (name, layout[name])
        assert layout[name]["faults"] == 1, name  # the one kill, marked
    assert len(layout["loss"]["lines"]) == 2  # this run and the fault-free one
    bars = layout["phases"]["bars"]
    assert len(bars) == 5 and all(b > 0 for b in bars)
    # Widths follow the phases (detection 20 ms, plan 10, comm 10, state 5, redo 55).
    assert bars[4] > bars[0] > bars[3] and bars[1] == pytest.approx(bars[2], rel=0.01)
    shot = tmp_path / "report.png"
    subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--window-size=900,1600",
         f"--screenshot={shot}", out.as_uri()],
        capture_output=True, timeout=120, check=True,
    )  # fmt: skip
    assert shot.stat().st_size > 20_000, "a page with plots, not a blank one"
