"""Every transport error latches: an operation on a group whose peer has died raises CommError.

Real gloo groups between this process and a peer process that really exits. The survivor has
not been told (no plan says so, ``abort`` stays false), so it meets the dead peer in the
transport itself: gloo raises while a send is being *posted* (``Connection closed by peer``,
before any wait), or fails the wait. Whichever it is, the Communicator must turn it into
:class:`CommError`, the error the engine latches; any other exception would end the survivor.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.comm.groups import CommError

PEER = textwrap.dedent(
    """
    import os
    import sys
    import torch
    from elaswave.runtime.comm.communicator import Communicator

    comm = Communicator(me="b", host_addr="127.0.0.1", rendezvous_timeout=30,
                        collective_timeout=30, waker=lambda ev: (lambda: None))
    comm.configure({"g": ("a", "b")}, store=sys.argv[1], epoch=1, abort=lambda: False)
    comm.allreduce("g", torch.zeros(4), lambda: False)  # both sides are connected
    print("ready", flush=True)
    sys.stdin.readline()  # the survivor says when; then die without a goodbye
    os._exit(0)
    """
)


def _never() -> bool:
    return False


def _survivor_with_dead_peer(staged: bool | None = None) -> Communicator:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))  # fmt: skip
    address = f"127.0.0.1:{store.port}"
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, address],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    comm = Communicator(me="a", host_addr="127.0.0.1", rendezvous_timeout=30,
                        collective_timeout=20, waker=lambda ev: (lambda: None),
                        staged=staged)  # fmt: skip
    comm._store_keepalive = store  # type: ignore[attr-defined]  # the master lives with the test
    comm.configure({"g": ("a", "b")}, store=address, epoch=1, abort=_never)
    comm.allreduce("g", torch.zeros(4), _never)
    assert peer.stdout is not None and peer.stdout.readline().strip() == "ready"
    assert peer.stdin is not None
    peer.stdin.write("go\n")
    peer.stdin.flush()
    assert peer.wait(timeout=30) == 0
    time.sleep(0.3)  # the survivor's transport has seen the connection close
    return comm


OPS: dict[str, Callable[[Communicator], object]] = {
    "exchange-send": lambda c: c.exchange("g", [(1, torch.ones(1 << 16))], [], abort=_never),
    "exchange-recv": lambda c: c.exchange("g", [], [(1, torch.empty(8))], abort=_never),
    "p2p": lambda c: c.p2p("g", [(1, torch.ones(8), 3)], [(1, torch.empty(8), 3)], abort=_never),
    "allreduce": lambda c: c.allreduce("g", torch.ones(1 << 16), _never),
    "allgather": lambda c: c.allgather("g", torch.ones(8), _never),
    "broadcast": lambda c: c.broadcast("g", torch.ones(8), 0, abort=_never),
    "reduce_scatter": lambda c: c.reduce_scatter(
        "g", [torch.ones(8), torch.ones(8)], torch.empty(8), abort=_never
    ),
    "allgather_into": lambda c: c.allgather_into("g", torch.empty(16), torch.ones(8), abort=_never),
}


@pytest.mark.parametrize("op", list(OPS))
def test_an_operation_with_a_dead_peer_raises_comm_error(op: str) -> None:
    comm = _survivor_with_dead_peer()
    with pytest.raises(CommError):
        OPS[op](comm)


@pytest.mark.parametrize("op", ["exchange-send", "exchange-recv", "allreduce", "allgather_into"])
def test_a_staged_operation_with_a_dead_peer_raises_comm_error(op: str) -> None:
    """Through host memory (workers sharing a device) the same errors latch the same way."""
    comm = _survivor_with_dead_peer(staged=True)
    assert comm.staged
    with pytest.raises(CommError):
        OPS[op](comm)


def test_a_send_posted_to_a_dead_peer_raises_at_once() -> None:
    """The race CI met: the post itself raises (before any wait), and it is a CommError."""
    comm = _survivor_with_dead_peer()
    start = time.monotonic()
    with pytest.raises(CommError, match="send/recv"):
        for _ in range(50):  # the first post may still be buffered by the kernel
            comm.post("g", [(1, torch.ones(1 << 16), 0)], [])
    assert time.monotonic() - start < 5


def test_an_unreachable_rendezvous_store_is_a_comm_error() -> None:
    """The store lives in a daemon that may be gone (its host died): a CommError, not a crash."""
    comm = Communicator(me="a", host_addr="127.0.0.1", rendezvous_timeout=1,
                        collective_timeout=5, waker=lambda ev: (lambda: None))  # fmt: skip
    with pytest.raises(CommError, match="rendezvous"):
        comm.configure({"g": ("a", "b")}, store=f"127.0.0.1:{_closed_port()}", epoch=1,
                       abort=_never)  # fmt: skip


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
