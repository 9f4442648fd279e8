"""The optimizer: the learning-rate schedule, the clip factor and the weight-decay groups
(pure functions, table-tested), and the AdamW and SGD updates against torch.optim."""

from __future__ import annotations

import math

import pytest
import torch

from elaswave.runtime.optim import (
    FlatOptimizer,
    OptimHyper,
    clip_factor,
    decay_groups,
    learning_rate,
    update_,
)

KW = {"lr": 1.0, "total": 10, "min_lr": 0.1}


@pytest.mark.parametrize(
    ("step", "schedule", "warmup", "expected"),
    [
        (1, "constant", 0, 1.0),
        (7, "constant", 0, 1.0),
        (1, "constant", 4, 0.25),  # linear warmup
        (4, "constant", 4, 1.0),
        (5, "constant", 4, 1.0),
        (1, "cosine", 0, 0.1 + 0.45 * (1 + math.cos(math.pi * 0.1))),
        (5, "cosine", 0, 0.55),  # half way: the mean of lr and min_lr
        (10, "cosine", 0, 0.1),  # the last step reaches min_lr
        (12, "cosine", 0, 0.1),  # and stays there (a job extended past total)
        (2, "cosine", 2, 1.0),  # the end of warmup is the peak
        (6, "cosine", 2, 0.55),
    ],
)
def test_learning_rate(step: int, schedule: str, warmup: int, expected: float) -> None:
    got = learning_rate(step, schedule=schedule, warmup=warmup, **KW)
    assert got == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("values", "max_norm", "ties", "expected"),
    [
        ([3.0, 4.0], 0.0, (), 1.0),  # off
        ([3.0, 4.0], 10.0, (), 1.0),  # under the limit: untouched
        ([3.0, 4.0], 1.0, (), 1.0 / (5.0 + 1e-6)),
        # a tied weight's two copies (slices 0:2 and 2:4) count once: norm 5, not 5·√2
        ([3.0, 4.0, 3.0, 4.0], 1.0, ((slice(0, 2), slice(2, 4)),), 1.0 / (5.0 + 1e-6)),
    ],
)
def test_clip_factor(values: list[float], max_norm: float, ties: tuple, expected: float) -> None:
    assert clip_factor(torch.tensor(values), max_norm, ties) == pytest.approx(expected, rel=1e-9)


# -- the update against torch.optim ------------------------------------------------------------

GROUPS = ([0.0, 0.1], [0, 0, 1, 1, 1, 0, 1, 1])  # two groups: no decay and 0.1


def _flat_run(optimizer: str, steps: int, grouped: bool) -> torch.Tensor:
    """``steps`` updates of one flat buffer by :func:`update_`, warmup + cosine schedule."""
    decays, index = GROUPS
    hyper = OptimHyper(
        lr=0.1, optimizer=optimizer, weight_decay=0.0 if grouped else 0.1, schedule="cosine",
        warmup=2, total=steps, min_lr=0.01,
        group_decay=tuple(decays) if grouped else (),
        groups=torch.tensor(index, dtype=torch.uint8) if grouped else None,
    )  # fmt: skip
    param = torch.linspace(-1.0, 1.0, 8)
    opt = FlatOptimizer(8, hyper)
    for step in range(1, steps + 1):
        opt.step(param, _grad(step), hyper.groups)
    return param


def _grad(step: int) -> torch.Tensor:
    return torch.sin(torch.arange(8, dtype=torch.float32) * step)


def _torch_run(optimizer: str, steps: int, grouped: bool) -> torch.Tensor:
    """The same updates by torch.optim on one parameter per element group."""
    decays, index = GROUPS
    param = torch.linspace(-1.0, 1.0, 8)
    where = (
        [[i for i, g in enumerate(index) if g == k] for k in range(2)] if grouped else [range(8)]
    )
    parts = [torch.nn.Parameter(param[list(w)].clone()) for w in where]
    wds = decays if grouped else [0.1]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(parts, wds, strict=True)]
    if optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9, foreach=False)
    else:
        opt = torch.optim.AdamW(groups, lr=0.1, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for step in range(1, steps + 1):
        lr = learning_rate(step, lr=0.1, schedule="cosine", warmup=2, total=steps, min_lr=0.01)
        for group in opt.param_groups:
            group["lr"] = lr
        g = _grad(step)
        for p, w in zip(parts, where, strict=True):
            p.grad = g[list(w)].clone()
        opt.step()
    out = torch.empty(8)
    for p, w in zip(parts, where, strict=True):
        out[list(w)] = p.detach()
    return out


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("grouped", [False, True])
def test_the_update_is_torch_optims_bit_for_bit(optimizer: str, grouped: bool) -> None:
    """AdamW and SGD with momentum, one weight decay or two parameter groups, under warmup +
    cosine: the flat update gives torch.optim's (single-tensor) parameters exactly."""
    ours = _flat_run(optimizer, 6, grouped)
    assert torch.equal(ours, _torch_run(optimizer, 6, grouped)), (ours, optimizer, grouped)
    assert not torch.equal(ours, torch.linspace(-1.0, 1.0, 8))


def test_a_slice_updates_as_the_whole_buffer_does() -> None:
    """Element-wise with groups: updating two halves (their groups sliced) equals one update."""
    decays, index = GROUPS
    for optimizer in ("adamw", "sgd"):
        hyper = OptimHyper(
            lr=0.1, optimizer=optimizer, group_decay=tuple(decays),
            groups=torch.tensor(index, dtype=torch.uint8),
        )  # fmt: skip
        whole, halves = torch.linspace(-1.0, 1.0, 8), torch.linspace(-1.0, 1.0, 8)
        m, v, m2, v2 = (torch.zeros(8) for _ in range(4))
        for step in (1, 2, 3):
            update_(
                whole,
                _grad(step),
                m,
                exp_avg_sq=v,
                step=step,
                h=hyper,
                groups=hyper.groups_of(slice(0, 8)),
            )
            for s in (slice(0, 3), slice(3, 8)):
                update_(
                    halves[s],
                    _grad(step)[s],
                    m2[s],
                    exp_avg_sq=v2[s],
                    step=step,
                    h=hyper,
                    groups=hyper.groups_of(s),
                )
        assert torch.equal(whole, halves)
        index_of = torch.tensor([5, 8, 1])  # a ZeRO shard's gather index; 8 is padding
        assert hyper.groups_of(index_of).tolist() == [0, 0, 0]


@pytest.mark.parametrize(
    ("name", "ndim", "embedding", "rules", "expected"),
    [
        ("layers.1.block.mlp.up_proj.weight", 2, None, [], 0.1),  # a matrix decays
        ("layers.1.block.mlp.up_proj.bias", 1, None, [], 0.0),  # a bias does not
        ("layers.3.norm.weight", 1, None, [], 0.0),  # nor a norm scale
        ("layers.0.embed_tokens.weight", 2, "layers.0.embed_tokens", [], 0.1),  # token table
        ("layers.0.wpe.weight", 2, "layers.0.wpe", [], 0.0),  # positional tables do not
        ("layers.0.pos.weight", 2, "layers.0.pos", [], 0.0),
        ("layers.0.embed_positions.weight", 2, "layers.0.embed_positions", [], 0.0),
        ("layers.0.wte.weight", 2, "layers.0.wte", [(["*.wte.*"], 0.0)], 0.0),  # a rule first
        ("layers.2.block.ln_1.bias", 1, None, [(["layers.2.*"], 0.3)], 0.3),
        ("layers.2.block.ln_1.bias", 1, None, [(["*.x"], 0.5), (["*bias"], 0.2)], 0.2),
    ],
)
def test_decay_groups(
    name: str, ndim: int, embedding: str | None, rules: list, expected: float
) -> None:
    assert decay_groups([(name, ndim, embedding)], 0.1, rules) == [expected]


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_cpu_chunks_give_the_single_pass_bits(
    optimizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The update over cache-sized chunks (with groups cut at chunk edges) equals one pass over
    the whole buffer, bit for bit."""
    from elaswave.runtime import optim

    n = 3 * optim.CPU_CHUNK + 123
    index = (torch.arange(n) % 7 == 0).to(torch.uint8)  # groups change inside every chunk
    hyper = OptimHyper(lr=0.1, optimizer=optimizer, group_decay=(0.1, 0.0), groups=index)
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) for _ in range(3)]

    def run() -> torch.Tensor:
        param = torch.linspace(-1.0, 1.0, n)
        opt = FlatOptimizer(n, hyper)
        for grad in grads:
            opt.step(param, grad, hyper.groups)
        return torch.cat([param, opt.exp_avg, opt.exp_avg_sq])

    chunked = run()
    monkeypatch.setattr(optim, "CPU_CHUNK", n)
    assert torch.equal(chunked, run())
