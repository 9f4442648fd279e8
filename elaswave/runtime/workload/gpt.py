"""The built-in workload: a small GPT (embedding, pre-LN transformer blocks, head) on token data.

It is one workload among others: the runtime knows it only through :class:`Workload`. Its dropout
is plain ``nn.Dropout``; the runtime keys the masks by (seed, step, micro-batch, layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.runtime.workload.base import Dataset, Family, Member, TensorSpec, Workload
from elaswave.runtime.workload.data import SyntheticTokens, token_file

__all__ = ["GPTConfig", "GPTWorkload", "gpt_families", "gpt_layer_costs", "per_sample_loss"]


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


class Embedding(nn.Module):
    """Token + learned positional embedding, then dropout: int64 [b, T] -> [b, T, d]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.seq_len = cfg.seq_len
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds configured seq_len {self.seq_len}")
        positions = torch.arange(t, device=x.device)
        return self.drop(self.tok(x) + self.pos(positions))


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention + 4x GELU MLP, each with dropout."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        d = cfg.d_model
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        shape = (b, t, self.n_head, d // self.n_head)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self._attention(self.ln1(x)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln2(x)))))


class Head(nn.Module):
    """Final LayerNorm + linear projection to vocabulary logits [b, T, V]."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


@torch.no_grad()
def _init(layer: nn.Module) -> nn.Module:
    """N(0, 0.02) weights, zero biases, unit LayerNorm weights (from the default generator,
    which the runtime seeds per layer)."""
    for module in layer.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, 0.02)
            bias = getattr(module, "bias", None)  # an Embedding has none
            if bias is not None:
                bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.weight.fill_(1.0)
            module.bias.zero_()
    return layer


def per_sample_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy per sample: logits [b, T, V], targets [b, T] -> [b]."""
    b, t, v = logits.shape
    ce = F.cross_entropy(logits.reshape(b * t, v).float(), targets.reshape(b * t), reduction="none")
    return ce.view(b, t).mean(dim=1)


def gpt_layer_costs(
    *, vocab_size: int, seq_len: int, d_model: int, n_layer: int
) -> tuple[float, ...]:
    """Relative compute cost of each layer of [embedding, blocks..., head].

    A FLOP estimate per sample (the backward pass costs a constant multiple of the forward, so
    the ratio is what matters): a block is 24·T·d² (projections, MLP) + 4·T²·d (attention), the
    head 2·T·d·V, the embedding a gather (≈ 2·T·d).
    """
    t, d, v = seq_len, d_model, vocab_size
    block = 24.0 * t * d * d + 4.0 * t * t * d
    return (2.0 * t * d, *([block] * n_layer), 2.0 * t * d * v)


class GPTWorkload(Workload):
    """The GPT of ``model`` (source ``gpt``) on ``data``: synthetic tokens or a token file."""

    def __init__(
        self, model: GPTConfig, *, data_source: str = "synthetic", data_path: str | None = None,
        data_dtype: str = "uint16", num_samples: int = 8192,
    ) -> None:  # fmt: skip
        self.cfg = model
        self.data_source, self.data_path, self.data_dtype = data_source, data_path, data_dtype
        self.num_samples = num_samples

    @property
    def num_layers(self) -> int:
        return self.cfg.n_layer + 2

    @property
    def vocab_size(self) -> int:
        """Token ids must be below this (checked on a token file before a job starts)."""
        return self.cfg.vocab_size

    def build_layer(self, index: int, seed: int) -> nn.Module:
        if index == 0:
            return _init(Embedding(self.cfg))
        if index == self.num_layers - 1:
            return _init(Head(self.cfg))
        return _init(Block(self.cfg))

    def dataset(self, seed: int) -> Dataset:
        c = self.cfg
        if self.data_source in ("tokens", "text"):  # text: the token file launch made
            return token_file(self.data_path, seq_len=c.seq_len, dtype=self.data_dtype)
        return SyntheticTokens(
            seed=seed, vocab_size=c.vocab_size, seq_len=c.seq_len, num_samples=self.num_samples
        )

    def collate(self, samples: Sequence[Any]) -> tuple[torch.Tensor, Any]:
        """Stack token windows: inputs are the first T tokens, targets the last T."""
        seqs = torch.stack(list(samples))
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()

    def boundary(self, index: int, micro_batch_size: int) -> TensorSpec:
        c = self.cfg
        width = c.vocab_size if index == self.num_layers - 1 else c.d_model
        return TensorSpec((micro_batch_size, c.seq_len, width), torch.float32)

    def loss(self, output: torch.Tensor, targets: Any) -> tuple[torch.Tensor, int]:
        """Sum over samples of each sample's mean token cross-entropy."""
        return per_sample_loss(output, targets).sum(), int(targets.shape[0])

    def zero_invariant_groups(self, model: Any) -> list[Any]:
        return gpt_families(self.cfg.d_model, self.cfg.n_head, range(1, self.num_layers - 1))

    def layer_costs(self) -> Sequence[float]:
        c = self.cfg
        return gpt_layer_costs(
            vocab_size=c.vocab_size, seq_len=c.seq_len, d_model=c.d_model, n_layer=c.n_layer
        )


def gpt_families(d_model: int, n_head: int, blocks: range) -> list[Family]:
    """The built-in GPT's blocks: each head (its q, k and v rows of ``qkv``, their biases, its
    columns of ``proj``) and each MLP channel (``fc`` row and bias, ``fc_out`` column)."""
    hd = d_model // n_head
    out = []
    for i in blocks:
        members = []
        for third in range(3):
            members.append(Member((i, "qkv.weight"), 0, hd, third * d_model))
            members.append(Member((i, "qkv.bias"), 0, hd, third * d_model))
        members.append(Member((i, "proj.weight"), 1, hd))
        out.append(Family(f"layers.{i}.attention", "attention", n_head, tuple(members)))
        members = [
            Member((i, "fc.weight"), 0),
            Member((i, "fc.bias"), 0),
            Member((i, "fc_out.weight"), 1),
        ]
        out.append(Family(f"layers.{i}.mlp", "mlp", 4 * d_model, tuple(members)))
    return out
