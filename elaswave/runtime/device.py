"""Which device a worker computes on, and which backend carries its collectives.

``train.device`` is ``auto`` (an accelerator when the host has one, else the CPU), ``cpu``,
``cuda`` or ``npu``. The daemon resolves it once per host before it spawns workers
(:func:`place`): every worker of a host gets the same kind, pinned by its local slot
(:func:`worker_device`). On an accelerator a host runs at most ``elastic.workers_per_device``
workers per device, one by default (:func:`workers_per_host`); without ``--nproc-per-node`` it
fills every device. The worker in slot ``s`` takes device ``s // workers_per_device``.

Backends (:func:`backend_for`): gloo on the CPU, NCCL on CUDA, HCCL on Ascend NPUs (through
``torch_npu``, imported only when asked for; untested without the hardware). Workers that share
a device (``workers_per_device > 1``) use gloo whatever the device, because NCCL refuses two
ranks of a communicator on one device; their collectives run on host copies of the device's
tensors (:func:`stages_through_host`, ``comm/staging.py``; on the CPU the same shared mode
copies host to host, so the CPU tests run it end to end). The backend depends on the config
alone, never on how many devices a host found, so every host of a job builds the same kind of
group. The decisions here are pure functions of what :func:`probe` found, tested as tables.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elaswave.config.train import DEVICE_KINDS
from elaswave.errors import ConfigError

if TYPE_CHECKING:  # torch is imported where a device is made: the daemon uses this module too
    import torch

__all__ = [
    "DEVICE_KINDS",
    "Accelerators",
    "Placement",
    "backend_for",
    "nccl_environment",
    "nvml_index",
    "may_have_accelerators",
    "place",
    "probe",
    "probe_for",
    "stages_through_host",
    "synchronize",
    "worker_device",
    "workers_per_host",
]

BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
_NAMES = {"cuda": "CUDA", "npu": "NPU"}


@dataclass(frozen=True)
class Accelerators:
    """How many devices of each accelerator kind this host has."""

    cuda: int = 0
    npu: int = 0

    def count(self, kind: str) -> int:
        return {"cuda": self.cuda, "npu": self.npu}.get(kind, 0)


@dataclass(frozen=True)
class Placement:
    """Where a host's workers compute: the device kind, its backend and how many devices."""

    kind: str  # cpu | cuda | npu
    devices: int  # accelerators on this host (0 on the CPU)

    @property
    def accelerated(self) -> bool:
        return self.kind != "cpu"


def probe() -> Accelerators:
    """The accelerators this process can see (``CUDA_VISIBLE_DEVICES`` applies). ``torch_npu``
    is imported only if installed."""
    import torch

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    npu = 0
    if importlib.util.find_spec("torch_npu") is not None:
        importlib.import_module("torch_npu")  # registers torch.npu
        npu_mod = getattr(torch, "npu", None)
        npu = npu_mod.device_count() if npu_mod is not None and npu_mod.is_available() else 0
    return Accelerators(cuda=cuda, npu=npu)


# Device nodes that an accelerator's driver creates: NVIDIA GPUs, CUDA under WSL2, ROCm (which
# torch drives as cuda), Ascend NPUs. Without any of them no accelerator can be used.
_ACCELERATOR_NODES = re.compile(r"nvidia\d+|dxg|kfd|davinci\d+")


def may_have_accelerators(dev_entries: Iterable[str]) -> bool:
    """Whether a host whose ``/dev`` lists ``dev_entries`` can have an accelerator. Pure."""
    return any(_ACCELERATOR_NODES.fullmatch(name) for name in dev_entries)


def probe_for(requested: str, dev: str = "/dev") -> Accelerators:
    """What :func:`place` needs to resolve ``requested``: nothing for the CPU, nor for
    ``auto`` on a host without accelerator device nodes (no torch imported: ``launch`` stays
    light), else :func:`probe`."""
    if requested == "cpu":
        return Accelerators()
    if requested == "auto":
        try:
            entries = os.listdir(dev)
        except OSError:
            entries = []
        if not may_have_accelerators(entries):
            return Accelerators()
    return probe()


def place(requested: str, found: Accelerators) -> Placement:
    """The device kind ``train.device = requested`` means on a host with ``found``; an
    accelerator asked for and absent is a one-line :class:`ConfigError`."""
    if requested not in DEVICE_KINDS:
        choices = ", ".join(DEVICE_KINDS)
        raise ConfigError(f"train.device must be one of {choices}, got {requested!r}")
    if requested == "auto":
        for kind in ("cuda", "npu"):
            if found.count(kind):
                return Placement(kind, found.count(kind))
        return Placement("cpu", 0)
    if requested == "cpu":
        return Placement("cpu", 0)
    if not found.count(requested):
        raise ConfigError(f"--device {requested}: no {_NAMES[requested]} device on this host")
    return Placement(requested, found.count(requested))


def workers_per_host(
    placement: Placement, nproc: int | None, *, cpu_default: int, per_device: int = 1
) -> int:
    """Workers this host runs: ``nproc`` if given (refused on an accelerator above its devices
    × ``per_device``, the workers one device may hold), else that many, or ``cpu_default`` on
    the CPU (where ``per_device`` means nothing)."""
    if not placement.accelerated:
        return cpu_default if nproc is None else nproc
    most = placement.devices * per_device
    if nproc is None:
        return most
    if nproc > most:
        name = _NAMES[placement.kind]
        why = (
            "one worker per device; --workers-per-device K lets K share one, over gloo"
            if per_device == 1
            else f"{per_device} workers per device"
        )
        raise ConfigError(
            f"--nproc-per-node {nproc} exceeds the {placement.devices} {name} device(s) "
            f"of this host ({why})"
        )
    return nproc


def worker_device(kind: str, slot: int, per_device: int = 1) -> torch.device:
    """The device of the worker in local ``slot``: accelerator ``slot // per_device`` (the
    slot-th with one worker per device), or the CPU."""
    import torch

    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, slot // per_device)


def backend_for(device: torch.device, per_device: int = 1) -> str:
    """The collective backend for tensors on ``device`` when ``per_device`` workers share
    each device: gloo when several do (NCCL and HCCL take one rank per device), else the
    device's own."""
    if per_device > 1:
        return "gloo"
    return BACKENDS.get(device.type, "gloo")


def stages_through_host(device: torch.device, backend: str, per_device: int = 1) -> bool:
    """Whether collectives on ``device``'s tensors over ``backend`` run on host copies: gloo on
    an accelerator (it has no send/recv, all-gather or reduce-scatter for device tensors), and
    the shared mode (``per_device > 1``) on any device: on the CPU its copies are host to host,
    the very code a shared GPU runs minus the device copies (how the CPU tests run it)."""
    return backend == "gloo" and (device.type != "cpu" or per_device > 1)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device``'s current stream (a no-op on the CPU): before
    reading a clock that times compute. Only that stream: NCCL's own streams (a migration's
    transfers running beside the step) are not waited for."""
    import torch

    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    elif device.type == "npu":
        torch.npu.current_stream(device).synchronize()  # type: ignore[attr-defined]  # torch_npu adds torch.npu at import


def nvml_index(device: torch.device, env: dict[str, str] | None = None) -> int:
    """The NVML index of a CUDA ``device`` (0 on the CPU): NVML numbers every GPU of the host,
    while CUDA numbers the ones ``CUDA_VISIBLE_DEVICES`` leaves, in its order."""
    if device.type != "cuda":
        return 0
    index = device.index or 0
    visible = (env if env is not None else os.environ).get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return index
    listed = [v.strip() for v in visible.split(",") if v.strip()]
    if index < len(listed) and listed[index].isdigit():
        return int(listed[index])
    return index  # UUIDs or an odd list: the CUDA index, as NVML most often agrees


# The daemon, not NCCL, decides when a peer is gone: it sees a process exit at once and kills a
# hung one after ``timeouts.hang``, then every survivor aborts its groups and builds new ones.
# So NCCL's own failure handling must neither tear the worker down nor act first.
NCCL_ENV = {
    # The watchdog must not abort communicators and kill the process on an error or a timeout:
    # the runtime aborts every group of the old epoch together (ncclGroupStart/End) itself.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0",
    # Waits poll the work's device event where the control channel can interrupt them; a
    # blocking wait could not be.
    "TORCH_NCCL_BLOCKING_WAIT": "0",
    # The heartbeat monitor kills a process whose watchdog looks stuck (a hung collective
    # is the daemon's call) and dumps traces on timeouts: both off.
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def nccl_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the NCCL settings above, unless the user set them already."""
    out = dict(env)
    for key, value in NCCL_ENV.items():
        out.setdefault(key, value)
    return out


def spare_builds_ahead(kind: str, *, script: bool) -> bool:
    """Whether a warm spare on a ``kind`` device builds its engine (model, data, optimizer)
    before it is activated: on the CPU, yes; on an accelerator it must not touch a device
    before it knows its slot, and a script builds its own state: those wait, imported and
    configured, and build once activated."""
    return kind == "cpu" and not script
