"""What one step sums over the plan's ranks: the gradient sums and a small typed record beside
them (the tail).

The gradient sums are laid out like the state's flat buffers and kept in the reduction dtype
(``train.reduce_dtype``: float32 by default). The tail's values are counts and an epoch as much
as they are losses, and a float32 sum stops being exact past 2^24: a plan epoch summed over
10^5 ranks, or a token count of a long-context batch, would be off by some units, and the engine
compares the epoch sum exactly. So the tail is its own float64 tensor, reduced in float64
whatever the gradients' dtype: every integer below 2^53 stays exact (an epoch of 10^4 summed over
10^6 ranks is 10^10; a batch of 2^40 tokens is 2^40).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["StepSums", "StepTail"]


class StepTail:
    """One step's record on this rank, summed over the plan's ranks by one all-reduce of
    :attr:`values` (float64):

    - ``loss``: the sum of this rank's micro-batches' loss sums;
    - ``epoch``: the newest plan epoch this rank has seen (the sum tells the engine whether
      some rank saw a newer plan than the one it runs);
    - ``flag``: a strategy's flag (pipelines: this rank's migrations are ready);
    - ``count``: the loss terms counted (samples, tokens): gradient and loss are divided by it;
    - ``nonfinite``: 1 where this rank's loss sum or gradient sums are not finite, or the step is
      one the job skips (``train.skip_steps``); summed, the ranks that say so (every rank skips
      the step when it is not 0);
    - ``preempt``: 1 where this rank's host is being preempted; summed, not 0 tells every rank
      to checkpoint this step and leave.
    """

    LOSS, EPOCH, FLAG, COUNT, NONFINITE, PREEMPT = range(6)
    SIZE = 6

    __slots__ = ("values",)

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.values = torch.zeros(self.SIZE, dtype=torch.float64, device=device)

    def zero(self) -> None:
        self.values.zero_()

    def add(self, loss: torch.Tensor, count: int | torch.Tensor) -> None:
        """Add a loss sum and its count (no host sync)."""
        self.values[self.LOSS] += loss.to(torch.float64)
        self.values[self.COUNT] += count

    def fresh(self) -> StepTail:
        """A zeroed tail on the same device (a redo never reuses a tensor an abandoned
        collective may still write into)."""
        return StepTail(self.values.device)

    # Setters take a tensor too: a loss sum written without a host sync.
    @property
    def loss(self) -> float:
        return float(self.values[self.LOSS])

    @loss.setter
    def loss(self, value: float | torch.Tensor) -> None:
        self.values[self.LOSS] = value

    @property
    def epoch(self) -> int:
        return int(self.values[self.EPOCH])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self.values[self.EPOCH] = value

    @property
    def flag(self) -> int:
        return int(self.values[self.FLAG])

    @flag.setter
    def flag(self, value: float) -> None:
        self.values[self.FLAG] = value

    @property
    def count(self) -> int:
        return int(self.values[self.COUNT])

    @count.setter
    def count(self, value: int | torch.Tensor) -> None:
        self.values[self.COUNT] = value

    @property
    def mean_loss(self) -> float:
        """The batch's mean loss, once reduced (a step that is not applied reports it too)."""
        return self.loss / max(self.count, 1)

    @property
    def nonfinite(self) -> int:
        return int(self.values[self.NONFINITE])

    @property
    def preempt(self) -> int:
        return int(self.values[self.PREEMPT])

    @preempt.setter
    def preempt(self, value: int) -> None:
        self.values[self.PREEMPT] = value

    def judge(self, grads: torch.Tensor, *, skip: bool) -> torch.Tensor:
        """Before the reduction: whether this rank's loss sum or ``grads`` (the gradient sums it
        brings to the step) are not finite, or ``skip`` says the step is skipped anyway; set
        and returned (a one-element bool tensor, this rank's own values' verdict). A sum is
        finite only when every element it adds is (in float64, finite float32 values cannot
        overflow it)."""
        v = self.values
        bad = ~torch.isfinite(v[self.LOSS] + grads.sum(dtype=torch.float64))
        v[self.NONFINITE] = 1.0 if skip else bad.to(torch.float64)
        return bad

    def __repr__(self) -> str:
        return (
            f"StepTail(loss={self.loss}, epoch={self.epoch}, flag={self.flag}, count={self.count}, "
            f"nonfinite={self.nonfinite})"
        )


@dataclass
class StepSums:
    """One step's sums on this rank before the reduction, and every rank's after it: ``grads``
    (the gradient sums, laid out like the state's flat buffers, in the reduction dtype) and
    ``tail`` (:class:`StepTail`, float64)."""

    grads: torch.Tensor
    tail: StepTail
