"""What a rank trains, and what a strategy may use besides it.

:class:`TrainState` owns the rank's model (the workload's layers), its parameters and AdamW
moments as flat buffers, the last applied step and its loss. :class:`RankContext` is the rest a
strategy needs: the config, the communicator, the plan this rank runs, and callbacks (an
event and a report to the daemon, the phase the hang detector sees, whether the plan lost a
member). Strategies get these two objects, never the engine.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.planning.plan import Plan
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.optim import FlatOptimizer, FlatParams, OptimHyper, decay_groups
from elaswave.runtime.workload import Dataset, KeyedLayers, Workload, build_layers
from elaswave.runtime.workload.load import load_workload

__all__ = ["AUTOCAST", "RankContext", "TrainState"]

AUTOCAST = {"off": None, "bf16": torch.bfloat16}  # train.autocast -> the layers' compute dtype


@dataclass(eq=False)
class TrainState:
    """A rank's training state. ``opt`` holds the moments of the whole model (replicated data
    parallelism and pipeline stages without ZeRO), or none (ZeRO keeps its shards itself)."""

    workload: Workload
    model: KeyedLayers
    flat: FlatParams
    opt: FlatOptimizer
    dataset: Dataset
    step: int = 0  # the last step whose update this rank has applied
    last_loss: float = math.nan
    ties: tuple[tuple[slice, slice], ...] = ()  # flat ranges of copies of one logical weight

    @classmethod
    def build(cls, cfg: JobConfig, device: torch.device | None = None) -> TrainState:
        """The rank's state on ``device`` (default: the CPU). Layers are built on the CPU, where
        their seeded initial values are the same on every kind of device, then moved."""
        t = cfg.train
        workload = load_workload(cfg)
        model = build_layers(workload, t.seed)
        if device is not None:
            model.to(device)
        model.autocast = AUTOCAST[t.autocast]
        model.train()
        flat = FlatParams(model)
        hyper = OptimHyper(
            lr=t.lr, optimizer=t.optimizer, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
            momentum=t.momentum, weight_decay=t.weight_decay, schedule=t.lr_schedule,
            warmup=t.warmup_steps, total=t.steps, min_lr=t.min_lr,
        )  # fmt: skip
        hyper.group_decay, hyper.groups = param_groups(model, flat, cfg)
        opt = FlatOptimizer(0 if cfg.zero else flat.numel, hyper, flat.data.device)  # ZeRO: shards
        ties = []
        for a, b in workload.tied():
            sa, sb = model.param_slice(a), model.param_slice(b)
            if sa.stop - sa.start != sb.stop - sb.start:
                raise ValueError(f"tied parameters {a} and {b} differ in size")
            ties.append((sa, sb))
        return cls(workload, model, flat, opt, workload.dataset(t.seed), ties=tuple(ties))

    def tie_gradients(self, grads: torch.Tensor) -> None:
        """Before the reduction: both copies of a tied weight hold the sum of their gradients
        (summed over ranks, every copy then gets the whole weight's gradient)."""
        for a, b in self.ties:
            grads[a].add_(grads[b])
            grads[b].copy_(grads[a])

    @property
    def device(self) -> torch.device:
        """Where this rank's parameters live: tensors the runtime creates for it go there too."""
        return self.flat.data.device

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """(offset, length) of each layer's parameters in the flat buffers."""
        return self.model.segments()

    def microbatch(self, sample_ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """The workload's (inputs, targets) for these global sample ids, on this rank's device."""
        inputs, targets = self.workload.collate([self.dataset[i] for i in sample_ids])
        return to_device(inputs, self.device), to_device(targets, self.device)

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        """The workload's (loss sum, count) of one micro-batch; the strategies backpropagate the
        sum and divide the reduced gradient by the batch's reduced count."""
        total, count = self.workload.loss(output, targets)
        count = int(count)
        if count < 0:
            raise ValueError(f"the workload's loss counted {count} terms (must be >= 0)")
        return total, count


def to_device(value: Any, device: torch.device) -> Any:
    """Tensors (also inside tuples, lists and dicts) moved to ``device``; anything else as is."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if device.type == "cpu":
        return value  # every tensor a workload collates is on the CPU already
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        moved = {k: to_device(v, device) for k, v in value.items()}
        return moved if type(value) is dict else type(value)(moved)
    return value


def param_groups(
    model: KeyedLayers, flat: FlatParams, cfg: JobConfig
) -> tuple[tuple[float, ...], torch.Tensor | None]:
    """The weight decay of each parameter group and each flat element's group (None when every
    element decays alike: the optimizer then takes one scalar)."""
    embeddings = {
        id(p): name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Embedding)
        for p in module.parameters(recurse=False)
    }
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    rules = [(g.params, g.weight_decay) for g in cfg.train.param_groups]
    decays = decay_groups(
        [(n, p.dim(), embeddings.get(id(p))) for n, p in named], cfg.train.weight_decay, rules
    )
    values = tuple(sorted(set(decays)))
    if len(values) <= 1:
        return values, None
    groups = torch.empty(flat.numel, dtype=torch.uint8, device=flat.data.device)
    offset = 0
    for (_, p), wd in zip(named, decays, strict=True):
        groups[offset : offset + p.numel()] = values.index(wd)
        offset += p.numel()
    return values, groups


@dataclass(eq=False)
class RankContext:
    """What a strategy uses besides the train state."""

    state: TrainState
    cfg: JobConfig
    comm: Communicator
    worker: str  # this worker's id
    event: Callable[..., None]  # event(kind, **fields): a record for the daemon's events.jsonl
    send: Callable[[dict[str, Any]], None]  # a report to the daemon (commit, costs, rollback)
    enter: Callable[[str], None]  # compute | collective | idle: what the hang detector sees
    removes_any: Callable[[tuple[str, ...]], bool]  # does a newer plan remove one of these?
    plan: Plan | None = None  # the plan this rank runs (None before the first)

    def broken(self) -> bool:
        """Whether the plan this rank runs has lost a member (collectives stop waiting)."""
        return self.plan is not None and self.removes_any(self.plan.workers)
