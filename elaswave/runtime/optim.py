"""Parameters and optimizer state as flat buffers.

Keeping every parameter, gradient and Adam moment in one contiguous tensor makes a whole rank's
state one buffer to snapshot, checksum, broadcast to a joining peer, or shard (ZeRO). The AdamW
update is element-wise, so its result does not depend on how the buffer is laid out or split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


class FlatParams:
    """Re-points a module's parameters (and their grads) at views of two flat float32 buffers,
    on the device the module's parameters live on."""

    def __init__(self, module: nn.Module) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.data = torch.empty(self.numel, dtype=torch.float32, device=device)
        self.grad = torch.zeros(self.numel, dtype=torch.float32, device=device)
        offset = 0
        for p in self.params:
            n = p.numel()
            self.data[offset : offset + n].copy_(p.detach().reshape(-1))
            p.data = self.data[offset : offset + n].view_as(p)
            p.grad = self.grad[offset : offset + n].view_as(p)
            offset += n

    def grads_in_place(self) -> bool:
        """True while every ``p.grad`` still views ``self.grad`` (autograd accumulated in place)."""
        base = self.grad.data_ptr()
        end = base + self.grad.numel() * self.grad.element_size()
        return all(p.grad is not None and base <= p.grad.data_ptr() < end for p in self.params)

    def collect_grads(self) -> torch.Tensor:
        """The flat gradient; re-points grads at the flat buffer if autograd replaced them."""
        if not self.grads_in_place():
            offset = 0
            for p in self.params:
                n = p.numel()
                g = p.grad if p.grad is not None else torch.zeros_like(p)
                self.grad[offset : offset + n].copy_(g.reshape(-1))
                p.grad = self.grad[offset : offset + n].view_as(p)
                offset += n
        return self.grad


def learning_rate(
    step: int, *, lr: float, schedule: str, warmup: int, total: int, min_lr: float
) -> float:
    """The learning rate of ``step`` (from 1): linear warmup to ``lr`` over ``warmup`` steps,
    then ``lr`` (constant) or a cosine from ``lr`` down to ``min_lr`` at step ``total``. A pure
    function of the step: a redone step, on any rank, gets the same rate."""
    if warmup and step <= warmup:
        return lr * step / warmup
    if schedule == "constant":
        return lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


@dataclass
class AdamWHyper:
    lr: float
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: str = "constant"  # "constant" | "cosine" (see learning_rate)
    warmup: int = 0
    total: int = 0  # the step the cosine reaches min_lr at
    min_lr: float = 0.0

    def lr_at(self, step: int) -> float:
        return learning_rate(
            step, lr=self.lr, schedule=self.schedule, warmup=self.warmup, total=self.total,
            min_lr=self.min_lr,
        )  # fmt: skip


class FlatAdamW:
    """AdamW over a flat parameter buffer (or any slice of one: ZeRO shards reuse it)."""

    def __init__(self, numel: int, hyper: AdamWHyper, device: torch.device | None = None) -> None:
        self.hyper = hyper
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.step_count = 0

    def step(self, param: torch.Tensor, grad: torch.Tensor) -> None:
        self.step_count += 1
        adamw_(param, grad, self.exp_avg, self.exp_avg_sq, self.step_count, self.hyper)


def adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    h: AdamWHyper,
) -> None:
    """One AdamW update in place (``step`` counts from 1, the learning rate is the schedule's at
    ``step``). Element-wise: applying it to a slice gives the same values as applying it to the
    whole buffer."""
    lr = h.lr_at(step)
    exp_avg.mul_(h.beta1).add_(grad, alpha=1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias1 = 1 - h.beta1**step
    bias2 = 1 - h.beta2**step
    if h.weight_decay:
        param.mul_(1 - lr * h.weight_decay)
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


def clip_factor(
    mean: torch.Tensor, max_norm: float, ties: Sequence[tuple[slice, slice]] = ()
) -> float:
    """``min(1, max_norm / ‖mean‖)`` for the whole model's mean gradient in flat order (the
    second copy of a tied weight not counted twice); 1 when clipping is off. The norm is taken
    over the same numbers in the same order on every rank and under every strategy, so the
    deterministic mode stays bit-identical with clipping on."""
    if not max_norm:
        return 1.0
    sq = float(torch.linalg.vector_norm(mean, dtype=torch.float64)) ** 2
    for _, b in ties:
        sq -= float(torch.linalg.vector_norm(mean[b], dtype=torch.float64)) ** 2
    return min(1.0, max_norm / (math.sqrt(max(sq, 0.0)) + 1e-6))
