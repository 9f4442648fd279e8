"""``elaswave status``: membership, ranks, epoch, step, throughput and recent incidents of a
running job, as a table, one JSON document (``--json``) or a view redrawn every second
(``--watch``).
"""

from __future__ import annotations

import json
import time
from typing import Any

import typer
from rich.markup import escape
from rich.table import Table

from elaswave.cli.common import EtcdCacert, EtcdCert, EtcdKey, client_tls, fail, out
from elaswave.errors import ConfigError, ElasWaveError

HANG_LINES = 4  # distinct hang-timeout descriptions status shows (hosts apply their own)


def status(
    job_id: str = typer.Option("elaswave", "--job-id"),
    etcd: str | None = typer.Option(None, "--etcd", help="Default: the job's embedded etcd."),
    etcd_cacert: EtcdCacert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
    as_json: bool = typer.Option(False, "--json"),
    watch: bool = typer.Option(
        False, "--watch", help="Refresh in place every second until the job ends or Ctrl-C."
    ),
) -> None:
    """Membership, ranks, epoch, step, throughput and recent incidents of a running job."""
    from elaswave.cli.jobs import job_status

    try:
        if watch and as_json:
            raise ConfigError("--watch and --json do not go together: --json is one document")
        tls = client_tls(etcd_cacert, etcd_cert, etcd_key)
        st = job_status(job_id, etcd, tls=tls)
    except ElasWaveError as exc:
        raise fail(exc) from None
    if as_json:
        out.print_json(json.dumps(st))
    elif not watch:
        out.print(_status_view(st))
    else:
        _watch_status(st, lambda: job_status(job_id, etcd, tls=tls), lambda: _ended(job_id, etcd))


def _ended(job_id: str, etcd: str | None) -> bool:
    """Whether a job found through its discovery record has ended: its launcher removes the
    record before it stops the job's embedded etcd (False with ``--etcd``: nothing to tell)."""
    from elaswave.daemon.discovery import find_job
    from elaswave.errors import JobNotFound

    if etcd:
        return False
    try:
        find_job(job_id)
    except JobNotFound:
        return True
    return False


def _watch_status(st: dict[str, Any], read: Any, ended: Any) -> None:
    """``status --watch``: one view redrawn in place until the job is done (or gone), Ctrl-C.
    A read that cannot reach etcd after the launcher ended (its record was there when the read
    began, its etcd stopped before the read connected) is the job's end, not an error."""
    from rich.live import Live

    from elaswave.errors import JobNotFound

    try:
        with Live(_status_view(st), console=out, auto_refresh=False) as live:
            while not st["done"]:
                time.sleep(1.0)
                try:
                    st = read()
                except ElasWaveError as exc:
                    # its launcher ended since the last look (its record gone, or its etcd)
                    if not isinstance(exc, JobNotFound) and not ended():
                        raise fail(exc) from None
                    out.print(f"job {escape(st['job_id'])}: no longer running", highlight=False)
                    break
                live.update(_status_view(st), refresh=True)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


def _held(member: dict[str, Any]) -> str:
    """A rank's bytes (parameters, gradients, optimizer state, recovery copies, ZeRO-3's gathered
    layers and layer gradients at their peak) in MiB."""
    from elaswave.report import MEMORY_FIELDS, PEAK_PARTS

    parts = [member.get(k) for k in MEMORY_FIELDS if k not in PEAK_PARTS]
    if any(p is None for p in parts[:4]):
        return "–"
    return f"{sum(p or 0 for p in parts) / 2**20:.1f} MiB"


def _status_view(st: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.text import Text

    prog = st["progress"] or {}
    head = (
        f"job [bold]{escape(st['job_id'])}[/bold]  epoch {st['epoch']}  world {st['world_size']}  "
        f"leader {st['leader']}  step {prog.get('step', 0)}/{prog.get('total_steps', '?')}  "
        f"loss {prog.get('loss', float('nan')):.4f}  {prog.get('samples_per_s', 0.0):.1f} samples/s"
    )
    if st["done"]:
        head += "  [green]done[/green]"
    grid = any("replica" in m for m in st["members"])
    columns = ["rank", "worker", "host", "pid", "micro-batches", "holds", "state"]
    table = Table(*(columns[:1] + ["replica·stage", "layers"] + columns[1:] if grid else columns))
    for m in st["members"]:
        place = [f"{m['replica']}·{m['stage']}", "[{}, {})".format(*m["layers"])] if grid else []
        table.add_row(
            str(m["rank"]),
            *place,
            m["worker"],
            m["host"],
            str(m["pid"] or "–"),
            str(m["microbatches"]),
            _held(m),
            "[green]alive[/green]" if m["alive"] else "[red]gone[/red]",
        )
    for wid in st["standby"]:
        table.add_row("–", wid, "", "", "0", "", "standby")
    lines = [
        Text(f"  {time.strftime('%H:%M:%S', time.localtime(inc['t']))}  {inc['reason']}")
        for inc in st["incidents"][-5:]
    ]
    return Group(head, table, *_hang_timeout(st.get("hang_timeout", {})), *lines)


def _hang_timeout(by_host: dict[str, dict[str, Any]]) -> list[Any]:
    """The hang detectors' bounds: one line if every host applies the same, else one per
    distinct description with its hosts (at most ``HANG_LINES``)."""
    from rich.text import Text

    hosts: dict[str, list[str]] = {}
    for host, bounds in sorted(by_host.items()):
        hosts.setdefault(str(bounds.get("how", "?")), []).append(host)
    if len(hosts) <= 1:
        return [Text(f"hang timeout: {how}") for how in hosts]
    out = []
    for how, names in list(hosts.items())[:HANG_LINES]:
        more = f" and {len(names) - 2} more" if len(names) > 2 else ""
        out.append(Text(f"hang timeout on {', '.join(names[:2])}{more}: {how}"))
    return out
