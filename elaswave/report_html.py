"""``elaswave report --format html``: one self-contained page (inline SVG, no script from the
network, no CDN) with the incident table, the stacks of workers killed as hung (folded), each
MTTR's phases as stacked bars, the loss curve
with the faults marked (and, with a baseline run, the fault-free curve and the deviation from
it), and throughput and world size over time.

The charts are drawn here as SVG from the run directory's records; a few lines of inline script
write each chart's laid-out geometry into the page (``#layout``), so a test in a real browser can
check that the plots were drawn, not only that the text is there.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from elaswave.events import METRICS_FILE, distinct_records, read_jsonl
from elaswave.report import PHASES, build_report

__all__ = ["deviation", "render_html", "series", "throughput"]

W, H, PAD = 760, 240, 64
COLORS = {"run": "#1f77b4", "baseline": "#7f7f7f", "fault": "#d62728", "world": "#2ca02c",
          "rate": "#9467bd", "deviation": "#ff7f0e"}  # fmt: skip
PHASE_COLORS = dict(zip(PHASES, ("#d62728", "#ff7f0e", "#bcbd22", "#17becf", "#1f77b4"),
                        strict=True))  # fmt: skip
WINDOW = 5  # commits per throughput point


def series(run_dirs: Sequence[Path]) -> list[dict[str, Any]]:
    """The committed steps of a run (several hosts' directories merged), in step order."""
    lines = distinct_records(m for d in run_dirs for m in read_jsonl(Path(d) / METRICS_FILE))
    steps = {int(m["step"]): m for m in lines if "kind" not in m and "step" in m}
    return [steps[s] for s in sorted(steps)]


def throughput(rows: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    """(seconds since the first commit, samples/s over the last ``WINDOW`` commits). Pure."""
    out = []
    for i in range(WINDOW, len(rows)):
        a, b = rows[i - WINDOW], rows[i]
        dt = float(b["time"]) - float(a["time"])
        if dt > 0:
            rate = (float(b["samples"]) - float(a["samples"])) / dt
            out.append((float(b["time"]) - float(rows[0]["time"]), rate))
    return out


def deviation(
    rows: Sequence[dict[str, Any]], base: Sequence[dict[str, Any]]
) -> list[tuple[float, float]]:
    """(step, |loss - baseline loss| / |baseline loss|) for the steps both runs have. Pure."""
    ref = {int(m["step"]): float(m["loss"]) for m in base}
    return [
        (float(m["step"]), abs(float(m["loss"]) - ref[s]) / abs(ref[s]))
        for m in rows
        if (s := int(m["step"])) in ref and ref[s]
    ]


def _scale(lo: float, hi: float, a: float, *, b: float) -> Any:
    span = (hi - lo) or 1.0
    return lambda v: a + (v - lo) / span * (b - a)


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / (n - 1) for i in range(n)]


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def line_chart(
    chart_id: str,
    title: str,
    lines: Sequence[tuple[str, str, Sequence[tuple[float, float]], bool]],
    *,
    marks: Sequence[tuple[float, str]] = (),
    x_label: str = "",
    step_line: bool = False,
) -> str:
    """An SVG chart: ``lines`` = (label, color, points, dashed); ``marks`` = vertical lines at
    x with a label (the faults)."""
    points = [p for _, _, pts, _ in lines for p in pts]
    if not points:
        return f'<p class="empty">{html.escape(title)}: no data</p>'
    xs, ys = [p[0] for p in points] + [m[0] for m in marks], [p[1] for p in points]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if y0 == y1:
        y0, y1 = y0 - 1, y1 + 1
    sx, sy = _scale(x0, x1, PAD, b=W - 12), _scale(y0, y1, H - 32, b=22)
    parts = [
        f'<svg class="chart" id="{chart_id}" viewBox="0 0 {W} {H}" width="{W}" height="{H}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<text x="{PAD}" y="14" class="title">{html.escape(title)}</text>',
        f'<line x1="{PAD}" y1="{H - 32}" x2="{W - 12}" y2="{H - 32}" class="axis"/>',
        f'<line x1="{PAD}" y1="22" x2="{PAD}" y2="{H - 32}" class="axis"/>',
    ]
    for t in _ticks(y0, y1):
        parts.append(f'<text x="{PAD - 4}" y="{sy(t) + 4:.1f}" class="tick" '
                     f'text-anchor="end">{_fmt(t)}</text>')  # fmt: skip
    for t in _ticks(x0, x1):
        parts.append(f'<text x="{sx(t):.1f}" y="{H - 18}" class="tick" '
                     f'text-anchor="middle">{_fmt(t)}</text>')  # fmt: skip
    parts.append(f'<text x="{W - 12}" y="{H - 4}" class="tick" text-anchor="end">'
                 f"{html.escape(x_label)}</text>")  # fmt: skip
    for x, label in marks:
        parts.append(
            f'<line class="fault" x1="{sx(x):.1f}" y1="22" x2="{sx(x):.1f}" y2="{H - 32}" '
            f'stroke="{COLORS["fault"]}" stroke-dasharray="4 3"><title>{html.escape(label)}'
            "</title></line>"
        )
    for i, (label, color, pts, dashed) in enumerate(lines):
        if step_line:  # a step function: hold each value until the next point
            held = [p for a, b in zip(pts, pts[1:], strict=False) for p in (a, (b[0], a[1]))]
            pts = [*held, pts[-1]] if pts else []
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        dash = ' stroke-dasharray="6 4"' if dashed else ""
        parts.append(f'<polyline class="series" points="{coords}" fill="none" '
                     f'stroke="{color}" stroke-width="1.6"{dash}/>')  # fmt: skip
        parts.append(f'<text x="{W - 16}" y="{30 + 14 * i}" class="legend" text-anchor="end" '
                     f'fill="{color}">{html.escape(label)}</text>')  # fmt: skip
    parts.append("</svg>")
    return "\n".join(parts)


def phase_bars(incidents: Sequence[dict[str, Any]]) -> str:
    """Each incident's MTTR as a bar of its phases, stacked, on one time scale."""
    rows = [i for i in incidents if i.get("mttr_s") is not None]
    if not rows:
        return '<p class="empty">No incident recovered: no MTTR to draw.</p>'
    longest = max(sum(i.get(p) or 0.0 for p in PHASES) for i in rows) or 1.0
    height = 30 + 26 * len(rows) + 24
    sx = _scale(0.0, longest, 150, b=W - 80)
    parts = [f'<svg class="chart" id="phases" viewBox="0 0 {W} {height}" width="{W}" '
             f'height="{height}" role="img" aria-label="MTTR phases">',
             '<text x="8" y="14" class="title">MTTR by phase (seconds)</text>']  # fmt: skip
    for k, inc in enumerate(rows):
        y, x = 26 + 26 * k, 0.0
        label = f"#{inc['id']} {inc['kind']} @ step {inc.get('fault_step') or '–'}"
        parts.append(f'<text x="8" y="{y + 14}" class="tick">{html.escape(label)}</text>')
        for p in PHASES:
            seconds = inc.get(p) or 0.0
            x0, x1 = sx(x), sx(x + seconds)
            parts.append(
                f'<rect class="phase" x="{x0:.1f}" y="{y}" width="{max(x1 - x0, 0.0):.2f}" '
                f'height="18" fill="{PHASE_COLORS[p]}"><title>{p.removesuffix("_s")} '
                f"{seconds * 1000:.0f} ms</title></rect>"
            )
            x += seconds
        parts.append(f'<text x="{sx(x) + 4:.1f}" y="{y + 14}" class="tick">'
                     f"{inc['mttr_s'] * 1000:.0f} ms</text>")  # fmt: skip
    y = 26 + 26 * len(rows) + 8
    for j, p in enumerate(PHASES):
        parts.append(f'<rect x="{150 + 110 * j}" y="{y}" width="10" height="10" '
                     f'fill="{PHASE_COLORS[p]}"/><text x="{164 + 110 * j}" y="{y + 9}" '
                     f'class="tick">{p.removesuffix("_s")}</text>')  # fmt: skip
    parts.append("</svg>")
    return "\n".join(parts)


def _table(incidents: Sequence[dict[str, Any]]) -> str:
    head = ["#", "fault", "step", *(p.removesuffix("_s") for p in PHASES), "MTTR", "after",
            "reason"]  # fmt: skip
    rows = []
    for inc in incidents:
        who = inc["kind"] + (f" rank {inc['rank']}" if inc.get("rank") is not None else "")
        ms = [f"{inc[p] * 1000:.0f} ms" if inc.get(p) is not None else "–" for p in PHASES]
        mttr = f"{inc['mttr_s'] * 1000:.0f} ms" if inc.get("mttr_s") is not None else "–"
        cells = [inc["id"], who, inc.get("fault_step") or "–", *ms, mttr,
                 inc.get("world_after") or "–", inc.get("reason", "")]  # fmt: skip
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    return f'<table id="incidents"><tr>{header}</tr>{"".join(rows)}</table>'


def _stacks(incidents: Sequence[dict[str, Any]]) -> str:
    """The stacks of each worker killed as hung, folded under its incident's number."""
    parts = []
    for inc in incidents:
        if not inc.get("stacks"):
            continue
        where = f" ({inc['stacks_file']})" if inc.get("stacks_file") else ""
        summary = f"#{inc['id']}: stacks of {inc['worker']} as it was killed{where}"
        parts.append(f'<details class="stacks"><summary>{html.escape(summary)}</summary>'
                     f"<pre>{html.escape(inc['stacks'])}</pre></details>")  # fmt: skip
    return "\n".join(parts)


LAYOUT_SCRIPT = """
<script>
// What the browser drew: each chart's size, its lines' lengths, its fault marks and bars.
const layout = {};
for (const svg of document.querySelectorAll("svg.chart")) {
  const box = svg.getBoundingClientRect();
  layout[svg.id] = {
    width: box.width, height: box.height,
    lines: [...svg.querySelectorAll("polyline.series")].map(p => p.getTotalLength()),
    faults: svg.querySelectorAll("line.fault").length,
    bars: [...svg.querySelectorAll("rect.phase")].map(r => r.getBBox().width),
  };
}
document.getElementById("layout").textContent = JSON.stringify(layout);
</script>
"""

STYLE = """
body { font: 14px system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 12px 0; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
svg.chart { display: block; margin: 16px 0; }
.title { font-weight: 600; font-size: 13px; } .tick { font-size: 11px; fill: #444; }
.legend { font-size: 12px; } .axis { stroke: #888; } #layout { display: none; }
"""


def render_html(
    run_dirs: Sequence[Path],
    baseline_dirs: Sequence[Path] = (),
    report: dict[str, Any] | None = None,
) -> str:
    """The page for a run (several hosts' directories merged), optionally against a baseline."""
    report = report or build_report(*run_dirs)
    rows = series(run_dirs)
    base = series(baseline_dirs) if baseline_dirs else []
    incidents = report["incidents"]
    t0 = float(rows[0]["time"]) if rows else 0.0
    faults = [i for i in incidents if i.get("fault_step") and i.get("kind") != "control plane"]
    step_marks = [(float(i["fault_step"]), f"#{i['id']} {i['kind']}") for i in faults]
    time_marks = [(float(i["fault_t"]) - t0, f"#{i['id']} {i['kind']}") for i in faults
                  if rows and i.get("fault_t")]  # fmt: skip
    loss = [(float(m["step"]), float(m["loss"])) for m in rows]
    lines = [("this run", COLORS["run"], loss, False)]
    if base:
        lines.append(("fault-free", COLORS["baseline"],
                      [(float(m["step"]), float(m["loss"])) for m in base], True))  # fmt: skip
    charts = [line_chart("loss", "Loss per committed step (faults marked)", lines, marks=step_marks,
                         x_label="step")]  # fmt: skip
    if base:
        dev = deviation(rows, base)
        charts.append(line_chart("deviation", "Relative deviation from the fault-free loss",
                                 [("|Δloss| / loss", COLORS["deviation"], dev, False)],
                                 marks=step_marks, x_label="step"))  # fmt: skip
    rate = throughput(rows)
    charts.append(line_chart("throughput", f"Throughput (samples/s over {WINDOW} steps)",
                             [("samples/s", COLORS["rate"], rate, False)], marks=time_marks,
                             x_label="seconds"))  # fmt: skip
    world = [(float(m["time"]) - t0, float(m["world_size"])) for m in rows]
    charts.append(line_chart("world", "World size", [("ranks", COLORS["world"], world, False)],
                             marks=time_marks, x_label="seconds", step_line=True))  # fmt: skip
    totals = report["totals"]
    summary = (
        f"Committed steps: {totals['committed_steps']} (last {totals['last_step']}; duplicates "
        f"{totals['duplicate_steps'] or 'none'}; missing {totals['missing_steps'] or 'none'}); "
        f"final loss {totals['final_loss']}; median MTTR "
        + (f"{totals['mttr_median_s'] * 1000:.0f} ms" if totals.get("mttr_median_s") else "–")
    )
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
        f"<title>ElasWave report: {html.escape(report['run_dir'])}</title>",
        f"<style>{STYLE}</style></head><body>",
        "<h1>ElasWave MTTR report</h1>",
        f"<p>{html.escape(report['run_dir'])}</p>",
        f"<p id=\"totals\">{html.escape(summary)}</p>",
        _table(incidents) if incidents else "<p>No incidents.</p>", _stacks(incidents),
        phase_bars(incidents), *charts,
        '<pre id="layout"></pre>', LAYOUT_SCRIPT, "</body></html>",
    ])  # fmt: skip
