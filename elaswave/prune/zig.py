"""The zero-invariant groups of any module, for use outside a training run.

>>> zig = ZIG(model, example_inputs)   # model: any nn.Module; its positional inputs
>>> len(zig.groups)                    # how many groups
>>> zig.zero([0, 5])                   # those groups set to zero, in place
>>> small = zig.compress()             # a new module without the zero groups: same outputs

The groups come from the module's ``torch.fx`` graph (:mod:`elaswave.prune.graph`); the
compressed module is a copy with its parameters sliced as ``export --compress`` slices a
run's layers (:func:`~elaswave.prune.compress.slice_params`), its size attributes following.
A LayerNorm over the channels keeps its full width there: it is fed zeros for the removed
channels (which are what the zeroed module feeds it) and its output loses them again, so its
statistics are the same.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from elaswave.prune.analysis import analyse
from elaswave.prune.compress import removals, slice_params
from elaswave.runtime.workload.base import Family, Member

__all__ = ["ZIG"]


class ZIG:
    """``model``'s zero-invariant groups, found on ``example_inputs`` (a tensor, or a tuple of
    the forward's positional inputs). ``families``: one per hidden dimension (its parameters
    named ``(0, qualified name)``); ``groups``: (family, block) of every group, in order."""

    def __init__(self, model: nn.Module, example_inputs: Any) -> None:
        example = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        analysis = analyse(model, example)
        self.model = model
        self.families: list[Family] = analysis.families
        self.groups: list[tuple[int, int]] = [
            (i, j) for i, f in enumerate(self.families) for j in range(f.count)
        ]
        self._sites = analysis.sites
        self._params = dict(model.named_parameters())

    def _blocks(self, m: Member, count: int) -> torch.Tensor:
        """Member ``m``'s ``count`` blocks, a view with the block index on its own axis (right
        after the member's axis)."""
        p = self._params[m.param[1]]
        return p.narrow(m.axis, m.start, count * m.size).unflatten(m.axis, (count, m.size))

    def zero(self, indices: Iterable[int]) -> None:
        """Set the groups at ``indices`` (of :attr:`groups`) exactly to zero, in place."""
        chosen: dict[int, list[int]] = defaultdict(list)
        for g in indices:
            i, j = self.groups[g]
            chosen[i].append(j)
        with torch.no_grad():
            for i, js in chosen.items():
                f = self.families[i]
                index = torch.tensor(js, dtype=torch.long)
                for m in f.members:
                    self._blocks(m, f.count).index_fill_(m.axis, index, 0.0)

    def zero_groups(self) -> list[int]:
        """The indices of the groups whose every member is zero."""
        nonzero = [self._nonzero(i) for i in range(len(self.families))]
        return [g for g, (i, j) in enumerate(self.groups) if not nonzero[i][j]]

    def _nonzero(self, i: int) -> list[bool]:
        """Whether each group of family ``i`` has a non-zero element."""
        f = self.families[i]
        out = torch.zeros(f.count, dtype=torch.bool)
        for m in f.members:
            out |= self._blocks(m, f.count).movedim(m.axis, 0).reshape(f.count, -1).ne(0).any(1)
        return out.tolist()

    def compress(self) -> nn.Module:
        """A copy of the module without its zero groups (and what only they fed): the same
        outputs, fewer parameters. A family whose every group is zero keeps its first (a
        layer of no channels does not run)."""
        kept = [
            [j for j, live in enumerate(self._nonzero(i)) if live] or [0]
            for i in range(len(self.families))
        ]
        small = copy.deepcopy(self.model)
        full = {module for module, kind, _, _ in self._sites if kind == "pad"}
        removed = {
            key: gone
            for key, gone in removals(self.families, kept).items()
            if key[0][1].rpartition(".")[0] not in full
        }
        slice_params([small], removed)
        for module, kind, axis, runs in self._sites:
            keep = kept_channels(runs, kept, self.families)
            target = small.get_submodule(module)
            width = sum(c for _, c in runs)
            if kind == "pad" and len(keep) < width:
                index = torch.tensor(keep, dtype=torch.long)
                target.register_forward_pre_hook(Widen(axis, index, width))
                target.register_forward_hook(Narrow(axis, index))
            elif kind == "width":
                target.num_features = len(keep)  # type: ignore[assignment]
        fit_widths(small, self.families, kept)
        return small


WIDTH_NAMES = ("hidden_dim", "embed_dim", "num_features", "hidden_size", "dim", "width")


def fit_widths(model: nn.Module, families: Sequence[Family], kept: Sequence[Sequence[int]]) -> None:
    """The width attributes a model's own modules read in their forward (``hidden_dim`` of a
    ViT reshaping its patches), set to their family's new width: an attribute of a module
    outside ``torch.nn`` named as one (:data:`WIDTH_NAMES`) that holds the full width of
    exactly one family of channels holding parameters inside it."""
    for name, module in model.named_modules():
        if type(module).__module__.startswith("torch.nn"):
            continue
        prefix = f"{name}." if name else ""
        for attr in WIDTH_NAMES:
            value = getattr(module, attr, None)
            if not isinstance(value, int) or isinstance(value, bool):
                continue
            widths = {
                len(k) * f.members[0].size
                for f, k in zip(families, kept, strict=True)
                if f.kind == "channels"
                and f.count * f.members[0].size == value
                and any(m.param[1].startswith(prefix) for m in f.members)
            }
            if len(widths) == 1:
                setattr(module, attr, widths.pop())


def kept_channels(
    runs: Sequence[tuple[int | None, int]],
    kept: Sequence[Sequence[int]],
    families: Sequence[Family],
) -> list[int]:
    """The channels a tensor keeps, from its runs (family index or None: kept whole,
    channels) and the groups each family keeps (a run's channels in its family's groups,
    in order)."""
    out: list[int] = []
    at = 0
    for family, channels in runs:
        if family is None:
            out += range(at, at + channels)
        else:
            size = channels // families[family].count
            for j in kept[family]:
                out += range(at + j * size, at + (j + 1) * size)
        at += channels
    return out


class Widen:
    """A forward pre-hook: the input, zeros added along ``axis`` where the removed channels
    were (``index``: the kept channels of ``width``)."""

    def __init__(self, axis: int, index: torch.Tensor, width: int) -> None:
        self.axis, self.index, self.width = axis, index, width

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        shape = list(x.shape)
        shape[self.axis] = self.width
        full = x.new_zeros(shape).index_copy(self.axis, self.index.to(x.device), x)
        return (full, *args[1:])


class Narrow:
    """A forward hook: the output's kept channels along ``axis`` only."""

    def __init__(self, axis: int, index: torch.Tensor) -> None:
        self.axis, self.index = axis, index

    def __call__(self, module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        return out.index_select(self.axis, self.index.to(out.device))
