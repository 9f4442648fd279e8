"""The accelerator path on real GPUs: recovery keeps every property the CPU runs keep.

On a host with exactly one GPU (the machines lent to this project), four workers share it
(``--workers-per-device 4``): NCCL refuses two ranks of a communicator on one device, so their
collectives run over gloo on host copies of the CUDA tensors (``comm/staging.py``), while the
step itself (forward, backward, the float64 accumulation, the optimizer) runs on the GPU. With
two or more GPUs each worker has its own (up to four) and NCCL carries the collectives: a fault
aborts the old epoch's communicators together, or shrinks them in place where NCCL can. A world
of one on NCCL is checked on any GPU host: the step path on CUDA, and an NCCL group built again
by a respawned worker. The shrink test needs two GPUs.

Every comparison is with a fault-free run on the same GPU(s) in the deterministic mode (float64
reduction, deterministic kernels): a micro-batch computes the same bits whichever worker runs it,
so a fault must change neither a loss nor a parameter bit. Skipped without CUDA (``pytest -m
gpu`` selects them; ``bench/gpucheck.py`` runs them with the GPU benchmark).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import F64, Run, assert_clean_run, assert_redid_only, launch

from elaswave.report import build_report

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SHARED = GPUS == 1  # four workers share the one GPU, over gloo through host memory
WORKERS = 4 if SHARED else min(GPUS, 4)
PER_DEVICE = WORKERS if SHARED else 1
BACKEND = "gloo" if SHARED else "nccl"
STEPS = 12
LAUNCH_TIMEOUT = 200  # one launch: CUDA start-up in every worker, 12 small steps

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA device"),
    pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 30),  # a test's launch, and the reference's
]


def _cuda(*args: str, workers: int = WORKERS, per_device: int = PER_DEVICE) -> tuple[str, ...]:
    return ("--device", "cuda", "--nproc-per-node", str(workers),
            "--workers-per-device", str(per_device), "--steps", str(STEPS), *args)  # fmt: skip


def _env(base: Path) -> dict[str, str]:
    # cuBLAS's own condition for bit-reproducible results, beside the deterministic kernels
    # the float64 mode asks for
    return {**os.environ, "ELASWAVE_STATE_DIR": str(base / "state"), **F64,
            "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # fmt: skip


def _shrinks() -> bool:
    """Whether NCCL here can shrink a communicator in place, asked of an instance as the
    runtime asks (NCCL 2.27 and a PyTorch that has it)."""
    import datetime

    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=30)
    pg = dist.ProcessGroupNCCL(dist.HashStore(), 0, 1, opts)
    return bool(getattr(pg, "supports_shrinking", False)) and hasattr(pg, "shrink")


def _backend_ok(events: list[dict], backend: str = BACKEND) -> None:
    """Every group was built on ``backend``; gloo on the GPU runs through host memory."""
    assert events and {e["backend"] for e in events} == {backend}, events
    staged = backend == "gloo"
    assert all(e.get("staged", False) is staged for e in events), events


def _bit_identical(run: Run, reference: Run) -> None:
    assert_clean_run(run, STEPS, reference)
    assert run.losses == reference.losses  # bit for bit
    for key in ("params_sha256", "state_sha256"):
        assert {f[key] for f in run.of("final_state")} == {
            f[key] for f in reference.of("final_state")
        }, key


@pytest.fixture(scope="module")
def gpu_reference(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The fault-free run on the GPU(s), float64 reduction."""
    base = tmp_path_factory.mktemp("gpu-ref")
    r = launch(base / "run", "--job-id", "gpu-ref", *_cuda(), env=_env(base),
               timeout=LAUNCH_TIMEOUT)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(base / "run")
    assert [m["step"] for m in run.metrics] == list(range(1, STEPS + 1))
    _backend_ok(run.of("comm_rebuilt"))
    assert len(run.of("final_state")) == WORKERS
    return run


def test_crash_recovers_in_place_on_the_gpu(tmp_path: Path, gpu_reference: Run) -> None:
    """A worker SIGKILLed mid-run: the survivors rebuild their groups (NCCL: abort together or
    shrink; shared GPU: gloo groups built again), redo only the in-flight step, and end
    bit-identical to the fault-free run."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-kill", *_cuda("--fault", "kill,rank=1,at_step=6"),
        env=_env(tmp_path), timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    _bit_identical(run, gpu_reference)
    (fault,) = run.of("fault_injected")
    assert_redid_only(run, 2, {fault["worker"]})
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    assert len(after) == WORKERS - 1
    _backend_ok(after)
    if BACKEND == "gloo":
        assert all("dp" in e["rebuilt"] for e in after), after
    elif _shrinks():  # the training group lost one member: shrunk in place, not rebuilt
        assert all("dp" in e["shrunk"] and "dp" not in e["rebuilt"] for e in after), after
    else:
        assert all("dp" in e["rebuilt"] and e["shrunk"] == [] for e in after), after


def test_hang_is_killed_by_the_daemon(tmp_path: Path, gpu_reference: Run) -> None:
    """SIGSTOP one worker: its peers wait in a collective (NCCL: spinning on the device; shared
    GPU: in gloo, on the host) until the daemon's hang check kills it; then their groups are
    given up and rebuilt and training goes on, bit-identical."""
    timeout = 3.0
    r = launch(
        tmp_path / "run", "--job-id", "gpu-hang", "--hang-timeout", str(timeout),
        *_cuda("--fault", "hang,rank=1,at_step=5"), env=_env(tmp_path), timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    _bit_identical(run, gpu_reference)
    (inc,) = build_report(run.dir)["incidents"]
    assert inc["kind"] == "hang" and inc["mttr_s"] <= timeout + 2.0, inc
    after = [e for e in run.of("comm_rebuilt") if e["epoch"] == 2]
    _backend_ok(after)
    if BACKEND == "nccl":
        assert all(e["abort_seconds"] < 5.0 for e in after), after


@pytest.mark.skipif(
    1 < GPUS < 4, reason="dp=2 × pp=2 needs four CUDA devices, or one shared by four"
)
def test_pipeline_stage_loss_on_the_gpu(tmp_path: Path, gpu_reference: Run) -> None:
    """dp=2 × pp=2: a stage dies, its layers migrate to the survivor point to point (NCCL, or
    gloo through host memory on a shared GPU), and the run stays bit-identical to data
    parallelism on the same GPU(s)."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-pp", *_cuda("--pp", "2", "--migration", "blocking",
        "--fault", "kill,rank=1,at_step=5"), env=_env(tmp_path), timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    _bit_identical(run, gpu_reference)
    _backend_ok(run.of("comm_rebuilt"))
    synced = [e for e in run.of("state_synced") if e["epoch"] == 2]
    assert synced and all(e["migration"] == "blocking" for e in synced)
    assert any(e["bytes_received"] > 0 for e in synced)


def test_one_worker_on_nccl_is_respawned_and_resumes(tmp_path: Path, gpu_reference: Run) -> None:
    """A world of one on NCCL: the step on CUDA, an NCCL group of one built at the start; the
    worker SIGKILLed, respawned (``--max-restarts 1``), its new process builds a new NCCL group
    and resumes from the durable checkpoint (nobody else holds the state). Bit-identical to the
    fault-free run: the float64 reduction makes the world size immaterial. Checkpoints are
    written in the background: the worker is slowed down (0.4 s a step) so that the one of step
    4 is complete before the kill at step 10."""
    r = launch(
        tmp_path / "run", "--job-id", "gpu-one",
        *_cuda("--max-restarts", "1", "--durable-every", "4",
               "--fault", "slow,rank=0,at_step=1,delay=0.4",
               "--fault", "kill,rank=0,at_step=10", workers=1, per_device=1),
        env=_env(tmp_path), timeout=LAUNCH_TIMEOUT,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    run = Run(tmp_path / "run")
    _bit_identical(run, gpu_reference)
    (respawn,) = run.of("worker_respawned")
    built = run.of("comm_rebuilt")
    _backend_ok(built, "nccl")
    assert [(e["epoch"], e["worker"], e["rebuilt"]) for e in built] == [
        (1, respawn["replaces"], ["dp"]),
        (2, respawn["worker"], ["dp"]),
    ], built
    (restored,) = run.of("durable_restored")
    assert restored["step"] in (4, 8) and "every worker holding the job's" in restored["reason"]


SHRINK_SCRIPT = """
import json, os, sys, threading, time
import torch
import torch.distributed as dist
from elaswave.runtime.comm.communicator import CommError, Communicator, Interrupted

never = lambda: False
members = tuple("abc"[: int(sys.argv[1])])  # the last one is lost
lost, survivors = members[-1], members[:-1]

def waker(event):
    stop = threading.Event()
    def tick():
        while not stop.wait(0.1):
            event.set()
    threading.Thread(target=tick, daemon=True).start()
    return stop.set

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
address = f"127.0.0.1:{store.port}"
out, errors, kept = {}, [], []

def body(me, index):
    try:
        torch.cuda.set_device(index)
        comm = Communicator(me=me, host_addr="127.0.0.1", rendezvous_timeout=60,
                            collective_timeout=60, waker=waker,
                            device=torch.device("cuda", index))
        comm.configure({"dp": members}, store=address, epoch=1, abort=never)
        t = torch.ones(4, device=f"cuda:{index}")
        comm.allreduce("dp", t, never)
        first = float(t[0])
        if me == lost:
            out[me] = {"first": first}
            kept.append(comm)  # lost, but its connections stay open: it just never answers
            return
        until = time.monotonic() + 1.0  # stuck on the device: the lost one never joins
        try:
            comm.allreduce("dp", torch.ones(4, device=f"cuda:{index}"),
                           lambda: time.monotonic() > until)
        except (Interrupted, CommError):
            pass
        comm.mark_broken()
        stats = comm.configure({"dp": survivors}, store=address, epoch=2, abort=never)
        t = torch.ones(4, device=f"cuda:{index}")
        comm.allreduce("dp", t, never)
        out[me] = {"first": first, "sum": float(t[0]), "shrunk": stats.shrunk,
                   "rebuilt": stats.rebuilt, "abort_s": stats.abort_seconds,
                   "shrink_s": stats.shrink_seconds}
    except BaseException as exc:
        errors.append(f"{me}: {exc!r}")

threads = [threading.Thread(target=body, args=(m, i)) for i, m in enumerate(members)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
print(json.dumps({"out": out, "errors": errors}), flush=True)
os._exit(0)
"""


@pytest.mark.skipif(GPUS < 2, reason="shrinking an NCCL group needs two CUDA devices")
def test_a_lost_member_is_shrunk_away_or_rebuilt() -> None:
    """Two or three ranks, one per GPU; the last is lost with a collective stuck on the
    others' devices. The survivors' next configure shrinks the group in place where NCCL can
    (else aborts it and builds a new one), and the new group sums correctly."""
    import json
    import subprocess
    import sys

    ranks = min(GPUS, 3)
    r = subprocess.run([sys.executable, "-c", SHRINK_SCRIPT, str(ranks)], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    out = result["out"]
    assert {m: e["first"] for m, e in out.items()} == {m: float(ranks) for m in "abc"[:ranks]}
    for me in "abc"[: ranks - 1]:
        e = out[me]
        assert e["sum"] == ranks - 1, e  # the new group is exactly the survivors
        if _shrinks():
            assert e["shrunk"] == ["dp"] and e["rebuilt"] == [], e
        else:
            assert e["shrunk"] == [] and e["rebuilt"] == ["dp"], e
