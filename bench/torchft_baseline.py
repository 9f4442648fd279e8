"""TorchFT baseline: 4 replica groups of one worker each; a dead group is dropped per step.

Set-up, as in TorchFT's ``train_ddp.py`` example and README: one ``torchft_lighthouse`` process
(``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``, default
``--heartbeat_timeout_ms 5000``); per replica group a ``torchft.Manager``
(``min_replica_size=1``, ``timeout=30 s``, ``init_sync=False``: every group builds the same
weights) over ``ProcessGroupGloo(timeout=5 s)``, ``torchft.DistributedDataParallel`` and
``torchft.Optimizer`` (``OptimizerWrapper``).

Work per step is ElasWave's: same model, sample ids, keyed dropout, ``torch.set_num_threads``
and AdamW hyper-parameters. Replica group ``g`` always runs micro-batches ``4g .. 4g+3`` of the
step (a fixed data shard per group, like ``torchft.DistributedSampler``) and backpropagates
``loss_sum / 8``; TorchFT averages gradients over the participating groups. With 4 groups that is
ElasWave's gradient; once a group is gone its shard is skipped, so the global batch drops from
32 to 24 samples (TorchFT's default behaviour: no re-sharding, no replacement).

The fault: group 1 SIGKILLs itself in the DDP communication hook of step 15, just before the
gradient all-reduce. The survivors' step 15 fails (``should_commit`` is False), they form a new
quorum without group 1 and redo step 15. The dead group is not restarted. ``kills`` names other
(step, group) faults (:mod:`bench.convergence`). ``rng="torch"``: each group seeds torch's
generator once and runs the layers without ElasWave's keyed dropout, as a TorchFT user's loop
does (its own random numbers).

This file is also the worker: ``python bench/torchft_baseline.py --replica G ...`` (see
:func:`run_torchft`). Each worker appends JSON lines to ``replica<G>.jsonl`` in the output folder.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

FAULT_STEP = 15
VICTIM = 1
LIGHTHOUSE = {"min_replicas": 1, "quorum_tick_ms": 100, "join_timeout_ms": 10000}
HEARTBEAT_TIMEOUT_MS = 5000  # torchft_lighthouse's default
PG_TIMEOUT_S = 5
MANAGER_TIMEOUT_S = 30


# ---- launcher: runs in the benchmark process ---------------------------------------------------
def lighthouse_command(port: int, heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS) -> list[str]:
    """The ``torchft_lighthouse`` binary that ``pip install torchft`` puts next to python."""
    exe = Path(sysconfig.get_path("scripts")) / "torchft_lighthouse"
    opts = {**LIGHTHOUSE, "heartbeat_timeout_ms": heartbeat_timeout_ms}
    return [str(exe), "--bind", f"127.0.0.1:{port}",
            *(f"--{k}={v}" for k, v in opts.items())]  # fmt: skip


def _start(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    from bench.common import REPO_ROOT

    with log.open("w") as fh:
        return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)


def _wait_listening(port: int, proc: subprocess.Popen, limit: float = 30.0) -> None:
    from bench.common import BenchError

    deadline = time.monotonic() + limit
    while time.monotonic() < deadline and proc.poll() is None:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise BenchError(f"torchft_lighthouse did not listen on port {port}")


def run_torchft(
    config: Path,
    out_dir: Path,
    *,
    kill: bool,
    kills: tuple[tuple[int, int], ...] = (),
    rng: str = "keyed",
    world: int = 4,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    pg_timeout_s: float = PG_TIMEOUT_S,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run one TorchFT job to completion; returns the measurements of :func:`analyse`.
    ``kill``: group 1 dies at step 15; ``kills``: (step, group) deaths instead."""
    import torch.distributed as dist

    from bench.common import BenchError, free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    barrier = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASWAVE_", "TORCHFT_"))}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{port}"
    args = ["--config", str(config), "--out", str(out_dir), "--replicas", str(world),
            "--barrier-port", str(barrier.port), "--pg-timeout", str(pg_timeout_s)]  # fmt: skip
    if kill:
        kills = ((FAULT_STEP, VICTIM),)
    if kills:
        args += ["--kills", ",".join(f"{s}:{g}" for s, g in kills)]
    args += ["--rng", rng]
    lighthouse = _start(lighthouse_command(port, heartbeat_timeout_ms), out_dir / "lighthouse.log",
                        env)  # fmt: skip
    procs = []
    try:
        _wait_listening(port, lighthouse)
        start = time.time()
        for g in range(world):
            cmd = [sys.executable, str(Path(__file__)), "--replica", str(g), *args]
            procs.append(_start(cmd, out_dir / f"replica{g}.log", env))
        deadline = time.monotonic() + timeout
        codes = [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    except subprocess.TimeoutExpired as exc:
        raise BenchError(f"torchft job still running after {timeout:g} s; see {out_dir}") from exc
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait()
    end = time.time()
    dead = {g for _, g in kills}
    expected = [-signal.SIGKILL if g in dead else 0 for g in range(world)]
    if codes != expected:
        raise BenchError(f"torchft replica exit codes {codes}, expected {expected}; see {out_dir}")
    return analyse(out_dir, config, world=world, kill=kill, start=start, end=end)


def analyse(
    out_dir: Path, config: Path, *, world: int, kill: bool, start: float, end: float
) -> dict[str, Any]:
    from bench.common import BenchError, read_jsonl
    from elaswave.config import load_config

    t = load_config(config, env={}).train
    share = t.global_batch // world
    recs = {g: read_jsonl(out_dir / f"replica{g}.jsonl") for g in range(world)}
    steps = [r for g in recs for r in recs[g] if r["kind"] == "step"]
    committed: dict[int, list[dict[str, Any]]] = {}
    for r in steps:
        if r["committed"]:
            committed.setdefault(r["step"], []).append(r)
    if sorted(committed) != list(range(1, t.steps + 1)):
        raise BenchError(f"{out_dir}: committed steps {sorted(committed)}")
    loss, step_end, batch = [], [], []
    for s in range(1, t.steps + 1):
        rs = committed[s]
        loss.append(sum(r["loss_sum"] for r in rs) / (share * len(rs)))
        step_end.append(min(r["t"] for r in rs))  # the first group to commit, like rank 0
        batch.append(share * len(rs))
    history = [(step_end[i], i + 1, batch[i]) for i in range(t.steps)]
    result: dict[str, Any] = {
        "loss": loss,
        "step_end": step_end,
        "history": history,
        "global_batch": batch,
        "failed_step_attempts": sorted(r["step"] for r in steps if not r["committed"]),
        "wall_s": round(end - start, 3),
        "launch_to_first_commit_s": round(step_end[0] - start, 3),
    }
    if kill:
        kill_t = next(r["t"] for r in recs[VICTIM] if r["kind"] == "kill")
        first = next(i for i, e in enumerate(step_end) if e > kill_t)
        survivors = [r["t"] for r in committed[first + 1]]
        result.update(
            kill_t=kill_t,
            fault_step=FAULT_STEP,
            mttr_s=step_end[first] - kill_t,
            mttr_last_survivor_s=max(survivors) - kill_t,
            first_step_after_fault=first + 1,
            refault_step_done_s=step_end[FAULT_STEP - 1] - kill_t,
            steps_lost=0,
            steps_redone=1,  # the in-flight step, discarded by should_commit and run again
            global_batch_after=batch[-1],
            world_after=batch[-1] // share,
        )
    return result


# ---- worker: one replica group (one process) ---------------------------------------------------
_ARMED = False


def _die(out: Any, step: int) -> None:
    out.write(json.dumps({"kind": "kill", "step": step, "t": time.time()}) + "\n")
    out.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    global _ARMED
    p = argparse.ArgumentParser()
    for name in ("--replica", "--replicas", "--barrier-port"):
        p.add_argument(name, type=int, default=None)
    p.add_argument("--kills", default="", help="STEP:GROUP,... : those groups die then")
    p.add_argument("--rng", choices=("keyed", "torch"), default="keyed")
    p.add_argument("--pg-timeout", type=float, default=PG_TIMEOUT_S)
    p.add_argument("--config", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    kills = {tuple(int(x) for x in k.split(":")) for k in a.kills.split(",") if k}
    out = (a.out / f"replica{a.replica}.jsonl").open("a", buffering=1)

    def emit(kind: str, **fields: Any) -> None:
        out.write(json.dumps({"kind": kind, "replica": a.replica, **fields}) + "\n")

    emit("start", t=time.time())

    import torch
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    from elaswave.config import load_config
    from elaswave.data.text import resolve_text
    from elaswave.runtime.workload.data import microbatches
    from elaswave.runtime.workload.gpt import per_sample_loss
    from elaswave.runtime.workload.load import build_model, load_workload

    class KillableDDP(DistributedDataParallel):
        """torchft's DDP; its communication hook can kill this group and survives a failure.

        torchft 0.2.0's hook (``torchft/ddp.py``) returns ``work.get_future()._fut`` after
        ``assert fut._fut``. Once a peer has died that breaks: the failed bucket's future is never
        set (gloo's ``wait()`` raised) and later buckets get a ``_DummyWork`` whose plain future has
        no ``_fut``, so every survivor would crash. Here either case yields the (discarded) bucket:
        the manager has recorded the error, so ``should_commit()`` rejects the step.
        """

        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
            if _ARMED:
                _die(out, step)
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            fut = getattr(fut, "_fut", fut)
            if fut is None:
                fut = torch.futures.Future()
                fut.set_result(bucket.buffer())
            return fut

    class Unkeyed(torch.nn.Module):
        """The layers in order, drawing from torch's generator as they come (no keys)."""

        def __init__(self, layers: torch.nn.ModuleList) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
            return x

    cfg = resolve_text(load_config(a.config, env={}))  # text: its tokens (launch's cache)
    t = cfg.train
    torch.set_num_threads(t.threads_per_worker)
    model = build_model(cfg)
    model.train()
    keyed = a.rng == "keyed"
    if not keyed:
        torch.manual_seed(t.seed * 1000 + a.replica)  # after the weights: they stay the same
    inner = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                              weight_decay=t.weight_decay)  # fmt: skip
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout)),
        min_replica_size=1,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        replica_id=f"bench_{a.replica}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=MANAGER_TIMEOUT_S),
        init_sync=False,  # every group builds identical weights from the config's seed
    )  # fmt: skip
    ddp = KillableDDP(manager, model if keyed else Unkeyed(model.layers))
    optimizer = Optimizer(manager, inner)
    workload = load_workload(cfg)
    dataset = workload.dataset(t.seed)
    per_group = t.num_microbatches // a.replicas
    mine = range(a.replica * per_group, (a.replica + 1) * per_group)
    share = per_group * t.micro_batch_size
    # Every group's manager heartbeats before anyone asks for the first quorum, so the first
    # quorum holds all groups (min_replicas=1 would otherwise let early starters go alone).
    barrier = dist.TCPStore("127.0.0.1", a.barrier_port, is_master=False)
    barrier.add("ready", 1)
    while barrier.add("ready", 0) < a.replicas:
        time.sleep(0.01)
    emit("ready", t=time.time())
    while manager.current_step() < t.steps:
        step = manager.current_step() + 1
        optimizer.zero_grad()  # starts the (asynchronous) quorum for this step
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
            _ARMED = last and (step, a.replica) in kills
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(tokens, step, mb.id) if keyed else ddp(tokens)
                loss = per_sample_loss(logits, targets).sum()
                (loss / share).backward()
            loss_sum += loss.item()
        optimizer.step()  # should_commit(): steps the optimizer only if every group succeeded
        done = manager.current_step() == step
        emit("step", step=step, committed=done, loss_sum=loss_sum, t=time.time(),
             participants=manager.num_participants())  # fmt: skip
    manager.shutdown(wait=False)
    out.close()


if __name__ == "__main__":
    main()
