"""One training step of one pipeline stage: the 1F1B schedule over its replica's micro-batches.

Forward runs this stage's layers (RNG keyed by (seed, step, micro-batch, layer)); the last stage
computes the workload's loss, scaled by 1/B. Backward sums the stage's layer gradients in an
accumulator that no collective writes into (autograd's gradient buffer, or a float64 one), and
records what it holds there (:class:`~elaswave.runtime.strategies.pipeline.stageredo.StageKept`,
what a partial redo keeps after a fault); the sums go into the step's reduction buffer once the
schedule is done. Activations go forward and their gradients back as point-to-point messages
whose shapes and dtypes come from the workload (``Workload.boundary``), on the state's device.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from elaswave.planning.schedule import Comm, Compute, schedule_roles
from elaswave.runtime.strategies.pipeline.stageredo import StageKept, masked
from elaswave.runtime.strategies.pipeline.stagetimes import StageTimer
from elaswave.runtime.strategies.sums import StepSums
from elaswave.runtime.timing import busy_mark, busy_since
from elaswave.runtime.workload.data import MicroBatch

if TYPE_CHECKING:
    from elaswave.runtime.state import RankContext

TAG_ACT, TAG_GRAD = 1, 2

__all__ = ["StageStep", "StageTools"]


@dataclass(frozen=True)
class StageTools:
    """What a step needs of its rank's stage: the model's layer count, a layer range's flat
    span, the timer of the stage's layers, a layer range's share of the model's cost, and the
    emulated device's pause after a layer range's forward or backward."""

    num_layers: int
    span: Callable[[range], slice]
    timer: StageTimer
    cost_share: Callable[[range], float]
    device_pause: Callable[[range, bool], None]


class StageStep:
    """The state of one step of this rank's stage (built for the step, then dropped)."""

    def __init__(
        self,
        ctx: RankContext,
        tools: StageTools,
        step: int,
        *,
        sums: StepSums,
        mbs: list[MicroBatch],
        broken: Callable[[], bool],
        kept: StageKept,
        acc: torch.Tensor | None = None,
        masks: dict[int, frozenset[int]] | None = None,
        replicas: list[int] | None = None,
    ) -> None:
        """``kept``: the record of what the accumulator holds (continued by a redo); ``acc``:
        the float64 accumulator of the stage's layers (``None``: autograd's gradient buffer
        accumulates, in the reduction's own dtype); ``masks``: per layer, the micro-batches
        whose gradient (and, for the last layer, loss) another rank keeps; ``replicas``: the
        replica of each of ``mbs`` (None: this rank's own), whose neighbouring stages its
        activations come from and go to (a rank running a lost stage for another replica too:
        ``stage_loss: recycle``)."""
        plan = ctx.plan
        assert plan is not None
        self.ctx, self.tools, self.step, self.sums, self.mbs, self.broken = (
            ctx, tools, step, sums, mbs, broken,
        )  # fmt: skip
        self.kept, self.acc, self.masks = kept, acc, masks or {}
        rank = ctx.comm.rank("dp")
        d, self.stage = plan.position(rank)
        self.stages = len(plan.replicas[d])
        self.layers = layers = plan.stage_layers(rank)
        self.replica_of = replicas if replicas is not None else [d] * len(mbs)
        s = self.stage
        # per replica: the ranks of the stages before and after this one (None: none)
        self.neighbours: dict[int, tuple[int | None, int | None]] = {}
        for e in set(self.replica_of):
            ranks = plan.replicas[e]
            self.neighbours[e] = (
                ranks[s - 1] if s > 0 else None,
                ranks[s + 1] if s + 1 < self.stages else None,
            )
        self.first, self.last = layers.start == 0, layers.stop == tools.num_layers
        self.region = tools.span(layers)
        # What arrives from the previous stage and what goes back to it; what this stage sends
        # and the gradient that comes back for it (shapes and dtypes: the workload's).
        workload, size = ctx.state.workload, ctx.cfg.train.micro_batch_size
        self.spec_in = workload.boundary(layers.start - 1, size) if not self.first else None
        self.spec_out = workload.boundary(layers.stop - 1, size) if not self.last else None
        self.inputs: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.grads_in: dict[int, torch.Tensor] = {}
        # The last stage's losses stay where they are computed (no host sync per micro-batch)
        # until their backward is done: then they count, in float64 like the Python float they
        # replace, so the sums keep their bits.
        self.losses: dict[int, tuple[torch.Tensor, int]] = {}

    def run(self, slow: float) -> float | None:
        """The whole schedule; returns busy seconds per micro-batch (``None``: no micro-batch).
        ``slow``: extra seconds per micro-batch of the whole model (a ``slow`` fault); the stage
        sleeps its layers' cost share of it, half after the forward and half after the backward."""
        tools, ctx = self.tools, self.ctx
        tools.timer.begin(self.layers)
        busy = 0.0
        extra = slow * tools.cost_share(self.layers) / 2
        for item in schedule_roles(self.stage, self.stages, self.replica_of):
            if isinstance(item, Compute):
                ctx.enter("compute")
                mark = busy_mark()
                if item.kind == "F":
                    self.forward(item.mb)
                else:
                    self.backward(item.mb)
                if extra:
                    time.sleep(extra)
                busy += busy_since(mark)
            else:
                self.exchange(item)
        flat = ctx.state.flat
        sums = self.acc if self.acc is not None else flat.at(flat.collect_grads())[self.region]
        flat.at(self.sums.grads)[self.region].copy_(sums)
        if self.last and self.kept.loss is not None:
            self.sums.tail.add(self.kept.loss, self.kept.count)
        tools.timer.end(len(self.mbs), [tools.cost_share(range(i, i + 1)) for i in self.layers])
        return busy / len(self.mbs) if self.mbs else None

    def forward(self, i: int) -> None:
        st, timer = self.ctx.state, self.tools.timer
        mb = self.mbs[i]
        # Only the first stage needs the inputs and only the last the targets.
        data, targets = st.microbatch(mb.sample_ids) if self.first or self.last else (None, None)
        h = data if self.first else self.inputs[i]
        assert h is not None  # a first stage reads its micro-batch's inputs above
        kept_elsewhere = [st.model.layers[j] for j in self.layers if mb.id in self.masks.get(j, ())]
        with masked(kept_elsewhere):
            for index in self.layers:
                with timer.forward(index):
                    h = st.model.run_layer(index, h, self.step, microbatch=mb.id)
        with timer.pause():
            self.tools.device_pause(self.layers, False)
        if self.last:
            loss, count = st.loss(h, targets)
            self.losses[i] = (loss.detach(), count)
            self.outputs[i] = loss  # its gradient is divided by the batch's count later
        else:
            self.outputs[i] = h

    def backward(self, i: int) -> None:
        out = self.outputs.pop(i)
        grad_in = None if self.last else self.grads_in.pop(i)
        with self.tools.timer.backward():
            if out.requires_grad:  # not when every layer of a first stage is kept elsewhere
                out.backward(grad_in)
        with self.tools.timer.pause():
            self.tools.device_pause(self.layers, True)
        if self.acc is not None:  # the float64 sums take each micro-batch's as it comes
            flat = self.ctx.state.flat
            grad = flat.at(flat.collect_grads())[self.region]
            self.acc.add_(grad)
            grad.zero_()
        mb = self.mbs[i].id
        loss, count = self.losses.pop(i, (None, 0))
        if loss is not None and mb in self.masks.get(self.tools.num_layers - 1, ()):
            loss, count = None, 0  # another rank counted it
        self.kept.add(mb, self.masks, loss, count=count)

    def exchange(self, item: Comm) -> None:
        """Post this slot's sends and receives together; received activations need gradients."""
        sends = [self.message(k, i, True) for k, i in item.sends]
        recvs = [self.message(k, i, False) for k, i in item.recvs]
        self.ctx.enter("collective")
        self.ctx.comm.p2p("dp", sends, recvs, abort=self.broken)
        for kind, i in item.recvs:
            if kind == "act" and self.inputs[i].is_floating_point():
                self.inputs[i].requires_grad_(True)

    def message(self, kind: str, i: int, sending: bool) -> tuple[int, torch.Tensor, int]:
        """(peer, tensor, tag) of an activation (``act``) or its gradient going back."""
        device = self.ctx.state.device
        prev_rank, next_rank = self.neighbours[self.replica_of[i]]
        if kind == "act":
            peer = next_rank if sending else prev_rank
            if sending:
                tensor = self.outputs[i].detach()
            else:
                spec = self.spec_in
                assert spec is not None
                tensor = torch.empty(spec.shape, dtype=spec.dtype, device=device)
                self.inputs[i] = tensor
            assert peer is not None
            return peer, tensor, TAG_ACT
        peer = prev_rank if sending else next_rank
        if sending:
            grad = self.inputs.pop(i).grad
            assert grad is not None
            tensor = grad
        else:
            spec = self.spec_out
            assert spec is not None
            tensor = self.grads_in[i] = torch.empty(spec.shape, dtype=spec.dtype, device=device)
        assert peer is not None
        return peer, tensor, TAG_GRAD
