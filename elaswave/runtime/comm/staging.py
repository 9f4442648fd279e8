"""Gloo on an accelerator's tensors, through host memory: several workers sharing one device.

NCCL refuses two ranks of a communicator on one device, and gloo runs only broadcast and
all-reduce on CUDA tensors (no send/recv, all-gather or reduce-scatter). So workers that share
an accelerator (``elastic.workers_per_device > 1``) build gloo groups, and every operation on
them runs on host copies of its tensors: :class:`StagedGroup` wraps a gloo process group and
offers the operations the communicator calls on a group (same names, same arguments).

Each operation copies its input tensors to fresh, contiguous host buffers (a synchronous copy:
it waits for the device's stream, so what the step computed is what is sent), allocates host
buffers for its outputs, and starts the gloo operation on those. The :class:`StagedWork` it
returns copies the host results back into the caller's tensors (in place: views of a flat
buffer stay views) when its ``wait()`` returns, once: a collective in the communicator's
interruptible wait, posted point-to-point work in whichever thread waits for it (the p2p helper
thread, a migration's background wait). A failed operation copies nothing back; an interrupted
one only if it is waited for again and completes (a kept group's unfinished collectives, a
helper thread left waiting), as gloo would write late into a CPU tensor. Sends copy nothing
back; a send's payload is the value at the time it was posted.

The communicator's waits, keep/rebuild agreement and parking are those of gloo (the group is a
gloo group: ``Communicator.backend`` is ``"gloo"``); staging changes only where the bytes sit.
On the CPU (``Communicator(staged=True)``, or the shared mode: ``workers_per_device > 1``) it
runs the same code with host-to-host copies: that is how the tests prove every operation, and
run whole jobs through it, on a machine without an accelerator. The copies are synchronous, on
the calling thread's current stream of the device (the default one, which the runtime computes
on, in every thread).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["StagedGroup", "StagedWork"]


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor holding ``t``'s value (waits for the device to produce it)."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t)


def _host_empty(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="cpu")


class StagedWork:
    """A gloo work item on host buffers; ``wait()`` copies each result into its tensor."""

    def __init__(self, work: Any, back: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._work = work
        self._back = list(back)  # (the caller's tensor, the host buffer gloo wrote)
        self._lock = threading.Lock()
        self._copied = False

    def wait(self, *args: Any) -> bool:
        """Wait for the gloo work (raising its error), then copy the results back, once."""
        done = self._work.wait(*args)
        with self._lock:
            if not self._copied:
                for tensor, host in self._back:
                    tensor.copy_(host)
                self._copied = True
        return bool(done) if done is not None else True

    def get_future(self) -> Any:
        """The gloo work's future (point-to-point work has none: gloo raises RuntimeError)."""
        return self._work.get_future()

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


class StagedGroup:
    """A gloo process group whose operations run on host copies of their tensors."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg  # the gloo group underneath

    def rank(self) -> int:
        return int(self.pg.rank())

    def size(self) -> int:
        return int(self.pg.size())

    def allreduce(self, tensors: list[torch.Tensor], *opts: Any) -> StagedWork:
        host = [_host_copy(t) for t in tensors]
        return StagedWork(self.pg.allreduce(host, *opts), zip(tensors, host, strict=True))

    def broadcast(self, tensors: list[torch.Tensor], *opts: Any) -> StagedWork:
        host = [_host_copy(t) for t in tensors]  # the root's value; the others' is overwritten
        return StagedWork(self.pg.broadcast(host, *opts), zip(tensors, host, strict=True))

    def allgather(
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], *opts: Any
    ) -> StagedWork:
        host_out = [[_host_empty(t) for t in outs] for outs in outputs]
        work = self.pg.allgather(host_out, [_host_copy(t) for t in inputs], *opts)
        back = [pair for outs, hosts in zip(outputs, host_out, strict=True)
                for pair in zip(outs, hosts, strict=True)]  # fmt: skip
        return StagedWork(work, back)

    def _allgather_base(self, output: torch.Tensor, part: torch.Tensor, *opts: Any) -> StagedWork:
        host_out = _host_empty(output)
        work = self.pg._allgather_base(host_out, _host_copy(part), *opts)
        return StagedWork(work, [(output, host_out)])

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *opts: Any
    ) -> StagedWork:
        host_out = [_host_empty(t) for t in outputs]
        host_in = [[_host_copy(t) for t in parts] for parts in inputs]
        work = self.pg.reduce_scatter(host_out, host_in, *opts)
        return StagedWork(work, zip(outputs, host_out, strict=True))

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StagedWork:
        return StagedWork(self.pg.send([_host_copy(t) for t in tensors], peer, tag), [])

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> StagedWork:
        host = [_host_empty(t) for t in tensors]
        return StagedWork(self.pg.recv(host, peer, tag), zip(tensors, host, strict=True))
