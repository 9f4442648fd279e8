"""The zero-invariant groups (:class:`~elaswave.runtime.workload.base.Family`) of the Hugging
Face families ElasWave trains: llama / qwen2 / mistral (GQA-aware attention heads and MLP
channels), gpt2 (heads of its fused ``c_attn`` ``Conv1D``, MLP channels) and gpt_neox (heads of
its per-head interleaved ``query_key_value``, MLP channels). Pure functions of a config and the
layers' parameter names; the HF workload declares them through
:meth:`~elaswave.runtime.workload.base.Workload.zero_invariant_groups`.

gpt2's and gpt_neox's configs derive a head's width from the hidden size and the head count
(:data:`HEADS_FIXED`), so a model with fewer heads cannot be written as one: its export keeps the
config's head count and each layer's under ``elaswave_widths``
(:func:`elaswave.prune.load.load_compressed` loads it; ``--pad`` keeps every head instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from elaswave.runtime.workload.base import Family, Member

__all__ = ["HEADS_FIXED", "LLAMA_LIKE", "attention_shape", "hf_families"]

LLAMA_LIKE = ("llama", "qwen2", "mistral", "qwen3")
HEADS_FIXED = ("gpt2", "gpt_neox")  # a head's width is hidden size / head count


def _params(layer: nn.Module) -> set[str]:
    return {n for n, p in layer.named_parameters() if p.requires_grad}


def _rows_and_bias(index: int, names: set[str], module: str, *, size: int) -> list[Member]:
    out = [Member((index, f"{module}.weight"), 0, size)]
    if f"{module}.bias" in names:
        out.append(Member((index, f"{module}.bias"), 0, size))
    return out


def attention_shape(config: Any) -> tuple[int, int, int]:
    """(query heads, key-value heads, head width) of a llama-like HF config."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def hf_families(config: Any, layers: Sequence[tuple[int, nn.Module]]) -> list[Family]:
    """Families of the decoder blocks ``(layer index, BlockLayer)`` of an HF model of
    ``config``; none for a family type without rules."""
    kind = getattr(config, "model_type", "")
    out: list[Family] = []
    for index, layer in layers:
        names = _params(layer)
        if kind in LLAMA_LIKE:
            heads, kv, hd = attention_shape(config)
            rep = heads // kv
            a = "block.self_attn"
            members = [
                *_rows_and_bias(index, names, f"{a}.q_proj", size=rep * hd),
                *_rows_and_bias(index, names, f"{a}.k_proj", size=hd),
                *_rows_and_bias(index, names, f"{a}.v_proj", size=hd),
                Member((index, f"{a}.o_proj.weight"), 1, rep * hd),
            ]
            out.append(Family(f"layers.{index}.attention", "attention", kv, tuple(members)))
            m = "block.mlp"
            members = [
                *_rows_and_bias(index, names, f"{m}.gate_proj", size=1),
                *_rows_and_bias(index, names, f"{m}.up_proj", size=1),
                Member((index, f"{m}.down_proj.weight"), 1),
            ]
            out.append(
                Family(f"layers.{index}.mlp", "mlp", config.intermediate_size, tuple(members))
            )
        elif kind == "gpt2":
            e, heads = config.n_embd, config.n_head
            hd, a = e // heads, "block.attn"
            members = []
            for third in range(3):  # Conv1D: (in, out); c_attn's outputs are [q | k | v]
                members.append(Member((index, f"{a}.c_attn.weight"), 1, hd, third * e))
                if f"{a}.c_attn.bias" in names:
                    members.append(Member((index, f"{a}.c_attn.bias"), 0, hd, third * e))
            members.append(Member((index, f"{a}.c_proj.weight"), 0, hd))
            out.append(Family(f"layers.{index}.attention", "attention", heads, tuple(members)))
            inner = config.n_inner or 4 * config.n_embd
            m = "block.mlp"
            members = [Member((index, f"{m}.c_fc.weight"), 1)]  # Conv1D: (in, out)
            if f"{m}.c_fc.bias" in names:
                members.append(Member((index, f"{m}.c_fc.bias"), 0))
            members.append(Member((index, f"{m}.c_proj.weight"), 0))
            out.append(Family(f"layers.{index}.mlp", "mlp", inner, tuple(members)))
        elif kind == "gpt_neox":
            heads = config.num_attention_heads
            hd, a = config.hidden_size // heads, "block.attention"
            members = [  # query_key_value's rows are [q_h k_h v_h] head by head
                *_rows_and_bias(index, names, f"{a}.query_key_value", size=3 * hd),
                Member((index, f"{a}.dense.weight"), 1, hd),
            ]
            out.append(Family(f"layers.{index}.attention", "attention", heads, tuple(members)))
            m = "block.mlp"
            members = [
                *_rows_and_bias(index, names, f"{m}.dense_h_to_4h", size=1),
                Member((index, f"{m}.dense_4h_to_h.weight"), 1),
            ]
            out.append(
                Family(f"layers.{index}.mlp", "mlp", config.intermediate_size, tuple(members))
            )
    return out
