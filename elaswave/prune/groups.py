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
model, from tracing it with ``torch.fx``: a ``Linear`` whose output reaches exactly one other
``Linear`` through element-wise modules only (activations, dropout) makes a family over its
output features; so does a convolution reaching one other convolution of its dimension through
element-wise modules, pooling and BatchNorms (whose per-channel weight and bias join the group),
or reaching one ``Linear`` through a flatten of its channels (channel ``j`` is then a block of
the ``Linear``'s input columns, one per position).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import fx, nn

from elaswave.errors import ConfigError
from elaswave.runtime.workload.base import Family, KeyedLayers, Member, ParamRef, Workload

__all__ = ["Family", "Member", "NoGroups", "find_groups", "flat_index", "traced_families"]


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
    families = list(declared) if declared is not None else traced_families(model)
    families = [f for f in families if f.count > 1 and (not kinds or f.kind in kinds)]
    if not families:
        only = f" of kinds {', '.join(kinds)}" if kinds else ""
        raise NoGroups(
            f"train.prune: {type(workload).__name__} has no zero-invariant groups{only} (no Linear "
            "feeding another through element-wise layers; declare them with "
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

# Element-wise and zero-preserving (f(0) = 0): a channel whose Linear row and bias are zero
# stays zero through them, so the next Linear's column for it multiplies zero.
_ELEMENTWISE_MODULES = (
    nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Dropout, nn.Identity, nn.LeakyReLU, nn.ELU, nn.Mish,
    nn.Hardswish, nn.ReLU6,
)  # fmt: skip
_ELEMENTWISE_FUNCTIONS = {
    F.gelu, F.relu, F.silu, F.dropout, F.leaky_relu, F.elu, F.mish, torch.relu, torch.tanh,
    F.tanh,
}  # fmt: skip


# Per-channel affine normalisations: channel j's output is (x_j - mean_j) / std_j × weight_j +
# bias_j, whatever the statistics; with weight_j and bias_j in the group, a zero group gives 0.
_PER_CHANNEL_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


def _projection(module: nn.Module | None) -> type | None:
    """The kind of ``module`` a chain can start and end at (a ``Linear``, or a convolution of
    one group, whose weight's axis 0 is its output channels and axis 1 its input channels)."""
    if isinstance(module, nn.Linear):
        return nn.Linear
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and module.groups == 1:
        return type(module)
    return None


# Per-channel and zero-preserving: pooling reads one channel's values only (a max or a mean of
# zeros is zero; a max pool's padding is -inf, never chosen over a zero).
_PER_CHANNEL_POOLS = (
    nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d, nn.AvgPool2d, nn.AvgPool3d,
    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d,
)  # fmt: skip


def traced_families(model: KeyedLayers) -> list[Family]:
    """Families found by tracing the layers in sequence (``torch.fx``): each ``Linear`` (or
    convolution) whose every use reaches one other of its kind's input through element-wise,
    zero-preserving operations, pooling and per-channel affine normalisations (BatchNorm)
    only, or, from a convolution, one ``Linear`` through a flatten of the channels (channel
    ``c`` is then a block of the ``Linear``'s columns, one per position); a group is an output
    row (channel) of the first, its bias, the normalisations' weight and bias of that channel,
    and the second's input column (channel, or block) is removed with it. A model that does not
    trace has none."""
    try:
        graph = fx.symbolic_trace(nn.Sequential(*model.layers)).graph
    except Exception:  # noqa: BLE001 (any model code may refuse to trace)
        return []
    modules = dict(nn.Sequential(*model.layers).named_modules())
    out = []
    for node in graph.nodes:
        kind = _projection(modules[node.target]) if node.op == "call_module" else None
        if kind is None:
            continue
        features = modules[node.target].weight.shape[0]
        found = _sole_user(node, modules, kind, channels=features)
        if found is None:
            continue
        target, norms, block = found
        a, b = _ref(node.target), _ref(str(target.target))
        members = [Member(_param(a, "weight"), 0)]
        if modules[node.target].bias is not None:
            members.append(Member(_param(a, "bias"), 0))
        for norm in norms:
            members += [
                Member(_param(_ref(norm), "weight"), 0),
                Member(_param(_ref(norm), "bias"), 0),
            ]
        consumers = (Member(_param(b, "weight"), 1, block),)
        out.append(Family(f"layers.{node.target}", "channels", features, tuple(members), consumers))
    return out


def _ref(qualified: str) -> tuple[int, str]:
    """(layer index, module path inside the layer) of a traced module's qualified name."""
    layer, _, rest = qualified.partition(".")
    return int(layer), rest


def _param(module: tuple[int, str], leaf: str) -> ParamRef:
    layer, path = module
    return layer, f"{path}.{leaf}" if path else leaf


def _flattens_channels(user: fx.Node, mod: nn.Module | None) -> bool:
    """Whether ``user`` flattens (batch, channels, positions...) into (batch, features),
    channel-major: ``nn.Flatten()`` or ``torch.flatten(x, 1)``."""
    if isinstance(mod, nn.Flatten):
        return mod.start_dim == 1 and mod.end_dim == -1
    if user.op == "call_function" and user.target is torch.flatten:
        start = user.args[1] if len(user.args) > 1 else user.kwargs.get("start_dim", 0)
        end = user.args[2] if len(user.args) > 2 else user.kwargs.get("end_dim", -1)
        return bool(start == 1 and end == -1)
    return False


def _sole_user(
    node: fx.Node, modules: dict[str, nn.Module], kind: type, *, channels: int
) -> tuple[fx.Node, list[str], int] | None:
    """The one module that ``node``'s output (``channels`` of them) reaches: of ``kind``
    through element-wise operations, pooling and per-channel affine normalisations (with the
    normalisations passed, by name, and block 1), or, from a convolution through a flatten, a
    ``Linear`` (block: its inputs per channel); None when it reaches anything else (or more
    than one)."""
    found: list[tuple[fx.Node, bool]] = []
    norms: list[str] = []
    frontier = [(user, False) for user in node.users]  # (node, after a flatten)
    while frontier:
        user, flat = frontier.pop()
        mod = modules.get(str(user.target)) if user.op == "call_module" else None
        if mod is not None and _projection(mod) is (nn.Linear if flat else kind):
            found.append((user, flat))
            continue
        if _flattens_channels(user, mod) and kind is not nn.Linear and not flat:
            flat = True
        elif isinstance(mod, _PER_CHANNEL_NORMS) and mod.affine and not flat:
            norms.append(str(user.target))
        elif isinstance(mod, _PER_CHANNEL_POOLS) and not flat:
            pass
        elif not (
            isinstance(mod, _ELEMENTWISE_MODULES)
            or (user.op == "call_function" and user.target in _ELEMENTWISE_FUNCTIONS)
        ):
            return None
        if sum(isinstance(a, fx.Node) for a in (*user.args, *user.kwargs.values())) != 1:
            return None
        frontier.extend((u, flat) for u in user.users)
    if len(found) != 1:
        return None
    target, flat = found[0]
    if not flat:
        return target, norms, 1
    linear = modules[str(target.target)]
    assert isinstance(linear, nn.Linear)  # a chain through a flatten ends at a Linear
    inputs = linear.weight.shape[1]
    if inputs % channels:  # not a whole number of positions per channel
        return None
    return target, norms, inputs // channels
