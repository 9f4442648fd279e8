"""The ``elaswave`` command line: thin commands over library functions.

Errors a user can cause print one line on stderr and exit non-zero; ``--json`` sits next to every
table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from elaswave.errors import ConfigError, ElasWaveError, FaultSpecError, JobStopped

if TYPE_CHECKING:
    from elaswave.config import EtcdTLSConfig

app = typer.Typer(
    name="elaswave",
    help="Elastic-native training: survive crashes in place, inspect, inject faults, report MTTR.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)


def _fail(exc: ElasWaveError) -> typer.Exit:
    if isinstance(exc, JobStopped):  # a verdict, not a usage error: "elaswave: job stopped: …"
        err.print(f"elaswave: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return typer.Exit(exc.exit_code)
    err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(exc.exit_code)


@app.command()
def launch(
    ctx: typer.Context,
    config: Path | None = typer.Argument(
        None, help="Job config YAML (defaults apply without one)."
    ),
    nproc_per_node: int | None = typer.Option(
        None, "--nproc-per-node", help="Workers on this host."
    ),
    nnodes: str | None = typer.Option(None, "--nnodes", help="Hosts: N or MIN:MAX."),
    etcd: str | None = typer.Option(
        None, "--etcd", help="host:port[,host:port]; default: embedded etcd."
    ),
    etcd_port: int | None = typer.Option(
        None, "--etcd-port", help="Client port of the embedded etcd."
    ),
    etcd_cacert: Path | None = typer.Option(
        None, "--etcd-cacert", help="CA of etcd's server certificate (turns TLS on)."
    ),
    etcd_cert: Path | None = typer.Option(
        None, "--etcd-cert", help="Client certificate for etcd (with --etcd-key)."
    ),
    etcd_key: Path | None = typer.Option(None, "--etcd-key", help="Client key for etcd."),
    etcd_server_cert: Path | None = typer.Option(
        None, "--etcd-server-cert", help="Embedded etcd: serve TLS with this certificate."
    ),
    etcd_server_key: Path | None = typer.Option(
        None, "--etcd-server-key", help="Embedded etcd: key of --etcd-server-cert."
    ),
    job_id: str | None = typer.Option(None, "--job-id"),
    run_dir: Path | None = typer.Option(None, "--run-dir", help="Default runs/<job-id>."),
    steps: int | None = typer.Option(None, "--steps"),
    max_restarts: int | None = typer.Option(
        None, "--max-restarts", help="Respawns of crashed workers."
    ),
    fault: list[str] = typer.Option(
        [], "--fault", help="e.g. kill,rank=1,at_step=15 (repeatable)."
    ),
    host_id: str | None = typer.Option(None, "--host-id"),
    host_addr: str | None = typer.Option(
        None, "--host-addr", help="Address peers reach this host on."
    ),
    zero: int | None = typer.Option(
        None, "--zero", help="1: ZeRO-1 sharded optimizer state (with --pp: inside each stage)."
    ),
    pp: int | None = typer.Option(None, "--pp", help="Pipeline stages per replica."),
    dp: int | None = typer.Option(None, "--dp", help="Data-parallel replicas (default world/pp)."),
    migration: str | None = typer.Option(
        None, "--migration", help="Pipelines: move a lost stage's layers async | blocking."
    ),
    stage_loss: str | None = typer.Option(
        None, "--stage-loss", help="Pipelines: reshard the replica | drop it (baseline)."
    ),
    dvfs: str | None = typer.Option(
        None, "--dvfs", help="Pipelines: frequency actuator off | sim | nvml | npu."
    ),
    durable_every: int | None = typer.Option(
        None, "--durable-every", help="Durable checkpoint every N steps (0: never)."
    ),
    durable_dir: Path | None = typer.Option(
        None, "--durable-dir", help="Default RUN_DIR/checkpoints."
    ),
    resume: Path | None = typer.Option(
        None, "--resume", help="Start from the newest durable checkpoint in this directory."
    ),
    snapshot_every: int | None = typer.Option(
        None, "--snapshot-every", help="ZeRO replicas every K steps (1: every step, 0: none)."
    ),
    verify_every: int | None = typer.Option(
        None, "--verify-every", help="Compare replicas' checksums every K steps (0: never)."
    ),
    hang_timeout: float | None = typer.Option(
        None, "--hang-timeout", help="Seconds without progress before a worker counts as hung."
    ),
    straggler_threshold: float | None = typer.Option(
        None,
        "--straggler-threshold",
        help="Evict a rank this many times slower than the median (0: never evict).",
    ),
    loop_breaker: int | None = typer.Option(
        None,
        "--loop-breaker",
        help="Stop the job after N failures without a committed step (0: never).",
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No MTTR summary at the end."),
) -> None:
    """Run a job on this host in the foreground (one launch per host).

    etcd user and password, when etcd has auth on, come from ELASWAVE_ETCD_USER and
    ELASWAVE_ETCD_PASSWORD only.
    """
    from elaswave.config import LAUNCH_FLAGS, load_config
    from elaswave.daemon.etcd import EtcdSecurity
    from elaswave.daemon.launch import launch as run_launch
    from elaswave.faults import FaultSpec
    from elaswave.report import build_report, render_markdown

    try:
        flags = {k: v for k, v in ctx.params.items() if k in LAUNCH_FLAGS}
        overrides: dict[str, Any] = {
            LAUNCH_FLAGS[name]: _flag_value(name, value) for name, value in flags.items()
        }
        if fault:
            try:
                overrides["faults"] = [FaultSpec.parse(f) for f in fault]
            except FaultSpecError as exc:
                raise ConfigError(str(exc)) from None
        cfg = load_config(config, overrides=overrides)
        if cfg.model.source == "module":  # a factory that cannot build: one line, before start
            from elaswave.runtime.workload.load import load_workload

            load_workload(cfg)
        if cfg.etcd:
            from elaswave.daemon.etcd import parse_endpoints

            parse_endpoints(cfg.etcd)
        security = EtcdSecurity.load(cfg.etcd_tls)  # bad files / credentials: fail before start
        start = time.time()
        code = run_launch(cfg, host_addr=host_addr, security=security)
    except ElasWaveError as exc:
        raise _fail(exc) from None
    if code == 0 and not quiet:
        report = build_report(cfg.resolved_run_dir)
        out.print(render_markdown(report), highlight=False)
        out.print(f"run directory: {cfg.resolved_run_dir}  ({time.time() - start:.1f} s)")
    raise typer.Exit(code)


@app.command()
def status(
    job_id: str = typer.Option("elaswave", "--job-id"),
    etcd: str | None = typer.Option(None, "--etcd", help="Default: the job's embedded etcd."),
    etcd_cacert: Path | None = typer.Option(
        None, "--etcd-cacert", help="CA of etcd's server certificate (turns TLS on)."
    ),
    etcd_cert: Path | None = typer.Option(
        None, "--etcd-cert", help="Client certificate for etcd (with --etcd-key)."
    ),
    etcd_key: Path | None = typer.Option(None, "--etcd-key", help="Client key for etcd."),
    as_json: bool = typer.Option(False, "--json"),
    watch: bool = typer.Option(False, "--watch", help="Refresh every second until Ctrl-C."),
) -> None:
    """Membership, ranks, epoch, step, throughput and recent incidents of a running job."""
    from elaswave.cli.jobs import job_status

    while True:
        try:
            tls = _client_tls(etcd_cacert, etcd_cert, etcd_key)
            st = job_status(job_id, etcd, tls=tls)
        except ElasWaveError as exc:
            raise _fail(exc) from None
        if as_json:
            out.print_json(json.dumps(st))
        else:
            _print_status(st)
        if not watch:
            return
        time.sleep(1.0)


def _print_status(st: dict[str, Any]) -> None:
    prog = st["progress"] or {}
    head = (
        f"job [bold]{st['job_id']}[/bold]  epoch {st['epoch']}  world {st['world_size']}  "
        f"leader {st['leader']}  step {prog.get('step', 0)}/{prog.get('total_steps', '?')}  "
        f"loss {prog.get('loss', float('nan')):.4f}  {prog.get('samples_per_s', 0.0):.1f} samples/s"
    )
    if st["done"]:
        head += "  [green]done[/green]"
    out.print(head)
    grid = any("replica" in m for m in st["members"])
    columns = ["rank", "worker", "host", "pid", "micro-batches", "state"]
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
            "[green]alive[/green]" if m["alive"] else "[red]gone[/red]",
        )
    for wid in st["standby"]:
        table.add_row("–", wid, "", "", "0", "standby")
    out.print(table)
    for inc in st["incidents"][-5:]:
        out.print(
            f"  {time.strftime('%H:%M:%S', time.localtime(inc['t']))}  {inc['reason']}",
            highlight=False,
        )


@app.command("inject-fault")
def inject_fault_cmd(
    job_id: str = typer.Option("elaswave", "--job-id"),
    kind: str = typer.Option(
        ...,
        "--kind",
        help="kill (SIGKILL) | hang (SIGSTOP) | corrupt (bit flip) | slow | host (SIGKILL a "
        "host's daemon and workers) | partition (cut a host's links; netns hosts only)",
    ),
    delay: float | None = typer.Option(
        None, "--delay", help="slow: extra compute seconds per step."
    ),
    target: str | None = typer.Option(None, "--target", help="corrupt: params | snapshot"),
    rank: int | None = typer.Option(None, "--rank"),
    host: str | None = typer.Option(None, "--host", help="Target of host and partition faults."),
    at_step: int | None = typer.Option(
        None, "--at-step", help="Fire while this step is in flight."
    ),
    phase: str | None = typer.Option(
        None,
        "--phase",
        help="With --at-step: reduce (default) | optimizer | forward | recovery (as the worker "
        "starts applying a new plan: a fault during recovery).",
    ),
    etcd: str | None = typer.Option(None, "--etcd"),
    etcd_cacert: Path | None = typer.Option(
        None, "--etcd-cacert", help="CA of etcd's server certificate (turns TLS on)."
    ),
    etcd_cert: Path | None = typer.Option(
        None, "--etcd-cert", help="Client certificate for etcd (with --etcd-key)."
    ),
    etcd_key: Path | None = typer.Option(None, "--etcd-key", help="Client key for etcd."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Inject a fault through etcd; the daemon that owns the target carries it out."""
    from elaswave.cli.jobs import inject_fault
    from elaswave.faults import FaultSpec

    try:
        spec = FaultSpec.from_dict(
            {
                k: v
                for k, v in {
                    "kind": kind,
                    "rank": rank,
                    "host": host,
                    "at_step": at_step,
                    "target": target,
                    "delay": delay,
                    "phase": phase,
                }.items()
                if v is not None
            },
            source="fault",
        )
        tls = _client_tls(etcd_cacert, etcd_cert, etcd_key)
        result = inject_fault(job_id, etcd, spec, tls=tls)
    except ElasWaveError as exc:
        raise _fail(exc) from None
    if as_json:
        out.print_json(json.dumps(result))
    else:
        out.print(
            f"fault {spec.describe()} → {result['target']} (epoch {result['epoch']}) submitted"
        )


@app.command("etcd-access")
def etcd_access(
    job_id: str = typer.Option("elaswave", "--job-id"),
    user: str | None = typer.Option(None, "--user", help="Default: the job id."),
) -> None:
    """Print the etcdctl commands that confine a user to one job's keys (run them as root)."""
    import shlex

    from elaswave.config import JobConfig
    from elaswave.keys import confinement_commands

    try:
        JobConfig(job_id=job_id)  # the same job id rules as launch
        if user is not None and not user.strip():
            raise ConfigError("--user must not be empty")
    except ElasWaveError as exc:
        raise _fail(exc) from None
    for cmd in confinement_commands(job_id, user or job_id):
        out.print(shlex.join(cmd), highlight=False, soft_wrap=True)


@app.command()
def report(
    job_id: str | None = typer.Option(None, "--job-id"),
    run_dirs: list[Path] = typer.Option(  # noqa: B006 - typer's way to repeat an option
        [], "--run-dir", help="A run directory; repeat it for each host's of a multi-host job."
    ),
    fmt: str = typer.Option("md", "--format", help="json | csv | md"),
    out_file: Path | None = typer.Option(None, "--out"),
) -> None:
    """MTTR report of a run: one row per incident with its phases, plus run totals."""
    from elaswave.report import build_report, render

    try:
        if fmt not in ("json", "csv", "md"):
            raise ConfigError(f"unknown --format {fmt!r}: use json, csv or md")
        directories = _report_dirs(job_id, run_dirs)
        text = render(build_report(*directories), fmt)
    except ElasWaveError as exc:
        raise _fail(exc) from None
    if out_file:
        out_file.write_text(text)
    else:
        sys.stdout.write(text)


def _flag_value(name: str, value: Any) -> Any:
    """A launch flag's value as its config key takes it (paths as strings, lists from commas)."""
    if isinstance(value, Path):
        return str(value)
    if name == "etcd" and value is not None:
        return [e for e in value.split(",") if e.strip()]
    return value


def _path(p: Path | None) -> str | None:
    return str(p) if p else None


def _client_tls(cacert: Path | None, cert: Path | None, key: Path | None) -> EtcdTLSConfig:
    """The TLS flags of ``status`` / ``inject-fault`` as a validated config section."""
    from elaswave.config import EtcdTLSConfig

    return EtcdTLSConfig(cacert=_path(cacert), cert=_path(cert), key=_path(key))


def _report_dirs(job_id: str | None, run_dirs: list[Path]) -> list[Path]:
    from elaswave.daemon.launch import find_job
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
