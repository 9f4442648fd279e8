"""``elaswave doctor`` and ``elaswave --version``: a thin command over :mod:`elaswave.doctor`.

:func:`register` adds both to the app. The doctor prints one table (or with ``--json`` one
document) of its checks and exits 0 if none FAILs, 1 otherwise; bad flags are one error line and
exit 2, before anything is probed.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from elaswave.errors import ConfigError, ElasWaveError

if TYPE_CHECKING:
    from elaswave.doctor import Check

out = Console()
err = Console(stderr=True)

_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}

_Device = Annotated[
    str,
    typer.Option("--device", help="Smoke run's workers: cpu (gloo) | cuda | npu | auto."),
]
_Etcd = Annotated[
    str | None,
    typer.Option("--etcd", help="host:port[,host:port]: check the address peers reach us on."),
]
_SkipSmoke = Annotated[
    bool, typer.Option("--skip-smoke", help="Skip the two-worker smoke run (tens of seconds).")
]
_SmokeTimeout = Annotated[
    float, typer.Option("--smoke-timeout", help="Seconds before the smoke run counts as failed.")
]
_Json = Annotated[bool, typer.Option("--json", help="One JSON document instead of the table.")]


def register(app: typer.Typer) -> None:
    """Add ``doctor`` and the app-wide ``--version`` to ``app``."""
    app.callback()(_app_options)
    app.command("doctor")(doctor)


def _show_version(value: bool) -> None:
    if value:
        from elaswave.doctor.probes import package_version

        typer.echo(f"elaswave {package_version()}")
        raise typer.Exit(0)


def _app_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", is_eager=True, callback=_show_version, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    # No docstring: the app's help stays the one given to typer.Typer.
    return None


def doctor(
    device: _Device = "cpu",
    etcd: _Etcd = None,
    skip_smoke: _SkipSmoke = False,
    smoke_timeout: _SmokeTimeout = 300.0,
    as_json: _Json = False,
) -> None:
    """Check this host before a first job: versions, devices and backends, the network, and a
    two-worker smoke run with a real kill. Exits 1 if any check FAILs."""
    from elaswave.doctor import diagnose, exit_code

    try:
        endpoints = _endpoints(etcd)
        _check_flags(device, smoke_timeout)
    except ElasWaveError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(exc.exit_code) from None
    status = None
    if not as_json and err.is_terminal:
        status = err.status("checking…")
        status.start()
    try:
        checks = diagnose(
            device=device, etcd=endpoints, smoke=not skip_smoke, smoke_timeout=smoke_timeout,
            on_smoke=status.update if status is not None else None,
        )  # fmt: skip
    finally:
        if status is not None:
            status.stop()
    code = exit_code(checks)
    if as_json:
        out.print_json(json.dumps(_document(checks, code)))
    else:
        out.print(_table(checks))
        out.print(_summary(checks), highlight=False)
    raise typer.Exit(code)


def _endpoints(text: str | None) -> list[str]:
    """``--etcd`` as ``host:port`` strings; malformed is a one-line error."""
    if text is None:
        return []
    from elaswave.daemon.etcd_connect import parse_endpoints

    return [f"{host}:{port}" for host, port in parse_endpoints(text)]


def _check_flags(device: str, smoke_timeout: float) -> None:
    from elaswave.config import DEVICE_KINDS

    if device not in DEVICE_KINDS:
        raise ConfigError(f"--device must be one of {', '.join(DEVICE_KINDS)}, got {device!r}")
    if not smoke_timeout > 0:
        raise ConfigError(f"--smoke-timeout must be > 0, got {smoke_timeout}")


def _document(checks: Sequence[Check], code: int) -> dict[str, Any]:
    from elaswave.doctor.probes import package_version

    return {
        "elaswave": package_version(),
        "exit_code": code,
        "counts": _counts(checks),
        "checks": [c.as_dict() for c in checks],
    }


def _counts(checks: Sequence[Check]) -> dict[str, int]:
    seen = Counter(c.status for c in checks)
    return {status: seen.get(status, 0) for status in ("PASS", "WARN", "FAIL")}


def _table(checks: Sequence[Check]) -> Table:
    """One row per check; a rule between the sections (versions, devices, network, smoke)."""
    table = Table("check", "status")
    table.add_column("finding", overflow="fold")
    for i, check in enumerate(checks):
        last = i + 1 == len(checks) or checks[i + 1].section != check.section
        table.add_row(
            check.name,
            f"[{_STYLE[check.status]}]{check.status}[/]",
            escape(check.reason),
            end_section=last,
        )
    return table


def _summary(checks: Sequence[Check]) -> str:
    counts = _counts(checks)
    verdict = "not ready: fix what FAILs" if counts["FAIL"] else "ready"
    warnings = f"{counts['WARN']} warning" + ("" if counts["WARN"] == 1 else "s")
    return f"{counts['PASS']} passed, {warnings}, {counts['FAIL']} failed: {verdict}"
