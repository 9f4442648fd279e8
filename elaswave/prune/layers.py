"""The rules of modules with parameters (:mod:`.rules`): producers, norms and attention.

A producer (``Linear``, a convolution, a transposed one, an ``Embedding``) makes a space of its
output channels, its rows (and bias) the members; its input columns consume what it reads. A
grouped convolution passes its input's channels through by whole groups (a depthwise one by
single channels), its rows joining their spaces. A norm over the channels keeps them, its
weight and bias joining their spaces (a PReLU's slopes are removed with them); a GroupNorm
needs whole norm groups, a LayerNorm over the channels is kept at full width by the compressed
model (:class:`~.graph.Site` ``pad``). An
attention makes a space of its heads (blocks of ``head_dim``: the q, k and v rows, the output
projection's columns) and one of its output projection.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from elaswave.prune.graph import Chan, Ref, Seg, Value, Walk, is_attention
from elaswave.prune.rules import CONV, CONV_T, add_site, aligned, block_units

__all__ = ["norm_axis", "rule_of"]

Val = Callable[[Any], Any]


def rule_of(m: nn.Module) -> Callable[..., Value] | None:
    """The rule of module ``m``, or None (not one the rules know)."""
    if isinstance(m, nn.Linear):
        return _linear
    if isinstance(m, CONV):
        return _conv if m.groups == 1 else _grouped
    if isinstance(m, CONV_T) and m.groups == 1:
        return _conv_t
    if isinstance(m, nn.Embedding):
        return _embedding
    if isinstance(m, nn.modules.batchnorm._NormBase):
        return _channel_norm
    if isinstance(m, nn.GroupNorm):
        return _group_norm
    if isinstance(m, nn.LayerNorm):
        return _layer_norm
    if isinstance(m, nn.PReLU):
        return _prelu
    if isinstance(m, nn.MultiheadAttention):
        return _multihead
    if is_attention(m):
        return _attention
    return None


def _ndim(node: Any) -> int:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else 0


def _produce(
    walk: Walk, name: str, axis: int, channels: int, params: list[tuple[str, int]]
) -> Chan:
    """A new space of ``channels`` along ``axis``, ``params`` (name, axis) its members."""
    out = Chan(axis, (Seg(walk.new(name, channels), channels),))
    for param, at in params:
        walk.ref(out, param, at)
    return out


def _consume(walk: Walk, x: Value, axis: int, param: str, at: int) -> None:
    """``param``'s slices along ``at`` consume ``x``'s channels (which must lie along
    ``axis`` and be zero when their group is)."""
    if not isinstance(x, Chan):
        walk.kill(x)
        return
    if x.axis != axis:
        walk.kill(x)
        return
    for s in x.segs:
        if s.space is not None and not s.zero:
            walk.dead.add(walk.find(s.space))
    walk.ref(x, param, at, consumer=True)


def _params(m: nn.Module, name: str, at: dict[str, int]) -> list[tuple[str, int]]:
    """(qualified name, axis) of the parameters of ``at`` that ``m`` has."""
    return [(f"{name}.{p}", a) for p, a in at.items() if getattr(m, p, None) is not None]


def _linear(node: fx.Node, m: nn.Linear, val: Val, walk: Walk) -> Value:
    name = str(node.target)
    _consume(walk, val(node.args[0]), _ndim(node.args[0]) - 1, f"{name}.weight", 1)
    params = _params(m, name, {"weight": 0, "bias": 0})
    return _produce(walk, name, _ndim(node) - 1, m.out_features, params)


def _conv(node: fx.Node, m: nn.Module, val: Val, walk: Walk) -> Value:
    name, axis = str(node.target), _ndim(node) - len(m.kernel_size) - 1  # type: ignore[arg-type]
    _consume(walk, val(node.args[0]), axis, f"{name}.weight", 1)
    params = _params(m, name, {"weight": 0, "bias": 0})
    return _produce(walk, name, axis, m.out_channels, params)  # type: ignore[arg-type]


def _conv_t(node: fx.Node, m: nn.Module, val: Val, walk: Walk) -> Value:
    """A transposed convolution: its weight is (in, out, ...): rows consume, columns make."""
    name, axis = str(node.target), _ndim(node) - len(m.kernel_size) - 1  # type: ignore[arg-type]
    _consume(walk, val(node.args[0]), axis, f"{name}.weight", 0)
    params = _params(m, name, {"weight": 1, "bias": 0})
    return _produce(walk, name, axis, m.out_channels, params)  # type: ignore[arg-type]


def _grouped(node: fx.Node, m: nn.Module, val: Val, walk: Walk) -> Value:
    """A grouped convolution: input group ``g`` makes output group ``g`` alone, so a space's
    channels pass through by whole groups (one channel each for a depthwise one), the rows
    and bias of each group joining the space of its input channels."""
    x, name = val(node.args[0]), str(node.target)
    axis = _ndim(node) - len(m.kernel_size) - 1  # type: ignore[arg-type]
    groups, ins, outs = int(m.groups), int(m.in_channels), int(m.out_channels)  # type: ignore[arg-type]
    ipg, opg = ins // groups, outs // groups
    if not isinstance(x, Chan) or x.axis != axis or not aligned(x, ipg):
        walk.kill(x)
        return None
    segs = []
    for s in x.segs:
        if s.space is not None:
            walk.step(s.space, block_units(s.per, ipg))
        per = s.per * Fraction(opg, ipg)
        segs.append(Seg(s.space, s.channels * opg // ipg, per, s.space is not None))
    out = Chan(axis, tuple(segs))
    for param, at in _params(m, name, {"weight": 0, "bias": 0}):
        walk.ref(out, param, at)
    return out


def _embedding(node: fx.Node, m: nn.Embedding, val: Val, walk: Walk) -> Value:
    walk.kill(val(node.args[0]))
    name = str(node.target)
    return _produce(walk, name, _ndim(node) - 1, m.embedding_dim, [(f"{name}.weight", 1)])


def _members(walk: Walk, x: Chan, m: nn.Module, name: str) -> bool:
    """The affine weight and bias of norm ``m`` join ``x``'s spaces; whether it has them."""
    params = _params(m, name, {"weight": 0, "bias": 0})
    for param, at in params:
        walk.ref(x, param, at)
    return any(p.endswith(".weight") for p, _ in params)


def _zero(x: Chan) -> Chan:
    return Chan(x.axis, tuple(Seg(s.space, s.channels, s.per, s.space is not None) for s in x.segs))


def _channel_norm(node: fx.Node, m: nn.Module, val: Val, walk: Walk) -> Value:
    """BatchNorm and InstanceNorm: per channel. Affine: the channel's weight and bias zero make
    it zero whatever its statistics. Without them, running statistics move a zero channel off
    zero (and are buffers no group holds): killed; without either, zero stays zero."""
    x = val(node.args[0])
    if not isinstance(x, Chan) or x.axis != 1:
        walk.kill(x)
        return None
    name = str(node.target)
    if _members(walk, x, m, name):
        return _zero(x)
    if getattr(m, "running_mean", None) is not None:
        walk.kill(x)
        return None
    add_site(walk, name, "width", x)
    return x


def _prelu(node: fx.Node, m: nn.PReLU, val: Val, walk: Walk) -> Value:
    """PReLU, ``max(0, x) + a min(0, x)``: zero stays zero whatever the slope, so a slope per
    channel is a consumer (removed with its channel, never required to be zero); one slope
    for all channels is element-wise."""
    x = val(node.args[0])
    if m.num_parameters == 1 or not isinstance(x, Chan):
        return x if isinstance(x, Chan) else None
    if x.axis != min(1, _ndim(node) - 1) or x.channels != m.num_parameters:
        walk.kill(x)
        return None
    walk.ref(x, f"{node.target}.weight", 0, consumer=True)
    return x


def _group_norm(node: fx.Node, m: nn.GroupNorm, val: Val, walk: Walk) -> Value:
    """GroupNorm: statistics per norm group, so a group holds whole norm groups."""
    x = val(node.args[0])
    per_group = m.num_channels // m.num_groups
    if not isinstance(x, Chan) or x.axis != 1 or not aligned(x, per_group) or not m.affine:
        walk.kill(x)
        return None
    for s in x.segs:
        if s.space is not None:
            walk.step(s.space, block_units(s.per, per_group))
    _members(walk, x, m, str(node.target))
    return _zero(x)


def norm_axis(m: nn.LayerNorm, shape: tuple[int, ...]) -> int | None:
    """The axis a LayerNorm over one dimension normalises on inputs of ``shape``: the last for
    ``nn.LayerNorm`` itself; for a subclass (a LayerNorm2d over NCHW), the axis whose
    normalisation matches its output on random values."""
    if len(m.normalized_shape) != 1:
        return None
    width = m.normalized_shape[0]
    if type(m) is nn.LayerNorm:
        return len(shape) - 1 if shape and shape[-1] == width else None
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=gen)
    state = {n: torch.randn(p.shape, generator=gen) for n, p in m.named_parameters()}
    state |= {n: torch.zeros(b.shape, dtype=b.dtype) for n, b in m.named_buffers()}
    try:
        with torch.no_grad():
            out = torch.func.functional_call(m, state, (x,))
    except Exception:  # noqa: BLE001 - a forward the probe cannot run: not read
        return None
    weight, bias = state.get("weight"), state.get("bias")
    for axis in [a for a, n in enumerate(shape) if n == width]:
        ref = F.layer_norm(x.movedim(axis, -1), (width,), weight, bias, m.eps).movedim(-1, axis)
        if out.shape == ref.shape and torch.allclose(out, ref, atol=1e-5):
            return axis
    return None


def _layer_norm(node: fx.Node, m: nn.LayerNorm, val: Val, walk: Walk) -> Value:
    """A LayerNorm over the channels: its statistics span them, so it is grouped only where the
    compressed model may keep it at full width (fed zeros for the removed channels), and only
    over channels that are zero with their group (the zeros it is fed then are the values)."""
    x = val(node.args[0])
    meta = node.args[0].meta.get("tensor_meta") if isinstance(node.args[0], fx.Node) else None
    shape = tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else ()
    if not isinstance(x, Chan) or not walk.mixing or norm_axis(m, shape) != x.axis:
        walk.kill(x)
        return None
    if any(s.space is not None and not s.zero for s in x.segs):
        walk.kill(x)
        return None
    name = str(node.target)
    add_site(walk, name, "pad", x)
    return _zero(x) if _members(walk, x, m, name) else _unzero(x)


def _unzero(x: Chan) -> Chan:
    return Chan(x.axis, tuple(Seg(s.space, s.channels, s.per, False) for s in x.segs))


def _heads(walk: Walk, name: str, *, width: int, head: int, rows: list[str], cols: str) -> None:
    """A space of ``width // head`` heads: ``rows`` (q, k and v stacked, each ``width`` rows)
    its members, ``cols`` the output projection's columns."""
    space = walk.new(name, width, "attention")
    walk.step(space, head)
    for param in rows:
        for part in range(3):
            walk.refs.append(Ref(space, Fraction(1), param, 0, part * width))
    walk.refs.append(Ref(space, Fraction(1), cols, 1, 0, consumer=True))


def _multihead(node: fx.Node, m: nn.MultiheadAttention, val: Val, walk: Walk) -> Value:
    """``nn.MultiheadAttention`` as self-attention (query, key and value one tensor)."""
    q = node.args[0] if node.args else node.kwargs.get("query")
    k = node.args[1] if len(node.args) > 1 else node.kwargs.get("key")
    v = node.args[2] if len(node.args) > 2 else node.kwargs.get("value")
    x, name = val(q), str(node.target)
    simple = m._qkv_same_embed_dim and m.bias_k is None and m.in_proj_weight is not None
    if not (q is k is v) or not simple:
        walk.kill(x)
        return None
    axis = _ndim(q) - 1
    _consume(walk, x, axis, f"{name}.in_proj_weight", 1)
    rows = [f"{name}.in_proj_weight"] + (
        [f"{name}.in_proj_bias"] if m.in_proj_bias is not None else []
    )
    _heads(
        walk, name, width=m.embed_dim, head=m.head_dim, rows=rows, cols=f"{name}.out_proj.weight"
    )
    params = _params(m.out_proj, f"{name}.out_proj", {"weight": 0, "bias": 0})
    return (_produce(walk, f"{name}.out_proj", axis, m.embed_dim, params), None)


def _attention(node: fx.Node, m: nn.Module, val: Val, walk: Walk) -> Value:
    """A timm-style attention (:func:`~.graph.is_attention`) on its first input (a mask
    changes which positions a head reads, not that a head with zero values gives zero)."""
    x, name = val(node.args[0]), str(node.target)
    walk.kill(*[val(a) for a in (*node.args[1:], *node.kwargs.values())])  # masks: read whole
    qkv, proj = m.qkv, m.proj
    assert isinstance(qkv, nn.Linear) and isinstance(proj, nn.Linear)
    axis = _ndim(node.args[0]) - 1
    _consume(walk, x, axis, f"{name}.qkv.weight", 1)
    rows = [f"{name}.qkv.weight"] + ([f"{name}.qkv.bias"] if qkv.bias is not None else [])
    width = qkv.out_features // 3
    head = int(m.head_dim)  # type: ignore[arg-type]
    _heads(walk, name, width=width, head=head, rows=rows, cols=f"{name}.proj.weight")
    params = _params(proj, f"{name}.proj", {"weight": 0, "bias": 0})
    return _produce(walk, f"{name}.proj", axis, proj.out_features, params)
