"""torchrun restart baseline: a crash restarts the whole job from its last checkpoint.

``python -m torch.distributed.run --nnodes 1 --nproc-per-node 4 --max-restarts 3
--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT bench/torchrun_baseline.py ...`` runs 4
plain-DDP workers (gloo) doing ElasWave's work per step: same model, sample ids, keyed dropout,
``torch.set_num_threads``, AdamW hyper-parameters; each rank runs its 4 micro-batches with
``no_sync()`` on all but the last and backpropagates ``loss_sum * 4 / 32`` (DDP averages).

Every ``--ckpt-every`` steps (default 10) rank 0 ``torch.save``s model, optimizer and step to a
temporary file and renames it over ``ckpt.pt``. A worker that finds ``ckpt.pt`` resumes after
its step. The fault: in the first incarnation only (``TORCHELASTIC_RESTART_COUNT == 0``), rank 1
SIGKILLs itself in DDP's communication hook of step 15, just before the gradient all-reduce.
torchrun then stops the survivors and restarts all 4 workers, which resume from step 10.

Each rank appends JSON lines (start, ready, step, ckpt, kill) to ``rank<R>.jsonl``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

FAULT_STEP = 15
VICTIM = 1
MAX_RESTARTS = 3


# ---- launcher: runs in the benchmark process ---------------------------------------------------
def torchrun_command(world: int, port: int, job: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(world), "--max-restarts", str(MAX_RESTARTS),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", job]  # fmt: skip


def run_torchrun(
    config: Path, out_dir: Path, *, kill: bool, ckpt_every: int = 10, world: int = 4,
    timeout: float = 600.0,
) -> dict[str, Any]:  # fmt: skip
    """Run one torchrun job to completion; returns the measurements of :func:`analyse`."""
    from bench.common import REPO_ROOT, BenchError, free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(world, free_port(), f"bench-{os.getpid()}-{out_dir.name}")
    cmd += [str(Path(__file__)), "--config", str(config), "--out", str(out_dir),
            "--ckpt-every", str(ckpt_every)]  # fmt: skip
    cmd += ["--kill-at", str(FAULT_STEP)] if kill else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASWAVE_")}
    # torch 2.13's default (workers share the agent's rendezvous store) breaks restarts: the new
    # incarnation's gloo reads the dead one's addresses ("connectFullMesh ... Connection
    # refused", pytorch/pytorch#135712). The documented workaround: a fresh store per attempt.
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    start = time.time()
    try:
        with (out_dir / "torchrun.log").open("w") as log:
            proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)  # fmt: skip
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"torchrun still running after {timeout:g} s; see {out_dir}") from exc
    end = time.time()
    if proc.returncode != 0:
        raise BenchError(f"torchrun exited {proc.returncode}; see {out_dir / 'torchrun.log'}")
    return analyse(out_dir, config, world=world, kill=kill, start=start, end=end)


def analyse(
    out_dir: Path, config: Path, *, world: int, kill: bool, start: float, end: float
) -> dict[str, Any]:
    from bench.common import BenchError, read_jsonl
    from elaswave.config import load_config

    t = load_config(config, env={}).train
    recs = [r for rank in range(world) for r in read_jsonl(out_dir / f"rank{rank}.jsonl")]
    last_attempt = max(r["attempt"] for r in recs)
    # The surviving value of each step: from the last incarnation that ran it, summed over ranks.
    final: dict[int, dict[int, dict[str, Any]]] = {}
    for r in recs:
        if r["kind"] == "step":
            prev = final.setdefault(r["step"], {}).get(r["rank"])
            if prev is None or r["attempt"] >= prev["attempt"]:
                final[r["step"]][r["rank"]] = r
    if sorted(final) != list(range(1, t.steps + 1)) or any(len(v) != world for v in final.values()):
        raise BenchError(f"{out_dir}: incomplete steps {sorted(final)}")
    loss = [sum(r["loss_sum"] for r in final[s].values()) / t.global_batch for s in sorted(final)]
    step_end = [final[s][0]["t"] for s in sorted(final)]
    # Every step rank 0 completed, redone ones included, in wall-clock order (for throughput).
    history = sorted((r["t"], r["step"], t.global_batch) for r in recs
                     if r["kind"] == "step" and r["rank"] == 0)  # fmt: skip
    result: dict[str, Any] = {
        "loss": loss,
        "step_end": step_end,
        "history": history,
        "global_batch": [t.global_batch] * t.steps,
        "restarts": last_attempt,
        "wall_s": round(end - start, 3),
        "launch_to_first_commit_s": round(min(h[0] for h in history) - start, 3),
        "ckpt_save_s": [r["seconds"] for r in recs if r["kind"] == "ckpt"],
    }
    if kill:
        kill_t = next(r["t"] for r in recs if r["kind"] == "kill")
        again = [r for r in recs if r["attempt"] == 1]
        ckpt = max(r["step"] for r in recs if r["kind"] == "ckpt" and r["t"] < kill_t)
        first = min((r for r in again if r["kind"] == "step" and r["rank"] == 0),
                    key=lambda r: r["t"])  # fmt: skip
        spawned = min(r["t_create"] for r in again if r["kind"] == "start")
        imported = max(r["t"] for r in again if r["kind"] == "imported")
        ready = max(r["t"] for r in again if r["kind"] == "ready")
        result.update(
            kill_t=kill_t,
            fault_step=FAULT_STEP,
            mttr_s=first["t"] - kill_t,
            first_step_after_fault=first["step"],
            refault_step_done_s=final[FAULT_STEP][0]["t"] - kill_t,
            last_ckpt_step=ckpt,
            steps_lost=FAULT_STEP - 1 - ckpt,
            steps_redone=FAULT_STEP - ckpt,  # the lost steps plus the in-flight one
            phases={
                "restart_s": spawned - kill_t,  # detection, teardown, re-rendezvous, re-spawn
                "import_s": imported - spawned,  # interpreter start, import torch and elaswave
                "setup_s": ready - imported,  # process group, model, load checkpoint, DDP
                "first_step_s": first["t"] - ready,
            },
            global_batch_after=t.global_batch,
            world_after=world,
        )
    return result


# ---- worker: one torchrun rank -----------------------------------------------------------------
_ARMED = False


def _process_start() -> float:
    """Wall-clock time this process was created (Linux ``/proc``; 10 ms resolution)."""
    try:
        with open("/proc/self/stat") as fh:
            ticks = int(fh.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def main(argv: list[str] | None = None) -> None:
    global _ARMED
    created = _process_start()
    p = argparse.ArgumentParser()
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=None)
    a = p.parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = (a.out / f"rank{rank}.jsonl").open("a", buffering=1)

    def emit(kind: str, **fields: Any) -> None:
        out.write(json.dumps({"kind": kind, "rank": rank, "attempt": attempt, **fields}) + "\n")

    emit("start", t=time.time(), t_create=created)

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from elaswave.config import load_config
    from elaswave.runtime.workload.data import microbatches
    from elaswave.runtime.workload.gpt import per_sample_loss
    from elaswave.runtime.workload.load import build_model, load_workload

    emit("imported", t=time.time())

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        if _ARMED:  # the gradient all-reduce of the fault step: die just before it
            emit("kill", step=step, t=time.time())
            os.kill(os.getpid(), signal.SIGKILL)
        return allreduce_hook(state, bucket)  # DDP's default: divide by world size, all-reduce

    cfg = load_config(a.config, env={})
    t = cfg.train
    torch.set_num_threads(t.threads_per_worker)
    dist.init_process_group("gloo")  # env:// from torchrun
    model = build_model(cfg)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                            weight_decay=t.weight_decay)  # fmt: skip
    ckpt, first_step = a.out / "ckpt.pt", 1
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        first_step = state["step"] + 1
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, hook)
    workload = load_workload(cfg)
    dataset = workload.dataset(t.seed)
    per_rank = t.num_microbatches // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    scale = world / t.global_batch  # DDP averages over ranks
    emit("ready", t=time.time(), resume_step=first_step - 1)
    for step in range(first_step, t.steps + 1):
        every = microbatches(
            t.seed,
            step,
            t.global_batch,
            micro_batch_size=t.micro_batch_size,
            num_samples=len(dataset),
        )
        loss_sum = 0.0
        for k, i in enumerate(mine):
            mb = every[i]
            tokens, targets = workload.collate([dataset[i] for i in mb.sample_ids])
            last = k == len(mine) - 1
            _ARMED = last and step == a.kill_at and attempt == 0 and rank == VICTIM
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(tokens, step, mb.id)
                loss = per_sample_loss(logits, targets).sum()
                (loss * scale).backward()
            loss_sum += loss.item()
        opt.step()
        opt.zero_grad()
        emit("step", step=step, loss_sum=loss_sum, t=time.time())
        if rank == 0 and step % a.ckpt_every == 0:
            began = time.perf_counter()
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)  # atomic: a crash never leaves a torn checkpoint
            emit("ckpt", step=step, t=time.time(), seconds=time.perf_counter() - began)
    dist.destroy_process_group()
    out.close()


if __name__ == "__main__":
    main()
