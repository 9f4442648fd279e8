import math

import pytest
import torch
from torch import nn

from elaswave.runtime.data import SyntheticTokens, batch, sample_ids
from elaswave.runtime.model import (
    GPT,
    Block,
    Embedding,
    GPTConfig,
    Head,
    build_layers,
    count_parameters,
)
from elaswave.runtime.rng import MicrobatchRng

CFG = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.1)


def _tokens(b: int = 3, t: int = 16) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (b, t), generator=torch.Generator().manual_seed(0))


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


def test_config_is_keyword_only_and_frozen() -> None:
    with pytest.raises(TypeError):
        GPTConfig(8, 4, 1, 2, 8)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        CFG.n_layer = 3  # type: ignore[misc]


def test_build_layers_structure_and_indices() -> None:
    layers = build_layers(CFG, init_seed=0)
    assert len(layers) == CFG.n_layer + 2
    assert isinstance(layers[0], Embedding)
    assert all(isinstance(layer, Block) for layer in layers[1:-1])
    assert isinstance(layers[-1], Head)
    assert [layer.index for layer in layers] == list(range(len(layers)))


def test_build_layers_deterministic_and_seed_dependent() -> None:
    def params(seed: int) -> list[torch.Tensor]:
        return [p for layer in build_layers(CFG, init_seed=seed) for p in layer.parameters()]

    a, b, c = params(1), params(1), params(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_build_layers_init_values_and_global_rng_untouched() -> None:
    state = torch.get_rng_state()
    layers = build_layers(CFG, init_seed=0)
    assert torch.equal(state, torch.get_rng_state())
    block = layers[1]
    assert isinstance(block, Block)
    assert torch.equal(block.ln1.weight, torch.ones(CFG.d_model))
    assert torch.equal(block.qkv.bias, torch.zeros(3 * CFG.d_model))
    assert abs(float(block.fc.weight.detach().std()) - 0.02) < 0.003
    assert all(p.device.type == "cpu" and torch.isfinite(p).all() for p in block.parameters())


def test_forward_shapes() -> None:
    model = GPT(CFG, init_seed=0)
    tokens = _tokens()
    rng = MicrobatchRng(0, 1, 0)
    h = model.layers[0](tokens, rng)
    assert h.shape == (3, 16, CFG.d_model)
    h = model.layers[1](h, rng)
    assert h.shape == (3, 16, CFG.d_model)
    assert model(tokens, rng).shape == (3, 16, CFG.vocab_size)
    assert model(tokens[:, :5]).shape == (3, 5, CFG.vocab_size)
    with pytest.raises(ValueError):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))


def test_layers_compose_to_model() -> None:
    model = GPT(CFG, init_seed=0)
    tokens = _tokens()
    h = tokens
    for layer in build_layers(CFG, init_seed=0):
        h = layer(h, MicrobatchRng(0, 1, 2))
    assert torch.allclose(h, model(tokens, MicrobatchRng(0, 1, 2)))


def test_dropout_masks_keyed_by_microbatch() -> None:
    model = GPT(CFG, init_seed=0).train()
    tokens = _tokens()
    a = model(tokens, MicrobatchRng(seed=3, step=2, microbatch=1))
    b = model(tokens, MicrobatchRng(seed=3, step=2, microbatch=1))
    c = model(tokens, MicrobatchRng(seed=3, step=2, microbatch=2))
    d = model(tokens, MicrobatchRng(seed=3, step=3, microbatch=1))
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)
    assert not torch.allclose(a, d)


def test_no_dropout_without_rng_or_in_eval() -> None:
    model = GPT(CFG, init_seed=0).train()
    tokens = _tokens()
    plain = model(tokens, None)
    model.eval()
    assert torch.equal(model(tokens, MicrobatchRng(0, 1, 0)), plain)
    assert torch.equal(model(tokens, MicrobatchRng(0, 1, 1)), plain)
    no_drop = GPT(GPTConfig(**{**CFG.__dict__, "dropout": 0.0}), init_seed=0).train()
    assert torch.allclose(no_drop(tokens, MicrobatchRng(0, 1, 0)), plain)


def test_dropout_does_not_touch_global_rng() -> None:
    model = GPT(CFG, init_seed=0).train()
    state = torch.get_rng_state()
    model(_tokens(), MicrobatchRng(0, 1, 0))
    assert torch.equal(state, torch.get_rng_state())


def test_loss_sum_is_sum_of_per_sample_means() -> None:
    model = GPT(CFG, init_seed=0).eval()
    tokens, targets = _tokens(4), _tokens(4).roll(1, dims=0)
    total = model.loss_sum(tokens, targets, None)
    logits = model(tokens)
    per_sample = torch.stack([nn.functional.cross_entropy(logits[i], targets[i]) for i in range(4)])
    assert total.shape == ()
    assert torch.allclose(total, per_sample.sum(), atol=1e-5)
    split = model.loss_sum(tokens[:2], targets[:2], None) + model.loss_sum(
        tokens[2:], targets[2:], None
    )
    assert torch.allclose(total, split, atol=1e-5)
    assert abs(total.item() / 4 - math.log(CFG.vocab_size)) < 0.1


def test_count_parameters() -> None:
    model = GPT(CFG, init_seed=0)
    d, v, t = CFG.d_model, CFG.vocab_size, CFG.seq_len
    block = 2 * (2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    expected = v * d + t * d + CFG.n_layer * block + 2 * d + (d * v + v)
    assert count_parameters(model) == expected


def test_loss_falls_on_synthetic_tokens() -> None:
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=64)
    data = SyntheticTokens(seed=0, vocab_size=64, seq_len=32, num_samples=512)
    model = GPT(cfg, init_seed=0).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(1, 31):
        inputs, targets = batch(data, sample_ids(0, step, 8, len(data)))
        loss = model.loss_sum(inputs, targets, MicrobatchRng(0, step, 0)) / 8
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(64)) < 0.2
    assert losses[-1] < 0.8 * losses[0]
