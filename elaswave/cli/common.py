"""What several ``elaswave`` commands share: the two consoles, the one error line a user's mistake
becomes, and the etcd TLS flags as a config section.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from elaswave.errors import ElasWaveError, HostDrained, JobComplete, JobStopped

if TYPE_CHECKING:
    from elaswave.config import EtcdTLSConfig

# The etcd client's TLS flags, the same on every command that talks to etcd.
EtcdCacert = Annotated[
    Path | None,
    typer.Option("--etcd-cacert", help="CA of etcd's server certificate (turns TLS on)."),
]
EtcdCert = Annotated[
    Path | None,
    typer.Option("--etcd-cert", help="Client certificate for etcd (with --etcd-key)."),
]
EtcdKey = Annotated[Path | None, typer.Option("--etcd-key", help="Client key for etcd.")]

out = Console()
err = Console(stderr=True)


def fail(exc: ElasWaveError) -> typer.Exit:
    """``exc`` as one line on stderr, and the exit that carries its code (raise it)."""
    if isinstance(exc, JobStopped | JobComplete | HostDrained):  # a verdict: "elaswave: …"
        err.print(f"elaswave: {escape(str(exc))}", highlight=False, soft_wrap=True)
        return typer.Exit(exc.exit_code)
    err.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
    return typer.Exit(exc.exit_code)


def _path(p: Path | None) -> str | None:
    return str(p) if p else None


def client_tls(cacert: Path | None, cert: Path | None, key: Path | None) -> EtcdTLSConfig:
    """The TLS flags of ``status`` / ``inject-fault`` as a validated config section."""
    from elaswave.config import EtcdTLSConfig

    return EtcdTLSConfig(cacert=_path(cacert), cert=_path(cert), key=_path(key))
