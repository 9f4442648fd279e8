"""Gloo through host memory (workers sharing an accelerator): every communicator operation gives
the same result staged as unstaged.

Three real gloo ranks, one process each. Every rank runs the whole set of operations twice: on
a plain gloo communicator with CPU tensors, and on a communicator with staging forced on, its
tensors on ``DEVICE`` (the CPU here: the same code with host-to-host copies; a CUDA device in
the ``gpu`` variant, all ranks on one GPU). Each result must equal the plain one bit for bit and
be what the operation means (sums, gathers, the root's value, the peer's message), written into
the caller's tensor in place.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.runtime.comm.staging import StagedGroup, StagedWork

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, threading
    import torch
    from elaswave.runtime.comm.communicator import Communicator

    me, address, device = sys.argv[1], sys.argv[2], sys.argv[3]
    PLAN = {"g": ("a", "b", "c"), "h": ("a", "b")}
    rank, n = PLAN["g"].index(me), len(PLAN["g"])
    never = lambda: False
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"  # one GPU: all three share it
        torch.cuda.set_device(device)

    def waker(event):
        stop = threading.Event()
        def tick():
            while not stop.wait(0.1):
                event.set()
        threading.Thread(target=tick, daemon=True).start()
        return stop.set

    def value(salt, size, dtype=torch.float32, who=None):
        r = rank if who is None else who
        return (torch.arange(size, dtype=torch.float64) * (r + 1) + salt * 100 + r / 4).to(dtype)

    def run(comm, dev):
        out = {}
        on = lambda t: t.to(dev)
        nxt, prv = (rank + 1) % n, (rank - 1) % n
        buf = on(torch.full((10,), -1.0))  # the reduced span is a view: written in place
        buf[2:8].copy_(on(value(1, 6)))
        comm.allreduce("g", buf[2:8], never)
        out["allreduce"] = buf.tolist()
        many = [("g", on(value(2, 5, torch.float64)))]
        if me in PLAN["h"]:
            many.append(("h", on(value(3, 3, torch.float64))))
        comm.allreduce_many(many, never)
        out["allreduce_many"] = [t.tolist() for _, t in many]
        gathered = comm.allgather("g", on(value(4, 4)), never)
        out["allgather"] = [t.tolist() for t in gathered]
        out["allgather_device"] = sorted({t.device.type for t in gathered})
        b = on(value(5, 4).to(torch.int64))
        comm.broadcast("g", b, 1, abort=never)
        out["broadcast"] = b.tolist()
        out["broadcast_json"] = comm.broadcast_json("g", {"from": me, "n": [1, 2]}, 2,
                                                     abort=never)
        flat = on(torch.full((8,), -1.0))
        parts = [on(value(6 + k, 4)) for k in range(n)]
        comm.reduce_scatter("g", parts, flat[2:6], abort=never)
        out["reduce_scatter"] = flat.tolist()
        whole = on(torch.full((3 * n,), -1.0))
        comm.allgather_into("g", whole, on(value(9, 3)), abort=never)
        out["allgather_into"] = whole.tolist()
        got = [on(torch.zeros(3)), on(torch.zeros(2, dtype=torch.float64))]
        comm.exchange("g", [(nxt, on(value(10, 3))), (nxt, on(value(11, 2, torch.float64)))],
                      [(prv, got[0]), (prv, got[1])], abort=never)
        out["exchange"] = [t.tolist() for t in got]
        posted = on(torch.zeros(4))
        works = comm.post("g", [(nxt, on(value(12, 4)), 7)], [(prv, posted, 7)])
        waiter = threading.Thread(target=comm.wait_done, args=(works,))  # as a migration does
        waiter.start()
        waiter.join(60)
        out["post_wait_done"] = posted.tolist()
        got = on(torch.zeros(5))
        comm.p2p("g", [(prv, on(value(13, 5)), 3)], [(nxt, got, 3)], abort=never)
        out["p2p"] = got.tolist()
        return out

    results = {}
    for epoch, (mode, dev, staged) in enumerate(
        [("plain", "cpu", None), ("staged", device, True)], start=1
    ):
        comm = Communicator(me=me, host_addr="127.0.0.1", rendezvous_timeout=60,
                            collective_timeout=60, waker=waker, device=torch.device(dev),
                            backend="gloo", staged=staged)
        comm.configure(PLAN, store=address, epoch=epoch, abort=never)
        results[mode] = run(comm, dev)
        results[mode + "_groups"] = sorted({type(g.pg).__name__ for g in comm._groups.values()})
        results[mode + "_flag"] = comm.staged
    print(json.dumps(results), flush=True)
    os._exit(0)
    """
)


def _run_ranks(device: str) -> dict[str, dict[str, Any]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    address = f"127.0.0.1:{store.port}"
    procs = {
        me: subprocess.Popen(
            [sys.executable, "-c", SCRIPT, me, address, device],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for me in "abc"
    }
    out = {}
    for me, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=150)
        assert proc.returncode == 0, f"{me}: {stderr[-2000:]}"
        out[me] = json.loads(stdout.strip().splitlines()[-1])
    return out


def _value(rank: int, salt: int, size: int, dtype: torch.dtype = torch.float32) -> list[Any]:
    """The script's ``value``: what rank ``rank`` contributes."""
    x = torch.arange(size, dtype=torch.float64) * (rank + 1) + salt * 100 + rank / 4
    return x.to(dtype).tolist()


def _sum(*lists: list[float], dtype: torch.dtype = torch.float32) -> list[float]:
    """What gloo's sum of these lists is (ranks in order, in ``dtype``)."""
    total = torch.tensor(lists[0], dtype=dtype)
    for x in lists[1:]:
        total = total + torch.tensor(x, dtype=dtype)
    return total.tolist()


def _expected(rank: int) -> dict[str, Any]:
    """What each operation must give rank ``rank`` (of three: a, b, c)."""
    n, ranks = 3, range(3)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    many = [_sum(*(_value(r, 2, 5, torch.float64) for r in ranks), dtype=torch.float64)]
    if rank < 2:
        many.append(_sum(*(_value(r, 3, 3, torch.float64) for r in (0, 1)), dtype=torch.float64))
    scattered = _sum(*(_value(r, 6 + rank, 4) for r in ranks))
    return {
        "allreduce": [-1.0, -1.0, *_sum(*(_value(r, 1, 6) for r in ranks)), -1.0, -1.0],
        "allreduce_many": many,
        "allgather": [_value(r, 4, 4) for r in ranks],
        "broadcast": [int(x) for x in _value(1, 5, 4)],
        "broadcast_json": {"from": "c", "n": [1, 2]},
        "reduce_scatter": [-1.0, -1.0, *scattered, -1.0, -1.0],
        "allgather_into": [x for r in ranks for x in _value(r, 9, 3)],
        "exchange": [_value(prv, 10, 3), _value(prv, 11, 2, torch.float64)],
        "post_wait_done": _value(prv, 12, 4),
        "p2p": _value(nxt, 13, 5),
    }


def _check(out: dict[str, dict[str, Any]], device_type: str) -> None:
    for rank, me in enumerate("abc"):
        plain, staged = out[me]["plain"], out[me]["staged"]
        assert out[me]["plain_groups"] == ["ProcessGroupGloo"] and not out[me]["plain_flag"]
        assert out[me]["staged_groups"] == ["StagedGroup"] and out[me]["staged_flag"]
        assert staged["allgather_device"] == [device_type]  # results live where asked
        assert plain["allgather_device"] == ["cpu"]
        for op, want in _expected(rank).items():
            assert plain[op] == want, (me, op, "plain", plain[op], want)
            assert staged[op] == plain[op], (me, op, "staged", staged[op], plain[op])


def test_every_operation_gives_the_same_result_staged_as_unstaged() -> None:
    _check(_run_ranks("cpu"), "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_operation_on_cuda_tensors_through_host_memory() -> None:
    """Three ranks share the GPU(s) over gloo: CUDA tensors in, CUDA tensors out."""
    _check(_run_ranks("cuda"), "cuda")


# ---- the work item, with a fake gloo work -------------------------------------------------------
class _Work:
    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.waits = error, 0

    def wait(self) -> bool:
        self.waits += 1
        if self.error is not None:
            raise self.error
        return True


def test_a_failed_operation_copies_nothing_back() -> None:
    tensor, host = torch.zeros(3), torch.ones(3)
    work = StagedWork(_Work(RuntimeError("Connection closed by peer")), [(tensor, host)])
    with pytest.raises(RuntimeError, match="closed by peer"):
        work.wait()
    assert tensor.tolist() == [0.0, 0.0, 0.0]


def test_results_are_copied_back_once_whoever_waits() -> None:
    """An interrupted collective is waited for again when its group is kept, and a p2p batch
    may be waited for by a helper thread: the result lands once, before ``wait`` returns."""
    tensor, host = torch.zeros(3), torch.full((3,), 2.0)
    inner = _Work()
    work = StagedWork(inner, [(tensor, host)])
    assert work.wait()
    tensor.add_(1.0)  # the caller moved on and changed its tensor
    threads = [threading.Thread(target=work.wait) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tensor.tolist() == [3.0, 3.0, 3.0] and inner.waits == 4


class _Recording:
    """A fake gloo group that records the tensors it was given."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> _Work:
        self.seen.extend(tensors)
        return _Work()


def test_a_send_carries_the_value_it_had_when_posted() -> None:
    t = torch.arange(4.0)
    work = StagedGroup(pg := _Recording()).send([t], 1, 0)
    t.zero_()  # the caller reuses its buffer before the send completed
    work.wait()
    (sent,) = pg.seen
    assert sent.tolist() == [0.0, 1.0, 2.0, 3.0] and sent.data_ptr() != t.data_ptr()
    assert t.tolist() == [0.0] * 4  # nothing comes back from a send
