"""``elaswave etcd-access``: print the etcdctl commands that confine a user to one job's keys (run
them as root).
"""

from __future__ import annotations

import typer

from elaswave.cli.common import fail, out
from elaswave.errors import ConfigError, ElasWaveError


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
        raise fail(exc) from None
    for cmd in confinement_commands(job_id, user or job_id):
        out.print(shlex.join(cmd), highlight=False, soft_wrap=True)
