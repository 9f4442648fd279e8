"""Held-out evaluation (``train.eval_every``, ``data.eval_samples``).

The data set's last ``eval_samples`` samples are held out: training draws only from the ones
before them. Every ``eval_every`` committed steps the ranks score those samples with the
model in eval mode (no dropout), without gradients, in fixed micro-batches: micro-batch ``i``
on rank ``i mod world``. Each rank writes its micro-batches' (loss sum, count, top-1 hits of a
classifier) into its own slots of one float64 vector, zeros elsewhere; the sum over ranks of a
slot is then exact (one value plus zeros), and the loss is summed over the slots in their fixed
order. So the eval loss is the same number whichever ranks, and how many, computed it.

Pipeline stages hold only their layers: micro-batch ``i`` goes through the stages of the
serving replica ``i mod replicas``, which pass its activations on as in training
(:meth:`Strategy.score`); the slots are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from elaswave.runtime.state import RankContext, TrainState
from elaswave.runtime.strategies.base import DP, Strategy
from elaswave.runtime.workload.base import Workload

__all__ = ["eval_microbatches", "evaluate", "training_samples"]


def training_samples(total: int, held_out: int) -> int:
    """How many samples (ids ``0 .. n - 1``) training draws from, the rest held out."""
    if held_out >= total:
        raise ValueError(
            f"data.eval_samples ({held_out}) leaves none of the data set's {total} samples "
            "for training"
        )
    return total - held_out


def eval_microbatches(total: int, held_out: int, micro: int) -> list[list[int]]:
    """The held-out sample ids (the last ``held_out`` of ``total``) in micro-batches."""
    ids = list(range(total - held_out, total))
    return [ids[i : i + micro] for i in range(0, len(ids), micro)]


def evaluate(
    ctx: RankContext, strategy: Strategy, broken: Callable[[], bool]
) -> tuple[float, int, float | None]:
    """(mean held-out loss, samples scored, top-1 accuracy or None where the workload is no
    classifier), the same on every rank; a collective."""
    st, cfg, comm = ctx.state, ctx.cfg, ctx.comm
    batches = eval_microbatches(len(st.dataset), cfg.data.eval_samples, cfg.train.micro_batch_size)
    slots = torch.zeros(3 * len(batches), dtype=torch.float64, device=st.device)
    st.model.eval()
    try:
        with torch.no_grad():
            strategy.score(batches, slots, broken)
    finally:
        st.model.train()
    comm.allreduce(DP, slots, broken)
    count = float(slots[1::3].sum())
    if count <= 0:
        raise ValueError("the held-out samples count no loss terms")
    samples = sum(len(b) for b in batches)
    classifies = _classifies(st, batches[0])
    accuracy = float(slots[2::3].sum()) / samples if classifies else None
    return float(slots[0::3].sum()) / count, samples, accuracy


def _classifies(st: TrainState, batch: list[int]) -> bool:
    """Whether the workload scores accuracy: asked on every rank alike (of zeros shaped like
    the model's output), since not every rank computes the model's output."""
    workload = st.workload
    if type(workload).correct is Workload.correct:
        return False
    spec = workload.boundary(workload.num_layers - 1, len(batch))
    _, targets = st.microbatch(batch)
    output = torch.zeros(spec.shape, dtype=spec.dtype, device=st.device)
    return workload.correct(output, targets) is not None
