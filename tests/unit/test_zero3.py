"""ZeRO-3 over the in-process fake group (ranks are threads): recovery, checks, durability and
memory, against one rank training alone (float64 reduction: bit for bit). The step itself is
tested there too (``test_strategies``, parametrized over zero 0, 1, 3) and in real gloo processes
(``test_layerwise``)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from elaswave.planning.plan import Plan, assign_microbatches
from elaswave.runtime.durable.checkpoints import DurableState
from elaswave.runtime.strategies.base import Strategy, step_sums
from elaswave.runtime.strategies.zero.shard import ShardLost
from elaswave.runtime.strategies.zero.strategy import Zero3
from elaswave.runtime.workload.data import microbatches
from tests.unit.test_strategies import (
    GLOBAL_BATCH,
    MICRO,
    _cfg,
    _computing,
    _run,
    _strategy,
    _train,
    _whole,
)
from tests.unit.threadcomm import Hub, ThreadComm, run_ranks


def _plan_of(workers: tuple[str, ...], epoch: int, committed: int, **kw: Any) -> Plan:
    return Plan(
        epoch=epoch, workers=workers, hosts=tuple(f"h{w}" for w in workers),
        microbatches=assign_microbatches(GLOBAL_BATCH // MICRO, [1.0] * len(workers)),
        store="", committed=committed, **kw,
    )  # fmt: skip


def _started(world: int, steps: int, **train: Any) -> list[Zero3]:
    """``world`` ZeRO-3 ranks after ``steps`` steps."""
    cfg, plan = _cfg(3, **train), _plan_of(tuple(f"w{r}" for r in range(world)), 1, 0)

    def body(rank: int, comm: ThreadComm) -> Strategy:
        strategy, _ = _strategy(cfg, comm, plan)
        strategy.sync(plan, lambda: False)
        strategy.ctx.plan = plan
        _train(strategy, steps)
        return strategy

    return run_ranks(world, body)


def _resume(ranks: list[Strategy], plan: Plan, steps: int) -> list[tuple[torch.Tensor, Any]]:
    """``ranks`` (in ``plan``'s order) apply ``plan`` and train ``steps`` steps."""

    def body(rank: int, comm: ThreadComm) -> tuple[torch.Tensor, Any]:
        strategy = ranks[rank]
        strategy.ctx.comm = comm
        info = strategy.sync(plan, lambda: False)
        strategy.ctx.plan = plan
        _train(strategy, steps)
        return _whole(strategy), info

    return run_ranks(len(ranks), body)


def _newcomer(plan: Plan) -> Zero3:
    """A fresh worker (its group is set when it joins)."""
    strategy, _ = _strategy(_cfg(3), ThreadComm(Hub(1), 0), plan)
    assert isinstance(strategy, Zero3)
    return strategy


def test_a_lost_shard_comes_back_from_its_replica_pieces_and_a_newcomer_gets_its_share() -> None:
    """Four ranks train two steps, rank 1 leaves: the three survivors promote the pieces they
    keep of its shard (parameters and moments: nothing crosses the network, every survivor
    takes the same share) and train two steps; a newcomer joins and receives its share by
    disjoint transfers; every state along the way is one rank's alone, bit for bit."""
    ranks = _started(4, 2)
    survivors = [ranks[r] for r in (0, 2, 3)]
    shrink = _plan_of(("w0", "w2", "w3"), 2, 2, departed=("w1",))
    out = _resume(survivors, shrink, 2)
    alone = _run(1, 0, 4)[0]
    assert all(torch.equal(w, alone) for w, _ in out)
    for _, info in out:
        assert info["resume_step"] == 2 and info["bytes"] == 0 and info["transfers"] == 0
        assert info["promoted_bytes"] > 0 and info["max_over_mean"] < 1.01
    grow = _plan_of(("w0", "w2", "w3", "w4"), 3, 4)
    out = _resume([*survivors, _newcomer(grow)], grow, 2)
    assert all(torch.equal(w, _run(1, 0, 6)[0]) for w, _ in out)
    assert all(info["bytes"] > 0 and info["resume_step"] == 4 for _, info in out)


def test_an_interrupted_step_is_redone_whole() -> None:
    """Rank 1 dies after the step's compute (every layer already reduce-scattered among the
    four): the reduced sums of its part are gone with it, so the survivors compute the whole
    step again under the new plan; the state is one rank's alone."""
    cfg, plan = _cfg(3), _plan_of(tuple(f"w{r}" for r in range(4)), 1, 0)

    def before(rank: int, comm: ThreadComm) -> Strategy:
        strategy, _ = _strategy(cfg, comm, plan)
        strategy.sync(plan, lambda: False)
        strategy.ctx.plan = plan
        _train(strategy, 2)
        st = strategy.state
        sums = step_sums(st, "float64")
        with _computing(strategy):
            strategy.compute(
                3,
                microbatches(
                    7, 3, GLOBAL_BATCH, micro_batch_size=MICRO, num_samples=len(st.dataset)
                ),
                sums,
                slowdown=0,
            )
        sums.grads.fill_(math.nan)
        sums.tail.values.fill_(math.nan)
        return strategy

    survivors = [s for r, s in enumerate(run_ranks(4, before)) if r != 1]
    after = _plan_of(("w0", "w2", "w3"), 2, 2, departed=("w1",))
    out = _resume(survivors, after, 2)
    assert all(torch.equal(w, _run(1, 0, 4)[0]) for w, _ in out)
    for _, info in out:
        assert info["redo_step"] == 3
        assert info["kept_microbatches"] == {"w0": 0, "w2": 0, "w3": 0}
        assert info["redo_microbatches"] == {"w0": [0, 1, 2], "w2": [3, 4, 5], "w3": [6, 7]}


def test_losing_a_rank_and_a_holder_of_its_pieces_is_shard_lost() -> None:
    """Two of four ranks gone at once: part of each one's shard was only on the other. With
    no durable checkpoint every survivor stops with the same reason."""
    ranks = _started(4, 1)
    after = _plan_of(("w0", "w3"), 2, 1, departed=("w1", "w2"))

    def body(rank: int, comm: ThreadComm) -> str:
        strategy = (ranks[0], ranks[3])[rank]
        strategy.ctx.comm = comm
        with pytest.raises(ShardLost) as err:
            strategy.sync(after, lambda: False)
        return str(err.value)

    reasons = run_ranks(2, body)
    assert len(set(reasons)) == 1 and "replica" in reasons[0]


@pytest.mark.parametrize("target", ["parameters", "snapshot"])
def test_a_flipped_shard_is_found_and_repaired_from_the_other_copy(target: str) -> None:
    """A bit flipped in rank 2's parameter shard (its snapshot: checksummed when staged) or in
    the replica pieces it keeps: verify() finds it on every rank and repairs it from the other
    copy; training goes on as one rank alone."""
    ranks = _started(3, 2)

    def body(rank: int, comm: ThreadComm) -> tuple[bool, torch.Tensor]:
        strategy = ranks[rank]
        strategy.ctx.comm = comm
        if rank == 2:
            tensor, _ = strategy.corrupt_target(target)
            tensor.view(torch.int32)[3] ^= 1 << 20
        found = strategy.verify(2, lambda: False)
        _train(strategy, 1)
        return found, _whole(strategy)

    out = run_ranks(3, body)
    assert [found for found, _ in out] == [True] * 3
    assert all(torch.equal(w, _run(1, 0, 3)[0]) for _, w in out)


def test_durable_pieces_tile_the_model_and_a_whole_state_resumes_at_another_size() -> None:
    """Each rank writes the intervals it owns (parameters and moments): together they are the
    whole state. Three ranks adopt that state (any size reads it) and train on as one alone."""
    ranks = _started(4, 2)

    def pieces(rank: int, comm: ThreadComm) -> Any:
        ranks[rank].ctx.comm = comm
        return ranks[rank].durable_pieces(), _whole(ranks[rank])

    out = run_ranks(4, pieces)
    n = out[0][1].numel() // 3
    whole = torch.zeros(3 * n)
    covered = 0
    for rank_pieces, _ in out:
        for a, b, p, m, v in rank_pieces:
            whole[a:b], whole[n + a : n + b], whole[2 * n + a : 2 * n + b] = p, m, v
            covered += b - a
    assert covered == n and torch.equal(whole, out[0][1])
    state = DurableState(2, 1.0, *whole.chunk(3), path=None)  # type: ignore[arg-type]
    plan = _plan_of(("a", "b", "c"), 5, 2)

    def adopt(rank: int, comm: ThreadComm) -> torch.Tensor:
        strategy, _ = _strategy(_cfg(3), comm, plan)
        strategy.adopt(state, plan, lambda: False)
        strategy.ctx.plan = plan
        _train(strategy, 1)
        return _whole(strategy)

    assert all(torch.equal(w, _run(1, 0, 3)[0]) for w in run_ranks(3, adopt))


def test_each_rank_holds_a_shard_and_gathers_at_most_two_layers() -> None:
    """memory(): parameters, moments and the step's gradient sums (float64) of one shard, about
    a quarter of the model each at 4 ranks; replica pieces of the peers' shards (the shard kept
    twice over the ranks); gathered layers' parameters at their peak, two layers' worth at
    most; layer gradients at their peak, never the model's."""

    def body(rank: int, comm: ThreadComm) -> tuple[int, int, dict[str, int], list[int]]:
        strategy, _ = _strategy(_cfg(3), comm, _plan_of(tuple(f"w{r}" for r in range(4)), 1, 0))
        strategy.sync(strategy.ctx.plan, lambda: False)  # type: ignore[arg-type]
        _train(strategy, 1)
        assert isinstance(strategy, Zero3)
        z = strategy.zero  # each layer as gathered: every rank's part, padded alike
        layers = [len(z.workers) * cut.pad for cut in strategy.shards.cuts]
        return z.size, strategy.state.flat.total, strategy.memory(), layers

    out = run_ranks(4, body)
    for shard, total, mem, layers in out:
        assert total / 4 <= shard < total / 2
        assert mem["param_bytes"] == 4 * shard and mem["optimizer_bytes"] == 8 * shard
        assert mem["grad_bytes"] == 8 * shard  # the float64 sums of the shard
        # gathered float32 parameters: at most two (padded) layers' worth
        assert 0 < mem["gathered_bytes"] <= 2 * 4 * max(layers) < 4 * total
        # layer gradients: one layer's float32 gradient and float64 sums, and the reduction of
        # the layer before it in flight (its float64 send buffer and this rank's quarter)
        assert 0 < mem["layer_grad_bytes"] <= (4 + 8 + 8 + 8 / 4) * max(layers)
        peaks = (mem["gathered_bytes"], mem["layer_grad_bytes"])
        assert max(peaks) <= mem["transient_bytes"] <= sum(peaks)
    total = out[0][1]
    replicas = sum(m["replica_bytes"] for _, _, m, _ in out)
    owned = sum(m["param_bytes"] + m["optimizer_bytes"] for _, _, m, _ in out)
    assert replicas == 12 * total <= owned  # every element's 3 floats once more (owned: padded)


def test_a_known_good_shard_is_taken_back() -> None:
    """The integrity check's known-good state is the rank's own shard (no rank keeps the
    whole state); rolling back to it gives the state of that step, and training from it the
    same steps again."""
    ranks = _started(2, 1)

    def body(rank: int, comm: ThreadComm) -> torch.Tensor:
        strategy = ranks[rank]
        strategy.ctx.comm = comm
        good = strategy.known_good(lambda: False).clone()
        key = strategy.layout_key()
        _train(strategy, 2)
        assert strategy.layout_key() == key
        params, m, v = good.chunk(3)
        state = DurableState(1, math.nan, params, m, v, path=None)  # type: ignore[arg-type]
        strategy.roll_back(state, strategy.ctx.plan, lambda: False)  # type: ignore[arg-type]
        assert strategy.state.step == 1
        _train(strategy, 2)
        return _whole(strategy)

    assert all(torch.equal(w, _run(1, 0, 3)[0]) for w in run_ranks(2, body))
