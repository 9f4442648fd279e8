"""Parameters and optimizer state as flat buffers.

Keeping every parameter, gradient and optimizer moment in one contiguous tensor makes a whole
rank's state one buffer to snapshot, checksum, broadcast to a joining peer, or shard (ZeRO). The
AdamW and SGD updates are element-wise (parameter groups are a per-element group index), so
their result does not depend on how the buffer is laid out or split.
"""

from __future__ import annotations

import bisect
import fnmatch
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from elaswave.runtime.optimizers import ScheduleReplay, TorchRule


class FlatParams:
    """Re-points a module's parameters (and their grads) at views of two flat float32 buffers,
    on the device the module's parameters live on.

    The buffers may hold a window of a larger model's flat layout (a pipeline rank's layers):
    element ``i`` of them is element ``base + i`` of the whole model's ``total``; :meth:`at`
    translates the whole model's offsets."""

    def __init__(
        self,
        module: nn.Module,
        *,
        base: int = 0,
        total: int | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.base = base
        self.total = self.numel if total is None else total
        if device is None:
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

    def release(self) -> None:
        """Free both buffers' memory (a ZeRO-3 pipeline stage between steps). The parameters
        and gradients keep viewing them, with no storage behind, until :meth:`reserve`."""
        for t in (self.data, self.grad):
            free(t)

    def reserve(self) -> None:
        """The buffers' memory back after :meth:`release`; what they hold is undefined until
        the caller fills it."""
        for t in (self.data, self.grad):
            size = t.numel() * t.element_size()
            if t.untyped_storage().nbytes() < size:
                t.untyped_storage().resize_(size)

    def at(self, tensor: torch.Tensor) -> Spans:
        """``tensor`` (laid out like these buffers) indexed by the whole model's offsets."""
        return Spans(tensor, self.base)

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


def free(t: torch.Tensor) -> None:
    """Release ``t``'s memory; ``t`` and its views stay, with no storage behind them."""
    t.untyped_storage().resize_(0)


def freed(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory was released (:func:`free`)."""
    return t.untyped_storage().nbytes() == 0 < t.numel()


class Spans:
    """A tensor that holds the whole model's flat elements ``[base, base + numel)``, sliced by the
    whole model's offsets: ``Spans(t, base)[a:b]`` is ``t[a - base : b - base]``. Slicing
    elements the tensor does not hold is an error, never a silent empty view."""

    __slots__ = ("base", "tensor")

    def __init__(self, tensor: torch.Tensor, base: int = 0) -> None:
        self.tensor = tensor
        self.base = base

    def __getitem__(self, where: slice) -> torch.Tensor:
        start, stop = where.start - self.base, where.stop - self.base
        if where.stop > where.start and (start < 0 or stop > self.tensor.numel()):
            raise IndexError(
                f"elements {where.start}:{where.stop} are not held here "
                f"(this rank holds {self.base}:{self.base + self.tensor.numel()})"
            )
        return self.tensor[max(start, 0) : max(stop, 0)]

    def holds(self, start: int, stop: int) -> bool:
        return self.base <= start and stop <= self.base + self.tensor.numel()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def new_empty(self, *size: int) -> torch.Tensor:
        return self.tensor.new_empty(*size)


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
class OptimHyper:
    """The optimizer and its hyper-parameters. AdamW keeps both moments; SGD with momentum keeps
    its momentum buffer in the first-moment slot and leaves the second at zero, so the state
    stays ``[params | exp_avg | exp_avg_sq]`` under every strategy (one layout to snapshot,
    shard, migrate and checkpoint, at the cost of one unused buffer with SGD)."""

    lr: float
    optimizer: str = "adamw"  # "adamw" | "sgd"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    momentum: float = 0.9  # SGD
    weight_decay: float = 0.0  # every parameter's, unless ``groups`` says otherwise
    schedule: str = "constant"  # "constant" | "cosine" (see learning_rate)
    warmup: int = 0
    total: int = 0  # the step the cosine reaches min_lr at
    min_lr: float = 0.0
    # Parameter groups: the weight decay of each group, and the group of every element of the
    # flat buffer from element ``groups_base`` on (uint8; None: one group with ``weight_decay``).
    # See :func:`decay_groups`. ``group_runs``: (start, stop, group) of the whole model's flat
    # layout, what :meth:`hold_groups` cuts a pipeline rank's window from.
    group_decay: tuple[float, ...] = ()
    groups: torch.Tensor | None = None
    group_runs: tuple[tuple[int, int, int], ...] = ()
    groups_base: int = 0
    # An optimizer class (train.optimizer) in place of adamw/sgd, and a scheduler class
    # (train.lr_schedule) in place of constant/cosine (:mod:`elaswave.runtime.optimizers`)
    rule: TorchRule | None = None
    replay: ScheduleReplay | None = None
    # The trainable parameters' shapes in flat order, for a class that steps whole parameters
    # (``rule.elementwise`` False: replicated data parallelism only, the buffer the whole model)
    shapes: tuple[torch.Size, ...] = ()
    _padded: torch.Tensor | None = field(default=None, init=False, repr=False)

    def lr_at(self, step: int) -> float:
        if self.replay is not None:
            return self.replay.lr(step)
        return learning_rate(
            step, lr=self.lr, schedule=self.schedule, warmup=self.warmup, total=self.total,
            min_lr=self.min_lr,
        )  # fmt: skip

    def group_at(self, step: int) -> dict[str, Any]:
        """The optimizer group's scheduled values at ``step`` (an optimizer class's update)."""
        return dict(self.replay.at(step)) if self.replay is not None else {"lr": self.lr_at(step)}

    def hold_groups(self, base: int, numel: int, device: torch.device | None = None) -> None:
        """Keep the groups of the whole model's flat elements ``[base, base + numel)`` only
        (a pipeline rank's window), from ``group_runs``."""
        if not self.group_runs:
            return
        groups = torch.zeros(numel, dtype=torch.uint8, device=device)
        for a, b, g in self.group_runs:
            lo, hi = max(a, base), min(b, base + numel)
            if lo < hi and g:
                groups[lo - base : hi - base] = g
        self.groups, self.groups_base, self._padded = groups, base, None

    def groups_in(
        self, pieces: Sequence[tuple[int, int]], size: int, device: torch.device | None = None
    ) -> torch.Tensor | None:
        """The group of each element of a ZeRO shard buffer: ``pieces`` (flat offset, length)
        one after another, padded with group 0 to ``size`` (None with one group). Made from
        ``group_runs``, so no rank needs the whole model's groups."""
        if not self.group_runs:
            return None
        groups = torch.zeros(size, dtype=torch.uint8, device=device)
        cursor = 0
        for lo, n in pieces:
            for a, b, g in self.group_runs:
                x, y = max(a, lo), min(b, lo + n)
                if x < y and g:
                    groups[cursor + x - lo : cursor + y - lo] = g
            cursor += n
        return groups

    def groups_of(self, where: slice | torch.Tensor) -> torch.Tensor | None:
        """The group of each element of ``flat[where]`` (a slice of the whole model's flat
        offsets, or the index a ZeRO shard gathers with, where index ``numel`` is padding), or
        None with one group."""
        if self.groups is None:
            return None
        if isinstance(where, slice):
            return self.groups[where.start - self.groups_base : where.stop - self.groups_base]
        if self._padded is None or self._padded.numel() != self.groups.numel() + 1:
            self._padded = torch.cat([self.groups, self.groups.new_zeros(1)])  # once, not per step
        return self._padded[where]


class FlatOptimizer:
    """The optimizer's moments over a flat parameter buffer (or any slice of one: ZeRO shards
    reuse it)."""

    def __init__(self, numel: int, hyper: OptimHyper, device: torch.device | None = None) -> None:
        self.hyper = hyper
        self.exp_avg = torch.zeros(numel, dtype=torch.float32, device=device)
        self.exp_avg_sq = torch.zeros(numel, dtype=torch.float32, device=device)
        self.step_count = 0

    def step(
        self, param: torch.Tensor, grad: torch.Tensor, groups: torch.Tensor | None = None
    ) -> None:
        self.step_count += 1
        update_(
            param,
            grad,
            self.exp_avg,
            exp_avg_sq=self.exp_avg_sq,
            step=self.step_count,
            h=self.hyper,
            groups=groups,
        )


# On a CPU the update runs over chunks of this many elements, so that each operation's
# temporaries stay in cache: 2.3x faster on a 10 M-element buffer here, the same bits (the
# update is element-wise). Accelerators take the buffer in one pass (fewer kernel launches).
CPU_CHUNK = 1 << 16


def update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    exp_avg_sq: torch.Tensor,
    step: int,
    h: OptimHyper,
    groups: torch.Tensor | None = None,
) -> None:
    """One optimizer update in place (``step`` counts from 1; the learning rate is the
    schedule's at ``step``; ``groups``: each element's parameter group, from
    :meth:`OptimHyper.groups_of`). Element-wise: applying it to a slice gives the same values as
    applying it to the whole buffer. The arithmetic is PyTorch's single-tensor AdamW and SGD
    (``torch.optim``), operation for operation."""
    if h.rule is not None and h.rule.elementwise:  # the class's own step on this slice
        h.rule.apply(param, grad, exp_avg, slot2=exp_avg_sq, step=step, group=h.group_at(step))
        return
    if h.rule is not None:  # the class's own step on each whole parameter
        if sum(s.numel() for s in h.shapes) != param.numel():
            raise RuntimeError(f"{h.rule.name} steps whole parameters: a slice cannot be updated")
        group, a = h.group_at(step), 0
        for shape in h.shapes:
            c = slice(a, a + shape.numel())
            piece, piece_grad = param[c].view(shape), grad[c].view(shape)
            h.rule.apply_packed(
                piece, piece_grad, exp_avg[c], slot2=exp_avg_sq[c], step=step, group=group
            )
            a = c.stop
        return
    lr = h.lr_at(step)
    n = param.numel()
    chunk = CPU_CHUNK if param.device.type == "cpu" else max(n, 1)
    for a in range(0, n, chunk):
        c = slice(a, a + chunk)
        g = None if groups is None else groups[c]
        if h.optimizer == "sgd":
            _sgd_(param[c], grad[c], exp_avg[c], step=step, lr=lr, h=h, groups=g)
        else:
            _adamw_(
                param[c],
                grad[c],
                exp_avg[c],
                exp_avg_sq=exp_avg_sq[c],
                step=step,
                lr=lr,
                h=h,
                groups=g,
            )


def _per_group(values: Sequence[float], groups: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each element's value of its group (the values rounded to ``like``'s dtype once, as a
    Python scalar is when it multiplies a tensor). The values go to the kernels as scalars:
    nothing is built on the host or copied to the device per update."""
    out = torch.full_like(like, values[0])
    for g in range(1, len(values)):
        out = torch.where(groups == g, values[g], out)
    return out


def _adamw_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    *,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    h: OptimHyper,
    groups: torch.Tensor | None,
) -> None:
    if groups is not None:
        param.mul_(_per_group([1 - lr * wd for wd in h.group_decay], groups, param))
    elif h.weight_decay:
        param.mul_(1 - lr * h.weight_decay)
    exp_avg.lerp_(grad, 1 - h.beta1)
    exp_avg_sq.mul_(h.beta2).addcmul_(grad, grad, value=1 - h.beta2)
    bias1 = 1 - h.beta1**step
    bias2 = 1 - h.beta2**step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(h.eps)
    param.addcdiv_(exp_avg, denom, value=-lr / bias1)


def _sgd_(
    param: torch.Tensor,
    grad: torch.Tensor,
    buf: torch.Tensor,
    *,
    step: int,
    lr: float,
    h: OptimHyper,
    groups: torch.Tensor | None,
) -> None:
    """SGD with momentum (no dampening) and L2 weight decay added to the gradient, as
    ``torch.optim.SGD``; the momentum buffer starts as the first step's gradient."""
    if groups is not None:
        grad = grad + _per_group(h.group_decay, groups, param) * param
    elif h.weight_decay:
        grad = grad.add(param, alpha=h.weight_decay)
    if h.momentum:
        if step == 1:
            buf.copy_(grad)
        else:
            buf.mul_(h.momentum).add_(grad)
        grad = buf
    param.add_(grad, alpha=-lr)


_POSITIONAL = re.compile(r"(^|\.)(wpe|pos|pos_emb|pos_embed|position_embeddings|embed_positions)$")


def no_decay_by_default(ndim: int, embedding: str | None) -> bool:
    """Whether a parameter of ``ndim`` dimensions (``embedding``: the name of the
    ``nn.Embedding`` module it belongs to, or None) skips weight decay unless a group says
    otherwise: biases and norm scales (one dimension) and positional tables (an embedding module
    named for positions: ``wpe``, ``pos``, ``embed_positions`` ...). Token embeddings decay."""
    return ndim < 2 or (embedding is not None and bool(_POSITIONAL.search(embedding)))


def decay_groups(
    params: Sequence[tuple[str, int, str | None]],
    weight_decay: float,
    rules: Sequence[tuple[Sequence[str], float]] = (),
) -> list[float]:
    """The weight decay of each parameter, from ``(global name, ndim, embedding module name)``:
    the first rule whose glob patterns match the name sets it; otherwise ``weight_decay``, or 0
    for what :func:`no_decay_by_default` exempts."""
    out = []
    for name, ndim, embedding in params:
        for patterns, wd in rules:
            if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                out.append(float(wd))
                break
        else:
            out.append(0.0 if no_decay_by_default(ndim, embedding) else float(weight_decay))
    return out


def clip_factor(
    mean: torch.Tensor,
    max_norm: float,
    ties: Sequence[tuple[slice, slice]] = (),
    *,
    segments: Sequence[tuple[int, int]] | None = None,
) -> float:
    """``min(1, max_norm / ‖mean‖)`` for the whole model's mean gradient in flat order (the
    second copy of a tied weight not counted twice); 1 when clipping is off. ``segments``:
    (offset, length) of each layer (default: one layer of everything)."""
    return clip_and_norm(mean, max_norm, ties, segments=segments)[0]


def clip_and_norm(
    mean: torch.Tensor,
    max_norm: float,
    ties: Sequence[tuple[slice, slice]] = (),
    *,
    segments: Sequence[tuple[int, int]] | None = None,
    measure: bool = False,
) -> tuple[float, float | None]:
    """(:func:`clip_factor`, the global norm it was taken from); the norm is also taken
    without clipping when ``measure`` (None when neither asks for it)."""
    if not (max_norm or measure):
        return 1.0, None
    norm = global_norm(layer_sumsq(mean, segments or ((0, mean.numel()),), ties))
    return (clip_scale(norm, max_norm) if max_norm else 1.0), norm


def layer_sumsq(
    mean: torch.Tensor | Spans,
    segments: Sequence[tuple[int, int]],
    ties: Sequence[tuple[slice, slice]] = (),
    *,
    only: Sequence[bool] | None = None,
) -> torch.Tensor:
    """Each layer's squared gradient norm (float64), the second copy of a tied weight left out;
    with ``only``, zero for the layers not marked (a pipeline rank counts the layers it is the
    first holder of; an all-reduce then completes the vector). Every strategy takes the global
    norm from these same numbers in layer order (:func:`clip_from`), so the deterministic mode
    stays bit-identical with clipping on, whichever rank computed which layer."""
    sq = torch.zeros(len(segments), dtype=torch.float64, device=mean.device)
    for i, (offset, length) in enumerate(segments):
        if length and (only is None or only[i]):
            sq[i] = torch.linalg.vector_norm(mean[offset : offset + length], dtype=torch.float64)
    sq.square_()
    starts = [offset for offset, _ in segments]
    for _, b in ties:
        i = bisect.bisect_right(starts, b.start) - 1
        if only is None or only[i]:
            sq[i] -= torch.linalg.vector_norm(mean[b], dtype=torch.float64).square()
    return sq


def clip_from(sumsq: torch.Tensor, max_norm: float) -> float:
    """The clipping factor from every layer's squared norm, summed in layer order."""
    return clip_scale(global_norm(sumsq), max_norm)


def global_norm(sumsq: torch.Tensor) -> float:
    """The whole model's gradient norm from every layer's squared norm, summed in layer order
    (the same number on every rank that holds the same squares)."""
    total = 0.0
    for x in sumsq.tolist():
        total += x
    return math.sqrt(max(total, 0.0))


def clip_scale(norm: float, max_norm: float) -> float:
    """``min(1, max_norm / norm)``, the factor clipping by the global norm applies."""
    return min(1.0, max_norm / (norm + 1e-6))
