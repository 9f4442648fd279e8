"""Zero-invariant groups of any module, read off its ``torch.fx`` graph.

The graph is walked once, in order. Every tensor whose channels (along one axis) the walk can
name gets a :class:`Chan`: the axis and the runs of channels (:class:`Seg`) it holds, each a
*space* (the output channels of a producer: a ``Linear``, a convolution, an attention's output
projection) with how many of the tensor's channels each unit of the space takes (a flatten
makes one channel many features). The rules (:mod:`elaswave.prune.rules`) say what each
operation does with them:

- an element-wise operation keeps the channels; whether a channel is still zero when its group
  is (``Seg.zero``) follows ``f(0) = 0``;
- a residual add, or a multiply of two tensors with channels (a squeeze-excitation's gate and
  the tensor it scales), makes one space of its operands' spaces (:meth:`Walk.union`): their
  channel ``j`` is removed together or not at all;
- a ``torch.cat`` along the channels keeps each input's runs at their offsets;
- per-channel parameters (norms' weights, a depthwise convolution's rows, a layer scale, a class
  token) join the space as *members*: zero with the group, so the channel is zero whatever came
  in; the next producer's input columns are *consumers*: removed with the group;
- a norm, a grouped convolution or an attention head that needs whole blocks of channels sets
  the space's block size (:meth:`Walk.step`);
- anything the rules do not know *kills* the spaces of its inputs: they form no group.

:func:`analyse` ends the walk: each live space is one :class:`Family` of ``count`` groups.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import ShapeProp

from elaswave.errors import ConfigError, one_line
from elaswave.runtime.workload.base import Family, Member, ParamRef

__all__ = [
    "Analysis", "Chan", "Param", "Ref", "Seg", "Site", "TraceError", "Walk", "analyse",
    "is_attention", "trace",
]  # fmt: skip


class TraceError(ConfigError):
    """The model does not trace with ``torch.fx`` (its cause on one line)."""


@dataclass(frozen=True)
class Seg:
    """A run of ``channels`` channels of a tensor: the units of ``space`` (None: channels the
    walk cannot name), ``per`` channels to a unit; ``zero``: they are zero when their group is."""

    space: int | None
    channels: int
    per: Fraction = Fraction(1)
    zero: bool = True


@dataclass(frozen=True)
class Chan:
    """A tensor whose channels along ``axis`` the walk names, run by run."""

    axis: int
    segs: tuple[Seg, ...]

    @property
    def channels(self) -> int:
        return sum(s.channels for s in self.segs)

    def offsets(self) -> Iterable[tuple[int, Seg]]:
        """(first channel, run) of each run."""
        at = 0
        for s in self.segs:
            yield at, s
            at += s.channels


@dataclass(frozen=True)
class Param:
    """A parameter or buffer the graph reads directly (``get_attr``), ``lead`` dimensions
    added in front of it (``expand``); ``dims``, where it was reshaped: the parameter's axis
    under each dimension of the view (None: a dimension of one added)."""

    name: str
    shape: tuple[int, ...]
    lead: int = 0
    dims: tuple[int | None, ...] = ()

    def axis_of(self, axis: int, ndim: int) -> int | None:
        """The parameter's axis under axis ``axis`` of a result of ``ndim`` dimensions (right
        aligned, as broadcasting aligns them), or None."""
        if self.dims:
            at = axis - (ndim - len(self.dims))
            return self.dims[at] if 0 <= at < len(self.dims) else None
        at = axis - (ndim - len(self.shape) - self.lead) - self.lead
        return at if 0 <= at < len(self.shape) else None

    def view(self, source: tuple[int, ...], shape: tuple[int, ...]) -> Param | None:
        """This parameter (seen as ``source``) reshaped to ``shape``, or None unless the
        reshape only adds or removes dimensions of one (a layer scale made ``(1, C, 1, 1)``)."""
        own = self.dims or tuple(
            i - self.lead if i >= self.lead else None for i in range(len(source))
        )
        kept = [d for d, n in zip(own, source, strict=True) if n != 1]
        if [n for n in shape if n != 1] != [n for n in source if n != 1]:
            return None
        it = iter(kept)
        return Param(self.name, self.shape, 0, tuple(next(it) if n != 1 else None for n in shape))


Value = Chan | Param | tuple | None  # a tuple of Values for a node that returns several


@dataclass(frozen=True)
class Ref:
    """Parameter ``param``'s slices along ``axis`` from ``start``, ``per`` elements to a unit
    of ``space``; a member (zero with its group) or a consumer (removed with it)."""

    space: int
    per: Fraction
    param: str
    axis: int
    start: int
    consumer: bool = False


@dataclass(frozen=True)
class Site:
    """A module the compressed model keeps at full width on the channels of ``chan`` (a norm
    whose statistics span the channels: ``pad``), or whose width attribute follows them
    (``width``)."""

    module: str
    kind: str  # pad | width
    chan: Chan


@dataclass
class Walk:
    """What the walk has found so far: the spaces (a union-find over them), their references,
    block sizes, the spaces killed, and the parameters read by operations the rules do not
    know (any family holding one is unsound)."""

    sizes: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    dead: set[int] = field(default_factory=set)
    refs: list[Ref] = field(default_factory=list)
    steps: list[tuple[int, int]] = field(default_factory=list)  # (space, units per block)
    escaped: set[str] = field(default_factory=set)
    sites: list[Site] = field(default_factory=list)
    calls: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # module: (input, output)
    mixing: bool = True  # norms whose statistics span the channels may be grouped

    def new(self, name: str, size: int, kind: str = "channels") -> int:
        self.sizes.append(size)
        self.names.append(name)
        self.kinds.append(kind)
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, space: int) -> int:
        while self.parent[space] != space:
            self.parent[space] = self.parent[self.parent[space]]
            space = self.parent[space]
        return space

    def union(self, a: int, b: int) -> int:
        """One space of ``a`` and ``b`` (the first created names it); killed if either was."""
        a, b = self.find(a), self.find(b)
        if a == b:
            return a
        a, b = min(a, b), max(a, b)
        self.parent[b] = a
        if b in self.dead:
            self.dead.add(a)
        return a

    def kill(self, *values: Any) -> None:
        """No group for any space in ``values`` (nested tuples and lists searched)."""
        for v in values:
            if isinstance(v, Chan):
                for s in v.segs:
                    if s.space is not None:
                        self.dead.add(self.find(s.space))
            elif isinstance(v, Param):
                self.escaped.add(v.name)
            elif isinstance(v, (tuple, list)):
                self.kill(*v)

    def ref(self, chan: Chan, param: str, axis: int, *, consumer: bool = False, scale=1) -> None:
        """``param``'s slices along ``axis`` over every named run of ``chan`` (``scale``
        elements of the parameter to a channel)."""
        for at, s in chan.offsets():
            if s.space is not None:
                per = s.per * scale
                self.refs.append(Ref(s.space, per, param, axis, int(at * scale), consumer))

    def step(self, space: int, units: int) -> None:
        self.steps.append((space, units))


@dataclass
class Analysis:
    """The families of a module (their parameters named as ``ref`` maps qualified names) and
    the sites the compressed model keeps at full width, each run given as (family index or
    None, channels)."""

    families: list[Family]
    sites: list[tuple[str, str, int, tuple[tuple[int | None, int], ...]]]


def is_attention(m: nn.Module) -> bool:
    """A timm-style attention: a fused ``qkv`` ``Linear`` of three times ``num_heads`` heads of
    ``head_dim``, a ``proj`` back, and no gate or norm over the heads' outputs."""
    qkv, proj = getattr(m, "qkv", None), getattr(m, "proj", None)
    heads, dim = getattr(m, "num_heads", None), getattr(m, "head_dim", None)
    return (
        isinstance(qkv, nn.Linear)
        and isinstance(proj, nn.Linear)
        and isinstance(heads, int)
        and isinstance(dim, int)
        and qkv.out_features == 3 * heads * dim
        and getattr(m, "gate", None) is None
        and isinstance(getattr(m, "norm", nn.Identity()), nn.Identity)
    )


class _Tracer(fx.Tracer):
    """torch.fx's tracer, with every norm and attention the rules read kept as one call."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._NormBase)):
            return True
        return is_attention(m) or super().is_leaf_module(m, module_qualified_name)


def trace(model: nn.Module) -> fx.GraphModule:
    """``model``'s graph; a model that does not trace raises :class:`TraceError` with the
    cause on one line."""
    tracer = _Tracer()
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # noqa: BLE001 - any model code may refuse to trace
        raise TraceError(
            f"train.prune: the model does not trace with torch.fx: {one_line(exc)}"
        ) from None
    return fx.GraphModule(tracer.root, graph)


def _shapes(gm: fx.GraphModule, example: tuple[Any, ...]) -> None:
    """Every node's output shape (``meta['tensor_meta']``), from a run on the meta device (no
    memory, no arithmetic; a model whose layers live on meta works too)."""

    def meta(t: Any) -> Any:
        return t.to("meta") if isinstance(t, torch.Tensor) else t

    class Run(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gm = gm

        def forward(self, *args: Any) -> Any:
            return ShapeProp(self.gm).propagate(*args)

    run = Run()
    state = {n: meta(t) for n, t in [*run.named_parameters(), *run.named_buffers()]}
    args = torch.utils._pytree.tree_map(meta, example)
    try:
        with torch.no_grad():
            torch.func.functional_call(run, state, args, tie_weights=True)
    except Exception as exc:  # noqa: BLE001 - the model's own code on its inputs
        raise TraceError(
            f"train.prune: the traced model does not run on its example inputs: {one_line(exc)}"
        ) from None


def analyse(
    model: nn.Module,
    example: tuple[Any, ...],
    *,
    step: Callable[[fx.Node, dict[fx.Node, Value], dict[str, nn.Module], Walk], Value],
    mixing: bool = True,
    ref: Callable[[str], ParamRef] = lambda name: (0, name),
    prefix: str = "",
) -> Analysis:
    """The zero-invariant groups of ``model`` run on ``example`` (its positional inputs), in
    eval mode: one family per live space, in the order the spaces were made. ``mixing``: norms
    whose statistics span the channels (LayerNorm over them) may be in a group (the compressed
    model then keeps them at full width, fed zeros for the removed channels). ``step`` gives
    a node's value from its inputs' (the rules: :func:`elaswave.prune.analysis.analyse` passes
    them)."""
    training = model.training
    model.eval()
    try:
        gm = trace(model)
        _shapes(gm, example)
        walk = Walk(mixing=mixing)
        env: dict[fx.Node, Value] = {}
        modules = dict(gm.named_modules())
        for node in gm.graph.nodes:
            env[node] = step(node, env, modules, walk)
    finally:
        model.train(training)
    return _families(walk, dict(gm.named_parameters()), ref=ref, prefix=prefix)


def _blocks(walk: Walk, refs: dict[int, list[Ref]]) -> dict[int, int]:
    """Each live space's units per group: a multiple of every block it must keep whole and of
    every reference's denominator, dividing the space; a space without one is killed."""
    need: dict[int, int] = defaultdict(lambda: 1)
    for space, units in walk.steps:
        root = walk.find(space)
        need[root] = math.lcm(need[root], units)
    out = {}
    for root, rs in refs.items():
        b = need[root]
        for r in rs:
            b = math.lcm(b, r.per.denominator)
        if walk.sizes[root] % b:
            walk.dead.add(root)
        else:
            out[root] = b
    return out


def _overlaps(walk: Walk, refs: dict[int, list[Ref]]) -> set[int]:
    """Spaces whose slices of a parameter overlap another's (a module called twice), or that
    hold a parameter an unknown operation reads."""
    spans: dict[tuple[str, int], list[tuple[int, int, int]]] = defaultdict(list)
    bad = set()
    for root, rs in refs.items():
        for r in rs:
            if r.param in walk.escaped:
                bad.add(root)
            spans[(r.param, r.axis)].append(
                (r.start, r.start + int(walk.sizes[root] * r.per), root)
            )
    for runs in spans.values():
        runs.sort()
        for (_, end, a), (start, _, b) in zip(runs, runs[1:], strict=False):
            if start < end:
                bad |= {a, b}
    return bad


def _families(
    walk: Walk, params: dict[str, nn.Parameter], *, ref: Callable[[str], ParamRef], prefix: str
) -> Analysis:
    refs: dict[int, list[Ref]] = defaultdict(list)
    seen: set[tuple[int, str, int, int, Fraction, bool]] = set()
    for r in walk.refs:
        root = walk.find(r.space)
        key = (root, r.param, r.axis, r.start, r.per, r.consumer)
        if key in seen:  # a shared module's slices, read again at its next call
            continue
        seen.add(key)
        if r.param in params and (r.consumer or params[r.param].requires_grad):
            refs[root].append(r)
        else:  # a buffer, or a frozen member: not something a group can drive to zero
            walk.dead.add(root)
    for _ in range(2):  # killing a space can only remove overlaps
        refs = {k: v for k, v in refs.items() if k not in walk.dead}
        walk.dead |= _overlaps(walk, refs)
    refs = {k: v for k, v in refs.items() if k not in walk.dead}
    blocks = _blocks(walk, refs)
    families: list[Family] = []
    index: dict[int, int] = {}
    for root in sorted(blocks):
        b, rs = blocks[root], refs[root]
        if not any(not r.consumer for r in rs):
            continue
        members = tuple(
            Member(ref(r.param), r.axis, int(b * r.per), r.start) for r in rs if not r.consumer
        )
        consumers = tuple(
            Member(ref(r.param), r.axis, int(b * r.per), r.start) for r in rs if r.consumer
        )
        index[root] = len(families)
        name = prefix + walk.names[root]
        families.append(Family(name, walk.kinds[root], walk.sizes[root] // b, members, consumers))
    sites = []
    for site in walk.sites:
        runs = tuple(
            (index.get(walk.find(s.space)) if s.space is not None else None, s.channels)
            for s in site.chan.segs
        )
        sites.append((site.module, site.kind, site.chan.axis, runs))
    return Analysis(families, sites)
