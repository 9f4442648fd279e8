"""What ``job.register`` hands the engine, as the engine takes it: the script's model as a
one-layer workload (:class:`ScriptWorkload`), its optimizer and scheduler as the flat optimizer's
rule and a schedule replay (:func:`optimizer_rule`), and its own state dict shared with peers
(:class:`ScriptState`); and :class:`ScriptError`, which names a misuse of the API. Kept apart from
the loop's API (:mod:`~elaswave.runtime.loop`: ``Job``, ``Step``, running the script), which
calls these once the script registers.
"""

from __future__ import annotations

import copy
import inspect
import io
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from elaswave.errors import ElasWaveError
from elaswave.runtime.optimizers import ScheduleReplay, TorchRule, probe
from elaswave.runtime.workload.base import Dataset, TensorSpec, Workload

__all__ = ["ScriptError", "ScriptState", "ScriptWorkload", "optimizer_rule"]

# Group keys of a torch optimizer that are not its update's hyper-parameters.
_NOT_ARGS = ("params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable")


class ScriptError(ElasWaveError):
    """The script used the API in a way the job cannot run (the message says how to fix it)."""


class ScriptState:
    """The script's own state (``register(state=dict)``): what a newcomer gets from peers beside
    the model and the optimizer (a counter, an EMA of the weights, the best loss so far). At
    a plan's sync every rank takes the dict of the lowest rank whose dict is of the resume step;
    durable checkpoints keep it. A tensor value of the same shape is copied into in place (a
    script's own references to it stay valid); other values are replaced."""

    def __init__(self, values: dict[str, Any], device: torch.device) -> None:
        self.values, self.device = values, device
        self.step = 0  # the step whose state the dict holds (the script's loop body is done)

    def saved(self) -> torch.Tensor:
        """The dict as a float64 vector of its serialized bytes (exact; a checkpoint's side)."""
        out = io.BytesIO()
        torch.save(self.values, out)
        raw = torch.frombuffer(bytearray(out.getvalue()), dtype=torch.uint8)
        return raw.to(torch.float64)

    def adopt(self, saved: torch.Tensor | None, step: int) -> None:
        if saved is None:
            raise ValueError("the saved state holds no script state (register(state=...))")
        raw = bytes(saved.to("cpu", torch.uint8).tolist())
        loaded = torch.load(io.BytesIO(raw), map_location=self.device, weights_only=False)
        for key in [k for k in self.values if k not in loaded]:
            del self.values[key]
        for key, value in loaded.items():
            mine = self.values.get(key)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(value, torch.Tensor)
                and (mine.shape == value.shape and mine.dtype == value.dtype)
            ):
                mine.copy_(value)
            else:
                self.values[key] = value
        self.step = step

    def share(self, comm: Any, step: int, broken: Callable[[], bool]) -> int:
        """After a plan's sync to ``step``: every rank takes the dict of the lowest rank whose
        dict is of ``step`` (a newcomer's is not). Returns that rank."""
        return self.spread(comm, self.saved(), self.step == step, step=step, broken=broken)

    def spread(
        self, comm: Any, saved: torch.Tensor, holds: bool, *, step: int, broken: Callable[[], bool]
    ) -> int:
        """Every rank adopts ``saved`` (a :meth:`saved` vector of ``step``) of the lowest rank
        that ``holds`` one; a rank whose own is it keeps it. Returns that rank."""
        from elaswave.runtime.strategies.base import DP

        row = torch.tensor([float(holds), float(saved.numel())], dtype=torch.float64)
        rows = [r.tolist() for r in comm.allgather(DP, row.to(self.device), broken)]
        holders = [r for r, (h, _) in enumerate(rows) if h]
        if not holders:
            raise RuntimeError(f"no rank holds the script's state of step {step}")
        me = comm.rank(DP)
        if len(holders) < len(rows):
            size = int(rows[holders[0]][1])
            buf = saved if me == holders[0] else torch.zeros(size, dtype=torch.float64)
            buf = buf.to(self.device)
            comm.broadcast(DP, buf, holders[0], abort=broken)
            saved = buf
        if me not in holders or self.step != step:  # (a rollback: every rank's is later)
            self.adopt(saved, step)
        return holders[0]


class ScriptWorkload(Workload):
    """The registered model as a one-layer workload over the script's data set (the engine
    builds its state from it; the script calls the model itself)."""

    def __init__(self, model: nn.Module, data: Dataset, collate: Callable[[Sequence[Any]], Any]):
        self.model, self.data, self._collate = model, data, collate

    @property
    def num_layers(self) -> int:
        return 1

    def build_layer(self, index: int, seed: int) -> nn.Module:
        return self.model  # the script's own object: its parameters become the flat views

    def dataset(self, seed: int) -> Dataset:
        return self.data

    def collate(self, samples: Sequence[Any]) -> Any:
        return self._collate(samples)

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        raise RuntimeError("a script's model is one layer: it has no boundaries")

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        raise RuntimeError("a script computes its own loss")


def optimizer_rule(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    steps: int,
) -> tuple[TorchRule, ScheduleReplay | None, float]:
    """The flat optimizer's rule for the script's optimizer (its class and its one group's
    values, probed), the replay of its scheduler (None: a constant rate) and the base rate."""
    cls = type(optimizer)
    name = f"{cls.__module__}.{cls.__qualname__}"
    if len(optimizer.param_groups) != 1:
        raise ScriptError(
            f"the optimizer has {len(optimizer.param_groups)} parameter groups: register one "
            "group (per-group values are a config job's train.param_groups)"
        )
    group = optimizer.param_groups[0]
    accepts = inspect.signature(cls.__init__).parameters
    anything = any(p.kind is p.VAR_KEYWORD for p in accepts.values())
    args = {
        k: v for k, v in group.items() if k not in _NOT_ARGS and (anything or k in accepts)
    }  # what the class was built with (a group may hold more: AdamW's decoupled_weight_decay)
    if args.get("maximize"):
        raise ScriptError(f"{name}: maximize=True: ElasWave minimizes the loss")
    args.pop("maximize", None)
    rule = TorchRule(cls, args, name)
    lr = float(group.get("initial_lr", group["lr"]))
    replay = None
    if scheduler is not None:
        if scheduler.optimizer is not optimizer:
            raise ScriptError("the scheduler steps another optimizer than the one registered")
        if getattr(scheduler, "last_epoch", 0) != 0:
            raise ScriptError(
                "register the scheduler before it steps (it is replayed from its first step)"
            )
        replay = ScheduleReplay(_replayed(scheduler, rule, group))
    steps_probed = sorted({1, max(1, steps // 2), steps})
    groups = [replay.at(s) if replay is not None else {"lr": lr} for s in steps_probed]
    try:
        probe(rule, groups)
    except ElasWaveError as exc:
        raise ScriptError(str(exc).replace("train.optimizer ", "the optimizer ")) from None
    if not rule.elementwise:
        raise ScriptError(f"{name} steps whole parameters (not element-wise): not in a script yet")
    return rule, replay, lr


def _replayed(
    scheduler: torch.optim.lr_scheduler.LRScheduler, rule: TorchRule, group: dict[str, Any]
) -> Callable[[], torch.optim.lr_scheduler.LRScheduler]:
    """A maker of the script's scheduler as it is now, on a one-element optimizer of the same
    class and values (the script's own is never stepped)."""
    kept = {k: v for k, v in scheduler.__dict__.items() if k != "optimizer"}
    # All of the group: a scheduler keeps its own values there too (OneCycleLR's max_lr).
    values = copy.deepcopy({k: v for k, v in group.items() if k != "params"})

    def make() -> torch.optim.lr_scheduler.LRScheduler:
        opt = rule._make(torch.zeros(1, requires_grad=True), {"lr": group["lr"]})
        opt.param_groups[0].update(values)
        twin = object.__new__(type(scheduler))
        twin.__dict__.update(copy.deepcopy(kept))
        twin.optimizer = opt
        return twin

    return make
