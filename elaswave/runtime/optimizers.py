"""Any ``torch.optim`` optimizer and learning-rate scheduler, on the flat train state.

ElasWave keeps every rank's state as flat buffers: parameters and two state slots per element
(AdamW's moments; :mod:`.optim`). A named optimizer class (``train.optimizer:
torch.optim.RMSprop``, or a user's class) fits that layout when its state per parameter is at
most two tensors shaped like the parameter plus the step count, and when its update is
*element-wise*: one step on a tensor whole and on its two halves gives the same bits. Then the
update of any slice of the flat buffers (a ZeRO shard, a pipeline window, a replica's whole
buffer) is the optimizer's own ``step()`` on that slice, with its state tensors mapped onto the
slots, and the state survives every snapshot, migration, checkpoint and resume with them. Both
properties are probed once, by running the optimizer (:func:`torch_rule`). A class that is not
element-wise but steps each parameter on its own, its state no larger than two copies of the
parameter (Adafactor: factored moments, update clipping over the tensor), steps whole parameters
with its state packed into the parameter's room in the slots: replicated data parallelism only,
as ZeRO and pipelines update slices. The others (LBFGS's closure, NAdam's scalar state, a class
coupling parameters) are refused with the reason.

A scheduler class (``train.lr_schedule: torch.optim.lr_scheduler.OneCycleLR``) is replayed on a
one-element optimizer of the same kind: the learning rate (and betas or momentum, where the
scheduler cycles them) of step ``s`` is what the scheduler holds after ``s - 1`` steps, a pure
function of ``s`` that a redone step gets again (:class:`ScheduleReplay`).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

import torch

from elaswave.config import JobConfig
from elaswave.errors import ConfigError, one_line

__all__ = [
    "ScheduleReplay", "TorchRule", "probe", "resolve_class", "schedule_replay", "torch_rule",
]  # fmt: skip

SCHEDULED = ("lr", "betas", "momentum")  # what a replayed scheduler may set per step


def resolve_class(spec: str, key: str) -> type:
    """The class named ``package.module.Class`` or ``package.module:Class``."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ConfigError(f"{key} {spec!r}: no such class ({exc})") from None
    if not isinstance(target, type):
        raise ConfigError(f"{key} {spec!r} is not a class")
    return target


class TorchRule:
    """One optimizer class and its arguments, stepping any slice of the flat buffers; its
    per-parameter state tensors ``slots`` live in the two state buffers. A class that is not
    element-wise but steps each parameter on its own (``elementwise`` False: Adafactor's
    factored moments and update clipping) steps whole parameters (:meth:`apply_packed`), its
    state packed into the parameter's room in the two slots."""

    def __init__(self, cls: type, args: dict[str, Any], name: str) -> None:
        self.cls, self.args, self.name = cls, dict(args), name
        self.slots: tuple[str, ...] = ()
        self.elementwise = True
        self._layouts: dict[tuple[int, ...], list[tuple[str, int, int, torch.Size]]] = {}

    def _make(self, t: torch.Tensor, group: dict[str, Any]) -> torch.optim.Optimizer:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = self.cls([t], **{**self.args, **group})
        opt.param_groups[0].update(group)
        return opt

    def apply(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        slot1: torch.Tensor,
        *,
        slot2: torch.Tensor,
        step: int,
        group: dict[str, Any],
    ) -> None:
        """Update ``param`` in place as the optimizer's ``step()`` number ``step`` would, its
        state read from and written back to the slots."""
        slots = (slot1, slot2)
        views = {key: slots[i] for i, key in enumerate(self.slots)}
        self._step(param, grad, views, step=step, group=group)

    def apply_packed(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        slot1: torch.Tensor,
        *,
        slot2: torch.Tensor,
        step: int,
        group: dict[str, Any],
    ) -> None:
        """Update the whole parameter ``param`` (its own shape; ``grad`` alike) as the
        optimizer's ``step()`` number ``step`` would, each of its state tensors read from and
        written back to its place in the slots (``slot1``, ``slot2``: the parameter's flat
        elements of each)."""
        slots = (slot1, slot2)
        views = {
            key: slots[i][a : a + shape.numel()].view(shape)
            for key, i, a, shape in self._layout(param, group)
        }
        self._step(param, grad, views, step=step, group=group)

    def _step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        views: dict[str, torch.Tensor],
        *,
        step: int,
        group: dict[str, Any],
    ) -> None:
        """The optimizer's own step on ``param``, its state tensors ``views`` into the slots
        (at step 1 it makes its initial state, which the slots then take)."""
        t = param.detach().requires_grad_(True)  # the same memory, as a leaf the optimizer takes
        t.grad = grad
        opt = self._make(t, group)
        if step > 1:
            opt.state[t] = {"step": torch.tensor(float(step - 1)), **views}
        opt.step()
        for key, view in views.items():
            if opt.state[t][key] is not view:
                view.copy_(opt.state[t][key])

    def _layout(
        self, param: torch.Tensor, group: dict[str, Any]
    ) -> list[tuple[str, int, int, torch.Size]]:
        """Where each state tensor of a parameter of ``param``'s shape lies: (key, slot, offset,
        shape), first fit into the parameter's room in slot 1, then slot 2 (found once per
        shape, by a step on zeros)."""
        shape = tuple(param.shape)
        if shape not in self._layouts:
            dummy = torch.zeros(shape, dtype=param.dtype, requires_grad=True)
            dummy.grad = torch.zeros_like(dummy)
            opt = self._make(dummy, group)
            opt.step()
            room, layout = [param.numel(), param.numel()], []
            for key, value in opt.state[dummy].items():
                if key == "step" and (not torch.is_tensor(value) or value.numel() == 1):
                    continue
                if not torch.is_tensor(value):
                    raise ValueError(f"its state {key!r} is not a tensor")
                n = value.numel()
                slot = next((i for i in (0, 1) if room[i] >= n), None)
                if slot is None:
                    raise ValueError(
                        f"its state outgrows two tensors the size of a parameter of shape "
                        f"{list(shape)}"
                    )
                layout.append((key, slot, param.numel() - room[slot], value.shape))
                room[slot] -= n
            self._layouts[shape] = layout
        return self._layouts[shape]


def torch_rule(name: str, args: dict[str, Any]) -> TorchRule:
    """The rule of optimizer class ``name``, not probed yet (:func:`probe`)."""
    cls = resolve_class(name, "train.optimizer")
    if not issubclass(cls, torch.optim.Optimizer):
        raise ConfigError(f"train.optimizer {name!r} is not a torch.optim.Optimizer")
    if "lr" in args:
        raise ConfigError("train.optimizer_args: the learning rate is train.lr, not lr")
    return TorchRule(cls, args, name)


def probe(rule: TorchRule, groups: list[dict[str, Any]]) -> None:
    """Run the optimizer a few steps, with the group values the job will give it (a scheduler's
    at its first, middle and last steps: a momentum it switches on adds a state tensor): its
    state must fit two slots and its update be element-wise and the same through the slots as
    run natively (else one line). Sets ``rule.slots``."""
    name = rule.name
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(64, generator=g)
    grads = [torch.randn(64, generator=g) for _ in groups]
    try:
        native = x0.clone().requires_grad_(True)
        opt = rule._make(native, groups[0])
        for k, grad in enumerate(grads):
            opt.param_groups[0].update(groups[k])
            native.grad = grad.clone()
            opt.step()
        state = opt.state[native]
    except TypeError as exc:
        raise ConfigError(f"train.optimizer {name!r}: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - an optimizer that cannot step this way
        raise ConfigError(
            f"train.optimizer {name!r} cannot step a tensor: {one_line(exc)}"
        ) from None
    slots, other = [], []
    for key, value in state.items():
        if torch.is_tensor(value) and value.shape == x0.shape:
            slots.append(key)
        elif key != "step":
            other.append(key)
    if other:
        raise ConfigError(
            f"train.optimizer {name!r} keeps state ElasWave cannot shard: {other[0]!r}"
        )
    if len(slots) > 2:
        raise ConfigError(
            f"train.optimizer {name!r} keeps {len(slots)} tensors per parameter "
            f"({', '.join(slots)}); ElasWave's flat state has two"
        )
    rule.slots = tuple(slots)
    try:
        whole = _through_slots(rule, x0, grads, groups=groups, cuts=[64])
        halves = _through_slots(rule, x0, grads, groups=groups, cuts=[32, 32])
    except Exception as exc:  # noqa: BLE001 - a class that cannot step from restored state
        why = one_line(exc)
        raise ConfigError(
            f"train.optimizer {name!r} cannot step from its state in ElasWave's slots: {why}"
        ) from None
    if not torch.equal(whole, native.detach()):
        raise ConfigError(f"train.optimizer {name!r}: its step through ElasWave's state slots "
                          "differs from its own")  # fmt: skip
    if not torch.equal(halves, native.detach()):
        if not _per_parameter(rule, groups):
            raise ConfigError(
                f"train.optimizer {name!r} is not element-wise (a tensor updated whole and in "
                "two halves differs) and does not step each parameter on its own"
            )
        rule.elementwise = False


PROBE_SHAPES = ((6, 5), (64,), (4, 3, 3, 3))  # a matrix, a vector, a convolution's weight


def _per_parameter(rule: TorchRule, groups: list[dict[str, Any]]) -> bool:
    """Whether the class steps each parameter on its own, its state fitting the parameter's
    room in the two slots: a matrix, a vector and a 4-d weight stepped together natively, and
    one by one through :meth:`TorchRule.apply_packed`, give the same bits."""
    g = torch.Generator().manual_seed(1)
    x0 = [torch.randn(s, generator=g) for s in PROBE_SHAPES]
    grads = [[torch.randn(s, generator=g) for s in PROBE_SHAPES] for _ in groups]
    try:
        native = [x.clone().requires_grad_(True) for x in x0]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = rule.cls(native, **{**rule.args, **groups[0]})
        for k, step_grads in enumerate(grads):
            opt.param_groups[0].update(groups[k])
            for x, grad in zip(native, step_grads, strict=True):
                x.grad = grad.clone()
            opt.step()
        mine = [x.clone() for x in x0]
        slots = [(torch.zeros(x.numel()), torch.zeros(x.numel())) for x in x0]
        for step, step_grads in enumerate(grads, start=1):
            for x, grad, (s1, s2) in zip(mine, step_grads, slots, strict=True):
                rule.apply_packed(x, grad.clone(), s1, slot2=s2, step=step, group=groups[step - 1])
    except Exception:  # noqa: BLE001 - not a class that steps parameters on their own
        return False
    return all(torch.equal(a, b.detach()) for a, b in zip(mine, native, strict=True))


def _through_slots(
    rule: TorchRule,
    x0: torch.Tensor,
    grads: list[torch.Tensor],
    *,
    groups: list[dict[str, Any]],
    cuts: list[int],
) -> torch.Tensor:
    x = x0.clone()
    s1, s2 = torch.zeros_like(x), torch.zeros_like(x)
    for step, grad in enumerate(grads, start=1):
        a = 0
        for n in cuts:
            part = slice(a, a + n)
            rule.apply(
                x[part],
                grad[part].clone(),
                s1[part],
                slot2=s2[part],
                step=step,
                group=groups[step - 1],
            )
            a += n
    return x


class ScheduleReplay:
    """The scheduled hyper-parameters of every step: a scheduler class replayed on a
    one-element optimizer of the job's kind, once, in order (``at`` is a pure function)."""

    def __init__(self, make: Callable[[], torch.optim.lr_scheduler.LRScheduler]) -> None:
        self._make = make
        self._sched: torch.optim.lr_scheduler.LRScheduler | None = None
        self._values: list[dict[str, Any]] = []

    def at(self, step: int) -> dict[str, Any]:
        """What the optimizer's group holds for ``step`` (from 1)."""
        if self._sched is None:
            self._sched = self._make()
        opt = self._sched.optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while len(self._values) < step:
                if self._values:
                    opt.step()
                    self._sched.step()
                group = opt.param_groups[0]
                self._values.append({k: group[k] for k in SCHEDULED if k in group})
        return self._values[step - 1]

    def lr(self, step: int) -> float:
        return float(self.at(step)["lr"])


def schedule_replay(
    cfg: JobConfig, rule: TorchRule | None, *, whole: bool = False
) -> ScheduleReplay | None:
    """``train.lr_schedule`` as a class, checked by building it and taking its first steps
    (``whole``: every step of the job, as launch checks it once; a worker replays as it goes);
    None for the built-in ``constant`` and ``cosine``."""
    t = cfg.train
    if t.lr_schedule in ("constant", "cosine"):
        return None
    cls = resolve_class(t.lr_schedule, "train.lr_schedule")
    if not issubclass(cls, torch.optim.lr_scheduler.LRScheduler):
        raise ConfigError(f"train.lr_schedule {t.lr_schedule!r} is not a torch.optim.lr_scheduler")

    def make() -> torch.optim.lr_scheduler.LRScheduler:
        dummy = torch.zeros(1, requires_grad=True)
        if rule is not None:
            opt = rule._make(dummy, {"lr": t.lr})
        elif t.optimizer == "sgd":
            opt = torch.optim.SGD([dummy], lr=t.lr, momentum=t.momentum)
        else:
            opt = torch.optim.AdamW([dummy], lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cls(opt, **t.lr_schedule_args)

    replay = ScheduleReplay(make)
    try:
        first = replay.at(1)
        for step in range(2, min(t.steps, 64) + 1):
            moved = [k for k in SCHEDULED if k != "lr" and replay.at(step).get(k) != first.get(k)]
            if moved and rule is None:
                raise ConfigError(
                    f"train.lr_schedule {t.lr_schedule!r} changes {moved[0]}: with the built-in "
                    f"{t.optimizer} only the learning rate is scheduled (name the optimizer as a "
                    "torch.optim class to schedule it all)"
                )
        if whole:
            replay.at(t.steps)  # a scheduler that cannot reach the last step fails now
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - wrong arguments, a scheduler that cannot step
        raise ConfigError(f"train.lr_schedule {t.lr_schedule!r}: {one_line(exc)}") from None
    return replay


def optimizer_classes(
    cfg: JobConfig, *, whole: bool = False
) -> tuple[TorchRule | None, ScheduleReplay | None]:
    """``train.optimizer`` and ``train.lr_schedule`` where they name classes, probed with the
    group values the schedule gives (one line for a class that does not fit the flat state);
    ``whole``: the schedule replayed to the last step (launch's check)."""
    t = cfg.train
    rule = None
    if t.optimizer not in ("adamw", "sgd"):
        rule = torch_rule(t.optimizer, t.optimizer_args)
    replay = schedule_replay(cfg, rule, whole=whole)
    if rule is not None:
        steps = sorted({1, max(1, t.steps // 2), t.steps})
        groups = [replay.at(s) if replay is not None else {"lr": t.lr} for s in steps]
        probe(rule, groups)
        if not rule.elementwise and (cfg.zero or cfg.pp > 1):
            raise ConfigError(
                f"train.optimizer {t.optimizer!r} steps whole parameters (not element-wise): "
                f"{'ZeRO' if cfg.zero else 'a pipeline'} updates slices of them; replicated data "
                "parallelism takes it"
            )
    return rule, replay
