"""What a rank trains, and what a strategy may use besides it.

:class:`TrainState` owns the rank's model (the workload's layers), its parameters and AdamW
moments as flat buffers, the last applied step and its loss. :class:`RankContext` is the rest a
strategy needs: the config, the communicator, the plan this rank runs, and callbacks (an
event and a report to the daemon, the phase the hang detector sees, whether the plan lost a
member). Strategies get these two objects, never the engine.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from elaswave import wire
from elaswave.config import JobConfig
from elaswave.planning.plan import Plan
from elaswave.runtime.comm.communicator import Communicator
from elaswave.runtime.integrity.checksums import host_bytes
from elaswave.runtime.optim import FlatOptimizer, FlatParams, OptimHyper, Spans, decay_groups
from elaswave.runtime.optimizers import ScheduleReplay, TorchRule, optimizer_classes
from elaswave.runtime.prunehook import PruneFactory, PruneHook
from elaswave.runtime.runningstats import RunningStats
from elaswave.runtime.workload import (
    Dataset,
    KeyedLayers,
    Workload,
    build_layer,
    build_layers,
)
from elaswave.runtime.workload.load import load_workload

__all__ = ["AUTOCAST", "RankContext", "TrainState"]

AUTOCAST = {"off": None, "bf16": torch.bfloat16}  # train.autocast -> the layers' compute dtype


@dataclass(eq=False)
class TrainState:
    """A rank's training state. ``opt`` holds the moments of the parameters the rank holds
    (replicated data parallelism and pipeline stages without ZeRO), or none (ZeRO keeps its
    shards itself); ``stats`` the norm layers' running statistics of the whole model (on every
    rank: see :mod:`elaswave.runtime.runningstats`).

    ``window`` is the range of layers whose state this rank allocates: every layer, except on
    a pipeline rank, which holds only the layers its stage needs (:meth:`set_window`); the
    others stay on the meta device, with their shapes and no memory. The flat buffers then
    hold the window's part of the whole model's flat layout (``flat.base`` onwards)."""

    workload: Workload
    model: KeyedLayers
    flat: FlatParams
    opt: FlatOptimizer
    dataset: Dataset
    step: int = 0  # the last step whose update this rank has applied
    last_loss: float = math.nan
    last_grad_norm: float | None = None  # of the last step's mean gradient, where measured
    ties: tuple[tuple[slice, slice], ...] = ()  # flat ranges of copies of one logical weight
    window: range = range(0)
    zero: bool = False  # ZeRO keeps the moments in its shards: ``opt`` holds none
    prune: PruneHook | None = None  # train.prune: the pruning after each update
    stats: RunningStats | None = None  # the norm layers' running statistics, if any
    script: Any = None  # a script's own registered state (``registered.ScriptState``), if any

    @classmethod
    def build(
        cls,
        cfg: JobConfig,
        device: torch.device | None = None,
        *,
        workload: Workload | None = None,
        optimizer: tuple[TorchRule, ScheduleReplay | None] | None = None,
        pruning: PruneFactory | None = None,
    ) -> TrainState:
        """The rank's state on ``device`` (default: the CPU). Layers are built on the CPU, where
        their seeded initial values are the same on every kind of device, then moved. A pipeline
        rank (``pp > 1``) allocates no layer until its first plan says which it runs; a ZeRO-3
        rank (``zero: 3``) allocates none at all: its layers are shells (parameters on the meta
        device, buffers on ``device``) that its strategy fills while they run.

        A user's own loop (:mod:`elaswave.runtime.loop`) gives its ``workload`` and its
        ``optimizer`` (the rule of its optimizer's class, probed, and its schedule's replay)
        instead of the config's.

        ``pruning`` builds the rank's pruning hook (:mod:`elaswave.runtime.prunehook`); the
        process that puts the worker together gives it, and a job with ``train.prune`` needs
        it."""
        t = cfg.train
        if t.prune is not None and pruning is None:
            raise ValueError("train.prune is set but no pruning hook was given (pruning=)")
        device = torch.device("cpu") if device is None else device
        workload = load_workload(cfg) if workload is None else workload
        shells = cfg.zero == 3 and cfg.pp == 1  # a ZeRO-3 stage allocates its window per step
        window = range(0) if cfg.pp > 1 or shells else range(workload.num_layers)
        model = build_layers(workload, t.seed, keep=window, shells=shells)
        for index in window:
            model.layers[index].to(device)
        if shells:
            for layer in model.layers:
                _buffers_to(layer, device)
        model.autocast = AUTOCAST[t.autocast]
        model.train()
        stats = RunningStats.of(
            workload, model, t.global_batch // t.micro_batch_size, device=device
        )
        if stats is not None:
            model.stats = stats
            for index, layer in enumerate(model.layers):
                if index in window or shells:
                    stats.bind(index, layer)
        total = sum(length for _, length in model.segments())
        flat = FlatParams(_layers(model, window), total=total, device=device)
        hyper = OptimHyper(
            lr=t.lr, optimizer=t.optimizer, beta1=t.beta1, beta2=t.beta2, eps=t.eps,
            momentum=t.momentum, weight_decay=t.weight_decay, schedule=t.lr_schedule,
            warmup=t.warmup_steps, total=t.steps, min_lr=t.min_lr,
        )  # fmt: skip
        hyper.rule, hyper.replay = optimizer_classes(cfg) if optimizer is None else optimizer
        if hyper.rule is not None and not hyper.rule.elementwise:
            hyper.shapes = tuple(p.shape for p in model.parameters() if p.requires_grad)
        hyper.group_decay, hyper.group_runs = param_groups(model, cfg)
        hyper.hold_groups(flat.base, flat.numel, device)
        opt = FlatOptimizer(0 if cfg.zero else flat.numel, hyper, device)  # ZeRO: shards
        ties = []
        for a, b in workload.tied():
            sa, sb = model.param_slice(a), model.param_slice(b)
            if sa.stop - sa.start != sb.stop - sb.start:
                raise ValueError(f"tied parameters {a} and {b} differ in size")
            ties.append((sa, sb))
        dataset = workload.dataset(t.seed)
        prune = pruning(cfg, workload, model) if pruning is not None else None
        return cls(
            workload, model, flat, opt, dataset, ties=tuple(ties), window=window,
            zero=bool(cfg.zero), prune=prune, stats=stats,
        )  # fmt: skip

    def set_window(self, layers: range) -> None:
        """Allocate the state of exactly ``layers`` (a contiguous range). Layers that stay keep
        their parameters and moments; layers that enter are built anew with their initial
        values (a transfer or a restore overwrites them where the job is past step 0); layers
        that leave go to the meta device and their memory is freed. Gradients start at zero."""
        if layers == self.window:
            return
        model, old, flat, opt, device = self.model, self.window, self.flat, self.opt, self.device
        flat.reserve()  # the staying layers' values are copied (a ZeRO-3 stage may have freed them)
        for index in layers:
            if index not in old:
                layer = build_layer(self.workload, model.seed, index).to(device)
                model.layers[index] = layer.train(model.training)
                if self.stats is not None:
                    self.stats.bind(index, layer)
        segments = self.segments
        base = segments[layers.start][0] if layers else 0
        new = FlatParams(_layers(model, layers), base=base, total=flat.total, device=device)
        opt.hyper.hold_groups(base, new.numel, device)
        if not self.zero:  # the moments of the window's layers, those that stay kept
            lo, hi = max(old.start, layers.start), min(old.stop, layers.stop)
            kept = slice(segments[lo][0], sum(segments[hi - 1])) if lo < hi else None
            moments = []
            for before in (opt.exp_avg, opt.exp_avg_sq):
                moment = torch.zeros(new.numel, dtype=torch.float32, device=device)
                if kept is not None:
                    new.at(moment)[kept].copy_(flat.at(before)[kept])
                moments.append(moment)
            opt.exp_avg, opt.exp_avg_sq = moments
        for index in old:
            if index not in layers:
                model.layers[index].to("meta")
        self.flat, self.window = new, layers

    @property
    def params(self) -> Spans:
        """The parameters this rank holds, sliced by the whole model's flat offsets."""
        return self.flat.at(self.flat.data)

    @property
    def exp_avg(self) -> Spans:
        return self.flat.at(self.opt.exp_avg)

    @property
    def exp_avg_sq(self) -> Spans:
        return self.flat.at(self.opt.exp_avg_sq)

    def tie_gradients(self, grads: torch.Tensor) -> None:
        """Before the reduction: both copies of a tied weight hold the sum of their gradients
        (summed over ranks, every copy then gets the whole weight's gradient). ``grads`` is laid
        out like the flat buffers; a pair of which this rank holds one copy is left as it is."""
        at = self.flat.at(grads)
        for a, b in self.ties:
            if at.holds(a.start, a.stop) and at.holds(b.start, b.stop):
                at[a].add_(at[b])
                at[b].copy_(at[a])

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

    def score(self, output: torch.Tensor, targets: Any) -> tuple[float, int, int]:
        """A held-out micro-batch's (loss sum, count, top-1 hits; hits 0 where the workload
        is no classifier)."""
        total, count = self.loss(output, targets)
        hits = self.workload.correct(output, targets)
        return float(total), count, int(hits or 0)

    def side_digests(self) -> dict[str, Any]:
        """The running statistics' SHA-256 and the fewest batches a norm layer has seen (none
        where the model keeps no running statistics), and a script's own state's SHA-256."""
        out: dict[str, Any] = {}
        if self.script is not None:  # a script's own state, serialized
            out["script_state_sha256"] = hashlib.sha256(host_bytes(self.script.saved())).hexdigest()
        stats = self.stats
        if stats is None:
            return out
        return {
            **out,
            "buffers_sha256": hashlib.sha256(host_bytes(stats.saved())).hexdigest(),
            "norm_batches": int(stats.counts.min()),
        }


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


def _buffers_to(layer: torch.nn.Module, device: torch.device) -> None:
    """Move a shell's buffers to ``device`` (its parameters are on the meta device)."""
    for module in layer.modules():
        for name, b in module._buffers.items():
            if b is not None and b.device != device:
                module._buffers[name] = b.to(device)


def _layers(model: KeyedLayers, window: range) -> torch.nn.Module:
    return model.layers[window.start : window.stop]


def param_groups(
    model: KeyedLayers, cfg: JobConfig
) -> tuple[tuple[float, ...], tuple[tuple[int, int, int], ...]]:
    """The weight decay of each parameter group, and the runs of flat elements of each group
    ((start, stop, group index); none when every element decays alike: the optimizer then takes
    one scalar)."""
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
        return values, ()
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for (_, p), wd in zip(named, decays, strict=True):
        group = values.index(wd)
        if runs and runs[-1][1] == offset and runs[-1][2] == group:
            runs[-1] = (runs[-1][0], offset + p.numel(), group)
        else:
            runs.append((offset, offset + p.numel(), group))
        offset += p.numel()
    return values, tuple(runs)


@dataclass(eq=False)
class RankContext:
    """What a strategy uses besides the train state."""

    state: TrainState
    cfg: JobConfig
    comm: Communicator
    worker: str  # this worker's id
    event: Callable[..., None]  # event(kind, **fields): a record for the daemon's events.jsonl
    send: Callable[[wire.WorkerMessage], None]  # a report to the daemon (costs, rollback)
    enter: Callable[[str], None]  # compute | collective | idle: what the hang detector sees
    removes_any: Callable[[tuple[str, ...]], bool]  # does a newer plan remove one of these?
    plan: Plan | None = None  # the plan this rank runs (None before the first)
    # miscomputes(step): an injected fault makes this rank's gradients of the step's replayed
    # micro-batches wrong (a device that miscomputes; None: no injector)
    miscomputes: Callable[[int], bool] | None = None

    def broken(self) -> bool:
        """Whether the plan this rank runs has lost a member (collectives stop waiting)."""
        return self.plan is not None and self.removes_any(self.plan.workers)
