"""The built-in GPT as a workload: layers built alone from (seed, index), keyed dropout, the
loss as (sum, count), boundaries that match what the layers return."""

import math

import pytest
import torch
from torch import nn

from elaswave.runtime.workload import KeyedLayers, build_layers, layer_seed
from elaswave.runtime.workload.base import INIT_STEP
from elaswave.runtime.workload.data import sample_ids
from elaswave.runtime.workload.gpt import Block, Embedding, GPTConfig, GPTWorkload, Head

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)


def _tokens(b: int = 3, t: int = 16) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))


def _model(cfg: GPTConfig = CFG, seed: int = 0) -> KeyedLayers:
    return build_layers(GPTWorkload(cfg), seed)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"vocab_size": 0},
        {"seq_len": -1},
        {"n_layer": 0},
        {"n_head": 3},
        {"d_model": 0},
        {"dropout": 1.0},
        {"dropout": -0.1},
    ],
)
def test_config_validation(kwargs: dict[str, float]) -> None:
    base = {"vocab_size": 8, "seq_len": 4, "n_layer": 1, "n_head": 2, "d_model": 8}
    with pytest.raises(ValueError):
        GPTConfig(**{**base, **kwargs})


def test_layers_structure() -> None:
    model = _model()
    assert len(model) == GPTWorkload(CFG).num_layers == CFG.n_layer + 2
    assert isinstance(model.layers[0], Embedding)
    assert all(isinstance(layer, Block) for layer in model.layers[1:-1])
    assert isinstance(model.layers[-1], Head)


def test_layers_deterministic_seed_dependent_and_built_alone() -> None:
    def params(seed: int) -> list[torch.Tensor]:
        return [p.detach() for p in _model(seed=seed).parameters()]

    a, b, c = params(1), params(1), params(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))
    # One layer built alone, from (seed, index), equals the same layer of the whole model.
    torch.manual_seed(layer_seed(1, INIT_STEP, INIT_STEP, layer=2))
    alone = GPTWorkload(CFG).build_layer(2, 1)
    whole = _model(seed=1).layers[2]
    assert all(
        torch.equal(x, y) for x, y in zip(alone.parameters(), whole.parameters(), strict=True)
    )


def test_init_values_and_global_rng_untouched() -> None:
    state = torch.get_rng_state()
    block = _model().layers[1]
    assert torch.equal(state, torch.get_rng_state())
    assert isinstance(block, Block)
    assert torch.equal(block.ln1.weight, torch.ones(CFG.d_model))
    assert torch.equal(block.qkv.bias, torch.zeros(3 * CFG.d_model))
    assert abs(float(block.fc.weight.detach().std()) - 0.02) < 0.003


def test_boundaries_match_the_layers() -> None:
    w, model = GPTWorkload(CFG), _model()
    h = _tokens()
    for i in range(w.num_layers):
        h = model(h, 1, 0, i, i + 1)
        spec = w.boundary(i, 3)
        assert (tuple(h.shape), h.dtype) == (spec.shape, spec.dtype)
    with pytest.raises(ValueError):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long), 1, 0)


def test_stages_compose_to_the_model() -> None:
    model, tokens = _model(), _tokens()
    whole = model(tokens, 4, 2)
    cut = model(model(tokens, 4, 2, 0, 2), 4, 2, 2, None)
    assert torch.equal(whole, cut)  # the same masks whichever stage runs a layer


def test_dropout_masks_keyed_by_step_and_microbatch() -> None:
    model, tokens = _model().train(), _tokens()
    a, b = model(tokens, 2, 1), model(tokens, 2, 1)
    assert torch.equal(a, b)
    assert not torch.allclose(a, model(tokens, 2, 2))
    assert not torch.allclose(a, model(tokens, 3, 1))
    model.eval()
    assert torch.equal(model(tokens, 2, 1), model(tokens, 2, 2))  # no dropout in eval


def test_loss_is_sum_of_per_sample_means_and_counts_samples() -> None:
    w, model = GPTWorkload(CFG), _model().eval()
    tokens, targets = _tokens(4), _tokens(4).roll(1, dims=0)
    logits = model(tokens, 1, 0)
    total, count = w.loss(logits, targets)
    per_sample = torch.stack([nn.functional.cross_entropy(logits[i], targets[i]) for i in range(4)])
    assert count == 4 and total.shape == ()
    assert torch.allclose(total, per_sample.sum(), atol=1e-5)
    assert abs(total.item() / 4 - math.log(CFG.vocab_size)) < 0.1


def test_parameter_count() -> None:
    d, v, t = CFG.d_model, CFG.vocab_size, CFG.seq_len
    block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = v * d + t * d + CFG.n_layer * block + 2 * d + (d * v + v)
    assert sum(p.numel() for p in _model().parameters()) == expected
    offsets = _model().segments()
    assert offsets[0][0] == 0 and sum(n for _, n in offsets) == expected


def test_loss_falls_on_synthetic_tokens() -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)
    w = GPTWorkload(cfg, num_samples=512)
    data, model = w.dataset(0), build_layers(w, 0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(1, 31):
        inputs, targets = w.collate(
            [data[i] for i in sample_ids(0, step, 8, num_samples=len(data))]
        )
        loss = w.loss(model(inputs, step, 0), targets)[0] / 8
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(64)) < 0.2
    assert losses[-1] < 0.8 * losses[0]


def test_export_writes_every_parameter_under_its_global_name(tmp_path) -> None:
    """The default export: one safetensors file, a key per parameter (``layers.<i>.<name>``),
    holding its values, readable without the runtime."""
    from safetensors.torch import load_file

    from elaswave.runtime.optim import FlatParams

    model = _model()
    FlatParams(model)  # as export builds it: parameters viewing one flat buffer
    GPTWorkload(CFG).export(model, tmp_path / "m.safetensors")
    saved = load_file(str(tmp_path / "m.safetensors"))
    named = dict(model.named_parameters())
    assert sorted(saved) == sorted(named) and "layers.0.tok.weight" in saved
    assert all(torch.equal(saved[k], p.detach()) for k, p in named.items())


def test_bf16_autocast_layers_pass_float32_and_split_like_the_whole() -> None:
    """Under bf16 autocast every layer hands on float32 (what stages exchange), the result
    differs from float32 compute, gradients stay float32, and running the layers in two pieces
    (two pipeline stages) gives the whole model's bits."""
    model = _model()
    x = _tokens()
    plain = model(x, 1, 0)
    model.autocast = torch.bfloat16
    whole = model(x, 1, 0)
    assert whole.dtype == torch.float32 and not torch.equal(whole, plain)
    for index in range(len(model)):
        assert model(x, 1, 0, 0, index + 1).dtype in (torch.float32,)
    assert torch.equal(model(model(x, 1, 0, 0, 2), 1, 0, 2), whole)
    whole.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
