"""ZeRO-3's layer-wise data path in real gloo processes, against plain autograd of the whole model.

Each rank is a process with its own Communicator: it keeps only its shards, gathers each layer
while it runs (the next layer's all-gather posted ahead), recomputes it for its backward from
the kept input, and reduce-scatters the layer's gradient. Over 1 to 4 ranks the batch's reduced
gradient (every rank's part, gathered whole here) must be, bit for bit in the float64 mode, the
sum that autograd gives when one process runs the whole model over every micro-batch; and the
updated parameters those of replicated data parallelism on one rank. The model is the built-in
GPT with dropout, so the recomputed forward must draw the very masks the first forward drew.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elaswave.config import JobConfig
from elaswave.runtime.state import TrainState
from elaswave.runtime.workload.data import microbatches

GLOBAL_BATCH, MICRO, SEED = 12, 1, 11
CONFIG: dict[str, Any] = {
    "zero": 3,
    "model": {"source": "gpt", "n_layer": 2, "n_head": 2, "d_model": 16, "seq_len": 8,
              "vocab_size": 40, "dropout": 0.2},
    "train": {"global_batch": GLOBAL_BATCH, "micro_batch_size": MICRO, "seed": SEED,
              "reduce_dtype": "float64", "lr": 0.01},
    "data": {"num_samples": 256},
    "elastic": {"nproc_per_node": 4},
}  # fmt: skip

RANK = textwrap.dedent(
    """
    import json, sys, torch
    from elaswave.config import JobConfig
    from elaswave.procutil import exit_now
    from elaswave.planning.plan import Plan, assign_microbatches
    from elaswave.runtime.comm.communicator import Communicator
    from elaswave.runtime.durable.restore import DurableSource
    from elaswave.runtime.state import RankContext, TrainState
    from elaswave.runtime.strategies.base import step_sums
    from elaswave.runtime.strategies.select import strategy_for
    from elaswave.runtime.workload.data import microbatches

    rank, world, address, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    cfg = JobConfig.from_dict(json.loads(sys.argv[5]))
    never = lambda: False
    torch.set_num_threads(1)
    state = TrainState.build(cfg)
    workers = tuple(f"w{r}" for r in range(world))
    comm = Communicator(me=workers[rank], host_addr="127.0.0.1", rendezvous_timeout=60,
                        collective_timeout=60, waker=lambda ev: (lambda: None))
    comm.configure({"dp": workers}, store=address, epoch=1, abort=never)
    t = cfg.train
    plan = Plan(epoch=1, workers=workers, hosts=("h",) * world, store=address, committed=0,
                microbatches=assign_microbatches(t.global_batch // t.micro_batch_size,
                                                 [1.0] * world))
    ctx = RankContext(state, cfg, comm, workers[rank], lambda kind, **f: None, lambda m: None,
                      lambda phase: None, lambda w: False, plan)
    strategy = strategy_for(ctx, DurableSource(ctx, None))
    strategy.sync(plan, never)
    sums = step_sums(state, t.reduce_dtype)
    every = microbatches(t.seed, 1, t.global_batch, micro_batch_size=t.micro_batch_size,
                         num_samples=len(state.dataset))
    strategy.compute(1, every, sums, slowdown=0.0)
    grad = strategy.zero.gather(comm, strategy.path.grads.clone(), never)  # the reduced sums, whole
    tail = sums.tail.fresh()
    tail.values.copy_(sums.tail.values)
    comm.allreduce("dp", tail.values, never)
    strategy.reduce_update(1, sums, never, before_update=lambda: None)
    params = strategy.whole(never).params
    torch.save({"grad": grad, "loss": tail.loss, "count": float(tail.count),
                "params": params, "gathered": strategy.path.gather.peak}, out)
    # as a worker ends: torch's teardown with gloo's threads still up can abort the process
    # ("terminate called without an active exception")
    exit_now(0)
    """
)


def _cfg() -> JobConfig:
    return JobConfig.from_dict(CONFIG)


def _plain() -> tuple[torch.Tensor, float, float, torch.Tensor]:
    """One process, the whole model, autograd over every micro-batch of step 1 (float32
    gradients summed in float64 in micro-batch order, as data parallelism sums them); then the
    update of replicated data parallelism."""
    from elaswave.runtime.strategies.base import mean_gradient
    from elaswave.runtime.strategies.sums import StepSums, StepTail

    cfg = JobConfig.from_dict({**CONFIG, "zero": 0})
    st = TrainState.build(cfg)
    acc = torch.zeros(st.flat.numel, dtype=torch.float64)
    loss_sum, count = 0.0, 0
    for mb in microbatches(
        SEED, 1, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=len(st.dataset)
    ):
        inputs, targets = st.microbatch(mb.sample_ids)
        loss, n = st.loss(st.model(inputs, 1, mb.id), targets)
        loss.backward()
        grad = st.flat.collect_grads()
        acc.add_(grad)
        grad.zero_()
        loss_sum, count = loss_sum + float(loss.detach()), count + n
    tail = StepTail()
    tail.loss, tail.count = loss_sum, count
    grad, _, _ = mean_gradient(StepSums(acc.clone(), tail))
    st.opt.step(st.flat.data, grad, st.opt.hyper.groups)
    return acc, loss_sum, float(count), st.flat.data.clone()


@pytest.fixture(scope="module")
def plain() -> tuple[torch.Tensor, float, float, torch.Tensor]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every rank (a kernel's sums may depend on its threads)
    try:
        return _plain()
    finally:
        torch.set_num_threads(threads)


def _ranks(world: int, tmp: Path) -> list[dict[str, Any]]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))  # fmt: skip
    address = f"127.0.0.1:{store.port}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RANK,
                str(r),
                str(world),
                address,
                str(tmp / f"r{r}.pt"),
                json.dumps(CONFIG),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    return [torch.load(tmp / f"r{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_layerwise_gradient_is_plain_autograd_bit_for_bit(
    world: int, tmp_path: Path, plain: tuple[torch.Tensor, float, float, torch.Tensor]
) -> None:
    grad, loss, count, params = plain
    out = _ranks(world, tmp_path)
    for r in out:
        assert torch.equal(r["grad"], grad), (r["grad"] - grad).abs().max()
        assert (r["loss"], r["count"]) == (loss, count)
        assert torch.equal(r["params"], params), "the update is replicated data parallelism's"
    layers = TrainState.build(_cfg()).segments
    biggest = max(n for _, n in layers) * 4
    # a layer gathered, the next one posted, the layer's gradient (float32 and float64 sums)
    # with its reduce-scatter's send buffer: bounded by layers, never the whole model
    assert all(0 < r["gathered"] <= 8 * biggest for r in out)
    assert grad.abs().sum() > 0
