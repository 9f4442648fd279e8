"""The accelerator path on real GPUs: NCCL carries the collectives, a fault aborts the old
epoch's communicators together (or shrinks them in place where NCCL can), and recovery keeps
every property the CPU runs keep. Skipped without CUDA (``pytest -m gpu`` selects them); each
needs at least two GPUs (NCCL refuses two ranks on one device), the pipeline test four.

Every comparison is with a fault-free run on the same GPUs in the deterministic mode (float64
reduction): GPUs compute each micro-batch identically on whichever device runs it, so a fault
must not change a single loss or parameter bit.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import F64, Run, assert_clean_run, assert_redid_only, launch

from elaswave.report import build_report

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
WORKERS = min(GPUS, 4)
STEPS = 20

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 2, reason="needs two CUDA devices (NCCL: one rank per device)"),
    pytest.mark.timeout(900),  # CUDA start-up in every worker, and a reference run
]


def _cuda(*args: str) -> tuple[str, ...]:
    return ("--device", "cuda", "--nproc-per-node", str(WORKERS), "--steps", str(STEPS), *args)


def _env(base: Path) -> dict[str, str]:
    return {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64}


def _shrinks() -> bool:
    """Whether NCCL here can shrink a communicator in place, asked of an instance as the
    runtime asks (NCCL 2.27 and a PyTorch that has it)."""
    import datetime

    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=30)
    pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, opts)
    return bool(getattr(pg, "supports_shrinking", False)) and hasattr(pg, "shrink")


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The fault-free run on the GPUs, float64 reduction."""
    base = tmp_path_factory.mktemp("gpu-ref")
    r = launch(base / "run", "--job-id", "gpu-ref", *_cuda(), env=_env(base), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(base / "run")
    assert {e["backend"] for e in run.of("comm_rebuilt")} == {"nccl"}
    return run


def test_crash_recovers_in_place_on_nccl(tmp_path: Path, gpu_reference: Run) -> None:
    """A worker SIGKILLed mid-run: the survivors abort (or shrink) their NCCL groups, redo only
    the in-flight step, and end bit-identical to the fault-free run."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-kill", *_cuda("--fault", "kill,rank=1,at_step=8"),
        env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses  # bit for bit
    (fault,) = run.of("fault_injected")
    assert_redid_only(run, 2, {fault["worker"]})
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert len(after) == WORKERS - 1 and all(e["backend"] == "nccl" for e in after)
    if _shrinks():  # the training group lost one member: shrunk in place, not rebuilt
        assert all("dp" in e["shrunk"] and "dp" not in e["rebuilt"] for e in after), after
    else:
        assert all("dp" in e["rebuilt"] and e["shrunk"] == [] for e in after), after


def test_hang_is_aborted_by_the_daemon(tmp_path: Path, gpu_reference: Run) -> None:
    """SIGSTOP one worker: its peers' NCCL collectives spin on the device until the daemon's
    hang check kills it; then their communicators are aborted and training goes on."""
    timeout = 3.0
    r = launch(
        tmp_path / "run", "--job-id", "gpu-hang", "--hang-timeout", str(timeout),
        *_cuda("--fault", "hang,rank=1,at_step=6"), env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "hang" and inc["mttr_s"] <= timeout + 2.0, inc
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert after and all(e["abort_seconds"] < 5.0 for e in after), after


@pytest.mark.skipif(GPUS < 4, reason="dp=2 × pp=2 needs four CUDA devices")
def test_pipeline_stage_loss_on_nccl(tmp_path: Path, gpu_reference: Run) -> None:
    """dp=2 × pp=2 on four GPUs: a stage dies, its layers migrate to the survivor over NCCL
    point-to-point, and the run stays bit-identical to data parallelism on the same GPUs."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-pp", *_cuda("--pp", "2", "--migration", "blocking",
        "--fault", "kill,rank=1,at_step=5"), env=_env(tmp_path), timeout=600,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    assert_clean_run(run, STEPS, gpu_reference)
    assert run.losses == gpu_reference.losses
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert synced and all(e["migration"] == "blocking" for e in synced)
    assert any(e["bytes_received"] > 0 for e in synced)


SHRINK_SCRIPT = """
import json, os, sys, threading, time
import torch
import torch.distributed as dist
from elaswave.runtime.comm.communicator import CommError, Communicator, Interrupted

never = lambda: False

def waker(event):
    stop = threading.Event()
    def tick():
        while not stop.wait(0.1):
            event.set()
    threading.Thread(target=tick, daemon=True).start()
    return stop.set

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
address = f"127.0.0.1:{store.port}"
out, errors, lost = {}, [], []

def body(me, index):
    try:
        torch.cuda.set_device(index)
        comm = Communicator(me=me, host_addr="127.0.0.1", rendezvous_timeout=60,
                            collective_timeout=60, waker=waker,
                            device=torch.device("cuda", index))
        comm.configure({"dp": ("a", "b", "c")}, store=address, epoch=1, abort=never)
        t = torch.ones(4, device=f"cuda:{index}")
        comm.allreduce("dp", t, never)
        first = float(t[0])
        if me == "c":
            out[me] = {"first": first}
            lost.append(comm)  # lost, but its connections stay open: it just never answers
            return
        until = time.monotonic() + 1.0  # stuck on the device: c never joins
        try:
            comm.allreduce("dp", torch.ones(4, device=f"cuda:{index}"),
                           lambda: time.monotonic() > until)
        except (Interrupted, CommError):
            pass
        comm.mark_broken()
        stats = comm.configure({"dp": ("a", "b")}, store=address, epoch=2, abort=never)
        t = torch.ones(4, device=f"cuda:{index}")
        comm.allreduce("dp", t, never)
        out[me] = {"first": first, "sum": float(t[0]), "shrunk": stats.shrunk,
                   "rebuilt": stats.rebuilt, "abort_s": stats.abort_seconds,
                   "shrink_s": stats.shrink_seconds}
    except BaseException as exc:
        errors.append(f"{me}: {exc!r}")

threads = [threading.Thread(target=body, args=(m, i)) for i, m in enumerate("abc")]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
print(json.dumps({"out": out, "errors": errors}), flush=True)
os._exit(0)
"""


@pytest.mark.skipif(GPUS < 3, reason="two survivors and a lost rank need three CUDA devices")
def test_a_lost_member_is_shrunk_away_or_rebuilt() -> None:
    """Three ranks on three GPUs; one is lost with a collective stuck on the others' devices.
    The survivors' next configure shrinks the group in place where NCCL can (else aborts it and
    builds a new one), and the new group sums correctly."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", SHRINK_SCRIPT], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    out = result["out"]
    assert {m: e["first"] for m, e in out.items()} == {"a": 3.0, "b": 3.0, "c": 3.0}
    for me in "ab":
        e = out[me]
        assert e["sum"] == 2.0, e  # the new group is exactly the survivors
        if _shrinks():
            assert e["shrunk"] == ["dp"] and e["rebuilt"] == [], e
        else:
            assert e["shrunk"] == [] and e["rebuilt"] == ["dp"], e
