"""Zero-invariant groups (OTOv2's ZIGs): slices of a model's parameters that, once all zero, can be
removed with the model's output unchanged.

A group family is ``count`` groups over one hidden dimension: group ``j`` takes block ``j``
(``size`` elements along ``axis``, from ``start`` on) of every member parameter. An MLP's channel
``j`` is row ``j`` of its input projection(s), their bias entry ``j``, and column ``j`` of its
output projection; an attention head group is a key-value head's rows of ``k``/``v``, the rows
of the query heads that share it, and their columns of the output projection. The residual
stream, embeddings and anything tied to them are never in a group.

Families come from the workload (:meth:`Workload.zero_invariant_groups`: Hugging Face llama /
qwen2 / mistral / gpt2 / gpt_neox and the built-in GPT declare theirs), or, for any other
model, from its ``torch.fx`` graph (:mod:`elaswave.prune.graph`): every producer (``Linear``,
convolution) whose output channels can be removed, through activations, norms, pooling,
flattens, residual adds (one family for a stream's producers), concatenations, depthwise and
grouped convolutions, squeeze-excitation gates; attention heads as blocks of ``head_dim``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from elaswave.errors import ConfigError
from elaswave.prune.analysis import analyse
from elaswave.prune.graph import TraceError
from elaswave.runtime.workload.base import Family, KeyedLayers, Member, ParamRef, Workload

__all__ = [
    "Family", "Member", "NoGroups", "TraceError", "find_groups", "flat_index", "traced_families",
    "workload_example",
]  # fmt: skip


class NoGroups(ConfigError):
    """The model has no zero-invariant group to prune."""


def find_groups(
    workload: Workload,
    model: KeyedLayers,
    kinds: Sequence[str] = (),
) -> list[Family]:
    """The model's families (declared by the workload, else traced; only ``kinds`` when
    given), checked: every member's blocks fit its parameter, no element is in two groups, no
    tied parameter is in any."""
    declared = workload.zero_invariant_groups(model)
    if declared is not None:
        families = list(declared)
    else:
        families = traced_families(model, workload_example(workload, model.seed))
    families = [f for f in families if f.count > 1 and (not kinds or f.kind in kinds)]
    if not families:
        only = f" of kinds {', '.join(kinds)}" if kinds else ""
        raise NoGroups(
            f"train.prune: {type(workload).__name__} has no zero-invariant groups{only} (no "
            "producer whose output channels can be removed; declare them with "
            "Workload.zero_invariant_groups)"
        )
    tied = {ref for pair in workload.tied() for ref in pair}
    shapes = {
        (i, n): p.shape for i, layer in enumerate(model.layers) for n, p in layer.named_parameters()
    }
    for f in families:
        for m in (*f.members, *f.consumers):
            if m.param in tied:
                raise NoGroups(f"train.prune: {f.name} includes the tied parameter {m.param}")
            shape = shapes.get(m.param)
            if shape is None:
                raise ConfigError(f"train.prune: {f.name} names no parameter {m.param}")
            if m.start + f.count * m.size > shape[m.axis]:
                raise ConfigError(
                    f"train.prune: {f.name}: {f.count} blocks of {m.size} from {m.start} do not "
                    f"fit axis {m.axis} of {m.param} {tuple(shape)}"
                )
    index = torch.cat([flat_index(f, model).reshape(-1) for f in families])
    if index.unique().numel() != index.numel():
        raise ConfigError("train.prune: the model's groups overlap (an element in two groups)")
    return families


def flat_index(family: Family, model: KeyedLayers) -> torch.Tensor:
    """``(count, group size)`` int64: the flat offsets (in the whole model's flat layout) of
    each group's elements, member by member."""
    parts = []
    for m in family.members:
        sl = model.param_slice(m.param)
        shape = dict(model.layers[m.param[0]].named_parameters())[m.param[1]].shape
        ids = torch.arange(sl.start, sl.stop, dtype=torch.int64).view(shape)
        ids = ids.narrow(m.axis, m.start, family.count * m.size).movedim(m.axis, 0)
        parts.append(ids.reshape(family.count, -1))
    return torch.cat(parts, dim=1)


# -- tracing -----------------------------------------------------------------------------------

EXAMPLE_SAMPLES = 2  # samples of the workload's data the traced layers are run on (shapes only)


def traced_families(model: KeyedLayers, example: tuple[Any, ...]) -> list[Family]:
    """The families of the layers in sequence, read off their ``torch.fx`` graph run on
    ``example`` (:mod:`elaswave.prune.graph`): every producer's output channels (a
    ``Linear``'s, a convolution's) whose uses the rules follow to their end, the producers of
    one residual stream as one family, attention heads as blocks. Norms whose statistics span
    the channels end a family here: the layers keep their own classes, which would compute
    them over fewer channels. A model that does not trace raises
    :class:`~elaswave.prune.graph.TraceError`."""
    return analyse(
        nn.Sequential(*model.layers), example, mixing=False, ref=_layer_ref, prefix="layers."
    ).families


def workload_example(workload: Workload, seed: int) -> tuple[Any, ...]:
    """The first samples of ``workload``'s data as layer 0's inputs (what tracing runs on)."""
    data = workload.dataset(seed)
    inputs, _ = workload.collate([data[i] for i in range(min(EXAMPLE_SAMPLES, len(data)))])
    return (inputs,)


def _layer_ref(qualified: str) -> ParamRef:
    """(layer index, name inside the layer) of a parameter of the layers in sequence."""
    layer, _, rest = qualified.partition(".")
    return int(layer), rest
