"""The loop ``python -m bench ownloop`` times: a plain PyTorch loop (an MLP with dropout on
fixed random data, AdamW with a cosine schedule), run by ``elaswave launch --script`` when this
file is the script; :func:`ddp_worker` runs the same loop under plain DDP."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IN, WIDTH, DEPTH, CLASSES, SAMPLES, LR = 256, 1024, 3, 10, 4096, 1e-3


def build_model() -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(IN, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Dropout(0.1)]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def dataset() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, IN, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return list(zip(x, y, strict=True))


def optimizer_for(model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, object]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)


def elaswave_main() -> None:
    import elaswave

    job = elaswave.init()
    model = build_model()
    opt, sched = optimizer_for(model, job.total_steps)
    job.register(model, opt, sched)
    for step in job.steps(dataset=dataset()):
        for mb in step.micro_batches():
            loss = F.cross_entropy(model(mb.inputs), mb.targets, reduction="sum")
            step.backward(loss, count=mb.size)
        step.commit()
    job.finish()


def ddp_worker(
    rank: int, world: int, port: int, steps: int, global_batch: int, micro: int, out: str
) -> None:
    """The same loop under DDP: this rank's contiguous share of the step's micro-batches (the
    samples ElasWave's step draws), ``no_sync`` for all but the last, one AdamW step."""
    import torch.distributed as dist

    from elaswave.runtime.workload.data import microbatches

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt, sched = optimizer_for(model, steps)
    data = dataset()
    per_rank = global_batch // micro // world
    mine = range(rank * per_rank, (rank + 1) * per_rank)
    ends: list[float] = []
    dist.barrier()
    ends.append(time.perf_counter())
    for step in range(1, steps + 1):
        every = microbatches(0, step, global_batch, micro_batch_size=micro, num_samples=len(data))
        for k, i in enumerate(mine):
            batch = torch.utils.data.default_collate([data[s] for s in every[i].sample_ids])
            with contextlib.nullcontext() if k == len(mine) - 1 else ddp.no_sync():
                loss = F.cross_entropy(ddp(batch[0]), batch[1], reduction="sum")
                (loss * world / global_batch).backward()  # DDP averages over the ranks
        opt.step()
        sched.step()
        opt.zero_grad()
        ends.append(time.perf_counter())
    if rank == 0:
        Path(out).write_text(json.dumps({"step_ends": ends}))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's teardown under DDP can hang at interpreter exit


if __name__ == "__main__":
    elaswave_main()
