"""The smaller model a pruned run trained: every zero group, and what only it fed, removed.

:func:`kept_groups` decides which groups stay (the non-zero ones; with ``same_width`` every family
of a kind keeps as many as the widest of them, padding with zero groups, which change nothing);
:func:`shrink` slices the parameters (:func:`slice_params`, which :class:`~elaswave.prune.zig.ZIG`
uses too); :func:`hf_config` writes the smaller widths into a
Hugging Face config so that ``from_pretrained`` loads the result; :func:`matmul_flops` is what the
export reports a forward costs before and after.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from elaswave.prune.groups import Family, flat_index
from elaswave.prune.heads import fit_heads
from elaswave.runtime.workload.base import KeyedLayers, ParamRef
from elaswave.runtime.workload.hfgroups import HEADS_FIXED, LLAMA_LIKE, attention_shape
from elaswave.runtime.workload.resize import fit_attention, resized

__all__ = ["hf_config", "kept_groups", "matmul_flops", "removals", "shrink", "slice_params"]


def matmul_flops(model: nn.Module, sample: torch.Tensor | None = None) -> int:
    """FLOPs of one sample (or token, for a language model) through ``model``'s matrix products:
    2 × the weights of every ``Linear`` and transformers' ``Conv1D`` (gpt2's projections), and
    2 × the weights of every convolution × the positions it computes for one sample of
    ``sample`` (a micro-batch of the model's inputs, run once in eval mode; without it,
    convolutions are not counted: their cost depends on the input's size)."""
    total = 2 * sum(
        cast(torch.Tensor, m.weight).numel()  # a Linear's or a Conv1D's weight
        for m in model.modules()
        if isinstance(m, nn.Linear) or (hasattr(m, "nf") and getattr(m, "weight", None) is not None)
    )
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    if sample is None or not convs:
        return total
    positions: dict[nn.Module, int] = {}

    def seen(module: nn.Module, _: Any, out: torch.Tensor) -> None:
        positions[module] = out[0, 0].numel()  # one sample's, one channel's

    hooks = [m.register_forward_hook(seen) for m in convs]
    training = model.training
    try:
        with torch.no_grad():
            model.eval()(sample, 0, 0)
    finally:
        for h in hooks:
            h.remove()
        model.train(training)
    return total + 2 * sum(m.weight.numel() * positions.get(m, 0) for m in convs)


def kept_groups(
    families: Sequence[Family],
    model: KeyedLayers,
    flat: torch.Tensor,
    *,
    same_width: bool,
    whole: Collection[str] = (),
) -> list[list[int]]:
    """The groups each family keeps (sorted): those with a non-zero element, or its first
    group where all are zero (a layer of no channels does not run; a zero one changes
    nothing); with ``same_width``, as many in every family of a kind as its widest keeps
    (lowest-index zero groups added); every group of the kinds in ``whole``."""
    kept = [
        torch.nonzero((flat[flat_index(f, model)] != 0).any(dim=1)).flatten().tolist() or [0]
        for f in families
    ]
    if not same_width and not whole:
        return kept
    width: dict[str, int] = defaultdict(int)
    for f, k in zip(families, kept, strict=True):
        width[f.kind] = max(width[f.kind], len(k))
    out = []
    for f, k in zip(families, kept, strict=True):
        want = f.count if f.kind in whole else width[f.kind] if same_width else len(k)
        have = set(k)
        pad = [j for j in range(f.count) if j not in have][: want - len(k)]
        out.append(sorted(k + pad))
    return out


def removals(
    families: Sequence[Family], kept: Sequence[Sequence[int]]
) -> dict[tuple[ParamRef, int], set[int]]:
    """The indices each (parameter, axis) loses: the blocks of every dropped group, of its
    members and of its consumers."""
    removed: dict[tuple[ParamRef, int], set[int]] = defaultdict(set)
    for f, k in zip(families, kept, strict=True):
        dropped = sorted(set(range(f.count)) - set(k))
        for m in (*f.members, *f.consumers):
            for j in dropped:
                start = m.start + j * m.size
                removed[(m.param, m.axis)].update(range(start, start + m.size))
    return removed


def slice_params(
    layers: Sequence[nn.Module], removed: Mapping[tuple[ParamRef, int], Collection[int]]
) -> None:
    """Slice the parameters of ``layers`` in place: (layer, name) loses ``removed``'s indices
    along each axis; a norm's running statistics follow its weight, and every module's size
    attributes follow its weights (:func:`resized`)."""
    for (ref, axis), gone in sorted(removed.items()):
        layer, name = ref
        owner, _, leaf = name.rpartition(".")
        module = layers[layer].get_submodule(owner) if owner else layers[layer]
        p = getattr(module, leaf)
        keep = torch.tensor([i for i in range(p.shape[axis]) if i not in gone], dtype=torch.long)
        setattr(
            module, leaf, nn.Parameter(p.detach().index_select(axis, keep).clone(), p.requires_grad)
        )
        if isinstance(module, nn.modules.batchnorm._NormBase) and leaf == "weight":
            for stat in ("running_mean", "running_var"):  # the kept channels' statistics
                buffer = getattr(module, stat)
                if buffer is not None:
                    setattr(module, stat, buffer.index_select(0, keep).clone())
        resized(module)
    for block in layers:
        fit_attention(block)
        fit_heads(block)


def shrink(model: KeyedLayers, families: Sequence[Family], kept: Sequence[Sequence[int]]) -> None:
    """Slice ``model``'s parameters in place: the blocks of every dropped group (its members
    and its consumers) removed."""
    slice_params(list(model.layers), removals(families, kept))


def hf_config(config: Any, families: Sequence[Family], kept: Sequence[Sequence[int]]) -> Any:
    """A copy of an HF ``config`` with the widths of ``kept``: one per kind, the widest layer's
    (``kept`` from :func:`kept_groups` with ``same_width``: every layer's). Where the layers
    kept different widths, ``elaswave_widths`` lists each layer's per kind (the model then
    loads with :func:`~elaswave.prune.load.load_compressed`)."""
    widths: dict[str, list[int]] = defaultdict(list)
    for f, k in zip(families, kept, strict=True):
        widths[f.kind].append(len(k))
    width = {kind: max(w) for kind, w in widths.items()}
    out = copy.deepcopy(config)
    kind = config.model_type
    full = {f.kind: f.count for f in families}
    fewer_heads = kind in HEADS_FIXED and width.get("attention", 0) < full.get("attention", 0)
    if any(len(set(w)) > 1 for w in widths.values()) or fewer_heads:
        out.elaswave_widths = dict(widths)  # the config keeps gpt2's and gpt_neox's head count
    if "attention" in width and kind in LLAMA_LIKE:
        heads, kv, out.head_dim = attention_shape(config)
        out.num_key_value_heads = width["attention"]
        out.num_attention_heads = width["attention"] * (heads // kv)
    if "mlp" in width:
        if kind == "gpt2":
            out.n_inner = width["mlp"]
        else:
            out.intermediate_size = width["mlp"]
    return out
