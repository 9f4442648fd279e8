"""The ``elaswave`` command line: thin commands over library functions.

Errors a user can cause print one line on stderr and exit non-zero; ``--json`` sits next to every
table.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from elaswave.cli import doctor as doctor_cli
from elaswave.errors import ConfigError, ElasWaveError, FaultSpecError, JobComplete, JobStopped

if TYPE_CHECKING:
    from elaswave.config import EtcdTLSConfig, JobConfig
    from elaswave.daemon.etcd import EtcdSecurity

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
    if isinstance(exc, JobStopped | JobComplete):  # a verdict, not a usage error: "elaswave: …"
        err.print(f"elaswave: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return typer.Exit(exc.exit_code)
    err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(exc.exit_code)


# ``launch``'s argument and options, one ``Annotated`` alias each (typer reads the option from
# the parameter's annotation; the default stays in the signature). The config key each option
# sets is in config.LAUNCH_FLAGS.
_Config = Annotated[
    Path | None, typer.Argument(help="Job config YAML (defaults apply without one).")
]
_NprocPerNode = Annotated[
    int | None,
    typer.Option(
        "--nproc-per-node",
        help="Workers on this host (default: --workers-per-device per accelerator, else 4).",
    ),
]
_Device = Annotated[
    str | None,
    typer.Option("--device", help="auto | cpu | cuda | npu (auto: an accelerator if present)."),
]
_WorkersPerDevice = Annotated[
    int | None,
    typer.Option(
        "--workers-per-device",
        help="Workers sharing one accelerator (default 1; more: gloo through host memory).",
    ),
]
_Nnodes = Annotated[str | None, typer.Option("--nnodes", help="Hosts: N or MIN:MAX.")]
_Etcd = Annotated[
    str | None, typer.Option("--etcd", help="host:port[,host:port]; default: embedded etcd.")
]
_EtcdPort = Annotated[
    int | None, typer.Option("--etcd-port", help="Client port of the embedded etcd.")
]
_EtcdCacert = Annotated[
    Path | None,
    typer.Option("--etcd-cacert", help="CA of etcd's server certificate (turns TLS on)."),
]
_EtcdCert = Annotated[
    Path | None,
    typer.Option("--etcd-cert", help="Client certificate for etcd (with --etcd-key)."),
]
_EtcdKey = Annotated[Path | None, typer.Option("--etcd-key", help="Client key for etcd.")]
_EtcdServerCert = Annotated[
    Path | None,
    typer.Option("--etcd-server-cert", help="Embedded etcd: serve TLS with this certificate."),
]
_EtcdServerKey = Annotated[
    Path | None,
    typer.Option("--etcd-server-key", help="Embedded etcd: key of --etcd-server-cert."),
]
_JobId = Annotated[str | None, typer.Option("--job-id")]
_RunDir = Annotated[Path | None, typer.Option("--run-dir", help="Default runs/<job-id>.")]
_Steps = Annotated[int | None, typer.Option("--steps")]
_GlobalBatch = Annotated[
    int | None, typer.Option("--global-batch", help="Samples per step, whatever the world size.")
]
_MicroBatchSize = Annotated[int | None, typer.Option("--micro-batch-size")]
_Script = Annotated[
    Path | None,
    typer.Option(
        "--script",
        help="Run this Python file's own training loop in every worker (elaswave.init()); "
        "its arguments follow --.",
    ),
]
_MaxRestarts = Annotated[
    int | None, typer.Option("--max-restarts", help="Respawns of crashed workers.")
]
_Fault = Annotated[
    list[str], typer.Option("--fault", help="e.g. kill,rank=1,at_step=15 (repeatable).")
]
_HostId = Annotated[str | None, typer.Option("--host-id")]
_HostAddr = Annotated[
    str | None, typer.Option("--host-addr", help="Address peers reach this host on.")
]
_Rack = Annotated[
    str | None,
    typer.Option(
        "--rack",
        help="This host's tier above hosts (a rack, a switch): ranks are laid out rack by rack, "
        "and copies kept for a rank go to another rack where the job spans two.",
    ),
]
_Zero = Annotated[
    int | None,
    typer.Option(
        "--zero",
        help="1: ZeRO-1 sharded optimizer state (with --pp: inside each stage); "
        "3: ZeRO-3, parameters, gradients and optimizer state sharded (no --pp yet).",
    ),
]
_Pp = Annotated[int | None, typer.Option("--pp", help="Pipeline stages per replica.")]
_Dp = Annotated[int | None, typer.Option("--dp", help="Data-parallel replicas (default world/pp).")]
_Migration = Annotated[
    str | None,
    typer.Option("--migration", help="Pipelines: move a lost stage's layers async | blocking."),
]
_StageLoss = Annotated[
    str | None,
    typer.Option(
        "--stage-loss",
        help="Pipelines: reshard the replica | drop it | recycle its lost stages' "
        "micro-batches onto the other replicas (the last two: baselines).",
    ),
]
_Dvfs = Annotated[
    str | None,
    typer.Option("--dvfs", help="Pipelines: frequency actuator off | sim | nvml | npu."),
]
_DurableEvery = Annotated[
    int | None,
    typer.Option("--durable-every", help="Durable checkpoint every N steps (0: never)."),
]
_DurableDir = Annotated[
    Path | None, typer.Option("--durable-dir", help="Default RUN_DIR/checkpoints.")
]
_Resume = Annotated[
    Path | None,
    typer.Option("--resume", help="Start from the newest durable checkpoint in this directory."),
]
_Fresh = Annotated[
    bool | None,
    typer.Option(
        "--fresh",
        help="Train this job id from step 0 again: an earlier run's records and checkpoints "
        "move to RUN_DIR/previous/.",
    ),
]
_SnapshotEvery = Annotated[
    int | None,
    typer.Option("--snapshot-every", help="ZeRO replicas every K steps (1: every step, 0: none)."),
]
_VerifyEvery = Annotated[
    int | None,
    typer.Option("--verify-every", help="Compare replicas' checksums every K steps (0: never)."),
]
_HangTimeout = Annotated[
    float | None,
    typer.Option("--hang-timeout", help="Seconds without progress before a worker counts as hung."),
]
_StragglerThreshold = Annotated[
    float | None,
    typer.Option(
        "--straggler-threshold",
        help="Evict a rank this many times slower than the median (0: never evict).",
    ),
]
_LoopBreaker = Annotated[
    int | None,
    typer.Option(
        "--loop-breaker",
        help="Stop the job after N failures without a committed step (0: never).",
    ),
]
_Quiet = Annotated[
    bool, typer.Option("--quiet", help="No live progress, no MTTR summary at the end.")
]
_MetricsPort = Annotated[
    int | None,
    typer.Option("--metrics-port", help="Serve Prometheus /metrics here (0: a free port)."),
]
_Tensorboard = Annotated[
    Path | None,
    typer.Option(
        "--tensorboard", help="Write the job's TensorBoard event stream under DIR/<job-id>."
    ),
]
_ProgressEvery = Annotated[
    float,
    typer.Option("--progress-every", help="Not on a terminal: a progress line every N seconds."),
]


@app.command()
def launch(
    ctx: typer.Context,
    config: _Config = None,
    script: _Script = None,
    nproc_per_node: _NprocPerNode = None,
    device: _Device = None,
    workers_per_device: _WorkersPerDevice = None,
    nnodes: _Nnodes = None,
    etcd: _Etcd = None,
    etcd_port: _EtcdPort = None,
    etcd_cacert: _EtcdCacert = None,
    etcd_cert: _EtcdCert = None,
    etcd_key: _EtcdKey = None,
    etcd_server_cert: _EtcdServerCert = None,
    etcd_server_key: _EtcdServerKey = None,
    job_id: _JobId = None,
    run_dir: _RunDir = None,
    steps: _Steps = None,
    global_batch: _GlobalBatch = None,
    micro_batch_size: _MicroBatchSize = None,
    max_restarts: _MaxRestarts = None,
    fault: _Fault = [],  # noqa: B006 - typer's way to repeat an option
    host_id: _HostId = None,
    host_addr: _HostAddr = None,
    rack: _Rack = None,
    zero: _Zero = None,
    pp: _Pp = None,
    dp: _Dp = None,
    migration: _Migration = None,
    stage_loss: _StageLoss = None,
    dvfs: _Dvfs = None,
    durable_every: _DurableEvery = None,
    durable_dir: _DurableDir = None,
    resume: _Resume = None,
    fresh: _Fresh = None,
    snapshot_every: _SnapshotEvery = None,
    verify_every: _VerifyEvery = None,
    hang_timeout: _HangTimeout = None,
    straggler_threshold: _StragglerThreshold = None,
    loop_breaker: _LoopBreaker = None,
    metrics_port: _MetricsPort = None,
    tensorboard: _Tensorboard = None,
    quiet: _Quiet = False,
    progress_every: _ProgressEvery = 10.0,
) -> None:
    """Run a job on this host in the foreground (one launch per host): the config's, or a
    script's own loop (--script train.py -- ARGS).

    etcd user and password, when etcd has auth on, come from ELASWAVE_ETCD_USER and
    ELASWAVE_ETCD_PASSWORD only.
    """
    from elaswave.cli.progress import LiveProgress
    from elaswave.daemon.launch import launch as run_launch

    view, code = None, None
    try:
        cfg = _placed(config, _launch_overrides(ctx.params, fault, _SCRIPT_ARGS))
        cfg = _tokenized(cfg, quiet=quiet)
        security = _preflight(cfg)
        start = time.time()
        if not quiet:
            if not progress_every > 0:
                raise ConfigError(f"--progress-every must be > 0, got {progress_every}")
            view = LiveProgress(
                cfg.job_id, cfg.train.steps, cfg.resolved_run_dir, out,
                interactive=out.is_terminal, every=progress_every,
            )  # fmt: skip
        code = run_launch(
            cfg, host_addr=host_addr, security=security,
            on_etcd=view.attach if view is not None else None,
        )  # fmt: skip
    except ElasWaveError as exc:
        raise _fail(exc) from None
    finally:
        if view is not None:
            view.stop(code)
    if code == 0 and not quiet:
        _print_summary(cfg, start)
    raise typer.Exit(code)


def _launch_overrides(
    params: dict[str, Any],
    faults: list[str],
    extra: Sequence[str] = (),
) -> dict[str, Any]:
    """The config overrides of ``launch``'s flags (``params``: every flag, set or not), its
    ``--fault`` specs and the script's arguments (``extra``: what follows ``--``); a bad fault
    spec, a script that is no file or arguments without a script is a ConfigError."""
    from elaswave.config import LAUNCH_FLAGS
    from elaswave.faults import FaultSpec

    flags = {k: v for k, v in params.items() if k in LAUNCH_FLAGS}
    overrides: dict[str, Any] = {
        LAUNCH_FLAGS[name]: _flag_value(name, value) for name, value in flags.items()
    }
    script = params.get("script")
    if script is not None:
        if not Path(script).is_file():
            raise ConfigError(f"--script {script}: no such file")
        overrides["script"] = str(Path(script).resolve())  # workers may start elsewhere
    if extra:
        if script is None:
            raise ConfigError(
                f"arguments after --: {' '.join(extra)!r} are a script's (--script FILE)"
            )
        overrides["script_args"] = list(extra)
    if faults:
        try:
            overrides["faults"] = [FaultSpec.parse(f) for f in faults]
        except FaultSpecError as exc:
            raise ConfigError(str(exc)) from None
    return overrides


def _placed(config: Path | None, overrides: dict[str, Any]) -> JobConfig:
    """The job's config with ``train.device`` resolved on this host (auto: an accelerator if
    present) and its workers per host: ``elastic.workers_per_device`` per device unless given,
    never more."""
    from elaswave.config import JobConfig, config_values
    from elaswave.runtime.device import place, probe_for, workers_per_host

    values = config_values(config, overrides=overrides)
    cfg = JobConfig.from_dict(values)
    placement = place(cfg.train.device, probe_for(cfg.train.device))
    given = "nproc_per_node" in values.get("elastic", {})
    nproc = workers_per_host(
        placement, cfg.elastic.nproc_per_node if given else None,
        cpu_default=cfg.elastic.nproc_per_node, per_device=cfg.elastic.workers_per_device,
    )  # fmt: skip
    values.setdefault("train", {})["device"] = placement.kind
    values.setdefault("elastic", {})["nproc_per_node"] = nproc
    return JobConfig.from_dict(values)


def _tokenized(cfg: JobConfig, *, quiet: bool) -> JobConfig:
    """``data.source: text``: the files tokenized once into the shared cache (or found there),
    the config naming that token file (what the workers read). A progress bar on a terminal,
    plain lines elsewhere, nothing with ``--quiet``. Other sources: ``cfg`` as it is."""
    if cfg.data.source != "text":
        return cfg
    from elaswave.cli.tokenizing import TokenizingView
    from elaswave.data.text import resolve_text

    view = None if quiet else TokenizingView(out, interactive=out.is_terminal)
    return resolve_text(cfg, progress=view)


def _preflight(cfg: JobConfig) -> EtcdSecurity:
    """Check before the job starts what would otherwise fail in it, each as one error line: a
    token file it cannot train on (too short, token ids past the vocabulary the config states),
    malformed etcd endpoints, bad TLS files or credentials, a stream whose package is not
    installed. Returns the etcd security the job runs with. What needs the model built (a
    factory, an HF config or directory, its vocabulary) is checked by ``launch`` where torch
    is imported: in the worker template, before any worker starts."""
    from elaswave.config import check_packages
    from elaswave.daemon.etcd import EtcdSecurity
    from elaswave.data.checks import check_before_start

    check_packages(cfg.logging)  # logging.tensorboard / wandb: the extra to install
    check_before_start(cfg)
    if cfg.etcd:
        from elaswave.daemon.etcd import parse_endpoints

        parse_endpoints(cfg.etcd)
    return EtcdSecurity.load(cfg.etcd_tls)  # bad files / credentials: fail before start


def _print_summary(cfg: JobConfig, start: float) -> None:
    """The MTTR report of the finished run, its directory and how long it ran since ``start``."""
    from elaswave.report import build_report, render_markdown

    report = build_report(cfg.resolved_run_dir)
    out.print(render_markdown(report), highlight=False)
    out.print(f"run directory: {cfg.resolved_run_dir}  ({time.time() - start:.1f} s)")


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
    watch: bool = typer.Option(
        False, "--watch", help="Refresh in place every second until the job ends or Ctrl-C."
    ),
) -> None:
    """Membership, ranks, epoch, step, throughput and recent incidents of a running job."""
    from elaswave.cli.jobs import job_status

    try:
        if watch and as_json:
            raise ConfigError("--watch and --json do not go together: --json is one document")
        tls = _client_tls(etcd_cacert, etcd_cert, etcd_key)
        st = job_status(job_id, etcd, tls=tls)
    except ElasWaveError as exc:
        raise _fail(exc) from None
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
                        raise _fail(exc) from None
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
    return Group(head, table, *lines)


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
    fmt: str = typer.Option("md", "--format", help="json | csv | md | html"),
    out_file: Path | None = typer.Option(None, "--out"),
    baseline: list[Path] = typer.Option(  # noqa: B006 - typer's way to repeat an option
        [], "--baseline", help="html: a fault-free run's directory to overlay (repeatable)."
    ),
) -> None:
    """MTTR report of a run: one row per incident with its phases, plus run totals; html adds
    the plots (phases, loss with the faults marked, throughput, world size) in one file."""
    from elaswave.report import build_report, render

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
        raise _fail(exc) from None
    if out_file:
        out_file.write_text(text)
    else:
        sys.stdout.write(text)


@app.command()
def export(
    run_dir: Path = typer.Option(..., "--run-dir", help="The run's directory."),
    out_path: Path = typer.Option(
        ..., "--out", help="HF models: a directory; others: a .safetensors file."
    ),
    step: int | None = typer.Option(None, "--step", help="A checkpointed step; default: newest."),
    compress: bool = typer.Option(
        False, "--compress", help="A pruned run (train.prune): write the smaller model."
    ),
    pad: bool = typer.Option(
        False,
        "--pad",
        help="With --compress, HF models: every layer as wide as the widest, so that "
        "from_pretrained loads it (always so after train.prune.uniform; otherwise layers of "
        "different widths load with elaswave.prune.load.load_compressed).",
    ),
) -> None:
    """Write a run's trained model: for model.source hf a directory that
    AutoModelForCausalLM.from_pretrained loads, otherwise one safetensors file."""
    from elaswave.export import export_model

    try:
        done = export_model(run_dir, out_path, step, compress=compress, pad=pad)
    except ElasWaveError as exc:
        raise _fail(exc) from None
    if done.skipped:
        out.print(f"skipped newer checkpoints that failed their check: {done.skipped}",
                  highlight=False, soft_wrap=True)  # fmt: skip
    out.print(
        f"exported step {done.step} (loss {done.loss:.4f}) from {done.checkpoint} to {done.out}",
        highlight=False,
        soft_wrap=True,
    )
    if done.sizes is not None and done.flops is not None:
        (before, after), (f0, f1) = done.sizes, done.flops
        out.print(
            f"compressed: {after:,} parameters of {before:,} ({after / before:.1%}); "
            f"{f1:,} matrix FLOPs per sample or token of {f0:,} ({f1 / f0:.1%})",
            highlight=False,
            soft_wrap=True,
        )
    if done.latency and done.latency_input and done.latency_runs:
        (l0, l1), shape = done.latency, "×".join(map(str, done.latency_input))
        n = min(done.latency_runs)
        out.print(
            f"CPU latency (one thread, a {shape} micro-batch, median of {n}): "
            f"{l1 * 1e3:.2f} ms of {l0 * 1e3:.2f} ms ({l1 / l0:.2f}×)",
            highlight=False,
            soft_wrap=True,
        )


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


doctor_cli.register(app)  # ``elaswave doctor`` and ``elaswave --version``


_SCRIPT_ARGS: list[str] = []  # launch's arguments after "--": the script's own


def main() -> None:
    """The command line; ``launch ... -- ARGS`` gives ARGS to the script whole (the flags and
    the config file before ``--`` are launch's)."""
    argv = sys.argv[1:]
    if argv[:1] == ["launch"] and "--" in argv:
        cut = argv.index("--")
        _SCRIPT_ARGS[:] = argv[cut + 1 :]
        argv = argv[:cut]
    app(args=argv)


if __name__ == "__main__":
    main()
