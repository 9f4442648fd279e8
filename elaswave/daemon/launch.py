"""``elaswave launch``: embedded etcd (if needed) + this host's daemon, in the foreground.

A host fenced for losing its etcd lease (a partition) stops its workers; ``launch`` then waits for
etcd to answer again and rejoins as a new member: new lease, new worker ids, admitted by a plan.

A discovery file ``<state dir>/jobs/<job_id>.json`` lets ``status``, ``inject-fault`` and ``report``
find a job on this machine by its id alone; it is removed when the launch ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from elaswave.config import JobConfig, state_dir
from elaswave.daemon.etcd import Etcd, EtcdSecurity
from elaswave.daemon.etcd_server import EmbeddedEtcd, ServerTLS, check_port_free
from elaswave.daemon.supervisor import HostDaemon
from elaswave.errors import ElasWaveError, EtcdUnavailable, HostFenced, JobNotFound

log = logging.getLogger(__name__)


def discovery_path(job_id: str) -> Path:
    return state_dir() / "jobs" / f"{job_id}.json"


def find_job(job_id: str) -> dict:
    """The discovery record of a job launched on this machine, if its launcher is alive."""
    path = discovery_path(job_id)
    if not path.exists():
        raise JobNotFound(
            f"no running job {job_id!r} on this machine (give --etcd to look elsewhere)"
        )
    record = json.loads(path.read_text())
    try:
        os.kill(int(record["pid"]), 0)
    except (ProcessLookupError, ValueError):
        path.unlink(missing_ok=True)
        raise JobNotFound(f"job {job_id!r} is no longer running (stale record removed)") from None
    except PermissionError:
        pass
    return record


def launch(
    cfg: JobConfig, *, host_addr: str | None = None, security: EtcdSecurity | None = None
) -> int:
    """Run this host's part of the job; ``security`` defaults to ``cfg.etcd_tls`` + environment."""
    if security is None:
        security = EtcdSecurity.load(cfg.etcd_tls)
    if cfg.resume:
        from elaswave.runtime.durable import latest

        if latest(cfg.resume) is None:
            raise ElasWaveError(f"--resume: no complete durable checkpoint in {cfg.resume}")
        cfg.resume = str(Path(cfg.resume).resolve())
    run_dir = cfg.resolved_run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    _log_to(run_dir / "daemon.log")
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
    try:
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
            embedded_etcd_pid=embedded.proc.pid if embedded and embedded.proc else None,
            security=security,
        )
        owns_record = not disc.exists()
        if owns_record:
            disc.parent.mkdir(parents=True, exist_ok=True)
            disc.write_text(
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
        try:
            while True:
                try:
                    return asyncio.run(_run(daemon))
                except HostFenced as exc:
                    log.warning("%s; rejoining once etcd answers", exc)
                    asyncio.run(
                        _await_etcd(
                            endpoints,
                            cfg.timeouts.rendezvous,
                            exc,
                            daemon.lease,
                            prefix=daemon.keys.prefix,
                            security=security,
                        )  # fmt: skip
                    )
                    daemon = HostDaemon(
                        cfg,
                        etcd_endpoints=endpoints,
                        host_addr=daemon.host_addr,
                        first_incarnation=daemon.next_incarnation,
                        security=security,
                    )
        finally:
            if owns_record:
                disc.unlink(missing_ok=True)
    finally:
        if embedded is not None:
            embedded.stop()


def tls_paths(cfg: JobConfig) -> dict[str, str]:
    """The client TLS files of a job as absolute paths (for its discovery record)."""
    tls = cfg.etcd_tls
    named = {"cacert": tls.cacert, "cert": tls.cert, "key": tls.key}
    return {k: str(Path(v).resolve()) for k, v in named.items() if v}


async def _await_etcd(
    endpoints: list[str],
    timeout: float,
    fenced: HostFenced,
    old_lease: Any,
    *,
    prefix: str,
    security: EtcdSecurity,
) -> None:
    """Wait until etcd answers again (a healed partition), or give up with the fencing error.

    The old lease is revoked first, if etcd has not dropped it already: whatever this host held
    (host, worker and leader keys) must be gone before it registers again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            db = await Etcd.connect(
                endpoints, prefix=prefix, timeout=min(2.0, timeout), security=security
            )
        except EtcdUnavailable:
            await asyncio.sleep(0.5)
            continue
        if old_lease is not None:
            with contextlib.suppress(EtcdUnavailable):
                await db.revoke_lease(old_lease)
        await db.close()
        return
    raise fenced


async def _run(daemon: HostDaemon) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, daemon.request_stop, sig)
    return await daemon.run()


def _log_to(path: Path) -> None:
    root = logging.getLogger("elaswave")
    if any(
        isinstance(h, logging.FileHandler) and h.baseFilename == str(path.resolve())
        for h in root.handlers
    ):
        return
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
