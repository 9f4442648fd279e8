"""``elaswave launch``: run a job on this host in the foreground (one launch per host), the
config's training loop or a script's own (``--script train.py -- ARGS``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from elaswave.cli.common import EtcdCacert, EtcdCert, EtcdKey, fail, out
from elaswave.errors import ConfigError, ElasWaveError, FaultSpecError

if TYPE_CHECKING:
    from elaswave.config import JobConfig
    from elaswave.daemon.etcd_connect import EtcdSecurity

SCRIPT_ARGS: list[str] = []  # the arguments after "--": the script's own (app.main fills it)


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
_Spares = Annotated[
    int | None,
    typer.Option(
        "--spares",
        help="Warm spares per host: built ahead, they take a lost rank's place instead of a "
        "respawn (within --max-restarts).",
    ),
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
_ReplayEvery = Annotated[
    int | None,
    typer.Option(
        "--replay-every",
        help="Recompute one micro-batch of each rank on a peer every K steps and compare the "
        "gradients (0: never).",
    ),
]
_HangTimeout = Annotated[
    str | None,
    typer.Option(
        "--hang-timeout",
        help="Seconds without progress before a worker counts as hung, or auto (default): "
        "from the job's own phase times.",
    ),
]
_PreemptSignal = Annotated[
    str | None,
    typer.Option(
        "--preempt-signal",
        help="The signal that preempts the job: checkpoint the newest step, exit 75 (default "
        "TERM; none: the signal stops this host only).",
    ),
]
_PreemptGrace = Annotated[
    float | None,
    typer.Option("--preempt-grace", help="Seconds a preempted launch waits for its checkpoint."),
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
    etcd_cacert: EtcdCacert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
    etcd_server_cert: _EtcdServerCert = None,
    etcd_server_key: _EtcdServerKey = None,
    job_id: _JobId = None,
    run_dir: _RunDir = None,
    steps: _Steps = None,
    global_batch: _GlobalBatch = None,
    micro_batch_size: _MicroBatchSize = None,
    max_restarts: _MaxRestarts = None,
    spares: _Spares = None,
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
    replay_every: _ReplayEvery = None,
    hang_timeout: _HangTimeout = None,
    preempt_signal: _PreemptSignal = None,
    preempt_grace: _PreemptGrace = None,
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
        cfg = _placed(config, _launch_overrides(ctx.params, fault, SCRIPT_ARGS))
        cfg = _tokenized(cfg, quiet=quiet)
        security = _preflight(cfg)
        start = time.time()
        if not quiet:
            if not progress_every > 0:
                raise ConfigError(f"--progress-every must be > 0, got {progress_every}")
            prune = cfg.train.prune
            view = LiveProgress(
                cfg.job_id, cfg.train.steps, cfg.resolved_run_dir, out,
                interactive=out.is_terminal, every=progress_every,
                target=prune.target_sparsity if prune is not None else None,
            )  # fmt: skip
        code = run_launch(
            cfg, host_addr=host_addr, security=security,
            on_etcd=view.attach if view is not None else None,
        )  # fmt: skip
    except ElasWaveError as exc:
        raise fail(exc) from None
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
    from elaswave.daemon.etcd_connect import EtcdSecurity
    from elaswave.data.checks import check_before_start

    check_packages(cfg.logging)  # logging.tensorboard / wandb: the extra to install
    check_before_start(cfg)
    if cfg.etcd:
        from elaswave.daemon.etcd_connect import parse_endpoints

        parse_endpoints(cfg.etcd)
    return EtcdSecurity.load(cfg.etcd_tls)  # bad files / credentials: fail before start


def _print_summary(cfg: JobConfig, start: float) -> None:
    """The MTTR report of the finished run, its directory and how long it ran since ``start``."""
    from elaswave.report import build_report
    from elaswave.report_text import render_markdown

    report = build_report(cfg.resolved_run_dir)
    out.print(render_markdown(report), highlight=False)
    out.print(f"run directory: {cfg.resolved_run_dir}  ({time.time() - start:.1f} s)")


def _flag_value(name: str, value: Any) -> Any:
    """A launch flag's value as its config key takes it (paths as strings, lists from commas)."""
    if isinstance(value, Path):
        return str(value)
    if name == "etcd" and value is not None:
        return [e for e in value.split(",") if e.strip()]
    return value
