"""This host's rendezvous store as the daemon sees it: a process of its own
(:mod:`elaswave.runtime.storeserver`), so that the daemon never imports torch.

Forked from the worker template where there is one (it has torch imported), else executed. It
reports the port it bound; the daemon writes ``address`` into every plan it makes as leader,
watches the process (its death ends this host's part of the job, as the daemon's own death
would) and stops it after the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from elaswave.daemon.aio import wait_for
from elaswave.daemon.template import Adopted, Template, TemplateGone
from elaswave.errors import ElasWaveError

log = logging.getLogger(__name__)


@dataclass
class StoreProcess:
    proc: asyncio.subprocess.Process | Adopted
    address: str  # host:port, as plans carry it

    @property
    def pid(self) -> int:
        return self.proc.pid

    @classmethod
    async def start(
        cls, host: str, log_path: Path, *, template: Template | None, timeout: float
    ) -> StoreProcess:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["--host", host]
        if template is not None and template.alive:
            try:
                proc, answer = await template.spawn("store", argv, log_path, timeout=timeout)
                return cls(proc, f"{host}:{int(answer['port'])}")
            except TemplateGone as exc:
                log.warning("%s; executing the store instead", exc)
        with open(log_path, "ab") as logf:
            executed = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "elaswave.runtime.storeserver", *argv, "--report-fd", "1",
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=logf,
            )  # fmt: skip
        assert executed.stdout is not None
        try:
            line = await wait_for(executed.stdout.readline(), timeout)
        except asyncio.TimeoutError:
            line = b""
        if not line.strip().isdigit():
            with contextlib.suppress(ProcessLookupError):
                executed.kill()
            await executed.wait()
            raise ElasWaveError(f"the rendezvous store did not start (see {log_path})")
        return cls(executed, f"{host}:{int(line)}")

    async def stop(self, grace: float) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds; an exited store is fine."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            await wait_for(self.proc.wait(), grace)
        except asyncio.TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
