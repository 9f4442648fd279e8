"""A plain ``nn.Module`` cut into the ordered layers the runtime trains (:mod:`.module`).

The module's forward is traced with ``torch.fx``. Its layers are consecutive stretches of the
traced graph, each a :class:`torch.fx.GraphModule` that holds the original submodules under their
own names (so ``layer1.0.conv1.weight`` stays ``layer1.0.conv1.weight``). A cut is valid only
where the graph is a *chain*: each stretch reads nothing from before it but the one value the
stretch before it returns (the first reads only the input), and the last one returns the output.

- ``split: ["auto"]``: one stretch per top-level child, in call order, when each child is called
  in one run (ResNet, VGG, ConvNeXt, ViT); a child without trainable parameters (an activation,
  a pooling) joins the stretch before it. Anything else (the forward does not trace, a child is
  called again later, a skip connection across children, several inputs or outputs) is one
  layer: the module itself, untraced.
- ``split: [names]``: a stretch starts at the first call of each named module. A name that is
  no module, a module never called, or a cut the chain does not allow is an error naming it.

Parameters reached from several stretches (a tied embedding, a shared module) are found here,
by identity: each stretch gets its own copy, and :attr:`Cut.tied` pairs them.
"""

from __future__ import annotations

import copy
import inspect
from collections import defaultdict
from dataclasses import dataclass, field

import torch.fx as fx
from torch import nn

from elaswave.errors import ConfigError, one_line

__all__ = ["Cut", "cut_module"]

AUTO = ["auto"]


@dataclass
class Cut:
    """The layers of a module (sharing its submodules and parameters), the pairs of parameters
    of different layers that are one tensor, and why it is one layer when auto could not cut."""

    layers: list[nn.Module]
    tied: list[tuple[tuple[int, str], tuple[int, str]]] = field(default_factory=list)
    whole_because: str = ""


def cut_module(model: nn.Module, split: list[str]) -> Cut:
    """Cut ``model`` as ``split`` says (see the module docstring). A copy is traced: a forward
    that assigns to its module's attributes (``self.seen += n``) leaves proxies there when traced,
    and a model that is not cut trains whole, as it was built."""
    auto = split == AUTO
    traced = copy.deepcopy(model)
    try:
        gm = fx.symbolic_trace(traced, concrete_args=_defaults(traced))
        if _mode_dependent(traced, gm):
            why = "its forward traces differently in train and eval mode"
            if auto:
                return Cut([model], whole_because=why)
            raise ConfigError(f"model.split: cannot cut the model: {why}")
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure to trace means: not cut
        if auto:
            return Cut([model], whole_because=f"its forward does not trace ({one_line(exc)})")
        raise ConfigError(
            f"model.split: the model's forward does not trace: {one_line(exc)}"
        ) from None
    _drop_fixed(gm)
    body = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output", "get_attr")]
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) != 1:
        return _whole_or_fail(model, auto, f"its forward takes {len(inputs)} inputs, not one")
    if auto:
        starts, why = _auto_starts(gm, body)
        if why:
            return Cut([model], whole_because=why)
    else:
        starts = _named_starts(model, body, split)
    segments = [body[a:b] for a, b in zip(starts, [*starts[1:], len(body)], strict=True)]
    segments = [s for s in segments if s]
    if auto:
        segments = _merge_parameterless(gm, segments)
    if len(segments) <= 1:
        return _whole_or_fail(model, auto, "it has one top-level child")
    outs, why = _chain(inputs[0], segments, gm)
    if why:
        return _whole_or_fail(model, auto, why)
    layers = [
        _stretch(gm, seg, inputs[0] if k == 0 else outs[k - 1], value_out=outs[k], k=k)
        for k, seg in enumerate(segments)
    ]
    return Cut(layers, tied=_ties(layers))


def _mode_dependent(model: nn.Module, gm: fx.GraphModule) -> bool:
    """Whether the forward branches on ``self.training`` in code the tracer runs through (a
    functional dropout, stochastic depth): the traced graph fixes one mode's branch for good,
    so the model is traced in the other mode too and the two graphs compared."""
    mode = model.training
    try:
        other = fx.symbolic_trace(model.train(not mode), concrete_args=_defaults(model))
    finally:
        model.train(mode)
    return bool(other.code != gm.code)


def _defaults(model: nn.Module) -> dict[str, object]:
    """The forward's arguments after the first that have defaults, fixed at them: the model is
    called with its input alone (an optional mask stays None)."""
    params = list(inspect.signature(model.forward).parameters.values())[1:]
    return {
        p.name: p.default
        for p in params
        if p.default is not inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }


def _drop_fixed(gm: fx.GraphModule) -> None:
    """Remove the placeholders of the arguments fixed at their defaults (after the first), with
    the checks the tracer adds that they keep them."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"][1:]:
        below, todo = {node}, [node]
        while todo:
            for user in todo.pop().users:
                if user not in below:
                    below.add(user)
                    todo.append(user)
        if all(u in below for n in below for u in n.users) and all(
            n.op != "output" for n in below
        ):  # only the tracer's checks read it: they go with it
            for n in sorted(below, key=order.__getitem__, reverse=True):
                gm.graph.erase_node(n)
    gm.recompile()


def _auto_starts(gm: fx.GraphModule, body: list[fx.Node]) -> tuple[list[int], str]:
    """Where each top-level child's calls begin, or why the children are not a chain."""
    starts: list[int] = []
    seen: list[str] = []
    for i, node in enumerate(body):
        paths = _paths(node)
        if not paths:
            continue  # an operation of the forward itself: it joins the stretch it runs in
        child = paths[0].split(".")[0]
        if seen and child == seen[-1]:
            continue
        if child in seen:
            return [], f"its child {child!r} is called again after {seen[-1]!r}"
        seen.append(child)
        starts.append(i)
    if not starts:
        return [], "its forward calls no child module"
    starts[0] = 0  # what runs before the first child belongs to the first layer
    return starts, ""


def _named_starts(model: nn.Module, body: list[fx.Node], split: list[str]) -> list[int]:
    names = dict(model.named_modules())
    starts = [0]
    for name in split:
        if name not in names or not name:
            top = ", ".join(n for n, _ in model.named_children())
            raise ConfigError(
                f"model.split: the model has no module {name!r} (its children: {top})"
            )
        at = next(
            (i for i, n in enumerate(body) if any(_within(p, name) for p in _paths(n))),
            None,
        )
        if at is None:
            raise ConfigError(f"model.split: module {name!r} is never called by the forward")
        if at <= starts[-1] and at != 0:
            raise ConfigError(f"model.split: module {name!r} runs before the one named before it")
        if at != 0:
            starts.append(at)
    return starts


def _paths(node: fx.Node) -> list[str]:
    """The modules a node runs inside, outermost first (the tracer records them for the
    operations of the modules it traces through; a module call is inside itself)."""
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) if isinstance(v, tuple) else str(k).split("@")[0] for k, v in stack.items()]
    if node.op == "call_module" and not paths:
        paths = [str(node.target)]
    return paths


def _within(target: object, name: str) -> bool:
    t = str(target)
    return t == name or t.startswith(name + ".")


def _merge_parameterless(gm: fx.GraphModule, segments: list[list[fx.Node]]) -> list[list[fx.Node]]:
    """Stretches without trainable parameters join the one before them (the first: after)."""
    out: list[list[fx.Node]] = []
    carry: list[fx.Node] = []
    for seg in segments:
        if not _has_params(gm, seg):
            if out:
                out[-1] = out[-1] + seg
            else:
                carry += seg
            continue
        out.append(carry + seg)
        carry = []
    if carry:
        out.append(carry)
    return out


def _has_params(gm: fx.GraphModule, seg: list[fx.Node]) -> bool:
    for node in seg:
        if node.op == "call_module":
            mod = gm.get_submodule(str(node.target))
            if any(p.requires_grad for p in mod.parameters()):
                return True
        for a in node.all_input_nodes:
            if a.op == "get_attr" and isinstance(_attr(gm, str(a.target)), nn.Parameter):
                return True
    return False


def _chain(
    x: fx.Node, segments: list[list[fx.Node]], gm: fx.GraphModule
) -> tuple[list[fx.Node], str]:
    """The value each stretch hands on (its last node that a later stretch or the output
    reads), or why the stretches are not a chain."""
    seg_of = {n: k for k, seg in enumerate(segments) for n in seg}
    output = next(n for n in gm.graph.nodes if n.op == "output")
    result = output.args[0]
    if not isinstance(result, fx.Node) or seg_of.get(result) != len(segments) - 1:
        return [], "its forward does not return one tensor computed by its last layer"
    outs: list[fx.Node | None] = [None] * len(segments)
    outs[-1] = result
    for k, seg in enumerate(segments):
        external = {
            a for n in seg for a in n.all_input_nodes
            if a.op != "get_attr" and seg_of.get(a) != k
        }  # fmt: skip
        if k == 0:
            if external - {x}:
                return [], "its first layer reads values from nowhere"
            continue
        if x in external:
            return [], f"layer {k} ({_name(seg)}) reads the model's input too"
        if len(external) != 1:
            names = ", ".join(sorted(str(a.name) for a in external))
            return (
                [],
                f"layer {k} ({_name(seg)}) reads {len(external)} values from before it: {names}",
            )
        (value,) = external
        if seg_of.get(value) != k - 1:
            return [], f"layer {k} ({_name(seg)}) reads a value from before the layer before it"
        outs[k - 1] = value
    return [o for o in outs if o is not None], ""


def _name(seg: list[fx.Node]) -> str:
    first = next((n for n in seg if n.op == "call_module"), seg[0])
    return str(first.target)


def _stretch(
    gm: fx.GraphModule, seg: list[fx.Node], value_in: fx.Node, *, value_out: fx.Node, k: int
) -> nn.Module:
    """One layer: the stretch's nodes in a graph of their own, from one input to one output,
    over the traced module's submodules and attributes (kept under their names)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {value_in: g.placeholder("x")}
    for node in seg:
        for a in node.all_input_nodes:
            if a.op == "get_attr" and a not in env:
                env[a] = g.node_copy(a, lambda m: env[m])
        env[node] = g.node_copy(node, lambda m: env[m])
    g.output(env[value_out])
    return fx.GraphModule(gm, g, class_name=f"Layer{k}")


def _ties(layers: list[nn.Module]) -> list[tuple[tuple[int, str], tuple[int, str]]]:
    where: dict[int, list[tuple[int, str]]] = defaultdict(list)
    for k, layer in enumerate(layers):
        for name, p in layer.named_parameters():
            if p.requires_grad:
                where[id(p)].append((k, name))
    pairs = []
    for refs in where.values():
        for other in refs[1:]:
            if other[0] != refs[0][0]:
                pairs.append((refs[0], other))
    return pairs


def _attr(gm: fx.GraphModule, target: str) -> object:
    obj: object = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _whole_or_fail(model: nn.Module, auto: bool, why: str) -> Cut:
    if auto:
        return Cut([model], whole_because=why)
    raise ConfigError(f"model.split: cannot cut the model there: {why}")
