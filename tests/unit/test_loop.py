"""The own-loop API's pure parts: the rule made of a script's optimizer, the replay of its
scheduler, what a script's job config refuses, and init() outside a job."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import elaswave
from elaswave import wire
from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.runtime.loop import ScriptError
from elaswave.runtime.registered import optimizer_rule

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 3))


SCHEDULES = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=STEPS),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5),
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_replayed_schedule_gives_each_step_the_rate_the_script_s_own_would(name: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = SCHEDULES[name](opt)
    _, replay, _ = optimizer_rule(opt, sched, STEPS)
    assert replay is not None
    native = []
    for _ in range(STEPS):  # the script's own objects, stepped as a plain loop steps them
        native.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert [replay.lr(s) for s in range(1, STEPS + 1)] == native
    # ... and a second replay (a newcomer's) gives the same again
    fresh = torch.optim.SGD(_model().parameters(), lr=0.05, momentum=0.9)
    _, again, _ = optimizer_rule(fresh, SCHEDULES[name](fresh), STEPS)
    assert again is not None and [again.lr(s) for s in range(1, STEPS + 1)] == native


def test_the_rule_steps_a_slice_as_the_script_s_optimizer_steps_its_parameters() -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95), weight_decay=0.1)
    rule, replay, lr = optimizer_rule(opt, None, STEPS)
    assert replay is None and lr == 0.01
    assert rule.args["betas"] == (0.8, 0.95) and rule.args["weight_decay"] == 0.1
    assert "decoupled_weight_decay" not in rule.args  # held by the group, not a constructor arg
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    slots = [torch.zeros_like(flat), torch.zeros_like(flat)]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=g) for p in model.parameters()]
        for p, gr in zip(model.parameters(), grads, strict=True):
            p.grad = gr
        opt.step()
        flat_grad = torch.cat([x.reshape(-1) for x in grads])
        rule.apply(flat, flat_grad, slots[0], slot2=slots[1], step=step, group={"lr": lr})
    assert torch.equal(flat, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


@pytest.mark.parametrize(
    "make, says",
    [
        (
            lambda m: torch.optim.SGD(
                [{"params": list(m.parameters())[:2]}, {"params": list(m.parameters())[2:]}],
                lr=0.1,
            ),
            "2 parameter groups",
        ),
        (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, maximize=True), "maximize=True"),
        (lambda m: torch.optim.LBFGS(m.parameters(), lr=0.1), "the optimizer"),
    ],
    ids=["two-groups", "maximize", "lbfgs"],
)
def test_an_optimizer_the_flat_state_cannot_hold_is_refused_in_one_line(make, says: str) -> None:
    with pytest.raises(ScriptError) as err:
        optimizer_rule(make(_model()), None, STEPS)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_scheduler_that_stepped_already_is_refused() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    opt.step()
    sched.step()
    with pytest.raises(ScriptError, match="before it steps"):
        optimizer_rule(opt, sched, STEPS)


@pytest.mark.parametrize(
    "values, says",
    [
        ({"script": "t.py", "pp": 2, "train": {"global_batch": 8, "micro_batch_size": 1}},
         "pipelines cut the model"),
        ({"script": "t.py", "zero": 3}, "zero: 3 gathers"),
        ({"script_args": ["--x"]}, "script_args needs a script"),
        ({"script": "t.py", "replay_every": 1}, "replay_every: a script's own loop"),
    ],
)  # fmt: skip
def test_what_a_script_job_does_not_run_is_refused(values: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        JobConfig.from_dict(values)


def test_init_outside_a_job_says_how_to_start_one() -> None:
    with pytest.raises(ScriptError, match="elaswave launch --script FILE"):
        elaswave.init()


class _Control:
    """What a Job asks of its control channel before the engine starts (a fake: no daemon)."""

    latest_plan = None

    def __init__(self) -> None:
        self.sent: list[dict] = []

    def send(self, msg: dict) -> None:
        self.sent.append(msg)


def _job() -> tuple[elaswave.runtime.loop.Job, _Control]:
    from elaswave.runtime.loop import Job, Session

    control = _Control()
    cfg = JobConfig.from_dict({"script": "train.py", "train": {"steps": STEPS}})
    return Job(Session(cfg, control, "h.w0", "127.0.0.1", torch.device("cpu"))), control


@pytest.mark.parametrize(
    "misuse, says",
    [
        ("steps-first", "steps() before register(model, optimizer)"),
        ("twice", "register() called twice"),
        ("late", "register() after steps()"),
        ("not-the-model's", "exactly the model's trainable parameters"),
        ("batchnorm", "1 (BatchNorm1d) keeps running statistics"),
        ("shape", "steps(global_batch=7) differs from the job's 32: launch with --global-batch 7"),
    ],
)
def test_the_api_s_misuse_before_the_loop_is_one_line(misuse: str, says: str) -> None:
    job, control = _job()
    assert control.sent == [wire.Ready(worker_id="h.w0")]  # init() reports ready
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ScriptError) as err:
        if misuse == "steps-first":
            job.steps(dataset=[1, 2])
        elif misuse == "twice":
            job.register(model, opt)
            job.register(model, opt)
        elif misuse == "late":
            job.register(model, opt)
            job._engine = object()  # steps() has started
            job.register(model, opt)
        elif misuse == "not-the-model's":
            job.register(model, torch.optim.SGD(_model().parameters(), lr=0.1))
        elif misuse == "batchnorm":
            bn = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4))
            job.register(bn, torch.optim.SGD(bn.parameters(), lr=0.1))
        else:
            job.register(model, opt)
            job.steps(dataset=[1, 2], global_batch=7)
    assert says in str(err.value) and "\n" not in str(err.value)
