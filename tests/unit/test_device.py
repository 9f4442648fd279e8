"""Where workers compute and what carries their collectives, as tables: the device a
``train.device`` means on a host, how many workers it runs, the backend, NCCL's settings, and
which groups an accelerator shrinks instead of rebuilding."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from elaswave.errors import ConfigError
from elaswave.runtime.comm.communicator import Communicator, _Group, shrink_exclusions
from elaswave.runtime.device import (
    NCCL_ENV,
    Accelerators,
    Placement,
    backend_for,
    nccl_environment,
    place,
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
    ("placement", "nproc", "workers"),
    [
        (Placement("cpu", 0), None, 4),  # the CPU default
        (Placement("cpu", 0), 16, 16),  # any number on the CPU
        (Placement("cuda", 8), None, 8),  # one per device
        (Placement("cuda", 8), 3, 3),  # fewer is fine
        (Placement("cuda", 8), 8, 8),
        (Placement("npu", 2), None, 2),
    ],
)
def test_workers_per_host(placement: Placement, nproc: int | None, workers: int) -> None:
    assert workers_per_host(placement, nproc, cpu_default=4) == workers


def test_more_workers_than_devices_is_refused() -> None:
    with pytest.raises(ConfigError, match="--nproc-per-node 9 exceeds the 8 CUDA device"):
        workers_per_host(Placement("cuda", 8), 9, cpu_default=4)


@pytest.mark.parametrize(
    ("kind", "slot", "device", "backend"),
    [
        ("cpu", 3, torch.device("cpu"), "gloo"),
        ("cuda", 3, torch.device("cuda", 3), "nccl"),  # pinned by the local slot
    ],
)
def test_worker_device_and_backend(kind: str, slot: int, device: Any, backend: str) -> None:
    assert worker_device(kind, slot) == device
    assert backend_for(device) == backend


def test_npu_backend() -> None:
    # torch names the "npu" device type only once torch_npu registered it: its type alone
    assert backend_for(SimpleNamespace(type="npu")) == "hccl"  # type: ignore[arg-type]


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
