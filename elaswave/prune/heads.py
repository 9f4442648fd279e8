"""Attention modules with fewer heads than they were built with (some removed as zero groups).

``nn.MultiheadAttention`` derives its head width from its input width, so a compressed one,
whose heads no longer span its input, becomes a :class:`HeadsAttention`: the same parameters,
a forward that takes ``head_dim`` as it is. timm's attention reads ``num_heads`` and
``attn_dim``: they are set from its fused ``qkv``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elaswave.prune.graph import is_attention

__all__ = ["HeadsAttention", "fit_heads"]


class HeadsAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with ``num_heads × head_dim`` inner width, whatever its input
    width (``embed_dim``): packed q, k, v projections, scaled dot products, the output
    projection; masks as ``nn.MultiheadAttention`` takes them."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask[None]
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        length, batch, _ = query.shape
        source = key.shape[0]
        heads, width = self.num_heads, self.num_heads * self.head_dim
        w, b = self.in_proj_weight, self.in_proj_bias
        biases = [None if b is None else b[i * width : (i + 1) * width] for i in range(3)]
        q, k, v = (
            F.linear(t, w[i * width : (i + 1) * width], biases[i])
            .reshape(t.shape[0], batch * heads, self.head_dim)
            .transpose(0, 1)
            for i, t in enumerate((query, key, value))
        )
        scores = q @ k.transpose(1, 2) / math.sqrt(self.head_dim)
        scores = scores + _additive(attn_mask, is_causal, length, source, scores)
        if key_padding_mask is not None:
            pad = _additive(key_padding_mask, False, length, source, scores)
            scores = scores + pad.reshape(batch, 1, 1, source).expand(-1, heads, -1, -1).reshape(
                batch * heads, 1, source
            )
        attn = scores.softmax(-1)
        weights = attn
        if self.training and self.dropout > 0:
            attn = F.dropout(attn, self.dropout)
        out = (attn @ v).transpose(0, 1).reshape(length, batch, width)
        out = self.out_proj(out)
        if unbatched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = weights.reshape(batch, heads, length, source)
        weights = weights.mean(1) if average_attn_weights else weights
        return out, weights.squeeze(0) if unbatched else weights


def _additive(
    mask: torch.Tensor | None, causal: bool, length: int, source: int, like: torch.Tensor
) -> torch.Tensor:
    """A mask as numbers to add to the scores (True: not attended, -inf)."""
    if mask is None:
        if not causal:
            return torch.zeros((), dtype=like.dtype, device=like.device)
        mask = torch.ones(length, source, dtype=torch.bool, device=like.device).triu(1)
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(like.dtype)


def fit_heads(model: nn.Module) -> None:
    """Every attention of ``model`` told its (sliced) head count and input width."""
    for m in model.modules():
        if isinstance(m, nn.MultiheadAttention) and m.in_proj_weight is not None:
            rows, width = m.in_proj_weight.shape
            if rows == 3 * m.embed_dim and width == m.embed_dim:
                continue
            m.num_heads = rows // 3 // m.head_dim
            m.embed_dim = m.kdim = m.vdim = width
            m.__class__ = HeadsAttention
        elif is_attention(m) or (hasattr(m, "qkv") and hasattr(m, "attn_dim")):
            qkv = m.qkv
            if isinstance(qkv, nn.Linear) and isinstance(getattr(m, "head_dim", None), int):
                heads = qkv.out_features // 3 // int(m.head_dim)  # type: ignore[arg-type]
                m.num_heads = heads  # type: ignore[assignment]
                if hasattr(m, "attn_dim"):
                    m.attn_dim = heads * int(m.head_dim)  # type: ignore[arg-type, assignment]
