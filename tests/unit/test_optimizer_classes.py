"""Optimizer and scheduler classes on the flat state: which fit (the probe's table), that a
fitting one's update through the slots is its own, in any slicing, and that a replayed
scheduler gives each step what the live scheduler gives it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.optim import FlatOptimizer, OptimHyper
from elaswave.runtime.optimizers import optimizer_classes


class GlobalNormSGD(torch.optim.SGD):
    """SGD on gradients divided by their norm over every parameter: neither element-wise nor
    per parameter (a user's class ElasWave must refuse)."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in params))
        for p in params:
            p.grad.div_(norm)
        return super().step(closure)


def _cfg(**train: Any) -> JobConfig:
    return JobConfig.from_dict({"train": train})


@pytest.mark.parametrize(
    ("name", "args", "slots"),
    [
        ("torch.optim.RMSprop", {}, ("square_avg",)),
        ("torch.optim.RMSprop", {"momentum": 0.9}, ("square_avg", "momentum_buffer")),
        ("torch.optim.Adagrad", {"initial_accumulator_value": 0.1}, ("sum",)),
        ("torch.optim.Adam", {}, ("exp_avg", "exp_avg_sq")),
        ("torch.optim.AdamW", {"weight_decay": 0.1}, ("exp_avg", "exp_avg_sq")),
        ("torch.optim.SGD", {"momentum": 0.9, "nesterov": True}, ("momentum_buffer",)),
        ("torch.optim:Adamax", {}, ("exp_avg", "exp_inf")),
    ],
)
def test_element_wise_optimizers_fit(name: str, args: dict[str, Any], slots: tuple) -> None:
    rule, replay = optimizer_classes(_cfg(optimizer=name, optimizer_args=args))
    assert rule is not None and rule.slots == slots and replay is None


def test_a_momentum_the_scheduler_switches_on_gets_its_slot() -> None:
    """RMSprop without momentum under OneCycleLR, which cycles a momentum: the probe runs with
    the scheduled values, so the momentum buffer the steps will need is a slot."""
    rule, replay = optimizer_classes(
        _cfg(optimizer="torch.optim.RMSprop", steps=10,
             lr_schedule="torch.optim.lr_scheduler.OneCycleLR",
             lr_schedule_args={"max_lr": 0.01, "total_steps": 10}),
        whole=True,
    )  # fmt: skip
    assert rule is not None and rule.slots == ("square_avg", "momentum_buffer")
    assert replay is not None and replay.at(1)["momentum"] > 0


@pytest.mark.parametrize(
    ("name", "args", "message"),
    [
        ("tests.unit.test_optimizer_classes:GlobalNormSGD", {}, "does not step each parameter"),
        ("torch.optim.NAdam", {}, "keeps state ElasWave cannot shard: 'mu_product'"),
        ("torch.optim.RMSprop", {"centered": True, "momentum": 0.9}, "keeps 3 tensors"),
        ("torch.optim.LBFGS", {}, "missing 1 required positional argument: 'closure'"),
        ("torch.optim.Adam", {"lr": 0.1}, "the learning rate is train.lr"),
        ("torch.nn.Linear", {}, "is not a torch.optim.Optimizer"),
        ("torch.optim.Nope", {}, "no such class"),
    ],
)
def test_the_others_are_refused_in_one_line(name: str, args: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        optimizer_classes(_cfg(optimizer=name, optimizer_args=args))
    assert "\n" not in str(err.value)


def test_config_errors() -> None:
    for train, message in [
        ({"optimizer": "rms"}, "adamw, sgd or a dotted class name"),
        ({"optimizer_args": {"alpha": 1}}, "optimizer_args needs train.optimizer: an optimizer"),
        ({"optimizer": "torch.optim.Adam", "weight_decay": 0.1}, "in train.optimizer_args"),
        ({"lr_schedule": "onecycle"}, "constant, cosine or a dotted class name"),
        ({"lr_schedule_args": {"a": 1}}, "needs train.lr_schedule: a scheduler class"),
        ({"lr_schedule": "torch.optim.lr_scheduler.StepLR", "warmup_steps": 3}, "warm-up"),
    ]:
        with pytest.raises(ConfigError, match=message):
            _cfg(**train)


@pytest.mark.parametrize(
    ("cls", "args", "schedule"),
    [
        (torch.optim.RMSprop, {"momentum": 0.5}, {"max_lr": 0.05, "total_steps": 6}),
        (torch.optim.Adagrad, {"initial_accumulator_value": 0.1}, None),
    ],
)
def test_an_optimizer_class_steps_shards_as_it_steps_the_whole(
    cls: type, args: dict[str, Any], schedule: dict[str, Any] | None
) -> None:
    """Through FlatOptimizer, the whole buffer and the same buffer in three ZeRO-like shards
    end in the bits torch's own optimizer (and OneCycleLR) reach on the tensor, its state in
    the slots (Adagrad's starts from its initial accumulator)."""
    sched_cfg = {"lr_schedule": "torch.optim.lr_scheduler.OneCycleLR",
                 "lr_schedule_args": schedule} if schedule else {}  # fmt: skip
    cfg = _cfg(optimizer=f"torch.optim.{cls.__name__}", optimizer_args=args, steps=6, **sched_cfg)
    rule, replay = optimizer_classes(cfg)
    hyper = OptimHyper(lr=cfg.train.lr, rule=rule, replay=replay)
    g = torch.Generator().manual_seed(1)
    x0, grads = torch.randn(300, generator=g), [torch.randn(300, generator=g) for _ in range(6)]

    live = x0.clone().requires_grad_(True)
    opt = cls([live], lr=cfg.train.lr, **args)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, **schedule) if schedule else None
    for grad in grads:
        live.grad = grad.clone()
        opt.step()
        if sched is not None:
            sched.step()

    whole = x0.clone()
    flat = FlatOptimizer(300, hyper)
    for grad in grads:
        flat.step(whole, grad.clone())
    assert torch.equal(whole, live.detach())

    cuts = [(0, 100), (100, 250), (250, 300)]
    shards = [(x0[a:b].clone(), FlatOptimizer(b - a, hyper)) for a, b in cuts]
    for grad in grads:
        for (a, b), (x, o) in zip(cuts, shards, strict=True):
            o.step(x, grad[a:b].clone())
    assert torch.equal(torch.cat([x for x, _ in shards]), live.detach())
    first = rule.slots[0] if rule is not None else ""
    assert torch.equal(torch.cat([o.exp_avg for _, o in shards]), opt.state[live][first])


def test_a_class_that_steps_whole_parameters_runs_replicated_only() -> None:
    """Adafactor (factored moments, update clipping over the tensor) is not element-wise but
    steps each parameter on its own: replicated data parallelism takes it, its state packed
    into each parameter's room in the two slots, and the flat update is torch's own, bit for
    bit; ZeRO and pipelines, which update slices, refuse it in one line."""
    cfg = _cfg(optimizer="torch.optim.Adafactor", optimizer_args={"beta2_decay": -0.7}, steps=5)
    rule, _ = optimizer_classes(cfg)
    assert rule is not None and not rule.elementwise
    shapes = (torch.Size([7, 5]), torch.Size([5]), torch.Size([3, 2, 3, 3]))
    hyper = OptimHyper(lr=cfg.train.lr, rule=rule, shapes=shapes)
    g = torch.Generator().manual_seed(2)
    live = [torch.randn(s, generator=g).requires_grad_(True) for s in shapes]
    x0 = torch.cat([p.detach().reshape(-1) for p in live])
    grads = [torch.randn(x0.numel(), generator=g) for _ in range(5)]
    opt = torch.optim.Adafactor(live, lr=cfg.train.lr, beta2_decay=-0.7)
    flat, mine = FlatOptimizer(x0.numel(), hyper), x0.clone()
    for grad in grads:
        for p, part in zip(live, grad.split([s.numel() for s in shapes]), strict=True):
            p.grad = part.view(p.shape).clone()
        opt.step()
        flat.step(mine, grad.clone())
    assert torch.equal(mine, torch.cat([p.detach().reshape(-1) for p in live]))
    row = opt.state[live[0]]["row_var"]  # the matrix's factored moment, in its first slot
    assert torch.equal(flat.exp_avg[: row.numel()], row.reshape(-1))
    with pytest.raises(RuntimeError, match="steps whole parameters"):
        flat.step(mine[:10], grads[0][:10].clone())
    for placement, where in (({"zero": 1}, "ZeRO"), ({"pp": 2}, "a pipeline")):
        doc = {"train": {"optimizer": "torch.optim.Adafactor"}, **placement}
        with pytest.raises(ConfigError, match=f"not element-wise\\): {where} updates slices"):
            optimizer_classes(JobConfig.from_dict(doc))
