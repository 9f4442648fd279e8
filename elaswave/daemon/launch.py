"""``elaswave launch``: embedded etcd (if needed) + this host's daemon, in the foreground.

An embedded etcd (no ``--etcd`` given) is supervised by the daemon: restarted at once, on its own
data directory and ports, if it exits.

It writes the job's discovery record (:mod:`elaswave.daemon.discovery`) and removes it when
the launch ends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections.abc import Callable
from pathlib import Path

from elaswave.config import JobConfig, check_packages
from elaswave.config.cluster import preempt_signum
from elaswave.daemon.discovery import discovery_path, find_job
from elaswave.daemon.earlier import archive, run_dir_records
from elaswave.daemon.etcd_connect import EtcdSecurity
from elaswave.daemon.etcd_server import EmbeddedEtcd, ServerTLS, check_port_free
from elaswave.daemon.supervisor import HostDaemon, default_host_id
from elaswave.daemon.template import (
    Template,
    builds_torch_optimizers,
    hf_model_type,
    take_prestarted,
)
from elaswave.daemon.workers import base_environment, device_environment
from elaswave.errors import ElasWaveError, JobNotFound
from elaswave.runtime.durable.layout import resume_point

log = logging.getLogger(__name__)


def launch(
    cfg: JobConfig,
    *,
    host_addr: str | None = None,
    security: EtcdSecurity | None = None,
    on_etcd: Callable[[list[str], EtcdSecurity], Callable[[], None]] | None = None,
) -> int:
    """Run this host's part of the job; ``security`` defaults to ``cfg.etcd_tls`` + environment.
    ``on_etcd(endpoints, security)`` is told where the job's etcd is once it is known (the
    live progress display reads the job from there); what it returns is called when the
    daemon is done, before an embedded etcd stops."""
    check_packages(cfg.logging)  # a stream whose package is missing: one line, nothing started
    if security is None:
        security = EtcdSecurity.load(cfg.etcd_tls)
    if cfg.resume:
        _, refused = resume_point(cfg.resume)
        if refused:
            raise ElasWaveError(refused)
        cfg.resume = str(Path(cfg.resume).resolve())
    run_dir = cfg.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    embedded: EmbeddedEtcd | None = None
    endpoints = list(cfg.etcd)
    disc = discovery_path(cfg.job_id)
    if disc.exists():
        try:
            find_job(cfg.job_id)
        except JobNotFound:
            pass
        else:
            if not endpoints:
                raise ElasWaveError(f"job {cfg.job_id!r} is already running on this machine")
    # What an earlier run of this job id left, read before this run writes anything (or, with
    # --fresh, moved aside): the daemon decides with etcd's records whether to resume.
    earlier = None
    moved = archive(run_dir, cfg.resolved_durable_dir) if cfg.fresh else None
    if not cfg.fresh:
        earlier = run_dir_records(run_dir, cfg.resolved_durable_dir, cfg)
    host_id = cfg.host_id or default_host_id()
    # First of all: the template's imports (seconds) overlap everything below.
    template = start_template(cfg, run_dir / "logs" / f"{host_id}.template.log")
    try:
        if template is None:  # no template to check in: here, before anything starts
            preflight(cfg)
        _log_to(run_dir / "daemon.log")
        if not endpoints:
            if cfg.etcd_port:
                check_port_free(cfg.etcd_port)
            tls = cfg.etcd_tls
            server_tls = None
            if tls.server_cert and tls.server_key and tls.cacert:
                server_tls = ServerTLS(cert=tls.server_cert, key=tls.server_key, ca=tls.cacert)
            embedded = EmbeddedEtcd(client_port=cfg.etcd_port, tls=server_tls).start()
            endpoints = [embedded.endpoint]
        daemon = HostDaemon(
            cfg,
            etcd_endpoints=endpoints,
            host_addr=host_addr,
            embedded=embedded,
            security=security,
            template=template,
            earlier=earlier,
            moved=moved,
        )
        owns_record = not disc.exists()
        if owns_record:
            # Written whole or not at all: launches of other hosts that share this state
            # directory (a home on a shared filesystem) may read it at any moment.
            disc.parent.mkdir(parents=True, exist_ok=True)
            tmp = disc.with_name(f".{disc.name}.{os.getpid()}.tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "job_id": cfg.job_id,
                        "etcd": endpoints,
                        "run_dir": str(run_dir.resolve()),
                        "pid": os.getpid(),
                        "host_id": daemon.host_id,
                        # paths only (never credentials): status/inject-fault reuse them
                        "etcd_tls": tls_paths(cfg),
                    }
                )
            )
            os.replace(tmp, disc)
        detach = on_etcd(endpoints, security) if on_etcd is not None else None
        try:
            return asyncio.run(_run(daemon))
        finally:
            if detach is not None:
                detach()
            if owns_record:
                disc.unlink(missing_ok=True)
    finally:
        if template is not None and template.proc.poll() is None:  # the daemon never ran
            template.proc.kill()
            template.proc.wait()
        if embedded is not None:
            embedded.stop()


def start_template(cfg: JobConfig, log_path: Path) -> Template | None:
    """This host's worker template (the one the command line started first of all, else a new
    one), set up for the job; None if workers are to be executed (``worker_start: exec``, or no
    template on this platform)."""
    template = take_prestarted()
    if cfg.elastic.worker_start != "template":
        if template is not None:
            template.proc.kill()
            template.proc.wait()
            template.log_path.unlink(missing_ok=True)
        return None
    if template is None:
        template = Template.start(env=base_environment(), log_path=log_path)
    if template is not None:
        template.configure(
            model_source=cfg.model.source, log_path=log_path,
            device_env=device_environment(cfg.train.device), zero=cfg.zero,
            model_type=hf_model_type(cfg.model.hf, cfg.model.pretrained),
            torch_optim=builds_torch_optimizers(
                script=cfg.script is not None, optimizer=cfg.train.optimizer,
                lr_schedule=cfg.train.lr_schedule,
            ),
        )  # fmt: skip
    return template


def preflight(cfg: JobConfig) -> None:
    """The model builds and its data fits, checked in this process (imports torch: only
    without a template, which checks it in its own)."""
    from elaswave.runtime.workload.load import check_data, load_workload

    if cfg.script is None:  # a script builds its model itself
        check_data(cfg, load_workload(cfg))


def tls_paths(cfg: JobConfig) -> dict[str, str]:
    """The client TLS files of a job as absolute paths (for its discovery record)."""
    tls = cfg.etcd_tls
    named = {"cacert": tls.cacert, "cert": tls.cert, "key": tls.key}
    return {k: str(Path(v).resolve()) for k, v in named.items() if v}


async def _run(daemon: HostDaemon) -> int:
    loop = asyncio.get_running_loop()
    preempt = preempt_signum(daemon.cfg.elastic.preempt_signal)
    for sig in {signal.SIGINT, signal.SIGTERM} - {preempt}:
        loop.add_signal_handler(sig, daemon.request_stop, sig)
    if preempt is not None:
        loop.add_signal_handler(preempt, daemon.request_preempt, preempt)
    return await daemon.run()


class _DaemonLog(logging.FileHandler):
    """``daemon.log``. A write that fails (a full disk) is dropped: the daemon already told the
    user about the run directory in one line; a traceback per log line would bury it."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass


def _log_to(path: Path) -> None:
    """Everything the daemon and its libraries log goes to ``daemon.log``, never the terminal."""
    root = logging.getLogger()
    if any(
        isinstance(h, logging.FileHandler) and h.baseFilename == str(path.resolve())
        for h in root.handlers
    ):
        return
    handler = _DaemonLog(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    logging.getLogger("elaswave").setLevel(logging.INFO)
