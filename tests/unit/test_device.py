"""Where workers compute and what carries their collectives, as tables: the device a
``train.device`` means on a host, how many workers it runs, the backend, NCCL's settings, and
which groups an accelerator shrinks instead of rebuilding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elaswave.errors import ConfigError
from elaswave.runtime.comm.backends import shrink_exclusions
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.comm.groups import HeldGroup as _Group
from elaswave.runtime.device import (
    NCCL_ENV,
    Accelerators,
    Placement,
    backend_for,
    nccl_environment,
    place,
    stages_through_host,
    worker_device,
    workers_per_host,
)


@pytest.mark.parametrize(
    ("requested", "found", "kind", "devices"),
    [
        ("auto", Accelerators(), "cpu", 0),  # this machine: CPU and gloo
        ("auto", Accelerators(cuda=8), "cuda", 8),
        ("auto", Accelerators(npu=4), "npu", 4),
        ("auto", Accelerators(cuda=2, npu=4), "cuda", 2),  # CUDA first
        ("cpu", Accelerators(cuda=8), "cpu", 0),  # asked for: the GPUs stay unused
        ("cuda", Accelerators(cuda=1), "cuda", 1),
        ("npu", Accelerators(npu=2), "npu", 2),
    ],
)
def test_place(requested: str, found: Accelerators, kind: str, devices: int) -> None:
    assert place(requested, found) == Placement(kind, devices)


@pytest.mark.parametrize(
    ("requested", "found", "message"),
    [
        ("cuda", Accelerators(), "--device cuda: no CUDA device on this host"),
        ("cuda", Accelerators(npu=8), "--device cuda: no CUDA device on this host"),
        ("npu", Accelerators(cuda=8), "--device npu: no NPU device on this host"),
        ("tpu", Accelerators(), "train.device must be one of auto, cpu, cuda, npu, got 'tpu'"),
    ],
)
def test_place_refuses(requested: str, found: Accelerators, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        place(requested, found)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("placement", "nproc", "per_device", "workers"),
    [
        (Placement("cpu", 0), None, 1, 4),  # the CPU default
        (Placement("cpu", 0), 16, 1, 16),  # any number on the CPU
        (Placement("cpu", 0), None, 4, 4),  # sharing means nothing on the CPU
        (Placement("cuda", 8), None, 1, 8),  # one per device
        (Placement("cuda", 8), 3, 1, 3),  # fewer is fine
        (Placement("cuda", 8), 8, 1, 8),
        (Placement("npu", 2), None, 1, 2),
        (Placement("cuda", 1), None, 4, 4),  # one GPU shared by four workers
        (Placement("cuda", 1), 2, 4, 2),
        (Placement("cuda", 2), None, 2, 4),
    ],
)
def test_workers_per_host(
    placement: Placement, nproc: int | None, per_device: int, workers: int
) -> None:
    assert workers_per_host(placement, nproc, cpu_default=4, per_device=per_device) == workers


@pytest.mark.parametrize(
    ("placement", "nproc", "per_device", "message"),
    [
        (Placement("cuda", 8), 9, 1, "--nproc-per-node 9 exceeds the 8 CUDA device(s) of this "
         "host (one worker per device; --workers-per-device K lets K share one, over gloo)"),
        (Placement("cuda", 1), 5, 4, "--nproc-per-node 5 exceeds the 1 CUDA device(s) of this "
         "host (4 workers per device)"),
        (Placement("npu", 2), 3, 1, "--nproc-per-node 3 exceeds the 2 NPU device(s) of this "
         "host (one worker per device; --workers-per-device K lets K share one, over gloo)"),
    ],
)  # fmt: skip
def test_more_workers_than_devices_hold_is_refused(
    placement: Placement, nproc: int, per_device: int, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        workers_per_host(placement, nproc, cpu_default=4, per_device=per_device)
    assert str(err.value) == message


@pytest.mark.parametrize(
    ("kind", "slot", "per_device", "device", "backend", "staged"),
    [
        ("cpu", 3, 1, torch.device("cpu"), "gloo", False),
        ("cpu", 3, 4, torch.device("cpu"), "gloo", True),  # the shared mode, host to host
        ("cuda", 3, 1, torch.device("cuda", 3), "nccl", False),  # pinned by the local slot
        ("cuda", 3, 4, torch.device("cuda", 0), "gloo", True),  # slots 0-3 share GPU 0
        ("cuda", 5, 2, torch.device("cuda", 2), "gloo", True),
        ("cuda", 0, 2, torch.device("cuda", 0), "gloo", True),  # shared or not: the config's
    ],
)
def test_worker_device_and_backend(
    kind: str, slot: int, per_device: int, device: Any, backend: str, staged: bool
) -> None:
    assert worker_device(kind, slot, per_device) == device
    assert backend_for(device, per_device) == backend
    assert stages_through_host(device, backend, per_device) is staged


def test_hosts_of_a_job_agree_on_sharing_devices() -> None:
    """The backend follows ``workers_per_device`` alone: a host sharing its devices (gloo) and
    one that does not (NCCL) would never meet in a group, so the hosts must agree on it."""
    from elaswave.config import load_config
    from elaswave.config.jobs import config_difference, training_config

    one = training_config(load_config(env={}))
    two = training_config(load_config(overrides={"elastic.workers_per_device": 2}, env={}))
    assert config_difference(one, two) == "workers_per_device: job has 1, this host 2"


def test_npu_backend() -> None:
    # torch names the "npu" device type only once torch_npu registered it: its type alone
    npu = SimpleNamespace(type="npu")
    assert backend_for(npu) == "hccl"  # type: ignore[arg-type]
    assert backend_for(npu, 2) == "gloo"  # type: ignore[arg-type]  # shared: host staging
    assert stages_through_host(npu, "gloo")  # type: ignore[arg-type]


def test_nccl_settings_leave_failures_to_the_daemon() -> None:
    env = nccl_environment({"PATH": "/bin", "TORCH_NCCL_BLOCKING_WAIT": "1"})
    assert env["PATH"] == "/bin"
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "1"  # the user's own setting wins
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # the watchdog must not kill workers
    assert env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert set(NCCL_ENV) <= set(env)


@pytest.mark.parametrize(
    ("old", "new", "excluded"),
    [
        (("a", "b", "c", "d"), ("a", "c", "d"), [1]),
        (("a", "b", "c", "d"), ("b", "c"), [0, 3]),
        (("a", "b", "c", "d"), ("a", "b", "c", "d"), None),  # unchanged: kept, not shrunk
        (("a", "b", "c"), ("a", "c", "e"), None),  # a newcomer: rebuilt
        (("a", "b", "c"), ("c", "a"), None),  # reordered: ranks would not match
        (("a", "b"), (), None),
        (("a", "b", "c"), ("a", "b", "c", "d"), None),  # grown
    ],
)
def test_shrink_exclusions(
    old: tuple[str, ...], new: tuple[str, ...], excluded: list[int] | None
) -> None:
    assert shrink_exclusions(old, new) == excluded


class _FakeNccl:
    """Records what is called on it, in one log shared by all (a pure unit test of the order)."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def _group_start(self) -> None:
        self.log.append("group_start")

    def _group_end(self) -> None:
        self.log.append("group_end")

    def abort(self) -> None:
        self.log.append(f"abort {self.name}")


def test_accelerator_groups_are_aborted_together() -> None:
    """Every group of the old epoch is aborted inside one group call, never one by one."""
    comm = Communicator.__new__(Communicator)  # no transport needed for this decision
    comm.backend, comm._graveyard = "nccl", []
    log: list[str] = []
    groups = [_Group(("a", "b"), 0, _FakeNccl(n, log)) for n in ("dp", "mig", "grad-1")]
    comm._abort_all(groups)
    assert log == ["group_start", "abort dp", "abort mig", "abort grad-1", "group_end"]
    assert comm._graveyard == []
    comm._abort_all(groups)  # a failed configure gives up what it put aside: never twice
    assert log == ["group_start", "abort dp", "abort mig", "abort grad-1", "group_end"]


def test_gloo_groups_are_parked_not_aborted() -> None:
    comm = Communicator.__new__(Communicator)
    comm.backend, comm._graveyard = "gloo", []
    log: list[str] = []
    groups = [_Group(("a", "b"), 0, _FakeNccl("dp", log))]
    comm._abort_all(groups)
    assert log == [] and comm._graveyard == groups


class _Work:
    """A fake accelerator work item: completes after ``polls`` checks (never if None)."""

    def __init__(self, polls: int | None, log: list[str] | None = None) -> None:
        self.polls, self.log = polls, log if log is not None else []

    def is_completed(self) -> bool:
        if self.polls is None:
            return False
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.log.append("wait")  # orders the compute stream after the work
        return True


def _device_comm(timeout: float = 30.0) -> Communicator:
    comm = Communicator.__new__(Communicator)
    comm.backend, comm._graveyard, comm._groups = "nccl", [], {}
    comm.collective_timeout = comm.rendezvous_timeout = timeout
    comm.device = torch.device("cpu")
    comm._waker = lambda event: lambda: None
    return comm


def test_device_work_is_polled_until_done_then_waited() -> None:
    """An NCCL future completes when the work is queued: completion is its device event."""
    log: list[str] = []
    _device_comm()._finish_on_device(_Work(3, log), lambda: False, "allreduce")  # type: ignore[arg-type]
    assert log == ["wait"]


def test_device_work_stuck_on_a_dead_peer_is_interrupted_by_a_newer_plan() -> None:
    from elaswave.runtime.comm.groups import Interrupted

    asked = []

    def newer() -> bool:
        asked.append(1)
        return len(asked) > 5

    log: list[str] = []
    with pytest.raises(Interrupted):
        _device_comm()._finish_on_device(_Work(None, log), newer, "allreduce")  # type: ignore[arg-type]
    assert log == []  # never waited on: the stream must not depend on a dead collective


def test_device_work_times_out_in_a_background_wait() -> None:
    from elaswave.runtime.comm.groups import CommError

    with pytest.raises(CommError, match="timed out"):
        _device_comm(timeout=0.05).wait_done([_Work(None)])  # type: ignore[list-item]
    log: list[str] = []
    _device_comm().wait_done([_Work(2, log), _Work(0, log)])  # type: ignore[list-item]
    assert log == ["wait", "wait"]


def test_pending_device_work_is_finished_only_once_done() -> None:
    from elaswave.runtime.comm.backends import finished as _finished

    assert _finished([_Work(2), _Work(1)], poll=True)  # type: ignore[list-item]
    assert not _finished([_Work(None)], poll=True, timeout=0.05)  # type: ignore[list-item]


class _FakeCoalescing:
    """Records how point-to-point messages are posted on an accelerator group."""

    def __init__(self, work: object) -> None:
        self.calls: list[str] = []
        self.work = work

    def _start_coalescing(self) -> None:
        self.calls.append("start")

    def send(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.calls.append(f"send {peer}")

    def recv(self, tensors: list[torch.Tensor], peer: int, tag: int) -> None:
        self.calls.append(f"recv {peer}")

    def _end_coalescing(self) -> object:
        self.calls.append("end")
        return self.work


def test_device_point_to_point_is_posted_as_one_group_call() -> None:
    """Both ranks of a pair may send first: one NCCL group call posts the whole batch."""
    comm = _device_comm()
    work = object()
    pg = _FakeCoalescing(work)
    comm._groups["dp"] = _Group(("a", "b"), 0, pg)
    t = torch.zeros(2)
    posted = comm.post("dp", [(1, t, 0), (1, t, 1)], [(1, t, 0)])
    assert pg.calls == ["start", "send 1", "send 1", "recv 1", "end"]
    assert posted == [work]
    assert comm.post("dp", [], []) == []  # nothing to post: no group call, no work
    pg.work = None  # a backend that returns no work for the batch
    assert comm.post("dp", [(1, t, 0)], []) == []


class _ShrinkablePG:
    """A fake accelerator group that can shrink: records its shrinks and aborts."""

    supports_shrinking = True

    def __init__(self, log: list[str], name: str, can: bool = True) -> None:
        self.log, self.name = log, name
        self.supports_shrinking = can

    def shrink(self, excluded: list[int], flags: int, opts: object) -> _ShrinkablePG:
        self.log.append(f"{self.name} shrink {excluded}")
        return _ShrinkablePG(self.log, f"{self.name}'")

    def abort(self) -> None:
        self.log.append(f"{self.name} abort")


def _configure_both(can_b: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Ranks a and b of a three-rank group whose c was lost configure the group without c."""
    import datetime
    import threading

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))  # fmt: skip
    built: list[str] = []
    monkeypatch.setattr(
        Communicator, "_build", lambda self, name, *a, **k: built.append(self.me) or object()
    )
    out: dict[str, Any] = {"built": built}

    def run(me: str, rank: int, can: bool) -> None:
        comm = _device_comm()
        comm.me, comm._store = me, None
        log: list[str] = []
        comm._groups["dp"] = _Group(("a", "b", "c"), rank, _ShrinkablePG(log, f"dp@{me}", can))
        comm._groups["dp"].suspect = True
        stats = comm.configure({"dp": ("a", "b")}, store=f"127.0.0.1:{store.port}", epoch=2,
                               abort=lambda: False)  # fmt: skip
        out[me] = {"stats": stats, "log": log}

    threads = [threading.Thread(target=run, args=a) for a in (("a", 0, True), ("b", 1, can_b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_a_group_that_lost_members_is_shrunk_when_every_survivor_can(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = _configure_both(True, monkeypatch)
    for me in "ab":
        stats, log = out[me]["stats"], out[me]["log"]
        assert stats.shrunk == ["dp"] and stats.rebuilt == [] and stats.dropped == [], stats
        assert log == [f"dp@{me} shrink [2]", f"dp@{me} abort"]  # the parent, after the shrink
    assert out["built"] == []


def test_a_group_is_rebuilt_when_one_survivor_cannot_shrink(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = _configure_both(False, monkeypatch)
    for me in "ab":
        stats, log = out[me]["stats"], out[me]["log"]
        assert stats.shrunk == [] and stats.rebuilt == ["dp"] and stats.dropped == ["dp"], stats
        assert log == [f"dp@{me} abort"]  # given up, never shrunk
    assert sorted(out["built"]) == ["a", "b"]
