"""The strategies over a fake communicator (ranks are threads): properties of one step and of a
plan change that are easy to state without processes."""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from elaswave.config import JobConfig
from elaswave.planning.plan import Plan, assign_microbatches
from elaswave.prune.pruner import Pruner
from elaswave.runtime.durable.restore import DurableSource
from elaswave.runtime.evaluate import eval_microbatches, evaluate, training_samples
from elaswave.runtime.state import RankContext, TrainState
from elaswave.runtime.strategies.base import Strategy, mean_gradient, step_sums
from elaswave.runtime.strategies.replicated import Replicated
from elaswave.runtime.strategies.select import strategy_for
from elaswave.runtime.strategies.zero.strategy import Zero1, Zero3
from elaswave.runtime.workload.data import microbatches
from examples.mlp_classifier import MLPClassifier
from tests.unit.threadcomm import Hub, ThreadComm, run_ranks

GLOBAL_BATCH, MICRO = 16, 2
# The ranks are threads of one process and share torch's default generator, which the runtime
# seeds around every layer build and call (inits keyed by layer; dropout masks by step,
# micro-batch and layer): build and compute one rank at a time, as separate processes would
# without sharing it.
COMPUTE = threading.Lock()


class CountsSomeLabels(MLPClassifier):
    """Its loss ignores the samples of class 0 (as a language model ignores padding): every
    micro-batch counts a different number of terms."""

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        keep = targets != 0
        return F.cross_entropy(output[keep], targets[keep], reduction="sum"), int(keep.sum())


def counts_some_labels(**args: Any) -> CountsSomeLabels:
    return CountsSomeLabels(num_samples=4096, **args)


class _OutputOfTied(nn.Module):
    """The output layer reading layer 0's input matrix (hidden × features) transposed."""

    def __init__(self, hidden: int, classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, classes))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.weight


class TiedEnds(MLPClassifier):
    """features == classes: layer 0's input weight and the output layer's weight are one logical
    matrix (as tied input/output embeddings are)."""

    def build_layer(self, index: int, seed: int) -> nn.Module:
        # The tied matrix comes from its own stream, so both layers build the same values.
        tied = torch.randn(
            self.hidden, self.features, generator=torch.Generator().manual_seed(seed)
        )
        if index == self.num_layers - 1:
            layer = _OutputOfTied(self.hidden, self.classes)
            layer.weight.data.copy_(tied * 0.1)
            return layer
        layer = super().build_layer(index, seed)
        if index == 0:
            layer[0].weight.data.copy_(tied * 0.1)
        return layer

    def tied(self) -> list[tuple[tuple[int, str], tuple[int, str]]]:
        return [((0, "0.weight"), (self.num_layers - 1, "weight"))]


def tied_ends(**args: Any) -> TiedEnds:
    args["classes"] = args["features"]
    return TiedEnds(num_samples=4096, **args)


def _cfg(
    zero: int = 0,
    reduce_dtype: str = "float64",
    factory: str = "examples.mlp_classifier:mlp_classifier",
    **train: Any,
) -> JobConfig:
    return JobConfig.from_dict(
        {
            "zero": zero,
            "model": {
                "source": "module",
                "factory": factory,
                "args": {"features": 8, "hidden": 16, "depth": 2, "classes": 3, "dropout": 0.1},
            },
            "train": {
                "global_batch": GLOBAL_BATCH,
                "micro_batch_size": MICRO,
                "seed": 7,
                "reduce_dtype": reduce_dtype,
                **train,
            },
        }
    )


def _plan(world: int, epoch: int = 1, committed: int = 0) -> Plan:
    workers = tuple(f"w{r}" for r in range(world))
    return Plan(
        epoch=epoch,
        workers=workers,
        hosts=tuple(f"h{r}" for r in range(world)),
        microbatches=assign_microbatches(GLOBAL_BATCH // MICRO, [1.0] * world),
        store="",
        committed=committed,
    )


def _strategy(cfg: JobConfig, comm: ThreadComm, plan: Plan) -> tuple[Strategy, list[Any]]:
    events: list[Any] = []
    with COMPUTE:
        state = TrainState.build(cfg, pruning=Pruner.build)  # as the worker's entry builds it
    ctx = RankContext(
        state, cfg, comm, f"w{comm.me}",
        lambda kind, **f: events.append((kind, f)), events.append, lambda phase: None,
        lambda workers: False, plan,
    )  # fmt: skip
    strategy = strategy_for(ctx, DurableSource(ctx, None))
    if isinstance(strategy, Zero3):  # its compute meets the peers: lock each layer call instead
        state.model.run_layer = _locked(state.model.run_layer)  # type: ignore[method-assign]
        strategy.shards.initial = _locked(strategy.shards.initial)
    return strategy, events


def _locked(fn: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        with COMPUTE:
            return fn(*args, **kwargs)

    return call


def _computing(strategy: Strategy) -> Any:
    """The lock around a rank's compute (ZeRO-3 locks each layer call: it meets its peers)."""
    return contextlib.nullcontext() if isinstance(strategy, Zero3) else COMPUTE


def _train(strategy: Strategy, steps: int) -> None:
    """What the engine's loop does, without faults and reports."""
    st = strategy.state
    sums = step_sums(st, strategy.ctx.cfg.train.reduce_dtype)
    for step in range(st.step + 1, st.step + 1 + steps):
        sums.grads.zero_()
        sums.tail.zero()
        n = training_samples(len(st.dataset), strategy.ctx.cfg.data.eval_samples)  # as the engine
        every = microbatches(7, step, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=n)
        with _computing(strategy):
            strategy.compute(step, every, sums, slowdown=0.0)
        st.tie_gradients(sums.grads)
        strategy.reduce_update(step, sums, lambda: False, before_update=lambda: None)


def _whole(strategy: Strategy) -> torch.Tensor:
    return strategy.whole(lambda: False).copy()


def _native(strategy: Strategy, comm: ThreadComm) -> list[int]:
    """ZeRO-1 as it runs on NCCL: each rank receives only its part of the gradient sums (a
    reduce-scatter) instead of keeping its part of an all-reduce. Returns the list each
    reduce-scatter appends to."""
    assert isinstance(strategy, Zero1) and not isinstance(strategy, Zero3)
    strategy.zero.native_reduce_scatter = True
    calls: list[int] = []
    scatter = comm.reduce_scatter

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(1)
        scatter(*args, **kwargs)

    comm.reduce_scatter = counted  # type: ignore[method-assign]
    return calls


def _run(
    world: int, zero: int, steps: int, factory: str = "", native: bool = False, **train: Any
) -> list[torch.Tensor]:
    cfg, plan = _cfg(zero, factory=factory or _cfg().model.factory, **train), _plan(world)

    def body(rank: int, comm: ThreadComm) -> torch.Tensor:
        strategy, _ = _strategy(cfg, comm, plan)
        calls = _native(strategy, comm) if native else []
        strategy.sync(plan, lambda: False)
        _train(strategy, steps)
        assert strategy.state.step == steps
        assert len(calls) == (steps if native else 0)
        return _whole(strategy)

    return run_ranks(world, body)


def test_the_strategy_follows_the_config() -> None:
    def body(rank: int, comm: ThreadComm) -> list[type]:
        return [type(_strategy(_cfg(z), comm, _plan(1))[0]) for z in (0, 1, 3)]

    assert run_ranks(1, body)[0] == [Replicated, Zero1, Zero3]


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_every_rank_ends_with_the_same_state_as_one_rank_alone(zero: int) -> None:
    """A rank's share of the fixed batch never changes the update: 1, 2 and 4 ranks (float64
    reduction), replicated, ZeRO-1 or ZeRO-3 (layers gathered while they run, recomputed for
    their backward, gradients reduce-scattered), reach the same whole state bit for bit."""
    alone = _run(1, 0, 3)[0]
    for world in (2, 4):
        wholes = _run(world, zero, 3)
        assert all(torch.equal(w, wholes[0]) for w in wholes)
        assert torch.equal(wholes[0], alone)
        assert not torch.equal(wholes[0], _run(1, 0, 2)[0])  # the steps did change the state


COUNTING = "tests.unit.test_strategies:counts_some_labels"


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_a_loss_that_counts_terms_is_a_mean_over_the_whole_batch(zero: int) -> None:
    """Micro-batches that count different numbers of terms: 1, 2 and 4 ranks still reach the
    same state bit for bit (the count is reduced with the gradient, divided once)."""
    alone = _run(1, 0, 3, COUNTING)[0]
    for world in (2, 4):
        assert all(torch.equal(w, alone) for w in _run(world, zero, 3, COUNTING))
    assert not torch.equal(alone, _run(1, 0, 3)[0])  # the ignored terms changed the training


def test_the_reduced_gradient_is_that_of_the_batch_mean() -> None:
    """mean_gradient(sums) equals autograd of (sum of every micro-batch's loss sum) / (sum of
    their counts), taken directly over the same micro-batches."""
    cfg = _cfg(factory=COUNTING)

    def body(rank: int, comm: ThreadComm) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        strategy, _ = _strategy(cfg, comm, _plan(1))
        st = strategy.state
        every = microbatches(
            7, 1, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=len(st.dataset)
        )
        sums = step_sums(st, "float64")
        with COMPUTE:
            strategy.compute(1, every, sums, slowdown=0.0)
        grad, _, _ = mean_gradient(sums)
        total, counts = torch.zeros(()), []
        with COMPUTE:
            for mb in every:
                inputs, targets = st.microbatch(mb.sample_ids)
                loss, count = st.loss(st.model(inputs, 1, mb.id), targets)
                total, counts = total + loss, [*counts, count]
            (total / sum(counts)).backward()
        return grad.clone(), st.flat.collect_grads().clone(), counts

    reduced, direct, counts = run_ranks(1, body)[0]
    assert len(set(counts)) > 1  # the micro-batches did count differently
    assert torch.allclose(reduced, direct, rtol=1e-5, atol=1e-7)
    assert reduced.abs().sum() > 0


TIED = "tests.unit.test_strategies:tied_ends"


def _copies(world: int, zero: int, steps: int, tie: bool = True) -> list[torch.Tensor]:
    """Every rank's [layer 0's copy, the output layer's copy] of the tied weight after ``steps``."""
    cfg, plan = _cfg(zero, factory=TIED), _plan(world)

    def body(rank: int, comm: ThreadComm) -> torch.Tensor:
        strategy, _ = _strategy(cfg, comm, plan)
        st = strategy.state
        if not tie:
            st.ties = ()
        strategy.sync(plan, lambda: False)
        _train(strategy, steps)
        (a, b), *_ = st.workload.tied()
        params = strategy.whole(lambda: False).params  # ZeRO-3: gathered from the shards
        return torch.stack([params[st.model.param_slice(a)], params[st.model.param_slice(b)]])

    return run_ranks(world, body)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_tied_copies_stay_identical(zero: int) -> None:
    """Both copies of a tied weight get the whole weight's gradient: identical after every step
    on 1, 2 and 4 ranks, and the same on every rank count; untied, they drift apart."""
    start = _copies(1, 0, 0)[0]
    assert torch.equal(start[0], start[1])
    alone = _copies(1, 0, 3)[0]
    assert torch.equal(alone[0], alone[1]) and not torch.equal(alone[0], start[0])
    for world in (2, 4):
        assert all(torch.equal(c, alone) for c in _copies(world, zero, 3))
    untied = _copies(1, 0, 3, tie=False)[0]
    assert not torch.equal(untied[0], untied[1])


CLIPPED = {"grad_clip": 0.05, "lr_schedule": "cosine", "warmup_steps": 1, "min_lr": 1e-4}


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_clipping_and_a_schedule_keep_every_share_bit_identical(zero: int) -> None:
    """The clip factor comes from the whole model's mean gradient in flat order, the rate from
    the step alone: 1, 2 and 4 ranks, replicated, ZeRO-1 or ZeRO-3, still reach the same bits."""
    alone = _run(1, 0, 3, **CLIPPED)[0]
    for world in (2, 4):
        assert all(torch.equal(w, alone) for w in _run(world, zero, 3, **CLIPPED))
    assert not torch.equal(alone, _run(1, 0, 3)[0])  # clipping and the schedule did act
    assert not torch.equal(alone, _run(1, 0, 3, **{**CLIPPED, "grad_clip": 0.0})[0])


def _norms(
    world: int, zero: int, stream: bool, native: bool = False, **train: Any
) -> list[float | None]:
    """Each rank's ``last_grad_norm`` after one step."""
    cfg, plan = _cfg(zero, **train), _plan(world)
    cfg.logging.tensorboard = "tb" if stream else None

    def body(rank: int, comm: ThreadComm) -> float | None:
        strategy, _ = _strategy(cfg, comm, plan)
        if native:
            _native(strategy, comm)
        strategy.sync(plan, lambda: False)
        _train(strategy, 1)
        return strategy.state.last_grad_norm

    return run_ranks(world, body)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_rank_0_measures_the_global_gradient_norm_for_a_stream(zero: int) -> None:
    """With a stream to report to, rank 0 takes the global norm of the batch's mean gradient
    (before clipping: what torch's clip_grad_norm_ returns): the same number on 1, 2 and 4
    ranks, replicated or ZeRO-1, and the norm of the update one rank alone applies. The other
    ranks spend nothing on it; without a stream or clipping nobody does."""
    cfg = _cfg()

    def direct(rank: int, comm: ThreadComm) -> float:
        strategy, _ = _strategy(cfg, comm, _plan(1))
        st = strategy.state
        sums = step_sums(st, "float64")
        with COMPUTE:
            every = microbatches(
                7, 1, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=len(st.dataset)
            )
            strategy.compute(1, every, sums, slowdown=0.0)
        grad, _, _ = mean_gradient(sums)
        return float(torch.linalg.vector_norm(grad.double()))

    applied = run_ranks(1, direct)[0]  # of the float32 gradient the update used
    alone = _norms(1, 0, stream=True)[0]
    assert alone == pytest.approx(applied, rel=1e-6) and applied > 0
    for world in (2, 4):
        first, *others = _norms(world, zero, stream=True)
        assert first == pytest.approx(alone, rel=1e-12)
        assert others == [None] * (world - 1)
    assert _norms(2, zero, stream=False) == [None, None]
    clipped = _norms(2, zero, stream=False, grad_clip=1e-3)  # clipping takes it on every rank
    assert clipped == [pytest.approx(alone, rel=1e-12)] * 2


def test_zero1_with_a_native_reduce_scatter_keeps_every_share_bit_identical() -> None:
    """NCCL's ZeRO-1 path (each rank receives only its part of the sums; clipping takes the
    global norm from every rank's per-layer squares of its part), on the fake communicator: 2 and
    4 ranks reach one rank's bits with clipping and a schedule, and rank 0 reports one rank's
    norm (every rank takes it when clipping)."""
    alone = _run(1, 0, 3, **CLIPPED)[0]
    for world in (2, 4):
        assert all(torch.equal(w, alone) for w in _run(world, 1, 3, native=True, **CLIPPED))
    norm = _norms(1, 0, stream=True)[0]
    first, *others = _norms(4, 1, stream=True, native=True)
    assert first == pytest.approx(norm, rel=1e-12) and others == [None] * 3
    clipped = _norms(2, 1, stream=False, native=True, grad_clip=1e-3)
    assert clipped == [pytest.approx(norm, rel=1e-12)] * 2


SGD_GROUPS = {
    "optimizer": "sgd", "momentum": 0.8, "weight_decay": 0.05,
    "param_groups": [{"params": ["layers.0.*"], "weight_decay": 0.2}],
}  # fmt: skip


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_sgd_and_parameter_groups_keep_every_share_bit_identical(zero: int) -> None:
    """SGD with momentum and per-parameter weight decay (a group by name, biases exempt): each
    rank's share of the update, replicated or a ZeRO-1 shard, gives the same bits as one rank."""
    alone = _run(1, 0, 3, **SGD_GROUPS)[0]
    for world in (2, 4):
        assert all(torch.equal(w, alone) for w in _run(world, zero, 3, **SGD_GROUPS))
    assert not torch.equal(alone, _run(1, 0, 3, **{**SGD_GROUPS, "param_groups": []})[0])
    n = alone.numel() // 3
    assert torch.equal(alone[2 * n :], torch.zeros(n))  # SGD leaves the second moment unused


def test_the_held_out_loss_is_the_same_bits_on_any_number_of_ranks() -> None:
    """Evaluation after 2 steps: 1, 2, 3 and 4 ranks (replicated, ZeRO-1 or ZeRO-3) report the same
    held-out loss bit for bit: the mean over the held-out samples of the model in eval mode
    (dropout off)."""
    held = 20

    def body(world: int, zero: int) -> float:
        cfg = _cfg(zero)
        cfg.data.eval_samples = held
        plan = _plan(world)

        def rank(r: int, comm: ThreadComm) -> float:
            strategy, _ = _strategy(cfg, comm, plan)
            strategy.sync(plan, lambda: False)
            _train(strategy, 2)
            loss, samples, accuracy = evaluate(strategy.ctx, strategy, lambda: False)
            assert samples == held and accuracy is None  # a language model: no accuracy
            return loss

        losses = run_ranks(world, rank)
        assert len(set(losses)) == 1
        return losses[0]

    alone = body(1, 0)
    cases = ((2, 0), (3, 0), (4, 0), (2, 1), (4, 1), (1, 3), (3, 3), (4, 3))
    assert all(body(w, z) == alone for w, z in cases)
    # The same number from the trained model directly, in eval mode.
    cfg = _cfg()
    cfg.data.eval_samples = held

    def direct(r: int, comm: ThreadComm) -> float:
        strategy, _ = _strategy(cfg, comm, _plan(1))
        strategy.sync(_plan(1), lambda: False)
        _train(strategy, 2)
        st = strategy.state
        st.model.eval()
        total, count = 0.0, 0
        with torch.no_grad():
            for ids in eval_microbatches(len(st.dataset), held, MICRO):
                inputs, targets = st.microbatch(ids)
                loss, n = st.loss(st.model(inputs, 0, 0), targets)
                total, count = total + float(loss), count + n
        return total / count

    assert abs(run_ranks(1, direct)[0] - alone) <= 1e-12 * abs(alone)


@pytest.mark.parametrize("zero", [0, 1, 3])
def test_bf16_autocast_keeps_every_share_bit_identical(zero: int) -> None:
    """Layers under bf16 autocast compute each micro-batch the same on any rank; the float32
    master weights, the reduction and the update keep 1, 2 and 4 ranks at the same bits."""
    alone = _run(1, 0, 3, autocast="bf16")[0]
    for world in (2, 4):
        assert all(torch.equal(w, alone) for w in _run(world, zero, 3, autocast="bf16"))
    assert alone.dtype == torch.float32
    assert not torch.equal(alone, _run(1, 0, 3)[0])  # bf16 did act


def test_ranks_behind_take_the_most_advanced_rank_state() -> None:
    """Replicated sync: a newcomer and a rank whose step failed copy the most advanced rank
    (parameters, moments, step, loss); bytes are counted where they arrive."""
    cfg = _cfg()

    def body(rank: int, comm: ThreadComm) -> tuple[torch.Tensor, int, float, dict[str, Any]]:
        strategy, _ = _strategy(cfg, comm, _plan(3))
        # rank 1 trained 3 steps, rank 2 one, rank 0 is new (steps run alone, world of one)
        alone, _ = _strategy(cfg, _SoloComm(), _plan(1))
        _train(alone, {0: 0, 1: 3, 2: 1}[rank])
        strategy.state.flat.data.copy_(alone.state.flat.data)
        mine, theirs = strategy.state.opt, alone.state.opt
        mine.exp_avg.copy_(theirs.exp_avg)
        mine.exp_avg_sq.copy_(theirs.exp_avg_sq)
        mine.step_count = theirs.step_count
        strategy.state.step, strategy.state.last_loss = alone.state.step, alone.state.last_loss
        info = strategy.sync(_plan(3, epoch=2, committed=3), lambda: False)
        st = strategy.state
        return _whole(strategy), st.step, st.last_loss, info

    out = run_ranks(3, body)
    assert all(torch.equal(o[0], out[1][0]) for o in out)
    assert [o[1] for o in out] == [3, 3, 3]
    assert len({o[2] for o in out}) == 1 and not math.isnan(out[0][2])
    assert [o[3]["source_rank"] for o in out] == [1, 1, 1]
    assert [o[3]["steps"] for o in out] == [[0, 3, 1]] * 3
    assert out[1][3]["bytes"] == 0 and out[0][3]["bytes"] > 0 and out[2][3]["bytes"] > 0


def test_a_flipped_replica_is_voted_out_and_repaired() -> None:
    """verify(): the majority's copy wins; the bad rank is reported once, by rank 0."""
    cfg = _cfg()

    def body(rank: int, comm: ThreadComm) -> tuple[bool, torch.Tensor, list[Any]]:
        strategy, events = _strategy(cfg, comm, _plan(3))
        strategy.sync(_plan(3), lambda: False)
        _train(strategy, 1)
        if rank == 2:
            tensor, _ = strategy.corrupt_target("parameters")
            tensor[5] += 1.0
        return strategy.verify(1, lambda: False), _whole(strategy), events

    out = run_ranks(3, body)
    assert [o[0] for o in out] == [True, True, True]
    assert all(torch.equal(o[1], out[0][1]) for o in out)
    detected = [f for kind, f in out[0][2] if kind == "sdc_detected"]
    assert [d["ranks"] for d in detected] == [[2]]
    assert out[1][2] == [] and out[2][2] == []


class _SoloComm(ThreadComm):
    """A group of one, for a rank's private history in a test."""

    def __init__(self) -> None:
        super().__init__(Hub(1), 0)


@pytest.mark.parametrize(
    ("total", "held", "micro", "expected"),
    [
        (10, 3, 2, [[7, 8], [9]]),  # the last samples, in micro-batches (the last one short)
        (10, 4, 2, [[6, 7], [8, 9]]),
        (10, 0, 2, []),
    ],
)
def test_eval_microbatches(total: int, held: int, micro: int, expected: list) -> None:
    assert eval_microbatches(total, held, micro) == expected
    assert training_samples(total, held) == total - held  # training draws ids below them


def test_no_training_samples_left_is_an_error() -> None:
    with pytest.raises(ValueError, match="leaves none of the data set's 10 samples"):
        training_samples(10, 10)


def _survive(zero: int, partial_redo: bool = True) -> tuple[list[torch.Tensor], list[Any]]:
    """Four ranks train two steps; in step 3 rank 1 dies after its compute and the others'
    reduction fails (the buffer it held is garbage). The three survivors apply the next plan
    and train steps 3 and 4: their whole states and sync reports."""
    cfg = _cfg(zero, partial_redo=partial_redo)
    plan = _plan(4)

    def before(rank: int, comm: ThreadComm) -> Strategy:
        strategy, _ = _strategy(cfg, comm, plan)
        strategy.sync(plan, lambda: False)
        strategy.ctx.plan = plan
        _train(strategy, 2)
        st = strategy.state
        sums = step_sums(st, "float64")
        every = microbatches(
            7, 3, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=len(st.dataset)
        )
        with COMPUTE:
            strategy.compute(3, every, sums, slowdown=0.0)
        sums.grads.fill_(math.nan)  # what an abandoned collective may leave in the buffer
        sums.tail.values.fill_(math.nan)
        return strategy

    survivors = [s for r, s in enumerate(run_ranks(4, before)) if r != 1]
    after = Plan(
        epoch=2, workers=("w0", "w2", "w3"), hosts=("h0", "h2", "h3"),
        microbatches=assign_microbatches(GLOBAL_BATCH // MICRO, [1.0] * 3), store="",
        committed=2, departed=("w1",),
    )  # fmt: skip

    def body(rank: int, comm: ThreadComm) -> tuple[torch.Tensor, dict[str, Any]]:
        strategy = survivors[rank]
        strategy.ctx.comm = comm
        info = strategy.sync(after, lambda: False)
        strategy.ctx.plan = after
        _train(strategy, 2)
        return _whole(strategy), info

    out = run_ranks(3, body)
    return [o[0] for o in out], [o[1] for o in out]


@pytest.mark.parametrize("zero", [0, 1])
def test_survivors_compute_only_the_lost_micro_batches(zero: int) -> None:
    """A rank lost in the middle of a step: the survivors keep the micro-batches they finished
    (0-1, 4-5, 6-7), compute only the lost rank's (2-3, shared by plan weight) and end bit for
    bit where one rank alone does (float64 reduction), replicated or ZeRO-1."""
    wholes, infos = _survive(zero)
    alone = _run(1, 0, 4)[0]
    assert all(torch.equal(w, alone) for w in wholes)
    for info in infos:
        assert info["resume_step"] == 2 and info["redo_step"] == 3
        assert info["kept_microbatches"] == {"w0": 2, "w2": 2, "w3": 2}
        assert info["redo_microbatches"] == {"w0": [2], "w2": [3]}


def test_without_partial_redo_the_whole_step_is_computed_again() -> None:
    """train.partial_redo false: nothing is kept, the plan's shares are computed, and the
    state is the same."""
    wholes, infos = _survive(0, partial_redo=False)
    assert all(torch.equal(w, _run(1, 0, 4)[0]) for w in wholes)
    for info in infos:
        assert info["kept_microbatches"] == {"w0": 0, "w2": 0, "w3": 0}
        assert info["redo_microbatches"] == {"w0": [0, 1, 2], "w2": [3, 4, 5], "w3": [6, 7]}


@pytest.mark.parametrize("zero", [0, 1])
def test_each_rank_says_what_it_holds(zero: int) -> None:
    """memory(): replicated ranks hold the whole model's parameters, gradients and both moments;
    ZeRO-1 ranks one shard of the moments (a quarter each of 4) and pieces of their peers'."""

    def body(rank: int, comm: ThreadComm) -> tuple[int, int, dict[str, int]]:
        strategy, _ = _strategy(_cfg(zero), comm, _plan(4))
        strategy.sync(_plan(4), lambda: False)
        _train(strategy, 1)
        shard = strategy.zero.size if isinstance(strategy, Zero1) else 0  # padded
        return strategy.state.flat.numel, shard, strategy.memory()

    out = run_ranks(4, body)
    n = out[0][0]
    for _, shard, mem in out:
        assert mem["param_bytes"] == 4 * n
        assert mem["grad_bytes"] == 4 * n + 8 * n  # autograd's float32, the float64 sums
        if zero:
            assert n / 4 <= shard < n / 2
            assert mem["optimizer_bytes"] == 8 * shard  # both moments of its shard
            assert mem["replica_bytes"] > 0
        else:
            assert (mem["optimizer_bytes"], mem["replica_bytes"]) == (8 * n, 0)
    if zero:  # every shard's moments kept twice over the ranks: once owned, once in pieces
        owned, pieces = (sum(m[k] for *_, m in out) for k in ("optimizer_bytes", "replica_bytes"))
        assert 8 * n <= pieces <= owned
