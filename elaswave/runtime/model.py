"""A small GPT expressed as an ordered list of layers, so it can be cut into pipeline stages.

Every dropout mask is drawn from a keyed generator (see `rng.MicrobatchRng`), so the same
micro-batch produces the same masks on any worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.runtime.rng import MicrobatchRng

__all__ = [
    "GPT",
    "Block",
    "Embedding",
    "GPTConfig",
    "Head",
    "build_layers",
    "count_parameters",
    "keyed_dropout",
    "per_sample_loss",
]


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model shape; validated on construction."""

    vocab_size: int
    seq_len: int
    n_layer: int
    n_head: int
    d_model: int
    dropout: float = 0.1

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


def keyed_dropout(
    x: torch.Tensor, p: float, rng: MicrobatchRng | None, *, layer: int, site: int, active: bool
) -> torch.Tensor:
    """Inverted dropout whose mask comes from the (layer, site) keyed generator."""
    if rng is None or not active or p == 0.0:
        return x
    gen = rng.generator(layer=layer, site=site, device=x.device)
    mask = torch.empty_like(x).bernoulli_(1.0 - p, generator=gen)
    return x * mask / (1.0 - p)


class Embedding(nn.Module):
    """Token + learned positional embedding, then dropout: int64 [b, T] -> [b, T, d]."""

    def __init__(self, cfg: GPTConfig, *, index: int = 0) -> None:
        super().__init__()
        self.index = index
        self.p = cfg.dropout
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, x: torch.Tensor, rng: MicrobatchRng | None = None) -> torch.Tensor:
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds configured seq_len {self.seq_len}")
        positions = torch.arange(t, device=x.device)
        h = self.tok(x) + self.pos(positions)
        return keyed_dropout(h, self.p, rng, layer=self.index, site=0, active=self.training)


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention + 4x GELU MLP, each with dropout."""

    def __init__(self, cfg: GPTConfig, *, index: int) -> None:
        super().__init__()
        self.index = index
        self.p = cfg.dropout
        self.n_head = cfg.n_head
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor, rng: MicrobatchRng | None = None) -> torch.Tensor:
        a = self._attention(self.ln1(x))
        x = x + keyed_dropout(a, self.p, rng, layer=self.index, site=0, active=self.training)
        m = self.fc_out(F.gelu(self.fc(self.ln2(x))))
        return x + keyed_dropout(m, self.p, rng, layer=self.index, site=1, active=self.training)


class Head(nn.Module):
    """Final LayerNorm + linear projection to vocabulary logits [b, T, V]."""

    def __init__(self, cfg: GPTConfig, *, index: int) -> None:
        super().__init__()
        self.index = index
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor, rng: MicrobatchRng | None = None) -> torch.Tensor:
        return self.out(self.ln(x))


def _init_module(module: nn.Module, gen: torch.Generator) -> None:
    """Deterministic init: N(0, 0.02) weights, zero biases, unit LayerNorm weights."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.normal_(0.0, 0.02, generator=gen)
        bias = getattr(module, "bias", None)
        if bias is not None:
            bias.zero_()
    elif isinstance(module, nn.LayerNorm):
        module.weight.fill_(1.0)
        module.bias.zero_()


def build_layers(cfg: GPTConfig, *, init_seed: int) -> list[nn.Module]:
    """[Embedding, Block x n_layer, Head] with parameters determined by `init_seed` alone."""
    with torch.device("meta"):
        layers: list[nn.Module] = [Embedding(cfg, index=0)]
        layers += [Block(cfg, index=i + 1) for i in range(cfg.n_layer)]
        layers.append(Head(cfg, index=cfg.n_layer + 1))
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int(init_seed))
    with torch.no_grad():
        for layer in layers:
            layer.to_empty(device="cpu")
            for module in layer.modules():
                _init_module(module, gen)
    return layers


class GPT(nn.Module):
    """The whole layer list run sequentially on one device."""

    def __init__(self, cfg: GPTConfig, *, init_seed: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(build_layers(cfg, init_seed=init_seed))

    def forward(self, tokens: torch.Tensor, rng: MicrobatchRng | None = None) -> torch.Tensor:
        h = tokens
        for layer in self.layers:
            h = layer(h, rng)
        return h

    def loss_sum(
        self, tokens: torch.Tensor, targets: torch.Tensor, rng: MicrobatchRng | None
    ) -> torch.Tensor:
        """Sum over samples of each sample's mean token cross-entropy."""
        return per_sample_loss(self(tokens, rng), targets).sum()


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy per sample: logits [b, T, V], targets [b, T] -> [b]."""
    b, t, v = logits.shape
    ce = F.cross_entropy(logits.reshape(b * t, v).float(), targets.reshape(b * t), reduction="none")
    return ce.view(b, t).mean(dim=1)


def count_parameters(model: nn.Module) -> int:
    """Total number of parameter elements."""
    return sum(p.numel() for p in model.parameters())
