"""What the per-host daemon's parts see of it.

The control plane, the fault relay, the worker pool and the job entry each work for one
:class:`~elaswave.daemon.supervisor.HostDaemon`; they are typed against this protocol instead, so
no module of the daemon imports the supervisor back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import asyncio
    from pathlib import Path

    from elaswave.config import JobConfig
    from elaswave.daemon.control_server import ControlServer, WorkerConn
    from elaswave.daemon.etcd import Etcd
    from elaswave.daemon.etcd_server import EmbeddedEtcd
    from elaswave.daemon.jobstore import JobStore
    from elaswave.daemon.leader import Leadership
    from elaswave.daemon.outbox import Outbox
    from elaswave.daemon.records import StepRecords
    from elaswave.daemon.streams import JobStream
    from elaswave.daemon.template import Template
    from elaswave.daemon.workers import WorkerProc
    from elaswave.events import EventLog
    from elaswave.keys import JobKeys
    from elaswave.planning.plan import Plan
    from elaswave.planning.relaunch import Records


class Host(Protocol):
    cfg: JobConfig
    host_id: str
    keys: JobKeys
    etcd: Etcd
    jobstore: JobStore
    events: EventLog
    outbox: Outbox
    control: ControlServer
    run_dir: Path
    embedded: EmbeddedEtcd | None
    plan: Plan | None  # the newest plan this host adopted
    workers: dict[str, WorkerProc]
    template: Template | None  # forks this host's workers (None: executed)
    leadership: Leadership
    stopping: bool
    finished: asyncio.Event  # set once every worker process of this host has exited
    # what joining the job reads and sets (the entry)
    host_addr: str
    earlier: Records | None  # what an earlier run of this job id left in this run directory
    moved: Path | None  # where --fresh moved it
    records: StepRecords
    stream: JobStream | None

    @property
    def lease(self) -> Any: ...  # the host lease its keys live under (a new one after expiry)

    async def new_lease(self) -> Any: ...

    @property
    def conns(self) -> dict[str, WorkerConn]: ...

    @property
    def unrecoverable(self) -> str | None: ...

    @property
    def is_leader(self) -> bool: ...

    @property
    def worker_step(self) -> int: ...

    def host_info(self) -> dict[str, Any]: ...

    def adopt_json(self, value: bytes) -> None: ...
