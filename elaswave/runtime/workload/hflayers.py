"""How a Hugging Face causal LM is cut into the runtime's layers, and the layer modules.

A transformers causal LM (llama, gpt2, qwen2, mistral, ...) is cut into the runtime's layers:

* layer 0, the embedding: the base model's input embedding, plus what the family registers
  before its decoder blocks (gpt2: learned positions ``wpe`` and dropout ``drop``). Token ids
  ``(mb, seq)`` int64 in, hidden states ``(mb, seq, hidden)`` float32 out;
* one layer per decoder block (the base model's one ``nn.ModuleList``). A block layer recomputes
  what the base model's forward would hand its blocks: position ids, the rotary
  ``position_embeddings`` (from its own copy of the base model's ``rotary_emb``, which has no
  trainable parameters) and causal masking (``attention_mask=None`` under ``sdpa`` attention is
  what the base model itself passes for unpadded input: ``sdpa`` then runs with ``is_causal``);
* the last layer, the head: what the base model registers after its blocks (the final norm)
  and the LM head: logits ``(mb, seq, vocab)`` float32.

The cut is generic: it reads the module tree (``base_model_prefix``, ``get_input_embeddings``,
``get_output_embeddings``) rather than a per-family table, and refuses, with a
:class:`ConfigError`, a tree it cannot read. Families whose base-model forward does more than
the above between the pieces (embedding scaling outside a module, ALiBi, logit soft-capping,
sliding windows shorter than ``seq_len``) are not covered.

Separate from :mod:`elaswave.runtime.workload.hf`, the workload that builds, initialises, loads
and exports these layers: this part only reads a model's structure and runs its pieces, and
needs neither transformers' configs nor checkpoints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from elaswave.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["BlockLayer", "EmbeddingLayer", "HeadLayer", "cut_hf_model"]


# -- the layers ------------------------------------------------------------------------------------


class EmbeddingLayer(nn.Module):
    """Layer 0: int64 token ids ``(mb, seq)`` -> hidden states ``(mb, seq, hidden)`` float32.

    Holds the input embedding and the modules the family registers before its blocks, each under
    its HF name: the token embedding, then every other ``nn.Embedding`` (learned positions,
    indexed ``0 .. seq - 1``) added to it, then the remaining modules (dropout, an embedding
    norm) applied in order.
    """

    def __init__(self, parts: Mapping[str, nn.Module], token: str) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)
        self._token = token
        self._positions = [
            n for n, m in parts.items() if n != token and isinstance(m, nn.Embedding)
        ]
        self._after = [
            n for n, m in parts.items() if n != token and not isinstance(m, nn.Embedding)
        ]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = getattr(self, self._token)(ids)
        if self._positions:
            positions = torch.arange(ids.shape[1], device=ids.device)
            for name in self._positions:
                h = h + getattr(self, name)(positions)
        for name in self._after:
            h = getattr(self, name)(h)
        return h.float()


class BlockLayer(nn.Module):
    """One decoder block, fed what the base model's forward would give it.

    Position ids ``0 .. seq - 1``; rotary ``position_embeddings`` from this layer's own copy of
    the base model's rotary module (buffers only); ``attention_mask=None``, which ``sdpa``
    attention turns into ``is_causal=True`` (as the base model does for unpadded input).
    """

    def __init__(self, block: nn.Module, rotary: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.rotary_emb = rotary

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": positions}
        if self.rotary_emb is not None:
            kwargs["position_embeddings"] = self.rotary_emb(h, positions)
        out = self.block(h, **kwargs)
        return out[0] if isinstance(out, tuple) else out


class HeadLayer(nn.Module):
    """The last layer: the modules registered after the blocks (final norm), then the LM head;
    hidden states ``(mb, seq, hidden)`` -> logits ``(mb, seq, vocab)`` float32."""

    def __init__(self, parts: Mapping[str, nn.Module]) -> None:
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            h = module(h)
        return h.float()


# -- the cut ---------------------------------------------------------------------------------------


def _child_name(parent: nn.Module, target: nn.Module) -> str | None:
    return next((n for n, c in parent.named_children() if c is target), None)


def cut_hf_model(model: PreTrainedModel) -> tuple[list[list[tuple[str, str]]], str, str | None]:
    """The layers of ``model`` as lists of (local name, HF module path), the input embedding's
    local name and the HF path of the rotary module (or ``None``).

    Reads the tree: the base model (``base_model_prefix``), its one ``nn.ModuleList`` of blocks,
    what comes before it (embedding layer), after it (head, with the output embedding), and a
    parameter-free rotary module anywhere (copied into each block layer)."""
    kind = type(model).__name__
    prefix = model.base_model_prefix
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module) or base is model:
        raise ConfigError(f"model.source: hf: cannot find the base model of {kind}")
    base_model = cast("PreTrainedModel", base)  # an HF model's base model is one too
    head, token = model.get_output_embeddings(), base_model.get_input_embeddings()
    head_name, token_name = _child_name(model, head), _child_name(base, token)
    if head_name is None or token_name is None:
        raise ConfigError(f"model.source: hf: cannot find the embeddings and LM head of {kind}")
    extra = [n for n, c in model.named_children() if c is not base and n != head_name]
    if any(p for n in extra for p in getattr(model, n).parameters()):
        raise ConfigError(f"model.source: hf: {kind} has modules outside its base model: {extra}")
    if any(True for m in (model, base) for _ in m.parameters(recurse=False)):
        raise ConfigError(f"model.source: hf: {kind} has parameters outside its modules")
    lists = [n for n, c in base.named_children() if isinstance(c, nn.ModuleList)]
    if len(lists) != 1:
        raise ConfigError(f"model.source: hf: {kind} needs one list of decoder blocks, has {lists}")
    before: list[tuple[str, str]] = []
    after: list[tuple[str, str]] = []
    rotary, side = None, before
    for name, child in base.named_children():
        if name == lists[0]:
            side = after
        elif (
            not any(True for _ in child.parameters()) and "rotary" in f"{name}{type(child)}".lower()
        ):
            rotary = f"{prefix}.{name}"
        elif isinstance(child, nn.Dropout) or any(True for _ in child.parameters()):
            side.append((name, f"{prefix}.{name}"))
        else:
            raise ConfigError(f"model.source: hf: {kind}: cannot place module {prefix}.{name}")
    if token_name not in dict(before):
        raise ConfigError(f"model.source: hf: {kind}: the input embedding is not before the blocks")
    blocks = getattr(base, lists[0])
    layers = [before]
    layers += [[("block", f"{prefix}.{lists[0]}.{i}")] for i in range(len(blocks))]
    layers.append([*after, (head_name, head_name)])
    return layers, token_name, rotary
