"""Plain PyTorch DDP doing exactly ElasWave's work per step: the overhead baseline.

Same model (``build_model``), data (the workload's data set, ``microbatches``, its collate), keyed
dropout RNG, global batch and micro-batch size, ``torch.set_num_threads(1)``, and AdamW with the
config's hyper-parameters. Each of the W processes runs its contiguous share of the step's
micro-batches with ``no_sync()`` for all but the last, so there is one gradient all-reduce per
step (DDP's bucketed float32 all-reduce, overlapped with the last backward).

Loss scaling: ElasWave sums gradients of the micro-batches' loss sums and divides by the
batch's count of loss terms (samples for the GPT, target tokens for a language model); DDP
*averages* over W ranks, so each micro-batch's loss sum is multiplied by W / (the batch's
count) to yield the same gradient. The workload's own ``loss`` gives (sum, count); every
micro-batch of these benchmark workloads counts the same number of terms (checked).
``train.autocast: bf16`` runs the layers under bf16 autocast, as ElasWave's workers do.

``device="cuda"``: rank ``r`` on ``cuda:r`` and NCCL. The model is built on the CPU (its seeded
initial values) and moved, each micro-batch moved when collated, and the clock read after the
device finished the step, as ElasWave's workers do. A world of one trains the bare model: a
plain PyTorch loop (forward and backward of every micro-batch, one optimizer step), with nothing
to all-reduce (``bench/gpustep.py`` compares one ElasWave worker with it).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ddp(
    config: Path, *, steps: int, world: int, out_dir: Path, device: str = "cpu"
) -> dict[str, Any]:
    """Spawn ``world`` workers on 127.0.0.1 (gloo on the CPU; ``device="cuda"``: one GPU each,
    NCCL); returns rank 0's timings and per-step losses."""
    from bench.common import free_port

    out = out_dir / "ddp.json"
    # Children inherit the environment: one OpenMP thread, as ElasWave's daemon gives its workers.
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        mp.spawn(
            _worker, args=(world, free_port(), str(config), steps, str(out), device), nprocs=world
        )
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return json.loads(out.read_text())


def _worker(
    rank: int, world: int, port: int, config: str, steps: int, out: str, device: str = "cpu"
) -> None:
    from elaswave.config import load_config
    from elaswave.runtime.evaluate import training_samples
    from elaswave.runtime.state import AUTOCAST, to_device
    from elaswave.runtime.workload.data import microbatches
    from elaswave.runtime.workload.load import build_model, load_workload

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback, like ElasWave's local groups
    cfg = load_config(config, env={})
    t = cfg.train
    torch.set_num_threads(t.threads_per_worker)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    backend = "nccl" if dev.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)
    try:
        model = build_model(cfg).to(dev)  # built on the CPU (its seeded values), then moved
        model.autocast = AUTOCAST[t.autocast]
        model.train()
        ids = [rank] if dev.type == "cuda" else None
        ddp = (
            torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if world > 1 else model
        )  # a world of one: the bare model, a plain loop
        opt = torch.optim.AdamW(
            ddp.parameters(), lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
            weight_decay=t.weight_decay,
        )  # fmt: skip
        workload = load_workload(cfg)
        dataset = workload.dataset(t.seed)
        # The samples training draws from: the held-out ones (data.eval_samples) are not.
        trained = training_samples(len(dataset), cfg.data.eval_samples)
        per_rank = t.num_microbatches // world
        assert per_rank * world == t.num_microbatches, "micro-batches must divide evenly"
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        per_mb_count: list[int] = []  # each micro-batch's count of loss terms (all equal)
        ends, inner, local_loss = [], [], []
        dist.barrier()
        ends.append(time.perf_counter())  # "step 0" end: all ranks leave the barrier together
        for step in range(1, steps + 1):
            start = time.perf_counter()
            every = microbatches(
                t.seed,
                step,
                t.global_batch,
                micro_batch_size=t.micro_batch_size,
                num_samples=trained,
            )
            loss_sum = 0.0
            for k, i in enumerate(mine):
                mb = every[i]
                batch = workload.collate([dataset[i] for i in mb.sample_ids])
                tokens, targets = to_device(batch, dev)
                last = k == len(mine) - 1
                with contextlib.nullcontext() if last or world == 1 else ddp.no_sync():
                    logits = ddp(tokens, step, mb.id)
                    loss, count = workload.loss(logits, targets)
                    per_mb_count.append(int(count))
                    assert per_mb_count[-1] == per_mb_count[0], "uneven counts per micro-batch"
                    # DDP averages over ranks; the batch counts count × num_microbatches terms
                    (loss * (world / (per_mb_count[0] * t.num_microbatches))).backward()
                loss_sum += loss.item()
            opt.step()
            opt.zero_grad()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)  # the step is done when the device is
            ends.append(time.perf_counter())
            inner.append(ends[-1] - start)
            local_loss.append(loss_sum)
        # Off the clock: global per-step losses, to check that both systems did the same work.
        losses = torch.tensor(local_loss, dtype=torch.float64, device=dev)
        dist.all_reduce(losses)
        if rank == 0:
            result = {
                "step_ends": ends,
                "step_seconds": inner,
                "loss": (losses / (per_mb_count[0] * t.num_microbatches)).tolist(),
                "world": world,
                "reducer": "DDP float32 bucketed all-reduce (average)"
                if world > 1
                else "none (a world of one: a plain loop)",
                "device": str(dev),
            }
            Path(out).write_text(json.dumps(result))
    finally:
        _shutdown(store, rank, world)
    # Leave without running destructors: gloo's process-group teardown under DDP can deadlock on
    # the GIL at interpreter exit (seen here several times); the results are already written.
    os._exit(0)


def _shutdown(store: dist.TCPStore, rank: int, world: int) -> None:
    """Tear down in order: rank 0 hosts the store, so it leaves only after every rank is done."""
    dist.destroy_process_group()
    store.add("exited", 1)
    deadline = time.monotonic() + 30.0
    while rank == 0 and store.add("exited", 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)
