"""``elaswave inject-fault``: inject a fault through etcd; the daemon that owns the target carries
it out.
"""

from __future__ import annotations

import json

import typer

from elaswave.cli.common import EtcdCacert, EtcdCert, EtcdKey, client_tls, fail, out
from elaswave.errors import ElasWaveError


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
    target: str | None = typer.Option(None, "--target", help="corrupt: params | snapshot | grad"),
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
    etcd_cacert: EtcdCacert = None,
    etcd_cert: EtcdCert = None,
    etcd_key: EtcdKey = None,
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
        tls = client_tls(etcd_cacert, etcd_cert, etcd_key)
        result = inject_fault(job_id, etcd, spec, tls=tls)
    except ElasWaveError as exc:
        raise fail(exc) from None
    if as_json:
        out.print_json(json.dumps(result))
    else:
        out.print(
            f"fault {spec.describe()} → {result['target']} (epoch {result['epoch']}) submitted"
        )
