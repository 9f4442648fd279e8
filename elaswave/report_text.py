"""The MTTR report as text: JSON, CSV (one row per incident) and a markdown table with totals.

Separate from :mod:`elaswave.report`, which computes the incidents and totals from a run's
records: this only lays a computed report out (the HTML page is :mod:`elaswave.report_html`).
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from elaswave.report import CONTROL_PLANE, PHASES

CSV_FIELDS = [
    "id", "kind", "host", "worker", "rank", "fault_step", "epoch", "world_after", *PHASES,
    "mttr_s", "first_commit_step", "state_bytes", "state_promoted_bytes", "state_max_over_mean",
    "recomputed_steps", "kept_microbatches", "redone_microbatches", "downtime_s",
    "steps_trained", "stacks_file", "spare", "reason",
]  # fmt: skip


def render(report: dict[str, Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(report, indent=2, sort_keys=True)
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for inc in report["incidents"]:
            writer.writerow(inc)
        return out.getvalue()
    if fmt == "md":
        return render_markdown(report)
    raise ValueError(f"unknown format {fmt!r} (json, csv, md)")


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value * 1000:.0f} ms"


def render_markdown(report: dict[str, Any]) -> str:
    lines = ["# ElasWave MTTR report", ""]
    incidents = report["incidents"]
    if incidents:
        lines += [
            "| # | fault | step | detection | plan | comm | state | redo | **MTTR** | after |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for inc in incidents:
            who = inc["kind"]
            after = f"{inc['world_after']} workers" if inc["world_after"] else "–"
            if inc["kind"] == CONTROL_PLANE:
                who = f"{inc['what']} ({_ms(inc['downtime_s'])})"
                after = f"trained on: {inc['steps_trained']} steps"
            elif inc["rank"] is not None:
                who += f" rank {inc['rank']}"
            elif inc.get("host"):
                who += f" host {inc['host']}"
            lines.append(
                f"| {inc['id']} | {who} | {inc['fault_step'] or '–'} | "
                + " | ".join(_ms(inc[p]) for p in PHASES)
                + f" | **{_ms(inc['mttr_s'])}** | {after} |"
            )
        lines.append("")
        for inc in incidents:
            state = ""
            if inc.get("state_promoted_bytes") is not None and inc.get("state_bytes") is not None:
                state = (
                    f" (state: {inc['state_bytes']} B over the network, "
                    f"{inc['state_promoted_bytes']} B promoted locally, per-rank max/mean "
                    f"{inc['state_max_over_mean']:.3f})"
                )
            redo = ""
            if inc.get("redone_by"):
                kept, again = inc["kept_microbatches"], inc["redone_microbatches"]
                by = ", ".join(f"{w} {n}" for w, n in inc["redone_by"].items())
                redo = f"; redone {again} of {kept + again} micro-batches ({by})"
            spare = f"; its place taken by warm spare {inc['spare']}" if inc.get("spare") else ""
            lines.append(f"- incident {inc['id']}: {inc['reason']}{state}{redo}{spare}")
            if inc.get("stacks"):
                where = f" ({inc['stacks_file']})" if inc.get("stacks_file") else ""
                lines += [f"  stacks of {inc['worker']} as it was killed{where}:", "", "  ```"]
                lines += [f"  {line}".rstrip() for line in inc["stacks"].splitlines()]
                lines += ["  ```", ""]
        lines.append("")
    else:
        lines += ["No incidents.", ""]
    t = report["totals"]
    lines += [
        f"Committed steps: {t['committed_steps']} (last {t['last_step']}; "
        f"duplicates {t['duplicate_steps'] or 'none'}; missing {t['missing_steps'] or 'none'}); "
        f"final loss {t['final_loss']}; wall {t['wall_s']} s; "
        f"median MTTR {_ms(t['mttr_median_s'])}.",
    ]
    if t.get("prune"):
        p = t["prune"]
        reached = f"{p['sparsity']:.2f}" if p["sparsity"] is not None else "–"
        lines.append(f"Group sparsity {reached}/{p['target']:.2f} ({p['method']}).")
        if p["below_target"]:
            lines.append(p["below_target"])
    if t.get("eval_loss"):
        e = t["eval_loss"]
        accuracy = f", accuracy {e['accuracy']:.1%}" if e.get("accuracy") is not None else ""
        lines.append(f"Held-out loss {e['loss']:.4f}{accuracy} at step {e['step']}.")
    if t.get("evicted"):
        lines.append(f"Evicted as stragglers: {', '.join(t['evicted'])}.")
    if t.get("stopped"):
        lines.append(f"Job stopped: {t['stopped']}.")
    return "\n".join(lines) + "\n"
