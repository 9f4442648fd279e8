"""``elaswave report``: the MTTR report of a run, one row per incident with its phases plus run
totals, as json, csv, markdown or html (which adds the plots).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from elaswave.cli.common import fail
from elaswave.errors import ConfigError, ElasWaveError


def report(
    job_id: str | None = typer.Option(None, "--job-id"),
    run_dirs: list[Path] = typer.Option(  # noqa: B006 - typer's way to repeat an option
        [], "--run-dir", help="A run directory; repeat it for each host's of a multi-host job."
    ),
    fmt: str = typer.Option("md", "--format", help="json | csv | md | html"),
    out_file: Path | None = typer.Option(None, "--out"),
    baseline: list[Path] = typer.Option(  # noqa: B006 - typer's way to repeat an option
        [], "--baseline", help="html: a fault-free run's directory to overlay (repeatable)."
    ),
) -> None:
    """MTTR report of a run: one row per incident with its phases, plus run totals; html adds
    the plots (phases, loss with the faults marked, throughput, world size) in one file."""
    from elaswave.report import build_report
    from elaswave.report_text import render

    try:
        if fmt not in ("json", "csv", "md", "html"):
            raise ConfigError(f"unknown --format {fmt!r}: use json, csv, md or html")
        if baseline and fmt != "html":
            raise ConfigError("--baseline is for --format html")
        directories = _report_dirs(job_id, run_dirs)
        for d in baseline:
            if not (d / "metrics.jsonl").is_file():
                raise ConfigError(f"--baseline {d}: not a run directory (no metrics.jsonl)")
        report_ = build_report(*directories)
        if fmt == "html":
            from elaswave.report_html import render_html

            text = render_html(directories, baseline, report_)
        else:
            text = render(report_, fmt)
    except ElasWaveError as exc:
        raise fail(exc) from None
    if out_file:
        out_file.write_text(text)
    else:
        sys.stdout.write(text)


def _report_dirs(job_id: str | None, run_dirs: list[Path]) -> list[Path]:
    from elaswave.daemon.discovery import find_job
    from elaswave.errors import JobNotFound

    if run_dirs:
        directories = run_dirs
    elif job_id is not None:
        try:
            directories = [Path(find_job(job_id)["run_dir"])]
        except JobNotFound:
            directories = [Path("runs") / job_id]
    else:
        raise ConfigError("give --run-dir DIR or --job-id ID")
    for directory in directories:
        if not (directory / "events.jsonl").exists():
            raise ElasWaveError(f"no run found at {directory} (missing events.jsonl)")
    return directories
