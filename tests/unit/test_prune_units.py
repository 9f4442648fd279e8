"""Structured pruning's pure parts: the config, the zero-invariant groups of each model family
(zeroing a group and removing it gives the same outputs), and DHSPG's decisions."""

from __future__ import annotations

import copy as copy_module
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

from elaswave.config import JobConfig
from elaswave.errors import ConfigError
from elaswave.prune import dhspg
from elaswave.prune.compress import kept_groups, matmul_flops, shrink
from elaswave.prune.groups import NoGroups, find_groups, flat_index
from elaswave.prune.pruner import Decisions, Holding, Pruner
from elaswave.runtime.durable import checkpoints
from elaswave.runtime.durable.checkpoints import DurableCheckpoints
from elaswave.runtime.optim import FlatParams, Spans
from elaswave.runtime.workload.base import KeyedLayers, build_layers
from elaswave.runtime.workload.load import load_workload

LLAMA = {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": 64}  # fmt: skip
MODELS = {
    "mlp": {"source": "module", "factory": "examples.mlp_classifier:mlp_classifier",
            "args": {"hidden": 16, "dropout": 0.0}},
    "gpt": {"source": "gpt", "n_layer": 2, "d_model": 32, "n_head": 4, "vocab_size": 64,
            "seq_len": 8},
    "llama": {"source": "hf", "seq_len": 8, "hf": {"model_type": "llama", **LLAMA}},
    "llama-gqa": {"source": "hf", "seq_len": 8,
                  "hf": {"model_type": "llama", **LLAMA, "num_key_value_heads": 2}},
    "mistral-gqa": {"source": "hf", "seq_len": 8,
                    "hf": {"model_type": "mistral", **LLAMA, "num_key_value_heads": 2}},
    "qwen2-gqa": {"source": "hf", "seq_len": 8,
                  "hf": {"model_type": "qwen2", **LLAMA, "num_key_value_heads": 2}},
    "gpt2": {"source": "hf", "seq_len": 8,
             "hf": {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4,
                    "vocab_size": 64, "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0}},
    "gpt_neox": {"source": "hf", "seq_len": 8,
                 "hf": {"model_type": "gpt_neox", "hidden_size": 32, "intermediate_size": 48,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 64}},
    # a group cut by a layer boundary: the first convolution in layer 0, its BatchNorm in layer 1
    "conv-split": {"source": "module", "factory": "tests.unit.test_prune_units:conv_net",
                   "args": {"split": True}},
}  # fmt: skip


def _model(name: str) -> tuple[object, KeyedLayers]:
    cfg = JobConfig.from_dict({"model": MODELS[name]})
    workload = load_workload(cfg)
    return workload, build_layers(workload, 7)


@pytest.mark.parametrize(
    ("prune", "message"),
    [
        ({"method": "magnitude"}, "train.prune.method"),
        ({"target_sparsity": 0.0}, "target_sparsity"),
        ({"target_sparsity": 1.0}, "target_sparsity"),
        ({"target_sparsity": 0.9, "tolerance": 0.2}, "tolerance"),
        ({"start_step": 0}, "start_step"),
        ({"start_step": 5, "partition_step": 6}, "partition_step"),
        ({"lmbda": -1.0}, "lmbda"),
    ],
)
def test_bad_prune_settings_are_one_line_errors(prune: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        JobConfig.from_dict({"train": {"prune": prune}})


def test_every_mode_prunes_but_zero3_inside_pipelines() -> None:
    for other in ({"zero": 1}, {"zero": 3}, {"pp": 2}, {"pp": 2, "zero": 1}):
        JobConfig.from_dict({**other, "train": {"prune": {}}})
    with pytest.raises(ConfigError, match="train.prune is not supported with zero: 3 inside"):
        JobConfig.from_dict({"zero": 3, "pp": 2, "train": {"prune": {}}})


@pytest.mark.parametrize(("world", "zero"), [(2, 1), (3, 3), (4, 3)])
def test_sharded_data_parallelism_prunes_exactly_as_one_rank_alone(world: int, zero: int) -> None:
    """8 steps, pruning from step 2 with a high target: ZeRO-1 prunes the gathered whole
    parameters; ZeRO-3 gathers each layer with groups before and after the update for the sums
    and prunes its own elements. Both reach the state of one replicated rank, bit for bit (float64
    reduction), and pruning did zero groups."""
    from tests.unit.test_strategies import _run

    prune = {"start_step": 2, "target_sparsity": 0.5, "epsilon": 0.9, "lmbda": 0.5}
    alone = _run(1, 0, 8, prune=prune, lr=0.01)[0]
    unpruned = _run(1, 0, 8, lr=0.01)[0]
    assert int((alone == 0).sum()) > int((unpruned == 0).sum()) + 100  # groups went to zero
    wholes = _run(world, zero, 8, prune=prune, lr=0.01)
    assert all(torch.equal(w, alone) for w in wholes)


def test_unset_hyper_parameters_take_the_reference_defaults_of_the_optimizer() -> None:
    p = JobConfig.from_dict({"train": {"prune": {"lmbda": 0.5}}}).train.prune
    assert p is not None
    assert (p.resolved("adamw").lmbda, p.resolved("adamw").lmbda_amplify) == (0.5, 20.0)
    assert p.resolved("sgd").hat_lmbda_coeff == 10.0


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("mlp", [("channels", 16)] * 3),
        ("gpt", [("attention", 4), ("mlp", 128)] * 2),
        ("llama-gqa", [("attention", 2), ("mlp", 48)] * 2),  # one group per key-value head
        ("qwen2-gqa", [("attention", 2), ("mlp", 48)] * 2),
        ("mistral-gqa", [("attention", 2), ("mlp", 48)] * 2),
        ("gpt2", [("attention", 4), ("mlp", 128)] * 2),  # heads of the fused c_attn
        ("gpt_neox", [("attention", 4), ("mlp", 48)] * 2),  # heads of the interleaved qkv
        ("conv-split", [("channels", 8), ("channels", 6)]),  # the second through the flatten
    ],
)
def test_each_family_finds_its_groups(name: str, expected: list) -> None:
    workload, model = _model(name)
    families = find_groups(workload, model)
    assert [(f.kind, f.count) for f in families] == expected
    index = torch.cat([flat_index(f, model).reshape(-1) for f in families])
    assert index.unique().numel() == index.numel()  # no element in two groups
    embeddings = {
        i for i, layer in enumerate(model.layers)
        if any(isinstance(m, nn.Embedding) for m in layer.modules())
    }  # fmt: skip
    assert not {m.param[0] for f in families for m in f.members} & embeddings


def _outputs(workload: object, model: KeyedLayers, name: str) -> torch.Tensor:
    torch.manual_seed(0)
    if name in ("mlp", "conv-split"):
        x = torch.randn(5, 16)
    else:
        x = torch.randint(0, 64, (3, 8))
    with torch.no_grad():
        return model.eval()(x, step=1, microbatch=0)


@pytest.mark.parametrize("name", list(MODELS))
def test_zeroed_groups_removed_leave_the_outputs_unchanged(name: str) -> None:
    """Every other group of each family zeroed (the sparse model), then removed (the compact
    one): the same outputs within 1e-5, and fewer parameters."""
    workload, model = _model(name)
    families = find_groups(workload, model)
    flat = FlatParams(model)
    with torch.no_grad():
        for f in families:
            flat.data[flat_index(f, model)[1::2]] = 0.0
    sparse = _outputs(workload, model, name)
    before = sum(p.numel() for p in model.parameters())
    kept = kept_groups(families, model, flat.data, same_width=True)
    width = {f.kind: max(g.count - g.count // 2 for g in families if g.kind == f.kind)
             for f in families}  # fmt: skip
    assert [len(k) for k in kept] == [width[f.kind] for f in families]  # one width per kind
    shrink(model, families, kept)
    assert sum(p.numel() for p in model.parameters()) < before
    if name == "gpt":  # its blocks take head and MLP widths from the config: shapes only
        return
    torch.testing.assert_close(_outputs(workload, model, name), sparse, rtol=0, atol=1e-5)


def test_a_model_with_nothing_to_group_is_refused() -> None:
    cfg = JobConfig.from_dict(
        {"model": {"source": "module", "factory": "tests.unit.test_prune_units:one_linear"}}
    )
    workload = load_workload(cfg)
    with pytest.raises(NoGroups, match="no zero-invariant groups"):
        find_groups(workload, build_layers(workload, 1))


def one_linear() -> object:
    from examples.mlp_classifier import MLPClassifier

    class One(MLPClassifier):
        @property
        def num_layers(self) -> int:
            return 1

        def build_layer(self, index: int, seed: int) -> nn.Module:
            return nn.Sequential(nn.Linear(16, 4), nn.Sigmoid())

    return One(features=16, hidden=8, depth=0, classes=4, dropout=0.0, num_samples=64)


def conv_net(dims: int = 1, pooled: bool = False, split: bool = False) -> object:
    """Two layers: [a 16-feature sample as one channel → conv → BatchNorm → ReLU] and [conv →
    ReLU → flatten → Linear]: a chain between the convolutions (8 channels) and one from the
    second convolution to the Linear through the flatten (6 channels, 16 positions each).
    ``pooled`` (2-d): a max pool after the first ReLU and a global average pool before the
    flatten (one position per channel), as image classifiers have them. ``split``: the
    BatchNorm and ReLU open the second layer (the first chain's groups lie in both layers)."""
    from examples.mlp_classifier import MLPClassifier

    conv, norm = {1: (nn.Conv1d, nn.BatchNorm1d), 2: (nn.Conv2d, nn.BatchNorm2d)}[dims]
    shape = (1, 16) if dims == 1 else (1, 4, 4)

    class Conv(MLPClassifier):
        @property
        def num_layers(self) -> int:
            return 2

        def build_layer(self, index: int, seed: int) -> nn.Module:
            torch.manual_seed(seed + index)
            if split:
                if index == 0:
                    return nn.Sequential(nn.Unflatten(1, shape), conv(1, 8, 3, padding=1))
                return nn.Sequential(norm(8), nn.ReLU(), conv(8, 6, 3, padding=1), nn.ReLU(),
                                     nn.Flatten(), nn.Linear(6 * 16, 4))  # fmt: skip
            if index == 0:
                pool = [nn.MaxPool2d(2)] if pooled else []
                return nn.Sequential(nn.Unflatten(1, shape), conv(1, 8, 3, padding=1), norm(8),
                                     nn.ReLU(), *pool)  # fmt: skip
            if pooled:
                return nn.Sequential(conv(8, 6, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                     nn.Flatten(), nn.Linear(6, 4))  # fmt: skip
            return nn.Sequential(conv(8, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(6 * 16, 4))  # fmt: skip

    return Conv(features=16, hidden=8, depth=0, classes=4, dropout=0.0, num_samples=64)


@pytest.mark.parametrize(("dims", "pooled"), [(1, False), (2, False), (2, True)])
def test_convolution_chains_are_traced_and_removed_exactly(dims: int, pooled: bool) -> None:
    """The tracer finds the convolutions' chain through a BatchNorm (whose weight and bias join
    each channel's group) and the pooling, and the second convolution's channels as blocks of
    the Linear's columns behind the flatten (16 positions each, or 1 after a global pool);
    every other channel of both zeroed, then removed (BatchNorm's statistics sliced with it):
    the eval-mode outputs within 1e-5."""
    factory = "tests.unit.test_prune_units:conv_net"
    model_cfg = {"source": "module", "factory": factory, "args": {"dims": dims, "pooled": pooled}}
    cfg = JobConfig.from_dict({"model": model_cfg})
    workload = load_workload(cfg)
    model = build_layers(workload, 3)
    families = find_groups(workload, model)
    assert [(f.kind, f.count) for f in families] == [("channels", 8), ("channels", 6)]
    first, second = families
    assert [m.param for m in first.members] == [
        (0, "1.weight"), (0, "1.bias"), (0, "2.weight"), (0, "2.bias")
    ]  # fmt: skip
    assert [(m.param, m.axis, m.size) for m in first.consumers] == [((1, "0.weight"), 1, 1)]
    linear = "4.weight" if pooled else "3.weight"
    block = 1 if pooled else 16
    assert [(m.param, m.axis, m.size) for m in second.consumers] == [((1, linear), 1, block)]
    norm = model.layers[0][2]
    with torch.no_grad():
        norm.running_mean.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
        norm.running_var.uniform_(0.5, 2, generator=torch.Generator().manual_seed(2))
    flat = FlatParams(model)
    with torch.no_grad():
        for f in families:
            flat.data[flat_index(f, model)[1::2]] = 0.0
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sparse = model.eval()(x, step=1, microbatch=0)
    # a 16-feature sample: 16 positions (1-d) or 4 × 4 (2-d), padded convs; 2 × 2 after the pool
    first_at, second_at = (16, 4) if pooled else (16, 16)

    def flops() -> int:  # both convolutions at every position, the Linear once
        convs = (model.layers[0][1].weight.numel() * first_at
                 + model.layers[1][0].weight.numel() * second_at)  # fmt: skip
        return 2 * (convs + model.layers[1][-1].weight.numel())

    assert matmul_flops(model, x) == flops() and matmul_flops(model) < flops()
    kept = kept_groups(families, model, flat.data, same_width=False)
    shrink(model, families, kept)
    assert matmul_flops(model, x) == flops()  # the halved convolutions and Linear
    assert norm.num_features == 4 and norm.running_mean.numel() == 4
    assert model.layers[1][0].in_channels == 4 and model.layers[0][1].out_channels == 4
    assert model.layers[1][0].out_channels == 3
    assert model.layers[1][-1].in_features == 3 * block
    with torch.no_grad():
        torch.testing.assert_close(model(x, step=1, microbatch=0), sparse, rtol=0, atol=1e-5)


# -- DHSPG's decisions ---------------------------------------------------------------------------

HP = dhspg.Hyper(target=0.5, tolerance=0.1, epsilon=0.0, lmbda=0.1, lmbda_amplify=2.0,
                 hat_lmbda_coeff=100.0)  # fmt: skip


def _stats(xn: list[float], xd: list[float], dn: list[float], hx: list[float]) -> dhspg.Stats:
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    return dhspg.Stats(t(xn), t(xd), t(dn), t(hx))


def test_the_partition_takes_the_smallest_groups_moving_towards_zero() -> None:
    # four groups of size 1: small norms and a direction towards zero score highest
    stats = _stats(xn=[1.0, 0.1, 2.0, 0.2], xd=[-1.0, 0.1, -2.0, 0.2], dn=[1, 1, 1, 1],
                   hx=[0, 0, 0, 0])  # fmt: skip
    sizes = torch.ones(4, dtype=torch.float64)
    assert dhspg.partition(stats, sizes, 0.5).tolist() == [False, True, False, True]
    # per bucket (uniform): each of two families of two picks its own one
    assert dhspg.partition(stats, sizes, 0.5, buckets=[2, 2]).tolist() == [False, True, False, True]
    assert dhspg.partition(stats, sizes, 0.5, buckets=[1, 3]).tolist() == [
        False,
        True,
        False,
        False,
    ]


@pytest.mark.parametrize(
    ("xd", "expected"),
    [
        (0.5, 0.1),  # direction already towards zero: the base lambda
        (-0.01, 0.1),  # away, weakly: amplify * lower = 0.02, raised to lmbda
        (-0.3, 0.6),  # amplify * lower = 0.6, within [lmbda, lmbda * hat] and below upper
        (-0.9, (0.9 + 1.0 / 0.9) / 2),  # 1.8 reaches upper (|d|^2 |x| / -xd): the midpoint
        (-9.0, 10.0),  # |d| = 100: 18 capped at lmbda * hat
    ],
)
def test_lambda_rises_for_groups_the_step_pushes_away_from_zero(xd: float, expected: float) -> None:
    stats = _stats(xn=[1.0], xd=[xd], dn=[1.0 if xd > -1 else 100.0], hx=[0.0])
    lam = dhspg.lambdas(stats, torch.tensor([True]), HP)
    assert lam.item() == pytest.approx(expected)
    assert dhspg.lambdas(stats, torch.tensor([False]), HP).item() == pytest.approx(0.1)


def test_projection_stops_at_the_upper_sparsity_and_takes_the_furthest_crossing() -> None:
    # 10 groups, 4 already zero, upper = 0.6: room for 2 more; 3 candidates cross the origin
    xn = [1.0] * 6 + [0.0] * 4
    hx = [-0.5, -0.1, -0.9, 0.5, 0.5, 0.5] + [0.0] * 4
    stats = _stats(xn=xn, xd=[0.0] * 10, dn=[1.0] * 10, hx=hx)
    red = torch.tensor([True] * 4 + [False] * 6)
    _, projected = dhspg.decide(stats, red, zero_before=4, lr=1e-9, hp=HP, project=True)
    assert torch.nonzero(projected).flatten().tolist() == [0, 2]
    _, none = dhspg.decide(stats, red, zero_before=4, lr=1e-9, hp=HP, project=False)
    assert not none.any()


def test_applying_leaves_important_groups_bit_identical_and_zero_groups_zero() -> None:
    x = torch.randn(3, 5)
    h = torch.randn(3, 5)
    scale = torch.tensor([0.0, 0.5, 0.0], dtype=torch.float64)
    decisions = Decisions(torch.tensor([False, False, True]), pull=scale)
    out = decisions.apply(x, h, torch.arange(3).unsqueeze(1))
    assert torch.equal(out[0], h[0])
    assert torch.equal(out[1], h[1] - 0.5 * x[1])
    assert not out[2].any()


# -- the redundant set travels -------------------------------------------------------------------


def _pruner() -> Pruner:
    cfg = JobConfig.from_dict({"model": MODELS["mlp"], "train": {"prune": {"start_step": 3}}})
    workload, model = _model("mlp")
    pruner = Pruner.build(cfg, workload, model)
    assert pruner is not None
    return pruner


def _stages(
    pruner: Pruner,
    cuts: list[int],
    old: torch.Tensor,
    new: torch.Tensor,
    starts: list[int],
    step: int,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``pruner``'s step on pipeline stages cut at ``cuts`` (one thread each, its sums added by
    an all-reduce over threads): each stage's window after the step, and its redundant set."""
    bounds = [0, *cuts, len(starts) - 1]  # layer ranges; ``starts`` ends with the total
    sums: list[torch.Tensor | None] = [None] * (len(bounds) - 1)
    barrier = threading.Barrier(len(sums))
    out: list = [None] * len(sums)

    def stage(s: int) -> None:
        lo, hi = bounds[s], bounds[s + 1]
        a, b = starts[lo], starts[hi]
        copy = copy_module.deepcopy(pruner)

        def reduce(t: torch.Tensor) -> None:
            sums[s] = t.clone()
            barrier.wait()
            t.copy_(torch.stack([x for x in sums if x is not None]).sum(dim=0))
            barrier.wait()

        holding = Holding(
            held=lambda i: lo <= i < hi, counted=lambda i: lo <= i < hi, reduce=reduce
        )
        params = Spans(new[a:b].clone(), a)
        copy.after(step, Spans(old[a:b].clone(), a), params, lr=0.1, holding=holding)
        out[s] = (params.tensor, copy.marks)

    threads = [threading.Thread(target=stage, args=(s,)) for s in range(len(sums))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _stage_problem(
    cfg: JobConfig, name: str
) -> tuple[Pruner, list[int], torch.Tensor, torch.Tensor]:
    """A pruner of model ``name``, its layers' offsets (and the end), and parameters before and
    after an update in which some groups cross zero."""
    workload, model = _model(name)
    pruner = Pruner.build(cfg, workload, model)
    assert pruner is not None
    starts = [o for o, _ in model.segments()]
    starts.append(sum(model.segments()[-1]))
    gen = torch.Generator().manual_seed(0)
    old = torch.randn(starts[-1], generator=gen)
    new = old * 0.6 + 0.05 * torch.randn(starts[-1], generator=gen)
    return pruner, starts, old, new


def _every_cut_matches_the_whole(
    pruner: Pruner, starts: list[int], old: torch.Tensor, new: torch.Tensor, step: int
) -> Pruner:
    """Step ``step`` on the whole model and on two stages cut at every layer: the stages'
    parameters put together and their marks are the whole model's. Returns the whole model's
    pruner after the step."""
    whole = copy_module.deepcopy(pruner)
    expected = new.clone()
    whole.after(step, Spans(old.clone()), Spans(expected), lr=0.1)
    for cut in range(1, len(starts) - 1):
        stages = _stages(pruner, [cut], old, new, starts, step)
        assert torch.equal(torch.cat([p for p, _ in stages]), expected), cut
        for _, marks in stages:
            assert torch.equal(marks, whole.marks)
    return whole


@pytest.mark.parametrize("name", ["mlp", "llama-gqa", "conv-split"])
def test_pipeline_stages_prune_exactly_as_the_whole_model_whatever_the_cut(name: str) -> None:
    """Each stage brings the group sums of its layers, zeros for the rest; the added sums give
    every stage the whole model's decisions: the stages' windows put together are the whole
    model's parameters after DHSPG, bit for bit, for every cut (``conv-split``: a group whose
    convolution and BatchNorm lie in different stages)."""
    cfg = JobConfig.from_dict(
        {"model": MODELS[name], "train": {"prune": {"start_step": 1, "target_sparsity": 0.5,
                                                    "epsilon": 0.9}}}
    )  # fmt: skip
    pruner, starts, old, new = _stage_problem(cfg, name)
    for step in (1, 2):  # the partition is chosen, then kept
        whole = _every_cut_matches_the_whole(pruner, starts, old, new, step)
        assert whole.last["prune_projected"] > 0  # the step decides something
        pruner = whole


def test_the_redundant_set_survives_a_durable_checkpoint(tmp_path: Path) -> None:
    source = _pruner()
    source.taken_at = 3
    source.marks = (torch.arange(source.groups) % 3 == 0).long()
    store = DurableCheckpoints(tmp_path)
    params = torch.randn(10)
    store.save_async(7, 0.5, params, exp_avg=params, exp_avg_sq=params, extra=source.saved())
    store.flush()
    state = checkpoints.load(tmp_path / "step-00000007", 10)
    fresh = _pruner()
    fresh.adopt(state.prune, state.step)
    assert (fresh.taken_at, fresh.marks.tolist()) == (3, source.marks.tolist())
    fresh.adopt(state.prune, 2)  # a state from before the set was chosen: dropped
    assert (fresh.taken_at, fresh.marks.numel()) == (0, 0)
    store.save_async(8, 0.5, params, exp_avg=params, exp_avg_sq=params)  # without pruning: no set
    store.flush()
    assert checkpoints.load(tmp_path / "step-00000008", 10).prune is None
    # written per rank (ZeRO-3, pipelines): the set in the checkpoint's index
    for step, extra in ((9, source.saved()), (10, None)):
        store.save_pieces_async(step, 0.5, rank=0, world=1, attempt="e1",
                                pieces=[(0, 10, params, params, params)], extra=extra)  # fmt: skip
        store.flush()
        state = checkpoints.load(tmp_path / f"step-{step:08d}", 10)
        assert torch.equal(state.params, params)
        if extra is None:
            assert state.prune is None
        else:
            fresh.adopt(state.prune, state.step)
            assert (fresh.taken_at, fresh.marks.tolist()) == (3, source.marks.tolist())


@pytest.mark.parametrize(
    "name", ["llama", "llama-gqa", "qwen2-gqa", "mistral-gqa", "gpt2", "gpt_neox"]
)
def test_layers_of_different_widths_export_and_load(tmp_path: Path, name: str) -> None:
    """The first block keeps half of each family's groups, the second a quarter: the export
    writes each layer at its own width (the config the widest, each layer's under
    ``elaswave_widths``). ``from_pretrained`` refuses it (a size mismatch); ``load_compressed``
    loads it with the sparse model's outputs within 1e-5. With ``pad`` every layer is as wide
    as the widest and ``from_pretrained`` loads it, with the same outputs."""
    import transformers

    from elaswave.export import compressed
    from elaswave.prune.load import load_compressed

    def sparse_model() -> tuple[object, KeyedLayers, torch.Tensor]:
        workload, model = _model(name)
        families = find_groups(workload, model)
        first = min(f.members[0].param[0] for f in families)
        flat = FlatParams(model)
        with torch.no_grad():
            for f in families:
                every = 2 if f.members[0].param[0] == first else 4
                gone = [j for j in range(f.count) if j % every]
                flat.data[flat_index(f, model)[gone]] = 0.0
        return workload, model, flat.data

    workload, model, flat = sparse_model()
    sparse = _outputs(workload, model, name)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (3, 8))
    (before, after), _ = compressed(workload, model, flat, kinds=[])
    workload.export(model, tmp_path / "hf")
    widths = transformers.AutoConfig.from_pretrained(tmp_path / "hf").elaswave_widths
    assert widths["mlp"][0] == 2 * widths["mlp"][1], widths
    if name in ("llama", "gpt2", "gpt_neox"):  # four heads: two kept in one layer, one in the other
        assert widths["attention"] == [2, 1], widths
    with pytest.raises(Exception, match="size mismatch|mismatch"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    small = load_compressed(tmp_path / "hf")
    with torch.no_grad():
        torch.testing.assert_close(small(ids).logits, sparse, rtol=0, atol=1e-5)

    workload, model, flat = sparse_model()
    (_, padded), _ = compressed(workload, model, flat, kinds=[], pad=True)
    workload.export(model, tmp_path / "padded")
    wide = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "padded").eval()
    assert after < padded < before and small.num_parameters() < wide.num_parameters()
    with torch.no_grad():
        torch.testing.assert_close(wide(ids).logits, sparse, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "gpt_neox"])
def test_fewer_heads_of_one_width_keep_the_config_head_count(tmp_path: Path, name: str) -> None:
    """gpt2's and gpt_neox's configs derive a head's width from the head count: half the heads
    of every layer zeroed (a uniform run) exports with the config's head count and each layer's
    under ``elaswave_widths``; ``load_compressed`` gives the sparse model's outputs."""
    import transformers

    from elaswave.export import compressed
    from elaswave.prune.load import load_compressed

    workload, model = _model(name)
    families = find_groups(workload, model, ["attention"])
    flat = FlatParams(model)
    with torch.no_grad():
        for f in families:
            flat.data[flat_index(f, model)[1::2]] = 0.0
    sparse = _outputs(workload, model, name)
    compressed(workload, model, flat.data, kinds=["attention"], uniform=True)
    workload.export(model, tmp_path / "hf")
    config = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert config.num_attention_heads == 4 and config.elaswave_widths == {"attention": [2, 2]}
    small = load_compressed(tmp_path / "hf")
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (3, 8))
    with torch.no_grad():
        torch.testing.assert_close(small(ids).logits, sparse, rtol=0, atol=1e-5)


def test_load_compressed_of_a_directory_without_weights_is_one_line(tmp_path: Path) -> None:
    from elaswave.errors import ElasWaveError
    from elaswave.prune.load import load_compressed

    with pytest.raises(ElasWaveError) as err:
        load_compressed(tmp_path)
    assert "no safetensors weights" in str(err.value) and "\n" not in str(err.value)
