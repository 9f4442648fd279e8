"""What each operation of a traced graph does with the channels it reads (:mod:`.graph`).

Tables name the operations by kind; :func:`step_node` looks a node up and applies its rule.
An operation in no table kills the spaces of every input: never an unsound group.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn

from elaswave.prune.graph import Chan, Param, Seg, Site, Value, Walk

__all__ = ["step_node"]

# -- the tables --------------------------------------------------------------------------------

# Element-wise with f(0) = 0: a zero channel stays zero.
ZERO_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
    nn.Dropout3d, nn.Identity, nn.LeakyReLU, nn.ELU, nn.CELU, nn.SELU, nn.Mish, nn.Hardswish,
    nn.Hardtanh, nn.Softsign, nn.Tanhshrink, nn.Hardshrink, nn.Softshrink,
)  # fmt: skip
ZERO_FUNCTIONS = {
    F.relu, F.relu_, torch.relu, torch.relu_, F.relu6, F.gelu, F.silu, F.hardswish, F.leaky_relu,
    F.elu, F.mish, F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.hardtanh, torch.tanh,
    F.tanh, torch.neg, operator.neg, torch.abs, torch.clone,
}  # fmt: skip
try:  # torchvision's stochastic depth: each row (sample) scaled, or kept (a traced call)
    from torchvision.ops import stochastic_depth

    ZERO_FUNCTIONS.add(stochastic_depth)
except ImportError:  # torchvision is optional
    pass
ZERO_METHODS = {
    "relu", "relu_", "tanh", "contiguous", "clone", "float", "half", "bfloat16", "to",
    "type_as", "detach", "neg", "abs",
}  # fmt: skip
# Element-wise with f(0) != 0: the channels stay, a zero one does not.
SHIFT_MODULES = (nn.Sigmoid, nn.Hardsigmoid, nn.Softplus)
SHIFT_FUNCTIONS = {torch.sigmoid, F.sigmoid, F.hardsigmoid, F.softplus, torch.exp}
SHIFT_METHODS = {"sigmoid", "sigmoid_", "exp"}
# Per channel over the last ``spatial`` dimensions (the channel axis just before them).
POOL_MODULES: dict[type, int] = {
    nn.MaxPool1d: 1, nn.MaxPool2d: 2, nn.MaxPool3d: 3, nn.AvgPool1d: 1, nn.AvgPool2d: 2,
    nn.AvgPool3d: 3, nn.AdaptiveAvgPool1d: 1, nn.AdaptiveAvgPool2d: 2, nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1, nn.AdaptiveMaxPool2d: 2, nn.AdaptiveMaxPool3d: 3, nn.ZeroPad1d: 1,
    nn.ZeroPad2d: 2, nn.ZeroPad3d: 3,
}  # fmt: skip
POOL_FUNCTIONS: dict[Callable[..., Any], int] = {
    F.max_pool1d: 1, F.max_pool2d: 2, F.max_pool3d: 3, F.avg_pool1d: 1, F.avg_pool2d: 2,
    F.avg_pool3d: 3, F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2,
    F.adaptive_avg_pool3d: 3, F.adaptive_max_pool1d: 1, F.adaptive_max_pool2d: 2,
    F.adaptive_max_pool3d: 3,
}  # fmt: skip
REDUCE_FUNCTIONS = {torch.mean, torch.sum, torch.amax, torch.amin}
REDUCE_METHODS = {"mean", "sum", "amax", "amin"}
RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.squeeze, torch.unsqueeze}
RESHAPE_METHODS = {"view", "reshape", "flatten", "squeeze", "unsqueeze", "unflatten"}
ADD = {operator.add, operator.iadd, torch.add, operator.sub, operator.isub, torch.sub}
ADD_METHODS = {"add", "add_", "sub", "sub_"}
MUL = {operator.mul, operator.imul, torch.mul}
MUL_METHODS = {"mul", "mul_"}
DIV = {operator.truediv, operator.itruediv, torch.div}
DIV_METHODS = {"div", "div_"}
CAT = {torch.cat, torch.concat, torch.concatenate}
SHAPE_QUERIES = {"size", "dim", "numel"}
CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
CONV_T = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


# -- one node ----------------------------------------------------------------------------------


def _shape(node: Any) -> tuple[int, ...] | None:
    meta = node.meta.get("tensor_meta") if isinstance(node, fx.Node) else None
    return tuple(meta.shape) if meta is not None and hasattr(meta, "shape") else None


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def step_node(
    node: fx.Node,
    env: dict[fx.Node, Value],
    modules: dict[str, nn.Module],
    walk: Walk,
    *,
    layer_rule: Callable[[nn.Module], Callable[..., Value] | None],
) -> Value:
    """The value of ``node`` (what its channels are) from its inputs' values; a module with
    parameters the element-wise, pooling and reshaping rules here do not cover is read by
    ``layer_rule`` (:func:`elaswave.prune.layers.rule_of`)."""

    def val(a: Any) -> Any:
        if isinstance(a, fx.Node):
            return env[a]
        if isinstance(a, (tuple, list)):
            return type(a)(val(x) for x in a)
        return None

    ins = [val(a) for a in (*node.args, *node.kwargs.values())]
    if node.op == "placeholder":
        return None
    if node.op == "output":
        walk.kill(*ins)
        return None
    if node.op == "get_attr":
        shape = _shape(node)
        return Param(str(node.target), shape) if shape is not None else None
    try:
        if node.op == "call_module":
            module = modules[str(node.target)]
            rule = _module_rule(module, layer_rule)
            if rule is not None:
                out = rule(node, module, val, walk)
                if next(module.parameters(), None) is None:
                    return out
                return _shared(walk, str(node.target), val(node.args[0]), out)
        else:
            rule = _function_rule(node)
            if rule is not None:
                return rule(node, val, walk)
    except (TypeError, ValueError, IndexError, KeyError):  # arguments a rule does not read
        walk.kill(*ins)
        return None
    if node.op == "call_method" and node.target in SHAPE_QUERIES:
        return None
    if node.op == "call_function" and node.target is getattr:
        return None
    walk.kill(*ins)
    return None


def _module_rule(
    m: nn.Module, layer_rule: Callable[[nn.Module], Callable[..., Value] | None]
) -> Callable[..., Value] | None:
    if isinstance(m, ZERO_MODULES):
        return lambda node, m, val, walk: _same(val(node.args[0]), zero=None)
    if isinstance(m, SHIFT_MODULES):
        return lambda node, m, val, walk: _same(val(node.args[0]), zero=False)
    for kind, spatial in POOL_MODULES.items():
        if isinstance(m, kind):
            return lambda node, m, val, walk: _pool(node, val(node.args[0]), spatial, walk)
    if isinstance(m, (nn.Flatten, nn.Unflatten)):
        return lambda node, m, val, walk: _reshape(node, val(node.args[0]), walk)
    return layer_rule(m)


def _function_rule(node: fx.Node) -> Callable[..., Value] | None:
    t, method = node.target, node.op == "call_method"
    first: Callable[[Callable[[Any], Any]], Any] = lambda val: val(node.args[0])  # noqa: E731
    if (method and t in ZERO_METHODS) or (not method and t in ZERO_FUNCTIONS):
        return lambda node, val, walk: _same(first(val), zero=None)
    if (method and t in SHIFT_METHODS) or (not method and t in SHIFT_FUNCTIONS):
        return lambda node, val, walk: _same(first(val), zero=False)
    if not method and t in POOL_FUNCTIONS:
        return lambda node, val, walk: _pool(node, first(val), POOL_FUNCTIONS[t], walk)
    if not method and t is F.interpolate:
        return lambda node, val, walk: _pool(node, first(val), len(_shape(node) or ()) - 2, walk)
    if (method and t in REDUCE_METHODS) or (not method and t in REDUCE_FUNCTIONS):
        return _reduce
    if (method and t in RESHAPE_METHODS) or (not method and t in RESHAPE_FUNCTIONS):
        return lambda node, val, walk: _reshape(node, first(val), walk)
    if (method and t in ("permute", "transpose")) or (
        not method and t in (torch.permute, torch.transpose)
    ):
        return _permute
    if method and t == "expand":
        return _expand
    if not method and t is operator.getitem:
        return _getitem
    if (method and t in ADD_METHODS) or (not method and t in ADD):
        return lambda node, val, walk: _combine(node, val, walk, "add")
    if (method and t in MUL_METHODS) or (not method and t in MUL):
        return lambda node, val, walk: _combine(node, val, walk, "mul")
    if (method and t in DIV_METHODS) or (not method and t in DIV):
        return lambda node, val, walk: _combine(node, val, walk, "div")
    if not method and t in CAT:
        return _cat
    return None


# -- the rules ---------------------------------------------------------------------------------


def _shared(walk: Walk, name: str, x: Value, out: Value) -> Value:
    """Module ``name`` (with parameters) read ``x`` and gave ``out``. Called again (its weights
    shared), its inputs' channels and its outputs' are the same columns and rows as at its
    first call: one space for each pair of runs, or no group where the runs do not line up."""
    if name not in walk.calls:
        walk.calls[name] = (x, out)
        return out
    for a, b in zip(walk.calls[name], (x, out), strict=True):
        if isinstance(a, Chan) and isinstance(b, Chan) and a.axis == b.axis:
            if _unify(a, b, walk, both=False) is None:
                walk.kill(a, b)
        elif isinstance(a, Chan) or isinstance(b, Chan):
            walk.kill(a, b)
    return out


def _same(v: Value, *, zero: bool | None) -> Value:
    """The same channels; ``zero`` False: a zero channel is no longer zero."""
    if not isinstance(v, Chan) or zero is None:
        return v if isinstance(v, Chan) else None
    return Chan(v.axis, tuple(Seg(s.space, s.channels, s.per, s.zero and zero) for s in v.segs))


def _pool(node: fx.Node, v: Value, spatial: int, walk: Walk) -> Value:
    """Per channel over the last ``spatial`` dimensions: the channel axis must come before."""
    if not isinstance(v, Chan):
        walk.kill(v)
        return None
    shape = _shape(node)
    if shape is None or v.axis != len(shape) - spatial - 1:
        walk.kill(v)
        return None
    return v


def _reduce(node: fx.Node, val: Callable[[Any], Any], walk: Walk) -> Value:
    """A mean or sum over other dimensions than the channels'."""
    v = val(node.args[0])
    source = _shape(node.args[0])
    dims = _arg(node, 1, "dim")
    keep = bool(_arg(node, 2, "keepdim", False))
    if not isinstance(v, Chan) or source is None or dims is None:
        walk.kill(v)
        return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not all(isinstance(d, int) for d in dims):
        walk.kill(v)
        return None
    dims = [d % len(source) for d in dims]
    if v.axis in dims:
        walk.kill(v)
        return None
    return Chan(v.axis if keep else v.axis - sum(d < v.axis for d in dims), v.segs)


def _reshape(node: fx.Node, v: Value, walk: Walk) -> Value:
    """A view: the channel axis kept whole, its leading dimensions regrouped at will and the
    dimensions right after it merged into it (channel-major: ``per`` grows); a parameter
    given or losing dimensions of one (:meth:`Param.view`)."""
    if isinstance(v, Param):
        source, shape = _shape(node.args[0]), _shape(node)
        view = v.view(source, shape) if source is not None and shape is not None else None
        if view is None:
            walk.kill(v)
        return view
    if not isinstance(v, Chan):
        walk.kill(v)
        return None
    source, shape = _shape(node.args[0]), _shape(node)
    if source is None or shape is None:
        walk.kill(v)
        return None
    found = reshaped_axis(source, shape, v.axis)
    if found is None:
        walk.kill(v)
        return None
    axis, grow = found
    return Chan(axis, tuple(Seg(s.space, s.channels * grow, s.per * grow, s.zero) for s in v.segs))


def reshaped_axis(
    source: tuple[int, ...], shape: tuple[int, ...], axis: int
) -> tuple[int, int] | None:
    """Where the channel axis ``axis`` of ``source`` lies in ``shape`` and how many elements
    each channel became, or None when the reshape splits or mixes the channels."""
    lead = math.prod(source[:axis])
    for b in range(len(shape)):
        if math.prod(shape[:b]) != lead:
            continue
        merged = source[axis]
        for r in range(axis + 1, len(source) + 1):
            if merged == shape[b]:
                return b, merged // source[axis]
            if r < len(source):
                merged *= source[r]
    return None


def _permute(node: fx.Node, val: Callable[[Any], Any], walk: Walk) -> Value:
    v = val(node.args[0])
    if not isinstance(v, Chan):
        walk.kill(v)
        return None
    ndim = len(_shape(node) or ())
    if node.target in ("transpose", torch.transpose):
        i, j = (int(d) % ndim for d in node.args[1:3])  # type: ignore[arg-type]
        order = list(range(ndim))
        order[i], order[j] = order[j], order[i]
    else:
        dims = node.args[1] if len(node.args) == 2 else node.args[1:]
        if (
            isinstance(dims, (tuple, list))
            and len(dims) == 1
            and isinstance(dims[0], (tuple, list))
        ):
            dims = dims[0]
        order = [int(d) % ndim for d in dims]  # type: ignore[union-attr, arg-type]
    return Chan(order.index(v.axis), v.segs)


def _expand(node: fx.Node, val: Callable[[Any], Any], walk: Walk) -> Value:
    v = val(node.args[0])
    grow = len(_shape(node) or ()) - len(_shape(node.args[0]) or ())
    if isinstance(v, Param):
        if v.dims:
            return Param(v.name, v.shape, 0, (None,) * grow + v.dims)
        return Param(v.name, v.shape, v.lead + grow)
    if isinstance(v, Chan):
        return Chan(v.axis + grow, v.segs)
    return None


def _getitem(node: fx.Node, val: Callable[[Any], Any], walk: Walk) -> Value:
    """An element of several outputs, or a tensor indexed by integers and slices that leave
    the channels whole."""
    v, index = val(node.args[0]), node.args[1]
    if isinstance(v, tuple) and isinstance(index, int):
        return v[index]
    if not isinstance(v, Chan):
        walk.kill(v)
        return None
    source = _shape(node.args[0])
    items = index if isinstance(index, tuple) else (index,)
    if source is None or any(isinstance(i, fx.Node) for i in items) or items.count(...) > 1:
        walk.kill(v)
        return None
    if ... in items:
        at = items.index(...)
        fill = len(source) - sum(i is not None for i in items if i is not ...)
        items = items[:at] + (slice(None),) * fill + items[at + 1 :]
    dim, out = 0, 0  # the source's dimension read next, and the result's
    for i in items:
        if i is None:
            out += 1
            continue
        if dim == v.axis:
            if not (isinstance(i, slice) and i == slice(None)):
                walk.kill(v)
                return None
            return Chan(out, v.segs)
        dim += 1
        out += 0 if isinstance(i, int) else 1
    return Chan(out + v.axis - dim, v.segs)


def _broadcast(value: Value, other: Any, node: fx.Node, axis: int) -> str:
    """What an operand without named channels is along the result's channel axis: ``scalar``
    (the same for every channel), ``full`` (one value per channel) or ``param``."""
    if isinstance(value, Param):
        return "param"
    shape = _shape(node) or ()
    ndim = len(shape)
    if not isinstance(other, fx.Node):
        return "scalar"
    its = _shape(other)
    if its is None:
        return "scalar"
    at = axis - (ndim - len(its))
    return "scalar" if at < 0 or its[at] == 1 else "full"


def _combine(node: fx.Node, val: Callable[[Any], Any], walk: Walk, kind: str) -> Value:
    """An element-wise add (sub), multiply or divide of two operands."""
    a, b = node.args[0], _arg(node, 1, "other")
    va, vb = val(a), val(b)
    if not isinstance(va, Chan) and isinstance(vb, Chan) and kind != "div":
        a, b, va, vb = b, a, vb, va
    if not isinstance(va, Chan):
        walk.kill(va, vb)
        return None
    ndim = len(_shape(node) or ())
    axis = va.axis + ndim - len(_shape(a) or ())
    if isinstance(vb, Chan):
        if kind == "div" or vb.axis + ndim - len(_shape(b) or ()) != axis:
            walk.kill(va, vb)
            return None
        segs = _unify(va, vb, walk, both=kind == "mul")
        if segs is None:
            walk.kill(va, vb)
            return None
        return Chan(axis, segs)
    what = _broadcast(vb, b, node, axis)
    if what == "param" and kind != "div":
        assert isinstance(vb, Param)
        at = vb.axis_of(axis, ndim)
        size = vb.shape[at] if at is not None else 1
        if size == va.channels:
            walk.ref(Chan(axis, va.segs), vb.name, at)  # type: ignore[arg-type]
            return _same(Chan(axis, va.segs), zero=None) if kind == "add" else _zeroed(va, axis)
        what = "scalar" if size == 1 else "full"
    if what == "full" or (what == "param" and kind == "div"):
        walk.kill(va, vb)
        return None
    if kind == "add":  # a zero channel plus something is no longer zero
        return _same(Chan(axis, va.segs), zero=False)
    return Chan(axis, va.segs)


def _zeroed(v: Chan, axis: int) -> Chan:
    """``v``'s channels, each zero when its group is (scaled by a member)."""
    return Chan(axis, tuple(Seg(s.space, s.channels, s.per, s.space is not None) for s in v.segs))


def _unify(a: Chan, b: Chan, walk: Walk, *, both: bool) -> tuple[Seg, ...] | None:
    """One space for each pair of runs of ``a`` and ``b`` (their channels are removed
    together); None where the runs do not line up. ``both``: a channel is zero when either
    operand's is (a product), else when both are (a sum)."""
    if len(a.segs) != len(b.segs):
        return None
    out = []
    for x, y in zip(a.segs, b.segs, strict=True):
        if x.channels != y.channels or x.per != y.per or (x.space is None) != (y.space is None):
            return None
        if x.space is None or y.space is None:
            out.append(Seg(None, x.channels, x.per, False))
            continue
        if walk.sizes[walk.find(x.space)] != walk.sizes[walk.find(y.space)]:
            return None
        zero = (x.zero or y.zero) if both else (x.zero and y.zero)
        out.append(Seg(walk.union(x.space, y.space), x.channels, x.per, zero))
    return tuple(out)


def _cat(node: fx.Node, val: Callable[[Any], Any], walk: Walk) -> Value:
    """A concatenation: along the channels, each input's runs at its offset (inputs without
    named channels become runs the walk cannot name); along another axis, one space for the
    inputs' channels (a parameter such as a class token joins it)."""
    items = list(node.args[0])  # type: ignore[arg-type]
    dim = int(_arg(node, 1, "dim", 0))
    shape = _shape(node)
    if shape is None:
        walk.kill(*[val(i) for i in items])
        return None
    dim %= len(shape)
    values = [val(i) for i in items]
    chans = [v for v in values if isinstance(v, Chan)]
    if not chans:
        walk.kill(*values)
        return None
    if any(isinstance(v, Chan) and v.axis != chans[0].axis for v in values):
        walk.kill(*values)
        return None
    axis = chans[0].axis
    if dim == axis:
        segs: list[Seg] = []
        for item, v in zip(items, values, strict=True):
            if isinstance(v, Chan):
                segs += v.segs
            elif isinstance(v, Param):
                walk.kill(*values)
                return None
            else:
                segs.append(Seg(None, (_shape(item) or shape)[axis], Fraction(1), False))
        return Chan(axis, tuple(segs))
    joined: Chan | None = None
    for v in values:
        if isinstance(v, Chan):
            joined = v if joined is None else _or_kill(joined, v, walk)
            if joined is None:
                walk.kill(*values)
                return None
    assert joined is not None
    for v in values:
        if isinstance(v, Param):
            at = v.axis_of(axis, len(shape))
            if at is None or v.shape[at] != joined.channels:
                walk.kill(*values)
                return None
            walk.ref(joined, v.name, at)
        elif not isinstance(v, Chan):
            walk.kill(*values)
            return None
    return joined


def _or_kill(a: Chan, b: Chan, walk: Walk) -> Chan | None:
    segs = _unify(a, b, walk, both=False)
    return Chan(a.axis, segs) if segs is not None else None


# -- shared with the module rules --------------------------------------------------------------


def block_units(per: Fraction, channels: int) -> int:
    """The fewest units of ``per`` channels each whose channels are a multiple of
    ``channels``."""
    whole = channels * per.denominator
    return whole // math.gcd(whole, per.numerator)


def aligned(chan: Chan, channels: int) -> bool:
    """Whether every run of ``chan`` starts and ends on a multiple of ``channels``."""
    return all(at % channels == 0 and s.channels % channels == 0 for at, s in chan.offsets())


def add_site(walk: Walk, module: str, kind: str, chan: Chan) -> None:
    walk.sites.append(Site(module, kind, chan))
